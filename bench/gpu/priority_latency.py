"""Inference latency beside a training hog, with and without Priority (issue 13, "Priority between groups").

A batch-1 ResNet-18 inference service (models_worker.py's cnn-infer, paced: one request every
--pause-ms after the last answer) runs in group `infer`, a ResNet-50 bf16 training loop (cnn-train,
batch 64) in group `train`, each process started with `gemtrace run` under one `gemtrace agent` per run
(models_torch.py's Agent and Worker: a temporary state dir and resource file, --no-ebpf unless --ebpf).
Three runs, each with its own agent:
  solo   the service alone (gated, no quota): the reference
  off    the service beside the hog, both at Priority 0 (the service waits for the hog's slice to end)
  on     the same with `Priority = 10` for `infer` (its next request revokes the hog at the next look)
and for each the service's p50 / p99 / max latency per request over the window (models_worker.py
--pause-ms), the hog's steps/s and the GPU time the agent charged each group. Target: p99 with Priority
on <= 1.5 x solo p99.

    python3 -m bench.gpu.priority_latency [--seconds 20] [--settle 2] [--pause-ms 20] [--gpu 0] [--ebpf]
        [--no-record] [--stand-in]

Prints a markdown table and appends it, dated, to bench/results/priority_latency.md (not with
--no-record, nor with --stand-in, whose figures say nothing of a GPU); with $OUT set, also writes
priority_latency.md and priority_latency.json there. Exit status 0 when the target was met, 1 when
missed, 2 on bad usage or a failed run. Needs, from the repo root: build/libgemgate.so (`make -C hook
BUILD=$PWD/build`), torch with CUDA and torchvision, and what the agent needs on PYTHONPATH.
--stand-in runs the simulated GPU's kernels instead of torch (a check of the orchestration on a
machine without a GPU, as tests/test_models_torch_standin.py does for models_torch.py).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bench.gpu.models_torch import REPO, GroupSpec, RunFailed, options, parser, report_header, run
from bench.recording import add_record_flag, publish

RESULTS = REPO / "bench" / "results" / "priority_latency.md"
SERVICE, HOG = "cnn-infer", "cnn-train"
HIGH = 10
TARGET = 1.5  # p99 with Priority on, over solo p99


def service(priority: int, pause_ms: float) -> GroupSpec:
    return GroupSpec("infer", workload=SERVICE, priority=priority, worker_args=("--pause-ms", f"{pause_ms:g}"))


def cases(pause_ms: float) -> tuple[tuple[str, tuple[GroupSpec, ...]], ...]:
    hog = GroupSpec("train", workload=HOG)
    return (("solo", (service(0, pause_ms),)),
            ("off", (service(0, pause_ms), hog)),
            ("on", (service(HIGH, pause_ms), hog)))


def row(name: str, result: dict[str, Any]) -> dict[str, Any]:
    infer = result["groups"]["infer"]
    latency = infer["results"][0]
    train = result["groups"].get("train")
    return {"case": name, "requests": latency.get("requests", 0), "p50_ms": latency.get("p50_ms", float("nan")),
            "p99_ms": latency.get("p99_ms", float("nan")), "max_ms": latency.get("max_ms", float("nan")),
            "infer_charged": infer["charged"], "hog_rate": train["rate"] if train else None,
            "hog_charged": train["charged"] if train else None, "agent_cpu": result["agent_cpu"]}


def render(header: str, rows: list[dict[str, Any]], ratio: float, met: bool) -> str:
    titles = {"solo": "solo (inference alone)", "off": "beside the hog, Priority off (both 0)",
              "on": f"beside the hog, Priority on (infer {HIGH})"}
    solo = rows[0]
    lines = [header, "", "| case | requests | p50 ms | p99 ms | max ms | p99 / solo p99 | infer time charged "
             "| hog steps/s | hog time charged | agent CPU |", "|" + " --- |" * 10]
    for r in rows:
        hog = "-" if r["hog_rate"] is None else f"{r['hog_rate']:.2f}"
        hog_charged = "-" if r["hog_charged"] is None else f"{r['hog_charged']:.3f}"
        lines.append(f"| {titles[r['case']]} | {r['requests']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                     f"{r['max_ms']:.2f} | {r['p99_ms'] / solo['p99_ms']:.2f} | {r['infer_charged']:.3f} | {hog} | "
                     f"{hog_charged} | {r['agent_cpu']:.1f}% |")
    lines += ["", f"Target: p99 with Priority on ≤ {TARGET:g} × solo p99: {ratio:.2f}, "
              f"{'met' if met else 'missed'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, seconds=20.0, paced=True)
    add_record_flag(ap, RESULTS)
    args = ap.parse_args(argv)
    opts = options(ap, args)
    if opts is None:
        return 2
    began = time.monotonic()
    rows: list[dict[str, Any]] = []
    about: dict[str, Any] = {}
    for name, groups in cases(args.pause_ms):
        try:
            result = run(groups, SERVICE, opts)
        except RunFailed as e:
            print(f"the {name} run failed, so nothing can be compared: {e}", file=sys.stderr)
            return 2
        about = about or result["about"]
        rows.append(row(name, result))
        r = rows[-1]
        print(f"{name}: {r['requests']} requests, p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, "
              f"max {r['max_ms']:.2f} ms" + ("" if r["hog_rate"] is None else f"; hog {r['hog_rate']:.2f} steps/s"),
              flush=True)
    ratio = rows[2]["p99_ms"] / rows[0]["p99_ms"]
    met = ratio <= TARGET
    header = report_header(about, args, f"batch-1 ResNet-18 requests {args.pause_ms:g} ms apart (group infer) beside "
                           "ResNet-50 bf16 training, batch 64 (group train); "
                           f"{args.seconds:g} s windows after {args.settle:g} s of settling", began)
    report = render(header, rows, ratio, met)
    publish(report, "priority_latency",
            {"header": header, "about": about, "seconds": args.seconds, "pause_ms": args.pause_ms, "rows": rows,
             "p99_on_over_solo": ratio, "target": TARGET, "met": met},
            None if args.no_record or args.stand_in else RESULTS,
            "Priority: inference latency beside a training hog (bench/gpu/priority_latency.py)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
