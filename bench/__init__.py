"""Benchmarks on the simulated GPU, each run from the checkout's root as a module:

    .venv/bin/python -m bench.bench_agent_cpu [--no-record]

Run so, the checkout's root is on the import path (for `gemtrace` and `bench`). The benches also start
the agent and the simulated GPU's clients as the tests do, through tests/'s modules (`simgpu_env`,
`agent_host`, `testkit`), which are top-level modules rather than a package (pytest imports them so);
this is the one place that puts tests/ on the import path for them.
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
