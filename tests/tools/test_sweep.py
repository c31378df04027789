"""`specd sweep` end to end against the SGLang twin (restarted by TwinUnitRunner), plus its
pure parts. Real processes, real HTTP on 127.0.0.1, real files and signals."""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import json
import os
import shlex
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import make_observation, tables
from in_process import specd_main as in_process

from specd.commands import override as override_cmd
from specd.commands import sweep as sweep_cmd
from specd.core.adaptive import AdaptiveModel
from specd.core.model import Calibration, PerformanceModel, adaptive_slots
from specd.core.observation import Observation
from specd.core.setting import adaptive_config_text, sglang_args, static
from specd.core.setting import parse as parse_setting
from specd.core.settings import DEFAULT_ADAPTIVE_SETS
from specd.io.apply import read_env_steps
from specd.io.config import Config
from specd.io.state import STATE_FILE, State, read_json
from specd.io.tables import read_table
from specd.tools import sweep as sw
from specd.twin.preset import preset_table
from specd.twin.process import free_port
from specd.twin.unit import DEFAULT_STEPS, ENV_ARGS, TwinUnitRunner, twin_unit_config

REPO = Path(__file__).resolve().parents[2]
TWIN_ARGS = ["--load-time-s", "0.2", "--warmup-s", "0.1", "--report-interval-s", "0.2"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TOLERANCE = 0.10


def make_config(workdir: Path, port: int, **overrides: Any) -> Config:
    settings: dict[str, Any] = {
        "quiet_deadline_s": 2.0,
        "startup_timeout_s": 20.0,
        "metrics_port": free_port(),
        "min_steps": 1,
        "max_steps": 6,
        **overrides,
    }
    return twin_unit_config(workdir, port, **tables(**settings))


class Unit:
    """The twin as a systemd unit, and the config that points specd at it. ``defaults``:
    the drop-in's Environment= defaults (None: the twin unit's own)."""

    def __init__(
        self,
        workdir: Path,
        extra_args: list[str],
        defaults: dict[str, str] | None = None,
        **config: Any,
    ) -> None:
        (workdir / "state").mkdir()
        port = free_port()
        self.config = make_config(workdir, port, **config)
        self.runner = TwinUnitRunner(
            self.config.sglang.unit,
            Path(self.config.sglang.env_file),
            port=port,
            defaults=defaults,
            extra_args=extra_args,
        )
        self.url = self.config.sglang.url

    def live_steps(self) -> int:
        info = httpx.get(self.url + "/server_info", timeout=5).json()
        return int(info["speculative_num_steps"])


@pytest.fixture
def unit_factory(tmp_path: Path) -> Iterator[Any]:
    units: list[Unit] = []

    def make(extra_args: list[str] = (), **config: Any) -> Unit:
        unit = Unit(tmp_path, [*TWIN_ARGS, *extra_args], **config)
        units.append(unit)
        unit.runner.start().wait_healthy(30)
        return unit

    yield make
    for unit in units:
        unit.runner.stop()


class Recorder(sw.Reporter):
    def __init__(self) -> None:
        self.phases: list[str] = []
        self.messages: list[str] = []
        self.on_phase: Any = None

    def phase(self, text: str) -> None:
        self.phases.append(text)
        if self.on_phase is not None:
            self.on_phase(text)

    def message(self, text: str) -> None:
        self.messages.append(text)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# -- against the twin ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("twin_args", "adaptive", "why"),
    [
        (
            # DP attention runs only across two or more ranks (SGLang 0.5.23 reads
            # --enable-dp-attention at dp_size 1 as attention DP off, as the twin does),
            # each a share of the TP ranks.
            ["--dp-size", "2", "--enable-dp-attention", "--tp-size", "2"],
            "adaptive:3,4",
            "--adaptive: this server cannot run SGLang's adaptive mode: SGLang's adaptive mode "
            "does not run with DP attention",
        ),
        (
            ["--sglang-version", "0.5.13"],
            "adaptive:1,3/1=1,3;8=0,1",
            "--adaptive adaptive:1,3/1=1,3;8=0,1: this server cannot run it: step 0 in a slot "
            "need SGLang >= 0.5.14; the server runs 0.5.13",
        ),
    ],
    ids=["dp-attention", "slot-zero-on-0.5.13"],
)
def test_an_adaptive_set_the_server_cannot_run_is_refused_before_any_restart(
    unit_factory: Any, tmp_path: Path, twin_args: list[str], adaptive: str, why: str
) -> None:
    unit = unit_factory(twin_args)
    plan = sw.SweepPlan(steps=(4,), concurrency=(1,), duration_s=1.0, adaptive=(adaptive,))
    with pytest.raises(sw.SweepError) as info:
        sw.sweep(unit.config, plan, tmp_path / "out", runner=unit.runner, reporter=Recorder())
    assert str(info.value) == why
    assert unit.runner.restarted_to == []
    assert not Path(unit.config.sglang.env_file).exists()
    assert not (tmp_path / "out").exists()


@pytest.fixture
def started_with(tmp_path: Path) -> Iterator[Any]:
    """A twin unit whose drop-in default runs the given speculative words (the setting
    form, as `specd install` writes it), and the config for it."""
    runners: list[TwinUnitRunner] = []

    def start(words: list[str], **config: Any) -> tuple[Config, TwinUnitRunner]:
        (tmp_path / "state").mkdir()
        port = free_port()
        cfg = make_config(tmp_path, port, **config)
        runner = TwinUnitRunner(
            cfg.sglang.unit,
            Path(cfg.sglang.env_file),
            port=port,
            defaults={ENV_ARGS: " ".join(words)},
            extra_args=TWIN_ARGS,
        )
        runners.append(runner)
        runner.start().wait_healthy(30)
        return cfg, runner

    yield start
    for runner in runners:
        runner.stop()


def test_a_sweep_of_a_server_running_adaptive_is_refused(started_with: Any, tmp_path: Path) -> None:
    # The sweep can only put back what it can name: off or a static K.
    setting = parse_setting("adaptive:3,4")
    (tmp_path / "a.json").write_text(adaptive_config_text(setting))
    words = sglang_args(setting, algorithm="NEXTN", config_path=str(tmp_path / "a.json"))
    config, runner = started_with(list(words))
    plan = sw.SweepPlan(steps=(4,), concurrency=(1,), duration_s=1.0)
    with pytest.raises(sw.SweepError, match=r"^SGLang runs adaptive \(a.json\); the sweep"):
        sw.sweep(config, plan, tmp_path / "out", runner=runner, reporter=Recorder())
    assert runner.restarted_to == []


def test_the_cli_stops_on_sigint_restores_and_exits_130(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "specd.cli", "sweep", "--twin", "--yes", "--steps", "4",
            "--concurrency", "1", "--duration-s", "30", "--warmup-s", "0",
            "--out", str(out)]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "measuring c=1" in line:
                break
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert time.monotonic() - started < 25  # the 30 s point was cut short
    assert "restored: SGLang runs 3 steps again" in stderr
    report = json.loads((out / sw.JSON_NAME).read_text())
    assert report["interrupted_by"] == "SIGINT"
    assert report["restored"] is True
    assert report["final_steps"] == DEFAULT_STEPS
    assert str(out / sw.JSON_NAME) in stdout


CLI_REFUSALS = [
    ([], "no terminal to ask; pass --yes"),
    (["--steps", "9"], "outside the configured range 1..6"),
    (["--concurrency", "1,x"], "expected a whole number in 1..4096"),
    (["--duration-s", "nan"], "expected a number > 0"),
    (["--adaptive", "4"], "--adaptive: '4' is not an adaptive set"),
    (["--adaptive", "fast"], "--adaptive: setting 'fast' is not"),
    (
        ["--adaptive", "adaptive:3,9"],
        "--adaptive adaptive:3,9: candidates outside the configured range 1..6 "
        "(min_steps/max_steps), and not one of [choose] adaptive_candidate_sets",
    ),
]


@pytest.mark.parametrize(
    ("adaptive", "max_steps", "refused"),
    [
        # [choose] adaptive_candidate_sets' default (bare --adaptive): SGLang's own set goes
        # to 7, past max_steps 6, and the daemon may choose it: a sweep may measure it (it
        # was refused, the one set no sweep could calibrate).
        pytest.param(DEFAULT_ADAPTIVE_SETS, 6, False, id="the-listed-sets"),
        pytest.param(("adaptive:3,4",), 4, False, id="within-the-range"),
        pytest.param(("adaptive:3,5",), 4, True, id="unlisted-past-the-range"),
        pytest.param(("adaptive:1,3,5,7",), 6, True, id="unlisted-and-other-slots"),
    ],
)
def test_a_sweep_measures_what_the_policy_may_choose(
    adaptive: tuple[str, ...], max_steps: int, refused: bool
) -> None:
    config = Config(choose={"max_steps": max_steps})
    plan = sw.SweepPlan(steps=(3,), concurrency=(1,), duration_s=1.0, adaptive=adaptive)
    if refused:
        with pytest.raises(sw.SweepError, match="not one of \\[choose\\] adaptive_candidate_sets"):
            sw.check_plan(plan, config)
    else:
        sw.check_plan(plan, config)


def _sweep_cli(argv: list[str], *, real: bool) -> subprocess.CompletedProcess[str]:
    """`specd sweep ARGV` with stdin from /dev/null: a real process, or `specd.cli.main` in
    this one (its return, or argparse's SystemExit, as the exit code; what it printed).
    Every refusal here comes before the command starts logging or a child."""
    command = [sys.executable, "-m", "specd.cli", "sweep", *argv]
    if real:
        return subprocess.run(
            command,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    stdin = sys.stdin
    with open(os.devnull, encoding="utf-8") as devnull:
        sys.stdin = devnull
        try:
            return in_process("sweep", *argv)
        finally:
            sys.stdin = stdin


@pytest.mark.parametrize(("extra", "needle"), CLI_REFUSALS)
def test_cli_refuses_before_touching_anything(
    tmp_path: Path, extra: list[str], needle: str
) -> None:
    config = tmp_path / "specd.toml"
    config.write_text(
        f'[sglang]\nurl = "http://127.0.0.1:{free_port()}"\nenv_file = "{tmp_path}/sglang.env"\n'
        f'[files]\nstate_dir = "{tmp_path}/state"\n[choose]\nmax_steps = 6\n'
    )
    args = ["--steps", "2,4", "--concurrency", "1", "--config", str(config), *extra]
    # In process but for the first row, whose real process shows the exit code and stderr
    # at the boundary (a process costs ~0.5 s of CPU to import specd and refuse).
    real = extra == CLI_REFUSALS[0][0]
    proc = _sweep_cli([*args, "--out", str(tmp_path / "out")], real=real)
    assert proc.returncode == 2
    # argparse prints its usage first; the reason itself is one line.
    assert needle in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "sglang.env").exists()
    assert not (tmp_path / "out").exists()


def test_a_twin_sweep_refuses_a_plan_before_the_twin_starts(tmp_path: Path) -> None:
    """`--twin --steps 7` started a twin, made the --out directory and its log, then said
    the range was wrong, exit 1: without --twin the same is exit 2 with nothing made."""
    out = tmp_path / "out"
    argv = ["--twin", "--steps", "7", "--concurrency", "1", "--yes", "--out", str(out)]
    proc = _sweep_cli(argv, real=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "specd sweep: --steps 7 outside the configured range 1..6 (min_steps/max_steps)"
    )
    assert not out.exists()


def test_the_json_summary_says_where_the_results_are(tmp_path: Path) -> None:
    """--json left out the directory and files the text output lists: with the default
    --out, named by the time the sweep began, a script could not find sweep.csv."""
    out = tmp_path / "out"
    argv = ["--twin", "--steps", str(DEFAULT_STEPS), "--concurrency", "1", "--duration-s", "1",
            "--warmup-s", "0", "--yes", "--json", "--out", str(out)]  # fmt: skip
    # A real process: this module's background sweeps log on threads of this one, into
    # whatever stdout an in-process run has redirected.
    proc = _sweep_cli(argv, real=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["out_dir"] == str(out)
    assert sorted(summary["files"]) == sorted(
        str(out / name) for name in (sw.JSON_NAME, sw.MARKDOWN_NAME, sw.CSV_NAME, sw.CHART_NAME)
    )
    assert json.loads((out / sw.JSON_NAME).read_text())["out_dir"] == str(out)


@pytest.mark.parametrize(
    "earlier", [sw.CSV_NAME, sw.MARKDOWN_NAME, sw.JSON_NAME, sw.CHART_NAME, "symlink"]
)
def test_a_sweep_into_an_earlier_sweeps_results_is_refused(tmp_path: Path, earlier: str) -> None:
    """An `--out` reused: a new sweep interrupted before its first point wrote its report
    beside the earlier run's sweep.csv and sweep.png, which passed for its own. Refused
    before the twin starts, and the earlier files are kept as they were."""
    out = tmp_path / "out"
    out.mkdir()
    if earlier == "symlink":
        (out / sw.CSV_NAME).symlink_to(tmp_path / "elsewhere.csv")
        name = sw.CSV_NAME
    else:
        (out / earlier).write_text("the earlier sweep's\n")
        name = earlier
    (out / sw.LOG_NAME).write_text("a log appends\n")
    before = {p.name: os.readlink(p) if p.is_symlink() else p.read_text() for p in out.iterdir()}
    argv = ["--twin", "--steps", "2", "--concurrency", "1", "--yes", "--out", str(out)]
    proc = _sweep_cli(argv, real=False)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert f"{out} already holds an earlier sweep's results ({name})" in last
    assert "starting the SGLang twin" not in proc.stderr
    config = make_config(tmp_path, free_port())
    plan = sw.SweepPlan(steps=(2,), concurrency=(1,), duration_s=1.0, warmup_s=0.0)
    with pytest.raises(sw.SweepError, match=r"^[^\n]+ already holds an earlier sweep's"):
        sw.sweep(config, plan, out, handle_signals=False)
    after = {p.name: os.readlink(p) if p.is_symlink() else p.read_text() for p in out.iterdir()}
    assert after == before


def test_a_sweep_log_alone_is_no_earlier_result(tmp_path: Path) -> None:
    # The log appends run after run; only results make a directory taken.
    out = tmp_path / "out"
    out.mkdir()
    (out / sw.LOG_NAME).write_text("an earlier refusal\n")
    (tmp_path / "state").mkdir()
    config = make_config(tmp_path, free_port())
    plan = sw.SweepPlan(steps=(2,), concurrency=(1,), duration_s=1.0, warmup_s=0.0)
    with pytest.raises(sw.SweepError, match="cannot tell which step count SGLang runs now"):
        sw.sweep(config, plan, out, handle_signals=False)


@pytest.mark.parametrize("key", ["right", "none", "wrong"])
def test_a_sweep_of_an_sglang_with_an_api_key_sends_it_or_refuses(
    unit_factory: Any, tmp_path: Path, key: str
) -> None:
    """SGLang started with --api-key refuses /server_info and every request without it: a
    sweep could not tell what runs (and its load would have been refused request after
    request). With [sglang] server_api_key_file it measures; without it or with the wrong
    one, it is refused in one line before SGLang is touched."""
    key_file = tmp_path / "sglang.key"
    key_file.write_text(("n0t-th3-k3y" if key == "wrong" else "k3y-0123") + "\n")
    settings: dict[str, Any] = {} if key == "none" else {"server_api_key_file": str(key_file)}
    unit = unit_factory(["--api-key", "k3y-0123"], **settings)
    plan = sw.SweepPlan(steps=(3,), concurrency=(1,), duration_s=0.5, warmup_s=0.0, max_tokens=64)
    out = tmp_path / "out"
    if key != "right":
        with pytest.raises(sw.SweepError, match=r"^[^\n]+$") as info:
            sw.sweep(unit.config, plan, out, runner=unit.runner, handle_signals=False)
        said = str(info.value)
        assert "401 Unauthorized" in said
        assert ("set [sglang] server_api_key_file" if key == "none" else str(key_file)) in said
        assert "k3y" not in said
        assert unit.runner.restarted_to == []
        return
    report = sw.sweep(
        unit.config,
        plan,
        out,
        runner=unit.runner,
        reporter=Recorder(),
        pacing=sweep_cmd.FAST_PACING,
        handle_signals=False,
    )
    assert report.error is None, report.error
    [point] = report.points
    assert point.output_tok_s > 0
    assert point.errors == 0


# -- refusals in process ------------------------------------------------------------------


class _FakeDaemonMetrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"# TYPE specd_up gauge\nspecd_up 1\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("case", ["daemon_running", "unfinished_journal", "sglang_down"])
def test_sweep_refuses_with_one_line_and_changes_nothing(tmp_path: Path, case: str) -> None:
    (tmp_path / "state").mkdir()
    server = None
    config = make_config(tmp_path, free_port())
    if case == "daemon_running":
        server = http.server.HTTPServer(("127.0.0.1", 0), _FakeDaemonMetrics)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        config = make_config(tmp_path, free_port(), metrics_port=server.server_port)
        needle = "specd is running"
    elif case == "unfinished_journal":
        state = State(journal={"phase": "restart_issued", "to_steps": 4}).to_dict()
        (tmp_path / "state" / STATE_FILE).write_text(json.dumps(state))
        needle = "holds an unfinished restart (restart_issued)"
    else:
        needle = "cannot tell which step count SGLang runs now"
    plan = sw.SweepPlan(steps=(2,), concurrency=(1,), duration_s=1.0, warmup_s=0.0)
    try:
        with pytest.raises(sw.SweepError, match=r"^[^\n]+$") as info:
            sw.sweep(config, plan, tmp_path / "out", handle_signals=False)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    assert needle in str(info.value)
    assert not (tmp_path / "sglang.env").exists()
    assert not (tmp_path / "out").exists()


# -- pure parts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "original", "order"),
    [
        ((1, 2, 3, 4, 5), 3, [1, 2, 4, 5, 3]),
        ((2, 4), 3, [2, 4]),
        ((3,), 3, [3]),
        ((5, 1), 1, [5, 1]),
    ],
)
def test_original_steps_go_last_to_save_a_restart(
    steps: tuple[int, ...], original: int, order: list[int]
) -> None:
    assert sw.steps_order(steps, original) == order


def _obs(gen: float | None, verify: float | None, accept: float | None, fresh: bool) -> Observation:
    return make_observation(
        0.0,
        running=1 if fresh else 0,
        accept_length=accept,
        spec_fresh=fresh,
        steps=3,
        max_running_requests=15,
        generation_tokens_total=gen,
        spec_verify_calls_total=verify,
        version=None,
    )


@pytest.mark.parametrize(
    ("first", "last", "samples", "expected"),
    [
        # Counters moved: their ratio.
        (_obs(100, 50, None, False), _obs(460, 150, None, False), [], 3.6),
        # Counters did not move (nothing finished): the fresh gauge samples.
        (_obs(100, 50, 2.0, False), _obs(100, 50, 2.0, False),
         [_obs(None, None, 3.0, True), _obs(None, None, 3.4, True)], 3.2),
        # Stale gauges (nothing running) are not an accept length.
        (_obs(None, None, 3.0, False), _obs(None, None, 3.0, False),
         [_obs(None, None, 3.0, False)], None),
        # A counter reset (restart) does not give a negative or huge ratio.
        (_obs(900, 300, None, False), _obs(10, 5, None, False), [_obs(None, None, 2.5, True)], 2.5),
        (None, None, [], None),
    ],
)  # fmt: skip
def test_accept_length_from_counters_else_fresh_gauges(
    first: Observation | None, last: Observation | None, samples: list[Observation],
    expected: float | None,
) -> None:  # fmt: skip
    got = sw.accept_length_between(first, last, samples)
    assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"steps": ()}, "give at least one step count"),
        ({"steps": (2, 2)}, "listed twice"),
        ({"concurrency": (0,)}, "at least 1"),
        ({"duration_s": 0.0}, "--duration-s must be > 0"),
        ({"warmup_s": float("inf")}, "--warmup-s must be >= 0"),
        ({"max_tokens": 0}, "--max-tokens must be at least 1"),
        ({"adaptive": ("off",)}, "--adaptive: 'off' is not an adaptive set"),
        ({"adaptive": ("adaptive:3,4", "adaptive:4,3")}, "--adaptive: a set is listed twice"),
        ({"adaptive": ("adaptive:",)}, "--adaptive: setting 'adaptive:': '' is not a comma"),
    ],
)
def test_bad_plans_are_one_line_errors(kwargs: dict[str, Any], problem: str) -> None:
    base: dict[str, Any] = {"steps": (1, 2), "concurrency": (1, 4)}
    with pytest.raises(ValueError, match=problem):
        sw.SweepPlan(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "?"), (0.4, "0m00s"), (75, "1m15s"), (3725, "1h02m"), (-3, "0m00s")],
)
def test_format_eta(seconds: float | None, text: str) -> None:
    assert sw.format_eta(seconds) == text


def _point(steps: int, concurrency: int, tok_s: float) -> sw.SweepPoint:
    return sw.SweepPoint(steps, concurrency, tok_s, tok_s / concurrency, 0.05, 0.08, 2.5, 15, 10,
                         0, 2.0)  # fmt: skip


def test_markdown_checks_adaptive_points_against_the_static_rows(tmp_path: Path) -> None:
    plan = sw.SweepPlan(
        steps=(3, 4), concurrency=(1, 16), adaptive=("adaptive:3,4", "adaptive:1,4")
    )
    report = sw.SweepReport(original_steps=3, plan=plan, out_dir=tmp_path, final_steps=3)
    adaptive = [
        dataclasses.replace(_point(4, c, tok), setting=text)
        for text, c, tok in (("adaptive:3,4", 1, 270.0), ("adaptive:3,4", 16, 2310.0),
                             ("adaptive:1,4", 1, 250.0))
    ]  # fmt: skip
    report.points = [_point(3, 1, 230), _point(4, 1, 280), _point(3, 16, 2100), *adaptive]
    md = sw.markdown(report)
    # c=1: the slot's best candidate is 4 (280); at c=16 the batch is capped at capacity 15,
    # where 3 reads its plateau (2100) and 4, measured only at 1, stays flat at 280.
    assert "- adaptive:3,4 c=1: measured 270.0 tok/s, predicted 280.0 (-3.6 %)" in md
    assert "- adaptive:3,4 c=16: measured 2310.0 tok/s, predicted 2100.0 (+10.0 %)" in md
    assert "- adaptive:1,4: not predicted: the sweep has no rows for steps 1" in md
    # (270 + 2310) / (280 + 2100) is above its rows: noise, read as 1.
    assert "- adaptive:3,4: as the calibration, specd predicts it at 1.000 ×" in md
    report.points[-2] = dataclasses.replace(adaptive[1], output_tok_s=1900.0)
    factor = (270 + 1900) / (280 + 2100)
    said = f"- adaptive:3,4: as the calibration, specd predicts it at {factor:.3f} ×"
    assert said in sw.markdown(report)
    assert "adaptive:1,4: as the calibration" not in md
    assert "| 4 | 1 | 250.0 |" in md
    assert "| adaptive:1,4 |" in md


@pytest.mark.parametrize(
    ("report_changes", "code"),
    [
        ({"restored": True}, 0),
        ({"restored": False}, sw.EXIT_FAILED),
        ({"restored": True, "failed_steps": {5: "rolled_back: OOM"}}, sw.EXIT_FAILED),
        ({"restored": True, "interrupted_by": "SIGTERM"}, 128 + signal.SIGTERM),
        ({"restored": True, "error": "no output tokens"}, sw.EXIT_FAILED),
    ],
)
def test_exit_code_and_markdown_say_what_happened(
    tmp_path: Path, report_changes: dict[str, Any], code: int
) -> None:
    plan = sw.SweepPlan(steps=(3, 4), concurrency=(1, 16), duration_s=2, warmup_s=1)
    report = sw.SweepReport(original_steps=3, plan=plan, out_dir=tmp_path, final_steps=3)
    report.points = [_point(3, 1, 230), _point(4, 1, 280), _point(3, 16, 2100), _point(4, 16, 2000)]
    for name, value in report_changes.items():
        setattr(report, name, value)
    assert sweep_cmd.exit_code(report) == code
    md = sw.markdown(report)
    assert "- c=1: steps 4 (280.0 tok/s)" in md
    assert "- c=16: steps 3 (2100.0 tok/s)" in md
    assert ("Restored the original 3 steps." in md) == report.restored
    for why in report.failed_steps.values():
        assert why in md


def test_confirmation_on_a_real_terminal(tmp_path: Path) -> None:
    config = make_config(tmp_path, free_port())
    plan = sw.SweepPlan(steps=(2, 4), concurrency=(1,), duration_s=60, warmup_s=0)
    for answer, expected in ((b"y\n", None), (b"\n", "not confirmed; nothing was changed")):
        leader, follower = os.openpty()
        with open(follower, encoding="utf-8") as stdin, open(os.devnull, "w") as sink:
            os.write(leader, answer)
            assert sweep_cmd.confirm(config, plan, False, stdin, sink) == expected
        os.close(leader)
    with open(os.devnull) as stdin, open(os.devnull, "w") as sink:
        assert sweep_cmd.confirm(config, plan, True, stdin, sink) is None


def test_configure_parses_lists(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    sweep_cmd.configure(parser)
    ns = parser.parse_args(["--steps", "1, 2,3", "--concurrency", "1,32", "--out", str(tmp_path)])
    assert ns.steps == (1, 2, 3)
    assert ns.concurrency == (1, 32)
    assert not ns.yes
    assert not ns.off
    assert ns.adaptive is None


def test_off_and_adaptive_options_make_the_plan() -> None:
    parser = argparse.ArgumentParser()
    sweep_cmd.configure(parser)
    argv = ["--steps", "3,4", "--concurrency", "1", "--off", "--adaptive", "adaptive:4,3"]
    ns = parser.parse_args([*argv, "--adaptive"])
    plan = sweep_cmd.make_plan(ns, ("adaptive:1,3", "adaptive:3,4"))
    assert plan.off
    # Canonical and once each: the explicit set, then the config's sets not yet named.
    assert plan.adaptive == ("adaptive:3,4", "adaptive:1,3")
    assert [s.kind for s in plan.settings()] == ["static", "static", "off", "adaptive", "adaptive"]
    assert plan.points == 5
    assert sweep_cmd.make_plan(parser.parse_args(argv[:4]), ("adaptive:1,3",)).settings() == [
        static(3),
        static(4),
    ]


def _report(out_dir: Path) -> sw.SweepReport:
    plan = sw.SweepPlan(steps=(3, 4), concurrency=(1, 16), duration_s=2, warmup_s=1)
    report = sw.SweepReport(original_steps=3, plan=plan, out_dir=out_dir, final_steps=3)
    report.points = [_point(3, 1, 230), _point(4, 1, 280), _point(3, 16, 2100), _point(4, 16, 2000)]
    return report


def test_outputs_are_written_atomically_with_their_mode_and_never_through_a_link(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.csv"
    victim.write_text("keep\n")
    (out / sw.CSV_NAME).symlink_to(victim)
    (out / sw.CHART_NAME).symlink_to(tmp_path / "dangling.png")
    report = _report(out)
    old = os.umask(0o077)
    try:
        written = sw.write_outputs(report)
    finally:
        os.umask(old)
    assert report.error is None
    names = [sw.JSON_NAME, sw.MARKDOWN_NAME, sw.CSV_NAME, sw.CHART_NAME]
    assert [p.name for p in written] == names
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # no temporary debris
    for name in names:
        st = os.lstat(out / name)
        assert stat.S_ISREG(st.st_mode), name
        assert stat.S_IMODE(st.st_mode) == sw.OUTPUT_FILE_MODE, name
    assert victim.read_text() == "keep\n"
    assert not (tmp_path / "dangling.png").exists()
    assert read_table(out / sw.CSV_NAME).steps() == [3, 4]
    assert png_size(out / sw.CHART_NAME) == (900, 550)


def test_an_output_that_cannot_be_written_is_reported_not_raised(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / sw.MARKDOWN_NAME).mkdir()  # a directory where the file should go
    report = _report(out)
    written = sw.write_outputs(report, chart=False)
    assert [p.name for p in written] == [sw.JSON_NAME, sw.CSV_NAME]
    assert report.error is not None
    assert report.error.startswith(f"cannot write {out / sw.MARKDOWN_NAME}: ")
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")] == []


# -- end to end ---------------------------------------------------------------------------
# Each sweep below waits on the twin's paced tokens (a point lasts two whole requests of
# seconds each, see `MATCHES`), not on the CPU. They run in two background lanes of about
# the same length (`LANES`), started with the module's first test, while the tests above
# run; each test reads its own sweep's report, recorder and twin once that sweep is done.
# A lane's sweeps run with handle_signals=False (a signal handler is the main thread's):
# test_the_cli_stops_on_sigint_restores_and_exits_130 sweeps with them, in a real process.


@dataclass
class Case:
    """One end-to-end sweep: the plan, the twin's extra flags and drop-in defaults, the
    config's overrides, and the phase at which it stops itself (None: it does not)."""

    plan: sw.SweepPlan
    twin_args: list[str] = dataclasses.field(default_factory=list)
    defaults: dict[str, str] | None = None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    stop_at_phase: str | None = None


@dataclass
class Swept:
    """A `Case` run in its lane (its twin started there, on ports picked then): what its
    test reads."""

    case: Case
    workdir: Path
    recorder: Recorder = dataclasses.field(default_factory=Recorder)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    unit: Any = None  # the Unit, once started
    report: sw.SweepReport | None = None
    error: BaseException | None = None

    @property
    def out(self) -> Path:
        return self.workdir / "out"

    def result(self) -> sw.SweepReport:
        """The report, once the sweep is done (its error, raised here, if it failed)."""
        assert self.done.wait(600), "the sweep did not end within 10 minutes"
        if self.error is not None:
            raise self.error
        assert self.report is not None
        return self.report

    def run(self) -> None:
        case = self.case
        if case.stop_at_phase is not None:
            self.recorder.on_phase = lambda text, at=case.stop_at_phase: (
                self.stop.set() if text.startswith(at) else None
            )
        try:
            self.unit = Unit(
                self.workdir, [*TWIN_ARGS, *case.twin_args], case.defaults, **case.config
            )
            self.unit.runner.start().wait_healthy(30)
            self.report = sw.sweep(
                self.unit.config,
                case.plan,
                self.out,
                runner=self.unit.runner,
                pacing=sweep_cmd.FAST_PACING,
                reporter=self.recorder,
                stop=self.stop,
                handle_signals=False,
            )
        except BaseException as exc:  # raised in the test that reads it
            self.error = exc
        finally:
            self.done.set()


# Long requests: each closed-loop client's gap between one request's last token and the
# next request's first (a few ms, more on a starved CI core) is then a small share of its
# time; the twin's table assumes no gap at all.
MATCHES = Case(
    sw.SweepPlan(steps=(2, 4), concurrency=(1, 8), duration_s=2.0, warmup_s=0.2, max_tokens=768)
)
# The failing step count is caught by its unit failing, not by the timeout; the timeout
# only bounds the healthy starts (4, then the original back), which a loaded 2-core
# machine took over 3 s to make healthy.
FAILS_TO_START = Case(
    sw.SweepPlan(steps=(4, 2), concurrency=(2,), duration_s=1.0, warmup_s=0.2),
    twin_args=["--fail-start-at-steps", "2"],
    config={"startup_timeout_s": 20.0},
)
OFF_AND_ADAPTIVE = Case(
    sw.SweepPlan(
        steps=(3, 4),
        concurrency=(1, 8),
        duration_s=1.5,
        warmup_s=0.2,
        max_tokens=768,
        off=True,
        adaptive=("adaptive:4,3",),
    )
)
# A twin whose drop-in default runs no speculation (the setting form, as `specd install`
# writes it: no words).
WITHOUT_SPECULATION = Case(
    sw.SweepPlan(steps=(4,), concurrency=(2,), duration_s=1.0, warmup_s=0.1, off=True),
    defaults={ENV_ARGS: ""},
    config={"speculative_algorithm": "NEXTN"},
)
STOP_WHILE_ADAPTIVE = Case(
    sw.SweepPlan(
        steps=(4,), concurrency=(1,), duration_s=5.0, warmup_s=0.1, adaptive=("adaptive:3,4",)
    ),
    stop_at_phase="adaptive:3,4: measuring",
)
# Each lane's cases, in order, by the test that reads them: about 80 s each.
LANES: tuple[dict[str, Case], ...] = (
    {"test_sweep_measures_off_and_an_adaptive_set_and_puts_the_original_back": OFF_AND_ADAPTIVE},
    {
        "test_sweep_matches_the_twins_truth_writes_files_and_restores": MATCHES,
        "test_a_step_count_that_fails_to_start_is_reported_and_the_original_restored": (
            FAILS_TO_START
        ),
        "test_a_server_without_speculation_is_swept_and_put_back_to_off": WITHOUT_SPECULATION,
        "test_a_stop_while_an_adaptive_set_runs_restores_the_original": STOP_WHILE_ADAPTIVE,
    },
)


@pytest.fixture(scope="module", autouse=True)
def sweeps(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Swept]]:
    """The end-to-end sweeps of the tests selected in this session, by test name, each
    lane in a thread of its own (none when none of them is selected)."""
    selected = {item.name for item in request.session.items}
    runs = {
        name: Swept(case, tmp_path_factory.mktemp(name[:40]))
        for lane in LANES
        for name, case in lane.items()
        if name in selected
    }
    closing = threading.Event()

    def run_lane(names: list[str]) -> None:
        for name in names:
            if closing.is_set():
                runs[name].error = RuntimeError("not run: the module ended first")
                runs[name].done.set()
            else:
                runs[name].run()

    threads = [
        threading.Thread(target=run_lane, args=([n for n in lane if n in runs],), daemon=True)
        for lane in LANES
    ]
    for thread in threads:
        thread.start()
    try:
        yield runs
    finally:
        # A sweep still running (its test failed or was not reached) stops and restores.
        closing.set()
        for swept in runs.values():
            swept.stop.set()
        for thread in threads:
            thread.join(timeout=120)
        for swept in runs.values():
            if swept.unit is not None:
                swept.unit.runner.stop()


def test_sweep_matches_the_twins_truth_writes_files_and_restores(
    sweeps: dict[str, Swept],
) -> None:
    swept = sweeps["test_sweep_matches_the_twins_truth_writes_files_and_restores"]
    report, unit, out = swept.result(), swept.unit, swept.out
    assert report.ok, report.to_dict()
    assert sweep_cmd.exit_code(report) == 0
    truth = preset_table()
    measured = read_table(out / sw.CSV_NAME)  # the calibration format, read back
    assert measured.steps() == [2, 4]
    for row in measured.rows:
        want = truth.throughput(row.steps, row.concurrency)
        assert abs(row.output_tok_s / want - 1) <= TOLERANCE, (row, want)
        assert row.accept_length is not None
        accept = truth.accept_length(row.steps)
        assert accept is not None
        assert abs(row.accept_length / accept - 1) <= TOLERANCE, (row, accept)
        assert row.max_running_requests == truth.capacity(row.steps)
    width, height = png_size(out / sw.CHART_NAME)
    assert (width, height) == (900, 550)
    assert (out / sw.CHART_NAME).stat().st_size > 10_000
    md = (out / sw.MARKDOWN_NAME).read_text()
    assert "| 4 | 8 |" in md
    assert f"Restored the original {DEFAULT_STEPS} steps." in md
    # Back where it began: the env file, the live server, no journal left to reconcile.
    assert read_env_steps(unit.config.sglang.env_file) == DEFAULT_STEPS
    assert unit.live_steps() == DEFAULT_STEPS
    assert read_json(Path(unit.config.files.state_dir) / STATE_FILE)["journal"] is None
    assert [r["to_steps"] for r in report.restarts] == [2, 4, DEFAULT_STEPS]


def test_a_step_count_that_fails_to_start_is_reported_and_the_original_restored(
    sweeps: dict[str, Swept],
) -> None:
    swept = sweeps["test_a_step_count_that_fails_to_start_is_reported_and_the_original_restored"]
    report, unit, out, recorder = swept.result(), swept.unit, swept.out, swept.recorder

    assert not report.ok
    assert sweep_cmd.exit_code(report) == sw.EXIT_FAILED
    assert list(report.failed_steps) == [2]
    assert report.failed_steps[2].startswith("rolled_back")
    assert [p.steps for p in report.points] == [4]
    assert report.restored
    assert read_env_steps(unit.config.sglang.env_file) == DEFAULT_STEPS
    assert unit.live_steps() == DEFAULT_STEPS
    assert "steps 2: rolled_back" in (out / sw.MARKDOWN_NAME).read_text()
    assert any(m.startswith("steps 2 failed (rolled_back)") for m in recorder.messages)
    assert read_table(out / sw.CSV_NAME).steps() == [4]


def test_sweep_measures_off_and_an_adaptive_set_and_puts_the_original_back(
    sweeps: dict[str, Swept],
) -> None:
    swept = sweeps["test_sweep_measures_off_and_an_adaptive_set_and_puts_the_original_back"]
    report, unit, out, recorder = swept.result(), swept.unit, swept.out, swept.recorder

    assert report.ok, report.to_dict()
    # The original 3 steps last: off and the adaptive set each cost one restart, no more.
    assert [r["to_setting"] for r in report.restarts] == ["4", "off", "adaptive:3,4", "3"]
    assert unit.runner.restarted_to == [4, 0, 4, DEFAULT_STEPS]
    info = httpx.get(unit.url + "/server_info", timeout=5).json()
    assert (info["speculative_num_steps"], info["speculative_adaptive"]) == (DEFAULT_STEPS, False)
    assert read_json(Path(unit.config.files.state_dir) / STATE_FILE)["journal"] is None

    truth = preset_table()
    table = read_table(out / sw.CSV_NAME)  # the calibration format, read back
    assert table.steps() == [0, 3, 4]
    off_rows = [r for r in table.rows if r.steps == 0]
    assert [r.concurrency for r in off_rows] == [1, 8]
    for row in off_rows:
        want = truth.throughput(0, row.concurrency)
        assert abs(row.output_tok_s / want - 1) <= TOLERANCE, (row, want)
        assert row.max_running_requests == truth.capacity(0)  # the off server's, not K's
    # The calibration predicts off from its steps-0 row.
    model = PerformanceModel(Calibration.of(table))
    assert model.can_predict(0)
    assert model.throughput(0, 8) == pytest.approx(off_rows[1].output_tok_s)

    # The adaptive rows are kept apart from the static curves, under their canonical text.
    assert table.measured_settings() == ["adaptive:3,4"]
    assert table.throughput(4, 8) == next(
        r.output_tok_s for r in table.rows if (r.steps, r.concurrency) == (4, 8)
    )
    assert table.setting_capacity("adaptive:3,4") == truth.capacity(4)  # the deepest's
    # Measured against what the model predicts for the set from the static rows.
    predicted = AdaptiveModel.of(adaptive_slots(parse_setting("adaptive:3,4")), model)
    for c in (1, 8):
        measured = table.setting_throughput("adaptive:3,4", c)
        assert abs(measured / predicted.throughput(c) - 1) <= TOLERANCE, (c, measured)
    points = {(p.setting, p.steps) for p in report.points}
    assert points == {(None, 0), (None, 3), (None, 4), ("adaptive:3,4", 4)}
    md = (out / sw.MARKDOWN_NAME).read_text()
    assert "| 0 | 8 |" in md
    assert "| adaptive:3,4 |" in md
    assert "- adaptive:3,4 c=8: measured " in md
    # The model reads the set's rows from the file written: the ratio sweep.md states.
    factor = Calibration.of(table).set_factor(parse_setting("adaptive:3,4"))
    assert factor is not None
    assert 1 - 2 * TOLERANCE <= factor <= 1.0  # the twin serves a set as its candidates
    assert f"- adaptive:3,4: as the calibration, specd predicts it at {factor:.3f} ×" in md
    assert f"Restored the original {DEFAULT_STEPS} steps." in md
    assert any(p.startswith("adaptive:3,4: measuring c=8") for p in recorder.phases)


def test_a_server_without_speculation_is_swept_and_put_back_to_off(
    sweeps: dict[str, Swept],
) -> None:
    swept = sweeps["test_a_server_without_speculation_is_swept_and_put_back_to_off"]
    report, config, runner, out = swept.result(), swept.unit.config, swept.unit.runner, swept.out
    assert report.ok, report.to_dict()
    assert (report.original_steps, report.final_steps) == (0, 0)
    # Off goes last: it is where SGLang began, so the sweep ends there with no restart.
    assert runner.restarted_to == [4, 0]
    info = httpx.get(config.sglang.url + "/server_info", timeout=5).json()
    assert info["speculative_algorithm"] is None
    assert read_table(out / sw.CSV_NAME).steps() == [0, 4]
    assert "Restored the original no speculation." in (out / sw.MARKDOWN_NAME).read_text()


def test_a_stop_while_an_adaptive_set_runs_restores_the_original(
    sweeps: dict[str, Swept],
) -> None:
    swept = sweeps["test_a_stop_while_an_adaptive_set_runs_restores_the_original"]
    report, unit = swept.result(), swept.unit
    assert report.restored
    assert [r["to_setting"] for r in report.restarts] == ["4", "adaptive:3,4", "3"]
    info = httpx.get(unit.url + "/server_info", timeout=5).json()
    assert (info["speculative_num_steps"], info["speculative_adaptive"]) == (DEFAULT_STEPS, False)
    assert all(p.setting is None for p in report.points)


@pytest.mark.parametrize("original", ["3", "off"])
def test_the_restore_by_hand_a_failed_restore_names_is_a_command_specd_takes(
    tmp_path: Path, original: str
) -> None:
    """It once named `specd override pin 3`, which exits 2 (--for and --reason are
    required), and a pin without --now waits for the next window."""
    hint = sw.restore_by_hand(make_config(tmp_path, free_port()), parse_setting(original))
    command = hint.split("`")[1]
    words = shlex.split(command)
    assert words[:4] == ["specd", "override", "pin", original]
    parser = argparse.ArgumentParser(prog="specd override", exit_on_error=False)
    override_cmd.configure(parser)
    args = parser.parse_args(words[2:])
    assert args.now is True
    assert args.duration.total_seconds() > 0
    assert args.reason
    assert "start specd" in hint
