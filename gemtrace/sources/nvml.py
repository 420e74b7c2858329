"""NVML's source: per-process device memory (context included) and each GPU's busy fraction.

Owns nothing but the reading: gemtrace/probes/nvml.py binds the library. Coarse figures, used only
where eBPF and the gates know nothing better (docs/accounting.md). Never raises: an unavailable
NVML reads as nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gemtrace.probes.nvml import NvmlProcess
from gemtrace.sources import Devices, Figures, Key, SourceReading


class NvmlLike(Protocol):
    """NvmlReader's shape (gemtrace/probes/nvml.py); tests/fake_sources.py has a fake."""

    @property
    def available(self) -> bool: ...

    def gpu_uuids(self) -> list[str]: ...

    def processes(self) -> Sequence[NvmlProcess]: ...

    def utilization(self) -> dict[str, float]: ...


class NvmlSource:
    def __init__(self, reader: NvmlLike) -> None:
        self.reader = reader

    def gpu_uuids(self) -> list[str]:
        return self.reader.gpu_uuids()

    def read(self, now_ns: int, devices: Devices, utilization: bool = True) -> SourceReading:
        """`utilization` False: per-process memory only (the rebuild after a restart needs no more)."""
        if not self.reader.available:
            return SourceReading()
        figures: dict[Key, Figures] = {(p.pid, p.gpu): Figures(memory=p.used_bytes) for p in self.reader.processes()}
        return SourceReading(figures, utilization=self.reader.utilization() if utilization else {})
