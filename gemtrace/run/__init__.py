"""`gemtrace run`: the user's side, everything between the command line and exec'ing CMD with the gate preloaded.

It runs as the user, once per command, and never talks to the agent: it reads the agent's region and the resource
file, and leaves the rest to the gate. From the rest of gemtrace it takes only what both sides share (the region,
the resource file, the header's constants, the GPUs' listing, MPS's client variables); the agent never imports it
(tests/test_import_graph.py holds both). Kubernetes' device plugin (gemtrace/kube/) places GPUs with placement.py.
Each module imports only those listed before it:
    placement.py     which GPUs a `run --gpus N` gets: topology as data, the policies (pure)
    framework_env.py the memory share frameworks are told, from the group's MemoryLimit (pure)
    topology.py      the NVML adapter behind placement.py: PCIe and NVLink between GPUs
    allotment.py     what a run is allotted besides its group: GPUs, memory share
    cache_release.py whether a run empties PyTorch's cache while its group is held, and how
    launcher.py      CMD's environment with the gate preloaded, then exec
    torch_hook/      the cache release's hook, run in the user's interpreter (stdlib only): sitecustomize, watcher
                     (cache_release.py puts this directory first on CMD's PYTHONPATH)
"""
