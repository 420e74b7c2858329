"""Benchmarks on a real GPU, each run by hand on a GPU machine from the checkout's root as a module:

    PYTHONPATH=$PWD:<the agent's dependencies> python3 -m bench.gpu.models_torch --help

Nothing here needs the dev venv (the lent GPU machines have only their own python3): the checkout's
root on the path gives `gemtrace`, `bench` and `tests.testkit`, the one test helper module they import
(it imports nothing but gemtrace). The workers they start (models_worker.py, ddp_worker.py) are plain
scripts run by path, `torchrun`'s way, and import nothing from the checkout.
"""
