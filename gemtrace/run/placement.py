"""Which GPUs a `gemtrace run --gpus N` gets: the topology as plain data, the policies that choose,
and the arithmetic of which GPUs are free for a group. And which GPUs a pod's share goes to on a
Kubernetes node (`place`): whole on each GPU, of the model asked, binpacked or spread.

Owns the scores and the choice; never touches NVML or the region (topology.py reads the one,
allotment.py the other). A policy is one class with one method, `allocate(available, size)`, as
go-gpuallocator's `Policy.Allocate` (https://github.com/NVIDIA/go-gpuallocator), registered in
POLICIES by one line; docs/placement.md explains the scores and why best-effort looks ahead.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import combinations
from typing import Protocol


class PcieLevel(enum.IntEnum):
    """The closest common ancestor of two GPUs on PCIe, with NVML's values
    (nvmlGpuTopologyLevel_t: NVML_TOPOLOGY_INTERNAL ... NVML_TOPOLOGY_SYSTEM)."""

    SAME_BOARD = 0
    SINGLE_SWITCH = 10
    MULTIPLE_SWITCHES = 20
    HOST_BRIDGE = 30
    SAME_CPU = 40
    ACROSS_CPUS = 50


# The closer the ancestor, the cheaper peer traffic: go-gpuallocator's P2PLink scores.
PCIE_SCORE = {
    PcieLevel.SAME_BOARD: 60,
    PcieLevel.SINGLE_SWITCH: 50,
    PcieLevel.MULTIPLE_SWITCHES: 40,
    PcieLevel.HOST_BRIDGE: 30,
    PcieLevel.SAME_CPU: 20,
    PcieLevel.ACROSS_CPUS: 10,
}
NVLINK_SCORE = 100
"""Per NVLink between two GPUs: one more link always outweighs any PCIe difference (at most 50)."""


@dataclass(frozen=True)
class Links:
    """What joins one GPU to another: the PCIe path (None where NVML did not say) and NVLinks, direct
    or through common NVSwitches, with their generation (NVML's nvmlNvlinkVersion_t, 0 unknown)."""

    pcie: PcieLevel | None = None
    nvlinks: int = 0
    nvlink_version: int = 0


@dataclass(frozen=True)
class GpuNode:
    index: int
    uuid: str
    memory_total: int
    links: Mapping[int, Links] = field(default_factory=dict)
    """The other GPUs' indexes -> what joins this GPU to them."""


def pair_score(a: GpuNode, b: GpuNode) -> int:
    """go-gpuallocator's pair score, plus a tie-break between NVLink generations: the version code
    (1..8) per link, at most 8 * 12 = 96 for a 12-link pair, below the 100 of one more link."""
    links = a.links.get(b.index)
    if links is None:
        return 0
    score = PCIE_SCORE[links.pcie] if links.pcie is not None else 0
    return score + links.nvlinks * (NVLINK_SCORE + links.nvlink_version)


def set_score(gpus: Iterable[GpuNode]) -> int:
    members = list(gpus)
    return sum(pair_score(a, b) for a, b in combinations(members, 2))


class Policy(Protocol):
    def allocate(self, available: Sequence[GpuNode], size: int) -> list[GpuNode]:
        """`size` GPUs of `available`, or [] when there are fewer than `size`."""
        ...


class SimplePolicy:
    """The first `size` available GPUs, in index order."""

    def allocate(self, available: Sequence[GpuNode], size: int) -> list[GpuNode]:
        if size <= 0 or len(available) < size:
            return []
        return sorted(available, key=lambda g: g.index)[:size]


class BestEffortPolicy:
    """The best-linked `size` GPUs, chosen so that the GPUs left over still split well into sets of
    the same size (the next request is assumed to be like this one).

    Of every way to split the available GPUs into sets of `size` (and, when `size` does not divide
    their number, one smaller set of the remainder: go-gpuallocator's padding, all in one set), it
    takes the split with the highest total score, then the highest-scoring full set in it. Ties go
    to the split that comes first with the GPUs in index order. The search is memoised over the
    GPUs still unassigned, which keeps 8 GPUs in milliseconds (105 splits into pairs, 280 into
    triples and a pair) and 16 GPUs within seconds.
    """

    def allocate(self, available: Sequence[GpuNode], size: int) -> list[GpuNode]:
        gpus = sorted(available, key=lambda g: g.index)
        if size <= 0 or len(gpus) < size:
            return []
        if size == len(gpus):
            return gpus
        n = len(gpus)
        score = [[pair_score(a, b) for b in gpus] for a in gpus]
        remainder = n % size

        def members_score(members: tuple[int, ...]) -> int:
            return sum(score[i][j] for i, j in combinations(members, 2))

        @cache
        def best(left: frozenset[int], short_placed: bool) -> tuple[int, tuple[tuple[int, ...], ...]]:
            """The best split of the GPUs at positions `left`: (total, sets in order of their first GPU)."""
            if not left:
                return 0, ()
            first, *rest = sorted(left)
            top: tuple[int, tuple[tuple[int, ...], ...]] | None = None
            sizes = [size] + ([remainder] if remainder and not short_placed else [])
            for set_size in sizes:
                if set_size > len(left):
                    continue
                for others in combinations(rest, set_size - 1):
                    members = (first, *others)
                    total, sets = best(left - set(members), short_placed or set_size != size)
                    total += members_score(members)
                    if top is None or total > top[0]:
                        top = (total, (members, *sets))
            # A split always exists: `left` holds whole sets plus at most the one short set.
            assert top is not None
            return top

        _, sets = best(frozenset(range(n)), remainder == 0)
        full = [members for members in sets if len(members) == size]
        chosen = max(full, key=members_score)  # max keeps the first of equals
        return [gpus[i] for i in chosen]


POLICIES: dict[str, Callable[[], Policy]] = {
    "simple": SimplePolicy,
    "best-effort": BestEffortPolicy,
}
DEFAULT_POLICY = "best-effort"


# ---- which GPUs are free for a group -----------------------------------------------------------


@dataclass(frozen=True)
class GroupUse:
    """One group as the region shows it: its MemoryLimit (None: the whole GPU) and, per GPU index,
    whether it has a live process there and the memory its processes hold there."""

    name: str
    memory_limit: int | None
    present: frozenset[int] = frozenset()
    memory: Mapping[int, int] = field(default_factory=dict)


def claimed(use: GroupUse, gpu: int, memory_total: int) -> int:
    """What `use`'s group claims on a GPU: its limit (the whole GPU without one) where it has a live
    process, since it may grow to that at any moment; elsewhere only the memory it holds."""
    if gpu in use.present:
        return memory_total if use.memory_limit is None else min(use.memory_limit, memory_total)
    return min(use.memory.get(gpu, 0), memory_total)


def free_for(group: str, limit: int | None, gpus: Sequence[GpuNode], uses: Iterable[GroupUse]) -> list[GpuNode]:
    """The GPUs on which the other groups' claims leave room for `group`'s limit (the whole GPU
    when it has none). The group's own processes do not count: they share its limit."""
    others = [u for u in uses if u.name != group]
    free = []
    for gpu in gpus:
        need = gpu.memory_total if limit is None else min(limit, gpu.memory_total)
        taken = sum(claimed(u, gpu.index, gpu.memory_total) for u in others)
        if gpu.memory_total - taken >= need:
            free.append(gpu)
    return free


# ---- which GPUs a pod's share goes to on a Kubernetes node ----------------------------------------


@dataclass(frozen=True)
class Room:
    """One GPU as the device plugin sees it: its NVML name and the units (GiB, percent) that no
    container holds yet."""

    uuid: str
    name: str
    memory: int
    util: int


class Packing(Protocol):
    def order(self, rooms: Sequence[Room]) -> list[Room]:
        """`rooms` (each of which fits the request) in the order to fill them; ties keep their order."""
        ...


class Binpack:
    """The fullest GPU that fits first: the free GPUs stay whole for the large requests to come."""

    def order(self, rooms: Sequence[Room]) -> list[Room]:
        return sorted(rooms, key=lambda r: (r.memory, r.util))


class Spread:
    """The emptiest GPU first: a pod shares a GPU only once every GPU has one, and competes least."""

    def order(self, rooms: Sequence[Room]) -> list[Room]:
        return sorted(rooms, key=lambda r: (-r.memory, -r.util))


PACKINGS: dict[str, Callable[[], Packing]] = {
    "binpack": Binpack,
    "spread": Spread,
}
DEFAULT_PACKING = "binpack"


class Unplaceable(Exception):
    """No GPU set fits a request; str() is a sentence for the pod's owner."""


def model_matches(model: str, name: str) -> bool:
    """Whether a GPU named `name` (NVML's, e.g. "NVIDIA H100 80GB HBM3") is the `model` asked: any of
    its comma-separated names as a whole word, case aside ("H100" is an H100, "A10" no A100)."""
    return any(re.search(rf"(?<![a-z0-9]){re.escape(m.strip())}(?![a-z0-9])", name, re.IGNORECASE)
               for m in model.split(",") if m.strip())


def place(rooms: Sequence[Room], memory: int, util: int, count: int, model: str | None,
          packing: Packing) -> list[Room]:
    """`count` distinct GPUs of `rooms` each with `memory` GiB and `util` percent free, of `model` if
    given, in the packing's order; Unplaceable says why there are none."""
    if model is not None:
        matching = [r for r in rooms if model_matches(model, r.name)]
        if not matching:
            names = ", ".join(sorted({r.name for r in rooms})) or "none"
            raise Unplaceable(f"no GPU of this node is a {model} (its GPUs: {names}); ask for one of those "
                              "models, or schedule the pod on a node that has it (a nodeSelector)")
    else:
        matching = list(rooms)
    fitting = [r for r in matching if r.memory >= memory and r.util >= util]
    if len(fitting) < count:
        of_model = f"{model} " if model is not None else ""
        raise Unplaceable(f"the pod needs {count} {of_model}GPU(s) with {memory} GiB and "
                          f"{util}% free on each, and this node has {len(fitting)} (the most free on one: "
                          f"{max((r.memory for r in matching), default=0)} GiB, "
                          f"{max((r.util for r in matching), default=0)}%); ask for less, or for more GPUs "
                          "with less on each (gemtrace.io/gpus)")
    return packing.order(fitting)[:count]
