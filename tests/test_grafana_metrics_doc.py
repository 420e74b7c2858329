"""docs/metrics.md's list of metrics is generated from the catalogue (`python -m gemtrace.metrics
--update docs/metrics.md`): the committed list must be exactly what the code generates, so the docs
cannot drift from the metrics. The prose around it is written by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gemtrace.metrics import CATALOGUE, DOC_BEGIN, DOC_END, markdown, updated_doc

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "metrics.md"


def test_committed_metrics_doc_is_the_generated_one() -> None:
    generated = subprocess.run([sys.executable, "-m", "gemtrace.metrics", "--markdown"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout
    text = DOC.read_text()
    assert generated in text and updated_doc(text) == text, (
        "docs/metrics.md is stale: python -m gemtrace.metrics --update docs/metrics.md"
    )


def test_updating_the_doc_replaces_only_the_generated_part() -> None:
    stale = f"# Title\n\nProse before.\n\n{DOC_BEGIN}\n| old | table |\n{DOC_END}\n\nProse after.\n"
    updated = updated_doc(stale)
    assert updated.startswith("# Title\n\nProse before.\n\n" + markdown())
    assert updated.endswith(f"{DOC_END}\n\nProse after.\n") and "| old | table |" not in updated
    with pytest.raises(ValueError, match="markers are missing"):
        updated_doc("# no markers\n")


def test_metrics_doc_lists_every_metric_with_type_unit_and_labels() -> None:
    rows = {line.split("|")[1].strip().strip("`"): line for line in DOC.read_text().splitlines()
            if line.startswith("| `")}
    assert set(rows) == set(CATALOGUE)
    for name, spec in CATALOGUE.items():
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert cells[1] == spec.type
        assert cells[2] == (spec.unit or "-")
        assert cells[3] == (", ".join(f"`{label}`" for label in spec.labels) or "-")
