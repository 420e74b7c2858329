"""The agent: the privileged daemon, one per host, that owns the region, schedules each GPU and accounts every
process. `gemtrace agent` (gemtrace/cli.py) builds an Agent (agent.py) and serves its /metrics (exporter.py).

It takes from the rest of gemtrace what it shares with the gates and `gemtrace run` (the region, the resource
file, the header's constants, the GPUs' listing, MPS) and the sources it opens (gemtrace/sources/); it never
imports gemtrace/run/, and nothing outside it but the command line imports it (tests/test_import_graph.py holds
both). Its parts, in this order: the lifecycle, its state dir and each process's group; each GPU's scheduling;
the accounting and the memory enforcement that acts on it; /metrics.
    agent.py         the agent's lifecycle and loop: heartbeat, reaping dead slots, reloads, shutdown
    state_dir.py     the agent's state dir, checked to be its own before anything is written there
    membership.py    each gated process's group, decided once by the agent (admission, Cgroup rules)
    policy.py        the time-share policy of one GPU: pure, driven by a clock it is given
    scheduler_loop.py  when each GPU looks: one thread for all, asleep on their doorbells (futex_waitv)
    scheduler.py     one GPU's adapter between the region's slots and the policy (futex words)
    gang.py          the turns of groups that span GPUs, shared by every GPU's scheduler
    accounting.py    the merge of the sources it is given (agent.py opens them), kept across polls: GPU time
                     shared within groups, NVML's time integrated; over the three modules below
    process_facts.py each process's facts (group, GPUs, start time) kept while it lives; the sources' Devices
    inherited.py     the memory eBPF never saw, rebuilt for processes older than their probes
    verified.py      the verified memory and the trust the accounting writes to the region (issue 25)
    gpu_time.py      GPU time within a group: its processes never get more than the group (pure)
    snapshot.py      a poll's per-process view (Snapshot): what the accounting publishes, the rest reads
    merge.py         the best figure of each process: docs/accounting.md's table, a function a row
    enforcement.py   memory enforcement: which process dies when a group is over its MemoryLimit
    collectors/      the Prometheus collectors, one module each, registered by Agent.metrics_registry:
      agent.py         the agent itself: version, reloads, refused requests, its GPUs (an AgentView)
      groups.py        groups' quotas and what the scheduler gave them, their memory (a GroupsView)
      processes.py     per-process series from the accounting's snapshot
      enforcement.py   OOM kills, quota breaches and slot tampering, per group
      attach.py        the gates' socket: refused and failed attaches per user, who holds the slot chunks
    exporter.py      the /metrics HTTP endpoint over the collectors' registry
    web_config.py    who may read /metrics: TLS and basic auth from a node_exporter-style web config
"""
