"""A poll's per-process view: what the accounting publishes, and the collectors and enforcement read.

Plain frozen data, importing nothing of gemtrace: the accounting (gemtrace/agent/accounting.py) makes a
Snapshot from its sources every poll; gemtrace/agent/enforcement.py audits it and the collectors export it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessAccount:
    pid: int
    comm: str
    group: str
    gpu: str  # UUID
    memory_bytes: int
    gpu_seconds: float
    launches: int | None  # None: not known (ungated process, launches not probed)
    gated: bool
    managed_bytes: int = 0  # managed memory (Oversubscribe), apart from memory_bytes


@dataclass(frozen=True)
class Snapshot:
    taken_ns: int
    processes: tuple[ProcessAccount, ...]

    def group_memory(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = {}
        for p in self.processes:
            key = (p.gpu, p.group)
            out[key] = out.get(key, 0) + p.memory_bytes
        return out

    def group_managed(self) -> dict[tuple[str, str], int]:
        """(GPU UUID, group) -> managed memory of its live processes, for every pair group_memory has."""
        out: dict[tuple[str, str], int] = {}
        for p in self.processes:
            key = (p.gpu, p.group)
            out[key] = out.get(key, 0) + p.managed_bytes
        return out
