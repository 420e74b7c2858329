"""Production and opportunistic work on one GPU, through the product only (issue 30).

A latency-critical service in a production group shares the GPU with a ResNet-50 training loop
(models_worker.py's cnn-train, bf16, batch 64) in an opportunistic one. Each run starts `gemtrace agent`
and the groups' processes with `gemtrace run` (models_torch.py's run(): a temporary state dir and
resource file per run, --no-ebpf unless --ebpf). Services (models_worker.py, paced: --pause-ms between
an answer and the next request):
  decoder   a Hugging Face GPT-2-shaped decoder, GPT2LMHeadModel(GPT2Config()) with random weights,
            64 tokens generated greedily at batch 1 per request (decoder-infer)
  cnn       ResNet-18 at batch 1 (cnn-infer)
Each service beside the training loop, in four settings (the case is SERVICE-SETTING):
  off       time slicing with Priority: the service at Priority 10, the training at 0 (before issue 30)
  gate      the training group Opportunistic = yes (time slicing for the rest): its gate keeps 2
            kernels queued while the service has work queued, half a millisecond otherwise
  gate0     the same with GEMTRACE_BESIDE_KERNELS=0 for the training: none while the service has work
            queued (it fills only the time between the service's bursts)
  mps       both groups Isolation = mps, the training one Opportunistic = yes: its clients start at
            MPS's low client priority (CUDA_MPS_CLIENT_PRIORITY=1), the service's at normal
  equal     both production, no quota, the same priority: what the scheduler does where nothing binds (on
            one GPU, turns; bb8a4c3 shared it under the driver's slicing, bench/results/colocation.md)
  turns     the same with MinUtil = 0.01 each: turns whatever the rule for groups nothing binds
and two training loops, one production and one opportunistic (pair-gate, pair-gate0, pair-mps, and
pair-mps-smN: under MPS with the opportunistic group at MaxUtil N%, a share of the SMs), or both
production (pair-equal, pair-turns). Solo
runs of each workload (gated, no quota) before and after; ratios are over their mean. The cases run
most telling first (the settings of issue 30, then gate0 and the pair's SM caps, then off, equal and
turns), so that a budget cut drops the baseline the issue measured already.

Per case: the service's p50 / p99 per request against solo, the training's steps/s against solo, the
time the agent charged each group, the agent's CPU. The fraction of time the service's kernels keep the
GPU busy is NVML's utilisation (the share of time a kernel ran) sampled every 0.1 s over the solo
service's window. Targets (issue 30): service p99 <= 1.2 x solo, training >= 0.5 of solo beside a service
busy < 40% of the time; pair: production >= 0.95 of solo, both together >= 1.0.

    python3 -m bench.gpu.colocation [--cases decoder,cnn,pair | decoder-gate,...] [--seconds 10]
        [--settle 2] [--pause-ms 20] [--budget-s 450] [--gpu 0] [--ebpf] [--no-record] [--stand-in]

Prints a markdown table and appends it, dated, to bench/results/colocation.md (not with --no-record,
nor with --stand-in); with $OUT set, also writes colocation.md and colocation.json there. 20 runs of
about 25 s on an H100 with the defaults; --budget-s (440 s) skips the cases that would not fit, solo
after included, so that the whole stays within 8 minutes. Exit
status 0 when every target was met, 1 when one was missed, 2 on bad usage or a failed run. Needs, from
the repo root: build/libgemgate.so, torch with CUDA, torchvision, transformers, nvidia-ml-py, and
nvidia-cuda-mps-control in PATH for the mps cases (/usr/local/nvidia/bin is added where it is found).
Leaves no MPS daemon running.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.gpu.models_torch import (
    REPO,
    SOLO,
    GroupSpec,
    RunFailed,
    options,
    parser,
    report_header,
    run,
)
from bench.gpu.mps import mps_left
from bench.recording import add_record_flag, publish

RESULTS = REPO / "bench" / "results" / "colocation.md"
TRAIN = "cnn-train"
SERVICES = {"decoder": "decoder-infer", "cnn": "cnn-infer"}
SETTINGS = ("gate", "mps", "gate0", "off", "equal", "turns")
PRODUCTION_ONLY = ("off", "equal", "turns")  # settings where the training is no opportunistic group
HIGH = 10
P99_TARGET = 1.2  # service p99 over solo p99
TRAIN_TARGET = 0.5  # training steps/s over solo, beside a service busy less than BUSY_BOUND
BUSY_BOUND = 0.4
PAIR_PRODUCTION = 0.95
PAIR_TOTAL = 1.0
START_UP_GUESS_S = 15.0  # a run's start and stop before one was measured: agent, torch, warm-up, teardown
NVIDIA_BIN = Path("/usr/local/nvidia/bin")


@dataclass(frozen=True)
class Case:
    name: str
    service: str | None  # the service workload; None: the training pair
    setting: str
    spare_sm: int | None = None  # mps: the opportunistic group's MaxUtil in percent, a share of the SMs

    def groups(self, pause_ms: float) -> tuple[GroupSpec, ...]:
        iso = "mps" if self.setting == "mps" else "time"
        min_util = 0.01 if self.setting == "turns" else 0.0
        spare = GroupSpec("spare", workload=TRAIN, isolation=iso, opportunistic=self.setting not in PRODUCTION_ONLY,
                          min_util=min_util,
                          max_util=1.0 if self.spare_sm is None else self.spare_sm / 100,
                          env=(("GEMTRACE_BESIDE_KERNELS", "0"),) if self.setting == "gate0" else ())
        if self.service is None:
            return GroupSpec("prod", workload=TRAIN, isolation=iso, min_util=min_util), spare
        service = GroupSpec("serve", workload=self.service, isolation=iso, min_util=min_util,
                            priority=HIGH if self.setting == "off" else 0, worker_args=("--pause-ms", f"{pause_ms:g}"))
        return service, spare


# The pair under MPS with the opportunistic training held to a few SMs: what it costs the production one.
PAIR_SPARE_SM = (1, 2, 5, 10, 20)
CASES = tuple(sorted([Case(f"{short}-{s}", w, s) for short, w in SERVICES.items() for s in SETTINGS] +
                     [Case(f"pair-{s}", None, s) for s in SETTINGS if s != "off"] +
                     [Case(f"pair-mps-sm{n}", None, "mps", n) for n in PAIR_SPARE_SM],
                     key=lambda c: max(0, SETTINGS.index(c.setting) - 1) + (c.spare_sm is not None)))
CASE = {c.name: c for c in CASES}
FAMILIES = {**{short: [c.name for c in CASES if c.service == w] for short, w in SERVICES.items()},
            "pair": [c.name for c in CASES if c.service is None]}


def parse_cases(text: str) -> tuple[str, ...]:
    names: list[str] = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        if word not in CASE and word not in FAMILIES:
            raise argparse.ArgumentTypeError(f"case {word}: choose among {', '.join([*FAMILIES, *CASE])}")
        names += FAMILIES.get(word, [word])
    if not names:
        raise argparse.ArgumentTypeError("no case given")
    return tuple(dict.fromkeys(names))


class Utilisation:
    """NVML's GPU utilisation (the share of time a kernel ran), sampled every 0.1 s with its time."""

    def __init__(self, gpu: int) -> None:
        self.samples: list[tuple[float, float]] = []
        self.error = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(gpu,), daemon=True)
        self._thread.start()

    def _run(self, gpu: int) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
            while not self._stop.wait(0.1):
                self.samples.append((time.monotonic(), pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100))
        except Exception as e:  # noqa: BLE001 - the run's other figures still stand; the table says why
            self.error = str(e)

    def over(self, window: tuple[float, float]) -> float | None:
        self._stop.set()
        self._thread.join(5)
        inside = [u for t, u in self.samples if window[0] <= t <= window[1]]
        return sum(inside) / len(inside) if inside else None


def mps_ready() -> str:
    """Empty where nvidia-cuda-mps-control is found (after adding /usr/local/nvidia/bin to PATH where it
    is there), else why not."""
    if shutil.which("nvidia-cuda-mps-control") is None and (NVIDIA_BIN / "nvidia-cuda-mps-control").exists():
        os.environ["PATH"] = f"{NVIDIA_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return "" if shutil.which("nvidia-cuda-mps-control") else "nvidia-cuda-mps-control is not in PATH"


def case_fields(case: Case) -> dict[str, Any]:
    """What a row says of its case (the table's setting column reads them)."""
    return {"case": case.name, "service": case.service, "setting": case.setting, "spare_sm": case.spare_sm}


def service_row(case: Case, result: dict[str, Any]) -> dict[str, Any]:
    serve, spare = result["groups"]["serve"], result["groups"]["spare"]
    latency = serve["results"][0]
    return {**case_fields(case), "requests": latency.get("requests", 0), "p50_ms": latency.get("p50_ms", float("nan")),
            "p99_ms": latency.get("p99_ms", float("nan")), "serve_charged": serve["charged"],
            "train_rate": spare["rate"], "train_charged": spare["charged"], "agent_cpu": result["agent_cpu"]}


def judge(rows: list[dict[str, Any]], solo: dict[str, dict[str, Any]]) -> None:
    """Each row's ratios over solo (the mean of before and after) and its targets' results."""
    train = solo[TRAIN]["mean_rate"]
    for r in rows:
        r["train_ratio"] = r["train_rate"] / train
        if r["service"] is not None:
            ref = solo[r["service"]]
            r["p50_ratio"], r["p99_ratio"] = r["p50_ms"] / ref["mean_p50_ms"], r["p99_ms"] / ref["mean_p99_ms"]
            busy = ref.get("busy")
            if r["setting"] == "off":
                r["result"] = "- (before issue 30)"
                continue
            if r["setting"] in PRODUCTION_ONLY:
                r["result"] = "-"
                continue
            checks = [r["p99_ratio"] <= P99_TARGET]
            if busy is not None and busy < BUSY_BOUND:
                checks.append(r["train_ratio"] >= TRAIN_TARGET)
            r["result"] = "met" if all(checks) else "missed"
        else:
            r["prod_ratio"] = r["prod_rate"] / train
            if r["setting"] in PRODUCTION_ONLY:
                r["result"] = "-"
                continue
            r["result"] = "met" if r["prod_ratio"] >= PAIR_PRODUCTION and \
                r["prod_ratio"] + r["train_ratio"] >= PAIR_TOTAL else "missed"


def render(header: str, solo: dict[str, dict[str, Any]], rows: list[dict[str, Any]], skipped: list[str]) -> str:
    lines = [header, "", "Solo: each workload alone, gated, in a group with no quota; the services' GPU busy is "
             "NVML's utilisation over the window (the share of time a kernel ran).", "",
             "| workload | before | after | GPU busy (before) |", "| --- | --- | --- | --- |"]
    for w, s in solo.items():
        def fig(run: dict[str, Any] | None) -> str:
            if run is None:
                return "-"
            if "p99_ms" in run:
                return f"p50 {run['p50_ms']:.2f} ms, p99 {run['p99_ms']:.2f} ms ({run['requests']} requests)"
            return f"{run['rate']:.2f} steps/s"
        busy = "-" if s.get("busy") is None else f"{s['busy']:.3f}"
        lines.append(f"| {w} | {fig(s.get('before'))} | {fig(s.get('after'))} | {busy} |")
    titles = {"off": f"Priority {HIGH} / 0, time slicing", "gate": "Opportunistic (the gate: 2 kernels queued)",
              "gate0": "Opportunistic, GEMTRACE_BESIDE_KERNELS=0 (none queued)",
              "mps": "Opportunistic, Isolation=mps (MPS client priority)",
              "equal": "both production, no quota",
              "turns": "both production, MinUtil 0.01 each (turns)"}

    def title(row: dict[str, Any]) -> str:
        sm = row.get("spare_sm")
        return titles[row["setting"]] + ("" if sm is None else f", the opportunistic one at MaxUtil {sm / 100:g} (SMs)")
    services = [r for r in rows if r["service"] is not None]
    if services:
        lines += ["", f"Targets: service p99 ≤ {P99_TARGET:g} × solo; training ≥ {TRAIN_TARGET:g} of solo where the "
                  f"service keeps the GPU busy < {BUSY_BOUND:g} of the time.", "",
                  "| service | setting | requests | p50 ms (× solo) | p99 ms (× solo) | service charged | training "
                  "steps/s (of solo) | training charged | agent CPU | result |", "|" + " --- |" * 10]
    for r in services:
        lines.append(f"| {r['service']} | {title(r)} | {r['requests']} | {r['p50_ms']:.2f} "
                     f"({r['p50_ratio']:.2f}) | {r['p99_ms']:.2f} ({r['p99_ratio']:.2f}) | {r['serve_charged']:.3f} | "
                     f"{r['train_rate']:.2f} ({r['train_ratio']:.3f}) | {r['train_charged']:.3f} | "
                     f"{r['agent_cpu']:.1f}% | {r['result']} |")
    pairs = [r for r in rows if r["service"] is None]
    if pairs:
        lines += ["", f"Two training loops ({TRAIN}), production and opportunistic (both production where the "
                  f"setting says so). Targets: production ≥ {PAIR_PRODUCTION:g} of solo, the two together ≥ "
                  f"{PAIR_TOTAL:g}.", "",
                  "| setting | production steps/s (of solo) | opportunistic steps/s (of solo) | together | "
                  "charged (production / opportunistic) | result |", "|" + " --- |" * 6]
        for r in pairs:
            lines.append(f"| {title(r)} | {r['prod_rate']:.2f} ({r['prod_ratio']:.3f}) | "
                         f"{r['train_rate']:.2f} ({r['train_ratio']:.3f}) | {r['prod_ratio'] + r['train_ratio']:.3f} "
                         f"| {r['prod_charged']:.3f} / {r['train_charged']:.3f} | {r['result']} |")
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, seconds=10.0, paced=True)
    ap.add_argument("--cases", type=parse_cases, default=tuple(CASE),
                    help=f"comma-separated cases or families ({', '.join(FAMILIES)}), among {', '.join(CASE)} "
                    "(default all)")
    ap.add_argument("--budget-s", type=float, default=440.0,
                    help="skip the cases that would end past this many seconds from the start, solo runs after "
                    "included (default 440; 0: no limit)")
    add_record_flag(ap, RESULTS)
    args = ap.parse_args(argv)
    opts = options(ap, args)
    if opts is None:
        return 2
    cases = [CASE[name] for name in args.cases]
    skipped: list[str] = []
    if args.stand_in:  # the simulated GPU's stand-in for the MPS control daemon (it runs no server)
        os.environ["PATH"] = f"{REPO / 'simgpu'}{os.pathsep}{os.environ.get('PATH', '')}"
    why_not_mps = mps_ready() if any(c.setting == "mps" for c in cases) else ""
    if why_not_mps:
        skipped += [f"{c.name} ({why_not_mps})" for c in cases if c.setting == "mps"]
        cases = [c for c in cases if c.setting != "mps"]
    workloads = list(dict.fromkeys([c.service for c in cases if c.service is not None] + [TRAIN]))
    began = time.monotonic()
    spent: list[float] = []

    def timed(groups: tuple[GroupSpec, ...], workload: str, watch: Utilisation | None = None) -> dict[str, Any]:
        t = time.monotonic()
        try:
            result = run(groups, workload, opts)
        finally:
            spent.append(time.monotonic() - t - opts.seconds)
        if watch is not None:
            result["busy"] = watch.over(result["window"])
        return result

    def per_run() -> float:
        return opts.seconds + (sum(spent) / len(spent) if spent else START_UP_GUESS_S)

    def solo_run(workload: str, when: str) -> dict[str, Any]:
        service = workload != TRAIN
        group = replace(SOLO, worker_args=("--pause-ms", f"{args.pause_ms:g}")) if service else SOLO
        result = timed((group,), workload, Utilisation(args.gpu) if service and when == "before" else None)
        got = result["groups"]["solo"]
        first = got["results"][0]
        fig: dict[str, Any] = {"rate": got["rate"]}
        if service:
            fig.update(p50_ms=first.get("p50_ms", float("nan")), p99_ms=first.get("p99_ms", float("nan")),
                       requests=first.get("requests", 0))
        print(f"solo {when} {workload}: " + (f"p50 {fig['p50_ms']:.2f} ms, p99 {fig['p99_ms']:.2f} ms, GPU busy "
                                             f"{result.get('busy')}" if service else f"{fig['rate']:.2f} steps/s"),
              flush=True)
        solo.setdefault(workload, {})[when] = fig
        if "busy" in result:
            solo[workload]["busy"] = result["busy"]
        return result

    print(f"plan: solo {', '.join(workloads)}; {', '.join(c.name for c in cases)}; solo again: "
          f"{len(cases) + 2 * len(workloads)} runs, about {per_run() * (len(cases) + 2 * len(workloads)) / 60:.1f} min",
          flush=True)
    solo: dict[str, dict[str, Any]] = {}
    about: dict[str, Any] = {}
    try:
        for w in workloads:
            ran = solo_run(w, "before")
            about = about or ran["about"]
    except RunFailed as e:
        print(f"a solo run failed, so nothing can be compared: {e}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    failed = False
    for case in cases:
        left = args.budget_s - (time.monotonic() - began)
        if args.budget_s and per_run() * (1 + len(workloads)) > left:
            skipped.append(f"{case.name} (budget: {left:.0f} s left, a run takes about {per_run():.0f} s)")
            print(f"skipped: {skipped[-1]}", flush=True)
            continue
        groups = case.groups(args.pause_ms)
        try:
            result = timed(groups, case.service or TRAIN)
        except RunFailed as e:  # the other cases still count: say which failed and go on
            failed = True
            skipped.append(f"{case.name} (failed: {str(e).splitlines()[0]})")
            print(f"a run failed ({case.name}): {e}", file=sys.stderr)
            continue
        finally:
            waited = time.monotonic()
            left_running = mps_left(15) if case.setting == "mps" else []
            spent[-1] += time.monotonic() - waited  # (a run's cost, for the budget's estimate)
            if left_running:
                print(f"MPS processes still running after {case.name}: {left_running}", file=sys.stderr)
        if case.service is not None:
            rows.append(service_row(case, result))
            r = rows[-1]
            print(f"{case.name}: p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms; training {r['train_rate']:.2f} "
                  f"steps/s; charged {r['serve_charged']:.3f} / {r['train_charged']:.3f}", flush=True)
        else:
            prod, spare = result["groups"]["prod"], result["groups"]["spare"]
            rows.append({**case_fields(case), "prod_rate": prod["rate"],
                         "prod_charged": prod["charged"], "train_rate": spare["rate"],
                         "train_charged": spare["charged"], "agent_cpu": result["agent_cpu"]})
            print(f"{case.name}: production {prod['rate']:.2f} steps/s, opportunistic {spare['rate']:.2f} steps/s",
                  flush=True)
    for w in workloads:
        try:
            solo_run(w, "after")
        except RunFailed as e:  # the reference is then solo before alone
            failed = True
            print(f"solo after {w} failed: {e}", file=sys.stderr)
    for s in solo.values():
        runs = [s[k] for k in ("before", "after") if k in s]
        s["mean_rate"] = sum(r["rate"] for r in runs) / len(runs)
        if "p99_ms" in runs[0]:
            s["mean_p50_ms"] = sum(r["p50_ms"] for r in runs) / len(runs)
            s["mean_p99_ms"] = sum(r["p99_ms"] for r in runs) / len(runs)
    judge(rows, solo)
    header = report_header(about, args, f"services paced {args.pause_ms:g} ms between requests (decoder: "
                           "GPT2LMHeadModel(GPT2Config()), 64 tokens a request; cnn: ResNet-18), batch 1, beside "
                           f"ResNet-50 bf16 training, batch 64; {args.seconds:g} s windows after {args.settle:g} s "
                           "of settling; ratios over the mean of solo before and after", began)
    report = render(header, solo, rows, skipped)
    publish(report, "colocation", {"header": header, "about": about, "seconds": args.seconds,
                                   "pause_ms": args.pause_ms, "solo": solo, "rows": rows, "skipped": skipped},
            None if args.no_record or args.stand_in else RESULTS,
            "Production and opportunistic work on one GPU (bench/gpu/colocation.py)")
    left = mps_left(5)
    if left:
        print(f"MPS processes still running at the end: {left}", file=sys.stderr)
    if failed:
        return 2
    return 0 if all(r["result"] != "missed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
