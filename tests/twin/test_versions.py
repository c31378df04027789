"""The twin at each SGLang version: the same page shape as that version's own collectors
wrote (tests/fixtures/metrics/versions/), its endpoints, and SGLang's warm-up request."""

from __future__ import annotations

import argparse
import gzip
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import SPEC4_ARGS, version_server_info
from prometheus_client.parser import text_string_to_metric_families
from twin_thread import INSTANT, TwinThread

from specd.core.observation import Observation
from specd.io.sglang import STALE_LOAD_AFTER_S, SGLangClient
from specd.io.tls import verifying_context
from specd.twin import cli as twin_cli
from specd.twin import server as twin_server
from specd.twin.launch import TwinConfigError, resolve
from specd.twin.versions import VERSIONS

PAGES = Path(__file__).parents[1] / "fixtures" / "metrics" / "versions"
Shape = dict[str, tuple[str, str, frozenset[frozenset[str]]]]
# What these tests ask of a twin is its HTTP surface: each runs in this process (see
# tests/twin_thread.py), up at once, its scheduler reporting every 0.05 s.
REPORT_S = 0.05
FAST = (*INSTANT, "--report-interval-s", str(REPORT_S))
# Long enough for the twin's next reports after the last request (4 of them).
REPORTED_S = 4 * REPORT_S


def _twin(version: str, *extra: str) -> TwinThread:
    """A twin as SGLang ``version`` with metrics, NEXTN at 4 steps."""
    return TwinThread([*SPEC4_ARGS, "--enable-metrics", "--sglang-version", version, *FAST, *extra])


def _shape(text: str) -> Shape:
    return {
        fam.name: (fam.type, fam.documentation, frozenset(frozenset(s.labels) for s in fam.samples))
        for fam in text_string_to_metric_families(text)
    }


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    ]


def _total(text: str, name: str) -> float:
    return sum(v for _, v in _samples(text, name))


def test_every_version_has_pages_from_its_own_collectors() -> None:
    for version in VERSIONS:
        for which in ("loaded", "fresh"):
            assert (PAGES / f"sglang-{version}-{which}.prom").is_file(), (version, which)


@pytest.mark.parametrize("version", VERSIONS)
def test_twin_pages_have_the_families_types_and_labels_of_that_version(version: str) -> None:
    # A KV pool of 48 tokens: the loaded page has evicted from the prefix cache (the chat
    # request needs the warm-up's slots), as the loaded server of the pages had; the fresh
    # page has not yet.
    with _twin(version, "--max-total-tokens", "48") as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            fresh = c.get("/metrics").text
            c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 20})
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
            c.post("/v1/chat/completions", json={**chat, "stream": True})
            # An aborted request, as in the loaded page.
            with c.stream(
                "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2000, "stream": True}
            ) as s:
                next(s.iter_lines())
            time.sleep(REPORTED_S)
            loaded = c.get("/metrics").text
    for which, page in (("fresh", fresh), ("loaded", loaded)):
        real = _shape((PAGES / f"sglang-{version}-{which}.prom").read_text())
        ours = _shape(page)
        assert sorted(ours) == sorted(real), which
        for name, (type_, help_, keys) in real.items():
            assert ours[name] == (type_, help_, keys), (which, name)


def _scheduler_series(text: str) -> set[tuple[str, str, str | None]]:
    """(family, tp_rank, pass) of every scheduler series: which TP ranks have each family,
    and of the CUDA-graph passes which kind (the radix cache's are not the scheduler's)."""
    return {
        (fam.name, s.labels["tp_rank"], s.labels.get("mode") if "passes" in fam.name else None)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if "tp_rank" in s.labels and "cache_type" not in s.labels
    }


# Every TP rank's scheduler has a collector of its own; TP rank 0 reports the batch, or every
# rank with --enable-metrics-for-all-schedulers. The twin emitted TP rank 0's series only.
@pytest.mark.parametrize("all_schedulers", [False, True], ids=["tp2", "tp2-all"])
@pytest.mark.parametrize("version", VERSIONS)
def test_each_tp_rank_has_the_series_its_scheduler_emits(
    version: str, all_schedulers: bool
) -> None:
    flags = ["--enable-metrics-for-all-schedulers"] if all_schedulers else []
    with _twin(version, "--tp-size", "2", *flags) as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 20})
            time.sleep(REPORTED_S)
            page = c.get("/metrics").text
    name = f"sglang-{version}-loaded-tp2{'-all' if all_schedulers else ''}.prom"
    real = _scheduler_series((PAGES / name).read_text())
    assert {tp for _, tp, _ in real} == {"0", "1"}
    assert _scheduler_series(page) == real


@pytest.mark.parametrize("version", VERSIONS)
def test_a_fresh_twin_has_answered_sglangs_warmup_request(version: str) -> None:
    with _twin(version) as twin:
        twin.wait_healthy(20)
        page = httpx.get(twin.url + "/metrics", timeout=10, verify=verifying_context()).text
    # 8 tokens: where /model_info says the model understands images (0.5.11+), a chat
    # completion of a picture and "Describe the image." (3 words here); else a /generate of
    # "The capital city of France is" (6 words).
    assert _total(page, "sglang:num_requests_total") == 1
    assert _total(page, "sglang:generation_tokens_total") == 8
    assert _total(page, "sglang:prompt_tokens_total") == (6 if version == "0.5.4" else 3)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert _total(page, f"sglang:{hist}_count") == 1, hist
    assert _total(page, "sglang:inter_token_latency_seconds_count") == 7
    verify = _samples(page, "sglang:spec_verify_calls_total")
    if version in ("0.5.4", "0.5.11"):
        assert verify == []  # the counter came with 0.5.13
    else:
        assert _total(page, "sglang:spec_verify_calls_total") == 2  # 8 tokens at L ~ 3.6
    if version == "0.5.23":
        http = {
            (labels["endpoint"], labels["method"])
            for labels, _ in _samples(page, "sglang:http_requests_total")
        }
        warm_up = {("/model_info", "GET"), ("/v1/chat/completions", "POST"), ("/freeze_gc", "POST")}
        assert warm_up <= http
        assert ("/generate", "POST") not in http


# (version, warm-up requests with 2 DP ranks): a /generate sends one prompt per rank; the
# chat completion of a model that understands images (/model_info, 0.5.11+) is one request.
WARMUP_WITH_DP: list[Any] = [("0.5.4", 2), ("0.5.23", 1)]


@pytest.mark.parametrize(("version", "requests"), WARMUP_WITH_DP)
def test_warmup_with_dp_ranks(version: str, requests: int) -> None:
    with _twin(version, "--dp-size", "2") as twin:
        twin.wait_healthy(20)
        page = httpx.get(twin.url + "/metrics", timeout=10, verify=verifying_context()).text
    assert _total(page, "sglang:num_requests_total") == requests
    assert _total(page, "sglang:generation_tokens_total") == 8 * requests


def test_skip_server_warmup_leaves_the_request_series_out() -> None:
    with _twin("0.5.23", "--skip-server-warmup") as twin:
        twin.wait_healthy(20)
        page = httpx.get(twin.url + "/metrics", timeout=10, verify=verifying_context()).text
    assert _samples(page, "sglang:num_requests_total") == []


# (path, versions that answer it); the rest answer 404 like that SGLang would.
ENDPOINTS = [
    ("/get_server_info", set(VERSIONS)),
    ("/server_info", {"0.5.11", "0.5.13", "0.5.23"}),
    ("/ready", {"0.5.23"}),
    ("/v1/loads", {"0.5.11", "0.5.13", "0.5.23"}),
    ("/get_model_info", set(VERSIONS)),
    ("/model_info", {"0.5.11", "0.5.13", "0.5.23"}),
]


@pytest.mark.parametrize("version", VERSIONS)
def test_endpoints_and_reported_version(version: str) -> None:
    # A decode log per decode batch: the warm-up's set the step gauge (see below).
    with _twin(version, "--decode-log-interval", "1") as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=10, verify=verifying_context()) as c:
            for path, have in ENDPOINTS:
                assert c.get(path).status_code == (200 if version in have else 404), path
            info = c.get("/get_server_info").json()
            page = c.get("/metrics").text
    assert info["version"] == version
    assert info["speculative_num_steps"] == 4
    steps = _samples(page, "sglang:spec_num_steps")
    assert [v for _, v in steps] == ([] if version in ("0.5.4", "0.5.11") else [4.0])


def _value(page: str, name: str) -> float:
    (value,) = [v for _, v in _samples(page, name)]
    return value


# SGLang sets its throughput and speculative gauges at a decode log, every
# --decode-log-interval (40) decode batches: the warm-up's two leave them at 0, and one log
# per batch sets them at once. An idle scheduler logs again 30 s after its last log (0.5.23:
# at once when its running gauge is stale, with gen_throughput 0): until then the page shows
# its last batch. The twin set the step gauges at start and refreshed every gauge each second.
@pytest.mark.parametrize("version", ["0.5.13", "0.5.23"])
def test_gauges_change_when_that_versions_scheduler_logs(version: str) -> None:
    with _twin(version) as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            fresh = c.get("/metrics").text
            c.post("/v1/completions", json={"prompt": "p", "max_tokens": 300})  # ~80 batches
            time.sleep(REPORTED_S)  # reports of an idle scheduler
            idle = c.get("/metrics").text
    with _twin(version, "--decode-log-interval", "1") as twin:
        twin.wait_healthy(20)
        logged = httpx.get(twin.url + "/metrics", timeout=10, verify=verifying_context()).text
    for name in ("spec_num_steps", "spec_num_draft_tokens", "spec_accept_length"):
        assert _value(fresh, f"sglang:{name}") == 0.0, name
    assert (_value(logged, "sglang:spec_num_steps"), _value(idle, "sglang:spec_num_steps")) == (
        4.0,
        4.0,
    )
    assert _value(idle, "sglang:spec_accept_length") > 1.0
    if version == "0.5.23":
        assert _value(idle, "sglang:num_running_reqs") == 0.0
        assert _value(idle, "sglang:gen_throughput") == 0.0
    else:  # the last decode log's, for up to 30 s
        assert _value(idle, "sglang:num_running_reqs") == 1.0
        assert _value(idle, "sglang:gen_throughput") > 0.0


# What specd reads of an idle server that still shows its last batch (0.5.13) or not (0.5.23):
# the gauge at first (one page cannot tell), none running once no forward pass was counted
# for STALE_LOAD_AFTER_S. It read the 0.5.13 server as running one request for 30 s.
# The reader's clock is injected: STALE_LOAD_AFTER_S + 0.5 s pass between its two scrapes
# (an 0.5.13 scheduler logs again only 30 s after its last batch, an 0.5.23 one at once, so
# the page is the same seconds later).
@pytest.mark.parametrize(("version", "shown"), [("0.5.13", 1), ("0.5.23", 0)])
def test_specd_reads_no_load_from_an_idle_servers_last_batch(version: str, shown: int) -> None:
    now = [time.time()]
    with (
        _twin(version) as twin,
        SGLangClient(twin.url, timeout_s=5.0, clock=lambda: now[0]) as reader,
    ):
        twin.wait_healthy(20)
        httpx.post(
            twin.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 300},
            timeout=20,
            verify=verifying_context(),
        )
        time.sleep(REPORTED_S)  # reports of an idle scheduler
        first = reader.observe()
        now[0] += STALE_LOAD_AFTER_S + 0.5
        later = reader.observe()
        page = httpx.get(twin.url + "/metrics", timeout=10, verify=verifying_context()).text
    assert isinstance(first, Observation), first
    assert isinstance(later, Observation), later
    assert _value(page, "sglang:num_running_reqs") == shown
    assert (first.running, later.running, later.spec_fresh) == (shown, 0, False)


# SGLang's processes add the CPU time they used to sglang:process_cpu_seconds_total every 5 s
# from before the model loads (0.5.11+; the DP controller too, with several DP ranks), and
# 0.5.23's schedulers, polling without sleep, count their CPU and loop time on every TP
# rank. The twin left all of them at 0, and had no DP controller.
def test_cpu_counters_move_as_sglangs_monitors_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # The monitors' period (SGLang's 5 s) made short: the twin runs in this process. The
    # wait is three periods, and the schedulers' counts must show all but half a second of it.
    monitor_s, waited_s = 0.5, 1.5
    monkeypatch.setattr(twin_server, "CPU_MONITOR_S", monitor_s)
    with _twin("0.5.23", "--dp-size", "2", "--tp-size", "2") as twin:
        twin.wait_healthy(20)
        first = httpx.get(twin.url + "/metrics", timeout=10, verify=verifying_context()).text
        httpx.post(
            twin.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 100},
            timeout=20,
            verify=verifying_context(),
        )
        time.sleep(waited_s)
        later = httpx.get(twin.url + "/metrics", timeout=10, verify=verifying_context()).text
    used = {
        labels["component"]: value
        for labels, value in _samples(later, "sglang:process_cpu_seconds_total")
    }
    assert set(used) == {"tokenizer", "detokenizer", "data_parallel_controller"}
    assert _total(later, "sglang:process_cpu_seconds_total") > _total(
        first, "sglang:process_cpu_seconds_total"
    )
    scheduler = _samples(later, "sglang:scheduler_process_cpu_seconds_total")
    assert len(scheduler) == 4  # every TP rank of both replicas
    assert all(value > waited_s - 0.5 for _, value in scheduler)
    idle = [
        value
        for labels, value in _samples(later, "sglang:scheduler_stage_seconds_total")
        if labels["category"] == "idle"
    ]
    assert min(idle) > 1.0


@pytest.mark.parametrize(
    ("version", "meaning"),
    [
        ("0.5.4", "tokens"),  # before 0.5.11: L / draft tokens
        ("0.5.11", "drafts"),  # since: accepted drafts / proposed drafts = (L-1)/(D-1)
        ("0.5.23", "drafts"),
    ],
)
def test_accept_rate_gauge_means_what_that_version_meant(version: str, meaning: str) -> None:
    with _twin(version, "--accept-noise", "0") as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            c.post("/v1/completions", json={"prompt": "p", "max_tokens": 200})
            time.sleep(REPORTED_S)
            page = c.get("/metrics").text
    (length,) = [v for _, v in _samples(page, "sglang:spec_accept_length")]
    (got,) = [v for _, v in _samples(page, "sglang:spec_accept_rate")]
    assert length > 1.5  # speculation at 4 steps accepts well over one token
    assert got == pytest.approx(length / 5 if meaning == "tokens" else (length - 1) / 4)


def test_unknown_version_is_a_one_line_error() -> None:
    parser = argparse.ArgumentParser()
    twin_cli.configure(parser)
    with pytest.raises(TwinConfigError, match=r"--sglang-version '0\.4\.9' .*known: 0\.5\.4"):
        resolve(parser.parse_args(["--sglang-version", "0.4.9"]))


def _figures(info: dict[str, Any]) -> tuple[set[str], set[str], dict[str, Any]]:
    """What an internal state adds to the server arguments, what /server_info's top level
    adds to them, and the state's memory_usage."""
    state = info["internal_states"][0]
    return set(state) - set(info), set(info) - set(state), state["memory_usage"]


# A decode log every 10 decode batches (SGLang's 40 took 400 tokens a rank): the warm-up's
# two or three still make none, a 100-token request (~28 verifies at 4 steps) makes two.
DECODE_LOG_EVERY_10 = ("--decode-log-interval", "10")


def _decode_on_both_ranks(client: httpx.Client) -> None:
    """One 100-token request per DP rank (round robin), side by side: each rank runs decode
    logs (at DECODE_LOG_EVERY_10)."""
    body = {"prompt": "p", "max_tokens": 100}
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda _: client.post("/v1/completions", json=body), range(2)))
    assert [r.status_code for r in done] == [200, 200]


@pytest.mark.parametrize("version", VERSIONS)
def test_server_info_is_that_versions_arguments_top_level_and_internal_states(
    version: str,
) -> None:
    real = version_server_info(version)
    with _twin(version, "--dp-size", "2", *DECODE_LOG_EVERY_10) as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            fresh = c.get("/get_server_info").json()
            fresh_loads = c.get("/v1/loads")
            _decode_on_both_ranks(c)
            time.sleep(REPORTED_S)
            info = c.get("/get_server_info").json()
            loads = c.get("/v1/loads")
    # That SGLang's fields exactly: all its arguments, no twin flags, nothing newer.
    top = set(info) - {"scheduler_pids"}  # the DP controller's (0.5.23), with DP ranks
    assert sorted(top) == sorted(real)
    assert [sorted(st) for st in info["internal_states"]] == [
        sorted(real["internal_states"][0])
    ] * 2
    arguments = set(info) & set(info["internal_states"][0])
    for state in info["internal_states"]:
        # Each scheduler's state: its server arguments, then its own figures.
        assert {k: state[k] for k in arguments - {"startup_time"}} == {
            k: info[k] for k in arguments - {"startup_time"}
        }
    figures, _, memory = _figures(info)
    real_figures, _, real_memory = _figures(real)
    assert figures == real_figures
    assert sorted(memory) == sorted(real_memory)
    assert type(memory["graph"]) is type(real_memory["graph"])
    if isinstance(memory["graph"], dict):
        assert sorted(memory["graph"]) == sorted(real_memory["graph"])
    # The lifetime accept length is counted at decode logs: the warm-up's few decode
    # batches are none, so a fresh server has none yet.
    assert not any("avg_spec_accept_length" in st for st in fresh["internal_states"])
    if version != "0.5.4":  # /v1/loads since 0.5.8: the same lifetime figure, None before
        assert [ld.get("speculative") for ld in fresh_loads.json()["loads"]] == [None, None]
        assert all(ld["speculative"]["accept_length"] > 1 for ld in loads.json()["loads"])


HEALTH_GENERATION = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


def _timed_status(client: httpx.Client, path: str) -> tuple[int, float]:
    start = time.monotonic()
    status = client.get(path).status_code
    return status, time.monotonic() - start


@pytest.mark.parametrize(
    ("version", "env", "health_waits"),
    [
        # /health generates (SGLang's default) unless the variable says false; 0.5.4
        # has no such variable and always generates.
        ("0.5.23", {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true"}, True),
        ("0.5.23", {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}, False),
        ("0.5.23", {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}, False),
        ("0.5.23", {}, True),
        ("0.5.4", {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}, True),
    ],
)
def test_health_checks_take_sglangs_second(
    monkeypatch: pytest.MonkeyPatch, version: str, env: dict[str, str], health_waits: bool
) -> None:
    # SGLang's health_generate sends a 1-token generation, then sleeps a second before it
    # first looks for an answer: a healthy server answers 200 after >= 1 s, never sooner.
    # (The twin reads the variable as SGLang does, at each probe: here this process's.)
    monkeypatch.delenv(HEALTH_GENERATION, raising=False)  # tests/conftest.py sets it
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with TwinThread([*SPEC4_ARGS, "--sglang-version", version, *FAST]) as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            status, took = _timed_status(c, "/health_generate")
            assert status == 200
            assert took >= 1.0
            status, took = _timed_status(c, "/health")
            assert status == 200
            assert (took >= 1.0) is health_waits
            if version == "0.5.23":
                status, took = _timed_status(c, "/ready")  # no generation
                assert (status, took < 0.5) == (200, True)


# /model_info (/get_model_info) as each version's http_server builds it.
MODEL_INFO_KEYS = {
    "0.5.4": ["model_path", "tokenizer_path", "is_generation", "preferred_sampling_params",
              "weight_version"],
    "0.5.11": ["model_path", "tokenizer_path", "is_generation", "preferred_sampling_params",
               "weight_version", "has_image_understanding", "has_audio_understanding",
               "model_type", "architectures"],
    "0.5.23": ["model_path", "served_model_name", "tokenizer_path", "is_generation",
               "preferred_sampling_params", "weight_version", "load_format",
               "reasoning_parser", "tool_call_parser", "disaggregation_mode",
               "has_image_understanding", "has_audio_understanding", "model_type",
               "architectures"],
}  # fmt: skip
MODEL_INFO_KEYS["0.5.13"] = MODEL_INFO_KEYS["0.5.11"]


@pytest.mark.parametrize("version", VERSIONS)
def test_endpoints_answer_with_sglangs_json_and_fastapis_errors(version: str) -> None:
    with _twin(version) as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            model_info = c.get("/get_model_info").json()
            models = c.get("/v1/models").json()
            missing = c.get("/no/such/path")
            wrong_method = c.get("/v1/completions")
            head = c.head("/get_server_info")
            freeze = c.get("/freeze_gc")
            put = c.put("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
            bad = c.post(
                "/v1/completions", content=b"{", headers={"Content-Type": "application/json"}
            )
            page = c.get("/metrics").text
    assert list(model_info) == MODEL_INFO_KEYS[version]
    assert model_info["tokenizer_path"] == model_info["model_path"]
    assert list(models["data"][0]) == [
        "id", "object", "created", "owned_by", "root", "parent", "max_model_len"
    ]  # fmt: skip
    # FastAPI's answers: no route, a route without that method (GET routes answer no HEAD).
    assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
    assert (wrong_method.status_code, wrong_method.json()) == (
        405,
        {"detail": "Method Not Allowed"},
    )
    assert wrong_method.headers["Allow"] == "POST"
    assert head.status_code == 405
    assert (freeze.status_code, freeze.text) == (200, "Garbage collection frozen.\n")
    assert put.status_code == 200  # /generate is POST and PUT
    # SGLang's ErrorResponse for a body it cannot validate.
    assert bad.status_code == 400
    assert {k: bad.json()[k] for k in ("object", "type", "code")} == {
        "object": "error",
        "type": "Bad Request",
        "code": 400,
    }
    if version == "0.5.23":
        # SGLang's HTTP middleware labels an unrouted request with the path asked for.
        http = {
            (labels["endpoint"], labels["method"], labels["status_code"])
            for labels, _ in _samples(page, "sglang:http_responses_total")
        }
        assert ("/no/such/path", "GET", "404") in http
        assert ("/v1/completions", "GET", "405") in http


def test_metrics_off_is_fastapis_404() -> None:
    with TwinThread([*SPEC4_ARGS, *FAST]) as twin:
        twin.wait_healthy(20)
        response = httpx.get(twin.url + "/metrics", timeout=10, verify=verifying_context())
    assert (response.status_code, response.json()) == (404, {"detail": "Not Found"})


def _asgi_answer(text: str, method: str, query: bytes, headers: dict[str, str]) -> Any:
    """What prometheus_client's ASGI app (SGLang's /metrics route) answers over a registry
    holding the families of ``text``."""
    import asyncio  # noqa: PLC0415

    from prometheus_client import CollectorRegistry, make_asgi_app  # noqa: PLC0415

    families = list(text_string_to_metric_families(text))

    class Page:
        def collect(self) -> Any:
            return families

    registry = CollectorRegistry()
    registry.register(Page())
    app = make_asgi_app(registry=registry)
    scope = {
        "type": "http",
        "method": method,
        "path": "/",
        "query_string": query,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


PROMETHEUS_2_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
# (method, query, headers): what a Prometheus server, a curl and a browser send.
ASKS = [
    ("GET", b"", {"Accept": "*/*"}),
    ("GET", b"", {"Accept": PROMETHEUS_2_ACCEPT}),
    ("GET", b"", {"Accept": "text/plain;version=1.0.0;escaping=underscores"}),
    ("GET", b"", {"Accept-Encoding": "gzip"}),
    ("GET", b"name[]=sglang:num_running_reqs&name[]=sglang:gen_throughput", {}),
    ("POST", b"", {}),
]


def test_metrics_negotiates_like_prometheus_clients_asgi_app() -> None:
    with _twin("0.5.23") as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            plain = c.get("/metrics", headers={"Accept": "*/*"}).text
            prometheus_2 = c.get("/metrics", headers={"Accept": PROMETHEUS_2_ACCEPT})
            answers = []
            for method, query, headers in ASKS:
                response = c.request(
                    method,
                    "/metrics",
                    params=query.decode() or None,
                    headers={"Accept-Encoding": "identity", **headers},
                )
                answers.append((response.status_code, dict(response.headers), response.content))
    # OpenMetrics, as prometheus_client >= 0.23 writes SGLang's names there: the samples
    # with "_" for ":", HELP and TYPE as named (the example scrape config renames them back).
    assert prometheus_2.headers["Content-Type"].startswith("application/openmetrics-text")
    assert 'sglang_num_running_reqs{engine_type="unified"' in prometheus_2.text
    assert "# TYPE sglang:num_running_reqs gauge" in prometheus_2.text
    # SGLang's registry describes no names: name[] keeps nothing.
    assert answers[4][0] == 200
    assert answers[4][2] == b""
    for (method, query, headers), (status, got_headers, body) in zip(ASKS, answers, strict=True):
        want_status, want_headers, want = _asgi_answer(
            plain, method, query, {"Accept-Encoding": "identity", **headers}
        )
        assert status == want_status
        for name, value in want_headers.items():
            assert got_headers[name.decode().lower()] == value.decode(), (headers, name)
        # Another scrape, other values: the same families, names and series (but the HTTP
        # ones, which count these requests). httpx has undone the twin's gzip already.
        if b"Content-Encoding" in want_headers:
            want = gzip.decompress(want)
        assert _series_of(body) == _series_of(want), headers


def _series_of(body: bytes) -> list[str]:
    """The page's lines without their values (and without the HTTP families)."""
    return [
        line if line.startswith("#") else line.rsplit(" ", 1)[0]
        for line in body.decode().splitlines()
        if "sglang:http_" not in line and "sglang_http_" not in line
    ]


_CORE_0_5_13 = ["dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
                "num_used_tokens", "num_total_tokens", "max_total_num_tokens",
                "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
                "utilization"]  # fmt: skip
_SECTIONS = ["memory", "speculative", "disaggregation", "queues"]
# /v1/loads per version: (top-level keys, a rank's keys, its queues' keys).
LOADS_SHAPE: dict[str, tuple[list[str], list[str], list[str]]] = {
    "0.5.11": (
        ["timestamp", "version", "dp_rank_count", "loads", "aggregate"],
        ["dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens",
         "num_total_tokens", "max_total_num_tokens", "token_usage", "gen_throughput",
         "cache_hit_rate", "utilization", "max_running_requests", *_SECTIONS,
         "num_total_reqs"],
        ["waiting", "grammar", "paused", "retracted"],
    ),
    "0.5.13": (
        ["timestamp", "version", "loads"],
        [*_CORE_0_5_13, *_SECTIONS],
        ["waiting", "grammar", "paused", "retracted"],
    ),
    "0.5.23": (
        ["timestamp", "version", "accelerator", "num_accelerators", "loads"],
        ["timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs",
         "num_waiting_uncached_tokens", "num_used_tokens", "num_total_tokens",
         "num_active_tokens", "num_prealloc_ready_tokens", "max_total_num_tokens",
         "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
         "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us",
         "decode_moments", *_SECTIONS],
        ["waiting", "grammar", "paused", "retracted", "prealloc_ready"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("version", sorted(LOADS_SHAPE))
def test_v1_loads_is_that_versions_shape(version: str) -> None:
    top, rank_keys, queue_keys = LOADS_SHAPE[version]
    with _twin(version, "--dp-size", "2", *DECODE_LOG_EVERY_10) as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            _decode_on_both_ranks(c)
            time.sleep(REPORTED_S)
            body = c.get("/v1/loads").json()
            core = c.get("/v1/loads", params={"include": "core", "dp_rank": "1"}).json()
            bad = c.get("/v1/loads", params={"include": "nonsense"})
            prometheus = c.get("/v1/loads", params={"format": "prometheus"}).text
            page = c.get("/metrics").text
    assert list(body) == top
    assert [list(ld) for ld in body["loads"]] == [rank_keys] * 2
    assert [list(ld["queues"]) for ld in body["loads"]] == [queue_keys] * 2
    assert [ld["dp_rank"] for ld in body["loads"]] == [0, 1]
    assert [ld["dp_rank"] for ld in core["loads"]] == [1]
    assert not set(_SECTIONS) & set(core["loads"][0])
    assert 'sglang_num_running_reqs{dp_rank="0"}' in prometheus
    assert 'sglang_spec_accept_length{dp_rank="1"}' in prometheus
    if version == "0.5.11":
        assert bad.status_code == 200  # unknown sections were left out, no error
        assert body["aggregate"]["total_running_reqs"] == 0
        assert _samples(page, "sglang:get_loads_duration_seconds_count") == []
    else:
        assert (bad.status_code, bad.text) == (500, "Internal Server Error")
        # Every /v1/loads is timed, the failed one too.
        assert _total(page, "sglang:get_loads_duration_seconds_count") == 4


def _value(page: str, name: str, **labels: str) -> float:
    return sum(v for got, v in _samples(page, name) if labels.items() <= got.items())


def test_scheduler_counters_move_with_the_work_it_did() -> None:
    # What SGLang's scheduler counts per forward and per prefilled request moves with the
    # requests: one prefill pass (no CUDA graph) per admission, a decode pass (a graph replay)
    # per verify, prompt tokens as effective prefill input, each request's stages.
    with _twin("0.5.23", "--accept-noise", "0") as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            for tokens in (120, 80, 200):  # one after the other: admitted alone
                c.post("/v1/completions", json={"prompt": "a b c d", "max_tokens": tokens})
            time.sleep(REPORTED_S)
            page = c.get("/metrics").text
    requests = _total(page, "sglang:num_requests_total")  # the warm-up's and these 3
    assert requests == 4
    assert _value(page, "sglang:cuda_graph_passes_total", mode="prefill_none") == requests
    assert _value(page, "sglang:prefill_effective_tokens_total", mode="input") == _value(
        page, "sglang:realtime_tokens_total", mode="prefill_compute"
    )
    for stage in ("request_process", "prefill_forward"):
        assert _value(page, "sglang:per_stage_req_latency_seconds_count", stage=stage) == (
            _total(page, "sglang:queue_time_seconds_count")
        )
    verifies = _total(page, "sglang:spec_verify_calls_total")
    decode = _value(page, "sglang:cuda_graph_passes_total", mode="decode_cuda_graph")
    assert verifies > 50
    assert abs(decode - verifies) <= requests  # each request's last verify rounds up


def test_new_token_ratio_decays_while_busy_and_starts_over_when_idle() -> None:
    # SGLang's prefill log reports its NewTokenRatioTracker: 0.7 after an idle spell, a
    # (0.7 - 0.098) / 600 step lower per decode batch run since, never below 0.098.
    with _twin("0.5.23", "--accept-noise", "0") as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=30, verify=verifying_context()) as c:
            time.sleep(REPORTED_S)
            body = {"prompt": "p", "max_tokens": 3000, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as long:
                lines = long.iter_lines()
                next(lines)
                # Decode batches go by: ~38 at 4 steps, 0.038 off the ratio (0.01 would do).
                time.sleep(0.5)
                c.post("/v1/completions", json={"prompt": "q", "max_tokens": 2})
                busy = _value(c.get("/metrics").text, "sglang:new_token_ratio")
            time.sleep(REPORTED_S)  # the hung-up stream ends: the scheduler idles
            c.post("/v1/completions", json={"prompt": "r", "max_tokens": 2})
            fresh = _value(c.get("/metrics").text, "sglang:new_token_ratio")
    assert 0.098 <= busy < 0.69
    assert fresh == pytest.approx(0.7)


def test_context_length_given_is_the_servers_context() -> None:
    with _twin("0.5.23", "--context-length", "32768", "--mem-fraction-static", "0.85") as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            info = c.get("/server_info").json()
            models = c.get("/v1/models").json()
            page = c.get("/metrics").text
    assert (info["context_length"], info["mem_fraction_static"]) == (32768, 0.85)
    assert models["data"][0]["max_model_len"] == 32768
    assert _value(page, "sglang:context_len") == 32768
    assert info["max_req_input_len"] == min(32767, info["max_total_num_tokens"] - 1) - 5
