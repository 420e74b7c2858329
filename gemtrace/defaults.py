"""Defaults: the one home of paths, ports and intervals that more than one part of gemtrace uses.

Values that the gate (C) also needs are defined in its headers (hook/gemtrace_contract.h) and reach
Python through gemtrace.contract, generated from them; the few that the agent's modules take from
here are named below, never copied.
"""

from pathlib import Path

from gemtrace import contract

CONFIG_PATH = Path("/etc/gemtrace/resource.conf")
STATE_DIR = Path(contract.DEFAULT_STATE_DIR)
LISTEN = "127.0.0.1:9843"
# `gemtrace kube-extender`: on each control-plane host, where kube-scheduler reaches it on loopback
# (deploy/scheduler-extender.yaml; deploy/kube-scheduler/config.yaml's urlPrefix names the same port).
EXTENDER_PORT = 9844
EXTENDER_LISTEN = f"127.0.0.1:{EXTENDER_PORT}"
# A listen address or a metrics source that names a unix socket: the agent serves /metrics there, top reads it.
UNIX_PREFIX = "unix:"
# Where packaging/deb/build.sh installs the gate and the BPF sources.
GATE_INSTALLED = Path("/usr/lib/gemtrace/libgemgate.so")
BPF_INSTALLED = Path("/usr/share/gemtrace/bpf")

ENV_GROUP = contract.ENV_GROUP
ENV_STATE_DIR = contract.ENV_STATE_DIR
DEFAULT_GROUP = contract.DEFAULT_GROUP
# The job `gemtrace run` names for everything it starts (gemtrace/agent/membership.py's job_of: gang turns).
ENV_JOB = "GEMTRACE_JOB"

# The MPS control daemon's program for groups with Isolation=mps (gemtrace/mps.py): a name found in PATH.
MPS_CONTROL = "nvidia-cuda-mps-control"

# The BPF probes' modes (what each attaches: gemtrace.sources.ebpf.probes; their cost: docs/accounting.md).
PROBE_MODES = ("memory", "launches")
PROBE_MODE = "memory"

# The agent's loop period: heartbeat, dead-process reaping (< 100 ms promised), region reading.
TICK_SECONDS = 0.010
# The keeper's period while no gate asked for a slot in the last second (it then ticks every
# TICK_SECONDS: a new gate waits for its group, GT_ASSIGN_WAIT_NS): the heartbeat (gates take the
# agent for gone after GT_HEARTBEAT_STALE_NS, 2 s) and the membership's pass over live slots.
KEEPER_IDLE_SECONDS = 0.250
CONFIG_POLL_SECONDS = 1.0
LIBCUDA_RESCAN_SECONDS = 1.0

# Oversubscription (docs/gate.md): the share of the host's memory (MemTotal) that the managed memory
# of all gated processes together may take. Managed pages evicted from a GPU live in host memory; the
# rest of it stays for the programs themselves (data loaders, pinned buffers, the page cache).
MANAGED_HOST_SHARE = 0.5
