"""Each process's facts for the accounting: its start time, name, group and the GPUs its ordinals name.

Owns reading them from /proc and keeping them while the process lives, and the Devices view that
the sources read through (the host's GPUs, a process's ordinals as GPU UUIDs). A kept record is
dropped when a source sees the process exit, when the accounting finds it gone or its pid reused,
and is read afresh under new rules (another resource file). Never decides a group itself (that is
gemtrace.agent.membership's one decision) and never reads a source.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gemtrace.agent.membership import group_of
from gemtrace.groups_of import ENV_VISIBLE_DEVICES, ProcReader, visible_devices
from gemtrace.region import Region


class Rules(Protocol):
    """The resource file as the accounting reads it: its groups by name."""

    @property
    def groups(self) -> Mapping[str, Any]: ...


@dataclass
class Facts:
    start_time: int | None
    comm: str
    group: str
    uuids: list[str]  # the GPUs its ordinals 0, 1, ... name
    rules_id: int


def inherited(pid: int, facts: Facts, missed: Collection[int], since_ticks: int | None) -> bool:
    """Started by `since_ticks` (/proc ticks), or mapped a libcuda file before it was probed (`missed`):
    eBPF cannot have seen what it allocated before."""
    return pid in missed or (since_ticks is not None and facts.start_time is not None
                             and facts.start_time <= since_ticks)


class ProcessFacts:
    def __init__(self, proc: ProcReader, region: Region | None, other_gpus: Callable[[], list[str]]) -> None:
        """`other_gpus`: the host's GPUs where the region lists none (NVML's)."""
        self.proc = proc
        self.region = region
        self._other_gpus = other_gpus
        self._kept: dict[int, Facts] = {}

    def physical(self) -> list[str]:
        """The host's GPU UUIDs in physical order: the region's, else NVML's."""
        if self.region is not None:
            uuids = list(self.region.gpu_uuids())
            if uuids:
                return uuids
        return self._other_gpus()

    def of(self, pid: int, rules: Rules | None) -> Facts | None:
        """`pid`'s facts under `rules`, read from /proc unless kept; None when it is gone."""
        # Kept while the process lives: eBPF's exit events (or, without eBPF, a failed liveness
        # check in the accounting's poll) drop the entry, so a reused pid is read afresh.
        rules_id = id(rules)
        facts = self._kept.get(pid)
        if facts is not None and facts.rules_id == rules_id:
            return facts
        start = self.proc.start_time(pid)
        env = self.proc.environ(pid)
        if env is None:
            return None
        # The agent's one decision (gemtrace/agent/membership.py): a gated process's assignment, else the
        # same admission for an ungated one.
        group, final = group_of(pid, env, self.proc, self.region, rules.groups if rules is not None else {})
        facts = Facts(
            start_time=start,
            comm=self.proc.comm(pid) or "?",
            group=group,
            uuids=visible_devices(env.get(ENV_VISIBLE_DEVICES), self.physical()),
            rules_id=rules_id,
        )
        if final:
            self._kept[pid] = facts
        return facts

    def kept(self, pid: int) -> Facts | None:
        """What is kept of `pid`, without reading /proc."""
        return self._kept.get(pid)

    def forget(self, pid: int) -> None:
        self._kept.pop(pid, None)

    def devices(self, rules: Rules | None) -> _Devices:
        """The Devices view of one reading, under `rules`."""
        return _Devices(self, rules)


class _Devices:
    """The host's GPUs and each process's ordinals as UUIDs, for the sources of one reading."""

    def __init__(self, facts: ProcessFacts, rules: Rules | None) -> None:
        self._facts = facts
        self._rules = rules
        self._physical: list[str] | None = None

    def physical(self) -> list[str]:
        if self._physical is None:
            self._physical = self._facts.physical()
        return self._physical

    def of(self, pid: int, ordinal: int) -> str | None:
        facts = self._facts.of(pid, self._rules)
        if facts is None or ordinal >= len(facts.uuids):
            return None
        return facts.uuids[ordinal]

    def forget(self, pids: Collection[int]) -> None:
        for pid in pids:
            self._facts.forget(pid)
