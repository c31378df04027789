"""specd.io.sglang and specd.io.promtext against SGLang pages served over real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import gzip_bomb, make_fixtures_module, run_specd
from pages import PageServer, Route, page_server
from prometheus_client.parser import text_string_to_metric_families
from twin_zygote import ForkedTwin

from specd import cli
from specd.core.acceptance import accept_length_from_alpha, alpha_from_accept_length
from specd.core.observation import Observation, ScrapeError
from specd.io.promtext import PromTextError, select_samples
from specd.io.sglang import (
    DEFAULT_MAX_PAGE_BYTES,
    FAMILIES,
    MAX_SERIES,
    RUNNING,
    HealthStatus,
    ParsedMetrics,
    SGLangClient,
    observation_from,
    parse_metrics,
)
from specd.io.tls import verifying_context
from specd.twin.process import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


mf = make_fixtures_module()
BASE = mf.base_page()


def page(name: str) -> str:
    return (FIXTURES / name).read_text()


def info(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


# ---- a real HTTP server on 127.0.0.1 (tests/pages.py) ------------------------------


@pytest.fixture
def server() -> Iterator[PageServer]:
    with page_server() as state:
        yield state


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


# ---- fixtures are reproducible -----------------------------------------------------


def test_committed_fixtures_match_make_fixtures() -> None:
    for name, text in mf.pages(BASE).items():
        assert page(name) == text, f"{name} is stale: run tests/fixtures/metrics/make_fixtures.py"
    for name, body in mf.server_infos().items():
        assert info(name) == body, f"{name} is stale: run tests/fixtures/metrics/make_fixtures.py"


# ---- exact against prometheus_client's full parser ---------------------------------

VALID_PAGES = [
    "sglang-0.5.23-loaded.prom",
    "dp2.prom",
    "dp4-2000.prom",
    "idle-stale.prom",
    "pre-0.5.13.prom",
    "spec-off.prom",
    "all-schedulers-tp4.prom",
    "priority.prom",
]


def full_parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    wanted = set(FAMILIES)
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in wanted
    }


def fast_parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for samples in select_samples(text, FAMILIES).values()
        for s in samples
    }


@pytest.mark.parametrize("name", VALID_PAGES)
def test_fast_parser_equals_prometheus_client(name: str) -> None:
    text = page(name)
    expected = full_parse(text)
    assert expected, "the comparison must cover samples"
    assert fast_parse(text) == expected


PROMTEXT_LINES = [
    # (page, expected {sample name: [(labels, value)]}); each also checked against prometheus_client
    ('a{x="1"} 2\n', {"a": [({"x": "1"}, 2.0)]}),
    ("a 2\n", {"a": [({}, 2.0)]}),
    ('a{x="1",} 2 1700000000000\n', {"a": [({"x": "1"}, 2.0)]}),
    ('a{x="1"}\t2\n', {"a": [({"x": "1"}, 2.0)]}),
    ('a{x="1"} 2\r\n', {"a": [({"x": "1"}, 2.0)]}),
    ('a{ x = "1" , y="2" } 1e3\n', {"a": [({"x": "1", "y": "2"}, 1000.0)]}),
    ('a{x="q\\"}\\\\ \\n, y=\\"z"} -1.5e-3\n', {"a": [({"x": 'q"}\\ \n, y="z'}, -0.0015)]}),
    ('a{x="it\'s {ok}"} +Inf\n', {"a": [({"x": "it's {ok}"}, math.inf)]}),
    ('a_total{x="1"} 3\na{x="1"} 4\nab 5\n', {"a": [({"x": "1"}, 4.0)]}),
    ('# HELP a about a\n# TYPE a gauge\na{x="1"} 7\nb{x="1"} 8\n', {"a": [({"x": "1"}, 7.0)]}),
    ("", {}),
]


@pytest.mark.parametrize(("text", "expected"), PROMTEXT_LINES)
def test_promtext_lines(text: str, expected: dict[str, list[tuple[dict[str, str], float]]]) -> None:
    got = {
        name: [(dict(s.labels), s.value) for s in samples]
        for name, samples in select_samples(text, ["a"]).items()
    }
    assert got == expected
    reference = {
        s.name: [(dict(s.labels), float(s.value))]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "a"
    }
    assert got == reference


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('a{x="1"} 2', "does not end with a newline"),
        ('a{x="1} 2\n', "bad labels"),
        ("a{x=1} 2\n", "bad labels"),
        ('a{x="1"y="2"} 2\n', "bad labels"),
        ('a{x="1",x="2"} 2\n', "label 'x' twice"),
        ('a{x="1"} 2\na{x="1"} 3\n', "duplicated series"),
        ('a{x="1"} 1_000\n', "bad value"),
        ('a{x="1"} two\n', "bad value"),
        ('a{x="1"}\n', "bad sample line"),
        ('a{x="1"} 1 2 3\n', "bad sample line"),
        ('a{x="1"}2\n', "bad sample line"),
    ],
)
def test_promtext_rejects(text: str, reason: str) -> None:
    with pytest.raises(PromTextError, match=reason):
        select_samples(text, ["a"])


@pytest.mark.parametrize(("series", "refused"), [(0, False), (3, False), (4, True), (50, True)])
def test_promtext_series_bound(series: int, refused: bool) -> None:
    # Lines of names not selected do not count against the bound.
    text = "".join(f'a{{x="{i}"}} 1\nb{{x="{i}"}} 1\n' for i in range(series)) + "b 2\n"
    if refused:
        with pytest.raises(PromTextError, match="more than 3 series of the metrics read"):
            select_samples(text, ["a"], max_samples=3)
    else:
        assert len(select_samples(text, ["a"], max_samples=3).get("a", [])) == series


# ---- from a page (and /server_info) to an Observation ------------------------------

LOADED = info("server_info-loaded.json")


def loaded_with(**changes: Any) -> dict[str, Any]:
    return {**LOADED, **changes}


OBSERVATIONS: list[tuple[str, str, dict[str, Any] | None, dict[str, Any]]] = [
    (
        "one series, loaded",
        "sglang-0.5.23-loaded.prom",
        LOADED,
        dict(
            running=13,
            queued=7,
            offered=20,
            accept_length=3.61,
            spec_fresh=True,
            steps=4,
            draft_tokens=5,
            topk=1,
            algorithm="NEXTN",
            max_running_requests=13,
            token_usage=0.82,
            gen_throughput=1510.0,
            generation_tokens_total=35762.0,
            decode_tokens_total=43990.0,
            spec_verify_calls_total=9724.0,
            retracted_total=None,
            version="0.5.23",
            dp_ranks=1,
        ),
    ),
    (
        "two DP ranks: counts summed, accept length weighted by running",
        "dp2.prom",
        info("server_info-dp2.json"),
        dict(
            running=18,
            queued=7,
            accept_length=(13 * 3.61 + 5 * 3.0) / 18,
            steps=4,
            max_running_requests=24,
            token_usage=(0.82 + 0.4) / 2,
            gen_throughput=2110.0,
            decode_tokens_total=2 * 43990.0,
            retracted_total=4.0,
            dp_ranks=2,
            generation_tokens_total=35762.0,
        ),
    ),
    (
        "four DP ranks, one idle with a stale accept length that must not count",
        "dp4-2000.prom",
        LOADED,
        dict(
            running=26,
            queued=8,
            accept_length=(13 * 3.61 + 9 * 3.2 + 4 * 3.9) / 26,
            spec_fresh=True,
            token_usage=(0.82 + 0.6 + 0.0 + 0.3) / 4,
            gen_throughput=3090.0,
            decode_tokens_total=4 * 43990.0,
            dp_ranks=4,
        ),
    ),
    (
        "idle: spec gauges kept their last values and are marked stale",
        "idle-stale.prom",
        LOADED,
        dict(
            running=0, queued=0, accept_length=3.61, spec_fresh=False, steps=4, gen_throughput=0.0
        ),
    ),
    (
        "pre-0.5.13: steps and draft tokens from /server_info",
        "pre-0.5.13.prom",
        info("server_info-0.5.12.json"),
        dict(
            running=13,
            steps=3,
            draft_tokens=4,
            spec_verify_calls_total=None,
            version="0.5.12",
            max_running_requests=48,
            launch_command=None,
            accept_length=3.61,
        ),
    ),
    (
        "pre-0.5.13 and /server_info unreadable: what only it knows is None",
        "pre-0.5.13.prom",
        None,
        dict(
            running=13,
            steps=None,
            draft_tokens=None,
            topk=None,
            algorithm=None,
            version=None,
            max_running_requests=None,
        ),
    ),
    (
        "speculation off",
        "spec-off.prom",
        info("server_info-spec-off.json"),
        dict(running=13, accept_length=None, steps=0, draft_tokens=0, topk=None, algorithm=None),
    ),
    (
        "speculation off, no /server_info: the gauges say 0",
        "spec-off.prom",
        None,
        dict(accept_length=None, steps=0, draft_tokens=0),
    ),
    (
        "--enable-metrics-for-all-schedulers: four TP ranks report one batch",
        "all-schedulers-tp4.prom",
        LOADED,
        dict(running=13, queued=7, gen_throughput=1510.0, decode_tokens_total=43990.0, dp_ranks=1),
    ),
    (
        "priority scheduling: per-priority breakdowns are not added to the totals",
        "priority.prom",
        LOADED,
        dict(running=13, queued=7, accept_length=3.61, dp_ranks=1),
    ),
    (
        "a broken line in a family specd does not read is not its business",
        "garbage-elsewhere.prom",
        LOADED,
        dict(running=13, queued=7),
    ),
    (
        "adaptive mode names its config file",
        "sglang-0.5.23-loaded.prom",
        loaded_with(
            speculative_adaptive=True,
            speculative_adaptive_config="/var/lib/specd/adaptive-0123456789abcdef.json",
        ),
        dict(adaptive=True, adaptive_config="/var/lib/specd/adaptive-0123456789abcdef.json"),
    ),
    (
        "adaptive mode with SGLang's default slots (no config file)",
        "sglang-0.5.23-loaded.prom",
        loaded_with(speculative_adaptive=True, speculative_adaptive_config=None),
        dict(adaptive=True, adaptive_config=None),
    ),
    (
        "a config file without adaptive mode is not adaptive",
        "sglang-0.5.23-loaded.prom",
        loaded_with(speculative_adaptive=False, speculative_adaptive_config="/x.json"),
        dict(adaptive=False, adaptive_config=None),
    ),
    (
        "/server_info without the fields specd reads",
        "sglang-0.5.23-loaded.prom",
        {"version": 5, "internal_states": "x", "speculative_num_steps": "four"},
        dict(
            steps=4,
            draft_tokens=5,
            topk=None,
            algorithm=None,
            version=None,
            max_running_requests=None,
            launch_command=None,
        ),
    ),
]


@pytest.mark.parametrize(
    ("metrics", "server_info", "expected"),
    [case[1:] for case in OBSERVATIONS],
    ids=[case[0] for case in OBSERVATIONS],
)
def test_observation_from_pages(
    metrics: str, server_info: dict[str, Any] | None, expected: dict[str, Any]
) -> None:
    parsed = parse_metrics(page(metrics))
    assert isinstance(parsed, ParsedMetrics)
    obs = observation_from(parsed, server_info, 1234.5)
    assert obs.t == 1234.5
    for name, value in expected.items():
        got = getattr(obs, name)
        assert got == (pytest.approx(value) if isinstance(value, float) else value), name


@pytest.mark.parametrize(
    ("gauges", "server_info", "steps", "draft_tokens"),
    [
        # Before the first decode report SGLang's gauge still reads its default 0.
        ({"sglang:spec_num_steps": 0, "sglang:spec_num_draft_tokens": 0}, LOADED, 4, 5),
        # Adaptive mode: 0 is a real tier ("no drafting" at large batch sizes).
        (
            {"sglang:spec_num_steps": 0, "sglang:spec_num_draft_tokens": 0},
            loaded_with(speculative_adaptive=True),
            0,
            0,
        ),
        # Adaptive mode: the gauge follows the tier, /server_info keeps the launch value.
        (
            {"sglang:spec_num_steps": 1, "sglang:spec_num_draft_tokens": 2},
            loaded_with(speculative_adaptive=True),
            1,
            2,
        ),
        # Without /server_info: the 0 of a server whose verify steps say it drafts is no
        # step count (it was read as 0 steps); its draft-tokens gauge was logged.
        ({"sglang:spec_num_steps": 0}, None, None, 5),
    ],
)
def test_live_steps(
    gauges: dict[str, float],
    server_info: dict[str, Any] | None,
    steps: int | None,
    draft_tokens: int,
) -> None:
    parsed = parse_metrics(mf.set_values(BASE, gauges))
    assert isinstance(parsed, ParsedMetrics)
    obs = observation_from(parsed, server_info, 0.0)
    assert (obs.steps, obs.draft_tokens) == (steps, draft_tokens)


GARBAGE = [
    ("garbage-truncated-mid-line.prom", "malformed", "does not end with a newline"),
    ("garbage-truncated-at-line.prom", "missing", "sglang:num_running_reqs not in page"),
    # The load cannot be unknown: a bad one fails the scrape. (A bad value elsewhere,
    # garbage-nan-usage.prom, garbage-inf.prom, costs its field only: test_sglang_values.)
    ("garbage-nan.prom", "malformed", "sglang:num_running_reqs{"),
    ("garbage-negative.prom", "malformed", "sglang:num_queue_reqs{"),
    ("garbage-fractional.prom", "malformed", "is 12.5, not whole"),
    ("garbage-duplicated.prom", "malformed", "duplicated series"),
    ("garbage-bad-labels.prom", "malformed", "bad labels"),
    ("garbage-html.prom", "missing", "no sglang: metrics at all"),
    ("garbage-empty.prom", "missing", "no sglang: metrics at all"),
]


@pytest.mark.parametrize(("name", "kind", "reason"), GARBAGE)
def test_garbage_pages_give_one_line_errors(name: str, kind: str, reason: str) -> None:
    result = parse_metrics(page(name), t=99.0)
    assert isinstance(result, ScrapeError)
    assert (result.kind, result.t) == (kind, 99.0)
    assert reason in result.reason
    assert "\n" not in result.reason
    assert len(result.reason) <= 200


def test_garbage_reasons_name_the_value() -> None:
    pages = [
        page("garbage-nan.prom"),
        page("garbage-negative.prom"),
        mf.set_values(BASE, {"sglang:num_queue_reqs": "+Inf"}),
    ]
    reasons = [parse_metrics(text) for text in pages]
    assert [r.reason.rsplit(" is ", 1)[1] for r in reasons if isinstance(r, ScrapeError)] == [
        "NaN",
        "-3.0",
        "+Inf",
    ]


# ---- over HTTP -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metrics", "server_info", "running", "steps"),
    [
        ("sglang-0.5.23-loaded.prom", "server_info-loaded.json", 13, 4),
        ("dp2.prom", "server_info-dp2.json", 18, 4),
        ("pre-0.5.13.prom", "server_info-0.5.12.json", 13, 3),
    ],
)
def test_observe_over_http(
    server: PageServer, metrics: str, server_info: str, running: int, steps: int
) -> None:
    server.serve_sglang(page(metrics), info(server_info))
    clock_values = iter([1000.0, 2000.0])
    with SGLangClient(server.url + "/", clock=lambda: next(clock_values)) as client:
        first = client.observe()
        second = client.observe()
    assert isinstance(first, Observation)
    assert isinstance(second, Observation)
    assert (first.t, second.t) == (1000.0, 2000.0)
    assert (first.running, first.steps) == (running, steps)
    assert (first.version, first.launch_command) == (second.version, second.launch_command)
    assert first.max_running_requests == second.max_running_requests
    # /server_info once per SGLang start: the second page is from the same start.
    assert server.hits == ["/metrics", "/server_info", "/metrics"]


def test_old_server_info_endpoint_is_found_and_remembered(server: PageServer) -> None:
    server.serve("/metrics", page("pre-0.5.13.prom"))
    server.serve("/get_server_info", json.dumps(info("server_info-0.5.12.json")))
    with SGLangClient(server.url) as client:
        first = client.observe()
        second = client.observe()
        again = client.server_info()
    assert isinstance(first, Observation)
    assert isinstance(second, Observation)
    assert (first.version, first.steps, second.steps) == ("0.5.12", 3, 3)
    assert isinstance(again, dict)
    assert server.hits == [
        "/metrics",
        "/server_info",
        "/get_server_info",
        "/metrics",
        "/get_server_info",
    ]


@pytest.mark.parametrize(
    ("route", "kind", "reason"),
    [
        (
            Route(status=404, body=b'{"detail":"Not Found"}'),
            "http_status",
            "GET /metrics: 404 Not Found (metrics disabled: start SGLang with --enable-metrics)",
        ),
        (Route(status=503), "http_status", "GET /metrics: 503 Service Unavailable"),
        (Route(status=500, body=b"boom"), "http_status", "GET /metrics: 500 Internal Server Error"),
        (Route(delay_s=1.0, body=BASE.encode()), "timeout", "GET /metrics: no answer within 0.2 s"),
        (
            Route(body=BASE.encode(), declared_length=len(BASE) + 500),
            "malformed",
            "GET /metrics: broken response",
        ),
        (Route(hang_up=True), "malformed", "GET /metrics: broken response"),
        (Route(body=b"\xff\xfe" + BASE.encode()), "malformed", "not UTF-8"),
        (
            Route(body=BASE[: BASE.index("\n", 5000) + 1].encode()),
            "missing",
            "sglang:num_running_reqs not in page",
        ),
    ],
)
def test_metrics_failures(server: PageServer, route: Route, kind: str, reason: str) -> None:
    server.routes["/metrics"] = route
    server.serve("/server_info", json.dumps(LOADED))
    with SGLangClient(server.url, timeout_s=0.2, clock=lambda: 7.0) as client:
        result = client.observe()
    assert isinstance(result, ScrapeError)
    assert (result.kind, result.t) == (kind, 7.0)
    assert reason in result.reason
    assert "\n" not in result.reason


def test_refused_connection() -> None:
    url = closed_port_url()
    with SGLangClient(url) as client:
        observed = client.observe()
        info_result = client.server_info()
        text = client.metrics_text()
        health = client.health_generate(timeout_s=1.0)
    for result in (observed, info_result, text):
        assert isinstance(result, ScrapeError)
        assert result.kind == "refused"
        assert url in result.reason
        assert "\n" not in result.reason
    assert health is HealthStatus.DOWN


@pytest.mark.parametrize(
    ("routes", "kind", "reason"),
    [
        ({"/server_info": Route(status=503)}, "http_status", "GET /server_info: 503"),
        ({}, "http_status", "/server_info and /get_server_info: 404"),
        ({"/server_info": Route(body=b"<html>")}, "malformed", "GET /server_info: invalid JSON"),
        ({"/server_info": Route(body=b"[1, 2]")}, "malformed", "not a JSON object"),
        # Valid JSON, no Unicode text: the name would raise where the history keys the set.
        (
            {
                "/server_info": Route(
                    body=b'{"speculative_adaptive": true, '
                    b'"speculative_adaptive_config": "/x/\\ud800.json"}'
                )
            },
            "malformed",
            "GET /server_info: invalid JSON: a string that is not Unicode text",
        ),
        (
            {"/server_info": Route(body=b"[" * 100_000)},
            "malformed",
            "GET /server_info: invalid JSON: nested deeper than",
        ),
        (
            {"/server_info": Route(delay_s=1.0, body=b"{}")},
            "timeout",
            "GET /server_info: no answer",
        ),
    ],
)
def test_server_info_failures_degrade_the_observation(
    server: PageServer, routes: dict[str, Route], kind: str, reason: str
) -> None:
    server.serve("/metrics", BASE)
    server.routes.update(routes)
    with SGLangClient(server.url, timeout_s=0.2) as client:
        result = client.server_info()
        obs = client.observe()
    assert isinstance(result, ScrapeError)
    assert result.kind == kind
    assert reason in result.reason
    # /metrics alone still gives the counts and the live step count.
    assert isinstance(obs, Observation)
    assert (obs.running, obs.steps, obs.version, obs.max_running_requests) == (13, 4, None, None)


@pytest.mark.parametrize(
    ("max_page_bytes", "kind"),
    [(1024 * 1024, "malformed"), (32 * 1024 * 1024, None)],
)
def test_five_megabyte_page(server: PageServer, max_page_bytes: int, kind: str | None) -> None:
    big = mf.big_page()
    assert len(big) >= 5 * 1024 * 1024
    server.serve_sglang(big, LOADED)
    with SGLangClient(server.url, max_page_bytes=max_page_bytes) as client:
        result = client.observe()
    if kind is None:
        assert isinstance(result, Observation)
        assert (result.running, result.queued, result.steps) == (13, 7, 4)
    else:
        assert isinstance(result, ScrapeError)
        assert result.kind == kind
        assert result.reason == f"GET /metrics: response larger than {max_page_bytes} bytes"


def _rank_lines(count: int) -> str:
    """``count`` more series of the running gauge, each a scheduler rank of replica 0 that
    is not its first (the one read), so the page still reads as BASE does."""
    labels = 'engine_type="unified",model_name="Qwen/Qwen3.5-122B-A10B",moe_ep_rank="0",pp_rank="0"'
    return "".join(f'{RUNNING}{{{labels},tp_rank="{i}"}} 99.0\n' for i in range(1, count + 1))


@pytest.mark.parametrize("over", [0, 1, 230_000])
def test_series_bound(server: PageServer, over: int) -> None:
    """A page within the byte cap can still hold a million lines of the families specd
    reads; reading them all took ~9 s and ~0.5 GB. Past MAX_SERIES the page is refused
    unread (no observation: no change), at any size; up to it, it reads as usual."""
    base_series = sum(len(v) for v in select_samples(BASE, FAMILIES).values())
    page = BASE + _rank_lines(MAX_SERIES - base_series + over)
    assert len(page) < DEFAULT_MAX_PAGE_BYTES
    server.serve_sglang(page, LOADED)
    with SGLangClient(server.url, timeout_s=30.0) as client:
        tracemalloc.start()
        try:
            result = client.observe()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    if over == 0:
        assert isinstance(result, Observation)
        assert (result.running, result.queued, result.steps) == (13, 7, 4)
    else:
        assert isinstance(result, ScrapeError)
        assert (result.kind, result.reason) == (
            "malformed",
            f"GET /metrics: more than {MAX_SERIES} series of the metrics read",
        )
    # The page's bytes, its text and its lines (~97 MB for the largest), and no more: read
    # whole, its samples took ~515 MB more.
    assert peak < 4 * len(page) + 32 * 1024 * 1024


def test_page_size_cap_without_content_length(server: PageServer) -> None:
    # Without a Content-Length up front the cap must hold while reading.
    server.serve("/metrics", BASE, no_length=True)
    with SGLangClient(server.url, max_page_bytes=len(BASE) - 1) as client:
        result = client.metrics_text()
    assert isinstance(result, ScrapeError)
    assert "larger than" in result.reason


@pytest.mark.parametrize(
    ("route", "status"),
    [
        (Route(status=200), HealthStatus.OK),
        (Route(status=503), HealthStatus.UNHEALTHY),
        (Route(delay_s=1.0), HealthStatus.TIMEOUT),
        (Route(hang_up=True), HealthStatus.UNHEALTHY),
    ],
)
def test_health_generate(server: PageServer, route: Route, status: HealthStatus) -> None:
    server.routes["/health_generate"] = route
    with SGLangClient(server.url) as client:
        assert client.health_generate(timeout_s=0.2) is status


# ---- /server_info once per SGLang start -------------------------------------------------

DECODE_LINE = next(
    line
    for line in BASE.splitlines()
    if line.startswith("sglang:realtime_tokens_total") and 'mode="decode"' in line
)
STEPS_LINE = next(line for line in BASE.splitlines() if line.startswith("sglang:spec_num_steps"))


def _with_value(line: str, value: float) -> str:
    return line.rsplit(" ", 1)[0] + f" {value!r}"


@pytest.mark.parametrize(
    ("second_page", "reads_again"),
    [
        (BASE, False),
        # Decode tokens only grow while one SGLang runs: fewer means it started again.
        (BASE.replace(DECODE_LINE, _with_value(DECODE_LINE, 10.0)), True),
        (BASE.replace(DECODE_LINE, _with_value(DECODE_LINE, 99999.0)), False),
        (BASE.replace(STEPS_LINE, _with_value(STEPS_LINE, 3.0)), True),
        # A scheduler with another pid is another process.
        (BASE.replace('pid="1552"', 'pid="7001"'), True),
        (BASE + "process_start_time_seconds 1.7e9\n", True),
    ],
    ids=["same", "counter-backwards", "counter-up", "steps-changed", "new-pid", "start-time"],
)
def test_server_info_is_read_again_only_for_a_new_start(
    server: PageServer, second_page: str, reads_again: bool
) -> None:
    server.serve_sglang(BASE, LOADED)
    with SGLangClient(server.url) as client:
        first = client.observe()
        server.serve("/metrics", second_page)
        second = client.observe()
    assert isinstance(first, Observation)
    assert isinstance(second, Observation)
    assert second.version == first.version == LOADED["version"]
    expected = ["/metrics", "/server_info", "/metrics"] + (["/server_info"] if reads_again else [])
    assert server.hits == expected


def test_server_info_is_read_again_after_a_failed_scrape(server: PageServer) -> None:
    server.serve_sglang(BASE, LOADED)
    with SGLangClient(server.url, timeout_s=0.5) as client:
        assert isinstance(client.observe(), Observation)
        server.serve("/metrics", "", status=503)
        assert isinstance(client.observe(), ScrapeError)
        server.serve("/metrics", BASE)
        assert isinstance(client.observe(), Observation)
        assert isinstance(client.observe(), Observation)
    assert server.hits == [
        "/metrics",
        "/server_info",
        "/metrics",  # 503
        "/metrics",
        "/server_info",
        "/metrics",
    ]


def test_a_failed_server_info_is_retried_with_the_next_scrape(server: PageServer) -> None:
    server.serve("/metrics", BASE)
    server.serve("/server_info", "", status=503)
    with SGLangClient(server.url) as client:
        degraded = client.observe()
        server.serve("/server_info", json.dumps(LOADED))
        whole = client.observe()
        client.observe()
    assert isinstance(degraded, Observation)
    assert isinstance(whole, Observation)
    assert (degraded.version, whole.version) == (None, LOADED["version"])
    assert server.hits == ["/metrics", "/server_info"] * 2 + ["/metrics"]


def test_asked_for_server_info_is_read_fresh_and_reported(server: PageServer) -> None:
    # The applier's verification after a restart: what it reads is what observe reports.
    server.serve_sglang(BASE, LOADED)
    with SGLangClient(server.url) as client:
        client.observe()
        server.serve("/server_info", json.dumps(loaded_with(max_running_requests=11)))
        fresh = client.server_info()
        after = client.observe()
    assert isinstance(fresh, dict)
    assert isinstance(after, Observation)
    assert fresh["max_running_requests"] == 11
    assert server.hits == ["/metrics", "/server_info", "/server_info", "/metrics"]


# Up at once: what these restarts show is the page of a new start, not its load. Each start
# is a process of its own (new pids), forked from a warm interpreter (tests/twin_zygote.py).
TWIN_FAST = ["--load-time-s", "0", "--warmup-s", "0", "--report-interval-s", "0.2"]


def twin_args(steps: int) -> list[str]:
    return [
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1),
        "--enable-metrics", *TWIN_FAST,
    ]  # fmt: skip


def server_info_hits(url: str) -> int:
    """How many /server_info requests the twin served, from its own request counter."""
    text = httpx.get(url + "/metrics", timeout=5, verify=verifying_context()).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sglang:http_requests_total" and sample.labels.get("endpoint") in (
                "/server_info",
                "/get_server_info",
            ):
                return int(sample.value)
    return 0


def test_twin_serves_server_info_once_per_start() -> None:
    port = free_port()
    with ForkedTwin(twin_args(4), port=port) as twin:
        twin.wait_healthy(20)
        client = SGLangClient(twin.url, timeout_s=3.0)
        observed = [client.observe() for _ in range(10)]
        assert all(isinstance(o, Observation) and o.steps == 4 for o in observed), observed
        assert server_info_hits(twin.url) == 1
        assert client.server_info() != {}
        assert server_info_hits(twin.url) == 2
    # SGLang stopped: the scrape fails, and whatever answers next is read afresh.
    down = client.observe()
    assert isinstance(down, ScrapeError)
    assert down.kind == "refused"
    for steps in (4, 3):  # a restart at the same steps (new pids), then at other steps
        with ForkedTwin(twin_args(steps), port=port) as twin:
            twin.wait_healthy(20)
            seen = [client.observe() for _ in range(5)]
            assert all(isinstance(o, Observation) for o in seen), seen
            last = seen[-1]
            assert isinstance(last, Observation)
            assert (last.steps, last.max_running_requests) == (steps, seen[0].max_running_requests)
            assert server_info_hits(twin.url) == 1
    client.close()


def test_twin_restart_between_two_scrapes_is_noticed() -> None:
    # No failed scrape in between: the new start shows only on the page (pids, counters).
    port = free_port()
    client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=3.0)
    with ForkedTwin(twin_args(4), port=port) as twin:
        twin.wait_healthy(20)
        assert isinstance(client.observe(), Observation)
    with ForkedTwin(twin_args(4), port=port) as twin:
        twin.wait_healthy(20)
        assert isinstance(client.observe(), Observation)
        assert isinstance(client.observe(), Observation)
        assert server_info_hits(twin.url) == 1
    client.close()


# ---- one deadline per scrape: a server that trickles bytes ------------------------------

# A byte every quarter second against a half-second deadline: each read gets a byte well
# within the timeout (a timeout per read never fires), the whole answer takes many seconds.
TRICKLE_INTERVAL_S = 0.25


@dataclass
class Trickler:
    """A real HTTP server on 127.0.0.1 answering chosen paths a byte every
    TRICKLE_INTERVAL_S."""

    url: str
    # path -> "headers" (the status line and headers trickle), "body" (headers at once, the
    # body trickles), "silent" (reads the request, never answers); others get BASE or LOADED.
    modes: dict[str, str]
    stop: threading.Event


def _trickle(conn: socket.socket, data: bytes, stop: threading.Event) -> None:
    for byte in data:
        if stop.wait(TRICKLE_INTERVAL_S):
            return
        conn.sendall(bytes([byte]))


def _serve_conn(conn: socket.socket, state: Trickler) -> None:
    with conn:
        buf = b""
        try:
            while not state.stop.is_set():
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                path = head.split(b" ")[1].decode()
                mode = state.modes.get(path)
                body = (json.dumps(LOADED).encode() if "info" in path else BASE.encode()) * (
                    100 if mode == "body" else 1
                )
                headers = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                if mode == "headers":
                    _trickle(conn, headers + body, state.stop)
                elif mode == "body":
                    conn.sendall(headers)
                    _trickle(conn, body, state.stop)
                elif mode == "silent":
                    state.stop.wait(60)
                else:
                    conn.sendall(headers + body)
                    continue
                return
        except OSError:
            return  # the client gave up and closed


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    state = Trickler(f"http://127.0.0.1:{listener.getsockname()[1]}", {}, threading.Event())

    def accept() -> None:
        while not state.stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=_serve_conn, args=(conn, state), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.stop.set()
        thread.join(5)
        listener.close()


SCRAPE_TIMEOUT_S = 0.5


@pytest.mark.parametrize("mode", ["headers", "body", "silent"])
def test_trickling_metrics_time_out_by_one_deadline(trickler: Trickler, mode: str) -> None:
    trickler.modes["/metrics"] = mode
    beats: list[float] = []
    with SGLangClient(
        trickler.url, timeout_s=SCRAPE_TIMEOUT_S, beat=lambda: beats.append(time.monotonic())
    ) as client:
        started = time.monotonic()
        result = client.observe()
        took = time.monotonic() - started
    assert isinstance(result, ScrapeError), result
    assert result.kind == "timeout"
    assert result.reason == f"GET /metrics: no answer within {SCRAPE_TIMEOUT_S:g} s"
    assert SCRAPE_TIMEOUT_S - 0.1 <= took <= SCRAPE_TIMEOUT_S + 1.0
    if mode == "silent":
        # A read that waits calls beat in slices: the daemon's loop is seen alive.
        assert len(beats) >= 1


@pytest.mark.parametrize("mode", ["headers", "body"])
def test_trickling_server_info_times_out_by_one_deadline(trickler: Trickler, mode: str) -> None:
    trickler.modes["/server_info"] = mode
    with SGLangClient(trickler.url, timeout_s=SCRAPE_TIMEOUT_S) as client:
        started = time.monotonic()
        info_result = client.server_info()
        took_info = time.monotonic() - started
        started = time.monotonic()
        observed = client.observe()
        took_observe = time.monotonic() - started
    assert isinstance(info_result, ScrapeError)
    assert info_result.kind == "timeout"
    assert f"GET /server_info: no answer within {SCRAPE_TIMEOUT_S:g} s" in info_result.reason
    assert took_info <= SCRAPE_TIMEOUT_S + 1.0
    # The whole scrape, /metrics and /server_info together, keeps the one deadline; the
    # page alone still gives an Observation.
    assert isinstance(observed, Observation)
    assert (observed.running, observed.version) == (13, None)
    assert took_observe <= SCRAPE_TIMEOUT_S + 1.0


@pytest.mark.parametrize("mode", ["headers", "silent"])
def test_trickling_health_probe_times_out(trickler: Trickler, mode: str) -> None:
    trickler.modes["/health_generate"] = mode
    with SGLangClient(trickler.url, timeout_s=30.0) as client:
        started = time.monotonic()
        status = client.health_generate(timeout_s=SCRAPE_TIMEOUT_S)
        took = time.monotonic() - started
    assert status is HealthStatus.TIMEOUT
    assert took <= SCRAPE_TIMEOUT_S + 1.0


def test_fast_server_after_a_timeout_is_read_in_full(trickler: Trickler) -> None:
    # The deadline belongs to one scrape: the next one starts with its own.
    trickler.modes["/metrics"] = "silent"
    with SGLangClient(trickler.url, timeout_s=SCRAPE_TIMEOUT_S) as client:
        assert isinstance(client.observe(), ScrapeError)
        del trickler.modes["/metrics"]
        again = client.observe()
    assert isinstance(again, Observation)
    assert again.version == LOADED["version"]


@pytest.mark.parametrize(
    "url",
    ["", "127.0.0.1:30000", "ftp://127.0.0.1/", "http://", "http://[::1"],
)
def test_bad_base_url_is_a_clear_value_error(url: str) -> None:
    with pytest.raises(ValueError, match="invalid SGLang URL"):
        SGLangClient(url)


# ---- acceptance maths ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alpha", "steps", "length"),
    [
        (0.0, 4, 1.0),
        (1.0, 4, 5.0),
        (0.5, 1, 1.5),
        (0.5, 2, 1.75),
        (0.8, 3, 1 + 0.8 + 0.64 + 0.512),
        (0.7, 4, 1 + 0.7 + 0.49 + 0.343 + 0.2401),
        (0.3, 0, 1.0),
    ],
)
def test_accept_length_from_alpha(alpha: float, steps: int, length: float) -> None:
    assert accept_length_from_alpha(alpha, steps) == pytest.approx(length)
    if steps >= 1:
        assert alpha_from_accept_length(length, steps) == pytest.approx(alpha, abs=1e-9)


@pytest.mark.parametrize(("length", "steps"), [(3.61, 4), (2.5, 3), (1.01, 5), (4.99, 4), (1.9, 7)])
def test_alpha_solves_the_forward_formula(length: float, steps: int) -> None:
    got = alpha_from_accept_length(length, steps)
    assert got is not None
    assert 0 < got < 1
    assert accept_length_from_alpha(got, steps) == pytest.approx(length, abs=1e-9)


@pytest.mark.parametrize(
    ("length", "steps", "alpha"),
    [
        (1.0, 3, 0.0),
        (5.0, 4, 1.0),
        (5.0 + 1e-12, 4, 1.0),  # rounding in SGLang's mean must not make it impossible
        (0.5, 4, None),  # below 1: not an accept length
        (6.0, 4, None),  # above K+1: measured at another step count
        (math.nan, 4, None),
        (math.inf, 4, None),
        (2.0, 0, None),  # no drafting, no alpha
    ],
)
def test_alpha_edges(length: float, steps: int, alpha: float | None) -> None:
    assert alpha_from_accept_length(length, steps) == alpha


@pytest.mark.parametrize(("alpha", "steps"), [(-0.1, 3), (1.5, 3), (0.5, -1)])
def test_accept_length_rejects_impossible_inputs(alpha: float, steps: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        accept_length_from_alpha(alpha, steps)


# ---- `specd observe` -----------------------------------------------------------------


def test_cli_json(server: PageServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.serve_sglang(page("dp2.prom"), info("server_info-dp2.json"))
    assert cli.main(["observe", "--url", server.url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["running"], out["queued"], out["offered"], out["dp_ranks"], out["steps"]) == (
        18,
        7,
        25,
        2,
        4,
    )


def test_cli_table(server: PageServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.serve_sglang(page("idle-stale.prom"), LOADED)
    assert cli.main(["observe", "--url", server.url]) == 0
    rows = dict(
        line.split(None, 1)
        for line in capsys.readouterr().out.splitlines()
        if not line.startswith(("alpha", "spec_fresh", "time"))
    )
    assert (rows["running"], rows["steps"], rows["accept_length"], rows["retracted_total"]) == (
        "0",
        "4",
        "3.610",
        "-",
    )


@pytest.mark.parametrize(
    ("argv", "code", "stderr"),
    [
        (
            ["--url", "{closed}"],
            1,
            "specd observe: refused: GET /metrics: cannot connect to http://127.0.0.1:",
        ),
        (["--url", "not a url"], 2, "invalid SGLang URL"),
        (
            ["--url", "http://127.0.0.1:1", "--timeout-s", "-1"],
            2,
            "must be > 0 and <= 300 s, got '-1'",
        ),
    ],
)
def test_cli_errors_in_a_real_process(argv: list[str], code: int, stderr: str) -> None:
    argv = [a.replace("{closed}", closed_port_url()) for a in argv]
    proc = run_specd("observe", *argv)
    assert proc.returncode == code
    assert stderr in proc.stderr
    assert proc.stdout == ""
    if code == 1:
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("declared", [True, False], ids=["content-encoding-gzip", "undeclared"])
def test_a_gzip_bomb_is_refused_undecoded(server: PageServer, declared: bool) -> None:
    """specd asks for identity, but httpx decoded whatever Content-Encoding came back, and
    the size cap counted decoded bytes: 662 bytes of nested gzip reached 632 MB, and 13 KB
    ended the scrape in a MemoryError. Now the raw bytes are what is capped and read."""
    bomb = gzip_bomb(256 << 20, layers=2)  # 256 MB of zeros in a few KB
    assert len(bomb) < 64 * 1024
    headers = (("Content-Encoding", "gzip, gzip"),) if declared else ()
    server.routes["/metrics"] = Route(body=bomb, headers=headers)
    tracemalloc.start()
    try:
        with SGLangClient(server.url, timeout_s=5) as client:
            result = client.observe()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(result, ScrapeError)
    assert result.kind == "malformed"
    assert ("Content-Encoding gzip, gzip" in result.reason) is declared, result.reason
    assert peak < 16 << 20, peak  # the compressed bytes and the client, never the 256 MB
