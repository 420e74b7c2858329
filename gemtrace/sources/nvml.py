"""NVML's source: per-process device memory (context included) and each GPU's busy fraction.

Owns the per-poll NVML reads (NvmlReader) and turning them into figures (NvmlSource). NVML is bound
once for the whole package, by pynvml, initialised by gemtrace.gpus.nvml(); the simulated NVML of
simgpu/ is found the same way (LD_LIBRARY_PATH). NVML's figures are coarse (per-process utilisation
often answers Not Found and blurs processes together: processes of very different duty read alike;
the device figure is a busy fraction over about a second) and memory includes the context overhead
(hundreds of MiB a PyTorch process: bench/results/gpu_ebpf.md): gemtrace uses them only where eBPF
and the gates know nothing better (docs/accounting.md), and says so. Never raises on a missing or
broken NVML: `available` is False and the readers return nothing.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gemtrace.gpus import GpuDiscoveryError, nvml, text
from gemtrace.sources import Devices, Figures, Key, SourceReading


@dataclass(frozen=True)
class NvmlProcess:
    pid: int
    gpu: str  # UUID
    used_bytes: int  # includes the context's own memory


_MOST_PROCESSES = 65536  # a device's process list is never asked for with more room than this


def _entry_layout(info: Any) -> struct.Struct:
    """An entry of NVML's process list as (pid, usedGpuMemory), at the offsets pynvml's structure gives."""
    pid, used, size = info.pid.offset, info.usedGpuMemory.offset, ctypes.sizeof(info)
    if pid + 4 > used or used + 8 > size:
        raise GpuDiscoveryError(f"NVML's process entry has an unexpected layout (pid at {pid}, memory at {used})")
    return struct.Struct(f"={pid}xI{used - pid - 4}xQ{size - used - 8}x")


class NvmlReader:
    def __init__(self, room: int = 64) -> None:
        """`room`: how many processes a device's list has room for at first; it grows as NVML answers."""
        self.available = False
        self.reason = ""
        self._handles: list[tuple[str, Any]] = []
        self._room: list[int] = []  # per device, learnt from NVML's answers (see processes())
        try:
            self._nvml = nvml()
        except GpuDiscoveryError as e:
            self.reason = str(e)
            return
        try:
            for i in range(self._nvml.nvmlDeviceGetCount()):
                try:
                    handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
                    uuid = text(self._nvml.nvmlDeviceGetUUID(handle))
                except self._nvml.NVMLError:
                    continue  # a device NVML cannot name is one no figure can be placed on
                self._handles.append((uuid, handle))
                self._room.append(room)
            # pynvml's own lookup, which each of its wrappers calls (private, but the version is pinned:
            # constraints.txt, packaging/deb/vendor.txt); processes() says why it goes around the wrapper.
            self._list = self._nvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
            self._entry = _entry_layout(self._nvml.c_nvmlProcessInfo_v3_t)
            self.available = True
        except (self._nvml.NVMLError, GpuDiscoveryError) as e:  # a subclass per code: Uninitialized, ...
            self.reason = f"NVML unavailable: {e}"

    def gpu_uuids(self) -> list[str]:
        return [uuid for uuid, _ in self._handles]

    def processes(self) -> list[NvmlProcess]:
        # pynvml's nvmlDeviceGetComputeRunningProcesses asks each device twice at every call (once
        # for the count) and makes an object per process; the driver builds the whole list at each
        # ask (the simulated one checks every listed process's liveness). Through pynvml's binding of
        # the same function, with room learnt from NVML's answers, a poll asks once a device.
        out: list[NvmlProcess] = []
        if not self.available:
            return out
        nvml = self._nvml
        for device, (uuid, handle) in enumerate(self._handles):
            size = self._room[device]
            while True:
                count = ctypes.c_uint(size)
                infos = (nvml.c_nvmlProcessInfo_v3_t * size)()
                r = self._list(handle, ctypes.byref(count), infos)
                if r == nvml.NVML_ERROR_INSUFFICIENT_SIZE and size < _MOST_PROCESSES:
                    # NVML says how many there are: room for those and a quarter more (processes
                    # that start before the next call), and for the next polls.
                    size = min(_MOST_PROCESSES, max(4 * size, count.value + count.value // 4))
                    continue
                break
            self._room[device] = size
            if r != nvml.NVML_SUCCESS:
                continue
            # The entries' two fields through one struct unpacking each: pynvml's structures answer every
            # field read through a Python __getattribute__ (a sixth of the accounting poll at 1024 processes).
            raw = ctypes.string_at(infos, count.value * self._entry.size)
            out.extend(NvmlProcess(pid, uuid, used) for pid, used in self._entry.iter_unpack(raw))
        return out

    def utilization(self) -> dict[str, float]:
        """Busy fraction 0-1 of each GPU over NVML's own averaging window (about a second)."""
        out: dict[str, float] = {}
        if not self.available:
            return out
        for uuid, handle in self._handles:
            try:
                out[uuid] = self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except self._nvml.NVMLError:
                pass  # this GPU reads as no figure, as NVML's Not Supported says
        return out


class NvmlLike(Protocol):
    """NvmlReader's shape; tests/fake_sources.py has a fake."""

    @property
    def available(self) -> bool: ...

    def gpu_uuids(self) -> list[str]: ...

    def processes(self) -> Sequence[NvmlProcess]: ...

    def utilization(self) -> dict[str, float]: ...


class NvmlSource:
    def __init__(self, reader: NvmlLike) -> None:
        self.reader = reader

    @property
    def available(self) -> bool:
        return self.reader.available

    def gpu_uuids(self) -> list[str]:
        return self.reader.gpu_uuids()

    def read(self, now_ns: int, devices: Devices, utilization: bool = True) -> SourceReading:
        """`utilization` False: per-process memory only (the rebuild after a restart needs no more)."""
        if not self.reader.available:
            return SourceReading()
        figures: dict[Key, Figures] = {(p.pid, p.gpu): Figures(memory=p.used_bytes) for p in self.reader.processes()}
        return SourceReading(figures, utilization=self.reader.utilization() if utilization else {})
