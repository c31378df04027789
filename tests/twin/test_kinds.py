"""The twin running each kind of setting, over real HTTP on 127.0.0.1: no speculation,
adaptive (tiers by batch size and by acceptance, capacity, startup), SGLang's refusals and
fallbacks, the fault knob, and the command lines specd renders for each kind."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from twin_kinds import SPEC, fast_table, write_config
from twin_thread import INSTANT, TwinThread

from specd.core import setting as specd_setting
from specd.io.tls import verifying_context
from specd.twin.process import TwinProcess

FIXTURES = Path(__file__).parents[1] / "fixtures" / "metrics"
# A decode log per decode batch: sglang:spec_num_steps follows the live tier from the
# warm-up on (at SGLang's 40 it reads 0 until the 40th batch). Up at once: the load and
# warm-up timers are what a test of them sets. The twins whose process is not the point
# (exit codes, the log) run in this process (TwinThread).
FAST = [*INSTANT, "--report-interval-s", "0.05", "--decode-log-interval", "1"]
QUIET = ["--accept-noise", "0"]


def _table(tmp_path: Path, **kwargs: object) -> str:
    accepts = kwargs.pop("accepts", {0: 1.0, 1: 1.8, 2: 2.5, 3: 3.1, 4: 3.6})
    path = tmp_path / "table.csv"
    path.write_text(fast_table(accepts, **kwargs))  # type: ignore[arg-type]
    return str(path)


def _samples(page: str, prefix: str = "sglang:") -> dict[str, float]:
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(page)
        for s in fam.samples
        if s.name.startswith(prefix)
    }


def _gauges(url: str) -> dict[str, float]:
    """One scrape's samples (one page parsed: a poll reads all it needs from it)."""
    return _samples(httpx.get(url + "/metrics", timeout=5, verify=verifying_context()).text)


def _gauge(url: str, name: str) -> float | None:
    return _gauges(url).get(name)


def _wait_for(check: object, timeout_s: float = 10.0, every_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(every_s)
    return False


@contextmanager
def _hold(url: str, n: int) -> Iterator[None]:
    """``n`` streaming requests running until the block ends (then the clients hang up)."""
    stop = threading.Event()
    started = threading.Barrier(n + 1, timeout=20)

    def client() -> None:
        # OpenAI chunks carry the new text only (/generate repeats all of it each time).
        body = {"prompt": "hi", "stream": True, "max_tokens": 10**6}
        with (
            httpx.Client(timeout=30, verify=verifying_context()) as c,
            c.stream("POST", url + "/v1/completions", json=body) as s,
        ):
            lines = s.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            started.wait()
            stop.wait(30)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    started.wait()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(10)


def _running(url: str) -> float | None:
    return _gauge(url, "sglang:num_running_reqs")


# -- no speculation -----------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.5.23", "0.5.13", "0.5.4"])
def test_off_serves_the_steps_0_row_and_shows_no_speculation(tmp_path: Path, version: str) -> None:
    table = _table(tmp_path)
    argv = ["--table", table, "--enable-metrics", "--sglang-version", version, *FAST]
    with TwinThread(argv) as twin:
        twin.wait_healthy()
        info_path = "/get_server_info" if version == "0.5.4" else "/server_info"
        info = httpx.get(twin.url + info_path, timeout=5, verify=verifying_context()).json()
        for key in ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                    "speculative_num_draft_tokens", "max_running_requests"):  # fmt: skip
            assert info[key] is None, key  # no reset of max_running_requests to 48 either
        assert ("speculative_adaptive" in info) is (version != "0.5.4")
        if version != "0.5.4":
            assert info["speculative_adaptive"] is False
        for state in info["internal_states"]:
            assert "avg_spec_accept_length" not in state
        if version != "0.5.4":
            assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 64
        # 400 tokens at the steps-0 row's 500 tok/s per request: 0.8 s (steps 1: 0.44 s).
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 400}}
        out = httpx.post(
            twin.url + "/generate", json=body, timeout=20, verify=verifying_context()
        ).json()
        assert out["meta_info"]["e2e_latency"] == pytest.approx(0.8, rel=0.15)
        # SGLang sends the draft figures only with speculation on.
        assert not [key for key in out["meta_info"] if key.startswith("spec_")]
        time.sleep(0.2)
        page = _samples(
            httpx.get(twin.url + "/metrics", timeout=5, verify=verifying_context()).text,
            "sglang:spec_",
        )
    # As SGLang's decode log without a draft worker: every spec gauge 0, and the verify
    # counter never created (it is only incremented with a verify count).
    expected = _samples((FIXTURES / "spec-off.prom").read_text(), "sglang:spec_")
    if version == "0.5.23":
        assert page == expected
    assert set(page.values()) == {0.0}
    assert "sglang:spec_verify_calls_total" not in page
    assert ("sglang:spec_num_steps" in page) is (version != "0.5.4")


# -- adaptive -------------------------------------------------------------------------------


def _adaptive(config: str, steps: int, version: str = "0.5.23") -> list[str]:
    return [*SPEC, "--speculative-num-steps", str(steps), "--speculative-num-draft-tokens",
            str(steps + 1), "--speculative-adaptive", "--speculative-adaptive-config", config,
            "--sglang-version", version, "--enable-metrics"]  # fmt: skip


def test_adaptive_tier_follows_batch_size_at_the_deepest_candidates_capacity(
    tmp_path: Path,
) -> None:
    # Single-candidate slots: the tier is the slot's. Capacity: 40 at steps 4 (the
    # deepest), more at the others.
    body = {"1": {"candidate_steps": [4]}, "8": {"candidate_steps": [2]},
            "32": {"candidate_steps": [1]}}  # fmt: skip
    config = write_config(tmp_path, body)
    table = _table(tmp_path, capacity={0: 64, 1: 60, 2: 50, 3: 45, 4: 40}, per_token_s=0.05)
    argv = [*_adaptive(config, 4), "--table", table, "--max-running-requests", "64", *FAST]
    with TwinThread(argv) as twin:
        twin.wait_healthy()
        info = httpx.get(twin.url + "/server_info", timeout=5, verify=verifying_context()).json()
        assert info["speculative_adaptive"] is True
        assert info["speculative_adaptive_config"] == config
        assert info["speculative_num_steps"] == 4
        assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 40
        loads = httpx.get(twin.url + "/v1/loads", timeout=5, verify=verifying_context()).json()[
            "loads"
        ]
        assert loads[0]["max_running_requests"] == 40
        for running, tier in ((1, 4), (8, 2), (31, 1)):  # 31 pads to 32
            with _hold(twin.url, running):
                assert _wait_for(
                    lambda running=running, tier=tier: (
                        (page := _gauges(twin.url)).get("sglang:num_running_reqs") == running
                        and page.get("sglang:spec_num_steps") == tier
                    )
                ), (running, tier, _gauge(twin.url, "sglang:spec_num_steps"))
                assert _gauge(twin.url, "sglang:spec_num_draft_tokens") == tier + 1
            assert _wait_for(lambda: _running(twin.url) == 0)


@pytest.mark.parametrize(("accept_3", "tier"), [(1.1, 1), (1.3, 3)])
def test_adaptive_tier_follows_acceptance_with_hysteresis(
    tmp_path: Path, accept_3: float, tier: int
) -> None:
    # 0.1 drafts at 3 sink the EMA below 1 - 0.5 - 0.25; 0.3 stay above it (hysteresis).
    config = write_config(tmp_path, {"1": {"candidate_steps": [1, 3]}})
    table = _table(tmp_path, accepts={1: 1.4, 3: accept_3})
    with TwinThread([*_adaptive(config, 3), "--table", table, *QUIET, *FAST]) as twin:
        twin.wait_healthy()
        with _hold(twin.url, 1):
            # About 300 verify batches a second: 60 decisions in a second.
            seen = set()
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                page = _gauges(twin.url)
                value = page.get("sglang:spec_num_steps")
                if page.get("sglang:num_running_reqs") == 1 and value is not None:
                    seen.add(value)
                time.sleep(0.1)
            assert _gauge(twin.url, "sglang:spec_num_steps") == tier
            assert seen <= {1.0, 3.0}


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_startup_grows_with_the_number_of_candidates(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"1": {"candidate_steps": [1, 2, 3, 4]}})
    # Both twins in this process (no interpreter to start): a graph set of 0.4 s stands
    # out of the jitter of two event loops starting (it was 1.0 s against two processes'),
    # and the bounds are the same shares of the 1.2 s the three more sets add.
    graph_s = 0.4
    slow = ["--load-time-s", "0.3", "--graph-set-s", str(graph_s), "--warmup-s", "0.1"]
    static = [*SPEC, "--speculative-num-steps", "4", "--speculative-num-draft-tokens", "5",
              "--enable-metrics"]  # fmt: skip
    t0 = time.monotonic()
    with TwinThread([*static, *slow]) as one, TwinThread([*_adaptive(config, 4), *slow]) as four:
        opened: dict[str, float] = {}
        while len(opened) < 2 and time.monotonic() - t0 < 20:
            for name, twin in (("static", one), ("adaptive", four)):
                if name not in opened and _port_open(twin.port):
                    opened[name] = time.monotonic() - t0
            time.sleep(0.02)
        # Three more graph sets.
        assert 2.2 * graph_s < opened["adaptive"] - opened["static"] < 4.0 * graph_s, opened
        for twin, load in ((one, 0.3), (four, 0.3 + 3 * graph_s)):
            twin.wait_healthy()
            page = httpx.get(twin.url + "/metrics", timeout=5, verify=verifying_context()).text
            phases = {
                (s.name, s.labels["phase"]): s.value
                for fam in text_string_to_metric_families(page)
                for s in fam.samples
                if s.name.startswith("sglang:startup_") and "phase" in s.labels
            }
            assert phases["sglang:startup_time_seconds", "tokenizer_e2e"] == pytest.approx(load)
            graphs = sum(v for (n, _), v in phases.items() if "cuda_graph" in n)
            assert graphs == pytest.approx(graph_s * (1 if twin is one else 4))


@pytest.mark.parametrize(
    ("version", "body", "extra", "code", "message", "loads"),
    [
        ("0.5.4", {"1": {"candidate_steps": [4]}}, [], 2,
         "specd twin: error: unrecognized arguments: --speculative-adaptive", False),
        ("0.5.23", {"1": {"candidate_steps": [-1]}}, [], 1,
         "specd twin: error: ValueError: BS 1: candidate_steps must be a list of "
         "non-negative ints, got [-1]", False),
        ("0.5.13", {"1": {"candidate_steps": [0, 4]}}, [], 1,
         "ValueError: BS 1: candidate_steps must be a list of positive ints, got [0, 4]", False),
        # 0.5.11 reads the file in the worker: the load runs, then the server dies.
        ("0.5.11", {"candidate_steps": [4]}, ["--disable-overlap-schedule"], 1,
         "AssertionError: candidate_steps must have at least 2 distinct values", True),
    ],
)  # fmt: skip
def test_a_config_sglang_refuses_is_fatal_and_never_listens(
    tmp_path: Path,
    version: str,
    body: object,
    extra: list[str],
    code: int,
    message: str,
    loads: bool,
) -> None:
    config = write_config(tmp_path, body)
    # Refused while the arguments resolve: long before a 30 s load could end.
    load = ["--load-time-s", "0.4" if loads else "30"]
    twin = TwinProcess([*_adaptive(config, 4, version), *extra, *load])
    t0 = time.monotonic()
    try:
        while twin.poll() is None and time.monotonic() - t0 < 15:
            assert not _port_open(twin.port)
            time.sleep(0.02)
        assert twin.poll() == code
        log = twin.log()
        assert message in log
        stage = "[twin] ERROR: " if loads else "specd twin: error: "
        assert f"{stage}{message.removeprefix('specd twin: error: ')}" in log
    finally:
        twin.stop()


@pytest.mark.parametrize(
    ("version", "extra", "reason"),
    [
        ("0.5.23", ["--enable-two-batch-overlap"], "enable_two_batch_overlap=True"),
        ("0.5.11", [], "the overlap scheduler (spec v2) is enabled"),
    ],
)
def test_quiet_fallback_runs_static_and_says_so_only_in_the_log(
    tmp_path: Path, version: str, extra: list[str], reason: str
) -> None:
    body = {"candidate_steps": [1, 4]} if version == "0.5.11" else {"1": {"candidate_steps": [1]}}
    config = write_config(tmp_path, body)
    with TwinProcess([*_adaptive(config, 4, version), *extra, *FAST]) as twin:
        twin.wait_healthy()
        info = httpx.get(twin.url + "/server_info", timeout=5, verify=verifying_context()).json()
        assert info["speculative_adaptive"] is False
        assert info["speculative_adaptive_config"] == config
        assert info["speculative_num_steps"] == 4
        # Capacity of static 4 (the preset: 13), not of the candidates.
        assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 13
        log = twin.log()
    assert f"WARNING speculative_adaptive disabled: {reason}" in log
    assert "Falling back to static speculative params." in log


# -- the fault knob -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["off", "static", "adaptive"])
def test_a_failed_setting_never_listens_and_exits_nonzero(tmp_path: Path, kind: str) -> None:
    config = write_config(tmp_path, {"1": {"candidate_steps": [3, 4]}})
    argv, name = {
        "off": ([], "off"),
        "static": (
            [*SPEC, "--speculative-num-steps", "4", "--speculative-num-draft-tokens", "5"],
            "4",
        ),
        "adaptive": (_adaptive(config, 4), "adaptive:3,4"),
    }[kind]
    twin = TwinProcess([*argv, "--fail-setting", name, *FAST])
    try:
        assert twin.wait(15) == 1
        assert f"failed to start with speculative_num_steps={0 if kind == 'off' else 4}" in (
            twin.log()
        )
        assert f"setting {name}" in twin.log()
        assert "listening" not in twin.log()
    finally:
        twin.stop()


# -- what specd renders -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "version", "extra", "runs"),
    [
        ("off", "0.5.23", [], True),
        ("4", "0.5.23", [], True),
        ("adaptive:3,4", "0.5.23", [], True),
        ("adaptive:1,3/1=1,3;8=0,1", "0.5.23", [], True),
        ("adaptive:3,4", "0.5.13", [], True),
        ("adaptive:3,4", "0.5.11", ["--disable-overlap-schedule"], True),
        # 0.5.11 runs adaptive only without the overlap scheduler, which specd does not turn off.
        ("adaptive:3,4", "0.5.11", [], False),
    ],
)
def test_the_twin_runs_the_command_line_specd_renders(
    tmp_path: Path, text: str, version: str, extra: list[str], runs: bool
) -> None:
    wanted = specd_setting.parse(text)
    slots = version not in ("0.5.11", "0.5.12")
    path = None
    if wanted.kind == "adaptive":
        path = str(tmp_path / specd_setting.adaptive_config_name(wanted, slots_supported=slots))
        Path(path).write_text(specd_setting.adaptive_config_text(wanted, slots_supported=slots))
    words = specd_setting.sglang_args(wanted, algorithm="NEXTN", config_path=path)
    argv = [*words, "--enable-metrics", "--sglang-version", version, *extra, *FAST]
    with TwinThread(argv) as twin:
        twin.wait_healthy()
        info_path = "/get_server_info" if version == "0.5.4" else "/server_info"
        info = httpx.get(twin.url + info_path, timeout=5, verify=verifying_context()).json()
        live = _gauge(twin.url, "sglang:spec_num_steps")
    problem = specd_setting.mismatch(wanted, info, None if live is None else int(live))
    if runs:
        assert problem is None
    else:
        assert problem is not None
        assert "adaptive mode off" in problem
