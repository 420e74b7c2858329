"""Checks PromQL written for gemtrace (dashboard panels, variables, alert rules) against the metric
catalogue, gemtrace/metrics.py: every metric name exists (or is Prometheus's own `up`), every label
it is matched or grouped on is one the metric has or a target label, range functions get counters.

A small lexer, not a PromQL parser: the syntax itself is checked by promtool (tests/test_rules.py,
tests/test_grafana.py) and by a real Prometheus (tests/test_prometheus_live.py). This one only has to
tell metric names from functions, keywords, label lists, durations and strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gemtrace.metrics import CATALOGUE

# Labels Prometheus attaches to every scraped series (a `host` target label is the optional
# friendlier name for an instance, see grafana/prometheus.example.yml).
TARGET_LABELS = frozenset({"job", "instance", "host"})
PROMETHEUS_METRICS: dict[str, frozenset[str]] = {"up": frozenset()}

GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"offset", "bool", "and", "or", "unless", "atan2", "inf", "nan"}) | GROUPING
FUNCTIONS = frozenset(
    """abs absent absent_over_time ceil changes clamp clamp_max clamp_min day_of_month day_of_week
    day_of_year days_in_month delta deriv exp floor histogram_quantile holt_winters hour idelta
    increase irate label_join label_replace ln log2 log10 minute month predict_linear rate resets
    round scalar sgn sort sort_desc sqrt time timestamp vector year avg_over_time min_over_time
    max_over_time sum_over_time count_over_time quantile_over_time stddev_over_time stdvar_over_time
    last_over_time present_over_time sum min max avg group stddev stdvar count count_values bottomk
    topk quantile""".split()
)
COUNTER_FUNCTIONS = frozenset({"rate", "irate", "increase", "resets"})

_TOKEN = re.compile(
    r"""
      (?P<space>\s+)
    | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    | (?P<matchers>\{(?:"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|[^{}"'])*\})
    | (?P<range>\[[^\]]*\])
    | (?P<variable>\$\{?\w+\}?)
    | (?P<number>(?:\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)(?:ms|[smhdwy])*|\.\d+)
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<punct>==|!=|>=|<=|=~|!~|[-+*/%^<>(),=])
    """,
    re.VERBOSE,
)
_MATCHER = re.compile(
    r"""\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')\s*,?"""
)


@dataclass
class Selector:
    metric: str
    matchers: dict[str, tuple[str, str]] = field(default_factory=dict)  # label -> (op, quoted value)


@dataclass
class Analysis:
    selectors: list[Selector]
    grouping_labels: set[str]
    functions: set[str]
    counter_function_args: list[str]  # metrics passed straight to rate/increase/...
    problems: list[str]


def _tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        kind = m.lastgroup or ""
        if kind != "space":
            out.append((kind, m.group()))
        pos = m.end()
    return out


def _matchers(block: str) -> dict[str, tuple[str, str]]:
    inner = block[1:-1]
    found: dict[str, tuple[str, str]] = {}
    pos = 0
    while inner[pos:].strip():
        m = _MATCHER.match(inner, pos)
        if m is None:
            raise ValueError(f"cannot read label matchers {block!r}")
        found[m.group(1)] = (m.group(2), m.group(3))
        pos = m.end()
    return found


def analyse(expr: str) -> Analysis:
    """Split a PromQL expression into what the catalogue can vouch for."""
    toks = _tokens(expr)
    result = Analysis([], set(), set(), [], [])
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ("", "")
        if kind == "ident" and text in GROUPING:
            if nxt == ("punct", "("):
                j = i + 2
                while j < len(toks) and toks[j] != ("punct", ")"):
                    if toks[j][0] == "ident":
                        result.grouping_labels.add(toks[j][1])
                    j += 1
                i = j + 1
                continue
        elif kind == "ident" and text == "offset":
            i += 2  # the duration
            continue
        elif kind == "ident" and text in KEYWORDS:
            pass  # binary operators such as `or (...)`
        elif kind == "ident" and (
            nxt == ("punct", "(") or (text in FUNCTIONS and nxt[0] == "ident" and nxt[1] in ("by", "without"))
        ):
            result.functions.add(text)
            if text not in FUNCTIONS:
                result.problems.append(f"unknown function {text}()")
            after = toks[i + 2] if i + 2 < len(toks) else ("", "")
            if text in COUNTER_FUNCTIONS and after[0] == "ident":
                result.counter_function_args.append(after[1])
        elif kind == "ident":
            sel = Selector(text)
            if nxt[0] == "matchers":
                sel.matchers = _matchers(nxt[1])
                i += 1
            result.selectors.append(sel)
        elif kind == "matchers":
            result.problems.append(f"selector without a metric name: {text}")
        i += 1
    return result


def labels_of(metric: str) -> frozenset[str] | None:
    if metric in CATALOGUE:
        return frozenset(CATALOGUE[metric].labels) | TARGET_LABELS
    if metric in PROMETHEUS_METRICS:
        return PROMETHEUS_METRICS[metric] | TARGET_LABELS
    return None


def problems(expr: str, extra_labels: frozenset[str] = frozenset()) -> list[str]:
    """What is wrong with `expr` against the catalogue; empty when nothing is.

    extra_labels: labels the expression may group on that no metric has (none so far)."""
    a = analyse(expr)
    found = list(a.problems)
    known: set[str] = set(TARGET_LABELS) | set(extra_labels)
    if not a.selectors:
        found.append("no metric in the expression")
    for sel in a.selectors:
        labels = labels_of(sel.metric)
        if labels is None:
            found.append(f"metric {sel.metric} is not in gemtrace/metrics.py")
            continue
        known |= labels
        for label in sel.matchers:
            if label not in labels:
                found.append(f"{sel.metric} has no label {label}")
    for label in sorted(a.grouping_labels - known):
        found.append(f"grouping on {label}, which none of the expression's metrics has")
    for metric in a.counter_function_args:
        if metric in CATALOGUE and CATALOGUE[metric].type != "counter":
            kind = CATALOGUE[metric].type
            found.append(f"{metric} is a {kind}, not a counter, yet given to a rate function")
    return found


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<expr>.+?)\s*,\s*)?(?P<label>\w+)\s*\)\s*$")


def label_values_parts(query: str) -> tuple[str, str]:
    """Grafana's `label_values(EXPR, LABEL)` variable query as (EXPR, LABEL)."""
    m = _LABEL_VALUES.match(query)
    if m is None or not m.group("expr"):
        raise ValueError(f"not a label_values(EXPR, LABEL) query: {query!r}")
    return m.group("expr"), m.group("label")
