"""deploy/grafana/grpo-fleet.json imports as-is and only queries metrics the code exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from grpo_fleet.observe.metrics import actor_metrics, learner_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "grpo-fleet.json"
INPUT = "${DS_PROMETHEUS}"
VARIABLE = "${datasource}"
# Series Prometheus itself adds to every scrape; `up` carries the SD target labels (role, actor).
PROMETHEUS_SERIES = {"up"}

# Sample suffixes prometheus_client exposes per family type. A labelled metric with no
# children yet has no samples at all, so the type decides what it *will* export.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
}


def exported_names(registry: CollectorRegistry) -> set[str]:
    names: set[str] = set()
    for family in registry.collect():
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def promql_metric_names(expr: str) -> set[str]:
    """Metric identifiers in a PromQL expression: every `grpo_fleet_*` identifier, plus `up`."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values are not metric names
    names = set(re.findall(r"(?<![A-Za-z0-9_:])grpo_fleet_[A-Za-z0-9_:]*", bare))
    names.update(re.findall(r"(?<![A-Za-z0-9_:$])up(?![A-Za-z0-9_:])", bare))
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_names(learner_metrics().registry) | exported_names(actor_metrics().registry)


def data_panels(dashboard: dict) -> list[dict]:
    """Every panel that queries something, including those nested in collapsed rows."""
    panels = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            panels.extend(panel.get("panels", []))
        else:
            panels.append(panel)
    return panels


def all_exprs(dashboard: dict) -> list[tuple[str, str]]:
    exprs = [(p["title"], t["expr"]) for p in data_panels(dashboard) for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append((f"variable {var['name']}", query))
    return exprs


def test_import_metadata(dashboard: dict) -> None:
    assert dashboard["title"] == "grpo-fleet"
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard.get("id") is None  # an import must not collide with an existing dashboard id
    inputs = {i["name"]: i for i in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"


def test_datasource_variable_defaults_to_the_input(dashboard: dict) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert ds["current"]["value"] == INPUT  # Grafana's import replaces ${DS_PROMETHEUS} in every string


def test_panels_are_complete_and_use_the_datasource(dashboard: dict) -> None:
    panels = data_panels(dashboard)
    assert len(panels) >= 10
    ids = [p["id"] for p in dashboard["panels"]] + [p["id"] for row in dashboard["panels"] for p in row.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["type"] in {"timeseries", "stat"}, panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert panel["datasource"]["type"] == "prometheus"
        assert panel["datasource"]["uid"] in {INPUT, VARIABLE}, panel["title"]
        assert panel["targets"], f"{panel['title']} has no queries"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] in {INPUT, VARIABLE}, panel["title"]
    assert all(v != "" for v in (p["title"] for p in panels))


def test_no_unresolved_inputs(dashboard: dict) -> None:
    declared = {"${" + i["name"] + "}" for i in dashboard["__inputs"]} | {VARIABLE}
    variables = {"${" + v["name"] + "}" for v in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$\{[A-Za-z0-9_]+\}", DASHBOARD.read_text()))
    assert used <= declared | variables


def test_promql_name_extraction() -> None:
    expr = 'sum(up{role="actor", actor=~"$actor"}) + rate(grpo_fleet_actor_tokens_generated_total{x="grpo_fleet_no"}[1m])'
    assert promql_metric_names(expr) == {"up", "grpo_fleet_actor_tokens_generated_total"}


def test_every_queried_metric_is_exported(dashboard: dict, exported: set[str]) -> None:
    missing = {}
    for title, expr in all_exprs(dashboard):
        names = promql_metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        for name in names - exported - PROMETHEUS_SERIES:
            missing.setdefault(name, []).append(title)
    assert not missing, f"queried but not exported by learner_metrics()/actor_metrics(): {missing}"


def test_promql_brackets_balance(dashboard: dict) -> None:
    pairs = {")": "(", "]": "[", "}": "{"}
    for title, expr in all_exprs(dashboard):
        stack: list[str] = []
        for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
            if char in "([{":
                stack.append(char)
            elif char in pairs:
                assert stack and stack.pop() == pairs[char], f"{title}: unbalanced {expr!r}"
        assert not stack, f"{title}: unbalanced {expr!r}"


def test_up_is_scoped_by_role(dashboard: dict) -> None:
    """`up` covers every target Prometheus scrapes; the SD labels tell learner and actors apart."""
    for title, expr in all_exprs(dashboard):
        for match in re.finditer(r"(?<![A-Za-z0-9_:$])up(\{[^}]*\})?", re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)):
            assert match.group(1) and "role=" in match.group(1), f"{title}: unscoped `up` in {expr!r}"


def test_counters_and_histograms_are_rated(dashboard: dict) -> None:
    """A raw counter or bucket series is a monotone line nobody can read; they go through rate/increase."""
    for title, expr in all_exprs(dashboard):
        for name in promql_metric_names(expr):
            if name.endswith(("_total", "_bucket", "_sum", "_count")):
                assert re.search(rf"(rate|increase)\(\s*{name}\b", expr), f"{title}: {name} not rated in {expr!r}"


def test_actor_label_only_on_actor_series(dashboard: dict) -> None:
    """`actor` is a target label Prometheus adds to actor targets (from /sd); learner series do not have it."""
    for title, expr in all_exprs(dashboard):
        for name, selector in re.findall(r"\b(grpo_fleet_[A-Za-z0-9_]+)\{([^}]*)\}", expr):
            if re.search(r"\bactor\s*=", selector):
                assert name.startswith("grpo_fleet_actor_"), f"{title}: {name} has no actor label"
        if re.search(r"by \([^)]*\bactor\b", expr):
            names = promql_metric_names(expr)
            assert all(n.startswith("grpo_fleet_actor_") or n == "up" for n in names), f"{title}: {expr!r}"
