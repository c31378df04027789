from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from twin_thread import INSTANT, TwinThread

from specd import cli as specd_cli
from specd.core.observation import Observation
from specd.io.sglang import SGLangClient
from specd.io.tls import verifying_context
from specd.twin import cli as twin_cli
from specd.twin.launch import TwinConfigError, resolve
from specd.twin.preset import preset_table
from specd.twin.process import TwinProcess, free_port, stop_process
from specd.twin.server import Twin

REAL_PAGE = Path(__file__).parents[1] / "fixtures" / "twin" / "sglang-0.5.23-metrics-loaded.prom"
# Up at once, its scheduler reporting every 0.05 s: the load and warm-up timers are what a
# test of them sets. Twins whose process is not the point run in this process (TwinThread).
REPORT_S = 0.05
FAST = [*INSTANT, "--report-interval-s", str(REPORT_S)]
# Long enough for the twin's next reports after the last request (4 of them).
REPORTED_S = 4 * REPORT_S
SPEC4 = [
    "--speculative-algorithm",
    "NEXTN",
    "--speculative-num-steps",
    "4",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "5",
]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    twin_cli.configure(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "steps", "draft", "max_running", "warns"),
    [
        ([], 0, 0, 39, 0),  # no speculation: steps 0, capacity from the table
        (SPEC4, 4, 5, 13, 1),  # 48 by default for speculation, capacity 13 wins
        (
            [
                "--speculative-algorithm",
                "EAGLE",
                "--speculative-num-steps",
                "3",
                "--speculative-eagle-topk",
                "1",
                "--speculative-num-draft-tokens",
                "9",
                "--max-running-requests",
                "8",
            ],
            3,
            4,
            8,
            1,
        ),  # draft tokens forced to K+1
        (["--speculative-algorithm", "nextn"], 3, 4, 15, 1),  # SGLang's auto choice (3,1,4)
        (
            [
                *SPEC4,
                "--trust-remote-code",
                "--mem-fraction-static",
                "0.9",
                "--context-length",
                "262144",
                "--tool-call-parser",
                "qwen3",
            ],
            4,
            5,
            13,
            1,
        ),
    ],
)
def test_resolve_follows_sglang_rules(
    argv: list[str], steps: int, draft: int, max_running: int, warns: int
) -> None:
    config = resolve(_parse(argv), argv=["twin", *argv])
    assert (config.steps, config.draft_tokens, config.max_running) == (steps, draft, max_running)
    assert len(config.warnings) == warns


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"], "TypeError"),
        (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"], "AssertionError"),
        (["--speculative-algorithm", "NGRAM"], "not simulated"),
        ([*SPEC4[:3], "9", *SPEC4[4:]], "no data for steps 9"),
        (["--table", "/nonexistent.csv"], "cannot read"),
        (["--preset", "nope"], "unknown preset"),
        (["--max-running-requests", "0"], "must be >= 1"),
    ],
)
def test_resolve_rejects_what_sglang_rejects(argv: list[str], message: str) -> None:
    with pytest.raises(TwinConfigError, match=message) as info:
        resolve(_parse(argv))
    assert "\n" not in str(info.value)


def test_cli_exits_nonzero_with_one_line_error() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "specd.cli",
            "twin",
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-num-steps",
            "3",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("specd twin: error: TypeError")
    assert len(proc.stderr.strip().splitlines()) == 1


# SGLang reads its command line with argparse's parse_args over that version's options
# (specd/twin/sglang_args.py OPTIONS, from its own add_cli_args): an option it lacks is
# refused (exit 2) before anything starts, a flag it removed raises its ValueError (exit 1),
# a unique prefix is that option. The twin kept every word it did not know, and took an
# abbreviation of SGLang's for its own flag. (version, words, exit code, stderr's last line)
REFUSED_COMMAND_LINES = [
    pytest.param(
        "0.5.23",
        ["--mem-fraction-statik", "0.9"],
        2,
        "specd twin: error: unrecognized arguments: --mem-fraction-statik 0.9",
        id="typo",
    ),
    pytest.param(
        "0.5.4",
        ["--admin-api-key", "k"],
        2,
        "specd twin: error: unrecognized arguments: --admin-api-key k",
        id="newer-flag",
    ),
    pytest.param(
        "0.5.13",
        ["--enable-piecewise-cuda-graph"],
        1,
        "specd twin: error: ValueError: Deprecated: Piecewise cuda graph is enabled by default",
        id="removed-flag",
    ),
]


@pytest.mark.parametrize(("version", "words", "code", "says"), REFUSED_COMMAND_LINES)
def test_a_command_line_that_sglang_refuses_is_refused(
    version: str, words: list[str], code: int, says: str
) -> None:
    argv = [sys.executable, "-m", "specd.cli", "twin", "--sglang-version", version]
    argv += [*SPEC4, "--port", str(free_port()), *words]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == code
    assert proc.stderr.strip().splitlines()[-1].startswith(says)


# What SGLang takes, the twin takes the same way: an unambiguous prefix of an SGLang option
# (--gra is --grammar-backend), an alias of an option the twin models.
def test_a_command_line_that_sglang_takes_is_read_as_sglang_reads_it() -> None:
    args = _parse(["--gra", "xgrammar", "--attention-data-parallel-size", "2", "--tp-size", "2"])
    assert args.ignored_args == ["--grammar-backend", "xgrammar"]
    config = resolve(args)
    assert (config.args.dp_size, config.args.enable_dp_attention) == (2, True)
    assert Twin(config).server_arguments()["grammar_backend"] == "xgrammar"


def test_port_0_serves_on_a_free_port_it_announces(tmp_path: Path) -> None:
    """`--port 0` (allowed by --help): the twin listens on a port the system picks, warms
    up on it, reports it in /server_info and says it in its 'listening on' line."""
    log = tmp_path / "twin.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specd.cli", "twin", *SPEC4, *FAST, "--port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 20
        found = None
        while found is None and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+) ", log.read_text())
            time.sleep(0.05)
        assert found is not None, log.read_text()
        port = int(found.group(1))
        assert port != 0, log.read_text()
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=5, verify=verifying_context()
        ) as c:
            while time.monotonic() < deadline and proc.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    if c.get("/health").status_code == 200:
                        break
                time.sleep(0.05)
            assert c.get("/health").status_code == 200, log.read_text()
            assert c.get("/server_info").json()["port"] == port
        assert proc.poll() is None, log.read_text()
    finally:
        stop_process(proc)
    assert "ERROR" not in log.read_text(), log.read_text()


# -- hostile files: what --table and --speculative-adaptive-config name ----------------------
ADAPTIVE = [*SPEC4[:1], "EAGLE", *SPEC4[2:], "--speculative-adaptive"]


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "fifo")
    return tmp / "fifo"


def _sparse_300_mb(tmp: Path) -> Path:
    path = tmp / "huge"
    with open(path, "wb") as fh:
        fh.truncate(300 * 1024 * 1024)  # sparse: no disk, but 300 MB to read
    return path


def _long_field(tmp: Path) -> Path:
    path = tmp / "long.csv"
    path.write_text('steps,concurrency,output_tok_s\n1,1,"' + "9" * 200_000 + '"\n')
    return path


def _bom_table(tmp: Path) -> Path:
    path = tmp / "excel.csv"  # Excel's "CSV UTF-8" starts with a byte order mark
    path.write_bytes(b"\xef\xbb\xbfsteps,concurrency,output_tok_s\n1,1,100\n")
    return path


def _deep_json(tmp: Path) -> Path:
    path = tmp / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    return path


def _bad_json(tmp: Path) -> Path:
    path = tmp / "bad.json"
    path.write_text('{"1": {"candidate_steps": [1, 3]}\n,,}')
    return path


@pytest.mark.parametrize(
    ("flags", "make", "problem"),
    [
        (["--table"], _fifo, "{path}: is not a regular file (a FIFO)"),
        (["--table"], lambda tmp: Path("/dev/zero"), "{path}: is not a regular file (a character"),
        (["--table"], _sparse_300_mb, "{path}: is 300 MiB, larger than the 4 MiB allowed"),
        (["--table"], _long_field, "{path}:2: not a CSV row (field larger than field limit"),
        (
            ["--table"],
            _bom_table,
            "{path}: starts with a UTF-8 byte order mark (BOM); save the file as UTF-8 without BOM",
        ),
        (
            [*ADAPTIVE, "--speculative-adaptive-config"],
            _fifo,
            "{path}: is not a regular file (a FIFO)",
        ),
        (
            [*ADAPTIVE, "--speculative-adaptive-config"],
            lambda tmp: Path("/dev/zero"),
            "{path}: is not a regular file (a character device)",
        ),
        (
            [*ADAPTIVE, "--speculative-adaptive-config"],
            _sparse_300_mb,
            "{path}: is 300 MiB, larger than the 1 MiB allowed",
        ),
        (
            [*ADAPTIVE, "--speculative-adaptive-config"],
            _deep_json,
            "json.decoder.JSONDecodeError: {path}: invalid JSON: nested deeper than 64",
        ),
        (
            [*ADAPTIVE, "--speculative-adaptive-config"],
            _bad_json,
            "JSONDecodeError: {path}: invalid JSON: Expecting property name enclosed in double "
            "quotes: line 2",
        ),
        # 0.5.11 reads the file when the worker loads, and dies then (here at once).
        (
            [
                "--sglang-version",
                "0.5.11",
                *ADAPTIVE,
                "--disable-overlap-schedule",
                "--speculative-adaptive-config",
            ],
            _fifo,
            "[twin] ERROR: OSError: {path}: is not a regular file (a FIFO)",
        ),
    ],
    ids=[
        "table-fifo",
        "table-device",
        "table-300MB",
        "table-long-field",
        "table-bom",
        "adaptive-fifo",
        "adaptive-device",
        "adaptive-300MB",
        "adaptive-deep",
        "adaptive-bad-json",
        "adaptive-0.5.11-fifo",
    ],
)
def test_a_hostile_file_is_one_error_line_at_once(
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    make: Callable[[Path], Path],
    problem: str,
) -> None:
    """Never a hang on a FIFO or device, never a huge read, never a traceback: one line
    naming the file (and line), exit 1 as for any file the twin (or SGLang) cannot use."""
    path = make(tmp_path)
    argv = ["twin", *flags, str(path), "--load-time-s", "0", "--port", str(free_port())]
    started = time.monotonic()
    if path.is_fifo():
        # A FIFO could hang the read: a process of its own, killed after 30 s.
        proc = subprocess.run(
            [sys.executable, "-m", "specd.cli", *argv],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        code, stderr = proc.returncode, proc.stderr
    else:
        # `specd twin` in this process: the same command and exit code, without a start of
        # an interpreter (it sets SSL_CERT_FILE for itself: here for this test only).
        monkeypatch.setenv("SSL_CERT_FILE", os.environ.get("SSL_CERT_FILE", os.devnull))
        code = specd_cli.main(argv)
        stderr = capfd.readouterr().err
    assert time.monotonic() - started < 15
    assert code == 1, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert problem.format(path=path) in errors[0], errors[0]
    assert len(errors[0]) < 300, errors[0]


def _shape(text: str) -> dict[str, tuple[str, str, frozenset[frozenset[str]]]]:
    out = {}
    for fam in text_string_to_metric_families(text):
        keys = frozenset(frozenset(s.labels) for s in fam.samples)
        out[fam.name] = (fam.type, fam.documentation, keys)
    return out


def test_exposition_matches_real_sglang_page() -> None:
    # A 48-token KV pool: the twin's prefix cache evicts, as the real page's server had.
    with TwinThread([*SPEC4, "--enable-metrics", "--max-total-tokens", "48", *FAST]) as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 20})
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
            c.post("/v1/chat/completions", json={**chat, "stream": True})
            # A client that goes away mid-stream is an aborted request, as in SGLang.
            with c.stream(
                "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2000, "stream": True}
            ) as s:
                next(s.iter_lines())
            time.sleep(REPORTED_S)
            page = c.get("/metrics").text
    twin_shape, real_shape = _shape(page), _shape(REAL_PAGE.read_text())
    assert set(twin_shape) == set(real_shape)
    for name, (type_, help_, keys) in real_shape.items():
        assert twin_shape[name][:2] == (type_, help_), name
        if not name.startswith("sglang:http_"):
            assert twin_shape[name][2] == keys, name
    assert "_created" not in page
    for line in page.splitlines():
        if "{" in line and not line.startswith("#"):
            keys = [
                kv.split("=")[0] for kv in line[line.index("{") + 1 : line.index("}")].split('",')
            ]
            assert keys == sorted(keys), line


def test_dp_ranks_404_and_failure_injection() -> None:
    args = [
        *SPEC4,
        "--enable-metrics",
        "--dp-size",
        "2",
        "--tp-size",
        "4",
        "--server-info-missing",
        "speculative_num_steps,version",
        "--metrics-pad-bytes",
        "200000",
        *FAST,
    ]
    with TwinThread(args) as twin, TwinThread([*SPEC4, *FAST]) as plain:
        twin.wait_healthy(20)
        plain.wait_healthy(20)
        page = httpx.get(twin.url + "/metrics", timeout=10, verify=verifying_context()).text
        assert len(page) > 200_000
        fams = {f.name: f for f in text_string_to_metric_families(page)}
        ranks = sorted(s.labels["dp_rank"] for s in fams["sglang:num_running_reqs"].samples)
        assert ranks == ["0", "1"]
        info = httpx.get(twin.url + "/server_info", timeout=10, verify=verifying_context()).json()
        assert "speculative_num_steps" not in info
        assert "version" not in info
        assert len(info["internal_states"]) == 2
        assert (
            httpx.get(plain.url + "/metrics", timeout=10, verify=verifying_context()).status_code
            == 404
        )


@pytest.mark.parametrize("timeout_s", [0, 2])
def test_a_generation_that_never_comes_back_is_503_after_sglangs_wait(
    timeout_s: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's health_generate waits SGLANG_HEALTH_CHECK_TIMEOUT (20 s) for its token before
    it answers 503; the twin answered at once, so a prober whose timeout is shorter than
    that wait saw 503 from the twin and a timeout from SGLang."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", str(timeout_s))
    with TwinThread([*SPEC4, "--never-healthy", *FAST]) as twin:
        deadline = time.monotonic() + 20
        with httpx.Client(base_url=twin.url, timeout=10, verify=verifying_context()) as c:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if c.get("/v1/models").status_code == 200:
                        break
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(REPORTED_S)  # its warm-up is over
            for path in ("/health_generate", "/health"):
                started = time.monotonic()
                assert c.get(path).status_code == 503
                took = time.monotonic() - started
                assert timeout_s <= took < timeout_s + 1.5
            if timeout_s:
                with pytest.raises(httpx.ReadTimeout):
                    c.get("/health_generate", timeout=timeout_s / 2)


@pytest.mark.parametrize(
    ("flag", "check"),
    [
        ("--never-healthy", lambda c: c.get("/health").status_code == 503),
        ("--metrics-404", lambda c: c.get("/metrics").status_code == 404),
        ("--garbage-metrics", lambda c: "\x00" in c.get("/metrics").text),
    ],
)
def test_failure_flags(flag: str, check: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    with TwinThread([*SPEC4, "--enable-metrics", flag, *FAST]) as twin:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(twin.url + "/v1/models", timeout=2, verify=verifying_context())
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        time.sleep(REPORTED_S)  # its warm-up is over
        with httpx.Client(base_url=twin.url, timeout=10, verify=verifying_context()) as c:
            assert check(c)  # type: ignore[operator]


def test_fail_start_at_steps_exits_nonzero_during_load() -> None:
    twin = TwinProcess([*SPEC4, "--fail-start-at-steps", "2,4", "--load-time-s", "0.3"])
    assert twin.wait(20) == 1
    assert "failed to start with speculative_num_steps=4" in twin.log()
    twin.stop()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_restart_with_new_steps_closed_then_503_then_200() -> None:
    port = free_port()
    with TwinThread(
        [*SPEC4[:3], "3", *SPEC4[4:-1], "4", "--enable-metrics", *FAST], port=port
    ) as t:
        t.wait_healthy(20)
        assert (
            httpx.get(t.url + "/server_info", verify=verifying_context()).json()[
                "speculative_num_steps"
            ]
            == 3
        )
    assert not _port_open(port)
    seen: list[str] = []
    # Loading and warming up each last over ten probes' time (a probe every 0.05 s).
    args = [*SPEC4, "--enable-metrics", "--load-time-s", "0.6", "--warmup-s", "0.6"]
    # A decode log per batch: the warm-up's sets sglang:spec_num_steps (read below).
    args += ["--decode-log-interval", "1"]
    with TwinProcess(args, port=port) as twin:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                url = twin.url + "/health_generate"
                # SGLang answers a healthy server's probe after >= 1 s: not within 1 s.
                code = httpx.get(url, timeout=5, verify=verifying_context()).status_code
                state = str(code)
            except httpx.HTTPError:
                state = "closed"
            if not seen or seen[-1] != state:
                seen.append(state)
            if state == "200":
                break
            time.sleep(0.05)
        assert seen == ["closed", "503", "200"]
        assert (
            httpx.get(twin.url + "/server_info", verify=verifying_context()).json()[
                "speculative_num_steps"
            ]
            == 4
        )
        page = httpx.get(twin.url + "/metrics", verify=verifying_context()).text
        assert 'sglang:spec_num_steps{engine_type="unified"' in page
        steps = next(
            f for f in text_string_to_metric_families(page) if f.name == "sglang:spec_num_steps"
        )
        assert steps.samples[0].value == 4.0


def test_queueing_beyond_capacity_and_sigterm_drain() -> None:
    with TwinProcess([*SPEC4, "--max-running-requests", "2", "--enable-metrics", *FAST]) as twin:
        twin.wait_healthy(20)
        results: list[int] = []

        # Long enough (about 2.9 s a pair) that the drain outlasts the checks below on a
        # busy machine: at 300 tokens it ended before them after a 1.5 s stall of this test.
        def one() -> None:
            r = httpx.post(
                twin.url + "/v1/completions",
                json={"prompt": "p", "max_tokens": 800},
                timeout=30,
                verify=verifying_context(),
            )
            results.append(r.json()["usage"]["completion_tokens"])

        threads = [threading.Thread(target=one) for _ in range(4)]
        for th in threads:
            th.start()
        deadline = time.monotonic() + 10.0
        while True:
            loads = httpx.get(twin.url + "/v1/loads", verify=verifying_context()).json()["loads"][0]
            seen = (loads["num_running_reqs"], loads["num_waiting_reqs"])
            if seen == (2, 2) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert seen == (2, 2)
        twin.terminate()
        time.sleep(0.3)
        assert httpx.get(twin.url + "/health", verify=verifying_context()).status_code == 503
        # Still accepting while draining, like SGLang.
        # Queued behind the two waiting requests: served once they are.
        late = httpx.post(
            twin.url + "/v1/completions",
            json={"prompt": "p", "max_tokens": 5},
            timeout=30,
            verify=verifying_context(),
        )
        assert late.status_code == 200
        assert twin.poll() is None
        for th in threads:
            th.join(30)
        assert results == [800, 800, 800, 800]
        assert twin.wait(10) == 0


@pytest.mark.alone  # a rate: beside three other workers it measured the machine
@pytest.mark.parametrize("concurrency", [1, 4])
def test_streaming_throughput_matches_table(concurrency: int) -> None:
    expected = preset_table().throughput(4, concurrency)
    with TwinProcess([*SPEC4, *FAST]) as twin:
        twin.wait_healthy(20)
        tokens: list[int] = []
        barrier = threading.Barrier(concurrency + 1)
        # Usage only where asked for, as SGLang sends it: in a last chunk of its own.
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 250, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip

        def client() -> None:
            with httpx.Client(base_url=twin.url, timeout=30, verify=verifying_context()) as c:
                c.get("/v1/models")  # connection up before the clock starts
                barrier.wait()
                with c.stream("POST", "/v1/chat/completions", json=body) as s:
                    for line in s.iter_lines():
                        if line.startswith("data: {"):
                            usage = json.loads(line[6:]).get("usage")
                            if usage is not None:
                                tokens.append(usage["completion_tokens"])

        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for th in threads:
            th.start()
        barrier.wait()
        start = time.monotonic()
        for th in threads:
            th.join(30)
        measured = sum(tokens) / (time.monotonic() - start)
    assert tokens == [250] * concurrency
    assert measured == pytest.approx(expected, rel=0.10)


# SGLang's utils.should_include_usage: usage on every chunk with continuous_usage_stats
# (include_usage or not), in a last chunk of its own (no choices) with include_usage;
# otherwise every chunk's usage is null and no count comes at all.
@pytest.mark.parametrize(
    ("stream_options", "usage_on_every_chunk", "usage_chunk"),
    [
        ({}, False, False),
        ({"include_usage": True}, False, True),
        ({"continuous_usage_stats": True}, True, False),
        ({"include_usage": True, "continuous_usage_stats": True}, True, True),
    ],
)
def test_continuous_usage_stats_like_sglang(
    stream_options: dict[str, bool], usage_on_every_chunk: bool, usage_chunk: bool
) -> None:
    body = {"prompt": "hi", "max_tokens": 40, "stream": True, "stream_options": stream_options}
    with TwinThread([*SPEC4, *FAST]) as twin:
        twin.wait_healthy(20)
        with httpx.stream(
            "POST", twin.url + "/v1/completions", json=body, timeout=30, verify=verifying_context()
        ) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    content = [c for c in chunks if c["choices"]]
    tail = [c for c in chunks if not c["choices"]]
    assert chunks == content + tail  # the usage chunk last
    assert len(content) > 1
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    counts = [c["usage"]["completion_tokens"] for c in content if c["usage"] is not None]
    if usage_on_every_chunk:
        assert len(counts) == len(content)
        assert counts == sorted(counts)
        assert counts[-1] == 40
    else:
        assert counts == []
        assert all(c["usage"] is None for c in content)  # there, null
    if usage_chunk:
        assert [c["usage"]["completion_tokens"] for c in tail] == [40]
    else:
        assert tail == []


def test_a_streaming_client_that_hangs_up_is_no_error_in_the_twin_log() -> None:
    # Before: aiohttp logged "Error handling request" and a traceback for every one.
    bodies = {
        "/v1/completions": {"prompt": "x", "max_tokens": 5000, "stream": True},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 5000,
            "stream": True,
        },
        "/generate": {"text": "x", "sampling_params": {"max_new_tokens": 5000}, "stream": True},
    }
    with TwinProcess([*SPEC4, *FAST]) as twin:
        twin.wait_healthy(20)
        for path, body in bodies.items():
            # Leaving the block closes the connection mid-stream; the twin's next write fails.
            with (
                httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c,
                c.stream("POST", path, json=body) as s,
            ):
                assert next(line for line in s.iter_lines() if line.startswith("data:"))
        time.sleep(0.5)  # the twin's next writes to the gone clients fail (a batch ~13 ms)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as c:
            assert c.get("/health").status_code == 200
        log = twin.log()
    assert "Traceback" not in log, log[-3000:]
    assert "Error handling request" not in log, log[-3000:]


# A decode log every 10 decode batches: 100 tokens make several with and without
# speculation (28 verifies at 4 steps, 100 batches without).
@pytest.mark.parametrize(("argv", "has_accept"), [([], False), (SPEC4, True)])
def test_server_info_accept_length_only_with_speculation(argv: list[str], has_accept: bool) -> None:
    with TwinThread([*argv, *FAST, "--decode-log-interval", "10"]) as twin:
        twin.wait_healthy()
        httpx.post(
            twin.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 100},
            timeout=20,
            verify=verifying_context(),
        )
        time.sleep(REPORTED_S)  # a decode log
        states = httpx.get(
            twin.url + "/server_info", timeout=10, verify=verifying_context()
        ).json()["internal_states"]
        assert ("avg_spec_accept_length" in states[0]) is has_accept


# Each DP rank's scheduler gets max_running_requests // dp_size with DP attention (the ranks
# share one model) and the whole argument without it (each replica is a server of its own);
# memory (the table's 13 at 4 steps, the server's) is split among the ranks either way. So
# SGLang sizes it in every version (0.5.4's tp_worker, 0.5.8-0.5.11's model_runner, 0.5.23's
# kv_cache_configurator), and /server_info (0.5.8+) and /v1/loads report each rank's limit.
# The twin divided the argument among plain DP replicas too; specd read SGLang < 0.5.8's
# argument as the server's capacity, one replica's without DP attention.
# (version, flags, each rank's limit, /server_info's dp_size and attn_dp_size)
DP_CAPACITY: list[Any] = [
    pytest.param("0.5.23", ["--max-running-requests", "4"], [4, 4], (2, 1), id="0.5.23-replicas"),
    pytest.param(
        "0.5.23",
        ["--max-running-requests", "4", "--enable-dp-attention", "--tp-size", "2"],
        [2, 2],
        (1, 2),  # --dp-size 2 --enable-dp-attention resolves into --attn-dp-size 2
        id="0.5.23-dp-attention",
    ),
    pytest.param("0.5.23", [], [6, 6], (2, 1), id="0.5.23-replicas-memory-bound"),
    pytest.param(
        "0.5.11", ["--max-running-requests", "4"], [4, 4], (2, None), id="0.5.11-replicas"
    ),
    pytest.param("0.5.4", ["--max-running-requests", "4"], [4, 4], (2, None), id="0.5.4-replicas"),
    pytest.param(
        "0.5.4",
        ["--max-running-requests", "4", "--enable-dp-attention", "--tp-size", "2"],
        [2, 2],
        (2, None),
        id="0.5.4-dp-attention",
    ),
]


@pytest.mark.parametrize(("version", "flags", "shares", "sizes"), DP_CAPACITY)
def test_dp_ranks_run_what_sglang_gives_them_and_specd_reads_it(
    version: str, flags: list[str], shares: list[int], sizes: tuple[int, int | None]
) -> None:
    args = [*SPEC4, "--enable-metrics", "--dp-size", "2", "--sglang-version", version, *flags]
    with TwinThread([*args, *FAST]) as twin, contextlib.ExitStack() as streams:
        twin.wait_healthy(20)
        info = httpx.get(
            twin.url + "/get_server_info", timeout=10, verify=verifying_context()
        ).json()
        assert (info["dp_size"], info.get("attn_dp_size")) == sizes
        assert info["enable_dp_attention"] is ("--enable-dp-attention" in flags)
        states = info["internal_states"]
        assert len(states) == 2
        if version == "0.5.4":  # before 0.5.8: the argument only
            assert not any("effective_max_running_requests_per_dp" in st for st in states)
        else:
            assert [st["effective_max_running_requests_per_dp"] for st in states] == shares
            loads = httpx.get(
                twin.url + "/v1/loads", timeout=10, verify=verifying_context()
            ).json()["loads"]
            assert [ld["max_running_requests"] for ld in loads] == shares
        # 20 requests at once, far more than the ranks hold (open, never read: the twin
        # answers the headers once a request is in).
        load = httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context())
        streams.callback(load.close)
        body = {"prompt": "x", "max_tokens": 100_000, "stream": True}
        for _ in range(20):
            streams.enter_context(load.stream("POST", "/v1/completions", json=body))
        client = SGLangClient(twin.url, timeout_s=5.0)
        streams.callback(client.close)
        seen: list[int] = []
        capacities: set[int | None] = set()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (not seen or max(seen) < sum(shares)):
            result = client.observe()
            assert isinstance(result, Observation), result
            seen.append(result.running)
            capacities.add(result.max_running_requests)
            time.sleep(REPORT_S)
    assert max(seen) == sum(shares), seen  # full, and never past it
    assert capacities == {sum(shares)}  # what specd learns the server holds


# How each version lays out DP ranks (server_args._handle_data_parallelism before 0.5.23,
# parallel_hook in 0.5.23): (version, flags, DP ranks, attention DP, /server_info's
# dp_size, attn_dp_size, enable_dp_attention).
DP_LAYOUTS: list[Any] = [
    pytest.param("0.5.23", ["--attn-dp-size", "2"], 2, True, (1, 2, True), id="0.5.23-attn"),
    pytest.param(
        "0.5.23",
        ["--attn-dp-size", "2", "--enable-dp-attention"],
        2,
        True,
        (1, 2, True),
        id="0.5.23-attn-and-old-flag",
    ),
    pytest.param(
        "0.5.23",
        ["--dp-size", "2", "--enable-dp-attention"],
        2,
        True,
        (1, 2, True),
        id="0.5.23-old",
    ),
    pytest.param("0.5.23", ["--enable-dp-attention"], 1, False, (1, 1, False), id="0.5.23-dp1"),
    pytest.param("0.5.23", ["--dp-size", "2"], 2, False, (2, 1, False), id="0.5.23-replicas"),
    # Replicas are servers of their own, each with all --tp-size ranks: no need to divide.
    pytest.param("0.5.23", ["--dp-size", "3"], 3, False, (3, 1, False), id="0.5.23-3-replicas"),
    # Before 0.5.23 DP attention at --dp-size 1 is turned off (and /server_info says so).
    pytest.param("0.5.13", ["--enable-dp-attention"], 1, False, (1, None, False), id="0.5.13-dp1"),
    pytest.param(
        "0.5.4",
        ["--dp-size", "2", "--enable-dp-attention"],
        2,
        True,
        (2, None, True),
        id="0.5.4-attn",
    ),
]


@pytest.mark.parametrize(("version", "flags", "ranks", "attention", "shown"), DP_LAYOUTS)
def test_dp_layout_as_each_version_resolves_it(
    version: str,
    flags: list[str],
    ranks: int,
    attention: bool,
    shown: tuple[int, int | None, bool],
) -> None:
    cfg = resolve(_parse([*SPEC4, "--tp-size", "4", "--sglang-version", version, *flags]))
    assert (cfg.args.dp_size, cfg.args.enable_dp_attention) == (ranks, attention)
    assert cfg.load_error is None
    info = Twin(cfg).server_info_dict()
    assert (info["dp_size"], info.get("attn_dp_size"), info["enable_dp_attention"]) == shown
    assert len(info["internal_states"]) == ranks


@pytest.mark.parametrize(
    ("version", "flags", "message", "code"),
    [
        ("0.5.13", ["--attn-dp-size", "2"], "unrecognized arguments: --attn-dp-size 2", 2),
        ("0.5.4", ["--attn-dp-size", "1"], "unrecognized arguments: --attn-dp-size 1", 2),
        (
            "0.5.23",
            ["--attn-dp-size", "2", "--dp-size", "2"],
            "ValueError: --dp-size 2 with --attn-dp-size 2: data-parallel replicas combined",
            1,
        ),
        ("0.5.23", ["--attn-dp-size", "0"], "--attn-dp-size must be positive (got 0)", 1),
        # Attention DP groups split the TP ranks: SGLang asserts they divide them.
        ("0.5.23", ["--attn-dp-size", "3"], "AssertionError: tp_size % dp_size == 0", 1),
        ("0.5.13", ["--dp-size", "3", "--enable-dp-attention"], "AssertionError", 1),
        ("0.5.4", ["--dp-size", "3", "--enable-dp-attention"], "AssertionError", 1),
    ],
)
def test_dp_layouts_sglang_refuses(version: str, flags: list[str], message: str, code: int) -> None:
    with pytest.raises(TwinConfigError) as exc:
        resolve(_parse([*SPEC4, "--tp-size", "4", "--sglang-version", version, *flags]))
    assert message in str(exc.value)
    assert exc.value.exit_code == code


@pytest.mark.parametrize(
    ("version", "share", "error"),
    [
        ("0.5.4", 0, "AssertionError: max_running_request is zero"),
        ("0.5.11", 0, "AssertionError: max_running_request is zero"),
        ("0.5.13", 0, "AssertionError: max_running_request is zero"),
        ("0.5.23", 1, None),  # resolve_max_num_reqs: max(1, argument // attn_dp_size)
    ],
)
def test_one_request_among_two_attention_dp_groups(
    version: str, share: int, error: str | None
) -> None:
    argv = ["--max-running-requests", "1", "--dp-size", "2", "--enable-dp-attention"]
    cfg = resolve(_parse([*SPEC4, "--tp-size", "2", "--sglang-version", version, *argv]))
    assert cfg.max_running_per_rank == share
    assert cfg.load_error == error


def test_attn_dp_size_runs_attention_dp_groups_end_to_end() -> None:
    args = [*SPEC4, "--enable-metrics", "--tp-size", "4", "--attn-dp-size", "2", *FAST]
    with TwinThread(args) as twin:
        twin.wait_healthy(20)
        info = httpx.get(twin.url + "/server_info", timeout=10, verify=verifying_context()).json()
        page = httpx.get(twin.url + "/metrics", timeout=10, verify=verifying_context()).text
    assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (1, 2, True)
    assert [st["effective_max_running_requests_per_dp"] for st in info["internal_states"]] == [
        6,
        6,
    ]
    running = {
        (s.labels["dp_rank"], s.labels["tp_rank"])
        for fam in text_string_to_metric_families(page)
        for s in fam.samples
        if s.name == "sglang:num_running_reqs"
    }
    assert running == {("0", "0"), ("1", "2")}  # each group's first TP rank reports


def test_a_start_that_fails_for_a_zero_share_keeps_the_port_closed_and_exits_1() -> None:
    argv = ["--max-running-requests", "1", "--dp-size", "2", "--enable-dp-attention"]
    args = [*SPEC4, "--tp-size", "2", "--sglang-version", "0.5.13", *argv, *FAST]
    with TwinProcess(args) as twin:
        assert twin.proc.wait(20) == 1
        log = twin.log()
    assert "max_running_request is zero" in log


def _label_sets(page: str, name: str, keys: tuple[str, ...]) -> list[tuple[str, ...]]:
    return sorted(
        tuple(s.labels.get(k, "-") for k in keys)
        for fam in text_string_to_metric_families(page)
        for s in fam.samples
        if s.name == name
    )


# Who reports what under each DP layout at --tp-size 4, --dp-size 2 (SGLang's
# data_parallel_controller and its collectors' labels): the scheduler series come from each
# DP rank's first TP rank, tp_rank 0 of each replica without DP attention (replicas count
# their TP ranks from 0), 0 and 2 with it (slices of one TP group). Every TP rank runs its
# own radix cache: 0.5.23 labels it with the attention ranks under DP attention, else with
# its TP rank and dp_rank 0, so the replicas' series share label sets (multiprocess mode adds
# them up); before, cache_type alone.
# (version, flags, scheduler (dp_rank, tp_rank), radix (dp_rank, tp_rank))
REPORTERS: list[Any] = [
    pytest.param(
        "0.5.23",
        [],
        [("0", "0"), ("1", "0")],
        [("0", "0"), ("0", "1"), ("0", "2"), ("0", "3")],
        id="0.5.23-replicas",
    ),
    pytest.param(
        "0.5.23",
        ["--enable-dp-attention"],
        [("0", "0"), ("1", "2")],
        [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")],
        id="0.5.23-dp-attention",
    ),
    pytest.param("0.5.13", [], [("0", "0"), ("1", "0")], [("-", "-")], id="0.5.13-replicas"),
    pytest.param("0.5.4", ["--enable-dp-attention"], [("0", "0"), ("1", "2")], [], id="0.5.4-attn"),
]


@pytest.mark.parametrize(("version", "flags", "scheduler", "radix"), REPORTERS)
def test_dp_ranks_report_under_sglangs_labels_and_specd_sums_them(
    version: str,
    flags: list[str],
    scheduler: list[tuple[str, str]],
    radix: list[tuple[str, str]],
) -> None:
    args = [*SPEC4, "--enable-metrics", "--sglang-version", version, "--dp-size", "2"]
    args += ["--tp-size", "4", "--max-running-requests", "6", "--max-total-tokens", "2000"]
    args += [*flags, *FAST]
    body = {"prompt": "x", "max_tokens": 100_000, "stream": True}
    with TwinThread(args) as twin, contextlib.ExitStack() as streams:
        twin.wait_healthy(20)
        client = httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context())
        streams.callback(client.close)
        # Two 1000-token prompts per DP rank: the second needs the first's cached slots in
        # the 2000-token pool, so every rank's radix cache evicts (its series appear).
        for _ in range(4):
            client.post("/v1/completions", json={"prompt": "w " * 1000, "max_tokens": 1})
        for _ in range(14):  # more than the server runs: some queue
            # Open (the twin answers the headers once the request is in), never read.
            streams.enter_context(client.stream("POST", "/v1/completions", json=body))
        time.sleep(REPORTED_S)  # a report
        page = client.get("/metrics").text
        with SGLangClient(twin.url, timeout_s=5.0) as reader:
            obs = reader.observe()
    assert _label_sets(page, "sglang:num_running_reqs", ("dp_rank", "tp_rank")) == scheduler
    assert _label_sets(page, "sglang:evicted_tokens_total", ("dp_rank", "tp_rank")) == radix
    running = _label_sets(page, "sglang:num_running_reqs", ("dp_rank", "tp_rank"))
    assert len(running) == 2
    assert isinstance(obs, Observation), obs
    ranks_running = sum(
        s.value
        for fam in text_string_to_metric_families(page)
        for s in fam.samples
        if s.name == "sglang:num_running_reqs"
    )
    assert obs.dp_ranks == 2
    assert obs.running + obs.queued == 14
    assert obs.running == obs.max_running_requests  # 6 per replica, 6 over attention DP
    assert obs.running == ranks_running


# --enable-metrics-for-all-schedulers: every TP rank of a DP rank reports the batch they all
# run, so the page has tp x DP ranks' worth of series with the same counts. specd reads each
# DP rank once (its lowest TP rank), which summing every series or taking the lowest TP rank
# of the whole page would not: the ranks run 1 and 2 of the 3 requests.
# (version, flags, DP ranks, TP ranks per DP rank)
ALL_SCHEDULERS: list[Any] = [
    pytest.param("0.5.23", ["--enable-dp-attention"], 2, 2, id="0.5.23-dp-attention"),
    pytest.param("0.5.23", [], 2, 4, id="0.5.23-replicas"),
    pytest.param("0.5.13", ["--enable-dp-attention"], 2, 2, id="0.5.13-dp-attention"),
]


@pytest.mark.parametrize(("version", "flags", "dp", "width"), ALL_SCHEDULERS)
def test_every_tp_rank_reports_and_specd_reads_each_dp_rank_once(
    version: str, flags: list[str], dp: int, width: int
) -> None:
    args = [*SPEC4, "--enable-metrics", "--enable-metrics-for-all-schedulers", "--tp-size", "4"]
    # A decode log per batch: the accept length is reported within the test's 0.6 s.
    args += ["--dp-size", str(dp), "--sglang-version", version, "--decode-log-interval", "1"]
    args += [*flags, *FAST]
    body = {"prompt": "x", "max_tokens": 100_000, "stream": True}
    with TwinThread(args) as twin, contextlib.ExitStack() as streams:
        twin.wait_healthy(20)
        client = httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context())
        streams.callback(client.close)
        # Round robin after the warm-up's one chat completion (on DP rank 0): 2 on DP rank
        # 1, 1 on DP rank 0.
        for _ in range(3):
            streams.enter_context(client.stream("POST", "/v1/completions", json=body))
        time.sleep(REPORTED_S)  # a report
        page = client.get("/metrics").text
        info = client.get("/get_server_info").json()
        with SGLangClient(twin.url, timeout_s=5.0) as reader:
            obs = reader.observe()
            parsed = reader.last_page
    running = {
        (s.labels["dp_rank"], s.labels["tp_rank"]): s.value
        for fam in text_string_to_metric_families(page)
        for s in fam.samples
        if s.name == "sglang:num_running_reqs"
    }
    assert len(running) == dp * width  # every TP rank of every DP rank
    per_dp = {d: {v for (rank, _), v in running.items() if rank == d} for d, _ in running}
    assert per_dp == {"0": {1.0}, "1": {2.0}}  # the TP ranks of a DP rank agree
    assert isinstance(obs, Observation), obs
    assert (obs.running, obs.dp_ranks) == (3, dp)
    assert sum(running.values()) == 3 * width  # what adding up every series would say
    assert obs.accept_length is not None
    assert 1.0 < obs.accept_length <= 5.0
    # Every scheduler's pid is on its retracted-requests gauge, as /server_info lists them.
    assert parsed is not None
    if "scheduler_pids" in info:
        assert parsed.scheduler_pids == {str(p) for p in info["scheduler_pids"]}
    else:
        assert len(parsed.scheduler_pids) == dp * width


# Out of KV memory, SGLang pushes running requests back to the queue and counts each in
# sglang:num_retracted_requests_total, from every TP rank's scheduler (0.5.11+: gated on
# --enable-metrics alone): specd reads one TP rank's count, not their sum. 0.5.4 has no such
# counter. The twin never ran out of KV memory (its pool had no size to fill).
@pytest.mark.parametrize("version", ["0.5.23", "0.5.13", "0.5.4"])
def test_retractions_are_counted_on_every_tp_rank_and_read_once(version: str) -> None:
    args = [*SPEC4, "--enable-metrics", "--sglang-version", version, "--tp-size", "2"]
    args += ["--max-running-requests", "4", "--max-total-tokens", "150", *FAST]
    with TwinThread(args) as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=60, verify=verifying_context()) as client:
            body = {"prompt": "a b c", "max_tokens": 60}
            with ThreadPoolExecutor(4) as pool:  # 4 x 63 tokens: more than the pool holds
                done = list(pool.map(lambda _: client.post("/v1/completions", json=body), "abcd"))
            page = client.get("/metrics").text
        with SGLangClient(twin.url, timeout_s=5.0) as reader:
            obs = reader.observe()
    # Every request still finished: a retracted one waits, is prefilled again, goes on.
    assert [r.json()["usage"]["completion_tokens"] for r in done] == [60] * 4
    counted = _label_sets(page, "sglang:num_retracted_requests_total", ("tp_rank",))
    values = {
        s.labels["tp_rank"]: s.value
        for fam in text_string_to_metric_families(page)
        for s in fam.samples
        if s.name == "sglang:num_retracted_requests_total"
    }
    assert isinstance(obs, Observation), obs
    if version == "0.5.4":
        assert (counted, obs.retracted_total) == ([], None)
        return
    assert counted == [("0",), ("1",)]
    assert values["0"] == values["1"] >= 1
    assert obs.retracted_total == values["0"]
