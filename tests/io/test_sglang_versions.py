"""The reader on every SGLang version's own pages (tests/fixtures/metrics/versions/, written
by each version's collector code): exact values, the live setting from the gauge or from
/server_info (/get_server_info before 0.5.6), "unknown" when neither says it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from factories import OLD_VERSIONS as OLD
from factories import StaticSGLang
from factories import version_page as page
from factories import version_server_info as server_info

from specd import cli
from specd.core.observation import Observation
from specd.io.sglang import ParsedMetrics, SGLangClient, observation_from, parse_metrics
from specd.twin.versions import VERSIONS


@pytest.fixture
def sglang(request: pytest.FixtureRequest) -> Iterator[StaticSGLang]:
    version, with_info = request.param
    server = StaticSGLang(version, with_info=with_info)
    try:
        yield server
    finally:
        server.close()


def _expected(version: str, which: str) -> dict[str, Any]:
    """What each page says (sglang_pages.py STATE / FRESH), as the reader must report it."""
    loaded = which == "loaded"
    return {
        "running": 13 if loaded else 0,
        "queued": 7 if loaded else 0,
        # The gauge; 0 (fresh: the warm-up fell short of a decode log interval) is no value.
        "accept_length": 3.61 if loaded else None,
        "token_usage": 0.82 if loaded else 0.0,
        "gen_throughput": 1510.0 if loaded else 0.0,
        "generation_tokens_total": 768.0 if loaded else 8.0,
        # realtime_tokens_total{mode="decode"} came after 0.5.4.
        "decode_tokens_total": None if version == "0.5.4" else (768.0 if loaded else 8.0),
        # spec_verify_calls_total came with 0.5.13: 70 + 141 verify steps, or the warm-up's 2.
        "spec_verify_calls_total": None if version in OLD else (211.0 if loaded else 2.0),
        "dp_ranks": 1,
    }


@pytest.mark.parametrize("which", ["loaded", "fresh"])
@pytest.mark.parametrize("version", VERSIONS)
def test_each_versions_page_is_read_exactly(version: str, which: str) -> None:
    parsed = parse_metrics(page(version, which))
    assert isinstance(parsed, ParsedMetrics), parsed
    obs = observation_from(parsed, server_info(version), t=5.0)
    for name, value in _expected(version, which).items():
        assert getattr(obs, name) == value, name
    assert (obs.steps, obs.draft_tokens, obs.topk, obs.algorithm) == (4, 5, 1, "EAGLE")
    # Capacity: the scheduler's effective limit (0.5.11+); 0.5.4 shows only the argument.
    assert obs.max_running_requests == (48 if version == "0.5.4" else 13)
    assert obs.version == version


@pytest.mark.parametrize("version", VERSIONS)
def test_without_server_info_old_versions_have_no_live_steps(version: str) -> None:
    parsed = parse_metrics(page(version))
    assert isinstance(parsed, ParsedMetrics), parsed
    obs = observation_from(parsed, None, t=5.0)
    # The gauges (0.5.13+) say the live setting; before, only /server_info knows it.
    assert (obs.steps, obs.draft_tokens) == ((None, None) if version in OLD else (4, 5))
    assert obs.max_running_requests is None
    assert obs.running == 13


# A fresh SGLang (its warm-up short of a decode log) shows spec_num_steps 0 while it runs 4
# steps: without /server_info that 0 is no step count (its verify steps say it drafts),
# where specd read it as 0 steps, a server running something else (a restart it did not
# make, a change to want). With /server_info, its step count (above).
@pytest.mark.parametrize("version", [v for v in VERSIONS if v not in OLD])
def test_a_fresh_servers_zero_step_gauge_is_no_step_count(version: str) -> None:
    parsed = parse_metrics(page(version, "fresh"))
    assert isinstance(parsed, ParsedMetrics), parsed
    assert (parsed.steps, parsed.draft_tokens, parsed.spec_verify_calls_total) == (0, 0, 2.0)
    obs = observation_from(parsed, None, t=5.0)
    assert (obs.steps, obs.draft_tokens) == (None, None)


@pytest.mark.parametrize("sglang", [(v, True) for v in VERSIONS], indirect=True, ids=list(VERSIONS))
def test_client_reads_each_version_over_http(sglang: StaticSGLang) -> None:
    version = sglang.version
    with SGLangClient(sglang.url, timeout_s=5) as client:
        assert client.info_path is None
        obs = client.observe()
        again = client.observe()
    assert isinstance(obs, Observation), obs
    # The endpoint that answered, for evidence that names it.
    assert client.info_path == ("/get_server_info" if version == "0.5.4" else "/server_info")
    assert isinstance(again, Observation), again
    assert (obs.steps, obs.running, obs.queued, obs.version) == (4, 13, 7, version)
    # /server_info once per start; 0.5.4 has only the old name (one 404 first, remembered).
    info_hits = [h for h in sglang.hits if h != "/metrics"]
    assert info_hits == (
        ["/server_info", "/get_server_info"] if version == "0.5.4" else ["/server_info"]
    )


@pytest.mark.parametrize(
    ("sglang", "steps"),
    [
        ((v, with_info), None if (v in OLD and not with_info) else "4")
        for v in VERSIONS
        for with_info in (True, False)
    ],
    indirect=["sglang"],
)
def test_specd_observe_json_on_each_version(
    sglang: StaticSGLang, steps: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["observe", "--url", sglang.url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["running"], out["queued"], out["accept_length"]) == (13, 7, 3.61)
    assert out["steps"] == (None if steps is None else int(steps))


def _decoded(text: str, tokens: float) -> str:
    """The page with its decode-token counter at ``tokens`` (pages before 0.5.11 have none)."""
    counter = re.compile(r'^(sglang:realtime_tokens_total\{[^}]*mode="decode"[^}]*\}) \S+$', re.M)
    return counter.sub(lambda m: f"{m.group(1)} {tokens!r}", text)


# SGLang before 0.5.2x logs an idle scheduler's stats only 30 s after its last log: its page
# still says the last batch runs. realtime_tokens_total moves with every forward pass
# (0.5.11+): standing still 5 s while requests "run", it is the last batch. specd counted it
# as load (and its zero throughput) for up to 30 s after every burst. 0.5.4 has no such
# counter: nothing tells. (seconds since the first scrape, decode tokens counted, running)
STALE_LOAD = [
    (0.0, 768.0, 13),
    (4.9, 768.0, 13),
    (5.0, 768.0, 0),
    (30.0, 768.0, 0),
    (31.0, 800.0, 13),  # a forward pass: running again
    (35.9, 800.0, 13),
    (36.0, 800.0, 0),
]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_running_gauge_no_forward_pass_moved_for_5_s_is_the_last_batchs(version: str) -> None:
    server = StaticSGLang(version)
    now = [1000.0]
    seen = []
    try:
        with SGLangClient(server.url, timeout_s=5.0, clock=lambda: now[0]) as client:
            for at, tokens, _ in STALE_LOAD:
                now[0] = 1000.0 + at
                server.routes["/metrics"] = _decoded(page(version), tokens).encode()
                obs = client.observe()
                assert isinstance(obs, Observation), obs
                seen.append((obs.running, obs.spec_fresh))
    finally:
        server.close()
    if version == "0.5.4":
        assert seen == [(13, True)] * len(STALE_LOAD)
    else:
        assert seen == [(running, running > 0) for _, _, running in STALE_LOAD]
