"""The benches' paired statistic over interleaved rounds, and how they name a host (bench/recording.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest

from bench import recording
from bench.recording import interleave, paired

pytestmark = pytest.mark.unit


def test_rounds_run_every_case_once_in_order() -> None:
    order: list[str] = []

    def case(name: str, figure: float) -> Callable[[], float]:
        def run() -> float:
            order.append(name)
            return figure
        return run

    runs = interleave([("a", case("a", 1.0)), ("b", case("b", 2.0))], 3)
    assert order == ["a", "b"] * 3
    assert runs == {"a": [1.0] * 3, "b": [2.0] * 3}


def test_the_median_is_of_the_differences_within_a_round_not_of_the_medians() -> None:
    # The rounds drift (100, 200, 300 ns): each case's median says -10 ns, the rounds say +30 ns.
    baseline = [100.0, 200.0, 300.0]
    case = [150.0, 190.0, 330.0]
    p = paired(baseline, case, " ns")
    assert (p.median, p.q1, p.q3, p.rounds) == (30.0, 10.0, 40.0, 3)
    assert -10.0 <= p.low <= 30.0 <= p.high <= 50.0
    assert str(p).startswith("+30.0 ns (median of 3 paired differences; IQR +10.0 ns to +40.0 ns")


def test_five_rounds_of_the_issue_place_the_median_nowhere() -> None:
    # The 5-round check of issue 30: paired differences +436, +535, -528, +312, +73 ns.
    diffs = [436.0, 535.0, -528.0, 312.0, 73.0]
    p = paired([3966.0] * 5, [3966.0 + d for d in diffs], " ns")
    assert p.median == 312.0
    assert (p.q1, p.q3) == (73.0, 436.0)
    assert p.low < 0 < p.high  # the interval does not even give the sign


def test_relative_differences_are_percent_of_the_rounds_baseline() -> None:
    p = paired([100.0, 200.0, 400.0], [102.0, 204.0, 404.0], relative=True)
    assert p.median == pytest.approx(2.0) and p.unit == "%"


def test_unequal_or_single_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="two equal runs"):
        paired([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least 2 rounds"):
        paired([1.0], [1.0])


def test_a_gpu_host_is_named_by_its_gpus_as_the_driver_lists_them(tmp_path) -> None:
    from bench.recording import gpu_models

    assert gpu_models(tmp_path / "absent") == ""  # (a host with no driver: the CPU-only VM)
    for bus, model in (("0000:18:00.0", "NVIDIA H100 80GB HBM3"), ("0000:2a:00.0", "NVIDIA H100 80GB HBM3"),
                       ("0000:3a:00.0", "NVIDIA H200")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 10\n")
    assert gpu_models(tmp_path) == "2 x NVIDIA H100 80GB HBM3, 1 x NVIDIA H200"


def test_a_results_header_says_where_the_checkout_differs_from_its_commit(tmp_path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("one\n")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = recording.commit(tmp_path)
    assert head and "changes" not in head
    (tmp_path / "untracked").write_text("")
    assert recording.commit(tmp_path) == head
    (tmp_path / "f").write_text("two\n")
    assert recording.commit(tmp_path) == f"{head} + changes"
    assert recording.commit(tmp_path / "nowhere") == "?"
