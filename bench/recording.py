"""How every bench writes its figures down: the machine it ran on, one date format, the commit, and one
flag. A figure in bench/results/ is worth only as much as what it says about where and when it was
measured, so no bench formats these itself.

Convention: a bench appends its results to bench/results/<name>.md unless given `--no-record`; a GPU
bench run with `--stand-in` (the simulated GPU in place of a real one) records nothing, since its
figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def stamp() -> str:
    """Now, as every results file dates its entries: `2026-11-26 18:31 UTC`."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def commit() -> str:
    """The checkout's commit, short, or `?` outside git."""
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The host as a results file names it: its name, CPUs and their model, the kernel, and the load
    (a shared machine's figures compare only with those taken at a like load)."""
    return (f"{platform.node()}, {os.cpu_count()} CPUs ({cpu_model()}), kernel {platform.release()}, "
            f"load {os.getloadavg()[0]:.1f}")


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
