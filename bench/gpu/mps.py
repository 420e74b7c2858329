"""Isolation=mps against time slicing on real models, through the product only (issue 13, MPS part).

Each run starts `gemtrace agent` and the groups' processes with `gemtrace run` (models_torch.py's run():
a temporary state dir and resource file per run, --no-ebpf unless --ebpf). Per workload:
  solo         the workload alone, gated, no quota (before and after the cases; the table divides by
               their mean)
  time 0.3/0.7 two groups, MaxUtil 0.3 and 0.7, time-sliced by the scheduler
  mps 0.3/0.7  the same two groups with Isolation=mps: the agent's MPS daemon, 30% and 70% of the SMs
               (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), launches never held
  mps none     two mps groups without a quota (inference only: what side by side gives a launch-bound
               loop)
Workloads: cnn-infer (ResNet-18, batch 1) and cnn-train (ResNet-50, batch 64, bf16). During each mps
run a thread reads NVML every half second (nvmlDeviceGetComputeRunningProcesses,
nvmlDeviceGetProcessUtilization) to record what is known per process under MPS.

    python3 -m bench.gpu.mps [--seconds 8] [--settle 2] [--workloads cnn-infer,cnn-train] [--gpu 0]
        [--no-record] [--ebpf] [--stand-in]

Needs nvidia-cuda-mps-control in PATH (/usr/local/nvidia/bin on the lent H100), and what
models_torch.py needs. Appends the dated table to bench/results/mps.md (not with --no-record, nor
with --stand-in, whose figures say nothing of a GPU); with $OUT set, also writes mps.md and mps.json
there. Leaves no MPS daemon running: it waits for each run's daemon and
server to go and says so if one is left. Exit status 0, or 2 on a failed run.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from bench.gpu.models_torch import REPO, SOLO, GroupSpec, RunFailed, options, parser, report_header, run, text
from bench.recording import add_record_flag, publish

RESULTS = REPO / "bench" / "results" / "mps.md"
MPS_PROCESSES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")


def cases(workload: str) -> list[tuple[str, tuple[GroupSpec, ...]]]:
    out = [(f"{iso} 0.3/0.7", (GroupSpec("capped30", max_util=0.3, isolation=iso),
                               GroupSpec("capped70", max_util=0.7, isolation=iso))) for iso in ("time", "mps")]
    if workload == "cnn-infer":
        out.append(("mps none", (GroupSpec("side1", isolation="mps"), GroupSpec("side2", isolation="mps"))))
    return out


class NvmlWatch:
    """What NVML says per process while a run goes (under MPS: which pids it lists, their memory, and
    whether per-process utilisation answers)."""

    def __init__(self, gpu: int) -> None:
        self.gpu = gpu
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.gpu)
        except Exception as e:  # noqa: BLE001 - recorded: the run's figures still stand
            self.samples.append({"error": str(e)})
            return
        last = 0
        while not self._stop.wait(0.5):
            sample: dict[str, Any] = {}
            try:
                sample["processes"] = [{"pid": p.pid, "memory": p.usedGpuMemory}
                                       for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            except Exception as e:  # noqa: BLE001
                sample["processes_error"] = str(e)
            try:
                utils = pynvml.nvmlDeviceGetProcessUtilization(handle, last)
                sample["utilization"] = [{"pid": u.pid, "sm": u.smUtil} for u in utils]
                last = max((u.timeStamp for u in utils), default=last)
            except Exception as e:  # noqa: BLE001
                sample["utilization_error"] = text(str(e))
            self.samples.append(sample)

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(5)
        return self.samples


def mps_left(timeout: float) -> list[str]:
    """The MPS daemons and servers still running after `timeout` seconds of waiting for them to go."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        left = [f"{p.info['name']} ({p.pid})" for p in psutil.process_iter(["name"])
                if p.info["name"] in MPS_PROCESSES]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def summary(samples: list[dict[str, Any]], workers: set[int]) -> str:
    """What NVML knew per process: the pids it listed (workers among them or not) and per-process SMs."""
    pids = {p["pid"] for s in samples for p in s.get("processes", ())}
    util = {u["pid"] for s in samples for u in s.get("utilization", ())}
    errors = {s.get("utilization_error") for s in samples} - {None}
    return (f"NVML listed pids {sorted(pids)} ({len(pids & workers)} of the {len(workers)} workers); "
            f"per-process utilisation for {sorted(util) or 'none'}"
            + (f" (errors: {', '.join(sorted(str(e) for e in errors))})" if errors else ""))


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, seconds=8.0)
    ap.add_argument("--workloads", default="cnn-infer,cnn-train", help="models_worker.py workloads")
    add_record_flag(ap, RESULTS)
    args = ap.parse_args(argv)
    opts = options(ap, args)
    if opts is None:
        return 2
    workloads = [w for w in args.workloads.split(",") if w]
    began = time.monotonic()
    solo: dict[str, list[float]] = {}
    rows: list[dict[str, Any]] = []
    about: dict[str, Any] = {}
    try:
        for w in workloads:
            solo[w] = [run((SOLO,), w, opts)["groups"]["solo"]["rate"]]
            print(f"solo before {w}: {solo[w][0]:.2f} steps/s", flush=True)
        for w in workloads:
            for name, groups in cases(w):
                watch = NvmlWatch(args.gpu) if "mps" in name else None
                result = run(groups, w, opts)
                nvml = "" if watch is None else summary(
                    watch.stop(), {r["pid"] for g in result["groups"].values() for r in g["results"] if "pid" in r})
                left = mps_left(15) if "mps" in name else []
                about = about or result["about"]
                for g in groups:
                    got = result["groups"][g.name]
                    rows.append({"workload": w, "case": name, "group": g.name, "rate": got["rate"],
                                 "charged": got["charged"], "agent_cpu": result["agent_cpu"], "nvml": nvml,
                                 "left": left})
                print(f"{w} {name}: " + ", ".join(f"{g.name} {result['groups'][g.name]['rate']:.2f} steps/s"
                                                  for g in groups) + (f"; {nvml}" if nvml else "")
                      + (f"; STILL RUNNING: {left}" if left else ""), flush=True)
        for w in workloads:
            solo[w].append(run((SOLO,), w, opts)["groups"]["solo"]["rate"])
            print(f"solo after {w}: {solo[w][1]:.2f} steps/s", flush=True)
    except RunFailed as e:
        print(f"a run failed: {e}", file=sys.stderr)
        return 2
    header = report_header(about, args, f"{args.seconds:g} s windows after {args.settle:g} s of settling; throughput "
                           "= the group's steps/s over the mean of solo before and after", began)
    lines = [header, "", "| workload | solo before / after (steps/s) |", "| --- | --- |"]
    lines += [f"| {w} | {s[0]:.2f} / {s[-1]:.2f} |" for w, s in solo.items()]
    lines += ["", "| workload | case | group | time charged | throughput (of solo) | sum of the pair | steps/s |",
              "|" + " --- |" * 7]
    for w in workloads:
        ref = sum(solo[w]) / len(solo[w])
        for case in dict.fromkeys(r["case"] for r in rows if r["workload"] == w):
            pair = [r for r in rows if r["workload"] == w and r["case"] == case]
            total = sum(r["rate"] for r in pair) / ref
            for r in pair:
                charged = f"{r['charged']:.3f}" if r["case"].startswith("time") else "- (not scheduled)"
                lines.append(f"| {w} | {case} | {r['group']} | {charged} | {r['rate'] / ref:.3f} | {total:.3f} | "
                             f"{r['rate']:.2f} |")
    notes = dict.fromkeys(f"{r['workload']} {r['case']}: {r['nvml']}" for r in rows if r["nvml"])
    lines += ["", *(f"- {n}" for n in notes)]
    if any(r["left"] for r in rows):
        lines.append(f"- MPS processes left after a run: {sorted({x for r in rows for x in r['left']})}")
    report = "\n".join(lines) + "\n"
    publish(report, "mps", {"header": header, "about": about, "solo": solo, "rows": rows},
            None if args.no_record or args.stand_in else RESULTS,
            "Isolation=mps against time slicing (bench/gpu/mps.py)")
    left = mps_left(5)
    if left:
        print(f"MPS processes still running at the end: {left}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
