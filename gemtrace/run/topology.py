"""The GPUs of this host and what links them, read from NVML: the thin adapter behind placement.py.

Owns the NVML calls (through pynvml) and turning their answers into placement.GpuNode; the reading
(`read`) is apart from the building (`build`, a pure function over plain readings, tested without
NVML). PCIe comes from nvmlDeviceGetTopologyCommonAncestor; NVLinks from each link's state, remote
PCI bus id and version. A link whose remote is another GPU joins the two directly; one whose remote
is an NVSwitch (nvmlDeviceGetNvLinkRemoteDeviceType) joins every GPU with links to that switch, as on
a DGX A100 where NVML names the switches, never the peer. NOT_SUPPORTED means no NVLink. Never
decides anything. simgpu/'s NVML reports the topology that SIMGPU_TOPOLOGY names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gemtrace.gpus import nvml, text
from gemtrace.run.placement import GpuNode, Links, PcieLevel


@dataclass(frozen=True)
class NvLink:
    """One active link: the PCI bus id at its far end, whether that is an NVSwitch, its version."""

    remote_bus_id: str
    version: int
    to_switch: bool = False


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    memory_total: int
    bus_id: str
    nvlinks: Sequence[NvLink] = field(default_factory=tuple)


KNOWN_LEVELS = frozenset(level.value for level in PcieLevel)


def normalise_bus_id(bus_id: str) -> str:
    """NVML writes a bus id as 00000000:18:00.0 (GPU) or 0000:18:00.0 (some remote ends): one form."""
    domain, _, rest = bus_id.strip().lower().rpartition(":")
    domain, _, bus = domain.rpartition(":") if ":" in domain else ("0", "", domain)
    return f"{int(domain or '0', 16):08x}:{bus}:{rest}"


def build(readings: Sequence[GpuReading], ancestors: Mapping[tuple[int, int], int]) -> list[GpuNode]:
    """GpuNodes from the readings; `ancestors[(a, b)]` is NVML's common ancestor level of GPUs a and b."""
    by_bus = {normalise_bus_id(r.bus_id): r.index for r in readings}
    direct: dict[tuple[int, int], list[NvLink]] = {}
    switched: dict[int, Counter[str]] = {}
    for r in readings:
        switched[r.index] = Counter()
        for link in r.nvlinks:
            remote = normalise_bus_id(link.remote_bus_id)
            if link.to_switch:
                switched[r.index][remote] += 1
            elif remote in by_bus and by_bus[remote] != r.index:
                direct.setdefault((r.index, by_bus[remote]), []).append(link)
    versions = {r.index: max((link.version for link in r.nvlinks), default=0) for r in readings}
    nodes = []
    for r in readings:
        links = {}
        for other in readings:
            if other.index == r.index:
                continue
            own = direct.get((r.index, other.index), [])
            through_switch = sum(min(n, switched[other.index][s]) for s, n in switched[r.index].items())
            count = len(own) + through_switch
            level = ancestors.get((r.index, other.index), -1)
            links[other.index] = Links(
                pcie=PcieLevel(level) if level in KNOWN_LEVELS else None,
                nvlinks=count,
                nvlink_version=min(versions[r.index], versions[other.index]) if count else 0,
            )
        nodes.append(GpuNode(r.index, r.uuid, r.memory_total, links))
    return nodes


def _nvlinks(pynvml: Any, handle: Any) -> list[NvLink]:
    links = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            version = int(pynvml.nvmlDeviceGetNvLinkVersion(handle, link))
        except pynvml.NVMLError_NotSupported:
            break  # no NVLink on this GPU
        except pynvml.NVMLError_InvalidArgument:
            break  # past this GPU's last link (NVML_NVLINK_MAX_LINKS is the most any GPU has)
        try:
            kind = pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
        except (pynvml.NVMLError, AttributeError):  # older drivers or pynvml: a remote GPU or nothing
            kind = pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
        links.append(NvLink(remote, version, kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH))
    return links


def read() -> list[GpuNode]:
    """This host's GPUs in NVML's (physical) order, with their links; GpuDiscoveryError without NVML."""
    pynvml = nvml()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        readings = [
            GpuReading(
                index=i,
                uuid=text(pynvml.nvmlDeviceGetUUID(h)),
                memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                bus_id=text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                nvlinks=_nvlinks(pynvml, h),
            )
            for i, h in enumerate(handles)
        ]
        ancestors = {}
        for a, ha in enumerate(handles):
            for b, hb in enumerate(handles):
                if a != b:
                    try:
                        ancestors[(a, b)] = int(pynvml.nvmlDeviceGetTopologyCommonAncestor(ha, hb))
                    except pynvml.NVMLError:
                        pass  # unknown PCIe path: scored 0
        return build(readings, ancestors)
    finally:
        pynvml.nvmlShutdown()
