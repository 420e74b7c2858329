"""Unit tests of the accounting's parsers, readers over fixture /proc trees, the Snapshot built
from gate slots (no eBPF), GPU time from slots, and per-process series leaving at the poll after an exit."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path

import pytest
from fake_sources import Config, FakeEbpf, FakeGate, FakeNvml, group
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from testkit import MiB, claim

from gemtrace.agent.accounting import Accounting, ProcessAccount, Snapshot, Sources
from gemtrace.agent.collectors.processes import ProcessCollector
from gemtrace.agent.enforcement import Enforcement, MemoryEnforcer
from gemtrace.agent.gpu_time import GpuTimeShare
from gemtrace.agent.merge import Merged
from gemtrace.agent.process_facts import ProcessFacts
from gemtrace.groups_of import ProcReader, group_for, parse_cgroup, parse_environ, visible_devices
from gemtrace.region import Region
from gemtrace.sources import Figures, Key
from gemtrace.sources.ebpf import libcuda
from gemtrace.sources.ebpf.probes import has_bpf_privilege
from gemtrace.sources.gate import GateSource
from gemtrace.sources.nvml import NvmlProcess, NvmlSource

pytestmark = pytest.mark.unit

UUIDS = ["GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000"]

MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 fd:01 1234 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04
7f0000001000-7f0000100000 r-xp 00001000 fd:01 1234 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04
7f0000200000-7f0000300000 r-xp 00001000 00:2a 99 /opt/app/libcuda.so.1
7f0000300000-7f0000400000 r-xp 00001000 fd:01 555 /usr/lib/libcudart.so.12
7f0000400000-7f0000500000 r-xp 00001000 fd:01 556 /old/libcuda.so.1 (deleted)
7f0000500000-7f0000600000 rw-p 00000000 00:00 0
"""


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_parse_maps_finds_each_libcuda_file_once() -> None:
    found = libcuda.parse_maps(MAPS)
    assert found == {
        libcuda.FileId("fd:01", 1234): "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04",
        libcuda.FileId("00:2a", 99): "/opt/app/libcuda.so.1",
    }


def _proc_tree(root: Path, pid: int, maps: str = "", environ: bytes = b"", cgroup: str = "0::/\n",
               comm: str = "python3", state: str = "S", start: int = 4242) -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "maps").write_text(maps)
    (d / "environ").write_bytes(environ)
    (d / "cgroup").write_text(cgroup)
    (d / "comm").write_text(comm + "\n")
    fields = [state] + ["0"] * 18 + [str(start)] + ["0"] * 10
    (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")


def test_scan_groups_pids_by_file_and_reaches_other_namespaces_through_proc_root(tmp_path: Path) -> None:
    _proc_tree(tmp_path, 10, MAPS)
    _proc_tree(tmp_path, 11, MAPS.splitlines()[0] + "\n")
    _proc_tree(tmp_path, 12, "")
    files = libcuda.scan(tmp_path)
    main = files[libcuda.FileId("fd:01", 1234)]
    assert main.pids == {10, 11}
    lib = tmp_path / "11" / "root" / "usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF")
    assert main.reachable_path(tmp_path) == lib


def test_a_process_without_libcuda_is_read_less_and_less_often_and_a_late_load_is_still_found(
        tmp_path: Path) -> None:
    now = [0.0]
    scanner = libcuda.Scanner(tmp_path, clock=lambda: now[0])
    _proc_tree(tmp_path, 12, "")
    found_at = None
    for second in range(40):  # one scan a second, as the agent's watcher does
        now[0] = float(second)
        if second == 20:  # the program loads CUDA late (a notebook importing torch)
            (tmp_path / "12" / "maps").write_text(MAPS)
        if scanner.scan() and found_at is None:
            found_at = second
    # Read at 0, 1, 3, 7, 15 (5 reads in 20 scans, not 20), then 23: found there, within the bound.
    assert found_at == 23 and found_at - 20 <= libcuda.NON_USER_RECHECK_MAX_SECONDS
    _proc_tree(tmp_path, 13, MAPS)  # a new process is read at the next scan
    now[0] = 40.0
    assert 13 in scanner.scan()[libcuda.FileId("fd:01", 1234)].pids


def test_parse_ldconfig_names_the_host_libcuda() -> None:
    text = (
        "1234 libs found in cache `/etc/ld.so.cache'\n"
        "\tlibcudart.so.12 (libc6,x86-64) => /usr/local/cuda/lib64/libcudart.so.12\n"
        "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
        "\tlibcuda.so (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so\n"
    )
    assert libcuda.parse_ldconfig(text) == [Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1")]


def test_bpf_privilege_is_read_from_effective_capabilities() -> None:
    assert has_bpf_privilege("Name:\tx\nCapEff:\t000001ffffffffff\n")  # root
    assert not has_bpf_privilege("CapEff:\t0000000000000000\n")
    assert has_bpf_privilege("CapEff:\t000000c000000000\n")  # CAP_BPF + CAP_PERFMON
    assert not has_bpf_privilege("CapEff:\t0000008000000000\n")  # CAP_BPF alone


def test_environ_cgroup_and_group_rules() -> None:
    env = parse_environ(b"A=1\0GEMTRACE_GROUP=train\0CUDA_VISIBLE_DEVICES=1\0")
    assert env == {"A": "1", "GEMTRACE_GROUP": "train", "CUDA_VISIBLE_DEVICES": "1"}
    cgroups = parse_cgroup("12:memory:/v1path\n0::/kubepods/burstable/pod1234/abcdef\n")
    assert cgroups == ["/kubepods/burstable/pod1234/abcdef", "/v1path"]
    rules = {
        "pods": ("/kubepods",),
        "pod1234": ("/kubepods/burstable/pod1234",),
        "other": ("/kubepods/burstable/pod12",),
    }
    assert group_for(env, cgroups, rules) == "train"  # the environment wins
    assert group_for({}, cgroups, rules) == "pod1234"  # longest prefix, at a path boundary
    assert group_for({}, ["/system.slice/x"], rules) == "default"


def test_visible_devices_by_ordinal_uuid_and_prefix() -> None:
    assert visible_devices(None, UUIDS) == UUIDS
    assert visible_devices("1", UUIDS) == [UUIDS[1]]
    assert visible_devices("GPU-bbbb,0", UUIDS) == [UUIDS[1], UUIDS[0]]
    assert visible_devices("0,7,1", UUIDS) == [UUIDS[0]]  # CUDA stops at the first invalid entry


def test_proc_reader_zombie_counts_as_gone(tmp_path: Path) -> None:
    _proc_tree(tmp_path, 20, state="Z")
    _proc_tree(tmp_path, 21)
    reader = ProcReader(tmp_path)
    assert not reader.alive(20) and reader.alive(21) and not reader.alive(22)
    assert reader.start_time(21) == 4242 and reader.comm(21) == "python3"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now


def _claim_slot(region: Region, index: int, pid: int, group: int, gpu: int, memory: int, launches: int,
                busy_ns: int) -> None:
    slot = claim(region, index, pid, group)
    slot.gpu_mask = 1 << gpu
    slot.memory[gpu], slot.launches[gpu], slot.busy_ns[gpu] = memory, launches, busy_ns


def test_gated_processes_from_slots_and_series_leave_at_the_exit(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _proc_tree(proc, 301, environ=b"GEMTRACE_GROUP=train\0", comm="trainer")
    region = Region.create(tmp_path / "state")
    region.set_gpus([(UUIDS[0], 16 << 30), (UUIDS[1], 16 << 30)])
    g = region.set_group("train", 1 << 30, 0.0, 1.0)
    _claim_slot(region, 3, 301, g, 1, memory=123 << 20, launches=4567, busy_ns=2_500_000_000)
    clock = Clock()
    acc = Accounting(region, lambda: Config({"train": group(1 << 30)}),  # type: ignore[arg-type]
                     Sources(GateSource(region), NvmlSource(FakeNvml(available=False))), proc_root=proc, clock=clock)
    assert "disabled" in acc.ebpf_status
    snap = acc.poll(clock.now)
    assert snap.processes == (
        ProcessAccount(301, "trainer", "train", UUIDS[1], 123 << 20, 2.5, 4567, True),
    )
    assert snap.group_memory() == {(UUIDS[1], "train"): 123 << 20}

    registry = CollectorRegistry()
    latest: list[Snapshot] = [snap]
    registry.register(ProcessCollector(lambda: latest[-1]))
    labels = {"gpu": UUIDS[1], "group": "train", "pid": "301", "comm": "trainer", "namespace": "", "pod": "",
              "container": ""}
    assert samples(registry) == {
        ("gemtrace_process_memory_bytes", frozenset(labels.items())): 123 << 20,
        ("gemtrace_process_kernel_launches_total", frozenset(labels.items())): 4567,
        ("gemtrace_process_gpu_seconds_total", frozenset(labels.items())): 2.5,
    }

    # The process exits (a zombie; its slot not yet freed): its series leave at the next poll.
    (proc / "301" / "stat").write_text("301 (trainer) Z " + "0 " * 30)
    clock.now += 1_000_000_000
    latest.append(acc.poll(clock.now))
    assert latest[-1].processes == ()
    assert samples(registry) == {}
    acc.close()
    region.close()


def test_the_gate_source_makes_a_figure_for_each_gpu_a_slots_mask_names(tmp_path: Path) -> None:
    region = Region.create(tmp_path / "state")
    region.set_gpus([(UUIDS[0], 16 << 30), (UUIDS[1], 16 << 30)])
    g = region.set_group("train", None, 0.0, 1.0)
    _claim_slot(region, 0, 401, g, 0, memory=1, launches=2, busy_ns=3)
    _claim_slot(region, 1, 402, g, 1, memory=4, launches=5, busy_ns=6)
    both = region.slots[1]
    both.gpu_mask |= 1 << 0 | 1 << 7  # GPU 7: a bit the region lists no GPU for
    both.memory[0], both.managed[0] = 7, 8
    _claim_slot(region, 2, 403, g, 1, memory=9, launches=0, busy_ns=0)
    region.slots[2].flags = 0  # being freed: its figures may be torn
    reading = GateSource(region).read(0, ProcessFacts(ProcReader(tmp_path), region, list).devices(None))
    assert reading.figures == {
        (401, UUIDS[0]): Figures(memory=1, launches=2, busy_ns=3, managed=0),
        (402, UUIDS[0]): Figures(memory=7, launches=0, busy_ns=0, managed=8),
        (402, UUIDS[1]): Figures(memory=4, launches=5, busy_ns=6, managed=0),
    }
    assert reading.start_times == {401: 0, 402: 0}
    region.close()


def test_a_groups_processes_share_its_time_and_never_get_more() -> None:
    share = GpuTimeShare()
    a, b = (UUIDS[0], "train"), (UUIDS[0], "infer")
    # Three processes of train each measured 3 s of bursts (each waited behind the others) while the
    # scheduler gave train 3.3 s; infer has one process, well under its group's figure.
    got = share.apportion({a: {1: 3.0, 2: 3.0, 3: 3.0}, b: {4: 1.0}}, {a: 3.3, b: 1.2})
    assert got[(1, UUIDS[0])] == pytest.approx(1.1) and got[(2, UUIDS[0])] == pytest.approx(1.1)
    assert sum(got[(pid, UUIDS[0])] for pid in (1, 2, 3)) == pytest.approx(3.3)
    assert got[(4, UUIDS[0])] == 1.0
    # A burst is counted when it ends, the group as it runs: what infer got and its process did not
    # claim yet is kept for it (0.2 s), and no more.
    got = share.apportion({a: {1: 3.0, 2: 3.0, 3: 3.0}, b: {4: 1.5}}, {a: 3.3, b: 1.2})
    assert got[(4, UUIDS[0])] == pytest.approx(1.2) and got[(1, UUIDS[0])] == pytest.approx(1.1)
    # Never decreasing, also when the group's figure is taken back a little (a refund).
    got = share.apportion({a: {1: 4.0, 2: 3.0, 3: 3.0}, b: {4: 1.5}}, {a: 3.2, b: 1.2})
    assert got[(1, UUIDS[0])] == pytest.approx(1.1)
    # A group the scheduler has no figure for keeps the gates' figures; an inherited process's bursts
    # before this agent are not its to give.
    got = share.apportion({(UUIDS[1], "x"): {5: 7.0}, a: {6: 50.0}}, {a: 4.0}, inherited={6})
    assert got[(5, UUIDS[1])] == 7.0 and got[(6, UUIDS[0])] == 0.0
    got = share.apportion({a: {6: 50.5}}, {a: 4.0})
    assert got[(6, UUIDS[0])] == pytest.approx(0.5)


def test_a_process_left_out_keeps_what_it_was_given_and_one_forgotten_starts_anew() -> None:
    share = GpuTimeShare()
    a, key = (UUIDS[0], "train"), (1, UUIDS[0])
    got = share.apportion({a: {1: 2.0, 2: 1.0}}, {a: 2.5})
    assert got == {key: pytest.approx(2.5 * 2 / 3), (2, UUIDS[0]): 2.5 / 3}
    share.keep({key, (2, UUIDS[0])})
    # 1's figure did not change: left out, it keeps its share, and 2's new burst is paid in full.
    assert share.apportion({a: {2: 1.5}}, {a: 3.0}) == {(2, UUIDS[0]): pytest.approx(2.5 / 3 + 0.5)}
    share.keep({(2, UUIDS[0])})  # 1 gone (or no longer gated): seen again, its bursts count from nothing
    assert share.apportion({a: {1: 1.0}}, {a: 10.0}) == {key: 1.0}


# -- the accounting with fake sources (tests/fake_sources.py): no root, no bcc ---------------------



def _fake_accounting(tmp_path: Path, ebpf: FakeEbpf, gate: FakeGate | None = None, nvml: FakeNvml | None = None,
                     limit: int | None = 100 * MiB, **kw: object) -> tuple[Accounting, MemoryEnforcer, list[int]]:
    killed: list[int] = []
    enforcer = MemoryEnforcer(kill=killed.append, clock=lambda: 1_000_000_500)
    acc = Accounting(None, lambda: Config({"train": group(limit)}),  # type: ignore[arg-type]
                     Sources(gate or FakeGate(), NvmlSource(nvml or FakeNvml(gpus=UUIDS)), ebpf), proc_root=tmp_path,
                     **kw)  # type: ignore[arg-type]
    acc.start(Enforcement(enforcer, acc.limits, acc.holdings))
    return acc, enforcer, killed


def test_an_allocation_over_the_limit_kills_at_once_without_a_poll(tmp_path: Path) -> None:
    for pid in (401, 402, 403):
        _proc_tree(tmp_path, pid, environ=b"GEMTRACE_GROUP=train\0")
    ebpf = FakeEbpf()
    acc, enforcer, killed = _fake_accounting(tmp_path, ebpf)
    ebpf.allocate(401, 0, 60 * MiB, ts_ns=1_000_000_000)
    ebpf.allocate(403, 1, 90 * MiB, ts_ns=1_000_000_100)  # another GPU: its own limit
    assert killed == []
    ebpf.allocate(402, 0, 50 * MiB, ts_ns=1_000_000_200)  # 110 MiB on GPU 0: the latest allocator goes
    assert killed == [402]
    (kill,) = enforcer.last_kills
    assert (kill.group_bytes, kill.process_bytes, kill.reaction_ns) == (110 * MiB, 50 * MiB, 300)
    ebpf.allocate(401, 0, 1 * MiB, ts_ns=1_000_000_300)  # 402 is pending until it exits: not twice
    assert killed == [402]
    ebpf.exit(402)
    snap = acc.poll()
    assert {(p.pid, p.gpu): p.memory_bytes for p in snap.processes} == {
        (401, UUIDS[0]): 61 * MiB, (403, UUIDS[1]): 90 * MiB}
    acc.close()


def test_inherited_processes_are_rebuilt_from_slot_and_nvml_less_the_context_and_enforced(tmp_path: Path) -> None:
    _proc_tree(tmp_path, 501, environ=b"GEMTRACE_GROUP=train\0")  # started at tick 4242
    _proc_tree(tmp_path, 502, environ=b"GEMTRACE_GROUP=train\0")
    ebpf = FakeEbpf(since_ticks=5000)  # the probes attached after both started: eBPF missed their memory
    # 502 is gated: its slot (30 MiB) against NVML (830 MiB) says the context costs 800 MiB.
    gate = FakeGate({(502, UUIDS[0]): Figures(memory=30 * MiB, launches=3, busy_ns=0)}, {502: 4242})
    nvml = FakeNvml(gpus=UUIDS, procs=[NvmlProcess(502, UUIDS[0], 830 * MiB)])
    acc, _, killed = _fake_accounting(tmp_path, ebpf, gate, nvml)
    assert killed == []  # checked at start: 30 MiB fit
    nvml.procs.append(NvmlProcess(501, UUIDS[0], 890 * MiB))  # first seen now (a container's libcuda)
    by_pid = {p.pid: p for p in acc.poll().processes}
    assert by_pid[501].memory_bytes == 90 * MiB and not by_pid[501].gated
    assert by_pid[502].memory_bytes == 30 * MiB and by_pid[502].gated
    assert killed == []
    ebpf.deliver_pending()  # the poll woke the watcher to enforce on what it rebuilt: 120 MiB > 100
    # Neither's last allocation is known and both started in the same tick: the ungated one goes.
    assert killed == [501]
    acc.close()


def test_an_agent_restart_finds_a_group_over_its_limit_and_acts_at_start(tmp_path: Path) -> None:
    _proc_tree(tmp_path, 511, environ=b"GEMTRACE_GROUP=train\0")
    ebpf = FakeEbpf(since_ticks=5000)
    gate = FakeGate({(511, UUIDS[0]): Figures(memory=150 * MiB, launches=0, busy_ns=0)}, {511: 4242})
    _, _, killed = _fake_accounting(tmp_path, ebpf, gate)
    assert killed == [511]  # before any poll or allocation


def test_a_slot_that_trails_ebpf_twice_with_the_same_figures_is_tampering(tmp_path: Path) -> None:
    _proc_tree(tmp_path, 601, environ=b"GEMTRACE_GROUP=train\0")
    ebpf = FakeEbpf()
    gate = FakeGate({(601, UUIDS[0]): Figures(memory=1 * MiB, launches=0, busy_ns=0)}, {601: 4242})
    acc, enforcer, _ = _fake_accounting(tmp_path, ebpf, gate, limit=None)
    ebpf.allocate(601, 0, 64 * MiB, ts_ns=1)
    (p,) = acc.poll().processes
    assert p.gated and p.memory_bytes == 64 * MiB  # eBPF's figure wins
    assert enforcer.tampering == {}  # once may be a race with the gate's reservation
    acc.poll()
    acc.poll()
    assert enforcer.tampering == {("train", "under_reporting"): 1}  # once per episode
    acc.close()


@pytest.mark.parametrize("with_ebpf", [True, False])
def test_a_slot_that_claims_more_than_the_agent_verified_is_over_reporting(tmp_path: Path, with_ebpf: bool) -> None:
    """Issue 25: a figure no allocation backs (eBPF saw 8 MiB; without eBPF, NVML lists 8 MiB, context
    included) is counted as over-reporting, and the process's verified figure stays what it holds."""
    _proc_tree(tmp_path, 611, environ=b"GEMTRACE_GROUP=train\0")
    gate = FakeGate({(611, UUIDS[0]): Figures(memory=64 << 30, launches=0, busy_ns=0)}, {611: 4242})
    nvml = FakeNvml(gpus=UUIDS, procs=[NvmlProcess(611, UUIDS[0], 8 * MiB)])
    if with_ebpf:
        ebpf = FakeEbpf()
        acc, enforcer, killed = _fake_accounting(tmp_path, ebpf, gate, nvml, limit=None)
        ebpf.allocate(611, 0, 8 * MiB, ts_ns=1)
    else:
        enforcer = MemoryEnforcer(kill=lambda pid: None)
        acc = Accounting(None, lambda: Config({"train": group(None)}),  # type: ignore[arg-type]
                         Sources(gate, NvmlSource(nvml)), proc_root=tmp_path)
        acc.start(Enforcement(enforcer, acc.limits, acc.holdings))
    assert acc.enforcement is not None
    verified = VerifiedFigures()
    acc.subscribe(verified)
    acc.poll()
    assert enforcer.tampering == {}  # once may be a reservation the driver has not answered yet
    assert acc.enforcement.over_reporting_suspected()  # the agent looks again in 0.2 s, not a second
    acc.poll()
    acc.poll()
    assert enforcer.tampering == {("train", "over_reporting"): 1}  # once per episode
    assert not acc.enforcement.over_reporting_suspected()
    assert verified.seen == [8 * MiB] * 3
    acc.close()


class VerifiedFigures:
    """A snapshot listener keeping each poll's verified figures."""

    def __init__(self) -> None:
        self.seen: list[int | None] = []

    def on_snapshot(self, snapshot: Snapshot, merged: Mapping[Key, Merged]) -> None:
        self.seen.extend(m.verified for m in merged.values())


def test_ungated_gpu_time_is_nvmls_utilisation_less_the_gates_share_split_equally(tmp_path: Path) -> None:
    for pid in (701, 702, 703):
        _proc_tree(tmp_path, pid, environ=b"GEMTRACE_GROUP=train\0")
    busy = [0]
    gate = FakeGate({(703, UUIDS[0]): Figures(memory=0, launches=0, busy_ns=0)}, {703: 4242})
    nvml = FakeNvml(gpus=UUIDS, procs=[NvmlProcess(701, UUIDS[0], MiB), NvmlProcess(702, UUIDS[0], MiB)],
                          busy={UUIDS[0]: 0.9})
    clock = Clock()
    acc = Accounting(None, lambda: None, Sources(gate, NvmlSource(nvml)), proc_root=tmp_path, clock=clock)
    acc.poll(clock.now)
    clock.now += 2_000_000_000
    busy[0] = 600_000_000
    gate.figures[(703, UUIDS[0])] = Figures(memory=0, launches=9, busy_ns=busy[0])
    seconds = {p.pid: p.gpu_seconds for p in acc.poll(clock.now).processes}
    # 0.9 x 2 s = 1.8 s busy, 0.6 s of it the gated process's: 0.6 s each for the two others.
    assert seconds == pytest.approx({701: 0.6, 702: 0.6, 703: 0.6})
    acc.close()


def test_a_process_that_is_gone_or_whose_pid_names_another_is_never_exported(tmp_path: Path) -> None:
    # NVML and a slot still list what /proc says is gone (the driver's context not yet destroyed,
    # the slot not yet freed by the reaper): neither is exported.
    for pid in (801, 802, 803):
        _proc_tree(tmp_path, pid, environ=b"GEMTRACE_GROUP=train\0", comm=f"p{pid}")  # started at tick 4242
    gate = FakeGate({(802, UUIDS[0]): Figures(memory=MiB, launches=0, busy_ns=0)}, {802: 4242})
    nvml = FakeNvml(gpus=UUIDS, procs=[NvmlProcess(801, UUIDS[0], MiB), NvmlProcess(803, UUIDS[0], MiB)],
                          busy={UUIDS[0]: 0.5})
    clock = Clock()
    acc = Accounting(None, lambda: None, Sources(gate, NvmlSource(nvml)), proc_root=tmp_path, clock=clock)
    assert [p.pid for p in acc.poll(clock.now).processes] == [801, 802, 803]
    clock.now += 2_000_000_000
    assert {p.pid: p.gpu_seconds for p in acc.poll(clock.now).processes}[803] == pytest.approx(0.5)
    (tmp_path / "801" / "stat").unlink()  # gone
    (tmp_path / "802" / "stat").write_text("802 (p802) S " + "0 " * 30)  # the slot's pid, another start time
    # 803 exits and its pid goes to a new process (another start time, another name): its own figures.
    stat = (tmp_path / "803" / "stat").read_text()
    (tmp_path / "803" / "stat").write_text(stat.replace("(p803)", "(new)").replace(" 4242 ", " 9999 "))
    (tmp_path / "803" / "comm").write_text("new\n")
    clock.now += 1_000_000_000
    (p,) = acc.poll(clock.now).processes
    assert (p.pid, p.comm) == (803, "new") and p.gpu_seconds == pytest.approx(0.5)  # 1 s at 0.5, not 1.0 + 0.5
    acc.close()


def test_the_verified_figures_reach_the_region_and_follow_the_process(tmp_path: Path) -> None:
    """Issue 25: what other users' gates count for a user caught lying. Without eBPF, a slot claiming
    a terabyte is published at NVML's figure for its process; a new NVML figure is published at the
    next poll; a slot taken by another process gets an entry naming that process."""
    proc = tmp_path / "proc"
    for pid in (301, 302):
        _proc_tree(proc, pid, environ=b"GEMTRACE_GROUP=train\0")
    region = Region.create(tmp_path / "state")
    region.set_gpus([(UUIDS[0], 16 << 30), (UUIDS[1], 16 << 30)])
    g = region.set_group("train", 1 << 30, 0.0, 1.0)
    _claim_slot(region, 3, 301, g, 1, memory=1 << 40, launches=0, busy_ns=0)
    nvml = FakeNvml(gpus=UUIDS, procs=[NvmlProcess(301, UUIDS[1], 8 * MiB)])
    acc = Accounting(region, lambda: Config({"train": group(1 << 30)}),  # type: ignore[arg-type]
                     Sources(GateSource(region), NvmlSource(nvml)), proc_root=proc)
    acc.poll()
    assert region.verified(3) == (301, [0, 8 * MiB] + [0] * 6, [0] * 8)
    nvml.procs = [NvmlProcess(301, UUIDS[1], 24 * MiB)]
    acc.poll()
    assert region.verified(3)[1][1] == 24 * MiB
    region.slots[3].pid = 0
    _claim_slot(region, 3, 302, g, 1, memory=5 * MiB, launches=0, busy_ns=0)
    nvml.procs = [NvmlProcess(302, UUIDS[1], 5 * MiB)]
    acc.poll()
    assert region.verified(3) == (302, [0, 5 * MiB] + [0] * 6, [0] * 8)
    acc.close()
    region.close()


def test_a_process_whose_slot_was_freed_while_it_ran_starts_its_gpu_time_anew(tmp_path: Path) -> None:
    _proc_tree(tmp_path, 902, environ=b"GEMTRACE_GROUP=train\0", start=10**9)
    key = (902, UUIDS[0])
    gate = FakeGate({key: Figures(memory=MiB, launches=1, busy_ns=2 * 10**9)}, {902: 10**9})
    nvml = FakeNvml(gpus=UUIDS, procs=[NvmlProcess(902, UUIDS[0], 800 * MiB)])
    clock = Clock()
    acc = Accounting(None, lambda: Config({"train": group(None)}),  # type: ignore[arg-type,return-value]
                     Sources(gate, NvmlSource(nvml)), proc_root=tmp_path, clock=clock,
                     group_seconds=lambda: {(UUIDS[0], "train"): 100.0})

    def poll() -> tuple[bool, float]:
        clock.now += 10**9
        (p,) = acc.poll(clock.now).processes
        return p.gated, p.gpu_seconds

    assert poll() == (True, 2.0)
    gate.figures.clear()
    gate.start_times.clear()
    assert poll() == (False, 0.0)  # NVML still lists it
    gate.figures[key] = Figures(memory=MiB, launches=1, busy_ns=10**9)  # a new slot: its gate counts anew
    gate.start_times[902] = 10**9
    assert poll() == (True, 1.0)
    acc.close()


# -- a poll makes anew only what changed (issue 30) ----------------------------------------------------


class _World:
    """An accounting over fake sources (no region), with its enforcer and the last merge it published.
    Two worlds that a scenario changes alike read the same /proc tree."""

    def __init__(self, proc: Path, with_ebpf: bool, group_seconds: Mapping[tuple[str, str], float]) -> None:
        self.gate = FakeGate()
        self.nvml = FakeNvml(gpus=UUIDS, busy={UUIDS[0]: 0.5, UUIDS[1]: 0.25})
        # The probes attached at tick 4300: processes started by then may hold memory eBPF never saw.
        self.ebpf = FakeEbpf(since_ticks=4300) if with_ebpf else None
        self.config = Config({"train": group(64 * MiB), "infer": group(None)})
        self.clock = Clock()
        self.killed: list[int] = []
        self.enforcer = MemoryEnforcer(kill=self.killed.append, clock=self.clock)
        self.acc = Accounting(None, lambda: self.config,  # type: ignore[arg-type,return-value]
                              Sources(self.gate, NvmlSource(self.nvml), self.ebpf), proc_root=proc, clock=self.clock,
                              group_seconds=lambda: dict(group_seconds))
        self.acc.start(Enforcement(self.enforcer, self.acc.limits, self.acc.holdings))
        self.merged: dict[Key, Merged] = {}
        self.acc.subscribe(self)

    def on_snapshot(self, snapshot: Snapshot, merged: Mapping[Key, Merged]) -> None:
        self.merged = dict(merged)

    def figures(self) -> tuple[object, ...]:
        """Everything the accounting made at its last poll that anyone reads."""
        e = self.enforcer
        return self.merged, dict(e.oom_kills), dict(e.breaches), dict(e.tampering), list(self.killed)


def _scenario(tmp_path: Path, worlds: list[_World], polls: int, seed: int,
              group_seconds: dict[tuple[str, str], float]) -> list[list[Snapshot]]:
    """Changes the worlds alike, poll by poll: bursts, allocations, a slot's figures changed by hand,
    processes starting, exiting and their pids reused, slots freed and claimed again, reloads that
    move a process to another group, eBPF's late pids, NVML's busy fraction, the groups' GPU time.
    Returns each world's snapshots."""
    import random

    rng = random.Random(seed)
    gpus = {pid: rng.randrange(2) for pid in range(1000, 1040)}
    gated = {pid for pid in gpus if pid % 4}
    started = {pid: (4000 + pid % 600 if pid % 3 else 10**9 + pid) for pid in gpus}  # some after since_ticks

    def start(pid: int, comm: str) -> None:
        group_name = ("train", "infer")[pid % 2]
        _proc_tree(tmp_path, pid, environ=f"GEMTRACE_GROUP={group_name}\0".encode(), comm=comm, start=started[pid])
        for w in worlds:
            uuid = UUIDS[gpus[pid]]
            if pid in gated:
                w.gate.figures[(pid, uuid)] = Figures(memory=MiB, launches=0, busy_ns=0)
                w.gate.start_times[pid] = started[pid]
            w.nvml.procs.append(NvmlProcess(pid, uuid, 300 * MiB))
            if w.ebpf is not None and pid % 5:
                w.ebpf.allocate(pid, gpus[pid], MiB, ts_ns=w.clock.now)

    def gone(pid: int) -> None:
        for w in worlds:
            for key in [k for k in w.gate.figures if k[0] == pid]:
                del w.gate.figures[key]
            w.gate.start_times.pop(pid, None)
            w.nvml.procs = [p for p in w.nvml.procs if p.pid != pid]
            if w.ebpf is not None:
                w.ebpf.exit(pid)

    for pid in gpus:
        start(pid, f"p{pid}")
    out: list[list[Snapshot]] = [[] for _ in worlds]
    detached: list[int] = []
    for poll in range(polls):
        for pid in detached:  # its gate claims a slot again: its bursts counted from nothing
            for w in worlds:
                w.gate.figures[(pid, UUIDS[gpus[pid]])] = Figures(memory=MiB, launches=1, busy_ns=5 * 10**7)
                w.gate.start_times[pid] = started[pid]
        live = sorted(gpus)
        detached = []
        for pid in rng.sample(live, len(live) // 3):  # bursts and launches; now and then a slot's memory
            key = (pid, UUIDS[gpus[pid]])
            busy, launches, memory = rng.randrange(1, 10**8), rng.randrange(1, 50), rng.randrange(1, 100) * MiB
            change_memory = rng.random() < 0.2
            allocate = rng.random() < 0.2
            for w in worlds:
                if key in w.gate.figures:
                    f = w.gate.figures[key]
                    w.gate.figures[key] = f._replace(busy_ns=(f.busy_ns or 0) + busy,
                                                     launches=(f.launches or 0) + launches,
                                                     memory=memory if change_memory else f.memory)
                if allocate and w.ebpf is not None:
                    w.ebpf.allocate(pid, gpus[pid], memory // 4, ts_ns=w.clock.now)
        event = rng.randrange(8)
        pid = rng.choice(live)
        if event == 0:  # an exit, and a new process
            gone(pid)
            (tmp_path / str(pid) / "stat").unlink()
            del gpus[pid]
            new = max(live) + 1
            gpus[new], started[new] = rng.randrange(2), 10**9 + new
            if rng.random() < 0.7:
                gated.add(new)
            start(new, f"p{new}")
        elif event == 1:  # the pid reused by another process: another start time and name
            gone(pid)
            started[pid] += 7
            start(pid, f"again{pid}")
        elif event == 2:  # a reload; a process's environment now asks for the other group
            env = (tmp_path / str(pid) / "environ").read_bytes()
            swapped = env.replace(b"train", b"@").replace(b"infer", b"train").replace(b"@", b"infer")
            (tmp_path / str(pid) / "environ").write_bytes(swapped)
            for w in worlds:
                w.config = Config(dict(w.config.groups))
        elif event == 3:
            for w in worlds:
                if w.ebpf is not None:
                    w.ebpf.missed.add(pid)
        elif event == 4:
            fraction = rng.random()
            for w in worlds:
                w.nvml.busy[UUIDS[poll % 2]] = fraction
        elif event == 5 and pid in gated:  # its gate now uses the other GPU too
            for w in worlds:
                w.gate.figures[(pid, UUIDS[1 - gpus[pid]])] = Figures(memory=2 * MiB, launches=1, busy_ns=10**7)
        elif event == 6 and pid in gated:  # its slot freed while it runs on (ungated for a poll)
            detached.append(pid)
            for w in worlds:
                for key in [k for k in w.gate.figures if k[0] == pid]:
                    del w.gate.figures[key]
                w.gate.start_times.pop(pid, None)
        for key in [(UUIDS[g], name) for g in (0, 1) for name in ("train", "infer", "default")]:
            group_seconds[key] = group_seconds.get(key, 0.0) + rng.choice((0.0, 0.01, 0.05, 0.2))
        step = 10**9 + rng.randrange(-10**8, 10**8)
        for w, snapshots in zip(worlds, out, strict=True):
            w.clock.now += step
            snapshots.append(w.acc.poll())
    return out


def _accounts_kept(snapshots: list[Snapshot]) -> int:
    """How many accounts are the very objects of the poll before."""
    kept = 0
    for before, after in itertools.pairwise(snapshots):
        accounts = {(p.pid, p.gpu): p for p in before.processes}
        kept += sum(accounts.get((p.pid, p.gpu)) is p for p in after.processes)
    return kept


def _forget_what_is_kept(acc: Accounting) -> None:
    """Every record's inputs forgotten: the next poll merges, shares and makes every account anew (what
    the accounting made before it kept anything), keeping only what carries over (NVML's time
    integrated, what each process was given)."""
    for record in acc._seen.values():
        record.inputs = None  # type: ignore[assignment]


@pytest.mark.parametrize("with_ebpf", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_what_a_poll_keeps_gives_the_figures_of_making_everything_anew(tmp_path: Path, with_ebpf: bool,
                                                                         seed: int) -> None:
    group_seconds: dict[tuple[str, str], float] = {}
    kept, anew = _World(tmp_path, with_ebpf, group_seconds), _World(tmp_path, with_ebpf, group_seconds)

    class Anew:  # forgets before each of the reference's polls
        def __init__(self, world: _World) -> None:
            self.world, self.poll = world, world.acc.poll

        def __call__(self, now_ns: int | None = None) -> Snapshot:
            _forget_what_is_kept(self.world.acc)
            return self.poll(now_ns)

    anew.acc.poll = Anew(anew)  # type: ignore[method-assign]
    ours, reference = _scenario(tmp_path, [kept, anew], polls=60, seed=seed, group_seconds=group_seconds)
    for poll, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert a == b, poll
    assert kept.figures() == anew.figures()
    # The scenario moved what matters (GPU time given within groups and by NVML, processes gone), and
    # the accounting kept what did not change (most accounts are the last poll's own).
    assert any(p.gated and p.gpu_seconds for p in ours[-1].processes)
    assert any(not p.gated and p.gpu_seconds for p in ours[-1].processes)
    assert {p.pid for s in ours for p in s.processes} - {p.pid for p in ours[-1].processes}
    assert _accounts_kept(ours) > sum(len(s.processes) for s in ours) / 3
    assert _accounts_kept(reference) == 0
    kept.acc.close()
    anew.acc.close()


def test_a_process_whose_figures_or_facts_change_shows_them_at_the_next_poll(tmp_path: Path) -> None:
    """What a poll keeps of a process whose figures did not change (its merge, GPU time and account)
    goes stale the moment one of them, or its facts, change: each change shows at the next poll."""
    _proc_tree(tmp_path, 901, environ=b"GEMTRACE_GROUP=train\0", comm="trainer", start=10**9)
    key = (901, UUIDS[0])
    gate = FakeGate({key: Figures(memory=10 * MiB, launches=5, busy_ns=10**9)}, {901: 10**9})
    nvml = FakeNvml(gpus=UUIDS, procs=[NvmlProcess(901, UUIDS[0], 800 * MiB)])
    config = [Config({"train": group(None), "infer": group(None)})]
    clock = Clock()
    acc = Accounting(None, lambda: config[0], Sources(gate, NvmlSource(nvml)),  # type: ignore[arg-type,return-value]
                     proc_root=tmp_path, clock=clock, group_seconds=lambda: {(UUIDS[0], "train"): 100.0})
    verified = VerifiedFigures()
    acc.subscribe(verified)

    def poll() -> ProcessAccount:
        clock.now += 10**9
        (p,) = acc.poll(clock.now).processes
        return p

    first = poll()
    assert (first.memory_bytes, first.launches, first.gpu_seconds, first.group) == (10 * MiB, 5, 1.0, "train")
    assert poll() is first  # nothing changed: the same account
    gate.figures[key] = gate.figures[key]._replace(memory=20 * MiB)
    assert poll().memory_bytes == 20 * MiB
    gate.figures[key] = gate.figures[key]._replace(launches=6)
    assert poll().launches == 6
    gate.figures[key] = gate.figures[key]._replace(busy_ns=3 * 10**9)
    assert poll().gpu_seconds == 3.0
    nvml.procs = [NvmlProcess(901, UUIDS[0], 12 * MiB)]  # without eBPF, the slot is verified against NVML
    poll()
    assert verified.seen[-2:] == [20 * MiB, 12 * MiB]
    (tmp_path / "901" / "environ").write_bytes(b"GEMTRACE_GROUP=infer\0")
    config[0] = Config(dict(config[0].groups))  # a reload: the facts are read afresh
    assert poll().group == "infer"
    _proc_tree(tmp_path, 901, environ=b"GEMTRACE_GROUP=infer\0", comm="other", start=10**9 + 1)  # pid reused
    gate.start_times[901] = 10**9 + 1
    assert poll().comm == "other"
    acc.close()
