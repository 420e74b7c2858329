"""Issue 25's shares, without a socket: how ChunkKeeper hands chunks to users who ask as fast as they can,
and how the socket's refusals are counted and logged (gemtrace/region/chunks.py, gemtrace/region/server.py).
The attacks themselves, as real users against a real agent, are tests/test_trust.py's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog

from gemtrace import contract
from gemtrace import region as rg
from gemtrace.eventlog import USER_BURST, UserLines
from gemtrace.region.chunks import ROOT_RESERVED_CHUNKS, SHARED_HEADROOM_CHUNKS, ChunkKeeper, SlotSpace
from gemtrace.region.server import DROPPED, MALFORMED, AttachCounts

pytestmark = pytest.mark.unit


@pytest.fixture
def keeper() -> Iterator[ChunkKeeper]:
    layout = rg.RegionLayout()
    for c in range(contract.MAX_CHUNKS):
        layout.chunk_owner[c] = contract.NO_OWNER
    space = SlotSpace()
    keeper = ChunkKeeper(space, layout)
    yield keeper
    keeper.close()
    space.close()


def hoard(keeper: ChunkKeeper, uid: int, joins: int = 2000) -> int:
    """`joins` joins of `uid` within one join window, none of them claiming a slot: the chunks it holds."""
    for _ in range(joins):
        keeper.join(uid)
    return keeper.holdings()[0].get(uid, 0)


def test_a_user_asking_as_fast_as_it_can_gets_its_cap_and_the_next_leaves_root_and_others_theirs(
        keeper: ChunkKeeper) -> None:
    assert hoard(keeper, 1001) == contract.USER_CHUNKS
    second = hoard(keeper, 1002)
    assert second == contract.MAX_CHUNKS - contract.USER_CHUNKS - ROOT_RESERVED_CHUNKS - SHARED_HEADROOM_CHUNKS
    # A third user still gets a first chunk, and no second one out of the headroom.
    assert hoard(keeper, 1003) == 1
    _, ok = keeper.join(1004)
    assert ok
    # Root gets its reserve whatever the others took, and more while any chunk is free.
    assert hoard(keeper, 0) == contract.MAX_CHUNKS - contract.USER_CHUNKS - second - 2
    assert keeper.holdings()[1] == 0


def test_a_users_refusals_are_counted_each_and_logged_within_its_line_limit() -> None:
    now = [100.0]
    summaries: list[object] = []
    lines = UserLines(clock=lambda: now[0], schedule=lambda seconds, action: summaries.append(action))
    counts = AttachCounts(lines)
    with structlog.testing.capture_logs() as logs:
        for _ in range(1000):
            counts.note(1001, DROPPED, pid=7)
        counts.note(1002, MALFORMED, pid=8)
        now[0] += 1.0
        counts.note(1001, MALFORMED, pid=7)
        lines.summarize()
    assert counts.counts() == {(1001, DROPPED): 1000, (1002, MALFORMED): 1, (1001, MALFORMED): 1}
    refused = [(e["uid"], e["reason"]) for e in logs if e["event"] == "attach_refused"]
    assert refused == [(1001, DROPPED)] * USER_BURST + [(1002, MALFORMED), (1001, MALFORMED)]
    dropped = [e for e in logs if e["event"] == "log_lines_dropped"]
    assert [(e["uid"], e["dropped"]) for e in dropped] == [(1001, 1000 - USER_BURST)]
