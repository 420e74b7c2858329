"""How every bench writes its figures down: the machine it ran on, one date format, the commit, and one
flag. A figure in bench/results/ is worth only as much as what it says about where and when it was
measured, so no bench formats these itself. And how a bench compares cases that differ by less than
its runs spread: interleaved rounds and the paired statistic over them (`interleave`, `paired`).

Convention: a bench appends its results to bench/results/<name>.md unless given `--no-record`; a GPU
bench run with `--stand-in` (the simulated GPU in place of a real one) records nothing, since its
figures say nothing about a GPU. A GPU bench also leaves its report in $OUT for the device machine to
send back (`publish`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# Fewer rounds place the median nowhere: a 5-round check of the gate's cost read +10%, with paired
# differences from -528 to +535 ns and a 95% interval of their median as wide (issue 30).
MIN_ROUNDS = 20
BOOTSTRAP_RESAMPLES = 2000


def stamp() -> str:
    """Now, as every results file dates its entries: `2026-11-26 18:31 UTC`."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def commit(repo: Path = REPO) -> str:
    """The checkout's commit, short, or `?` outside git; `+ changes` where tracked files differ from it
    (a copy of a working tree, such as the GPU machine's, may carry the git of an older commit)."""
    done = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    head = done.stdout.strip()
    if not head:
        return "?"
    changed = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True)
    return f"{head} + changes" if changed.returncode == 0 and changed.stdout.strip() else head


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_models(driver: Path = Path("/proc/driver/nvidia/gpus")) -> str:
    """The host's NVIDIA GPUs as the driver names them (`1 x NVIDIA H100 80GB HBM3`), "" where it has
    none: a CPU bench run on a GPU host says so (its header read "vm" there, as on the CPU-only VM)."""
    models: dict[str, int] = {}
    for info in sorted(driver.glob("*/information")):
        try:
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    model = line.split(":", 1)[1].strip()
                    models[model] = models.get(model, 0) + 1
        except OSError:
            continue
    return ", ".join(f"{n} x {model}" for model, n in models.items())


def machine() -> str:
    """The host as a results file names it: its name, its GPUs if any, CPUs and their model, the
    kernel, and the load (a shared machine's figures compare only with those taken at a like load)."""
    gpus = gpu_models()
    return (f"{platform.node()}{', ' + gpus if gpus else ''}, {os.cpu_count()} CPUs ({cpu_model()}), "
            f"kernel {platform.release()}, load {os.getloadavg()[0]:.1f}")


def add_record_flag(parser: argparse.ArgumentParser, results: Path) -> None:
    parser.add_argument("--no-record", action="store_true",
                        help=f"print only; do not append to {results.relative_to(REPO)}")


def record(results: Path, title: str, text: str, about: str = "") -> None:
    """Append `text` to `results` under a heading with the date, the machine and the commit (`about`, the
    run's own words, after them), with `title` atop a new file."""
    results.parent.mkdir(parents=True, exist_ok=True)
    head = "\n" if results.exists() else f"# {title}\n\n"  # a heading needs a blank line above it
    with results.open("a") as f:
        f.write(f"{head}## {stamp()} on {machine()}, gemtrace {commit()}{': ' + about if about else ''}\n\n"
                f"{text.strip()}\n\n")


def append_rows(results: Path, header: str, rows: list[str]) -> None:
    """Append table rows to `results`, written with `header` (title, prose, the table's head) when new.
    A row starts with `stamp()` and `machine()` in its first two columns."""
    results.parent.mkdir(parents=True, exist_ok=True)
    if not results.exists():
        results.write_text(header)
    with results.open("a") as f:
        f.write("".join(row.rstrip("\n") + "\n" for row in rows))


def publish(report: str, name: str, data: object = None, results: Path | None = None, title: str = "") -> None:
    """How a GPU bench hands its report over, the report bringing its own dated heading (`stamp`, `gpus`):
    printed; with `results`, appended there (under `title` when the file is new); with $OUT set (the
    folder the device machine sends back), written there as NAME.md, and `data`, if any, as NAME.json."""
    print("\n" + report)
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        new = not results.exists()
        with results.open("a") as f:
            f.write((f"# {title}\n\n" if new else "\n") + report)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"{name}.md").write_text(report)
        if data is not None:
            Path(out, f"{name}.json").write_text(json.dumps(data, indent=1))


def add_tree_flag(parser: argparse.ArgumentParser, what: str = "the agent") -> None:
    """`--tree NAME=DIR`, repeatable: also run `what` from DIR/gemtrace (`git archive` of an older
    commit, say), side by side with this checkout, so that a change is judged against the code before
    it on the same machine at the same load rather than against a figure from another day."""
    parser.add_argument("--tree", "--agent-tree", dest="tree", action="append", default=[], metavar="NAME=DIR",
                        help=f"also run {what} from DIR/gemtrace, side by side with this checkout")


def trees(values: list[str]) -> list[tuple[str, Path | None]]:
    """The trees `--tree` named, then this checkout (None)."""
    named: list[tuple[str, Path | None]] = [(name, Path(path)) for name, _, path in (v.partition("=") for v in values)]
    return [*named, ("this checkout", None)]


def gpus() -> str:
    """The GPUs as a GPU bench's results name them: how many of which, and the driver, found as the
    agent finds them (gemtrace.gpus; the simulated NVML's under --stand-in)."""
    from gemtrace.gpus import GpuDiscoveryError, discover, nvml

    try:
        found = discover()
        driver = nvml().nvmlSystemGetDriverVersion()
    except GpuDiscoveryError as e:  # the figures still stand; the heading says what was not known
        return f"GPU unknown ({e})"
    names = sorted({gpu.name for gpu in found})
    driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    return f"{len(found)} x {' + '.join(names) or 'no GPU'}, driver {driver}"


def region_gpus() -> list[tuple[str, int]]:
    """The GPUs as the region lists them, UUID and memory, found as the agent finds them: for a bench
    that stands in for the agent."""
    from gemtrace.gpus import discover

    return [(gpu.uuid, gpu.memory_total) for gpu in discover()]


def interleave(cases: Sequence[tuple[str, Callable[[], float]]], rounds: int) -> dict[str, list[float]]:
    """Each case's figure, `rounds` times: one run of every case per round, in the order given, so that
    a drift of the machine (another tenant, the clock, the cache) hits every case alike, and a case's
    run can be paired with the run of another in the same round."""
    runs: dict[str, list[float]] = {name: [] for name, _ in cases}
    for _ in range(rounds):
        for name, run in cases:
            runs[name].append(run())
    return runs


@dataclass(frozen=True)
class Paired:
    """The paired statistic of `case` against `baseline` over interleaved rounds: per round, the case's
    figure less the baseline's of the same round (in percent of the baseline's where `relative`)."""

    median: float  # of the paired differences: the figure to report
    q1: float  # their interquartile range: how much one round's difference spreads
    q3: float
    low: float  # a 95% bootstrap interval of the median: how well the rounds place it
    high: float
    rounds: int
    unit: str

    def __str__(self) -> str:
        u = self.unit
        return (f"{self.median:+.1f}{u} (median of {self.rounds} paired differences; IQR {self.q1:+.1f}{u} to "
                f"{self.q3:+.1f}{u}; 95% interval of the median {self.low:+.1f}{u} to {self.high:+.1f}{u})")


def paired(baseline: Sequence[float], case: Sequence[float], unit: str = "", relative: bool = False,
           seed: int = 0) -> Paired:
    """The paired statistic of `case` against `baseline`, both from `interleave` (round i of one with
    round i of the other). The bootstrap is seeded, so one set of runs always gives one interval."""
    if len(baseline) != len(case) or len(case) < 2:
        raise ValueError(f"paired needs two equal runs of at least 2 rounds, got {len(baseline)} and {len(case)}")
    diffs = [(c - b) / b * 100 if relative else c - b for b, c in zip(baseline, case, strict=True)]
    q1, _, q3 = statistics.quantiles(diffs, n=4, method="inclusive")
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(diffs, k=len(diffs))) for _ in range(BOOTSTRAP_RESAMPLES))
    low = medians[int(0.025 * BOOTSTRAP_RESAMPLES)]
    high = medians[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]
    return Paired(statistics.median(diffs), q1, q3, low, high, len(diffs), "%" if relative else unit)
