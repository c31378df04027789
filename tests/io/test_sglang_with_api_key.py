"""SGLang started with --api-key: specd's reader, applier and daemon against the twin, which
refuses what SGLang refuses without the key (/server_info, /v1/*; /metrics and /health*
are open). specd sent no key: it ran on without /server_info (asked again every tick, never
said), and a change restarted SGLang twice, verified neither time, and froze."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from pages import page_server
from test_apply import (
    ORIGINAL_ENV,
    Recorder,
    always_open,
    applier_for,
    make_unit,  # noqa: F401 - the fixture
)
from test_daemon import IN_WINDOW, Applier, config, daemon
from twin_thread import INSTANT, TwinThread

from specd.core.decide import Reason
from specd.core.observation import Observation, ScrapeError
from specd.io.sglang import SGLangClient

KEY = "s3cr3t-k3y-0123"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
SPEC3 = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]  # fmt: skip
FAST = [*INSTANT, "--report-interval-s", "0.2"]


def key_file(tmp_path: Path, key: str, name: str = "sglang.key") -> Path:
    path = tmp_path / name
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def keyed_twin() -> Any:
    with TwinThread([*SPEC3, "--enable-metrics", "--api-key", KEY, *FAST]) as twin:
        twin.wait_healthy(20)
        yield twin


@pytest.mark.parametrize(
    ("key", "says"),
    [
        (None, "GET /server_info: 401 Unauthorized (SGLang runs with --api-key: set [sglang] "
         "server_api_key_file)"),
        ("wrong", "GET /server_info: 401 Unauthorized (the key in {file} is not SGLang's "
         "--api-key)"),
        ("", "[sglang] server_api_key_file {file}: empty"),
    ],
)  # fmt: skip
def test_a_refused_or_missing_key_fails_the_scrape_and_names_the_setting(
    keyed_twin: Any, tmp_path: Path, key: str | None, says: str
) -> None:
    path = None if key is None else key_file(tmp_path, key)
    with SGLangClient(keyed_twin.url, timeout_s=5, api_key=path) as client:
        for _ in range(2):  # and again at the next scrape, with the same words
            result = client.observe()
            assert isinstance(result, ScrapeError), result
            assert result.kind == "api_key"
            assert says.format(file=path) in result.reason, result.reason
            assert KEY not in result.reason


def test_the_key_from_its_file_reads_everything_and_is_never_shown(
    keyed_twin: Any, tmp_path: Path
) -> None:
    path = key_file(tmp_path, "rotated-away")
    with SGLangClient(keyed_twin.url, timeout_s=5, api_key=path) as client:
        assert isinstance(client.observe(), ScrapeError)
        key_file(tmp_path, KEY)  # rotated in place: read at the next request, no reload
        obs = client.observe()
    assert isinstance(obs, Observation), obs
    assert obs.steps == 3
    assert obs.version is not None
    assert obs.max_running_requests is not None
    assert obs.launch_command is not None
    assert KEY not in obs.launch_command
    assert "--api-key ***" in obs.launch_command


@pytest.mark.parametrize("with_key", [False, True])
def test_a_pin_applied_now_is_not_restarted_into_what_it_cannot_verify(
    make_unit: Any,  # noqa: F811 - the fixture
    tmp_path: Path,
    with_key: bool,
) -> None:
    unit = make_unit(ORIGINAL_ENV, lambda steps: ["--api-key", KEY])
    path = key_file(tmp_path, KEY) if with_key else None
    applier = applier_for(unit, Recorder(tmp_path / "journal.json"))
    applier.client = SGLangClient(unit.url, timeout_s=3.0, api_key=path)
    outcome = applier.apply(4, 3, window_open=always_open, force=True)
    if with_key:
        assert outcome.result == "success", outcome.message
        assert unit.restarts == [4]
        return
    assert outcome.result == "aborted", outcome.message
    assert outcome.message.endswith(
        "cannot verify a restart: GET /server_info: 401 Unauthorized (SGLang runs with "
        "--api-key: set [sglang] server_api_key_file)"
    ), outcome.message
    assert unit.restarts == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV


def test_the_daemon_decides_nothing_without_the_key_and_counts_it(
    keyed_twin: Any, tmp_path: Path
) -> None:
    cfg = config(tmp_path)
    clock = [IN_WINDOW]
    applier = Applier()
    with SGLangClient(keyed_twin.url, timeout_s=5, clock=lambda: clock[0]) as client:
        d = daemon(cfg, client, applier, clock)  # type: ignore[arg-type]
        decision = d.tick()
    assert decision.reason is Reason.NO_DATA, decision.message
    assert "set [sglang] server_api_key_file" in decision.message
    assert applier.calls == []
    errors = d.metrics.registry.get_sample_value("specd_scrape_errors_total", {"kind": "api_key"})
    assert errors == 1


def test_only_one_request_per_scrape_is_refused(keyed_twin: Any) -> None:
    # /metrics answers (exempt), /server_info refuses: no fallback to /get_server_info.
    seen: list[str] = []
    lock = threading.Lock()
    with SGLangClient(keyed_twin.url, timeout_s=5) as client:
        original = client._http.send

        def counting(request: Any, **kw: Any) -> Any:
            with lock:
                seen.append(request.url.path)
            return original(request, **kw)

        client._http.send = counting  # type: ignore[method-assign]
        client.observe()
    assert seen == ["/metrics", "/server_info"]


def test_the_key_goes_only_where_sglang_asks_for_it(tmp_path: Path) -> None:
    """The key was sent with every scrape of /metrics, which SGLang never asks a key for:
    whoever bound SGLang's port while it was down (a restart's load, a crash) got it every
    few seconds. It goes with /server_info alone now, once per SGLang start."""
    metrics = (FIXTURES / "sglang-0.5.23-loaded.prom").read_text()
    info = json.loads((FIXTURES / "server_info-loaded.json").read_text())
    with page_server() as server:
        server.serve_sglang(metrics, info)
        with SGLangClient(server.url, timeout_s=5, api_key=key_file(tmp_path, KEY)) as client:
            for _ in range(3):
                assert isinstance(client.observe(), Observation)
            assert isinstance(client.server_info(), dict)  # as a restart's verification
            assert isinstance(client.observe(), Observation)
    sent = server.authorizations
    assert [path for path, _ in sent].count("/metrics") == 4, sent
    assert {auth for path, auth in sent if path == "/metrics"} == {None}, sent
    assert {auth for path, auth in sent if path == "/server_info"} == {f"Bearer {KEY}"}, sent
    assert [path for path, _ in sent].count("/server_info") == 2, sent
