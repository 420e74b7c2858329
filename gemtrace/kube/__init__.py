"""gemtrace on Kubernetes: GPU shares as pod resources, the gate injected into containers, pods' names.

    shares.py        the extended resources, their devices and units, and the group a grant makes (pure)
    injection.py     what a container gets to be gated: the gate, the state dir, /etc/ld.so.preload
    placer.py        which GPUs a container's share goes to, decided once for both resources
    rooms.py         each GPU's free room as its node's annotation: the plugin writes it, the extender reads it
    deviceplugin.py  `gemtrace kube-plugin`: the kubelet's device plugin API (v1beta1) for both resources
    grants.py        the drop-in resource files of the pods that hold shares, rebuilt from PodResources
    kubelet.py       the kubelet's sockets: registration, PodResources, the apiserver's pods of this node
    shapes.py        Kubernetes objects' JSON read without trusting its shape (the webhook's and the extender's)
    webhook.py       `gemtrace kube-webhook`: the mutating admission webhook for pods labelled with a group
    extender.py      `gemtrace kube-extender`: the kube-scheduler extender that checks each GPU's room
    pods.py          a process's pod and container from its cgroup path (metrics labels)

The agent itself knows nothing of Kubernetes: a pod's group is one more group of the resource file
(a drop-in), and a pod's processes join it through GEMTRACE_GROUP or a Cgroup rule. docs/kubernetes.md
tells the whole story.
"""
