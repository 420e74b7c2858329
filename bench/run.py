"""`make bench`: run every benchmark on the simulated GPU, one after the other.

Each bench/bench_<name>.py runs as a module from the checkout's root (`python -m bench.bench_<name>`):
it prints a table and appends its dated results, with the machine, to bench/results/<name>.md
(bench/recording.py). GPU benchmarks live in bench/gpu/; each is run by hand on a GPU machine, with
the command its docstring gives.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    failed = []
    for script in sorted(HERE.glob("bench_*.py")):
        print(f"== {script.name}", flush=True)
        if subprocess.run([sys.executable, "-m", f"bench.{script.stem}"], cwd=HERE.parent).returncode != 0:
            failed.append(script.name)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
