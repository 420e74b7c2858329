"""The memory share a `gemtrace run` tells frameworks: environment variables from the group's
MemoryLimit, as GPUShare/Arena hand each container its share (docs/frameworks.md has the table).

Owns which variables and their values; a pure function, never reads the world. A variable the user
set is never replaced, and for JAX a user who set any of its memory variables keeps JAX's memory
behaviour as they chose it. Without a limit nothing is added: the group may use the whole GPU, as
the frameworks' defaults assume.

JAX gets XLA_PYTHON_CLIENT_PREALLOCATE=false and XLA_PYTHON_CLIENT_MEM_FRACTION=1.0. Under the gate
cuMemGetInfo reports the limit as the GPU's total (docs/gate.md), and XLA's allocator stops at the
fraction of that total, 0.75 by default, with preallocation off too: without a fraction of 1.0 a
JAX process alone in its group could use only three quarters of the limit. A fraction limit/total
would shrink the share twice. Growing on demand, every process of the group gets what it uses, up
to the limit the gate enforces; preallocating, the first would take the whole share.
"""

from __future__ import annotations

from collections.abc import Mapping

ENV_MEMORY_LIMIT = "GEMTRACE_GPU_MEMORY_LIMIT"
ENV_MEMORY_TOTAL = "GEMTRACE_GPU_MEMORY_TOTAL"

# Setting any of these is choosing JAX's memory behaviour: then gemtrace adds none of them.
JAX_MEMORY_VARIABLES = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_CLIENT_MEM_FRACTION",  # the newer name of the fraction (JAX's docs/gpu-memory)
    "XLA_PYTHON_CLIENT_ALLOCATOR",
)


def variables(limit: int | None, gpu_memory: int | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add for a group with MemoryLimit `limit` (None: none) on GPUs of `gpu_memory`
    bytes (the smallest of them; None when unknown). A limit at or above the GPU's memory is none."""
    if limit is None or (gpu_memory is not None and limit >= gpu_memory):
        return {}
    wanted: dict[str, str] = {}
    if not any(name in environ for name in JAX_MEMORY_VARIABLES):
        wanted["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        # The old name: every JAX version reads it, the newer ones as a deprecated alias.
        wanted["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "1.0"
    wanted["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    # GPUShare's ALIYUN_COM_GPU_MEM_CONTAINER / _DEV pair, in bytes, for programs that size their
    # own share. A fraction handed to a framework is of cuMemGetInfo's total, which under the gate is
    # the limit already: docs/frameworks.md says which figure to pass where.
    wanted[ENV_MEMORY_LIMIT] = str(limit)
    if gpu_memory is not None:
        wanted[ENV_MEMORY_TOTAL] = str(gpu_memory)
    return {name: value for name, value in wanted.items() if name not in environ}
