"""Verified memory: what other users' gates count for each gated process, and whose own figures they trust.

Owns writing to the region the memory the agent verified each gated process holds (merge's row
"verified", Region.publish_verified) and which users' slots the gates may count at their own figures
(Region.trust_chunks): every user's but those the audit caught over-reporting, for as long as this
agent runs (issue 25; docs/gate.md, Memory). Never reads a source and never kills: the accounting
hands it each poll's merged figures and eBPF's readings.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import structlog

from gemtrace.agent import merge
from gemtrace.agent.merge import Merged
from gemtrace.region import Region
from gemtrace.sources import Devices, Figures, Key, SourceReading

log = structlog.get_logger("gemtrace.accounting")


class VerifiedMemory:
    def __init__(self, region: Region) -> None:
        self.region = region
        self._untrusted_uids: frozenset[int] = frozenset()  # users caught over-reporting (untrust)
        self._trusted_generation = -1  # the chunk generation trust_chunks last looked at

    def publish(self, devices: Devices, gated: Collection[int], merged: Mapping[Key, Merged]) -> None:
        """At each poll: every gated process's memory as eBPF or NVML checks it (merge's row
        "verified"; the slot's own figure where nothing checks it), into the region's verified[]. A
        gated process no source places on a GPU holds nothing there."""
        index = {uuid: g for g, uuid in enumerate(devices.physical())}
        out: dict[int, dict[int, tuple[int, int]]] = {pid: {} for pid in gated}
        for (pid, uuid), m in merged.items():
            g = index.get(uuid) if m.gated else None
            if g is not None:
                held = out.get(pid)
                if held is None:
                    held = out[pid] = {}
                held[g] = (m.verified if m.verified is not None else (m.slot_memory or 0), m.verified_managed)
        self.region.publish_verified(out)

    def publish_from_ebpf(self, devices: Devices, ebpf: SourceReading, rebuilt: Collection[int]) -> None:
        """On each eBPF wake-up while some user is untrusted: the gated processes' eBPF figures (merge's
        row "verified"), so that an untrusted user's allocation counts in the others' gates within the
        watcher's reaction, not at the next poll. While every user is trusted the gates count live
        figures, and the polls publish enough: the watcher, woken by every allocation, stays as light
        as it was. Processes holding `rebuilt` memory are the poll's to publish (their slot, clamped)."""
        if not self._untrusted_uids:
            return
        columns = self.region.slot_columns
        physical = devices.physical()
        slot_managed = [columns.managed(g) for g in range(len(physical))]
        out: dict[int, dict[int, tuple[int, int]]] = {}
        for slot in columns.live():
            pid = columns.pid[slot]
            if not pid or pid in rebuilt:
                continue
            held = out[pid] = {}
            for g, uuid in enumerate(physical):
                f = ebpf.figures.get((pid, uuid))
                if f is not None:
                    slot_figures = Figures(managed=slot_managed[g][slot])
                    device, managed = merge.verified(True, f, slot_figures, None, False, False)
                    held[g] = (device or 0, managed)
        self.region.publish_verified(out)

    def untrust(self, over_reporters: Iterable[int]) -> None:
        """The users of the processes the audit just counted over-reporting lose the trust of the
        other users' gates (the poller's: the audit's state is the poller's)."""
        for pid in over_reporters:
            uid = self.region.owner_of(pid)
            if uid is not None and uid not in self._untrusted_uids:
                self._untrusted_uids = self._untrusted_uids | {uid}  # a new set: the keeper reads it
                log.warning("user_untrusted", uid=uid, pid=pid,
                            consequence="other users' gates count this user's memory as the agent verifies it")

    def trust_chunks(self) -> None:
        """Which users' slots other users' gates count at their own figures (chunk_trusted): every
        user's but those caught over-reporting. The verified figures lag each allocation (eBPF's
        event, else a poll), and in that lag two users allocating at once each took most of a shared
        limit (docs/gate.md, Memory)."""
        untrusted = self._untrusted_uids
        generation = self.region.layout.header.chunk_generation
        self.region.trust_chunks(lambda uid: uid not in untrusted)
        self._trusted_generation = generation

    def trust_new_chunks(self) -> None:
        """trust_chunks' decision for chunks made or given to another user since (the keeper's tick:
        a gate waits for its group, which the same tick decides, before it allocates)."""
        if self.region.layout.header.chunk_generation != self._trusted_generation:
            self.trust_chunks()
