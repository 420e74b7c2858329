"""The GPUs of this host, from NVML: index, UUID, name, memory. Read once at agent start.

Also the package's one binding of NVML: pynvml (NVIDIA's own bindings), initialised by nvml(), which
run/topology.py and the accounting's NVML source (sources/nvml.py) call too. Never used on a per-call
path. Without NVML (no driver, no libnvidia-ml) it raises GpuDiscoveryError with what to check; the
simulated GPU in simgpu/ provides an NVML that pynvml loads unmodified.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType


class GpuDiscoveryError(Exception):
    pass


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    memory_total: int


def text(value: str | bytes) -> str:
    """A string pynvml answers: bytes from older versions, str from newer."""
    return value.decode() if isinstance(value, bytes) else value


def nvml() -> ModuleType:
    """pynvml, initialised; GpuDiscoveryError (saying what to check) when NVML cannot be had."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # pynvml raises NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise GpuDiscoveryError(
            f"NVML is not available ({e}); is the NVIDIA driver installed and libnvidia-ml.so.1 on the "
            "library path?"
        ) from None
    return pynvml


def discover() -> list[Gpu]:
    pynvml = nvml()
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        gpus.append(Gpu(
            index=index,
            uuid=text(pynvml.nvmlDeviceGetUUID(handle)),
            name=text(pynvml.nvmlDeviceGetName(handle)),
            memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
        ))
    return gpus
