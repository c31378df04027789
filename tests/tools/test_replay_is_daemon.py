"""Proof that `specd replay` is the daemon: the real `Daemon` loop, with an injected clock,
SGLang reader and applier, decides tick for tick what replay decides on the same trace,
truth table and config — inside the hysteresis band, while stabilizing, across windows
and restarts."""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import tables
from prometheus_client import CollectorRegistry

from specd.core.decide import ACTING_REASONS, Reason
from specd.core.model import Calibration, restart_extra_s
from specd.core.observation import Observation, ScrapeError
from specd.core.perftable import PerfRow, PerfTable
from specd.core.setting import SpecSetting, format_setting
from specd.daemon import Daemon
from specd.io import logs
from specd.io.apply import ApplyOutcome, setting_steps
from specd.io.config import Config
from specd.io.notify import Notifier
from specd.io.tables import read_table, write_table
from specd.tools.replay import (
    DEFAULT_START,
    REPLAY_TRAITS,
    ReplayResult,
    SimulatedServer,
    Tokens,
    Trace,
    replay,
    trace_from_rows,
)
from specd.twin.preset import preset_table

HOUR = 3600.0
RESTART_S = 100.0
SEED = preset_table()


def _truth() -> PerfTable:
    """The seed, but with 4 steps' capacity halved: under heavy load 3 serves ~20 % more,
    so the model policy has changes to make in both directions."""
    # The twin's preset is the twin's own table type: its rows, as specd's.
    rows = [
        PerfRow(r.steps, r.concurrency, r.output_tok_s, r.accept_length, r.max_running_requests)
        for r in SEED.rows
        if r.steps <= 3
    ]
    for r in SEED.rows:
        if r.steps == 4:
            plateau = SEED.throughput(4, 7)
            tok = r.output_tok_s if r.concurrency < 7 else plateau
            rows.append(PerfRow(4, r.concurrency, tok, r.accept_length, 7))
    return PerfTable(rows)


TRUTH = _truth()


def trace() -> Trace:
    """Two days: light agentic hours, heavy hours, and hours hovering just past the bands'
    boundary of 4 (inside its 5 % hysteresis), changing every few hours."""
    levels = [2, 2, 20, 20, 4, 2, 24, 24, 2, 4, 2, 2]  # each held 4 hours
    times = [i * 4 * HOUR for i in range(len(levels))]
    return trace_from_rows(times, levels)


def config(tmp_path: Path, state_dir: Path, **choose: Any) -> Config:
    return Config(
        **tables(
            state_dir=str(state_dir),
            override_file=str(tmp_path / "override.toml"),
            env_file=str(tmp_path / "sglang.env"),
            min_steps=1,
            max_steps=4,
            scrape_interval_s=60,
            stale_after_s=180,
            history_half_life_s=2 * HOUR,
            min_history_s=900,
            warmup_exclude_s=120,
            stabilization_window_s=900,
            min_dwell_s=HOUR,
            daily_restart_budget=6,
            windows=[{"cron": "0 */3 * * mon-sun", "duration_s": HOUR, "timezone": "UTC"}],
            **choose,
        )
    )


class SimulatedReader:
    """The daemon's SGLang reader: the very server replay simulates, read at the clock."""

    def __init__(self, server: SimulatedServer, clock: Callable[[], float], t0: float) -> None:
        self.server, self.clock, self.t0 = server, clock, t0

    def observe(self) -> Observation | ScrapeError:
        now = self.clock()
        if not self.server.up(now - self.t0):
            return ScrapeError("refused", "SGLang is loading the model", now)
        return self.server.observe(now - self.t0)

    @property
    def last_server_info(self) -> dict[str, Any]:
        """/server_info of the server replay simulates (its REPLAY_TRAITS): the daemon is
        offered what replay is."""
        t = REPLAY_TRAITS
        assert t.version is not None
        return {
            "speculative_algorithm": t.algorithm,
            "speculative_eagle_topk": t.topk,
            "enable_dp_attention": t.dp_attention,
            "enable_multi_layer_eagle": t.multi_layer_eagle,
            "enable_two_batch_overlap": t.two_batch_overlap,
            "enable_pdmux": t.pdmux,
            "version": ".".join(map(str, t.version)),
        }

    def close(self) -> None:
        pass


class SimulatedApplier:
    """A restart that blocks, as the real applier does, until SGLang serves again."""

    def __init__(self, server: SimulatedServer, clock: list[float], t0: float, cfg: Config) -> None:
        self.server, self.clock, self.t0, self.cfg = server, clock, t0, cfg
        self.restarts: list[tuple[float, int | None]] = []  # None: an adaptive set

    def apply_setting(
        self,
        target: SpecSetting,
        current: SpecSetting | None,
        *,
        window_open: Callable[[], bool],
        force: bool = False,
        cancelled: Callable[[], str | None] | None = None,
    ) -> ApplyOutcome:
        assert window_open() or force
        steps = setting_steps(target)
        s = self.clock[0] - self.t0
        self.restarts.append((s, steps))
        # As replay restarts: an adaptive start captures one CUDA-graph set per candidate.
        took = RESTART_S + restart_extra_s(target, self.cfg)
        self.server.restart(target, s, took)
        self.clock[0] = self.t0 + self.server.serving_from
        return ApplyOutcome(
            "success",
            setting_steps(current),
            steps,
            took,
            "verified",
            None,
            1,
            from_setting=None if current is None else format_setting(current),
            to_setting=format_setting(target),
        )

    def reconcile(self, journal_data: Any) -> ApplyOutcome | None:
        return None

    def stop_timeout_s(self) -> float:
        return 0.0  # replay's restart is the start alone

    def read_stop_timeout(self) -> None:
        pass

    def read_wiring(self) -> str | None:
        return None

    def readd_left_out(self, drained: list[dict[str, Any]]) -> str | None:
        return None

    def retry_mark_in(self, *, serving: bool = False) -> str | None:
        return None


def run_daemon(
    tr: Trace, cfg: Config, initial: int, saved: dict[float, Any] | None = None
) -> tuple[dict[float, tuple[int | None, str, str]], list[tuple[float, int | None]]]:
    """Tick the daemon through ``tr``: its decision at each tick, and its restarts;
    ``saved`` gets the last decision it keeps in its state at each tick."""
    t0 = DEFAULT_START.timestamp()
    allowed = list(range(cfg.choose.min_steps, cfg.choose.max_steps + 1))
    server = SimulatedServer(tr, TRUTH, Tokens(tr, TRUTH, allowed), t0, initial)
    clock = [t0 + tr.t[0]]
    applier = SimulatedApplier(server, clock, t0, cfg)
    daemon = Daemon(
        cfg,
        registry=CollectorRegistry(),
        clock=lambda: clock[0],
        notifier=Notifier({}),
        reader=SimulatedReader(server, lambda: clock[0], t0),
        applier=applier,
    )
    # As replay assumes: SGLang had been up long before the trace began.
    daemon.state.history.mark_sglang_start(
        t0 + tr.t[0] - cfg.observe.warmup_exclude_s - cfg.observe.scrape_interval_s
    )
    decisions: dict[float, tuple[int | None, str, str]] = {}
    step_s = cfg.observe.scrape_interval_s
    for n in range(int((tr.t[-1] - tr.t[0]) // step_s) + 1):
        t = t0 + tr.t[0] + n * step_s
        if t < clock[0]:
            continue  # the daemon was blocked in a restart
        clock[0] = t
        decision = daemon.tick()
        decisions[t] = (decision.target_steps, decision.reason.value, decision.message)
        if saved is not None:
            saved[t] = dict(daemon.state.last_decision)
    return decisions, applier.restarts


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """Where the daemon keeps its state: in RAM (/dev/shm) where the machine has it. The
    daemon saves it at every tick here (they are a simulated minute apart): ~2,900 atomic
    writes, each with two fsyncs, which on this disk took a quarter of the test's time.
    The same files and syscalls; what this test compares is the decisions."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path / "state"
        return
    with tempfile.TemporaryDirectory(dir=shm, prefix="specd-replay-is-daemon-") as held:
        yield Path(held) / "state"


@pytest.fixture(autouse=True)
def quiet_logs() -> None:
    logs.configure("json", stream=open("/dev/null", "w"))  # noqa: SIM115


@pytest.mark.parametrize(
    "policy", ["bands", "model", "model-trusting", "model-adaptive", "model-uncalibrated"]
)
def test_replay_decides_tick_for_tick_what_the_daemon_decides(
    tmp_path: Path, state_dir: Path, policy: str
) -> None:
    tr = trace()
    # Uncalibrated, the model learns the box by exploring from the bands (specd.core.explore).
    # "model": the first day's rhythm (2 by night, 20 by day) reads hours not seen yet as
    # the quietest or the busiest seen; "model-trusting" turns that off, so changes go
    # through stabilization;
    # "model-adaptive" too, offered adaptive sets only (the daemon reads /server_info for
    # them).
    choose: dict[str, Any] = {"policy": policy.split("-", maxsplit=1)[0]}
    if policy in {"model-trusting", "model-adaptive"}:
        choose["min_forecast_seen_ratio"] = 0.0
    if policy == "model-adaptive":
        choose["kinds"] = ["adaptive"]
    calibration = None
    if policy.startswith("model") and not policy.endswith("-uncalibrated"):
        cal_path = tmp_path / "calibration.csv"
        write_table(cal_path, TRUTH)
        choose["calibration_file"] = str(cal_path)
        calibration = Calibration.of(read_table(cal_path))
    cfg = config(tmp_path, state_dir, **choose)
    initial = 3
    result: ReplayResult = replay(
        tr, TRUTH, cfg, restart_s=RESTART_S, initial_steps=initial, calibration=calibration
    )
    daemon, restarts = run_daemon(tr, cfg, initial)

    # Every tick replay decided at, the daemon decided the same: target, reason, message.
    assert len(result.decisions) > 300
    mismatches = [
        (t, (target, reason), daemon.get(t))
        for t, target, reason in result.decisions
        if daemon.get(t, (None, None, None))[:2] != (target, reason)
    ]
    assert mismatches[:5] == []
    # Where replay did not decide (far from any window), the daemon never acted.
    decided = {r[0] for r in result.decisions}  # once: not again for every daemon tick
    skipped = {t: d for t, d in daemon.items() if t not in decided}
    assert skipped
    assert all(Reason(r) not in ACTING_REASONS for _, r, _ in skipped.values())
    # The same restarts at the same moments to the same step counts.
    assert [(s, k) for s, k in result.steps_timeline[1:]] == restarts
    # The comparison covered what matters, so it cannot pass vacuously.
    seen = Counter(reason for _, _, reason in result.decisions)
    if policy == "model-uncalibrated":
        assert seen[Reason.EXPLORE.value] > 0
        assert Reason.EXPLORE.value in result.change_reasons
    else:
        assert seen[Reason.CHANGE.value] >= 2
        assert seen[Reason.WINDOW_CLOSED.value] > 0
        if policy == "model":
            unseen = "of the epoch in hours of the day never seen, while the hours seen show"
            assert any(unseen in daemon[t][2] for t, _, _ in result.decisions)
        else:
            assert seen[Reason.STABILIZING.value] > 0
        if policy == "model-adaptive":
            # The daemon, reading /server_info, changed among adaptive sets where replay did.
            assert len(restarts) >= 2
            assert all(k is None for _, k in restarts), restarts
    assert seen[Reason.WITHIN_TOLERANCE.value] > 0
    if policy == "bands":
        # Ticks inside the hysteresis band around the boundary of 4.
        assert any("within 5% of the band boundary" in daemon[t][2] for t, _, _ in result.decisions)


def test_the_daemon_goes_back_in_the_window_of_a_change_as_replay_does(
    tmp_path: Path, state_dir: Path
) -> None:
    """A day at 20 requests; the sweep claims 1 step serves 40 % more than it does, so the
    model changes 3 → 1 as the first window opens. 1 serves 15 % less than 3 there, against
    the prediction: the daemon goes back inside that window, the dwell not holding it, at
    the tick replay does."""
    tr = trace_from_rows([0.0, 24 * HOUR], [20, 20])
    oversold = PerfTable(
        [
            PerfRow(
                r.steps,
                r.concurrency,
                r.output_tok_s * (1.4 if r.steps == 1 else 1.0),
                r.accept_length,
                r.max_running_requests,
            )
            for r in TRUTH.rows
        ]
    )
    cal_path = tmp_path / "calibration.csv"
    write_table(cal_path, oversold)
    cfg = config(
        tmp_path, state_dir, policy="model", calibration_file=str(cal_path), kinds=["static"]
    )
    result = replay(
        tr,
        TRUTH,
        cfg,
        restart_s=RESTART_S,
        initial_steps=3,
        calibration=Calibration.of(read_table(cal_path)),
    )
    saved: dict[float, Any] = {}
    daemon, restarts = run_daemon(tr, cfg, 3, saved)
    mismatches = [
        (t, (target, reason), daemon.get(t))
        for t, target, reason in result.decisions
        if daemon.get(t, (None, None, None))[:2] != (target, reason)
    ]
    assert mismatches[:5] == []
    assert [(s, k) for s, k in result.steps_timeline[1:]] == restarts
    assert result.change_reasons[:2] == ["change", "regression"], result.steps_timeline
    (changed, to), (back, _) = restarts[:2]
    assert to == 1
    assert back - changed < cfg.restart.min_dwell_s
    said = [(t, m) for t, (_, r, m) in daemon.items() if r == Reason.REGRESSION.value]
    assert said
    t, message = said[0]
    assert "going back 1 → " in message
    assert message.endswith("in the window the change was made in")
    # The state keeps the verdict with the decision, for `specd status`.
    assert saved[t]["outcome"].startswith("outcome of 3 → 1 at ")
    assert ": regression, " in saved[t]["outcome"]
    assert saved[t]["outcome"] in message
