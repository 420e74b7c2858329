"""The gates' socket: refused and failed attaches per user, and who holds the slot chunks.

Reads copies the socket's thread and the chunk keeper keep (gemtrace/region/server.py,
gemtrace/region/chunks.py) through two callables; computes nothing. Every reason of a user who holds
chunks or was ever refused is exported, at 0 until it happens, so that increase() sees the first as a
step from 0 and an alert's selector has series before anyone is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gemtrace.metrics import family, spec
from gemtrace.region.server import REASONS


class AttachCollector(Collector):
    def __init__(self, refusals: Callable[[], dict[tuple[int, str], int]],
                 holdings: Callable[[], tuple[dict[int, int], int]]) -> None:
        """`refusals`: (uid, reason) -> count; `holdings`: (uid -> chunks held, chunks nobody holds)."""
        self._refusals = refusals
        self._holdings = holdings

    def collect(self) -> Iterator[Metric]:
        counts = self._refusals()
        held, free = self._holdings()
        refused = family(spec("gemtrace_attach_refusals_total"))
        for uid in sorted({uid for uid, _ in counts} | held.keys()):
            for reason in REASONS:
                refused.add_metric([str(uid), reason], float(counts.get((uid, reason), 0)))
        chunks = family(spec("gemtrace_attach_chunks"))
        for uid, n in sorted(held.items()):
            chunks.add_metric([str(uid)], float(n))
        unowned = family(spec("gemtrace_attach_chunks_free"))
        unowned.add_metric([], float(free))
        yield refused
        yield chunks
        yield unowned
