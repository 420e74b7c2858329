"""gemtrace: share NVIDIA GPUs between groups of processes with quotas, and show who uses what.

The stack, top to bottom:
    cli.py        command line (agent, run, check-config, status, top)
    agent.py      the agent's main loop: wires config, region, scheduler, probes, exporter
    config.py     the resource file (parse, validate, reload)
    scheduler.py  per-GPU time-share policy (pure) driving region control words
    region.py     ctypes mirror of hook/gemtrace_region.h (the gates' shared memory)
    probes/       eBPF uprobes on libcuda (bpf/*.c) and NVML readers
    accounting.py per-process / per-group figures, kept across polls
    sources/      eBPF, the gates' slots and NVML behind one interface (each with a fake)
    merge.py      the best figure of each process (docs/accounting.md's table, row by row)
    enforcement.py memory-quota OOM killer
    exporter.py   /metrics; collectors/ read narrow views; metrics.py is the one catalogue of metric names
"""

__version__ = "0.1.0"
