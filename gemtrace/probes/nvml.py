"""NVML reader: per-process device memory and device utilisation, for what eBPF and the gates miss.

Bound with ctypes to the library named at construction (default libnvidia-ml.so.1), so a test can
point it at the simulated NVML. NVML's figures are coarse (per-process utilisation often answers
Not Found and blurs processes together: processes of very different duty read alike; the device
figure is a busy fraction over about a second) and memory includes the context overhead (hundreds of
MiB a PyTorch process: bench/results/gpu_ebpf.md):
gemtrace uses them only where nothing better exists and says so.
Never raises on a missing or broken NVML: `available` is False and the readers return nothing.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

_SUCCESS = 0
_INSUFFICIENT_SIZE = 7


class _ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t (v2/v3)
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


@dataclass(frozen=True)
class NvmlProcess:
    pid: int
    gpu: str  # UUID
    used_bytes: int  # includes the context's own memory


class NvmlReader:
    def __init__(self, library: str = "libnvidia-ml.so.1") -> None:
        self.available = False
        self.reason = ""
        self._handles: list[tuple[str, ctypes.c_void_p]] = []
        try:
            # Room for each device's process list, learnt from NVML's answers: a list that did not
            # fit costs a second call, and the driver builds the whole list for each (the simulated
            # one reads /proc for every process listed: 1024 processes on 8 devices read it twice).
            self._room: list[int] = []
            self._lib = ctypes.CDLL(library)
            if self._lib.nvmlInit_v2() != _SUCCESS:
                raise OSError("nvmlInit_v2 failed")
            count = ctypes.c_uint()
            if self._lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != _SUCCESS:
                raise OSError("nvmlDeviceGetCount_v2 failed")
            for i in range(count.value):
                handle = ctypes.c_void_p()
                if self._lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != _SUCCESS:
                    continue
                uuid = ctypes.create_string_buffer(96)
                if self._lib.nvmlDeviceGetUUID(handle, uuid, 96) != _SUCCESS:
                    continue
                self._handles.append((uuid.value.decode(), handle))
                self._room.append(64)
            self.available = True
        except (OSError, AttributeError) as e:
            self.reason = f"NVML unavailable: {e}"

    def gpu_uuids(self) -> list[str]:
        return [uuid for uuid, _ in self._handles]

    def processes(self) -> list[NvmlProcess]:
        out: list[NvmlProcess] = []
        for device, (uuid, handle) in enumerate(self._handles):
            size = self._room[device]
            while True:
                count = ctypes.c_uint(size)
                infos = (_ProcessInfo * size)()
                r = self._lib.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(count), infos)
                if r == _INSUFFICIENT_SIZE and size < 65536:
                    # NVML says how many there are: room for those and a quarter more (processes
                    # that start before the next call), and for the next polls.
                    size = min(65536, max(4 * size, count.value + count.value // 4))
                    continue
                break
            self._room[device] = size
            if r != _SUCCESS:
                continue
            out.extend(NvmlProcess(infos[i].pid, uuid, infos[i].usedGpuMemory) for i in range(count.value))
        return out

    def utilization(self) -> dict[str, float]:
        """Busy fraction 0-1 of each GPU over NVML's own averaging window (about a second)."""
        out: dict[str, float] = {}
        for uuid, handle in self._handles:
            util = _Utilization()
            if self._lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) == _SUCCESS:
                out[uuid] = util.gpu / 100.0
        return out
