"""Defaults: the one home of paths, ports and intervals that more than one part of gemtrace uses.

Values that the gate (C) also needs live in hook/gemtrace_region.h and are read from there through
gemtrace.region; do not copy them here.
"""

from pathlib import Path

CONFIG_PATH = Path("/etc/gemtrace/resource.conf")
STATE_DIR = Path("/run/gemtrace")
LISTEN = "127.0.0.1:9843"
GATE_INSTALLED = Path("/usr/lib/gemtrace/libgemgate.so")
BPF_INSTALLED = Path("/usr/share/gemtrace/bpf")

ENV_GROUP = "GEMTRACE_GROUP"
ENV_STATE_DIR = "GEMTRACE_STATE_DIR"
DEFAULT_GROUP = "default"

# The agent's loop period: heartbeat, dead-process reaping (< 100 ms promised), region reading.
TICK_SECONDS = 0.010
CONFIG_POLL_SECONDS = 1.0
LIBCUDA_RESCAN_SECONDS = 1.0
PROCESS_SERIES_GRACE_SECONDS = 60.0

# Oversubscription (docs/gate.md): the share of the host's memory (MemTotal) that the managed memory
# of all gated processes together may take. Managed pages evicted from a GPU live in host memory; the
# rest of it stays for the programs themselves (data loaders, pinned buffers, the page cache).
MANAGED_HOST_SHARE = 0.5
