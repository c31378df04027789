"""`specd recommend`: a one-shot decision against a live server (the twin) that changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from factories import make_observation

from specd.core.history import History, HistorySettings
from specd.io.config import load_config
from specd.io.state import State, StateStore
from specd.twin.process import TwinProcess

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


def write_config(tmp: Path, window: tuple[str, int]) -> Path:
    cfg = tmp / "specd.toml"
    cfg.write_text(
        f'[files]\nstate_dir = "{tmp / "state"}"\n'
        f'override_file = "{tmp / "override.toml"}"\n'
        f'[sglang]\nenv_file = "{tmp / "sglang.env"}"\n'
        "[choose]\nstabilization_window_s = 0\n"
        f'[[windows]]\ncron = "{window[0]}"\nduration_s = {window[1]}\ntimezone = "UTC"\n'
    )
    return cfg


def run_recommend(url: str, cfg: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "recommend", "--url", url, "--config", str(cfg),
         "--samples", "2", "--interval-s", "0.1", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def twin() -> TwinProcess:
    with TwinProcess(TWIN) as proc:
        proc.wait_healthy(20)
        yield proc


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
    cfg = write_config(tmp_path, window)
    if learned:
        settings = HistorySettings.from_config(load_config(cfg))
        store = StateStore(tmp_path / "state", history_settings=settings)
        assert store.save(State(history=heavy_history(settings, time.time()))) is None
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


def test_recommend_against_a_dead_server_says_why(tmp_path: Path) -> None:
    out = run_recommend("http://127.0.0.1:9", write_config(tmp_path, ALL_DAY))
    assert out["decision"]["reason"] == "no_data"
    assert out["decision"]["would_restart"] is False
    assert "refused" in out["scrape_error"].lower() or out["scrape_error"]
