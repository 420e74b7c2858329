"""A tensor-parallel service across two GPUs beside training, through the product only (issue 29).

The service (bench/gpu/ddp_worker.py --serve: a decoder's MLP blocks split over the ranks, an NCCL
all-reduce a layer, requests one after another with a pause between, rank 0 telling the others over
gloo) runs as `gemtrace run --group serve -- torchrun --standalone --nproc_per_node N ddp_worker.py
--serve`; beside it single-GPU ResNet-50 training jobs (`gemtrace run --group hogN`, one GPU each). Its
group spans the GPUs, so it takes gang turns (docs/scheduler.md): every request needs its turn on all of
them. Per case: the service's p50 / p99 / max latency against its solo (through gemtrace), the training
jobs' steps/s against a single-GPU job alone, and the time charged per GPU.

Cases:
  solo        the service alone, no quota (before and after the cases: latencies divide by their mean)
  equal       no quota, a training job on GPU 0 only: a request waits for that job's slice on GPU 0
  priority    the service at Priority 10, the same training job: p99 <= 1.5 x solo (priority_latency's target)
  busy        the service at Priority 10, a training job on every GPU: p99 <= 1.5 x solo
  opportunistic  the training job on GPU 0 `Opportunistic = yes`: p99 <= 1.5 x solo
  two         a second service in its own group over the same GPUs: each p99 <= 1.5 x solo
  beside-ddp  the service at Priority 10 beside a data-parallel ResNet-50 job over the same GPUs
              (bench/gpu/gang_ddp.py's): p99 <= 1.5 x solo, and the job's steps/s
  ddp-equal   the same at equal priority
  ddp-solo    the data-parallel job alone, no quota (the job's steps/s divide by its mean)
  raw-ddp     `beside-ddp` without gemtrace
  raw-solo    the service alone without gemtrace; and a single-GPU job alone (the training jobs' solo)
  raw-equal   `equal` without gemtrace: the driver's own time slicing

    python3 -m bench.gpu.gang_serve [--cases solo,equal,...] [--gpus 2] [--seconds 10] [--warmup 40]
        [--pause-ms 30]

Prints a markdown table; with $OUT set writes gang_serve.md and gang_serve.json there. Needs what
bench/gpu/gang_ddp.py needs.
"""

from __future__ import annotations

import argparse
import time

from bench.gpu.gang_ddp import Case, Job, cases_to_run, charged_cell, not_warm, publish_table, run_cases
from bench.gpu.models_torch import GroupSpec

TARGET = 1.5  # p99 over solo p99 where the service outranks or is served first (bench/gpu/priority_latency.py)
PLAN = ("raw-solo", "solo", "equal", "priority", "busy", "opportunistic", "two", "beside-ddp", "raw-equal", "solo")


def plan_cases(gpus: int) -> dict[str, Case]:
    service = Job("serve", True, serve=True)
    hogs = tuple(Job(f"hog{i}", False, i) for i in range(gpus))
    high = GroupSpec("serve", priority=10)
    return {c.name: c for c in (
        Case("solo", "the service alone, no quota", (GroupSpec("serve"),), (service,)),
        Case("equal", "no quota, a training job on GPU 0", (GroupSpec("serve"), GroupSpec("hog0")),
             (service, hogs[0])),
        Case("priority", "Priority 10, a training job on GPU 0", (high, GroupSpec("hog0")), (service, hogs[0]),
             target={"serve": TARGET}),
        Case("busy", "Priority 10, a training job on every GPU", (high, *(GroupSpec(h.group) for h in hogs)),
             (service, *hogs), target={"serve": TARGET}),
        Case("opportunistic", "the training job on GPU 0 opportunistic",
             (GroupSpec("serve"), GroupSpec("hog0", opportunistic=True)), (service, hogs[0]),
             target={"serve": TARGET}),
        Case("two", "a second service like it, in its own group", (GroupSpec("serve"), GroupSpec("serve2")),
             (service, Job("serve2", True, serve=True)), target={"serve": TARGET, "serve2": TARGET}),
        Case("beside-ddp", "Priority 10, a data-parallel training job over the same GPUs",
             (high, GroupSpec("ddp")), (service, Job("ddp", True)), target={"serve": TARGET}),
        Case("ddp-equal", "no quota, a data-parallel training job over the same GPUs",
             (GroupSpec("serve"), GroupSpec("ddp")), (service, Job("ddp", True))),
        Case("ddp-solo", "the data-parallel job alone, no quota", (GroupSpec("ddp"),), (Job("ddp", True),)),
        Case("raw-ddp", "without gemtrace: a data-parallel training job over the same GPUs", (),
             (service, Job("ddp", True)), gated=False),
        Case("raw-solo", "without gemtrace: the service alone", (), (service,), gated=False),
        Case("raw-equal", "without gemtrace: a training job on GPU 0", (), (service, hogs[0]), gated=False),
    )}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=float, default=40.0)
    parser.add_argument("--pause-ms", type=float, default=30.0, help="between an answer and the next request")
    args, named = cases_to_run(parser, PLAN, "a service", plan_cases)
    cases = dict(named)
    began = time.monotonic()
    runs, hog_solo = run_cases(named, args, ((), ("--pause-ms", f"{args.pause_ms:g}")))
    solos = [r["results"]["serve"] for n, r in runs if n == "solo"]
    solo_p50 = sum(s["p50_ms"] for s in solos) / len(solos) if solos else None
    solo_p99 = sum(s["p99_ms"] for s in solos) / len(solos) if solos else None
    raw = next((r["results"]["serve"] for n, r in runs if n == "raw-solo"), None)
    hog_rate = hog_solo["results"]["hog0"]["rate"] if hog_solo else None
    ddp_solos = [r["results"]["ddp"]["rate"] for n, r in runs if n == "ddp-solo"]
    ddp_rate = sum(ddp_solos) / len(ddp_solos) if ddp_solos else None
    raw_text = f"{raw['p50_ms']:.1f} / {raw['p99_ms']:.1f}" if raw else "-"
    per_gpu = " / ".join(f"GPU {i}" for i in range(args.gpus))
    rows = [f"| case | group | p50 ms (x solo) | p99 ms (x solo) | max ms | requests/s or steps/s (of solo) | target "
            f"| charged {per_gpu} |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    missed = 0
    for name, run in runs:
        case = cases[name]
        for group, result in run["results"].items():
            charged = charged_cell(run, group)
            if group.startswith("serve"):
                base = (solo_p50, solo_p99) if case.gated else (raw and raw["p50_ms"], raw and raw["p99_ms"])
                x50 = result["p50_ms"] / base[0] if base[0] else float("nan")
                x99 = result["p99_ms"] / base[1] if base[1] else float("nan")
                most = case.target.get(group)
                verdict = "" if most is None else (f"p99 ≤ {most:g} x " + ("met" if x99 <= most else "**missed**"))
                missed += most is not None and not x99 <= most
                rows.append(f"| {name}: {case.title} | {group} | {result['p50_ms']:.1f} ({x50:.2f}) | "
                            f"{result['p99_ms']:.1f} ({x99:.2f}) | {result['max_ms']:.1f} | {result['rate']:.1f} | "
                            f"{verdict} | {charged} |")
            else:  # (a training job: a single-GPU one against a single-GPU job alone, the DDP job against ddp-solo)
                base = hog_rate if group.startswith("hog") else ddp_rate
                ratio = result["rate"] / base if base else float("nan")
                cold = not_warm(result)
                missed += bool(cold)
                rows.append(f"| {name}: {case.title} | {group} | - | - | - | {result['rate']:.2f} ({ratio:.3f}) | "
                            f"{cold} | {charged} |")
    publish_table("gang_serve", runs, hog_solo, rows,
                  f"the service's solo through gemtrace p50 {solo_p50 and f'{solo_p50:.1f}'} / p99 "
                  f"{solo_p99 and f'{solo_p99:.1f}'} ms, without gemtrace {raw_text} ms; a single-GPU job alone "
                  f"{hog_rate and f'{hog_rate:.2f}'} steps/s; {args.gpus} GPUs; a pause of {args.pause_ms:g} ms "
                  f"after each answer; the data-parallel job alone {ddp_rate and f'{ddp_rate:.2f}'} steps/s; "
                  f"windows of {args.seconds:g} s after {args.warmup:g} s", began)
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
