"""Fixtures every test module may use without importing them (pytest finds them here).

simgpu, simgpu_factory: a private simulated GPU (see simgpu_env.py for the API).
host: a real agent on a private simulated GPU, and `gemtrace run` (see agent_host.py).
k8s_cluster: a one-node Kubernetes cluster for the whole session (see k8s_cluster.py).
"""

from agent_host import host  # noqa: F401
from k8s_cluster import k8s_cluster  # noqa: F401
from simgpu_env import simgpu, simgpu_factory  # noqa: F401
