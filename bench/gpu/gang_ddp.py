"""A data-parallel job across GPUs under gemtrace's quotas, through the product only (issue 29).

Each case starts `gemtrace agent --no-ebpf` (its own state dir and resource file), then the job as a user
would: `gemtrace run --group ddp -- torchrun --standalone --nproc_per_node N bench/gpu/ddp_worker.py
--ddp` (ResNet-50, bf16, batch 64 a rank, NCCL), and beside it single-GPU ResNet-50 training jobs, each
`gemtrace run --group hogN` with CUDA_VISIBLE_DEVICES naming its GPU. Every process counts the steps it
ends within one shared window (ddp_worker.py). Per group it prints steps/s against its solo rate, and
the time the agent charged it on each GPU (gemtrace_group_gpu_seconds_total over the window). The
"without gemtrace" rows run the same processes with no agent and no gate: the driver's own time slicing.

Cases (issue 29's targets on two H100s):
  solo          the job alone, gated, no quota (before and after the cases: the table divides by their mean)
  solo-capped   the job alone, MaxUtil 0.99: what the short queue of a hold in sight costs it
  cap30         MaxUtil 0.3, a single-GPU job on each GPU       the job >= 0.28 of solo
  min60         MinUtil 0.6, a single-GPU job on each GPU       the job >= 0.57 of solo
  equal         no quota, a single-GPU job on each GPU          >= 0.45 and >= the same without gemtrace
  one-busy      no quota, a single-GPU job on GPU 0 only        shown
  two-jobs      two jobs in two groups, no quota                shown
  sweep         one group's single-GPU runs, one a GPU, a single-GPU job of another group on GPU 0:
                the run on GPU 1, alone there, >= 0.9 of a single-GPU job's solo (not a gang)
  raw-equal     `equal` without gemtrace
  raw-solo      the job alone without gemtrace, and a single-GPU job alone (the hogs' solo)

    python3 -m bench.gpu.gang_ddp [--cases solo,cap30,...] [--gpus 2] [--seconds 10] [--warmup 40]
        [--pause-ms 0] [--job ddp|jax] [--agent-log DIR]

With `--gpus 1` the job is one rank (torchrun's one process, its all-reduce with itself) beside one
single-GPU job: no gang, one GPU's rules (where no quota binds, the two share the GPU under the driver's
slicing: docs/scheduler.md), against the same processes without gemtrace.

`--job jax`: the job is one JAX process over all the GPUs (bench/gpu/jax_worker.py: a pmap'd step with an
all-reduce) instead of torchrun's ranks; its group is still named ddp.

Prints a markdown table; with $OUT set writes gang_ddp.md and gang_ddp.json there. Needs --gpus GPUs (2 by
default), torch with CUDA and torchvision, build/libgemgate.so, and the agent's Python dependencies on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.gpu.models_torch import REPO, Agent, GroupSpec, gemtrace, product_env, report_header
from bench.recording import publish

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"
JAX_WORKER = Path(__file__).resolve().parent / "jax_worker.py"
# Leave NVLink multicast off (the device machine's notes: NCCL's NVLS and torch's symmetric memory).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Job:
    group: str
    ddp: bool  # across all the run's GPUs (torchrun), or one process on `gpu`
    gpu: int = 0
    serve: bool = False  # with ddp: ddp_worker.py's tensor-parallel service (bench/gpu/gang_serve.py)
    jax: bool = False  # with ddp: one JAX process over all the GPUs (jax_worker.py) instead of torchrun's ranks


@dataclass(frozen=True)
class Case:
    name: str
    title: str
    groups: tuple[GroupSpec, ...]
    jobs: tuple[Job, ...]
    gated: bool = True
    target: dict[str, float] = field(default_factory=dict)  # group -> least share of its solo


DDP = Job("ddp", True)
JOBS = {"ddp": DDP, "jax": Job("ddp", True, jax=True)}  # --job: what spans the GPUs (its group is named ddp)
# More arguments of ddp_worker.py for the jobs that span the GPUs: (the training jobs', the services').
JobArgs = tuple[tuple[str, ...], tuple[str, ...]]


def plan_cases(gpus: int, job: Job = DDP) -> dict[str, Case]:
    """The cases on a host of `gpus` GPUs: the job spans all of them, a single-GPU job sits on each."""
    hogs = tuple(Job(f"hog{i}", False, i) for i in range(gpus))
    uncapped = tuple(GroupSpec(h.group) for h in hogs)
    return {c.name: c for c in (
        Case("solo", "the job alone, no quota", (GroupSpec("ddp"),), (job,)),
        Case("solo-capped", "the job alone, MaxUtil 0.99 (released with the short queue of a hold in sight)",
             (GroupSpec("ddp", max_util=0.99),), (job,)),
        Case("cap30", "MaxUtil 0.3, a single-GPU job on each GPU", (GroupSpec("ddp", max_util=0.3), *uncapped),
             (job, *hogs), target={"ddp": 0.28}),
        Case("min60", "MinUtil 0.6, a single-GPU job on each GPU", (GroupSpec("ddp", min_util=0.6), *uncapped),
             (job, *hogs), target={"ddp": 0.57}),
        Case("equal", "no quota, a single-GPU job on each GPU", (GroupSpec("ddp"), *uncapped), (job, *hogs),
             target={"ddp": 0.45}),
        Case("one-busy", "no quota, a single-GPU job on GPU 0 only", (GroupSpec("ddp"), GroupSpec("hog0")),
             (job, hogs[0])),
        Case("two-jobs", "two jobs in two groups, no quota", (GroupSpec("ddp"), GroupSpec("ddp2")),
             (job, replace(job, group="ddp2"))),
        Case("sweep", "one group's single-GPU runs, one a GPU (not a job across them), beside a single-GPU "
             "job on GPU 0", (GroupSpec("sweep"), GroupSpec("hog0")),
             (*(Job("sweep", False, i) for i in range(gpus)), hogs[0]), target={"sweep (GPU 1)": 0.9}),
        Case("raw-equal", "without gemtrace: a single-GPU job on each GPU", (), (job, *hogs), gated=False),
        Case("raw-solo", "without gemtrace: the job alone, then a single-GPU job alone", (), (job,), gated=False),
    )}

PLAN = ("raw-solo", "solo", "cap30", "min60", "equal", "raw-equal", "one-busy", "two-jobs", "sweep", "solo")


def start_job(job: Job, gpus: int, window: tuple[float, float], env: dict[str, str], state: Path | None,
              log: Path, job_args: JobArgs = ((), ())) -> subprocess.Popen[str]:
    worker = [sys.executable, str(WORKER)]
    if job.jax:
        worker = [sys.executable, str(JAX_WORKER)]
    elif job.ddp:
        worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
                  str(WORKER), *(("--serve", *job_args[1]) if job.serve else ("--ddp", *job_args[0]))]
    env = {**env, **NCCL_ENV, "BENCH_WINDOW": f"{window[0]:.3f},{window[1]:.3f}"}
    if not job.ddp:
        env["CUDA_VISIBLE_DEVICES"] = str(job.gpu)
    if job.jax:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # not 75% of each GPU: the other jobs need theirs
    argv = worker if state is None else gemtrace("run", "--group", job.group, "--state-dir", str(state),
                                                 "--require-agent", "--", *worker)
    return subprocess.Popen(argv, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=log.open("w"))


def result_of(proc: subprocess.Popen[str], log: Path) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=180)
    for line in out.splitlines():
        if line.startswith("{") and '"result"' in line:
            return dict(json.loads(line))
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    raise RuntimeError(f"a job gave no result (exit {proc.returncode}); its stderr ends:\n{tail}")


def result_key(job: Job, jobs: tuple[Job, ...]) -> str:
    """A job's row: its group's name, and its GPU where the group has several jobs."""
    return job.group if sum(j.group == job.group for j in jobs) == 1 else f"{job.group} (GPU {job.gpu})"


def scrape(agent: Agent | None, uuids: list[str]) -> list[tuple[float, dict[str, float]]]:
    """Each GPU's (when, charged per group), all from one scrape."""
    if agent is None:
        return []
    when, by_gpu = agent.charged_on(tuple(uuids))
    return [(when, by_gpu[uuid]) for uuid in uuids]


def run_case(case: Case, gpus: int, seconds: float, warmup: float,
             job_args: JobArgs = ((), ()), keep_log: Path | None = None) -> dict[str, Any]:
    """One case's window; with `keep_log`, the agent logs at debug level (each GPU's changed decisions, each
    gang turn) and its log is kept there, gzipped."""
    env = product_env()
    with tempfile.TemporaryDirectory(prefix="gemtrace-ddp-") as tmp:
        work = Path(tmp)
        agent = Agent(work, case.groups, env, ebpf=False, log_level="debug" if keep_log else "info") \
            if case.gated else None
        procs = []
        try:
            uuids = [agent.gpu_uuid(i) for i in range(gpus)] if agent else []
            window = (time.monotonic() + warmup, time.monotonic() + warmup + seconds)
            for n, job in enumerate(case.jobs):
                log = work / f"{job.group}-{n}.log"
                procs.append((job, start_job(job, gpus, window, env, agent.state if agent else None, log, job_args),
                              log))
            time.sleep(max(0.0, window[0] - time.monotonic()))
            charged0 = scrape(agent, uuids)
            time.sleep(max(0.0, window[1] - time.monotonic()))
            charged1 = scrape(agent, uuids)
            results = {result_key(job, case.jobs): result_of(proc, log) for job, proc, log in procs}
        finally:
            for _, proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
            if agent:
                agent.stop()
                if keep_log:
                    keep_log.parent.mkdir(parents=True, exist_ok=True)
                    keep_log.write_bytes(gzip.compress(agent.log.read_bytes()))
    charged: dict[str, list[float]] = {}
    for (t0, c0), (t1, c1) in zip(charged0, charged1, strict=True):
        for group in c1:
            charged.setdefault(group, []).append((c1[group] - c0.get(group, 0.0)) / (t1 - t0))
    return {"results": results, "charged": charged}


# A job that ended fewer steps than this before its window opened was measured in its warm-up (cuDNN's
# autotuning, NCCL's first collectives, a fresh machine's cold caches): four ResNet-50 ranks on a fresh 4 x
# H200 machine took 20-30 s from their start to their first step, and a 14 s warm-up read a tenth of the
# steady rate (bench/results/gang_ddp.md, 2026-11-28 20:51-21:21).
WARM_STEPS = 10


def not_warm(result: dict[str, Any]) -> str:
    """A table's flag for a training job that ended fewer than WARM_STEPS steps before its window, or ""."""
    before = result.get("steps_before", WARM_STEPS)
    return f" **not warm: {before} steps before the window** (raise --warmup)" if before < WARM_STEPS else ""


def cases_to_run(parser: argparse.ArgumentParser, plan: tuple[str, ...], what: str,
                 planner: Callable[[int], dict[str, Case]]) -> tuple[argparse.Namespace, list[tuple[str, Case]]]:
    """Parses --cases/--seconds/--gpus (and whatever `parser` has already) and returns the cases named,
    in order; exits 2 on a bad one. `what`: the thing that spans the GPUs, for the error."""
    parser.add_argument("--cases", default=",".join(plan))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--gpus", type=int, default=2, help=f"GPUs {what} spans, a single-GPU job on each")
    parser.add_argument("--agent-log", metavar="DIR",
                        help="run the agent at --log-level debug and keep each case's log in DIR (gzipped)")
    args = parser.parse_args()
    if args.gpus < 1:
        parser.exit(2, f"--gpus {args.gpus}: {what} needs at least 1 GPU\n")
    cases = planner(args.gpus)
    unknown = [n for n in args.cases.split(",") if n not in cases]
    if unknown:
        parser.exit(2, f"unknown case {unknown[0]!r}: choose among {', '.join(cases)}\n")
    return args, [(n, cases[n]) for n in args.cases.split(",")]


def run_cases(named: list[tuple[str, Case]], args: argparse.Namespace, job_args: JobArgs = ((), ())
              ) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any] | None]:
    """Each case's run, in order (`job_args`: more arguments of the jobs that span the GPUs); and after
    raw-solo, a single-GPU job alone without gemtrace (the single-GPU jobs' solo), or None."""
    runs: list[tuple[str, dict[str, Any]]] = []
    hog_solo = None
    for n, (name, case) in enumerate(named):
        print(f"# {name}", file=sys.stderr, flush=True)
        keep = Path(args.agent_log, f"agent-{n}-{name}.log.gz") if args.agent_log and case.gated else None
        runs.append((name, run_case(case, args.gpus, args.seconds, args.warmup, job_args, keep)))
        if name == "raw-solo":
            hog_solo = run_case(Case("hog-solo", "", (), (Job("hog0", False, 0),), gated=False), args.gpus,
                                args.seconds, args.warmup)
    return runs, hog_solo


def charged_cell(run: dict[str, Any], group: str) -> str:
    """The time charged to `group` on each GPU over a case's window, for a table's cell."""
    return " / ".join(f"{c:.3f}" for c in run["charged"].get(group, [])) or "-"


def publish_table(name: str, runs: list[tuple[str, dict[str, Any]]], hog_solo: dict[str, Any] | None,
                  rows: list[str], what_ran: str, began: float) -> None:
    """The dated heading (the machine and software of the first run's first job) and the table, as
    `name`.md and `name`.json in $OUT (bench/recording.py's publish)."""
    about = next(iter(runs[0][1]["results"].values())) if runs else {}
    header = report_header(about, argparse.Namespace(ebpf=False, stand_in=False), what_ran, began)
    publish(header + "\n\n" + "\n".join(rows) + "\n", name, {"runs": runs, "hog_solo": hog_solo})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=float, default=40.0)
    parser.add_argument("--pause-ms", type=float, default=0.0,
                        help="CPU work of the job after each step: its ranks sleep so long (a data loader)")
    parser.add_argument("--job", choices=sorted(JOBS), default="ddp",
                        help="ddp: torchrun's ResNet-50 ranks; jax: one JAX process over all the GPUs (jax_worker.py)")
    job = JOBS[parser.parse_known_args()[0].job]
    args, named = cases_to_run(parser, PLAN, "a job", lambda gpus: plan_cases(gpus, job))
    cases = dict(named)
    began = time.monotonic()
    runs, hog_solo = run_cases(named, args, (("--pause-ms", f"{args.pause_ms:g}") if args.pause_ms else (), ()))
    solos = [r["results"]["ddp"]["rate"] for n, r in runs if n == "solo"]
    solo = sum(solos) / len(solos) if solos else None
    raw_solo = next((r["results"]["ddp"]["rate"] for n, r in runs if n == "raw-solo"), None)
    hog_rate = hog_solo["results"]["hog0"]["rate"] if hog_solo else None
    per_gpu = " / ".join(f"GPU {i}" for i in range(args.gpus))
    paused = f"the job sleeping {args.pause_ms:g} ms after each step; " if args.pause_ms else ""
    rows = [f"| case | group | steps/s | of solo | target | charged {per_gpu} |",
            "| --- | --- | --- | --- | --- | --- |"]
    missed = 0
    for name, run in runs:
        case = cases[name]
        for group, result in run["results"].items():
            base = (solo if case.gated else raw_solo) if group.startswith("ddp") else hog_rate
            ratio = result["rate"] / base if base else float("nan")
            least = case.target.get(group)
            verdict = "" if least is None else (f"≥ {least:.2f} " + ("met" if ratio >= least else "**missed**"))
            cold = not_warm(result)
            verdict += cold
            missed += bool(cold)
            missed += least is not None and ratio < least
            rows.append(f"| {name}: {case.title} | {group} | {result['rate']:.2f} | {ratio:.3f} | {verdict} "
                        f"| {charged_cell(run, group.split(' (')[0])} |")
    publish_table("gang_ddp", runs, hog_solo, rows,
                  f"solo through gemtrace {', '.join(f'{s:.2f}' for s in solos)} steps/s, without "
                  f"{raw_solo and f'{raw_solo:.2f}'}; a single-GPU job alone {hog_rate and f'{hog_rate:.2f}'}"
                  f" steps/s; {args.gpus} GPUs; {paused}windows of {args.seconds:g} s after {args.warmup:g} s",
                  began)
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
