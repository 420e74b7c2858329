"""The merge, row by row of docs/accounting.md's table "Sources, best first" (gemtrace/agent/merge.py).

Each test names its row; the figures of each source differ, so a test fails if the wrong one wins.
"""

from __future__ import annotations

import pytest
from testkit import MiB

from gemtrace.agent import merge
from gemtrace.sources import Figures, SourceReading

pytestmark = pytest.mark.unit

GPU = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
KEY = (100, GPU)

EBPF = Figures(memory=300 * MiB, last_alloc_ns=5, launches=77)
SLOT = Figures(memory=320 * MiB, launches=1000, busy_ns=2_500_000_000)
NVML = Figures(memory=1100 * MiB)  # the context's ~800 MB included


def reading(figures: Figures | None, gated: bool = False) -> SourceReading:
    return SourceReading({KEY: figures} if figures is not None else {},
                         start_times={KEY[0]: 4242} if gated else {})


def merged(ebpf: Figures | None, slot: Figures | None, nvml: Figures | None, ebpf_on: bool = True,
           rebuilt: int | None = None) -> merge.Merged:
    return merge.merged(merge.inputs(KEY, reading(ebpf) if ebpf_on else None, reading(slot, gated=slot is not None),
                                     reading(nvml), rebuilt))


# -- row "memory" -----------------------------------------------------------------------------------


def test_memory_of_a_gated_process_is_ebpfs() -> None:
    assert merged(EBPF, SLOT, NVML).memory == 300 * MiB


def test_memory_of_a_gated_process_is_its_slots_where_ebpf_has_no_figure() -> None:
    assert merged(None, SLOT, NVML, ebpf_on=False).memory == 320 * MiB  # eBPF off
    assert merged(None, SLOT, NVML).memory == 320 * MiB  # on, but it never saw this process


def test_memory_of_an_inherited_gated_process_is_the_larger_of_ebpf_and_its_slot() -> None:
    rebuilt = merge.rebuilt_memory(True, SLOT, NVML, context_bytes=800 * MiB)
    assert rebuilt == 320 * MiB  # the slot, not NVML
    assert merged(EBPF, SLOT, NVML, rebuilt=rebuilt).memory == 320 * MiB
    more = Figures(memory=400 * MiB)  # eBPF saw more since: a slot lowered by hand hides nothing
    assert merged(more, SLOT, NVML, rebuilt=rebuilt).memory == 400 * MiB
    # Only where the gate places it: a slot's figure on a GPU outside its gpu_mask rebuilds nothing.
    assert merge.rebuilt_memory(True, SLOT._replace(placed=False), NVML, 0) is None


def test_memory_of_an_ungated_process_is_ebpfs() -> None:
    assert merged(EBPF, None, NVML).memory == 300 * MiB


def test_memory_of_an_ungated_process_is_nvmls_context_included_where_ebpf_has_no_figure() -> None:
    assert merged(None, None, NVML, ebpf_on=False).memory == 1100 * MiB
    assert merged(None, None, None, ebpf_on=False).memory == 0


def test_memory_of_an_inherited_ungated_process_is_the_larger_of_ebpf_and_nvml_less_the_context() -> None:
    rebuilt = merge.rebuilt_memory(False, None, NVML, context_bytes=800 * MiB)
    assert rebuilt == 300 * MiB
    assert merged(Figures(memory=100 * MiB), None, NVML, rebuilt=rebuilt).memory == 300 * MiB
    assert merged(Figures(memory=500 * MiB), None, NVML, rebuilt=rebuilt).memory == 500 * MiB
    # No overhead learnt yet: nothing taken off, an over-count that errs toward holding the limit.
    assert merge.rebuilt_memory(False, None, NVML, context_bytes=0) == 1100 * MiB
    assert merge.rebuilt_memory(False, None, None, context_bytes=0) is None


def test_the_context_overhead_is_the_smallest_nvml_less_true_figure_per_gpu() -> None:
    other = (101, GPU)
    gate = SourceReading({KEY: SLOT}, start_times={KEY[0]: 4242})
    nvml = SourceReading({KEY: NVML, other: Figures(memory=1000 * MiB)})
    ebpf = SourceReading({other: Figures(memory=250 * MiB)})
    # gated: 1100 - 320 = 780 MiB; ungated, seen by eBPF from its start: 1000 - 250 = 750 MiB
    assert merge.context_overhead(gate, nvml, ebpf, inherited=(), reused=()) == {GPU: 750 * MiB}
    # eBPF missed some of an inherited process's memory: its difference says nothing of the context.
    assert merge.context_overhead(gate, nvml, ebpf, inherited={101}, reused=()) == {GPU: 780 * MiB}
    # A slot whose pid was reused is a dead process's.
    assert merge.context_overhead(gate, nvml, ebpf, inherited={101}, reused={100}) == {}


# -- row "GPU time" ---------------------------------------------------------------------------------


def test_gpu_time_of_a_gated_process_is_the_gates_busy_time() -> None:
    assert merged(EBPF, SLOT, NVML).gate_seconds == 2.5


def test_gpu_time_of_an_ungated_process_starts_at_zero_for_nvml_to_add() -> None:
    # Accounting adds NVML's utilisation x time (tests/test_accounting_unit.py checks the figure).
    assert merged(EBPF, None, NVML).gate_seconds == 0.0


# -- row "launches" ---------------------------------------------------------------------------------


def test_launches_of_a_gated_process_are_the_gates() -> None:
    assert merged(EBPF, SLOT, NVML).launches == 1000


def test_launches_of_an_ungated_process_come_from_the_launches_probe_mode_else_unknown() -> None:
    assert merged(EBPF, None, NVML).launches == 77
    assert merged(Figures(memory=1), None, NVML).launches is None  # the default "memory" mode
    assert merged(None, None, NVML, ebpf_on=False).launches is None


# -- where a process is -------------------------------------------------------------------------------


def test_a_process_is_where_any_source_places_it_and_a_slot_where_its_gpu_mask_says() -> None:
    elsewhere = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
    gate = SourceReading({(1, GPU): Figures(memory=0), (1, elsewhere): Figures(memory=0, placed=False)},
                         start_times={1: 0})
    ebpf = SourceReading({(2, elsewhere): Figures(memory=5)})
    nvml = SourceReading({(3, GPU): Figures(memory=7)})
    assert merge.places(ebpf, gate, nvml) == {(1, GPU), (2, elsewhere), (3, GPU)}
    assert merge.places(None, gate, nvml) == {(1, GPU), (3, GPU)}


def test_a_gated_process_on_a_gpu_its_gate_never_used_counts_zeros_there_not_nvmls_figure() -> None:
    # The gates' source makes figures only where a slot's gpu_mask says (gemtrace/sources/gate.py):
    # NVML listing the process on another GPU (a context, nothing launched or allocated through the
    # gate) does not make NVML's figure, context included, its gated memory there.
    gate = SourceReading({}, start_times={KEY[0]: 0})
    m = merge.merged(merge.inputs(KEY, None, gate, reading(NVML), None))
    assert (m.memory, m.launches, m.gate_seconds, m.gated, m.slot_memory) == (0, 0, 0.0, True, 0)


# -- row "verified" (issue 25: what other users' gates count for a gated process) ----------------------


def test_verified_memory_with_ebpf_is_ebpfs_whatever_the_slot_says() -> None:
    liar = Figures(memory=1 << 40)
    assert merge.verified(True, EBPF, liar, NVML, nvml_on=True, inherited=False) == (300 * MiB, 0)
    # eBPF saw nothing of it: it holds nothing, the slot's terabyte notwithstanding
    assert merge.verified(True, None, liar, NVML, nvml_on=True, inherited=False) == (0, 0)
    assert merged(EBPF, liar, NVML).verified == 300 * MiB


def test_verified_memory_without_ebpf_is_the_slot_clamped_by_nvml() -> None:
    assert merge.verified(False, None, SLOT, NVML, nvml_on=True, inherited=False) == (320 * MiB, 0)
    liar = Figures(memory=1 << 40, managed=5 * MiB)
    assert merge.verified(False, None, liar, NVML, nvml_on=True, inherited=False) == (1100 * MiB, 5 * MiB)
    # NVML lists the process nowhere on that GPU: it holds nothing there
    assert merge.verified(False, None, liar, None, nvml_on=True, inherited=False) == (0, 5 * MiB)
    # nothing checks it: None, the slot's own figure is what counts
    assert merge.verified(False, None, liar, None, nvml_on=False, inherited=False) == (None, 5 * MiB)


def test_verified_managed_memory_a_gate_counted_as_device_memory_stays_device_memory() -> None:
    """eBPF counts every cuMemAllocManaged as managed; outside an Oversubscribe group the gate counts
    the program's own as device memory: the verified figures split as the slot does, never more."""
    seen = Figures(memory=100 * MiB, managed=50 * MiB)
    as_device = Figures(memory=150 * MiB, managed=0)
    assert merge.verified(True, seen, as_device, None, nvml_on=False, inherited=False) == (150 * MiB, 0)
    as_managed = Figures(memory=100 * MiB, managed=50 * MiB)
    assert merge.verified(True, seen, as_managed, None, nvml_on=False, inherited=False) == (100 * MiB, 50 * MiB)
    inflated = Figures(memory=100 * MiB, managed=1 << 40)
    assert merge.verified(True, seen, inflated, None, nvml_on=False, inherited=False) == (100 * MiB, 50 * MiB)


def test_verified_memory_of_an_inherited_process_adds_what_its_slot_shows_within_nvml() -> None:
    assert merge.verified(True, EBPF, Figures(memory=900 * MiB), NVML, nvml_on=True, inherited=True) == (900 * MiB, 0)
    assert merge.verified(True, EBPF, Figures(memory=1 << 40), NVML, nvml_on=True, inherited=True) == (1100 * MiB, 0)


def test_an_ungated_process_has_no_verified_figure() -> None:
    assert merged(EBPF, None, NVML).verified is None
