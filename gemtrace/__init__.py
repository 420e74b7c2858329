"""gemtrace: share NVIDIA GPUs between groups of processes with quotas, and show who uses what.

The package, one module per concern: what the .deb ships (packaging/deb/build.sh copies all of it), the agent and
the user's commands (run, status, top). The gate itself is C, in hook/; BPF programs are in bpf/. What only a checkout
uses is outside: dev/ (`make demo`, the dashboards' generator), simgpu/ (the simulated GPU), tests/, bench/.
    cli.py           the `gemtrace` command: argument parsing, errors as one line and an exit status
    agent/           the agent daemon: its lifecycle, loop and state dir, each GPU's scheduling, the
                     accounting of what sources/ (below) report, memory enforcement, /metrics
                     (agent/__init__.py has its map)
    config.py        the resource file: reading, parsing (pure), validating, watching for changes
    defaults.py      paths, ports and intervals that more than one part uses
    contract.py      the C headers' constants (env names, limits, magics, BPF event types): generated
                     by `make` from hook/gemtrace_contract.h, hook/gemtrace_region.h, bpf/gemtrace_cuda.h
    region/          what the agent shares with the gates (hook/gemtrace_region.h), listed bottom-up, each file
                     importing only those listed before it; `from gemtrace import region as rg` gives rg.Region:
      layout.py        ctypes mirror of hook/gemtrace_region.h (the region and the slots), checks of a read-back
      chunks.py        the slot table's memory: per-user chunks, sealed memfds in one reserved range
      slots.py         SlotColumns: the slots' counters read as columns
      futex.py         futex waits and wakes on words shared with the gates
      doorbells.py     the page of per-GPU futex words that gates ring when a wait is news
      server.py        the attach socket where gates get their slots, fair per user (SO_PEERCRED)
      region.py        Region: the region file and the slot table mapped, created or adopted, and their care
    mps.py           the MPS control daemons of the GPUs that Isolation=mps groups use, and their
                     clients' variables, which `gemtrace run` sets (so it sits here, shared)
    sources/         what each source knows of each process's GPU use, behind one interface (__init__.py):
      ebpf/            uprobes on every libcuda file: which files processes map (libcuda.py), bcc
                       (probes.py), the rescans and the ring-buffer thread (source.py)
      gate.py          the gates' slots, through region.SlotColumns
      nvml.py          NVML's per-process memory and device utilisation (pynvml, as gpus.py binds it)
    groups_of.py     the group of a process and the GPUs it sees, from /proc (pure parsers)
    gpus.py          the host's GPUs from NVML (index, UUID, name, memory), read at agent start; nvml():
                     NVML's one binding (pynvml), initialised
    metrics.py       the one catalogue of metric names, types, units, labels and help texts; family()
    httpd.py         the HTTP server behind /metrics and the webhook: slow clients hold no worker
    eventlog.py      structlog configured once: JSON lines, or key-values on a terminal
    signals.py       a daemon's signals, taken by its main loop rather than acted on in a handler
    run/             `gemtrace run`, the user's side: CMD's environment with the gate preloaded, then exec; the GPUs
                     and memory share it is allotted; PyTorch's cache release (run/__init__.py has its map)
    top.py           `gemtrace top`: the live terminal view, from the agent's /metrics
    status.py        `gemtrace status`: one frame of top's view, or JSON
    kube/            gemtrace on Kubernetes: the device plugin, the webhook, the gate injected into
                     containers, pods' names for the metrics (kube/__init__.py has its map)
"""

__version__ = "0.1.0"
