"""The golden /metrics comparison (tests/golden_metrics.py) on edited copies of the golden file itself:
number formatting alone is no difference; a renamed family, a changed label, help text or value is one,
named in a sentence."""

from __future__ import annotations

import re

import pytest
from golden_metrics import GOLDEN, differences

pytestmark = pytest.mark.unit


def golden() -> str:
    return GOLDEN.read_text()


def edited(text: str, old: str, new: str) -> str:
    assert old in text, f"the golden copy no longer holds {old!r}: choose another edit"
    return text.replace(old, new)


def rewrite_numbers(text: str) -> str:
    """Every value written another way: integers without a fraction, others in exponent notation."""

    def another_way(match: re.Match[str]) -> str:
        number = float(match[2])
        written = str(int(number)) if number.is_integer() else f"{number:e}"
        return match[1] + written

    return re.sub(r"^([^#].* )([-+0-9.e]+)$", another_way, text, flags=re.MULTILINE)


def test_prometheus_client_0_16_exponent_is_no_difference() -> None:
    # 0.26 (constraints.txt's, which wrote the golden copy) writes the exponent with two digits; 0.16,
    # Debian 12's, with three.
    older = edited(golden(), "1.7179869184e+10\n", "1.7179869184e+010\n")
    assert differences(golden(), older) == []


def test_number_formatting_alone_is_no_difference() -> None:
    rewritten = rewrite_numbers(golden())
    assert "gemtrace_gpu_memory_total_bytes{gpu=\"GPU-<uuid>\"} 17179869184\n" in rewritten
    assert ('gemtrace_group_util_max_ratio{container="",group="infer",namespace="",pod=""} 5.000000e-01\n'
            in rewritten)
    assert "gemtrace_agent_info{version=\"0.1.0\"} 1\n" in rewritten
    assert differences(golden(), rewritten) == []


def test_a_raw_scrape_is_normalised_before_the_comparison() -> None:
    scrape = golden().replace("GPU-<uuid>", "GPU-0a1b2c3d-0000-4000-8000-123456789abc").replace("<value>", "12.5")
    assert differences(golden(), scrape) == []


def test_a_renamed_family_is_a_difference() -> None:
    renamed = edited(golden(), "gemtrace_probes_attached", "gemtrace_probes_attach")
    assert differences(golden(), renamed) == [
        "family gemtrace_probes_attached: in the golden copy, not in /metrics",
        "family gemtrace_probes_attach: in /metrics, not in the golden copy",
    ]


def test_a_changed_label_name_is_a_difference() -> None:
    changed = edited(golden(), 'gemtrace_group_memory_limit_bytes{container="",group="train",',
                     'gemtrace_group_memory_limit_bytes{container="",team="train",')
    assert differences(golden(), changed) == [
        'series gemtrace_group_memory_limit_bytes{container="",group="train",namespace="",pod=""}: '
        'in the golden copy, not in /metrics',
        'series gemtrace_group_memory_limit_bytes{container="",namespace="",pod="",team="train"}: '
        'in /metrics, not in the golden copy',
    ]


def test_a_changed_label_value_is_a_difference() -> None:
    changed = edited(golden(), '{result="failure"}', '{result="failed"}')
    assert differences(golden(), changed) == [
        'series gemtrace_config_reloads_total{result="failure"}: in the golden copy, not in /metrics',
        'series gemtrace_config_reloads_total{result="failed"}: in /metrics, not in the golden copy',
    ]


def test_a_changed_help_text_is_a_difference() -> None:
    changed = edited(golden(), "# HELP gemtrace_gpu_info A GPU the agent schedules.",
                     "# HELP gemtrace_gpu_info A GPU the agent watches.")
    assert differences(golden(), changed) == [
        "family gemtrace_gpu_info: help 'A GPU the agent schedules.' in the golden copy, "
        "'A GPU the agent watches.' in /metrics",
    ]


def test_a_changed_stable_value_is_a_difference() -> None:
    infer = 'gemtrace_group_util_max_ratio{container="",group="infer",namespace="",pod=""}'
    changed = edited(golden(), f"{infer} 0.5", f"{infer} 0.6")
    assert differences(golden(), changed) == [f"series {infer}: 0.5 in the golden copy, 0.6 in /metrics"]


def test_a_missing_series_is_a_difference() -> None:
    infer = 'gemtrace_group_util_ratio{container="",gpu="GPU-<uuid>",group="infer",namespace="",pod=""}'
    changed = edited(golden(), f"{infer} <value>\n", "")
    assert differences(golden(), changed) == [f"series {infer}: in the golden copy, not in /metrics"]
