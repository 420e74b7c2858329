"""Memory enforcement: a group over its MemoryLimit on a GPU is brought back under it by SIGKILL.

Owns the decision (which process dies) and its bookkeeping (counters, log events). The victim is
chosen among the processes of the users (uids) who made the group go over, never a process of
another user while one of theirs is alive (docs/accounting.md, "Who is killed"):

- If the group's gated processes together are within the limit, the gate held them to it, and what
  took the group over is the memory of its ungated processes: their uids made it go over.
- Otherwise (the gates' own sum is over: a reload lowered the limit, a slot was tampered with,
  memory was rebuilt after an agent restart), the uids whose processes allocated since the group was
  last seen within its limit on that GPU did; if none did, every uid.

Among those uids' processes the one that allocated last on that GPU dies first, then the next-latest,
until what the group would hold without the processes already killed is within the limit; only then
the other uids' processes, in the same order. In a group of one user this is the order it always
was. A process whose last allocation is not known (it allocated before the agent started: its memory
was rebuilt from its slot or NVML) counts as the oldest; among equals an ungated process goes first
(the gate held the gated one to the limit, nothing held the other), then the bigger (fewer die).
A process outside the group is never a candidate. A killed process keeps its memory until it has
exited, so it stays `pending` and is not counted twice. The figures come from eBPF
(gemtrace.agent.accounting), so a process without the gate is held to the limit too. Pure apart from the
injected `kill`; called on every allocation event.

Enforcement is how it is wired: a subscriber of the accounting, woken by eBPF's allocation events
(the OOM killer's path: it reads eBPF's memory alone, through `holdings`) and handed every merged
snapshot (the audit of the slots: tampering). It reads no source itself and never merges.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from gemtrace.agent.merge import Merged
    from gemtrace.agent.snapshot import Snapshot
    from gemtrace.sources import Key

RESOURCE_MEMORY = "memory"
RESOURCES = (RESOURCE_MEMORY,)  # every `resource` a quota breach can name

# Every `kind` of tampering: a slot showing less memory than eBPF saw (hiding it from the gates'
# quota), or more than the agent can verify (issue 25: a figure that would deny other members of a
# shared group their memory, which their gates now ignore).
UNDER_REPORTING = "under_reporting"
OVER_REPORTING = "over_reporting"
TAMPERING_KINDS = (UNDER_REPORTING, OVER_REPORTING)


@dataclass(frozen=True)
class Holding:
    """What one process holds on one GPU, with the time of its last allocation there (0: unknown)."""

    pid: int
    group: str
    gpu: str
    bytes: int
    last_alloc_ns: int
    gated: bool = False
    uid: int | None = None  # the process's real uid (None: not known, counted as one more user)


@dataclass(frozen=True)
class Kill:
    pid: int
    group: str
    gpu: str
    group_bytes: int
    limit: int
    process_bytes: int
    reaction_ns: int | None = None  # from the allocation that crossed the limit to the signal
    uid: int | None = None


def _default_kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def culprit_uids(holdings: Iterable[Holding], limit: int, within_mark: int) -> frozenset[int | None]:
    """The uids that made one group go over `limit` on one GPU (`holdings`: its processes there).
    `within_mark`: the latest allocation the group held when it was last seen within the limit."""
    holding = [h for h in holdings if h.bytes > 0]
    if sum(h.bytes for h in holding if h.gated) <= limit:
        return frozenset(h.uid for h in holding if not h.gated)
    recent = frozenset(h.uid for h in holding if h.last_alloc_ns > within_mark)
    return recent or frozenset(h.uid for h in holding)


def victims_in_order(holdings: Iterable[Holding], culprits: frozenset[int | None],
                     pending: Mapping[int, str] | frozenset[int] = frozenset()) -> list[Holding]:
    """The order in which the group's processes on one GPU die: the culprits' processes first, each
    set newest allocation first; on a tie ungated first, then the bigger, then the higher pid."""
    return sorted(
        (h for h in holdings if h.pid not in pending and h.bytes > 0),
        key=lambda h: (h.uid in culprits, h.last_alloc_ns, not h.gated, h.bytes, h.pid),
        reverse=True,
    )


class MemoryEnforcer:
    def __init__(self, kill: Callable[[int], None] = _default_kill, log: Any = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._kill = kill
        self._clock = clock
        self._log = log or structlog.get_logger("gemtrace.enforcement")
        self._lock = threading.Lock()
        self._pending: dict[int, str] = {}  # pid killed -> group, until it no longer holds anything
        self._over: set[tuple[str, str]] = set()  # (gpu, group) found over its limit, until back under
        # (gpu, group) -> the latest allocation it held when last seen within its limit: allocations
        # after it are the ones that took it over.
        self._within_mark: dict[tuple[str, str], int] = {}
        self.oom_kills: Counter[str] = Counter()
        self.breaches: Counter[tuple[str, str]] = Counter()  # (group, resource)
        self.tampering: Counter[tuple[str, str]] = Counter()  # (group, kind)
        self._tampering_logged: set[tuple[int, str]] = set()  # (pid, kind) logged once per process
        self.last_kills: list[Kill] = []  # the latest few, for tests and `gemtrace top`

    def check(self, holdings: Iterable[Holding], limits: Mapping[str, int | None],
              event_ns: int | None = None) -> list[Kill]:
        """Kill what must die for every group to be within its limit; the kills made. `event_ns`: when
        the allocation that woke the check returned (CLOCK_MONOTONIC), to log the reaction time."""
        by_key: dict[tuple[str, str], list[Holding]] = {}
        for h in holdings:
            by_key.setdefault((h.gpu, h.group), []).append(h)
        kills: list[Kill] = []
        with self._lock:
            present = {h.pid for hs in by_key.values() for h in hs if h.bytes > 0}
            for pid in [p for p in self._pending if p not in present]:
                del self._pending[pid]  # it exited and its memory went with it
            for (gpu, group), hs in by_key.items():
                limit = limits.get(group)
                total = sum(h.bytes for h in hs)
                if limit is None or total <= limit:
                    self._over.discard((gpu, group))
                    self._within_mark[(gpu, group)] = max(h.last_alloc_ns for h in hs)
                    continue
                if (gpu, group) not in self._over:
                    self._over.add((gpu, group))
                    self.breaches[(group, RESOURCE_MEMORY)] += 1
                    self._log.warning("quota_breach", group=group, gpu=gpu, resource=RESOURCE_MEMORY,
                                      bytes=total, limit=limit)
                remaining = total - sum(h.bytes for h in hs if h.pid in self._pending)
                if remaining <= limit:
                    continue  # what is pending brings it back: nobody else dies for that memory
                culprits = culprit_uids(hs, limit, self._within_mark.get((gpu, group), 0))
                for victim in victims_in_order(hs, culprits, self._pending):
                    if remaining <= limit:
                        break
                    kills.append(self._kill_one(victim, total, limit, event_ns, culprits))
                    remaining -= victim.bytes
        return kills

    def _kill_one(self, victim: Holding, group_bytes: int, limit: int, event_ns: int | None,
                  culprits: frozenset[int | None]) -> Kill:
        try:
            self._kill(victim.pid)
        except ProcessLookupError:
            pass  # it died on its own meanwhile: its memory goes all the same
        reaction = None if event_ns is None else self._clock() - event_ns
        self._pending[victim.pid] = victim.group
        self.oom_kills[victim.group] += 1
        self._log.warning("oom_kill", pid=victim.pid, group=victim.group, gpu=victim.gpu, bytes=group_bytes,
                          limit=limit, process_bytes=victim.bytes, uid=victim.uid,
                          culprit_uids=sorted(culprits, key=lambda u: -1 if u is None else u),
                          reaction_ms=None if reaction is None else round(reaction / 1e6, 3))
        kill = Kill(victim.pid, victim.group, victim.gpu, group_bytes, limit, victim.bytes, reaction, victim.uid)
        self.last_kills.append(kill)
        del self.last_kills[:-16]
        return kill

    def counters(self) -> tuple[dict[str, int], dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        """Copies of (oom kills by group, breaches by (group, resource), tampering by (group, kind))."""
        with self._lock:
            return dict(self.oom_kills), dict(self.breaches), dict(self.tampering)

    def note_tampering(self, pid: int, group: str, gpu: str, slot_bytes: int, verified_bytes: int,
                       kind: str = UNDER_REPORTING) -> None:
        """A slot's figure that disagreed with what the agent verified (eBPF, else NVML): counted each
        episode, logged once per process and kind (a process that keeps flipping its figure cannot
        flood the log)."""
        with self._lock:
            self.tampering[(group, kind)] += 1
            first = (pid, kind) not in self._tampering_logged
            self._tampering_logged.add((pid, kind))
        if first:
            self._log.warning("slot_tampering", pid=pid, group=group, gpu=gpu, kind=kind, slot_bytes=slot_bytes,
                              verified_bytes=verified_bytes)

    def forget_tampering(self, live: Collection[int]) -> None:
        """Keep the once-per-process log memory for the processes in `live` only."""
        with self._lock:
            self._tampering_logged = {(pid, kind) for pid, kind in self._tampering_logged if pid in live}


class Enforcement:
    """The enforcer as the accounting's subscriber. `limits`: group -> MemoryLimit (None: none) of the
    resource file in force; `holdings`: what every process holds now (Accounting.holdings)."""

    def __init__(self, enforcer: MemoryEnforcer, limits: Callable[[], Mapping[str, int | None]],
                 holdings: Callable[[], list[Holding]]) -> None:
        self.enforcer = enforcer
        self._limits = limits
        self._holdings = holdings
        self._tamper_suspect: dict[tuple[int, str], tuple[int, int, str]] = {}
        self._tampered: set[tuple[int, str]] = set()

    def on_allocation(self, event_ns: int | None) -> None:
        """Memory may have grown: check every group on every GPU against its limit."""
        limits = self._limits()
        if not any(limit is not None for limit in limits.values()):
            return  # no group has a limit: nothing to read
        holdings = self._holdings()
        if any(limits.get(h.group) is not None for h in holdings):
            self.enforcer.check(holdings, limits, event_ns=event_ns)

    def on_snapshot(self, snapshot: Snapshot, merged: Mapping[Key, Merged]) -> None:
        """A slot that shows less than eBPF saw is hiding memory from the gates' quota; one that shows
        more than the agent verified (eBPF, else NVML, context included) claims memory its process does
        not hold, which would deny the other members of its group theirs (their gates count the
        verified figure instead: hook/memory.c). A gate reserves before it calls the driver and frees
        after, so a slot may lead eBPF for a moment, never trail it, and never lead it for two looks in
        a row with the same figures."""
        for p in snapshot.processes:
            key = (p.pid, p.gpu)
            m = merged.get(key)
            if m is None or m.slot_memory is None:
                continue
            if m.ebpf_memory is not None and m.slot_memory < m.ebpf_memory:
                self._audit(p.pid, p.group, p.gpu, m.slot_memory, m.ebpf_memory, UNDER_REPORTING)
            elif m.verified is not None and m.slot_memory + m.slot_managed > m.verified + m.verified_managed:
                # device and managed together: a gate counts a program's own managed memory as device
                # memory outside an Oversubscribe group, eBPF as managed
                self._audit(p.pid, p.group, p.gpu, m.slot_memory + m.slot_managed, m.verified + m.verified_managed,
                            OVER_REPORTING)
            else:
                self._tamper_suspect.pop(key, None)
                self._tampered.discard(key)
        live = {p.pid for p in snapshot.processes}
        for key in [key for key in self._tamper_suspect if key[0] not in live]:
            del self._tamper_suspect[key]
        self._tampered = {key for key in self._tampered if key[0] in live}
        self.enforcer.forget_tampering(live)

    def _audit(self, pid: int, group: str, uuid: str, slot_bytes: int, verified_bytes: int, kind: str) -> None:
        """An episode is counted at its second look in a row: under-reporting with the same figures;
        over-reporting with any (a slot leads only while a reservation is in flight, which two looks
        do not both catch: a poll, and the agent's second look 0.2 s later; and a liar must not escape
        by changing its figure)."""
        key = (pid, uuid)
        figures = (slot_bytes, verified_bytes, kind)
        before = self._tamper_suspect.get(key)
        if before is not None and before[2] != kind:
            self._tampered.discard(key)  # it changed sides: a new episode
            before = None
        repeated = before is not None and (kind == OVER_REPORTING or before == figures)
        if repeated and key not in self._tampered:
            self._tampered.add(key)
            self.enforcer.note_tampering(pid, group, uuid, slot_bytes, verified_bytes, kind)
        self._tamper_suspect[key] = figures

    def over_reporting_suspected(self) -> bool:
        """A slot was seen above its verified figure once and not yet counted: the accounting looks
        again sooner than its next poll (AUDIT_AGAIN_SECONDS), to cut what a liar can deny."""
        return any(f[2] == OVER_REPORTING and key not in self._tampered for key, f in self._tamper_suspect.items())

    def over_reporters(self) -> set[int]:
        """The processes whose slot claims more than they hold now (an episode counted, not over)."""
        return {key[0] for key in self._tampered if self._tamper_suspect.get(key, (0, 0, ""))[2] == OVER_REPORTING}
