"""docs/metrics.md is generated from the catalogue (`python -m gemtrace.metrics --markdown`): the
committed file must be exactly what the code generates, so the docs cannot drift from the metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gemtrace.metrics import CATALOGUE

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "metrics.md"


def test_committed_metrics_doc_is_the_generated_one() -> None:
    generated = subprocess.run([sys.executable, "-m", "gemtrace.metrics", "--markdown"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout
    assert DOC.read_text() == generated, (
        "docs/metrics.md is stale: python -m gemtrace.metrics --markdown > docs/metrics.md"
    )


def test_metrics_doc_lists_every_metric_with_type_unit_and_labels() -> None:
    rows = {line.split("|")[1].strip().strip("`"): line for line in DOC.read_text().splitlines()
            if line.startswith("| `")}
    assert set(rows) == set(CATALOGUE)
    for name, spec in CATALOGUE.items():
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        assert cells[1] == spec.type
        assert cells[2] == (spec.unit or "-")
        assert cells[3] == (", ".join(f"`{label}`" for label in spec.labels) or "-")
