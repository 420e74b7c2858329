"""The simulated NVML's topology as the real pynvml reads it, and topology.build over plain readings.

pynvml's ctypes mirrors are the reference for the signatures and struct layouts: a wrong layout in
simgpu/nvml.c shows up here as a garbled bus id or a wrong level.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from simgpu_env import SimGpu

from gemtrace.run.placement import Links, PcieLevel
from gemtrace.run.topology import GpuReading, NvLink, build, normalise_bus_id

pytestmark = pytest.mark.unit

READ_LINKS = """
import pynvml as N
def call(f, *a):
    try:
        return f(*a)
    except N.NVMLError as e:
        return {"error": e.value}
for i in range(N.nvmlDeviceGetCount()):
    h = N.nvmlDeviceGetHandleByIndex(i)
    links = []
    for link in range(N.NVML_NVLINK_MAX_LINKS):
        state = call(N.nvmlDeviceGetNvLinkState, h, link)
        if isinstance(state, dict):
            links.append(state)
            break
        pci = N.nvmlDeviceGetNvLinkRemotePciInfo(h, link) if state else None
        links.append({"state": state, "bus": pci and pci.busId, "legacy": pci and pci.busIdLegacy,
                      "device_id": pci and pci.pciDeviceId,
                      "version": call(N.nvmlDeviceGetNvLinkVersion, h, link),
                      "type": call(N.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)})
    levels = [N.nvmlDeviceGetTopologyCommonAncestor(h, N.nvmlDeviceGetHandleByIndex(j))
              for j in range(N.nvmlDeviceGetCount())]
    emit({"bus": N.nvmlDeviceGetPciInfo(h).busId, "links": links, "levels": levels})
"""


def read(sim: SimGpu, topology: str) -> list[dict]:  # type: ignore[type-arg]
    return sim.nvml(READ_LINKS, SIMGPU_TOPOLOGY=topology)


def test_dgx1_links_read_back_through_pynvml(simgpu_factory: Callable[..., SimGpu]) -> None:
    gpus = read(simgpu_factory(devices=8), "dgx1")
    gpu0 = gpus[0]
    assert gpu0["bus"] == "00000000:10:00.0"
    # Six active links (1 to GPU 1, 1 to GPU 2, 2 to GPU 3, 2 to GPU 4), then past the last link.
    assert [link.get("bus") for link in gpu0["links"][:6]] == [
        "00000000:11:00.0", "00000000:12:00.0", "00000000:13:00.0", "00000000:13:00.0",
        "00000000:14:00.0", "00000000:14:00.0",
    ]
    assert gpu0["links"][0]["legacy"] == "0000:11:00.0"
    assert all(link["state"] == 1 and link["version"] == 2 and link["type"] == 0 for link in gpu0["links"][:6])
    assert gpu0["links"][6] == {"error": 2}  # NVML_ERROR_INVALID_ARGUMENT: no seventh link
    assert gpu0["levels"] == [0, 10, 30, 30, 50, 50, 50, 50]
    assert gpus[5]["levels"] == [50, 50, 50, 50, 10, 0, 30, 30]


def test_dgx_a100_links_go_to_nvswitches(simgpu_factory: Callable[..., SimGpu]) -> None:
    gpus = read(simgpu_factory(devices=8), "dgx-a100")
    links = gpus[3]["links"]
    assert len(links) == 13 and links[12] == {"error": 2}
    assert [link["bus"] for link in links[:12:2]] == [f"00000000:{0xC0 + s:02X}:00.0" for s in range(6)]
    assert all(link["type"] == 2 and link["version"] == 4 and link["device_id"] == 0x1AF110DE for link in links[:12])
    assert gpus[3]["levels"] == [40, 40, 10, 0, 50, 50, 50, 50]


@pytest.mark.parametrize("topology", ["hostbridge", "pcie"])
def test_boxes_without_nvlink_answer_not_supported(simgpu_factory: Callable[..., SimGpu], topology: str) -> None:
    gpus = read(simgpu_factory(devices=8), topology)
    assert gpus[0]["links"] == [{"error": 3}]  # NVML_ERROR_NOT_SUPPORTED
    assert gpus[0]["levels"] == ([0] + [30] * 7 if topology == "hostbridge" else [0, 10, 40, 40, 50, 50, 50, 50])


def test_links_to_gpus_not_simulated_are_down(simgpu_factory: Callable[..., SimGpu]) -> None:
    gpus = read(simgpu_factory(devices=4), "dgx1")
    assert [link["state"] for link in gpus[0]["links"][:6]] == [1, 1, 1, 1, 0, 0]  # the two to GPU 4


def test_the_topology_is_the_simulations_not_each_process(simgpu_factory: Callable[..., SimGpu]) -> None:
    sim = simgpu_factory(devices=8)
    read(sim, "dgx1")
    code = "emit({'state': pynvml.nvmlDeviceGetNvLinkState(pynvml.nvmlDeviceGetHandleByIndex(0), 0)})"
    assert sim.nvml(code) == [{"state": 1}]  # made as dgx1; this process names no topology


# ---- build: readings -> nodes ----------------------------------------------------------------


def test_bus_ids_compare_in_either_form() -> None:
    assert normalise_bus_id("00000000:1A:00.0") == normalise_bus_id("0000:1a:00.0") == "00000000:1a:00.0"


def test_direct_links_count_per_pair_and_unknown_remotes_are_ignored() -> None:
    readings = [
        GpuReading(0, "GPU-a", 1, "00000000:10:00.0",
                   [NvLink("0000:11:00.0", 3), NvLink("0000:11:00.0", 3), NvLink("0000:99:00.0", 3)]),
        GpuReading(1, "GPU-b", 1, "00000000:11:00.0", [NvLink("00000000:10:00.0", 3)] * 2),
    ]
    nodes = build(readings, {(0, 1): 10, (1, 0): 10})
    assert nodes[0].links == {1: Links(PcieLevel.SINGLE_SWITCH, 2, 3)}
    assert nodes[1].links == {0: Links(PcieLevel.SINGLE_SWITCH, 2, 3)}


def test_links_through_common_switches_join_gpus() -> None:
    def on(*switches: str) -> list[NvLink]:
        return [NvLink(s, 4, to_switch=True) for s in switches]

    readings = [
        GpuReading(0, "GPU-a", 1, "0000:10:00.0", on("0000:c0:00.0", "0000:c0:00.0", "0000:c1:00.0")),
        GpuReading(1, "GPU-b", 1, "0000:11:00.0", on("0000:c0:00.0", "0000:c1:00.0", "0000:c1:00.0")),
        GpuReading(2, "GPU-c", 1, "0000:12:00.0", on("0000:c2:00.0")),
    ]
    nodes = build(readings, {})
    assert nodes[0].links[1] == Links(None, 2, 4)  # one link's worth through each shared switch
    assert nodes[0].links[2] == Links(None, 0, 0)
