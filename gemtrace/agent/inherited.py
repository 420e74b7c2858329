"""Memory eBPF never saw: what an inherited process allocated before its libcuda was probed.

eBPF cannot know what a process allocated before its libcuda was probed (an agent restart, a
container's copy found late): for such an inherited process the memory is rebuilt from its gate's
slot or, ungated, NVML less the context overhead (merge.rebuilt, merge.context_overhead), at start
and whenever one is first seen. Owns what that keeps across looks: each GPU's context overhead,
which processes hold rebuilt memory, eBPF's late pids at the last look. Never reads a source (the
accounting hands it the readings) and never kills: it wakes the enforcer when a process is first
found holding rebuilt memory.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from gemtrace.agent import merge
from gemtrace.agent.process_facts import ProcessFacts, Rules, inherited
from gemtrace.sources import Key, SourceReading

log = structlog.get_logger("gemtrace.accounting")


class InheritedMemory:
    def __init__(self, facts: ProcessFacts, wake: Callable[[], None]) -> None:
        """`wake`: the enforcer checks every limit now (eBPF's nudge)."""
        self.facts = facts
        self.wake = wake
        self.holding: set[int] = set()  # inherited processes with rebuilt memory, last look
        self._due = True  # nothing rebuilt yet: the first look rebuilds
        self._missed: frozenset[int] = frozenset()  # eBPF's late pids at the last look
        self._context_bytes: dict[str, int] = {}  # per GPU: NVML's per-process figure less the true one

    def due(self, ebpf: SourceReading) -> bool:
        """Whether a look at the enforcer's figures must rebuild (the slots and NVML read, not only eBPF)."""
        return self._due or bool(self.holding) or bool(ebpf.missed - self._missed)

    def rebuild(self, rules: Rules | None, ebpf: SourceReading, gate: SourceReading,
                nvml: SourceReading) -> dict[Key, int]:
        """Memory of the live inherited processes by (pid, GPU UUID) (merge.rebuilt); learns each GPU's
        context overhead on the way (merge.context_overhead). Logs `memory_rebuilt` and wakes the
        enforcer for a process first found holding rebuilt memory."""
        reused = set()
        for pid, start in gate.start_times.items():
            facts = self.facts.of(pid, rules)
            if facts is not None and start and facts.start_time is not None and start != facts.start_time:
                reused.add(pid)  # a reused pid: the slot is a dead process's, left for the agent to free
        candidates = {pid for (pid, _), s in gate.figures.items() if s.placed and s.memory and pid not in reused}
        candidates |= {pid for pid, _ in nvml.figures if pid not in gate.start_times}
        found = set()
        for pid in candidates:
            facts = self.facts.of(pid, rules)
            if (facts is not None and self.facts.proc.alive(pid)
                    and inherited(pid, facts, ebpf.missed, ebpf.since_ticks)):
                found.add(pid)
        self._context_bytes.update(merge.context_overhead(gate, nvml, ebpf, found, reused))
        keys = {key for key, s in gate.figures.items() if s.placed} | nvml.figures.keys()
        out = merge.rebuilt(keys, gate, nvml, found, reused, self._context_bytes)
        holding = {pid for (pid, _), used in out.items() if used > 0}
        new = holding - self.holding
        if new:
            log.info("memory_rebuilt", pids=sorted(new)[:20],
                     bytes={f"{pid}/{uuid}": used for (pid, uuid), used in sorted(out.items()) if pid in new})
            self.wake()  # the watcher enforces on them at once
        self.holding = holding
        self._due = False
        self._missed = ebpf.missed
        return out
