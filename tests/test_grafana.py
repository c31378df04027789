"""grafana/: the committed dashboard equals its generator and validates against the official
Grafana dashboard schema (built from the @grafana/schema npm package); provisioning files."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml
from factories import load_script
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from specd.core.decide import Reason
from specd.io.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "grafana" / "generate.py"
DASHBOARD = ROOT / "grafana" / "dashboards" / "specd.json"
PROVISIONING = ROOT / "grafana" / "provisioning"
# Pinned so the schema, and the cache key, only change on purpose.
NPM_PACKAGES = ("@grafana/schema@13.2.3", "ts-json-schema-generator@2.4.0", "typescript@5.9.3")
SCHEMA_CACHE = Path(os.environ.get("SPECD_SCHEMA_CACHE", ROOT / ".cache" / "grafana-schema"))
SCHEMA_TYPES = "node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts"

# specd metrics the dashboard leaves out on purpose (logs and alerts cover them).
NOT_ON_DASHBOARD = {
    "specd_last_decision_timestamp_seconds",  # the decision panels show when
    "specd_state_load_errors_total",  # once at start; the log says it
    "specd_config_reload_timestamp_seconds",  # the reload panel and the log show the outcome
}


def load_dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def panels() -> list[dict[str, Any]]:
    return [p for p in load_dashboard()["panels"] if p["type"] != "row"]


def annotations() -> list[dict[str, Any]]:
    return [a for a in load_dashboard()["annotations"]["list"] if not a.get("builtIn")]


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]] + [a["expr"] for a in annotations()]


# What Grafana's Prometheus data source reads from an annotation query beside `expr`; the
# official schema's AnnotationQuery (a --grafana-- query, "TODO: a normal query target")
# has none of them, so they are checked here and the rest against the schema.
PROMETHEUS_ANNOTATION_KEYS = {"expr", "step", "titleFormat", "textFormat", "useValueForTime"}


def without_datasource_annotation_keys(dashboard: dict[str, Any]) -> dict[str, Any]:
    stripped = copy.deepcopy(dashboard)
    for query in stripped["annotations"]["list"]:
        for key in PROMETHEUS_ANNOTATION_KEYS:
            query.pop(key, None)
    return stripped


def generator() -> ModuleType:
    if sys.version_info < (3, 11):
        pytest.skip("grafana-foundation-sdk needs Python >= 3.11")
    return load_script(GENERATOR, "grafana_generate")


def test_committed_json_matches_generator() -> None:
    assert DASHBOARD.read_text(encoding="utf-8") == generator().render(), (
        "grafana/dashboards/specd.json is stale: run python grafana/generate.py"
    )


@pytest.mark.parametrize(
    ("content", "expected_rc"),
    [(None, 0), ("{}\n", 1), ("", 1)],
)
def test_generator_check_flag(tmp_path: Path, content: str | None, expected_rc: int) -> None:
    gen = generator()
    target = tmp_path / "specd.json"
    target.write_text(gen.render() if content is None else content, encoding="utf-8")
    assert gen.main(["--check", "--output", str(target)]) == expected_rc


@pytest.fixture(scope="module")
def dashboard_schema() -> dict[str, Any]:
    """The Dashboard JSON schema generated from @grafana/schema, cached by package versions."""
    key = re.sub(r"[^A-Za-z0-9.]+", "-", "_".join(NPM_PACKAGES)).strip("-")
    cached = SCHEMA_CACHE / key / "dashboard.schema.json"
    if not cached.exists():
        npm, npx = shutil.which("npm"), shutil.which("npx")
        if npm is None or npx is None:
            if os.environ.get("SPECD_ALLOW_SKIP") == "1":
                pytest.skip("npm missing (apt-get install nodejs npm)")
            pytest.fail("npm missing: apt-get install nodejs npm (or SPECD_ALLOW_SKIP=1)")
        work = cached.parent
        work.mkdir(parents=True, exist_ok=True)
        (work / "package.json").write_text('{"private": true}\n')
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--silent", *NPM_PACKAGES],
            cwd=work,
            check=True,
            timeout=300,
        )
        partial = work / "dashboard.schema.json.tmp"
        subprocess.run(
            [npx, "--no-install", "ts-json-schema-generator", "--path", SCHEMA_TYPES,
             "--type", "Dashboard", "--no-type-check", "-o", str(partial)],
            cwd=work,
            check=True,
            timeout=300,
        )  # fmt: skip
        partial.replace(cached)
    schema: dict[str, Any] = json.loads(cached.read_text(encoding="utf-8"))
    return schema


def schema_errors(schema: dict[str, Any], dashboard: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(dashboard)]


def test_dashboard_validates_against_official_schema(dashboard_schema: dict[str, Any]) -> None:
    assert (
        schema_errors(dashboard_schema, without_datasource_annotation_keys(load_dashboard())) == []
    )


def test_the_schema_check_sees_the_annotations(dashboard_schema: dict[str, Any]) -> None:
    # Stripping the Prometheus keys must not hide a broken annotation from the schema.
    broken = copy.deepcopy(load_dashboard())
    broken["annotations"]["list"][0]["iconColour"] = "blue"
    assert schema_errors(dashboard_schema, without_datasource_annotation_keys(broken)) != []


@pytest.mark.parametrize("annotation", annotations(), ids=lambda a: a["name"])
def test_annotations_are_prometheus_queries_on_specd_metrics(annotation: dict[str, Any]) -> None:
    # Each marks, on every time series, what explains a dip: restarts, rollbacks, pins.
    assert annotation["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert annotation["enable"] is True
    assert set(annotation) >= PROMETHEUS_ANNOTATION_KEYS
    assert annotation["titleFormat"]
    assert annotation["textFormat"]
    assert annotation["useValueForTime"] is False  # the span where the series exists
    assert re.search(r"\bspecd_[a-z_]+\{", annotation["expr"]), annotation["expr"]


def test_every_restart_result_exploration_and_pin_is_annotated() -> None:
    text = " ".join(a["expr"] for a in annotations())
    assert 'result="success"' in text
    assert 'result!="success"' in text  # rolled_back and failed
    assert 'mode="pin"' in text
    assert 'specd_override_info{instance=~"$instance", mode="freeze"}' in text
    assert "specd_frozen{" in text  # the freeze after a failed restart, apart
    assert "specd_explorations_total{" in text


def test_every_regression_is_annotated() -> None:
    assert any("specd_regressions_total{" in a["expr"] for a in annotations())


def _unknown_top_key(d: dict[str, Any]) -> None:
    d["__inputs"] = [{"name": "DS_PROMETHEUS"}]


def _panel_without_type(d: dict[str, Any]) -> None:
    del d["panels"][1]["type"]


def _bad_grid(d: dict[str, Any]) -> None:
    d["panels"][1]["gridPos"]["w"] = "wide"


def _bad_variable(d: dict[str, Any]) -> None:
    d["templating"]["list"][0]["type"] = "prometheus"


@pytest.mark.parametrize(
    "corrupt", [_unknown_top_key, _panel_without_type, _bad_grid, _bad_variable]
)
def test_schema_rejects_broken_dashboards(dashboard_schema: dict[str, Any], corrupt: Any) -> None:
    broken = copy.deepcopy(load_dashboard())
    corrupt(broken)
    assert schema_errors(dashboard_schema, broken) != []


def test_datasource_is_a_variable_not_an_input() -> None:
    dashboard = load_dashboard()
    text = DASHBOARD.read_text(encoding="utf-8")
    assert "__inputs" not in dashboard
    assert "${DS_" not in text
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["type"] == "query"
    assert variables["instance"]["multi"]
    assert variables["instance"]["includeAll"]
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


SELECTOR = re.compile(r"\b(specd_[a-z_]+|sglang:[a-z_]+|up)\b(\{[^}]*\})?")


@pytest.mark.parametrize("expr", exprs())
def test_every_selector_filters_on_instance(expr: str) -> None:
    for match in SELECTOR.finditer(expr):
        assert match.group(2) is not None, f"bare selector {match.group(1)} in {expr}"
        assert 'instance=~"$instance"' in match.group(2), expr


@pytest.mark.parametrize("panel", panels(), ids=lambda p: p["title"])
def test_every_panel_has_title_description_unit(panel: dict[str, Any]) -> None:
    assert panel["title"]
    assert panel["description"]
    assert panel["fieldConfig"]["defaults"].get("unit"), f"{panel['title']}: no unit"
    assert panel["targets"], f"{panel['title']}: no query"


def test_panels_do_not_overlap_and_fit_the_grid() -> None:
    taken: set[tuple[int, int]] = set()
    ids = [p["id"] for p in load_dashboard()["panels"]]
    assert len(ids) == len(set(ids))
    for panel in load_dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0, panel["title"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        cells = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_thresholds_set_where_a_value_means_trouble() -> None:
    by_title = {p["title"]: p for p in panels()}
    for title in ("Restart budget left", "Restart duration", "Last good SGLang scrape"):
        steps = by_title[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert len(steps) >= 3, title
        assert {"red", "green"} <= {s["color"] for s in steps}, title
    frozen = by_title["Frozen"]["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert frozen["1"]["color"] == "red"


def test_every_specd_metric_is_on_the_dashboard() -> None:
    registry = CollectorRegistry()
    Metrics(registry=registry)
    # Whole names: specd_offered_concurrency is not on the dashboard by way of
    # specd_offered_concurrency_current. A family is there when a query reads any of its
    # series (a counter's _total, a histogram's _bucket, _sum or _count).
    used = set(re.findall(r"\bspecd_\w+", " ".join(exprs())))
    missing = set()
    for family in registry.collect():
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        name = family.name + suffix
        sample_names = {s.name for s in family.samples} | {name}
        if name not in NOT_ON_DASHBOARD and not sample_names & used:
            missing.add(name)
    assert missing == set()


LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def test_every_legend_label_is_one_its_metric_has() -> None:
    """A legend's {{label}} names a label of the specd metric its query reads: one a rename
    took away (specd_offered_concurrency's `quantile`, now `q`: promtool refuses `quantile`
    outside a summary) would show the same blank name for every series."""
    metrics = Metrics(registry=CollectorRegistry())
    names: dict[str, set[str]] = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            for family in metric.collect():
                seen = {label for sample in family.samples for label in sample.labels}
                for suffix in ("", "_total", "_info", "_bucket", "_sum", "_count"):
                    names[family.name + suffix] = {*metric._labelnames, *seen}
    wrong = []
    checked = 0
    for panel in panels():
        for target in panel["targets"]:
            read = set(re.findall(r"\bspecd_\w+", target["expr"]))
            legend = set(LEGEND_LABEL.findall(target.get("legendFormat", ""))) - {"instance", "job"}
            if len(read) != 1 or not legend:
                continue
            (metric,) = read
            checked += 1
            if not legend <= names[metric]:
                wrong.append(f"{panel['title']}: {target['legendFormat']} over {metric}")
    assert checked, "no legend names a label: the check checks nothing"
    assert wrong == []


def test_provisioning_files() -> None:
    dashboards = yaml.safe_load((PROVISIONING / "dashboards" / "specd.yml").read_text())
    datasources = yaml.safe_load(
        (PROVISIONING / "datasources" / "specd-prometheus.yml").read_text()
    )
    assert dashboards["apiVersion"] == 1
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"].startswith("/")
    assert datasources["apiVersion"] == 1
    assert [d["type"] for d in datasources["datasources"]] == ["prometheus"]


def test_decision_timeline_colours_every_reason() -> None:
    assert set(generator().REASON_COLORS) == {r.value for r in Reason}


SPECD_SELECTOR = re.compile(r"\b(specd_[a-z_]+)\{([^}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"')
RULES = ROOT / "etc" / "prometheus" / "specd.rules.yml"


def exported_label_values() -> dict[tuple[str, str], set[str]]:
    """Every (sample name, label) specd exports and the values it takes: the fixed ones
    declared at start, and an override's mode as the daemon sets it."""
    metrics = Metrics(
        registry=CollectorRegistry(), reasons=[r.value for r in Reason], steps=range(1, 7)
    )
    values: dict[tuple[str, str], set[str]] = {}
    for mode in ("pin", "freeze"):
        metrics.set_override_info(mode, "on-call's reason")
        for family in metrics.registry.collect():
            for sample in family.samples:
                for label, value in sample.labels.items():
                    values.setdefault((sample.name, label), set()).add(value)
    return values


def matched_label_values() -> list[tuple[str, str, str, str]]:
    """(where, metric, label, value) of every matcher on a specd metric in the dashboard
    and the rules; a regex alternation ("pin|freeze") counts each alternative."""
    rules = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    sources = [("dashboard", e) for e in exprs()] + [
        (r.get("alert") or r["record"], r["expr"]) for g in rules for r in g["rules"]
    ]
    found = []
    for where, expr in sources:
        for selector in SPECD_SELECTOR.finditer(expr):
            for label, op, value in MATCHER.findall(selector.group(2)):
                if label in ("instance", "job"):
                    continue
                for option in value.split("|") if op in ("=~", "!~") else [value]:
                    found.append((where, selector.group(1), label, option))
    return found


def test_every_matched_label_value_is_exported() -> None:
    """A label value a panel, annotation or alert matches on is one specd exports: a
    renamed result, mode or reason would leave the query silently empty."""
    exported = exported_label_values()
    matched = matched_label_values()
    assert {(m, label) for _, m, label, _ in matched} >= {
        ("specd_mode", "mode"),
        ("specd_override_info", "mode"),
        ("specd_restarts_total", "result"),
    }
    wrong = [
        f"{where}: {metric}{{{label}={value!r}}}"
        for where, metric, label, value in matched
        if value not in exported.get((metric, label), set())
    ]
    assert wrong == []


ALERT_TIMING = re.compile(r"\b((?:Specd|SGLang)\w+) fires after (an hour|\d+ minutes)")


def _seconds(text: str) -> int:
    """Seconds of a rule's `for` ("1h", "15m") or of a description's "an hour", "45 minutes"."""
    if text == "an hour":
        return 3600
    if text.endswith(" minutes"):
        return int(text.removesuffix(" minutes")) * 60
    return int(text[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[text[-1]]


# An age the rule compares with a time specd exports: `time() - ...timestamp_seconds...) > N`.
RULE_AGE = re.compile(r"time\(\) - [^\n]*_timestamp_seconds[^\n]*\) > (\d+)")


def _rule_delay(rule: dict[str, Any]) -> int:
    """When a rule fires after its condition began: its `for`, or the age it compares
    (SpecdFleetSlotHeldTooLong counts its hour from the time the slot was taken)."""
    ages = [int(n) for n in RULE_AGE.findall(rule["expr"])]
    return max([_seconds(rule.get("for", "0s")), *ages])


def test_panel_descriptions_give_each_alert_its_rules_delay() -> None:
    """A panel that tells the on-call when an alert fires says what the rule does: Fleet
    slot held said SpecdFleetSlotHeldTooLong fires after 45 minutes; its `for` was 1h."""
    rules = {
        r["alert"]: r
        for g in yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    said = [
        (p["title"], alert, when)
        for p in panels()
        for alert, when in ALERT_TIMING.findall(p["description"])
    ]
    assert said, "no panel names an alert's delay: the check checks nothing"
    wrong = [
        f"{title}: {alert} fires after {when}, its rule after {_rule_delay(rules[alert])} s"
        for title, alert, when in said
        if _seconds(when) != _rule_delay(rules[alert])
    ]
    assert wrong == []
