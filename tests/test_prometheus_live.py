"""A real Prometheus scrapes a running specd and the SGLang twin under load; every panel query
of the dashboard and every rule of etc/prometheus/specd.rules.yml runs against it.

Approach for rules: Prometheus loads the rule file itself, so /api/v1/rules proves every
rule parsed and evaluates without error (health "ok"). Recording rules must produce series.
Alerts legitimately return nothing on a healthy stack, so for each alert every metric
selector inside its expression must match series of this stack (a renamed metric or a
wrong label would make the alert silently dead), and the expression must run cleanly
via /api/v1/query.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from factories import system_binary
from twin_thread import TwinThread

from specd.io.tls import verifying_context
from specd.twin.process import free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "grafana" / "dashboards" / "specd.json"
RULES = ROOT / "etc" / "prometheus" / "specd.rules.yml"
EXAMPLE_CONFIG = ROOT / "etc" / "prometheus" / "prometheus.example.yml"
DATA_DEADLINE_S = 45.0
# Panels with no data in this stack, with the reason (strict: were one to return data,
# the xfail turns into a failure).
PENDING: dict[str, str] = {
    # No restart or drain happens in this stack: their panels show no value (they showed
    # NaN, a 0/0, before), which these queries must keep returning until one happens.
    "specd_restart_duration_seconds": "no restart in this stack: no value, not NaN",
    "specd_drain_duration_seconds": "no drain in this stack: no value, not NaN",
}
CALIBRATION = Path(__file__).resolve().parents[1] / "specd" / "data" / "seed-qwen35-122b.csv"
# Grafana's macros, as Grafana would expand them for a short range at a 1 s scrape (a 1 s
# step: $__interval, and the bar panels' ${__interval_ms}).
MACROS = {
    "${__interval_ms}": "1000",
    "$__rate_interval": "10s",
    "$__range": "5m",
    "$instance": ".+",
}
# `specd run`'s code path (specd.cli only dispatches to it), without depending on the
# subcommand's registration.
DAEMON_BOOT = (
    "import argparse, sys\n"
    "from specd.commands import run as daemon\n"
    "parser = argparse.ArgumentParser(prog='specd run')\n"
    "daemon.configure(parser)\n"
    "sys.exit(daemon.run(parser.parse_args(sys.argv[1:])))\n"
)

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]


def prometheus_binary() -> str:
    return system_binary("prometheus", "prometheus")


def expand(expr: str) -> str:
    for macro, value in MACROS.items():
        expr = expr.replace(macro, value)
    return expr


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queries.append((f"{panel['title']}/{target['refId']}", target["expr"]))
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            # Annotations mark events (restarts, pins): empty until one happens, so only the
            # series behind them must exist; the query itself runs in its own test.
            metric = re.search(r"\b(specd_[a-z_]+)\{", annotation["expr"])
            assert metric is not None, annotation["expr"]
            queries.append((f"annotation {annotation['name']}", metric.group(1)))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(metric, label) is Grafana's; the series behind it is what matters.
            metric = re.fullmatch(r"label_values\((\w+), *\w+\)", variable["query"]["query"])
            assert metric is not None, variable["query"]
            queries.append((f"variable {variable['name']}", metric.group(1)))
    return queries


def rule_entries() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"]]


def query_params() -> list[Any]:
    ready, pending = [], []
    for name, expr in panel_queries():
        why = next((why for metric, why in PENDING.items() if metric in expr), None)
        if why is None:
            ready.append(pytest.param(expr, id=name))
        else:
            pending.append(
                pytest.param(expr, id=name, marks=pytest.mark.xfail(strict=True, reason=why))
            )
    return ready + pending  # pending last: they run once the stack has data, without waiting


class Loader:
    """A few closed-loop streaming clients, so SGLang has running requests to report."""

    def __init__(self, url: str, clients: int, max_tokens: int = 200) -> None:
        self.url = url
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        self.max_tokens = max_tokens

    def _client(self) -> None:
        body = {"model": "default", "prompt": "hi", "max_tokens": self.max_tokens, "stream": True}
        with httpx.Client(timeout=30, verify=verifying_context()) as client:
            while not self.stop.is_set():
                try:
                    with client.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                        for _ in resp.iter_lines():
                            if self.stop.is_set():
                                break
                except httpx.HTTPError:
                    self.stop.wait(0.2)  # the twin may be restarting

    def __enter__(self) -> Loader:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=5)


@dataclass
class Stack:
    prom_url: str
    client: httpx.Client
    deadline: float

    def query(self, expr: str) -> dict[str, Any]:
        resp = self.client.get(f"{self.prom_url}/api/v1/query", params={"query": expr})
        body: dict[str, Any] = resp.json()
        assert resp.status_code == 200, f"{expr}: {body.get('error')}"
        assert body["status"] == "success", body
        return body

    def query_until_data(self, expr: str) -> list[dict[str, Any]]:
        while True:
            result: list[dict[str, Any]] = self.query(expr)["data"]["result"]
            if result or time.monotonic() > self.deadline:
                return result
            time.sleep(0.25)  # Prometheus scrapes and evaluates every second


def write_specd_config(tmp: Path, twin_url: str, metrics_port: int) -> Path:
    # A window that never opens during the test: no restart interferes with scraping.
    closed_hour = (datetime.now(timezone.utc).hour + 12) % 24
    expires = (datetime.now(timezone.utc) + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    override = tmp / "override.toml"
    override.write_text(
        f'mode = "pin"\nsteps = 4\nexpires_at = "{expires}"\nreason = "live monitoring test"\n'
    )
    override.chmod(0o644)
    config = tmp / "specd.toml"
    config.write_text(
        f"""
[sglang]
url = "{twin_url}"
unit = "sglang-twin.service"
env_file = "{tmp / "sglang.env"}"
[files]
state_dir = "{tmp / "state"}"
override_file = "{override}"
[observe]
scrape_interval_s = 1.0
scrape_timeout_s = 2.0
stale_after_s = 10.0
history_half_life_s = 60.0
min_history_s = 2.0
warmup_exclude_s = 0.0
[report]
metrics_listen_address = "127.0.0.1"
metrics_port = {metrics_port}
log_format = "json"
[choose]
stabilization_window_s = 2.0
# The model policy, from the twin's own table, so the predictions panel has data.
calibration_file = "{CALIBRATION}"

[[windows]]
cron = "0 {closed_hour} * * mon-sun"
duration_s = 60
timezone = "UTC"
"""
    )
    (tmp / "state").mkdir()
    return config


def write_prometheus_config(tmp: Path, specd_port: int, twin_port: int) -> Path:
    """The example config, pointed at this stack: its relabeling is under test too."""
    config = yaml.safe_load(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    ports = {"specd": specd_port, "sglang": twin_port}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{ports[job['job_name']]}"]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binary = prometheus_binary()
    tmp = tmp_path_factory.mktemp("live")
    twin_args = [
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--enable-metrics", "--load-time-s", "0", "--warmup-s", "0",
    ]  # fmt: skip
    # What Prometheus scrapes of SGLang is the twin's page: the twin runs in this process
    # (tests/twin_thread.py); specd and Prometheus are processes of their own.
    with TwinThread(twin_args) as twin:
        twin.wait_healthy(30)
        specd_port, prom_port = free_port(), free_port()
        specd_cfg = write_specd_config(tmp, twin.url, specd_port)
        specd_log = (tmp / "specd.log").open("wb")
        specd = subprocess.Popen(
            [sys.executable, "-c", DAEMON_BOOT, "--config", str(specd_cfg)],
            stdout=specd_log,
            stderr=subprocess.STDOUT,
        )
        prom_log = (tmp / "prometheus.log").open("wb")
        prom = subprocess.Popen(
            [
                binary,
                f"--config.file={write_prometheus_config(tmp, specd_port, twin.port)}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=prom_log,
            stderr=subprocess.STDOUT,
        )
        client = httpx.Client(timeout=10, verify=verifying_context())
        try:
            with Loader(twin.url, clients=4):
                prom_url = f"http://127.0.0.1:{prom_port}"
                wait_targets_up(client, prom_url, specd, tmp)
                yield Stack(prom_url, client, time.monotonic() + DATA_DEADLINE_S)
        finally:
            client.close()
            stop_process(prom)
            stop_process(specd)
            specd_log.close()
            prom_log.close()


def wait_targets_up(
    client: httpx.Client, prom_url: str, specd: subprocess.Popen[bytes], tmp: Path
) -> None:
    deadline = time.monotonic() + 30
    health: dict[str, str] = {}
    while time.monotonic() < deadline:
        if specd.poll() is not None:
            log = (tmp / "specd.log").read_text(errors="replace")[-2000:]
            pytest.fail(f"specd exited with {specd.returncode}:\n{log}")
        try:
            targets = client.get(f"{prom_url}/api/v1/targets").json()["data"]["activeTargets"]
            health = {t["labels"]["job"]: t["health"] for t in targets}
        except (httpx.HTTPError, ValueError):  # not listening yet, or 503 while starting
            health = {}
        if health == {"specd": "up", "sglang": "up"}:
            return
        time.sleep(0.1)
    pytest.fail(f"targets not up within 30 s: {health}")


def test_targets_share_the_host_instance(stack: Stack) -> None:
    # Both targets are up in /api/v1/targets before each one's first `up` sample can be
    # queried (once, under the full suite's load, specd's was not yet): read until both
    # jobs have one, then compare.
    result = stack.query_until_data("count by (job) (up) and on () count(count by (job) (up)) == 2")
    result = stack.query("up")["data"]["result"] if result else []
    assert {(r["metric"]["job"], r["metric"]["instance"]) for r in result} == {
        ("specd", "127.0.0.1"),
        ("sglang", "127.0.0.1"),
    }


@pytest.mark.parametrize("expr", query_params())
def test_panel_query_returns_data(stack: Stack, expr: str, request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("xfail"):
        assert stack.query(expand(expr))["data"]["result"], f"no data for {expr}"
    else:
        assert stack.query_until_data(expand(expr)), f"no data for {expr}"


def annotation_exprs() -> list[Any]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return [
        pytest.param(a["expr"], id=a["name"])
        for a in dashboard["annotations"]["list"]
        if "expr" in a
    ]


@pytest.mark.parametrize("expr", annotation_exprs())
def test_annotation_query_runs(stack: Stack, expr: str) -> None:
    # Valid PromQL Prometheus evaluates (an error fails inside query()); empty is fine.
    stack.query(expand(expr))


def test_every_rule_loaded_and_healthy(stack: Stack) -> None:
    # Rules evaluate every second; a few rounds after the targets came up.
    want = {rule.get("alert") or rule["record"] for rule in rule_entries()}
    while True:
        groups = stack.client.get(f"{stack.prom_url}/api/v1/rules").json()["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        evaluated = all(r.get("lastEvaluation", "0001").startswith("20") for r in loaded.values())
        if (set(loaded) == want and evaluated) or time.monotonic() > stack.deadline:
            break
        time.sleep(0.25)
    assert set(loaded) == want
    unhealthy = {name: r.get("lastError") for name, r in loaded.items() if r["health"] != "ok"}
    assert unhealthy == {}


RECORDS = [r for r in rule_entries() if "record" in r]
ALERTS = [r for r in rule_entries() if "alert" in r]


@pytest.mark.parametrize("rule", RECORDS, ids=lambda r: r["record"])
def test_recording_rule_returns_data(stack: Stack, rule: dict[str, Any]) -> None:
    assert stack.query_until_data(rule["expr"]), rule["expr"]
    assert stack.query_until_data(rule["record"]), f"{rule['record']} not recorded"


SELECTOR = re.compile(r"(?<![\w:])((?:specd_|sglang:|instance:)[\w:]+|up)(\{[^}]*\})?(?!\s*\()")


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_alert_expression_runs_and_its_series_exist(stack: Stack, rule: dict[str, Any]) -> None:
    stack.query(rule["expr"])  # parses and evaluates
    selectors = {m.group(0) for m in SELECTOR.finditer(rule["expr"])}
    assert selectors, rule["expr"]
    missing = [s for s in sorted(selectors) if not stack.query_until_data(f"count({s})")]
    assert missing == [], f"{rule['alert']}: no series for {missing}"
