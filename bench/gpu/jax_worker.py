"""One JAX process over every GPU it sees: a step of 8 bf16 matmuls on each GPU, then an all-reduce across
them (pmap with psum, NCCL underneath), the step's result awaited each time. A job that spans GPUs in one
process, for bench/gpu/gang_ddp.py's `--job jax` (docs/scheduler.md: one process using several GPUs is a job).

    BENCH_WINDOW=T0,T1 python3 bench/gpu/jax_worker.py

Counts the steps that end in [T0, T1) (time.monotonic) and prints one JSON line {"result": true, "steps",
"rate", "steps_before" (those that ended before T0: its warm-up), "jax", "device", "devices"}.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp


def step_of(devices: int):  # type: ignore[no-untyped-def]
    def step(a):  # type: ignore[no-untyped-def]
        for _ in range(8):
            a = jnp.tanh(a @ a)
        return jax.lax.psum(a, "gpus") / devices
    return jax.pmap(step, axis_name="gpus")


def main() -> None:
    start, end = (float(t) for t in os.environ["BENCH_WINDOW"].split(","))
    devices = jax.device_count()
    step = step_of(devices)
    x = step(jnp.full((devices, 4096, 4096), 0.001, jnp.bfloat16))
    x.block_until_ready()
    steps = before = 0
    while True:
        x = step(x)
        x.block_until_ready()
        now = time.monotonic()
        if now >= end:
            break
        steps += now >= start
        before += now < start
    print(json.dumps({"result": True, "steps": steps, "rate": steps / (end - start), "steps_before": before,
                      "jax": jax.__version__,
                      "device": jax.devices()[0].device_kind, "devices": devices}), flush=True)


if __name__ == "__main__":
    main()
