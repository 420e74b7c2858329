"""GPU time within a group: a group's gated processes together are never given more GPU time than the
scheduler charged the group on that GPU (docs/accounting.md, "GPU time within a group"). Pure: plain figures in, figures
out; the accounting (gemtrace/agent/accounting.py) calls it at each poll."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass


@dataclass
class _Share:
    raw_seen: float  # the gate's busy seconds at the last apportioning
    charged: float  # what the process has been given


class GpuTimeShare:
    """Per-process GPU time of gated processes, so that a group's processes together never get more
    than the group's time on that GPU (the scheduler's figure, charged once per interval).

    The gate measures a burst from its first launch to the sync that drains it; on a time-sliced GPU
    that includes the time its kernels waited behind the group's other processes, so three busy
    processes of one group measure about three times the group's time. Each poll, the bursts that
    ended since the last (the increase of each process's busy seconds) are paid out of what the group
    was given and not yet paid to its processes: in full if it covers them all, else that remainder is
    split in proportion and the excess (the waiting) is dropped. The remainder carries over, because
    the gate counts a burst only when it ends while the scheduler charges it as it runs.
    Pure: plain figures in, figures out. Each poll, `keep` is called with every live gated process,
    then `apportion` with those whose busy seconds may have changed (a process whose figure is the one
    it was last apportioned is paid nothing: it keeps what it was given, and may be left out).
    """

    def __init__(self) -> None:
        self._procs: dict[tuple[int, str], _Share] = {}
        self._paid: dict[tuple[str, str], float] = {}  # (gpu, group) -> given to its processes so far

    def apportion(self, raw: Mapping[tuple[str, str], Mapping[int, float]],
                  group_seconds: Mapping[tuple[str, str], float],
                  inherited: Collection[int] = ()) -> dict[tuple[int, str], float]:
        """`raw`: (gpu, group) -> pid -> the gate's busy seconds; `group_seconds`: (gpu, group) -> the
        group's GPU seconds; `inherited`: pids whose earlier bursts predate the group's figure (not
        paid). Returns (pid, gpu) -> seconds of the processes in `raw`, never decreasing for a process;
        a group without a figure gets its raw increases unchanged."""
        out: dict[tuple[int, str], float] = {}
        shares = self._procs
        for (gpu, group), procs in raw.items():
            # Only the processes whose bursts grew since they were last apportioned are paid: the
            # others keep what they were given.
            grown: list[tuple[tuple[int, str], _Share, float]] = []
            for pid, seconds in procs.items():
                key = (pid, gpu)
                share = shares.get(key)
                if share is None:
                    share = shares[key] = _Share(seconds if pid in inherited else 0.0, 0.0)
                if seconds == share.raw_seen:
                    out[key] = share.charged
                else:
                    grown.append((key, share, max(0.0, seconds - share.raw_seen)))
                    share.raw_seen = seconds
            total = sum(increase for _, _, increase in grown)
            figure = group_seconds.get((gpu, group))
            paid = self._paid.get((gpu, group), 0.0)
            scale = 1.0
            if figure is not None and total > 0:
                scale = min(1.0, max(0.0, figure - paid) / total)
            for key, share, increase in grown:
                share.charged += increase * scale
                out[key] = share.charged
            self._paid[(gpu, group)] = paid + total * scale
        return out

    def keep(self, live: Collection[tuple[int, str]]) -> None:
        """Forget the processes not in `live` ((pid, gpu) of every live gated process, at each poll
        before `apportion`): one gone, or no longer gated, starts anew if it is seen again. The
        snapshot keeps a gone process's figure."""
        for key in self._procs.keys() - live:
            del self._procs[key]
