"""Benchmarks on the simulated GPU, each run from the checkout's root as a module:

    .venv/bin/python -m bench.bench_agent_cpu [--no-record]

They start the agent and the simulated GPU's clients as the tests do, through tests/'s modules
(`simgpu_env`, `agent_host`, `testkit`). Those are top-level modules, not a package (pytest imports
them so), and the dev venv puts tests/ on its path for them (`make venv` writes the .pth), as pytest
does for the tests. The GPU benchmarks, which run without the venv, are in bench/gpu/.
"""
