"""The golden copy of the agent's /metrics (tests/golden/metrics.txt): how a scrape is normalised into it,
and how a scrape is compared with it.

The comparison is by meaning, never by text: both sides go through prometheus_client's own parser, and
the same families (names, types, help texts) with the same series (sample names, label sets) and the same
values must come out. How a client version writes a number does not count: prometheus-client 0.16 writes
`1.7179869184e+010` where 0.26 writes `1.7179869184e+10`, and which one pip installs must not decide
whether the test passes. The parser names a counter's family without its `_total`, and so do the
differences reported here; its samples keep the name as exported.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

GOLDEN = Path(__file__).parent / "golden" / "metrics.txt"
UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# Values that are the same on every run of this setup (quotas, limits, totals, info, reload counts).
# Every other series keeps its labels in the golden copy, and PLACEHOLDER for its value.
# The enforcement counters are among them: nothing in the golden setup goes over a limit, so they must
# read 0, not be absent.
STABLE = re.compile(r"^gemtrace_(agent_info|gpu_info|gpu_memory_total_bytes|group_util_(min|max)_ratio|"
                    r"group_memory_limit_bytes|config_reloads_total|config_last_reload_success|"
                    r"oom_kills_total|quota_breaches_total|tampering_events_total|scrape_collector_success)\b")
PLACEHOLDER = "<value>"
PLACEHOLDER_AT_END = re.compile(rf" {re.escape(PLACEHOLDER)}$", re.MULTILINE)

# A series: its sample name and its labels, sorted.
Series = tuple[str, tuple[tuple[str, str], ...]]


def normalise(text: str) -> str:
    """The scrape as the golden copy holds it: UUIDs and the values outside STABLE replaced."""
    lines = []
    for line in text.splitlines():
        line = UUID.sub("GPU-<uuid>", line)
        if not line.startswith("#") and not STABLE.match(line):
            line = re.sub(r" \S+$", f" {PLACEHOLDER}", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Family:
    type: str
    help: str
    # A series' value: a float where STABLE keeps it, else PLACEHOLDER.
    series: dict[Series, float | str]


def families(text: str) -> dict[str, Family]:
    """What an exposition says, a scrape or the golden copy alike (normalise is applied to both)."""
    # The parser needs a number where the golden copy has its placeholder; any will do, since the value
    # of every series outside STABLE is set to PLACEHOLDER below.
    parseable = PLACEHOLDER_AT_END.sub(" 0", normalise(text))
    meaning = {}
    for family in text_string_to_metric_families(parseable):
        series: dict[Series, float | str] = {}
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            series[key] = sample.value if STABLE.match(sample.name) else PLACEHOLDER
        meaning[family.name] = Family(family.type, family.documentation, series)
    return meaning


def differences(golden: str, scraped: str) -> list[str]:
    """One sentence for every difference in meaning between the golden copy and a scrape; none if alike."""
    want, got = families(golden), families(scraped)
    found = [f"family {name}: in the golden copy, not in /metrics" for name in sorted(want.keys() - got.keys())]
    found += [f"family {name}: in /metrics, not in the golden copy" for name in sorted(got.keys() - want.keys())]
    for name in sorted(want.keys() & got.keys()):
        w, g = want[name], got[name]
        if w.type != g.type:
            found.append(f"family {name}: type {w.type} in the golden copy, {g.type} in /metrics")
        if w.help != g.help:
            found.append(f"family {name}: help {w.help!r} in the golden copy, {g.help!r} in /metrics")
        for key in sorted(w.series.keys() - g.series.keys()):
            found.append(f"series {show(key)}: in the golden copy, not in /metrics")
        for key in sorted(g.series.keys() - w.series.keys()):
            found.append(f"series {show(key)}: in /metrics, not in the golden copy")
        for key in sorted(w.series.keys() & g.series.keys()):
            if not same_value(w.series[key], g.series[key]):
                found.append(f"series {show(key)}: {w.series[key]} in the golden copy, {g.series[key]} in /metrics")
    return found


def show(series: Series) -> str:
    name, labels = series
    return name + "{" + ",".join(f'{label}="{value}"' for label, value in labels) + "}"


def same_value(a: float | str, b: float | str) -> bool:
    # NaN is a value a series may hold, and it is unequal to itself.
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b
