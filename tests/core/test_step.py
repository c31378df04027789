"""specd.core.step: one pure decision per tick, shared by the daemon, replay and recommend."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import pytest
from factories import make_observation, tables

import specd.core
from specd.core import decide as decide_mod
from specd.core.decide import Control, Reason
from specd.core.history import History, HistorySettings
from specd.core.observation import Observation, ScrapeError
from specd.core.override import Override
from specd.core.setting import (
    ServerTraits,
    SpecSetting,
    adaptive,
    adaptive_config_name,
    off,
    traits_from_server_info,
)
from specd.core.step import LIVE_FILE_NAME_MAX, StepContext, step
from specd.io.config import Config

UTC = timezone.utc
OPEN = datetime(2026, 1, 5, 3, 30, tzinfo=UTC).timestamp()  # inside the default window


def observation(t: float, running: int = 20, steps: int | None = 4) -> Observation:
    return make_observation(t, running=running, steps=steps, accept_length=2.5)


def busy_history(end: float = OPEN, offered: int = 20, seconds: float = 1200.0) -> History:
    h = History(HistorySettings(half_life_s=1e9, warmup_exclude_s=0, scrape_interval_s=5))
    n = int(seconds // 5)
    for i in range(n):
        h.record(observation(end - 5 * (n - 1 - i), running=offered))
    return h


def context(history: History, **control: Any) -> StepContext:
    config = Config(**tables(min_history_s=600, stabilization_window_s=600))
    return StepContext(config, history, None, Control(current_steps=None, **control))


@pytest.mark.parametrize(
    ("entries", "window_s", "kept"),
    [
        ((), 30.0, ((100.0, 3),)),
        # The newest entry at or before t - window stays: it shows the hold had begun.
        (
            ((50.0, 3), (60.0, 3), (75.0, 4), (90.0, 3)),
            30.0,
            ((60.0, 3), (75.0, 4), (90.0, 3), (100.0, 3)),
        ),
        (((70.0, 3), (80.0, 3)), 30.0, ((70.0, 3), (80.0, 3), (100.0, 3))),
        (((10.0, 3), (20.0, 3)), 0.0, ((100.0, 3),)),
    ],
)
def test_recommendations_are_trimmed_to_the_stabilization_window(
    entries: tuple[tuple[float, int], ...], window_s: float, kept: tuple[tuple[float, int], ...]
) -> None:
    control = Control(current_steps=3, recommendations=entries)
    assert control.with_recommendation(100.0, 3, window_s).recommendations == kept
    assert control.recommendations == entries  # a new value; the old one is untouched


def test_after_a_restart_stabilization_starts_over_and_the_restart_counts() -> None:
    control = Control(current_steps=3, restart_times=(10.0,), recommendations=((50.0, 4),))
    after = control.after_restart(200.0)
    assert after.restart_times == (10.0, 200.0)
    assert after.recommendations == ()


@pytest.mark.parametrize(
    ("observed", "current", "reason"),
    [
        (observation(OPEN, steps=4), 4, None),
        (observation(OPEN, steps=None), None, Reason.NO_DATA),
        # A failed scrape: the live setting is unknown, never the last one believed.
        (ScrapeError("timeout", "no answer in 3 s", OPEN), None, Reason.NO_DATA),
        (None, None, Reason.NO_DATA),
    ],
)
def test_the_live_step_count_comes_from_this_ticks_observation_only(
    observed: Observation | ScrapeError | None, current: int | None, reason: Reason | None
) -> None:
    result = step(context(busy_history()), observed, OPEN)
    assert result.current == current
    assert result.control.current_steps == current
    if reason is not None:
        assert result.decision.reason is reason
        assert not result.acts
    if current is None:
        assert "4" not in result.decision.message.split(";")[-1]


ADAPTIVE_FILE = "/var/lib/specd/" + adaptive_config_name(adaptive((3, 4)))


def _pinned(setting: SpecSetting) -> Override:
    until = datetime.fromtimestamp(OPEN + 86400, tz=UTC)
    return Override("pin", None, until, "try", "next-window", setting)


@pytest.mark.parametrize(
    ("observed", "override", "acts", "says"),
    [
        # Adaptive live: the tier's steps are not a setting, the policy's pick is a change.
        (
            make_observation(
                OPEN, running=20, steps=3, adaptive=True, adaptive_config=ADAPTIVE_FILE
            ),
            None,
            False,  # a change like any other: it must hold for the stabilization window
            "stabilization window: adaptive → 3 waits",
        ),
        (
            make_observation(
                OPEN, running=20, steps=3, adaptive=True, adaptive_config=ADAPTIVE_FILE
            ),
            _pinned(adaptive((3, 4))),
            False,
            "already live",
        ),
        (observation(OPEN, steps=3), _pinned(adaptive((3, 4))), True, "3 → adaptive:3,4"),
        # No speculation: the reader reports 0 steps.
        (observation(OPEN, steps=0), _pinned(off()), False, "already live"),
        (observation(OPEN, steps=4), _pinned(off()), True, "4 → off"),
    ],
)
def test_the_live_setting_kind_comes_from_the_observation(
    observed: Observation, override: Override | None, acts: bool, says: str
) -> None:
    ctx = replace(context(busy_history()), override=override)
    result = step(ctx, observed, OPEN)
    assert result.control.live_adaptive is observed.adaptive
    assert result.control.live_adaptive_config == observed.adaptive_config
    assert result.current == (None if observed.adaptive else observed.steps)
    assert result.acts is acts, result.decision.message
    assert says in result.decision.message


def test_only_a_real_observation_is_noted_for_the_stabilization_window() -> None:
    h = busy_history()
    seen = step(context(h), observation(OPEN), OPEN)
    assert seen.pick is not None
    assert seen.control.recommendations == ((OPEN, seen.pick.steps),)
    failed = step(context(h), ScrapeError("refused", "connection refused", OPEN), OPEN)
    assert failed.control.recommendations == ()


def test_the_policy_runs_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int | None] = []
    real = decide_mod.POLICIES["bands"]

    def counting(
        history: History, config: Config, current: int | None, cal: Any, avoid: Any
    ) -> Any:
        calls.append(current)
        return real(history, config, current, cal, avoid)

    monkeypatch.setattr(decide_mod, "POLICIES", {"bands": counting})
    held = tuple((OPEN - 700 + 5 * i, 3) for i in range(141))
    result = step(context(busy_history(), recommendations=held), observation(OPEN), OPEN)
    assert result.decision.reason is Reason.CHANGE  # the pick reached decide
    assert calls == [4]


def test_step_is_pure_and_leaves_its_inputs_alone() -> None:
    h = busy_history()
    before = h.to_dict()
    ctx = context(h, recommendations=((OPEN - 100, 3),))
    first = step(ctx, observation(OPEN), OPEN)
    assert step(ctx, observation(OPEN), OPEN) == first
    assert h.to_dict() == before
    assert ctx.control.recommendations == ((OPEN - 100, 3),)


def test_the_core_keeps_no_mutable_module_state() -> None:
    """No module-level dict, list, set or bytearray in specd.core: a cache there would make
    the brain's answer depend on what it was asked before."""
    mutable = (dict, list, set, bytearray)
    found = []
    for info in pkgutil.iter_modules(specd.core.__path__):
        module = importlib.import_module(f"specd.core.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, mutable) and not name.startswith("__"):
                found.append(f"{module.__name__}.{name}")
    assert found == []


SERVER = traits_from_server_info(
    {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 1, "version": "0.5.23"}
)
HOSTILE_FILE = "/etc/" + "x" * 5000 + ".json"


@pytest.mark.parametrize(
    ("observed", "traits", "name"),
    [
        (observation(OPEN, steps=3), None, "3"),
        (observation(OPEN, steps=0), None, "off"),
        (observation(OPEN, steps=None), None, None),
        (None, None, None),
        (ScrapeError("timeout", "no answer", OPEN), None, None),
        # An offered set by its name; not offered (server not read yet), by its file.
        (
            make_observation(OPEN, steps=3, adaptive=True, adaptive_config=ADAPTIVE_FILE),
            SERVER,
            "adaptive:3,4",
        ),
        (
            make_observation(OPEN, steps=3, adaptive=True, adaptive_config=ADAPTIVE_FILE),
            None,
            f"adaptive ({ADAPTIVE_FILE.rsplit('/', 1)[-1]})",
        ),
        (make_observation(OPEN, steps=3, adaptive=True), None, "adaptive"),
        # Whatever SGLang reports, the name stays short (state.json keeps it, a label shows it).
        (
            make_observation(OPEN, steps=3, adaptive=True, adaptive_config=HOSTILE_FILE),
            SERVER,
            f"adaptive ({'x' * (LIVE_FILE_NAME_MAX - 1)}…)",
        ),
    ],
)
def test_the_live_setting_is_named_as_the_operator_writes_it(
    observed: Observation | ScrapeError | None, traits: ServerTraits | None, name: str | None
) -> None:
    result = step(replace(context(busy_history()), traits=traits), observed, OPEN)
    assert result.live_name == name
