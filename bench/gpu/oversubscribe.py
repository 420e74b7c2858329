"""Oversubscription on the GPU (issue 14, first part): PyTorch training past its group's MemoryLimit.

Each run goes through the product only, with bench/gpu/models_torch.py's helpers (`run`: one
`gemtrace agent --no-ebpf`, its workers started with `gemtrace run`, one shared window): the workload
is models_worker.py's cnn-train (ResNet-50, batch 64, 224x224, bf16 autocast, SGD, weights=None).
Cases, each against solo (the same workload alone, gated, no limit, run before and after the cases):
  limited   one job, MemoryLimit = --limit-ratio x its solo need, Oversubscribe = true: what the gate's
            switch to managed memory costs while the GPU itself still has room for the managed pages
  squeezed  the same, with a balloon (a plain CUDA process outside gemtrace, holding device memory)
            leaving the job only need / --oversubscription of the GPU: the driver must page
  pair      two jobs in two groups, MemoryLimit = half of what the balloon leaves each, Oversubscribe =
            true, the balloon leaving (need + need) / --oversubscription: the issue's case, the sum of
            the two peaks --oversubscription (1.5) times the GPU memory they can have. One after the
            other, each would get 0.5 of solo over the same time; the table says how far above or below
            that each lands when they share the GPU and its memory
"Need" is the solo run's device memory at the window's end (the caching allocator's reserve: its peak).
Whether a run finished at all is the first result: an oversubscribed GPU that thrashes or hangs shows
as a failed run, with the worker's log. --cache-release runs each case with `gemtrace run`'s PyTorch
cache release (on by default for these Oversubscribe groups: gemtrace/run/cache_release.py), without it
(GEMTRACE_RELEASE_CACHE=0), or both ways, one after the other (issue 14's "the same without").
--hints does the same for the gate's advice and prefetch hints on the managed memory it serves in place
of device memory (hook/memory.c; off by default, GEMTRACE_MANAGED_HINTS=1 turns them on): each case
runs with them, without them, or both ways.

    python3 -m bench.gpu.oversubscribe [--cases limited,squeezed,pair] [--limit-ratio 0.5]
        [--oversubscription 1.5] [--cache-release on|off|both] [--hints on|off|both] [--seconds 20]
        [--settle 5] [--gpu 0] [--no-record]

Prints a markdown table and appends it, dated, to bench/results/oversubscribe.md (not with --no-record);
with $OUT set, also writes oversubscribe.md and oversubscribe.json there. Exit status 0 when every run finished, 2 on
a failed run or bad usage. Needs what models_torch.py needs (build/libgemgate.so, torch with CUDA,
torchvision, the agent's Python dependencies).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench.gpu.models_torch import REPO, GroupSpec, Options, RunFailed, options, parse_list, parser, run
from bench.recording import add_record_flag, gpus, publish, stamp
from gemtrace.contract import ENV_MANAGED_HINTS
from gemtrace.run.cache_release import ENV_RELEASE_CACHE
from tests.testkit import GiB

WORKLOAD = "cnn-train"
CASES = ("limited", "squeezed", "pair")
BOTH_WAYS = {"on": ("on",), "off": ("off",), "both": ("on", "off")}
RESULTS = REPO / "bench" / "results" / "oversubscribe.md"
# What a CUDA context of PyTorch takes outside its allocations on the H100 (FACTS.md: about 810 MB per
# process before any tensor); the balloon leaves it to each job on top of its share.
CONTEXT_BYTES = 900 << 20

# The balloon: takes all of the GPU's free memory but `leave` bytes, says so, holds until stdin closes.
BALLOON = """
import json, sys, torch
leave = int(sys.argv[1])
free, total = torch.cuda.mem_get_info()
take = max(0, free - leave)
held = torch.empty(take, dtype=torch.uint8, device="cuda")
print(json.dumps({"taken": take, "free": torch.cuda.mem_get_info()[0], "total": total}), flush=True)
sys.stdin.read()
"""


@dataclass(frozen=True)
class OversubscribedGroup(GroupSpec):
    """A group with a MemoryLimit and Oversubscribe on (models_torch's GroupSpec writes the quota lines)."""

    memory_limit: int = 0

    def quota(self) -> str:
        return f"MemoryLimit {self.memory_limit / GiB:.2f} GiB, Oversubscribe"

    def conf(self) -> str:
        return super().conf() + f"MemoryLimit = {self.memory_limit}\nOversubscribe = true\n"


class Balloon:
    """A plain CUDA process, outside gemtrace, that leaves `leave` bytes of the GPU free."""

    def __init__(self, leave: int, gpu: int) -> None:
        from gemtrace.gpus import discover

        env = {**os.environ, "CUDA_VISIBLE_DEVICES": discover()[gpu].uuid}
        env.pop("LD_PRELOAD", None)
        self.proc = subprocess.Popen([sys.executable, "-c", BALLOON, str(leave)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("{"):
            self.stop()
            raise RunFailed(f"the balloon did not start (exit status {self.proc.poll()})")
        self.report: dict[str, int] = json.loads(line)

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def solo(opts: Options) -> dict[str, Any]:
    return run((GroupSpec("solo"),), WORKLOAD, opts)["groups"]["solo"]


def case_groups(case: str, need: int, ratio: float, factor: float) -> tuple[tuple[OversubscribedGroup, ...], int]:
    """The case's groups and what the balloon leaves free (0: no balloon)."""
    if case == "pair":
        share = int(2 * need / factor)
        return (OversubscribedGroup("job1", memory_limit=share // 2),
                OversubscribedGroup("job2", memory_limit=share // 2)), share + 2 * CONTEXT_BYTES
    group = (OversubscribedGroup("job", memory_limit=int(need * ratio)),)
    return group, (int(need / factor) + CONTEXT_BYTES if case == "squeezed" else 0)


def render(header: str, before: dict[str, Any], after: dict[str, Any] | None, rows: list[dict[str, Any]],
           failures: list[str]) -> str:
    ref = (before["rate"] + after["rate"]) / 2 if after else before["rate"]
    rates = f"{before['rate']:.2f} steps/s before, {after['rate']:.2f} after" if after else \
        f"{before['rate']:.2f} steps/s before (the run after failed)"
    lines = [header, "",
             f"Solo (no limit): {rates}; its need (device memory at the window's end): "
             f"{before['memory'] / GiB:.2f} GiB.", "",
             "| case | group | quota | cache release | hints | GPU memory left to the jobs | device GiB | "
             "managed GiB | steps/s | throughput (of solo) | one after the other |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        left = f"{r['left'] / GiB:.2f} GiB (balloon)" if r["left"] else "the whole GPU"
        lines.append(f"| {r['case']} | {r['group']} | {r['quota']} | {r['release']} | {r['hints']} | {left} | "
                     f"{r['memory'] / GiB:.2f} | {r['managed'] / GiB:.2f} | {r['rate']:.2f} | {r['rate'] / ref:.3f} | "
                     f"{'0.5' if r['case'] == 'pair' else '-'} |")
    if failures:
        lines += ["", "Did not finish: " + "; ".join(failures) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    # A longer settling than the others': paging settles after the warm-up.
    ap = parser(__doc__, seconds=20.0, settle=5.0, agent=False)
    ap.add_argument("--cases", type=lambda t: parse_list(t, CASES, "case"), default=CASES,
                    help=f"comma-separated, among {','.join(CASES)} (default all)")
    ap.add_argument("--limit-ratio", type=float, default=0.5,
                    help="limited and squeezed: MemoryLimit as a share of the solo need (default 0.5)")
    ap.add_argument("--oversubscription", type=float, default=1.5,
                    help="squeezed and pair: the jobs' need over the GPU memory the balloon leaves (default 1.5)")
    ap.add_argument("--cache-release", choices=sorted(BOTH_WAYS), default="on",
                    help="the jobs' PyTorch cache release while their group is held: on (gemtrace run's default for "
                    "Oversubscribe groups), off, or both, each case once each way (default on)")
    ap.add_argument("--hints", choices=sorted(BOTH_WAYS), default="off",
                    help="the gate's advice and prefetch hints on the managed memory it serves: on "
                    "(GEMTRACE_MANAGED_HINTS=1), off (the gate's default), or both, each case once each way "
                    "(default off)")
    add_record_flag(ap, RESULTS)
    args = ap.parse_args(argv)
    if not 0 < args.limit_ratio < 1 or args.oversubscription <= 1:
        ap.error("--limit-ratio must be in (0, 1) and --oversubscription above 1")
    opts = options(ap, args)
    if opts is None:
        return 2
    began = time.monotonic()
    try:
        before = solo(opts)
    except RunFailed as e:
        print(f"the solo run failed, so nothing can be compared: {e}", file=sys.stderr)
        return 2
    need = int(before["memory"])
    print(f"solo: {before['rate']:.2f} steps/s, need {need / GiB:.2f} GiB", flush=True)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    for case in args.cases:
        for release, hints in [(r, h) for r in BOTH_WAYS[args.cache_release] for h in BOTH_WAYS[args.hints]]:
            groups, leave = case_groups(case, need, args.limit_ratio, args.oversubscription)
            balloon = None
            what = f"cache release {release}, hints {hints}"
            # models_torch.run hands its environment to `gemtrace run`; solo (no Oversubscribe) has none.
            os.environ[ENV_RELEASE_CACHE] = "1" if release == "on" else "0"
            os.environ[ENV_MANAGED_HINTS] = "1" if hints == "on" else "0"
            try:
                balloon = Balloon(leave, args.gpu) if leave else None
                result = run(groups, WORKLOAD, opts)
            except RunFailed as e:
                failures.append(f"{case}, {what} ({str(e).splitlines()[0]})")
                print(f"{case} ({what}) did not finish: {e}", file=sys.stderr)
                continue
            finally:
                del os.environ[ENV_RELEASE_CACHE]
                del os.environ[ENV_MANAGED_HINTS]
                if balloon is not None:
                    balloon.stop()
            left = balloon.report["free"] if balloon is not None else 0
            for g in groups:
                got = result["groups"][g.name]
                rows.append({"case": case, "group": g.name, "quota": g.quota(), "release": release, "hints": hints,
                             "left": left, **got})
                print(f"{case} {g.name} ({what}): {got['rate']:.2f} steps/s, device "
                      f"{got['memory'] / GiB:.2f} GiB, managed {got['managed'] / GiB:.2f} GiB", flush=True)
    try:
        after: dict[str, Any] | None = solo(opts)
    except RunFailed as e:
        after = None
        failures.append(f"solo after ({str(e).splitlines()[0]})")
    header = (f"## {stamp()}, {gpus()}, {platform.node()}\n\n"
              f"{WORKLOAD} (ResNet-50 bf16, batch 64), `gemtrace agent --no-ebpf` and `gemtrace run`; "
              f"{args.seconds:g} s windows after {args.settle:g} s of settling; throughput = steps/s / the mean "
              f"of solo before and after; MemoryLimit {args.limit_ratio:g} of the need (limited, squeezed), "
              f"the jobs' need {args.oversubscription:g} x what the balloon leaves (squeezed, pair); "
              f"{(time.monotonic() - began) / 60:.1f} min in all.")
    report = render(header, before, after, rows, failures)
    publish(report, "oversubscribe",
            {"header": header, "solo_before": before, "solo_after": after, "rows": rows, "failures": failures},
            None if args.no_record or args.stand_in else RESULTS,
            "Oversubscription: PyTorch training past its MemoryLimit (bench/gpu/oversubscribe.py)")
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
