"""GPU choice for `gemtrace run --gpus N`: the scores, the policies on the simulated GPU's topologies
(read through the real NVML adapter, run/topology.py), and which GPUs are free for a group.

The expected sets are derived by hand in docs/placement.md ("What it picks"); in short, on the
DGX-1 (Volta) the eight pairs with 2 NVLinks form two perfect matchings of equal score,
{0-3, 1-2, 4-7, 5-6} and {0-4, 1-5, 2-3, 6-7}; the first in index order wins, so N=2 gives {0, 3};
each half {0,1,2,3} and {4,5,6,7} holds 9 NVLinks, more than any other four.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from simgpu_env import REPO, SimGpu
from testkit import GiB

from gemtrace.run.placement import (
    PACKINGS,
    POLICIES,
    BestEffortPolicy,
    GpuNode,
    GroupUse,
    Links,
    PcieLevel,
    Room,
    SimplePolicy,
    Unplaceable,
    free_for,
    model_matches,
    pair_score,
    place,
    set_score,
)

pytestmark = pytest.mark.unit

TOPOLOGIES = ["dgx1", "dgx-a100", "pcie", "hostbridge"]


def read_nodes(sim: SimGpu, topology: str) -> list[GpuNode]:
    """topology.read() in a child on the simulation (pynvml binds one NVML per process)."""
    lines = sim.nvml(
        "from gemtrace.run import topology\n"
        "for n in topology.read():\n"
        "    emit({'index': n.index, 'uuid': n.uuid, 'memory_total': n.memory_total, 'links': {\n"
        "        str(k): [None if v.pcie is None else int(v.pcie), v.nvlinks, v.nvlink_version]\n"
        "        for k, v in n.links.items()}})\n",
        SIMGPU_TOPOLOGY=topology,
    )
    return [
        GpuNode(
            line["index"],
            line["uuid"],
            line["memory_total"],
            {int(k): Links(None if p is None else PcieLevel(p), n, v) for k, (p, n, v) in line["links"].items()},
        )
        for line in lines
    ]


@pytest.fixture(params=TOPOLOGIES)
def topology_nodes(request: pytest.FixtureRequest, simgpu_factory: Callable[..., SimGpu]) -> tuple[str, list[GpuNode]]:
    return request.param, read_nodes(simgpu_factory(devices=8), request.param)


@pytest.fixture
def dgx1(simgpu_factory: Callable[..., SimGpu]) -> list[GpuNode]:
    return read_nodes(simgpu_factory(devices=8), "dgx1")


def indexes(gpus: list[GpuNode]) -> list[int]:
    return [g.index for g in gpus]


def without(nodes: list[GpuNode], *taken: int) -> list[GpuNode]:
    return [n for n in nodes if n.index not in taken]


# ---- scores ---------------------------------------------------------------------------------


def node(index: int, **links: Links) -> GpuNode:
    return GpuNode(index, f"GPU-{index}", 16 * GiB, {int(k[1:]): v for k, v in links.items()})


@pytest.mark.parametrize(
    ("level", "score"),
    [(PcieLevel.SAME_BOARD, 60), (PcieLevel.SINGLE_SWITCH, 50), (PcieLevel.MULTIPLE_SWITCHES, 40),
     (PcieLevel.HOST_BRIDGE, 30), (PcieLevel.SAME_CPU, 20), (PcieLevel.ACROSS_CPUS, 10)],
)
def test_a_pcie_pair_scores_by_its_common_ancestor(level: PcieLevel, score: int) -> None:
    assert pair_score(node(0, g1=Links(level)), node(1)) == score


def test_each_nvlink_scores_100_plus_its_generation_and_one_more_link_beats_any_generation() -> None:
    two_volta = node(0, g1=Links(PcieLevel.ACROSS_CPUS, nvlinks=2, nvlink_version=2))
    assert pair_score(two_volta, node(1)) == 10 + 2 * 102
    newest_twelve = pair_score(node(0, g1=Links(None, nvlinks=12, nvlink_version=8)), node(1))
    oldest_thirteen = pair_score(node(0, g1=Links(None, nvlinks=13, nvlink_version=1)), node(1))
    assert oldest_thirteen > newest_twelve
    assert pair_score(node(0), node(1)) == 0  # nothing known about the pair


def test_the_dgx1_topology_reads_back_as_nvidia_lays_it_out(dgx1: list[GpuNode]) -> None:
    links = {(a.index, b): lk.nvlinks for a in dgx1 for b, lk in a.links.items() if lk.nvlinks}
    assert {k: v for k, v in links.items() if k[0] < k[1]} == {
        (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
        (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2,
    }
    assert all(links[(b, a)] == n for (a, b), n in links.items())  # both ends agree
    assert dgx1[0].links[1] == Links(PcieLevel.SINGLE_SWITCH, 1, 2)
    assert dgx1[0].links[3] == Links(PcieLevel.HOST_BRIDGE, 2, 2)
    assert dgx1[3].links[7] == Links(PcieLevel.ACROSS_CPUS, 1, 2)
    assert set_score(dgx1[:4]) == 9 * 102 + 2 * 50 + 4 * 30


# ---- the policies on the simulated topologies ------------------------------------------------

BEST = {
    # N: expected set, on a whole idle box
    "dgx1": {1: [0], 2: [0, 3], 4: [0, 1, 2, 3], 8: list(range(8))},
    "dgx-a100": {1: [0], 2: [0, 1], 4: [0, 1, 2, 3], 8: list(range(8))},
    "pcie": {1: [0], 2: [0, 1], 4: [0, 1, 2, 3], 8: list(range(8))},
    "hostbridge": {1: [0], 2: [0, 1], 4: [0, 1, 2, 3], 8: list(range(8))},
}
# GPU 0 taken: where best-effort and simple part ways. Pairs: on the switch-pair boxes the pair
# that leaves the other switch pairs whole ({2,3}, not simple's {1,2} across switches); on the DGX-1
# the split {1-5, 2-3, 6-7} (722) beats {1-2, 4-7, 5-6} (702). Fours: the untouched half.
BEST_WITHOUT_0 = {
    "dgx1": {2: [2, 3], 4: [4, 5, 6, 7]},
    "dgx-a100": {2: [2, 3], 4: [4, 5, 6, 7]},
    "pcie": {2: [2, 3], 4: [4, 5, 6, 7]},
    "hostbridge": {2: [1, 2], 4: [1, 2, 3, 4]},  # all pairs equal: index order
}


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_best_effort_picks_the_known_best_set(topology_nodes: tuple[str, list[GpuNode]], size: int) -> None:
    name, nodes = topology_nodes
    assert indexes(BestEffortPolicy().allocate(nodes, size)) == BEST[name][size]


@pytest.mark.parametrize("size", [2, 4])
def test_best_effort_keeps_whole_sets_for_the_next_request(topology_nodes: tuple[str, list[GpuNode]],
                                                           size: int) -> None:
    name, nodes = topology_nodes
    assert indexes(BestEffortPolicy().allocate(without(nodes, 0), size)) == BEST_WITHOUT_0[name][size]
    assert indexes(SimplePolicy().allocate(without(nodes, 0), size)) == list(range(1, size + 1))


def test_after_three_pairs_on_a_dgx1_the_last_pair_is_still_two_nvlinks(dgx1: list[GpuNode]) -> None:
    taken: list[list[int]] = []
    for _ in range(4):
        pair = BestEffortPolicy().allocate(without(dgx1, *sum(taken, [])), 2)
        taken.append(indexes(pair))
    assert taken == [[0, 3], [1, 2], [4, 7], [5, 6]]
    assert all(dgx1[a].links[b].nvlinks == 2 for a, b in taken)


def test_best_effort_gives_up_the_best_pair_now_when_it_would_strand_a_bad_one() -> None:
    # A chain 0 =3= 1 =4= 2 =3= 3 (NVLinks), 0 and 3 unlinked: the best pair now is {1,2}, which
    # leaves {0,3} with nothing; {0,1} + {2,3} totals 6 links against 4.
    def chain(i: int) -> GpuNode:
        counts = {(0, 1): 3, (1, 2): 4, (2, 3): 3}
        return GpuNode(i, f"GPU-{i}", 16 * GiB, {
            j: Links(PcieLevel.ACROSS_CPUS, counts.get((min(i, j), max(i, j)), 0)) for j in range(4) if j != i})

    gpus = [chain(i) for i in range(4)]
    assert indexes(BestEffortPolicy().allocate(gpus, 2)) == [0, 1]
    assert indexes(BestEffortPolicy().allocate(gpus[2:], 2)) == [2, 3]


def test_sizes_that_do_not_divide_the_gpus_are_chosen_and_too_many_are_refused(dgx1: list[GpuNode]) -> None:
    for policy in POLICIES.values():
        assert policy().allocate(dgx1, 9) == []
        assert policy().allocate(dgx1, 0) == []
    assert indexes(BestEffortPolicy().allocate(dgx1, 3)) == [0, 2, 3]  # 5 NVLinks, the most three have
    assert set_score(BestEffortPolicy().allocate(dgx1, 3)) == 5 * 102 + 30 + 30 + 50


def test_best_effort_on_8_gpus_takes_milliseconds(dgx1: list[GpuNode]) -> None:
    start = time.perf_counter()
    for size in range(1, 9):
        BestEffortPolicy().allocate(dgx1, size)
    assert time.perf_counter() - start < 1.0  # about 5 ms unloaded; 1 s leaves room for a busy CI


# ---- which GPUs are free ---------------------------------------------------------------------


def gpus16(n: int = 4) -> list[GpuNode]:
    return [GpuNode(i, f"GPU-{i}", 16 * GiB) for i in range(n)]


def free(group: str, limit: int | None, uses: list[GroupUse]) -> list[int]:
    return indexes(free_for(group, limit, gpus16(), uses))


def test_a_group_with_processes_on_a_gpu_claims_its_limit_there() -> None:
    train = GroupUse("train", 10 * GiB, present=frozenset({0}), memory={0: 1 * GiB})
    assert free("infer", 6 * GiB, [train]) == [0, 1, 2, 3]
    assert free("infer", 6 * GiB + 1, [train]) == [1, 2, 3]  # 10 GiB claimed though 1 GiB used


def test_a_group_without_a_limit_claims_the_whole_gpu_where_it_runs() -> None:
    infer = GroupUse("infer", None, present=frozenset({1}))
    assert free("train", 1, [infer]) == [0, 2, 3]


def test_where_a_group_has_no_live_process_only_what_it_holds_counts() -> None:
    infer = GroupUse("infer", None, memory={2: 4 * GiB})
    assert free("train", 12 * GiB, [infer]) == [0, 1, 2, 3]
    assert free("train", 12 * GiB + 1, [infer]) == [0, 1, 3]


def test_a_group_without_a_limit_needs_a_gpu_nobody_claims() -> None:
    uses = [GroupUse("train", 1 * GiB, present=frozenset({0})), GroupUse("other", None, memory={3: 1})]
    assert free("infer", None, uses) == [1, 2]


def test_the_groups_own_processes_do_not_count_against_it() -> None:
    train = GroupUse("train", 10 * GiB, present=frozenset({0, 1, 2, 3}))
    assert free("train", 10 * GiB, [train]) == [0, 1, 2, 3]
    assert free("train", None, [train]) == [0, 1, 2, 3]


def test_claims_of_several_groups_add_up() -> None:
    uses = [GroupUse("a", 5 * GiB, present=frozenset({0})), GroupUse("b", 5 * GiB, present=frozenset({0}))]
    assert free("c", 6 * GiB, uses) == [0, 1, 2, 3]
    assert free("c", 7 * GiB, uses) == [1, 2, 3]


def test_docs_name_every_policy() -> None:
    doc = (REPO / "docs" / "placement.md").read_text()
    assert all(f"`{name}`" in doc for name in POLICIES)


# ---- a pod's share on a Kubernetes node -----------------------------------------------------------


@pytest.mark.parametrize(("model", "name", "matches"), [
    ("H100", "NVIDIA H100 80GB HBM3", True),
    ("h100", "NVIDIA H100 PCIe", True),
    ("A100", "NVIDIA A100-SXM4-80GB", True),
    ("A10", "NVIDIA A100-SXM4-80GB", False),
    ("H100", "NVIDIA GH100", False),
    ("A100, H100", "NVIDIA H100 80GB HBM3", True),
    ("L4", "NVIDIA L40S", False),
    ("Simulated GPU", "Simulated GPU", True),
])
def test_a_model_is_a_whole_word_of_the_gpus_name(model: str, name: str, matches: bool) -> None:
    assert model_matches(model, name) is matches


def test_binpack_takes_the_fullest_gpu_that_fits_and_spread_the_emptiest() -> None:
    rooms = [Room("a", "X", 8, 100), Room("b", "X", 3, 40), Room("c", "X", 5, 90), Room("d", "X", 5, 60),
             Room("e", "Y", 4, 100)]
    binpack, spread = PACKINGS["binpack"](), PACKINGS["spread"]()
    assert [r.uuid for r in place(rooms, 4, 50, 1, None, binpack)] == ["e"]
    assert [r.uuid for r in place(rooms, 4, 50, 1, "X", binpack)] == ["d"]  # 5 GiB: fuller than a; of d, c: less time
    assert [r.uuid for r in place(rooms, 4, 50, 2, None, spread)] == ["a", "c"]
    assert [r.uuid for r in place(rooms, 1, 0, 5, None, binpack)] == ["b", "e", "d", "c", "a"]
    with pytest.raises(Unplaceable, match=r"needs 2 X GPU\(s\) with 6 GiB and 90% free on each, and this node has 1 "
                                          r"\(the most free on one: 8 GiB, 100%\)"):
        place(rooms, 6, 90, 2, "X", spread)
    with pytest.raises(Unplaceable, match=r"no GPU of this node is a H100 \(its GPUs: X, Y\)"):
        place(rooms, 1, 1, 1, "H100", binpack)
