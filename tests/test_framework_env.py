"""The memory share told to frameworks: framework_env.variables, a pure function."""

from __future__ import annotations

import pytest
from testkit import GiB

from gemtrace.run.framework_env import variables

pytestmark = pytest.mark.unit



def test_a_limit_sets_growth_on_demand_and_the_byte_pair() -> None:
    assert variables(4 * GiB, 16 * GiB, {}) == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        # XLA stops at this fraction of the total the gate reports (the limit), 0.75 unless set.
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "1.0",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "GEMTRACE_GPU_MEMORY_LIMIT": str(4 * GiB),
        "GEMTRACE_GPU_MEMORY_TOTAL": str(16 * GiB),
    }


def test_no_limit_adds_nothing() -> None:
    assert variables(None, 16 * GiB, {}) == {}
    assert variables(16 * GiB, 16 * GiB, {}) == {}  # a limit of the whole GPU is none


def test_what_the_user_set_is_kept() -> None:
    user = {"TF_FORCE_GPU_ALLOW_GROWTH": "false", "GEMTRACE_GPU_MEMORY_LIMIT": "1"}
    added = variables(4 * GiB, 16 * GiB, user)
    assert "TF_FORCE_GPU_ALLOW_GROWTH" not in added and "GEMTRACE_GPU_MEMORY_LIMIT" not in added
    assert added["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert added["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "1.0"


@pytest.mark.parametrize("name", ["XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                  "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR"])
def test_a_user_who_set_any_jax_memory_variable_keeps_jax_as_they_chose(name: str) -> None:
    added = variables(4 * GiB, 16 * GiB, {name: "0.5"})
    assert not any(key.startswith(("XLA_PYTHON_CLIENT_", "XLA_CLIENT_")) for key in added)
    assert added["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


def test_unknown_gpu_memory_leaves_the_total_out() -> None:
    added = variables(4 * GiB, None, {})
    assert added["GEMTRACE_GPU_MEMORY_LIMIT"] == str(4 * GiB)
    assert "GEMTRACE_GPU_MEMORY_TOTAL" not in added
