"""What a `gemtrace run` is allotted besides its group: the GPUs it sees (`--gpus N`, chosen by a
placement policy) and the memory share frameworks are told (framework_env.py).

Owns gathering what those choices need: the running agent's region (groups' limits, live slots),
this host's topology (topology.py), the resource file when no agent runs. It returns variables to
add to the command's environment and never writes the region: the choice is advice the gate then
enforces through the group's limit, not a reservation (docs/placement.md).

CUDA_VISIBLE_DEVICES already set (by the user, Slurm, a container runtime) is taken as the GPUs
the command may have: --gpus chooses among those, and the answer names them by UUID.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from gemtrace import defaults
from gemtrace import region as rg
from gemtrace.config import ConfigError, format_size, load
from gemtrace.gpus import GpuDiscoveryError, discover
from gemtrace.groups_of import ENV_VISIBLE_DEVICES, visible_devices
from gemtrace.run import framework_env, placement, topology
from gemtrace.run.placement import GpuNode, GroupUse


class AllotmentError(Exception):
    """Why the GPUs asked for cannot be allotted; `status` is the exit status the launcher gives (2: a
    usage error, 1: no room now). The launcher turns it into its LaunchError: this module sits below it."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def group_uses(layout: rg.RegionLayout, table: rg.SlotTableLayout, index_of_uuid: Mapping[str, int]) -> list[GroupUse]:
    """Each named group's limit and, per GPU (by topology index, found through the GPU's UUID), its
    live processes (in the group the agent assigned them) and the memory they hold there."""
    gpu_index = {g: index_of_uuid.get(layout.gpus[g].uuid.decode()) for g in range(layout.header.n_gpus)}
    present: dict[int, set[int]] = {}
    memory: dict[int, dict[int, int]] = {}
    for slot, group in zip(table.slots, rg.SlotColumns(layout, table).groups(), strict=True):
        if not slot.pid or group == rg.GROUP_UNASSIGNED:
            continue
        for g, index in gpu_index.items():
            if index is None:
                continue
            if slot.gpu_mask & (1 << g):
                present.setdefault(group, set()).add(index)
            if slot.memory[g]:
                held = memory.setdefault(group, {})
                held[index] = held.get(index, 0) + slot.memory[g]
    return [
        GroupUse(
            name=group.name.decode(),
            memory_limit=None if group.memory_limit == rg.NO_LIMIT else group.memory_limit,
            present=frozenset(present.get(i, ())),
            memory=memory.get(i, {}),
        )
        for i, group in enumerate(layout.groups)
        if group.name
    ]


def group_limit(group: str, layout: rg.RegionLayout | None, config: Path | None) -> int | None:
    """The group's MemoryLimit: from the running agent, else from the resource file (None: none)."""
    if layout is not None and config is None:
        for entry in layout.groups:
            if entry.defined and entry.name.decode(errors="replace") == group:
                limit = int(entry.memory_limit)
                return None if limit == rg.NO_LIMIT else limit
    try:
        settings = load(config or defaults.CONFIG_PATH).groups.get(group)
    except ConfigError:
        return None  # the launcher has checked the group already; no file means no limit known
    return None if settings is None else settings.memory_limit


def gpu_totals(layout: rg.RegionLayout | None) -> dict[str, int]:
    """Each GPU's memory by UUID: as the running agent published it, else from NVML ({} without)."""
    if layout is not None:
        return {g.uuid.decode(): int(g.memory_total) for g in layout.gpus[: layout.header.n_gpus]}
    try:
        return {g.uuid: g.memory_total for g in discover()}
    except GpuDiscoveryError:
        return {}


def choose(
    group: str,
    count: int,
    policy: str,
    limit: int | None,
    nodes: Sequence[GpuNode],
    uses: Sequence[GroupUse],
    visible: str | None,
) -> list[GpuNode]:
    """`count` GPUs for `group` among those CUDA_VISIBLE_DEVICES (`visible`) allows, free by the
    groups' claims, picked by `policy`; AllotmentError says why none could be."""
    allowed = set(visible_devices(visible, [n.uuid for n in nodes]))
    candidates = [n for n in nodes if n.uuid in allowed]
    if visible is not None and not candidates:
        raise AllotmentError(f"{ENV_VISIBLE_DEVICES}={visible} names none of this host's GPUs; unset it or "
                             "name GPUs by index or UUID")
    where = f"{ENV_VISIBLE_DEVICES}={visible} allows" if visible is not None else "this host has"
    if len(candidates) < count:
        raise AllotmentError(f"--gpus {count}: {where} only {len(candidates)} GPUs; ask for fewer")
    free = placement.free_for(group, limit, candidates, uses)
    chosen = placement.POLICIES[policy]().allocate(free, count)
    if chosen:
        return chosen
    need = "a whole GPU" if limit is None else f"{format_size(limit)} (its MemoryLimit)"
    raise AllotmentError(
        f"--gpus {count}: of the {len(candidates)} GPUs {where}, only {len(free)} have room for group "
        f"{group!r}, which needs {need} on each (other groups' running processes claim the rest: "
        "`gemtrace status` shows them); ask for fewer GPUs or wait",
        status=1,
    )


def environment(
    group: str,
    gpus: int | None,
    policy: str,
    layout: rg.RegionLayout | None,
    config: Path | None,
    environ: Mapping[str, str],
    table: rg.SlotTableLayout | None = None,
) -> dict[str, str]:
    """The variables to add to the command's environment: CUDA_VISIBLE_DEVICES for --gpus, and the
    frameworks' memory variables for the group's limit. `layout` and `table` are the running agent's
    region and slots (the launcher has read them and warned when there are none: then every GPU
    counts as free)."""
    limit = group_limit(group, layout, config)
    added: dict[str, str] = {}
    gpu_memory: int | None = None
    if gpus is not None:
        try:
            nodes = topology.read()
        except GpuDiscoveryError as e:
            raise AllotmentError(f"--gpus needs this host's GPUs: {e}") from None
        uses = [] if layout is None or table is None else group_uses(layout, table, {n.uuid: n.index for n in nodes})
        chosen = choose(group, gpus, policy, limit, nodes, uses, environ.get(ENV_VISIBLE_DEVICES))
        added[ENV_VISIBLE_DEVICES] = ",".join(n.uuid for n in chosen)
        gpu_memory = min(n.memory_total for n in chosen)
    elif limit is not None:
        totals = gpu_totals(layout)
        seen = [totals[u] for u in visible_devices(environ.get(ENV_VISIBLE_DEVICES), list(totals))]
        gpu_memory = min(seen, default=None)
    added.update(framework_env.variables(limit, gpu_memory, {**environ, **added}))
    return added
