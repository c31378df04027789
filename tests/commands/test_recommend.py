"""`specd recommend`: a one-shot decision against a live server (the twin) that changes nothing."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import tomli_w
from factories import make_observation, serve
from in_process import specd_main

from specd.core.history import History, HistorySettings
from specd.core.setting import adaptive, adaptive_config_name, adaptive_config_text
from specd.io.config import load_config
from specd.io.state import State, StateStore
from specd.twin.process import TwinProcess, free_port
from specd.twin.standin import make_standin

TWIN = [
    "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "4",
    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5",
    "--enable-metrics", "--load-time-s", "0.2", "--warmup-s", "0.1",
]  # fmt: skip


def heavy_history(settings: HistorySettings, now: float) -> History:
    """Two busy hours at offered concurrency 20: the bands say 3 steps."""
    history = History(settings)
    for i in range(1440):
        history.record(
            make_observation(
                now - 7200 + i * 5,
                running=13,
                queued=7,
                accept_length=3.6,
                algorithm="EAGLE",
                max_running_requests=13,
                token_usage=0.8,
                gen_throughput=1500.0,
                generation_tokens_total=float(i * 7500),
                decode_tokens_total=float(i * 7500),
                spec_verify_calls_total=float(i * 2000),
            )
        )
    return history


# Open all day but one second before midnight (a window may not overlap itself).
ALL_DAY = ("0 0 0 * * *", 86399)
NEVER = ("0 0 0 29 2 *", 3600)  # 29 February only


def write_config(tmp: Path, window: tuple[str, int], choose: str = "") -> Path:
    cfg = tmp / "specd.toml"
    cfg.write_text(
        f'[files]\nstate_dir = "{tmp / "state"}"\n'
        f'override_file = "{tmp / "override.toml"}"\n'
        f'[sglang]\nenv_file = "{tmp / "sglang.env"}"\n'
        f"[choose]\nstabilization_window_s = 0\n{choose}"
        f'[[windows]]\ncron = "{window[0]}"\nduration_s = {window[1]}\ntimezone = "UTC"\n'
    )
    return cfg


def run_recommend(url: str, cfg: Path, systemctl_dir: Path | None = None, code: int = 0) -> dict:
    """`specd recommend --json` in-process (tests/commands/in_process.py); ``systemctl_dir``:
    a stand-in systemctl found first on PATH; ``code``: the exit status expected."""
    env = dict(os.environ)
    if systemctl_dir is not None:
        env["PATH"] = f"{systemctl_dir}:{env['PATH']}"
    done = specd_main(
        "recommend", "--url", url, "--config", str(cfg), "--samples", "2", "--interval-s", "0.1",
        "--json", env=env,
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def twin() -> TwinProcess:
    with TwinProcess(TWIN) as proc:
        proc.wait_healthy(20)
        yield proc


def configured(tmp_path: Path, window: tuple[str, int], learned: bool) -> Path:
    """A config; with ``learned``, a state file whose history is a heavy day."""
    cfg = write_config(tmp_path, window)
    if learned:
        settings = HistorySettings.from_config(load_config(cfg))
        store = StateStore(tmp_path / "state", history_settings=settings)
        assert store.save(State(history=heavy_history(settings, time.time()))) is None
    return cfg


@pytest.mark.parametrize(
    ("learned", "window", "reason", "target", "restart"),
    [
        # Nothing learned yet: the samples alone are too little to act on.
        (False, ALL_DAY, "insufficient_data", 4, False),
        # Heavy history and an open window: specd would restart to 3 now...
        (True, ALL_DAY, "change", 3, True),
        # ...but not while no window is open.
        (True, NEVER, "window_closed", 3, False),
    ],
)
def test_recommend_decides_like_the_daemon_and_changes_nothing(
    tmp_path: Path,
    twin: TwinProcess,
    learned: bool,
    window: tuple[str, int],
    reason: str,
    target: int,
    restart: bool,
) -> None:
    cfg = configured(tmp_path, window, learned)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    out = run_recommend(twin.url, cfg)
    assert out["current_steps"] == 4
    assert out["decision"]["reason"] == reason
    assert out["decision"]["target_steps"] == target
    assert out["decision"]["would_restart"] is restart
    # Changed nothing: no env file, no new state, the twin still runs 4 steps.
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert not (tmp_path / "sglang.env").exists()
    assert run_recommend(twin.url, cfg)["current_steps"] == 4


def test_recommend_waits_for_a_window_too_short_for_a_restart_as_the_daemon_does(
    tmp_path: Path, twin: TwinProcess
) -> None:
    """A window closing in 150 s: one restart needs the unit's stop timeout (systemd's
    90 s default where it cannot say) plus restart_cost_s (100 s), so the daemon waits
    (window_ending); recommend counted no time for a restart and said it would restart."""
    now = datetime.now(timezone.utc)
    opened = now.replace(second=0, microsecond=0)
    left_s = 150
    cron = f"0 {opened.minute} {opened.hour} * * *"
    cfg = configured(tmp_path, (cron, int((now - opened).total_seconds()) + left_s), True)
    decision = run_recommend(twin.url, cfg)["decision"]
    assert (decision["reason"], decision["target_steps"]) == ("window_ending", 3), decision
    assert decision["would_restart"] is False
    assert "one restart needs up to 3.2 min" in decision["message"], decision["message"]


def test_recommend_against_a_dead_server_says_why(tmp_path: Path) -> None:
    # SGLang not read at all: a failure, as for `specd observe`.
    out = run_recommend("http://127.0.0.1:9", write_config(tmp_path, ALL_DAY), code=1)
    assert out["decision"]["reason"] == "no_data"
    assert out["decision"]["would_restart"] is False
    assert "refused" in out["scrape_error"].lower() or out["scrape_error"]


@pytest.mark.parametrize(
    ("learned", "server", "code", "decision", "restart"),
    [
        # Nothing read: no target to name, nothing to restart, and a failure.
        (False, "dead", 1, "decision       no_data: no target — scrape failed", "no"),
        (False, "twin", 0, "decision       insufficient_data: target 4 — ", "no"),
        (True, "twin", 0, "decision       change: target 3 — ", "yes, to 3"),
    ],
)
def test_recommend_says_plainly_what_it_would_do(
    tmp_path: Path,
    twin: TwinProcess,
    learned: bool,
    server: str,
    code: int,
    decision: str,
    restart: str,
) -> None:
    cfg = configured(tmp_path, ALL_DAY, learned)
    url = twin.url if server == "twin" else f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "recommend", "--url", url, "--config", str(cfg),
         "--samples", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (proc.returncode, proc.stderr) == (code, ""), proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith(decision) for line in lines), lines
    assert f"would restart  {restart}" in lines, lines
    assert "None" not in proc.stdout


def test_recommend_shows_each_setting_measured_against_its_prediction(
    tmp_path: Path, twin: TwinProcess
) -> None:
    choose = 'kinds = ["static", "adaptive"]\nadaptive_candidate_sets = ["adaptive:3,4"]\n'
    cfg = write_config(tmp_path, NEVER, choose)
    settings = HistorySettings.from_config(load_config(cfg))
    history = History(settings)
    now = time.time()
    # 3 served 1000 tok/s at 2 requests, then adaptive {3,4} 950 (its gauge at tier 4).
    serve(history, 3, now - 4 * 3600, now - 2 * 3600 - 60, 2, 1000.0, 5.0)
    path = f"/var/lib/specd/{adaptive_config_name(adaptive((3, 4)))}"
    serve(history, 4, now - 2 * 3600, now - 60, 2, 950.0, 5.0, adaptive_config=path)
    store = StateStore(tmp_path / "state", history_settings=settings)
    assert store.save(State(history=history)) is None
    out = run_recommend(twin.url, cfg)
    rows = {row["setting"]: row for row in out["measured"]}
    assert rows["3"]["observed_tok_s"] == pytest.approx(1000.0, rel=1e-3)
    assert rows["adaptive:3,4"]["observed_tok_s"] == pytest.approx(950.0, rel=1e-3)
    assert rows["3"]["concurrencies"] == [2]
    assert rows["adaptive:3,4"]["concurrencies"] == [2]
    # Static 3 is predicted from what it served (no calibration): inside its interval.
    low, high = rows["3"]["interval"]
    assert low <= rows["3"]["predicted_tok_s"] <= high
    assert low <= 1000.0 <= high
    # The decision is still the daemon's step(): nothing restarts with no window open.
    assert out["decision"]["would_restart"] is False


def test_recommend_holds_a_pin_the_unit_cannot_take_as_the_daemon_does(
    tmp_path: Path, twin: TwinProcess
) -> None:
    cfg = write_config(tmp_path, ALL_DAY)
    expires = datetime.fromtimestamp(time.time() + 3600, tz=timezone.utc)
    override = {"mode": "pin", "setting": "off", "expires_at": expires, "reason": "incident"}
    (tmp_path / "override.toml").write_text(tomli_w.dumps({**override, "apply": "now"}))
    os.chmod(tmp_path / "override.toml", 0o600)
    # This machine's systemd has no sglang.service: nothing says the unit cannot take off.
    assert run_recommend(twin.url, cfg)["decision"]["would_restart"] is True
    # The fault tests' stand-in systemctl: a unit of the step-variable form.
    (tmp_path / "unit").mkdir()
    standin = make_standin(tmp_path / "unit", free_port())
    out = run_recommend(twin.url, cfg, standin.bin_dir)
    assert out["decision"]["reason"] == "unsupported"
    assert out["decision"]["would_restart"] is False
    message = out["decision"]["message"]
    assert "reads ${SPECULATIVE_NUM_STEPS}, not $SPECD_SPECULATIVE_ARGS" in message


def test_recommend_names_the_adaptive_set_sglang_runs_and_the_one_it_would_run(
    tmp_path: Path,
) -> None:
    # Under SGLang's adaptive mode there is no step count: it said "steps ?" and "target None".
    wanted = adaptive((3, 4))
    config = tmp_path / adaptive_config_name(wanted)
    config.write_text(adaptive_config_text(wanted))
    argv = [*TWIN, "--speculative-adaptive", "--speculative-adaptive-config", str(config)]
    choose = 'kinds = ["static", "adaptive"]\nadaptive_candidate_sets = ["adaptive:3,4"]\n'
    cfg = write_config(tmp_path, NEVER, choose)
    expires = datetime.fromtimestamp(time.time() + 3600, tz=timezone.utc)
    override = {"mode": "pin", "setting": "adaptive:3,4", "expires_at": expires, "reason": "x"}
    (tmp_path / "override.toml").write_text(tomli_w.dumps(override))
    os.chmod(tmp_path / "override.toml", 0o600)
    with TwinProcess(argv) as adaptive_twin:
        adaptive_twin.wait_healthy(20)
        out = run_recommend(adaptive_twin.url, cfg)
        shown = specd_main(
            "recommend", "--url", adaptive_twin.url, "--config", str(cfg), "--samples", "1"
        )
        assert shown.returncode == 0, shown.stderr
        text = shown.stdout
    assert (out["current_steps"], out["current_setting"]) == (None, "adaptive:3,4")
    assert out["decision"]["target_setting"] == "adaptive:3,4"
    assert f"SGLang         {adaptive_twin.url}: adaptive:3,4" in text, text
    assert "decision       override_pin: target adaptive:3,4 — " in text, text


def test_recommend_offers_step_counts_on_a_server_running_off_as_the_daemon_does(
    tmp_path: Path,
) -> None:
    """SGLang running off names no speculative algorithm: the daemon offers the static
    step counts with the one it applies (the config's), or it could never leave off.
    recommend read the server alone: every step count unavailable, a pin to one refused."""
    cfg = write_config(tmp_path, ALL_DAY)
    text = cfg.read_text().replace("[sglang]\n", '[sglang]\nspeculative_algorithm = "NEXTN"\n')
    cfg.write_text(text)
    expires = datetime.fromtimestamp(time.time() + 3600, tz=timezone.utc)
    override = {"mode": "pin", "setting": "4", "expires_at": expires, "reason": "incident"}
    (tmp_path / "override.toml").write_text(tomli_w.dumps({**override, "apply": "now"}))
    os.chmod(tmp_path / "override.toml", 0o600)
    with TwinProcess(["--enable-metrics", "--load-time-s", "0.2", "--warmup-s", "0.1"]) as off:
        off.wait_healthy(20)
        out = run_recommend(off.url, cfg)
    assert out["current_setting"] == "off"
    decision = out["decision"]
    assert (decision["reason"], decision["target_setting"]) == ("override_pin", "4"), decision
    assert decision["would_restart"] is True


SETPRIV = shutil.which("setpriv")


@pytest.mark.parametrize("case", ["a newer specd's freeze", "unreadable to this user"])
def test_recommend_never_says_it_would_restart_over_a_freeze_it_could_not_read(
    tmp_path: Path, twin: TwinProcess, case: str
) -> None:
    """The daemon would change to 3 (a heavy day in an open window; a pin applied now),
    but for the freeze in its state file. recommend read a state file it could not use as
    no state at all, and said `would restart  yes, to 3` while the daemon stayed frozen."""
    if case == "unreadable to this user" and (os.geteuid() != 0 or SETPRIV is None):
        pytest.skip("needs root and setpriv")  # CI runs as root; util-linux ships setpriv
    cfg = configured(tmp_path, ALL_DAY, learned=True)
    state = tmp_path / "state" / "state.json"
    data = json.loads(state.read_text())
    data["frozen"] = {"since": time.time() - 600, "reason": "restart to 3 rolled_back"}
    if case == "a newer specd's freeze":
        data["version"] = 99
    state.write_text(json.dumps(data))
    argv = [sys.executable, "-m", "specd.cli", "recommend", "--url", twin.url, "--config",
            str(cfg), "--samples", "1"]  # fmt: skip
    if case == "unreadable to this user":
        # The samples alone act on a pin applied now (the history is in the file).
        expires = datetime.fromtimestamp(time.time() + 3600, tz=timezone.utc)
        pin = {"mode": "pin", "steps": 3, "apply": "now", "expires_at": expires, "reason": "x"}
        (tmp_path / "override.toml").write_text(tomli_w.dumps(pin))
        (tmp_path / "override.toml").chmod(0o600)
        # Root without the capabilities that read any file, as an on-call outside group
        # specd: the file (0600, another user's) cannot be opened.
        state.chmod(0o600)
        nobody = pwd.getpwnam("nobody")
        os.chown(state, nobody.pw_uid, nobody.pw_gid)
        argv = [str(SETPRIV), "--bounding-set", "-dac_override,-dac_read_search", *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    if case == "a newer specd's freeze":
        # As the daemon keeps it: frozen, no restart.
        assert any(line.startswith("decision       frozen: ") for line in lines), lines
        assert "would restart  no" in lines, lines
    else:
        [said] = [line for line in lines if line.startswith("would restart  ")]
        assert said.startswith("would restart  unknown: to 3 unless the state file"), said
    assert not any(line.startswith("would restart  yes") for line in lines), lines
