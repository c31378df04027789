from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import make_observation, mounted_tmpfs

from specd.core.decide import Control, _held_for
from specd.core.history import History, HistorySettings
from specd.core.observation import Observation
from specd.core.outcome import Avoided, ChangeSnapshot
from specd.io.state import (
    MAX_STATE_BYTES,
    STATE_FILE,
    STATE_FILE_MODE,
    STATE_VERSION,
    STATUS_FILE,
    State,
    StateFormatError,
    StateStore,
    atomic_write_json,
    encode_json,
    read_json,
    read_status,
    with_status,
)

T0 = 1_767_225_600.0


def obs(t: float, running: int, steps: int = 4) -> Observation:
    return make_observation(
        t,
        running=running,
        steps=steps,
        accept_length=2.6,
        max_running_requests=13,
        gen_throughput=150.0,
    )


def populated() -> State:
    history = History(HistorySettings(warmup_exclude_s=0))
    for i in range(50):
        history.record(obs(T0 + 5 * i, running=i % 6))
    return State(
        history=history,
        last_decision={"t": T0, "target_steps": 3, "reason": "change", "message": "4 → 3"},
        journal={"phase": "env_written", "from_steps": 4, "to_steps": 3, "previous_env": "X=1\n"},
        restarts=[{"t": T0 - 7200, "from_steps": 3, "to_steps": 4, "result": "success"}],
        frozen={"since": T0 - 60, "reason": "restart to 5 failed"},
        recommendations=[[T0 - 10, 4], [T0 - 5, 3]],
        explorations=[[T0 - 3 * 86400, 5], [T0 - 86400, 2]],
        verifying=ChangeSnapshot(
            T0 - 7200,
            3,
            4,
            ((2, 30.0, 4500.0), (5, 10.0, 2000.0)),
            0.02,
            until=T0 + 86400,
            predicted=((1, 1.03, 0.4), (3, 0.98, 0.6)),
        ),
        avoided=[
            Avoided(5, T0 - 86400, ((2, 0.25), (5, 0.75)), 0.031, 4),
            Avoided(6, T0 - 3600, ((8, 1.0),), 0.05, 4),
        ],
        sglang_started_at=T0 - 7200,
    )


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# -- atomic writes --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("obj", "mode"),
    [({"a": 1, "b": [1.5, None, "é"]}, 0o600), ([1, 2, 3], 0o644), ("text", 0o600)],
)
def test_atomic_write_round_trip_and_mode(tmp_path: Path, obj: Any, mode: int) -> None:
    path = tmp_path / "x.json"
    path.write_text("old")
    atomic_write_json(path, obj, mode=mode)
    assert read_json(path) == obj
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("obj", "error"),
    [({"x": math.nan}, ValueError), ({"x": math.inf}, ValueError), ({"x": object()}, TypeError)],
)
def test_a_failed_write_leaves_the_old_file_and_no_debris(
    tmp_path: Path, obj: Any, error: type[Exception]
) -> None:
    path = tmp_path / "x.json"
    atomic_write_json(path, {"good": True})
    with pytest.raises(error):
        atomic_write_json(path, obj)
    assert read_json(path) == {"good": True}
    assert leftovers(tmp_path) == []


WRITER = """
import sys
from specd.io.state import atomic_write_json
path, n = sys.argv[1], 0
print("ready", flush=True)
while True:
    n += 1
    atomic_write_json(path, {"n": n, "pad": ["x" * 1000] * (200 + n % 300)})
"""


@pytest.mark.parametrize("delay_s", [0.05, 0.11, 0.17, 0.23])
def test_sigkill_mid_write_never_leaves_a_half_written_file(tmp_path: Path, delay_s: float) -> None:
    path = tmp_path / STATE_FILE
    atomic_write_json(path, {"n": 0, "pad": []})
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while read_json(path)["n"] < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay_s)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    data = read_json(path)
    assert data["n"] >= 1
    assert len(data["pad"]) == 200 + data["n"] % 300


# -- State ----------------------------------------------------------------------------
def test_state_round_trips_through_the_store(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    state = populated()
    assert store.save(state) is None
    # Group-readable for the on-call in group specd (`specd status`); never world-readable.
    assert stat.S_IMODE((tmp_path / STATE_FILE).stat().st_mode) == 0o640
    loaded, problem = store.load()
    assert problem is None
    assert loaded.to_dict() == state.to_dict()
    assert loaded.history.quantile(0.5) == state.history.quantile(0.5)
    assert loaded.version == STATE_VERSION


def test_a_version_1_file_is_read_and_saved_as_version_2(tmp_path: Path) -> None:
    """Version 1 stayed while explorations, the avoid list, the outcome check and the
    gateway's state were added: an older specd (a rollback) read a newer file as its own
    and dropped those parts unsaid at its next save. Files are version 2 now (an older
    specd sets them aside, frozen); a version-1 file, which lacks those parts, still
    loads whole."""
    store = StateStore(tmp_path)
    older = populated().to_dict()
    older["version"] = 1
    for added in ("explorations", "avoided", "verifying", "gateway"):
        older.pop(added, None)
    (tmp_path / STATE_FILE).write_text(json.dumps(older))
    loaded, problem = store.load()
    assert problem is None
    assert loaded.history.quantile(0.5) == populated().history.quantile(0.5)
    assert store.save(loaded) is None
    assert json.loads((tmp_path / STATE_FILE).read_text())["version"] == STATE_VERSION == 2


def test_a_string_that_is_no_unicode_text_costs_that_string_not_what_specd_learned(
    tmp_path: Path,
) -> None:
    """A lone surrogate an answer carried into a decision's message is saved as the escape
    "\\ud800" (json.dumps writes ASCII); read back it made the whole file invalid, so every
    start of specd set state.json aside and began learning again. It reads as "?" now."""
    store = StateStore(tmp_path)
    state = populated()
    state.last_decision = {"t": 1.0, "reason": "fleet_unavailable", "message": "held by box\ud800"}
    assert store.save(state) is None
    assert "\\ud800" in (tmp_path / STATE_FILE).read_text()
    loaded, problem = store.load()
    assert problem is None
    assert loaded.last_decision is not None
    assert loaded.last_decision["message"] == "held by box?"
    assert loaded.history.to_dict() == state.history.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]  # nothing set aside


def test_a_missing_file_is_a_first_start(tmp_path: Path) -> None:
    state, problem = StateStore(tmp_path / "new").load()
    assert problem is None
    assert state.to_dict() == State().to_dict()


def test_the_store_hands_config_settings_to_the_history(tmp_path: Path) -> None:
    settings = HistorySettings(half_life_s=60, warmup_exclude_s=1, scrape_interval_s=1)
    StateStore(tmp_path).save(populated())
    assert StateStore(tmp_path, history_settings=settings).load()[0].history.settings == settings
    assert StateStore(tmp_path / "empty", history_settings=settings).load()[0].history.settings == (
        settings
    )


def _state_dict() -> dict[str, Any]:
    return populated().to_dict()


def _idle_state() -> dict[str, Any]:
    """`populated` neither frozen nor in a restart."""
    return {**_state_dict(), "frozen": None, "journal": None}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (lambda: json.dumps(_state_dict())[:-40], "unreadable"),
        (lambda: "", "unreadable"),
        (lambda: "\x00\x01garbage", "unreadable"),
        (lambda: b"\xff\xfe{}", "unreadable"),
        (lambda: "[]", "expected a JSON object"),
        (lambda: json.dumps({**_idle_state(), "version": STATE_VERSION + 1}), "newer"),
        (lambda: json.dumps({**_idle_state(), "version": "1"}), "version"),
    ],
    ids=[
        "truncated",
        "empty",
        "garbage",
        "not-utf8",
        "not-object",
        "newer-version",
        "version-type",
    ],
)
def test_a_file_that_is_no_state_is_moved_aside_and_specd_starts_fresh(
    tmp_path: Path, content: Any, problem: str
) -> None:
    path = tmp_path / STATE_FILE
    data = content()
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    original = path.read_bytes()
    store = StateStore(tmp_path, clock=lambda: 1_767_229_200.9)
    state, message = store.load()
    assert message is not None
    assert problem in message
    assert "\n" not in message
    assert "moved to state.json.corrupt-1767229200" in message
    assert state.to_dict() == State().to_dict()
    assert not path.exists()
    assert (tmp_path / "state.json.corrupt-1767229200").read_bytes() == original
    # The next save works, and a second corrupt file in the same second gets its own name.
    assert store.save(state) is None
    path.write_text("{")
    assert "corrupt-1767229200.1" in (store.load()[1] or "")


def _with(**parts: Any) -> dict[str, Any]:
    return {**_state_dict(), **parts}


def _with_history(**parts: Any) -> dict[str, Any]:
    data = _state_dict()
    data["history"] = {**data["history"], **parts}
    return data


def _verifying(**parts: Any) -> dict[str, Any]:
    data = _state_dict()
    data["verifying"] = {**data["verifying"], **parts}
    return data


def _avoided_entry(index: int, **parts: Any) -> dict[str, Any]:
    data = _state_dict()
    data["avoided"][index] = {**data["avoided"][index], **parts}
    return data


def _history_cells(table: str, *rows: list[Any]) -> dict[str, Any]:
    data = _state_dict()
    data["history"][table]["cells"].extend(rows)
    return data


def _history_table(table: str, **parts: Any) -> dict[str, Any]:
    data = _state_dict()
    data["history"][table] = {**data["history"][table], **parts}
    return data


def _hour(how: int, *rows: list[Any]) -> dict[str, Any]:
    data = _state_dict()
    data["history"]["hourly"][how]["cells"].extend(rows)
    return data


# The hour of the week `populated` observed in (Thursday 2026-01-01 00:00 UTC).
HOW = 72


# Each damages one part: that part is left out (named in the message), all else is kept.
# `expect` maps the parts that differ from the undamaged state to what they load as.
SALVAGED: list[Any] = [
    pytest.param(
        lambda: _with(restarts=[{"from_steps": 1}]),
        "restarts[0]",
        {"restarts": []},
        id="restart-without-t",
    ),
    pytest.param(lambda: _with(restarts={}), "restarts", {"restarts": []}, id="restarts-type"),
    pytest.param(lambda: _with(journal=[1]), "journal", {"journal": None}, id="journal-type"),
    pytest.param(
        lambda: _with(last_decision=3), "last_decision", {"last_decision": {}}, id="decision-type"
    ),
    pytest.param(
        lambda: _with(recommendations=[[1, "3"], [T0, 3]]),
        "recommendations[0]",
        {"recommendations": [[T0, 3]]},
        id="one-recommendation-bad",
    ),
    pytest.param(
        lambda: _with(explorations=[[T0, "5"], [T0 - 86400, 2]]),
        "explorations[0]",
        {"explorations": [[T0 - 86400, 2]]},
        id="exploration-steps-text",
    ),
    pytest.param(
        lambda: _with(explorations=[[T0 - 86400, 2], [None, 5], [T0, 0], [T0, True]]),
        "explorations[1]",
        {"explorations": [[T0 - 86400, 2]]},
        id="explorations-null-t-zero-or-bool-steps",
    ),
    pytest.param(
        lambda: _with(explorations={"5": T0}),
        "explorations",
        {"explorations": []},
        id="explorations-type",
    ),
    pytest.param(
        lambda: _with(verifying=[3, 4]), "verifying", {"verifying": None}, id="verifying-type"
    ),
    pytest.param(
        lambda: _verifying(to_steps=3), "verifying", {"verifying": None}, id="verifying-no-change"
    ),
    pytest.param(
        lambda: _verifying(from_steps=-1), "verifying", {"verifying": None}, id="verifying-steps"
    ),
    pytest.param(
        lambda: _verifying(t=None), "verifying: t", {"verifying": None}, id="verifying-no-t"
    ),
    pytest.param(
        lambda: _verifying(predicted=[[1, 1.03, 0.4], [3, "0.98", 0.6]]),
        "verifying: predicted[1]",
        {"verifying": None},
        id="verifying-predicted-text",
    ),
    # One bad cell of the snapshot: that cell, not the change it verifies.
    pytest.param(
        lambda: _verifying(
            cells={"ref_t": T0 - 7200, "cells": [[2, 30.0, 4500.0], [5, 10.0, 1e300]]}
        ),
        "verifying.cells[1]",
        {
            "verifying": ChangeSnapshot(
                T0 - 7200,
                3,
                4,
                ((2, 30.0, 4500.0),),
                0.02,
                T0 + 86400,
                predicted=((1, 1.03, 0.4), (3, 0.98, 0.6)),
            )
        },
        id="verifying-cell-1e299-tok-s",
    ),
    pytest.param(
        lambda: _with(avoided={"steps": 5}), "avoided", {"avoided": []}, id="avoided-type"
    ),
    pytest.param(
        lambda: _avoided_entry(0, steps=99),
        "avoided[0]: steps",
        {"avoided": [Avoided(6, T0 - 3600, ((8, 1.0),), 0.05, 4)]},
        id="avoided-steps-99",
    ),
    pytest.param(
        lambda: _avoided_entry(1, mix=[[8, 7.0]]),
        "avoided[1]: mix",
        {"avoided": [Avoided(5, T0 - 86400, ((2, 0.25), (5, 0.75)), 0.031, 4)]},
        id="avoided-share-7",
    ),
    pytest.param(
        lambda: _avoided_entry(1, shortfall_ratio=float("nan")),
        "avoided[1]: shortfall_ratio",
        {"avoided": [Avoided(5, T0 - 86400, ((2, 0.25), (5, 0.75)), 0.031, 4)]},
        id="avoided-nan",
    ),
    pytest.param(
        lambda: _with(sglang_started_at="x"),
        "sglang_started_at",
        {"sglang_started_at": None},
        id="started-type",
    ),
    pytest.param(lambda: _with(live={"t": "now"}), "live", {"live": None}, id="live-type"),
    pytest.param(
        lambda: _with(live={"t": T0, "steps": None, "source": "observation", "setting": [1]}),
        "live",
        {"live": None},
        id="live-setting-type",
    ),
    pytest.param(
        lambda: _with(live={"t": T0, "steps": 3, "source": "observation", "setting": "x" * 9999}),
        "live",
        {"live": None},
        id="live-setting-huge",
    ),
    pytest.param(lambda: _with(history=None), "history", {"history": "fresh"}, id="no-history"),
    pytest.param(
        lambda: _with(history={"format": 1}),
        "history",
        {"history": "fresh"},
        id="history-incomplete",
    ),
    # What SGLang once sent and an older specd stored: one entry, not the whole history.
    pytest.param(
        lambda: _with_history(capacity=[[4, 13], [3, -5]]),
        "history.capacity[1]",
        {"capacity": {4: 13}},
        id="negative-capacity",
    ),
    pytest.param(
        lambda: _with_history(capacity=[[-3, 13], [4, 13]]),
        "history.capacity[0]",
        {"capacity": {4: 13}},
        id="negative-steps",
    ),
    pytest.param(
        lambda: _with_history(last_steps=-3), "history.last_steps", {}, id="negative-last-steps"
    ),
    pytest.param(
        lambda: _history_cells("accept", [3, 10.0, 500.0]),
        "history.accept[",
        {"accept3": None},
        id="accept-length-50-at-3-steps",
    ),
    pytest.param(
        lambda: _history_cells("accept", [3, 10.0, 1e301]),
        "history.accept[",
        {"accept3": None},
        id="accept-length-1e300",
    ),
    pytest.param(
        lambda: _history_cells("throughput", [[3, 4], 10.0, 1e300]),
        "history.throughput[",
        {"throughput34": None},
        id="throughput-1e299",
    ),
    pytest.param(
        lambda: _history_cells("offered", [-1, 10.0]), "history.offered[", {}, id="negative-offered"
    ),
    pytest.param(
        lambda: _with_history(accept_seen=[[4, 3600.0], [3, -5.0]]),
        "history.accept_seen[1]",
        {"seen4": 3600.0},
        id="negative-acceptance-seconds",
    ),
    pytest.param(
        lambda: _with_history(accept_seen=[[4, 1e300]]),
        "history.accept_seen[0]",
        {"seen4": "decayed"},
        id="seen-1e300",
    ),
    pytest.param(
        lambda: _with_history(accept_seen={"4": 5}),
        "history.accept_seen",
        {"seen4": "decayed"},
        id="seen-type",
    ),
    pytest.param(
        lambda: _with_history(counters={"decode_tokens_total": -1.0}),
        "history.counters.decode_tokens_total",
        {},
        id="negative-counter",
    ),
    # Hand-edited or damaged, still JSON. Python's json reads NaN and Infinity: kept, they
    # made every later save fail (the state is written as JSON only).
    pytest.param(
        lambda: _with(restarts=[{**populated().restarts[0], "duration_s": math.nan}]),
        "restarts[0].duration_s",
        {"restarts": [{**populated().restarts[0], "duration_s": None}]},
        id="restart-duration-nan",
    ),
    pytest.param(
        lambda: _with(last_decision={"t": T0, "reason": "change", "message": math.inf}),
        "last_decision.message",
        {"last_decision": {"t": T0, "reason": "change", "message": None}},
        id="decision-message-infinity",
    ),
    pytest.param(
        lambda: _with(live={"t": T0, "steps": 3, "source": "observation", "x": -math.inf}),
        "live.x",
        {"live": {"t": T0, "steps": 3, "source": "observation", "x": None}},
        id="live-field-minus-infinity",
    ),
    pytest.param(
        lambda: _with(gateway={"probe": {"t": math.nan, "problem": None}}),
        "gateway.probe.t",
        {"gateway": {"probe": {"t": None, "problem": None}}},
        id="gateway-probe-nan",
    ),
    pytest.param(
        lambda: _with(journal={"phase": "planned", "started_at": math.nan}),
        "journal.started_at",
        {"journal": None},  # and the freeze it had stays (see the test of a journal alone)
        id="journal-nan",
    ),
    # A time no clock specd ran under: 1e308 crashed every tick (datetime overflow).
    pytest.param(
        lambda: _with(restarts=[*populated().restarts, {"t": -1.0}]),
        "restarts[1].t: -1 is before 1970",
        {},
        id="restart-before-1970",
    ),
    pytest.param(
        lambda: _with(last_decision={"t": 1e308}),
        "last_decision.t: 1e+308 is past any time",
        {"last_decision": {}},
        id="decision-t-1e308",
    ),
    pytest.param(
        lambda: _with(last_decision={"t": "yesterday"}),
        "last_decision.t",
        {"last_decision": {}},
        id="decision-t-text",
    ),
    pytest.param(
        lambda: _with(live={"t": T0, "steps": 99, "source": "observation"}),
        "live",
        {"live": None},
        id="live-steps-99",
    ),
    pytest.param(
        lambda: _with(recommendations=[[T0 - 5, 99], [T0 + 86400 * 30, 3], [T0 - 10, 3]]),
        "recommendations[0]",
        {"recommendations": [[T0 - 10, 3]]},
        id="recommendation-99-steps-or-from-the-future",
    ),
    pytest.param(
        lambda: _with(explorations=[[1e308, 5], [-1e308, 5], [T0 - 86400, 2]]),
        "explorations[0].t",
        {"explorations": [[T0 - 86400, 2]]},
        id="exploration-t-1e308",
    ),
    pytest.param(
        lambda: _verifying(t=-1e308), "verifying: t", {"verifying": None}, id="verifying-t-1e308"
    ),
    pytest.param(
        lambda: _verifying(until=1e308),
        "verifying: until",
        {"verifying": None},
        id="verifying-until-1e308",
    ),
    pytest.param(
        lambda: _verifying(until=T0 - 86400),
        "verifying: until",
        {"verifying": None},
        id="verifying-until-before-its-change",
    ),
    pytest.param(
        lambda: _with(sglang_started_at=1e308),
        "sglang_started_at",
        {"sglang_started_at": None},
        id="started-1e308",
    ),
    pytest.param(
        lambda: _with(gateway={"probe": "ready", "last_drain": None}),
        "gateway.probe",
        {"gateway": None},
        id="gateway-probe-text",
    ),
    pytest.param(
        lambda: _with(gateway={"last_drain": {"t": T0, "duration_s": "long"}}),
        "gateway.last_drain.duration_s",
        {"gateway": None},
        id="gateway-drain-duration-text",
    ),
    pytest.param(
        lambda: _with(gateway={"left_out": {"t": T0, "tried_at": 1e308, "workers": []}}),
        "gateway.left_out.tried_at",
        {"gateway": None},
        id="gateway-left-out-tried-1e308",
    ),
    pytest.param(
        lambda: _with(gateway={"last_drain": {"t": T0, "readded_at": -1e308}}),
        "gateway.last_drain.readded_at",
        {"gateway": None},
        id="gateway-readded-at-1e308",
    ),
    # What no time that passed can hold: the model took 1e9 s at 3 steps for the truth
    # (and changed to it), a busy hour of 1e12 s for the coming epoch's traffic.
    pytest.param(
        lambda: _history_cells("throughput", [[3, 4], 1e9, 1e9 * 900.0]),
        "history.throughput[5]: 1e+09 s of weight is more time than it can hold",
        {"throughput34": None},
        id="throughput-cell-1e9-s",
    ),
    pytest.param(
        lambda: _hour(HOW, [64, 1e12]),
        "history.hourly[72][6]: 1e+12 s of weight",
        {},
        id="hour-cell-1e12-s",
    ),
    # Each cell possible, their sum not: which one lies is unknown, so the table goes.
    pytest.param(
        lambda: _history_cells("offered", *([k, 200_000.0] for k in range(10, 20))),
        "history.offered: its cells: 2.00",
        {"busy": 0.0},
        id="offered-sums-past-time",
    ),
    pytest.param(
        lambda: _history_cells("offered", [2, 1.0]),
        "history.offered[6]: a second cell for 2",
        {},
        id="offered-cell-twice",
    ),
    pytest.param(
        lambda: _history_table("offered", ref_t=1e308),
        "history.offered: ref_t: 1e+308 is past any time",
        {"busy": 0.0},
        id="offered-table-1e308",
    ),
    pytest.param(
        lambda: _with_history(sglang_started_at=1e308),
        "history.sglang_started_at",
        {},
        id="history-started-1e308",
    ),
    # Copied lines: specd writes each restart and exploration once; twice, they counted
    # twice against the day's budget and the week's explorations.
    pytest.param(
        lambda: _with(restarts=populated().restarts * 2),
        "restarts[1]: a second copy",
        {},
        id="restart-twice",
    ),
    pytest.param(
        lambda: _with(explorations=[[T0 - 3 * 86400, 5], [T0 - 86400, 2], [T0 - 3 * 86400, 5]]),
        "explorations[2]: a second copy",
        {},
        id="exploration-twice",
    ),
]


def test_every_bad_exploration_is_left_out_and_named(tmp_path: Path) -> None:
    good = [[T0 - 86400, 2], [T0 - 3600, 6]]
    bad = [[T0, 17], [T0, 4, 1], "4@T0", [T0, 4.5]]
    content = _with(explorations=[good[0], *bad, good[1]])
    (tmp_path / STATE_FILE).write_text(json.dumps(content))
    state, message = StateStore(tmp_path, clock=lambda: 1_767_229_200.9).load()
    assert state.explorations == good
    assert state.control().explorations == ((T0 - 86400, 2), (T0 - 3600, 6))
    assert message is not None
    assert "left out 4 bad entries" in message
    for index in (1, 2, 3):  # the first three named, then how many more
        assert f"explorations[{index}]: expected [t, steps]" in message
    assert "and 1 more" in message
    assert "\n" not in message


@pytest.mark.parametrize(("content", "problem", "expect"), SALVAGED)
def test_a_state_with_bad_parts_keeps_every_good_part(
    tmp_path: Path, content: Any, problem: str, expect: dict[str, Any]
) -> None:
    path = tmp_path / STATE_FILE
    path.write_text(json.dumps(content()))
    original = path.read_bytes()
    good = populated()
    state, message = StateStore(tmp_path, clock=lambda: 1_767_229_200.9).load()
    assert message is not None
    assert "\n" not in message
    assert problem in message
    assert "kept the rest" in message
    # Nothing is lost: the file as it was is kept for a post-mortem, and stays put.
    assert "state.json.corrupt-1767229200" in message
    assert (tmp_path / "state.json.corrupt-1767229200").read_bytes() == original
    assert path.read_bytes() == original
    for part in (
        "last_decision",
        "journal",
        "restarts",
        "frozen",
        "recommendations",
        "explorations",
        "verifying",
        "avoided",
        "sglang_started_at",
        "live",
        "gateway",
    ):
        want = expect.get(part, getattr(good, part))
        assert getattr(state, part) == want, part
    history, learned = state.history, good.history
    if expect.get("history") == "fresh":
        assert history.busy_seconds == 0
        return
    assert history.capacities == expect.get("capacity", learned.capacities)
    assert history.busy_seconds == pytest.approx(expect.get("busy", learned.busy_seconds))
    assert history.accept_length(4) == pytest.approx(
        expect.get("accept4", learned.accept_length(4))
    )
    for how in range(168):
        want_hour = expect.get("hourly", {}).get(how, learned.hour_of_week_weights(how))
        assert history.hour_of_week_weights(how) == pytest.approx(want_hour)
    assert history.accept_length(3) == expect.get("accept3", learned.accept_length(3))
    # Without its count of seconds measured, a step count's decayed seconds stand in.
    seen4 = expect.get("seen4", learned.accept_seen_s(4))
    assert history.accept_seen_s(4) == pytest.approx(
        learned.accept_seconds(4) if seen4 == "decayed" else seen4
    )
    assert history.throughput(3, 4) == expect.get("throughput34", learned.throughput(3, 4))
    assert history.throughput(4, 3) == pytest.approx(learned.throughput(4, 3))
    # The next save writes only what was kept, and the next load has nothing to say.
    store = StateStore(tmp_path, clock=lambda: 1_767_229_201.0)
    assert store.save(state) is None
    assert store.load()[1] is None


@pytest.mark.parametrize("behind_s", [2 * 86400, 365 * 86400])
def test_a_state_read_by_a_clock_behind_keeps_what_it_learned(
    tmp_path: Path, behind_s: float
) -> None:
    """A box whose RTC lost its battery boots days (or a year) behind, and specd.service
    can start before NTP sets it. Every time in state.json was then more than a day after
    "now": the history, the restart records, the explorations and the avoided settings were
    dropped (set aside in a copy never read again), learning began anew, and the restart
    made minutes before no longer counted against the budget. Each is kept; the daemon
    takes a time ahead of its clock as now (`records_ahead_of_clock`)."""
    (tmp_path / STATE_FILE).write_text(json.dumps(_state_dict()))
    now = T0 + 60 - behind_s
    state, message = StateStore(tmp_path, clock=lambda: now).load()
    assert message is None
    good = populated()
    for part in ("restarts", "recommendations", "explorations", "avoided", "journal", "live"):
        assert getattr(state, part) == getattr(good, part), part
    assert state.verifying is not None
    assert state.history.busy_seconds == pytest.approx(good.history.busy_seconds)
    assert state.history.last_t == now  # the sums as they were written, read as of now
    assert state.history.accept_length(4) == pytest.approx(good.history.accept_length(4))
    frozen = _with(frozen={"since": T0, "reason": "rolled back"})
    (tmp_path / STATE_FILE).write_text(json.dumps(frozen))
    state, message = StateStore(tmp_path, clock=lambda: now).load()
    assert message is None
    assert state.frozen == {"since": now, "reason": "rolled back"}  # not in the future


@pytest.mark.parametrize(
    ("frozen", "problem"),
    [
        ("yes", "frozen: expected null or an object"),
        # A reason that is no text crashed every tick (the decision's message is text).
        ({"since": T0, "reason": 5}, "frozen.reason: expected text, got 5"),
        ({"since": T0, "reason": {"why": "rollback"}}, "frozen.reason"),
        ({"since": T0, "reason": math.nan}, "frozen.reason"),
        ({"since": math.inf, "reason": "x"}, "frozen: expected null or an object"),
        ({"since": 1e308, "reason": "x"}, "frozen.since: 1e+308 is past any time"),
        ({"since": T0, "reason": "x", "by": -math.inf}, "frozen.by"),
    ],
    ids=[
        "text",
        "reason-a-number",
        "reason-an-object",
        "reason-nan",
        "since-infinity",
        "since-1e308",
        "field-minus-infinity",
    ],
)
def test_an_unreadable_freeze_stays_a_freeze(tmp_path: Path, frozen: Any, problem: str) -> None:
    # "Not frozen" would let specd restart SGLang after an operator-visible failure.
    (tmp_path / STATE_FILE).write_text(json.dumps(_with(frozen=frozen)))
    state, message = StateStore(tmp_path, clock=lambda: 1_767_229_200.0).load()
    assert message is not None
    assert problem in message
    assert state.frozen is not None
    assert state.control().frozen
    assert isinstance(state.control().frozen_reason, str)
    if "by" in frozen:  # one bad field of a good freeze: that field only
        assert state.frozen == {**frozen, "by": None}
    else:
        assert state.frozen["since"] == 1_767_229_200.0
        assert "specd unfreeze" in state.frozen["reason"]
    assert state.restarts == populated().restarts
    store = StateStore(tmp_path, clock=lambda: 1_767_229_201.0)
    assert store.save(state) is None
    assert store.load()[1] is None


@pytest.mark.parametrize(
    "journal",
    [[1], "env_written", {"phase": "restart_issued", "started_at": math.inf}],
    ids=["list", "text", "infinity"],
)
def test_an_unreadable_restart_journal_is_a_freeze(tmp_path: Path, journal: Any) -> None:
    # The restart it records may have been cut short anywhere: as the applier does with a
    # journal it cannot read, specd leaves SGLang and the env file alone and waits for an
    # operator, rather than forget it and go on deciding (and restarting).
    (tmp_path / STATE_FILE).write_text(json.dumps(_with(journal=journal, frozen=None)))
    state, message = StateStore(tmp_path, clock=lambda: 1_767_229_200.0).load()
    assert message is not None
    assert "journal" in message
    assert state.journal is None
    assert state.frozen is not None
    assert state.frozen["since"] == 1_767_229_200.0
    assert "restart journal specd cannot read" in state.frozen["reason"]
    assert "specd unfreeze" in state.frozen["reason"]
    assert state.control().frozen
    assert state.restarts == populated().restarts


NOW = 1_767_229_200.0  # T0 + 1 h


@pytest.mark.parametrize(
    ("entries", "times", "problem"),
    [
        pytest.param(
            [{"t": NOW - 90, "result": "rolled_back"}, {"t": NOW - 30, "result": "success"}],
            (NOW - 90, NOW - 30),
            None,
            id="a file from before specd counted restarts: one each, as then",
        ),
        pytest.param(
            [
                {"t": NOW - 90, "result": "rolled_back", "restarts": 2},
                {"t": NOW - 60, "result": "success", "restarts": 1},
                {"t": NOW - 30, "result": "failed", "restarts": 0},
            ],
            (NOW - 90, NOW - 90, NOW - 60),
            None,
            id="a rollback two, a change one, a sequence that restarted nothing none",
        ),
        pytest.param(
            [{"t": NOW - 30, "result": "success", "restarts": 7}],
            (NOW - 30,),
            "restarts[0].restarts: 7 is no count of 0..2 (counted 1)",
            id="a count no sequence makes: one, named",
        ),
        pytest.param(
            [{"t": NOW - 30, "result": "success", "restarts": True}],
            (NOW - 30,),
            "restarts[0].restarts: True is no count of 0..2 (counted 1)",
            id="a count that is no number: one, named",
        ),
    ],
)
def test_the_restart_budget_counts_sglang_restarts_and_old_state_files_still_load(
    tmp_path: Path, entries: list[dict[str, Any]], times: tuple[float, ...], problem: str | None
) -> None:
    """Dwell and the daily budget (Control.restart_times) count one time per SGLang restart
    a sequence made, as its entry says; an entry written before specd said (every one then)
    counts one, as it did."""
    (tmp_path / STATE_FILE).write_text(json.dumps(_with(restarts=entries)))
    store = StateStore(tmp_path, clock=lambda: NOW)
    state, message = store.load()
    if problem is None:
        assert message is None
    else:
        assert message is not None
        assert problem in message
    assert state.control().restart_times == times
    assert len(state.restarts) == len(entries)  # nothing dropped, a bad count included
    assert store.save(state) is None
    again, message = StateStore(tmp_path, clock=lambda: NOW).load()
    assert (again.control().restart_times, message) == (times, None)


@pytest.mark.parametrize(
    ("entries", "spent"),
    [
        pytest.param([], 0, id="none"),
        pytest.param(
            [{"t": NOW - 86_400, "result": "success", "restarts": 1}],
            0,
            id="exactly a day ago: out of the day",
        ),
        pytest.param(
            [{"t": NOW - 86_399, "result": "success", "restarts": 1}],
            1,
            id="a second less: in it",
        ),
        pytest.param(
            [
                {"t": NOW - 90_000, "result": "success", "restarts": 1},
                {"t": NOW - 600, "result": "rolled_back", "restarts": 2},
                {"t": NOW - 60, "result": "aborted", "restarts": 0},
            ],
            2,
            id="a rollback's two; yesterday's and a sequence that restarted nothing none",
        ),
    ],
)
def test_restarts_in_day_is_what_the_budget_counts(
    entries: list[dict[str, Any]], spent: int
) -> None:
    """`specd status` and specd_restart_budget_remaining read the day's restarts here."""
    state = State.from_dict(_with(restarts=entries))
    assert state.restarts_in_day(NOW) == spent


def test_strict_reading_still_names_the_first_bad_part() -> None:
    with pytest.raises(StateFormatError, match=r"capacity"):
        State.from_dict(_with_history(capacity=[[3, -5]]))


def test_a_state_path_that_is_a_directory_is_moved_aside(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).mkdir()
    _, problem = StateStore(tmp_path, clock=lambda: 5.0).load()
    assert problem is not None
    assert "unreadable" in problem
    assert "corrupt-5" in problem
    assert (tmp_path / "state.json.corrupt-5").is_dir()


def test_state_format_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="expected a JSON object"):
        State.from_dict("nope")
    assert issubclass(StateFormatError, ValueError)


# -- failures to write: real full and read-only filesystems ----------------------------
@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "fs", "256k") as mount_point:
        yield mount_point


def test_a_full_disk_is_a_one_line_error_and_keeps_the_old_state(tmpfs: Path) -> None:
    store = StateStore(tmpfs)
    assert store.save(populated()) is None
    before = (tmpfs / STATE_FILE).read_bytes()
    fd = os.open(tmpfs / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    error = store.save(populated())
    assert error is not None
    assert "No space left on device" in error
    assert "\n" not in error
    assert (tmpfs / STATE_FILE).read_bytes() == before
    assert leftovers(tmpfs) == []


def test_a_read_only_filesystem_is_a_one_line_error(tmpfs: Path) -> None:
    store = StateStore(tmpfs)
    assert store.save(populated()) is None
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    error = store.save(populated())
    assert error is not None
    assert "Read-only file system" in error
    state, problem = store.load()
    assert problem is None
    assert state.to_dict() == populated().to_dict()


def test_a_corrupt_state_on_a_read_only_filesystem_still_starts_fresh(tmpfs: Path) -> None:
    (tmpfs / STATE_FILE).write_text('{"version": 1')
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    state, problem = StateStore(tmpfs).load()
    assert problem is not None
    assert "could not move it aside" in problem
    assert "Read-only file system" in problem
    assert state.to_dict() == State().to_dict()


def test_a_state_dir_that_is_a_file_is_a_one_line_error(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    store = StateStore(not_a_dir)
    error = store.save(populated())
    assert error is not None
    assert error.startswith(f"cannot write {not_a_dir / STATE_FILE}: ")
    assert "\n" not in error
    state, problem = store.load()
    assert problem is not None
    assert "Not a directory" in problem
    assert state.to_dict() == State().to_dict()


def test_unwritable_directory_for_non_root(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions; the read-only tmpfs test covers this")
    tmp_path.chmod(0o500)
    try:
        error = StateStore(tmp_path).save(populated())
    finally:
        tmp_path.chmod(0o700)
    assert error is not None
    assert "Permission denied" in error


# -- hostile files: deep nesting, FIFOs, devices, huge files, links --------------------------
def _plant(kind: str, path: Path) -> None:
    if kind == "deep-json":
        path.write_text("[" * 100_000)
    elif kind == "deep-object":
        path.write_text('{"version": 1, "last_decision": ' + '{"a": ' * 5000 + "1" + "}" * 5001)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        with socket.socket(socket.AF_UNIX) as listening:
            listening.bind(str(path))  # the socket file stays: open() says ENXIO
    elif kind == "huge":
        with path.open("wb") as handle:
            handle.truncate(300 * 1024**2)  # the 300 MB state of issue 11, sparse
    elif kind == "link-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "link-to-state":
        real = path.with_name("real.json")
        real.write_text(json.dumps(populated().to_dict()))
        path.symlink_to(real)


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("deep-json", "invalid JSON: nested deeper than"),
        ("deep-object", "invalid JSON: nested deeper than"),
        ("fifo", "is not a regular file (a FIFO)"),
        ("socket", "No such device or address"),
        ("huge", "larger than the 16 MiB allowed"),
        ("link-dev-zero", "is a symbolic link"),
        ("link-to-state", "is a symbolic link"),
    ],
)
def test_a_hostile_state_file_is_moved_aside_within_a_second(
    tmp_path: Path, kind: str, problem: str
) -> None:
    path = tmp_path / STATE_FILE
    _plant(kind, path)
    started = time.monotonic()
    state, message = StateStore(tmp_path, clock=lambda: 7.0).load()
    assert time.monotonic() - started < 1.0
    assert message is not None
    assert problem in message
    assert "\n" not in message
    assert "moved to state.json.corrupt-7" in message
    assert state.to_dict() == State().to_dict()
    # Moved aside itself (a link stays a link; /dev/zero and real.json are untouched).
    assert not os.path.lexists(path)
    assert os.path.lexists(tmp_path / "state.json.corrupt-7")
    if kind == "link-to-state":
        assert json.loads((tmp_path / "real.json").read_text()) == populated().to_dict()


def test_read_json_is_bounded_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text("[1]")
    assert read_json(path) == [1]
    with pytest.raises(ValueError, match=r"x.json: is 3 bytes, larger than the 2 bytes allowed"):
        read_json(path, max_bytes=2)
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "none.json")


def test_a_save_replaces_a_planted_symlink_not_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / STATE_FILE).symlink_to(victim)
    assert StateStore(tmp_path).save(populated()) is None
    assert victim.read_text() == "keep"
    assert not (tmp_path / STATE_FILE).is_symlink()
    assert stat.S_IMODE((tmp_path / STATE_FILE).stat().st_mode) == STATE_FILE_MODE


def test_a_history_learned_under_a_longer_half_life_loads_whole_under_a_shorter_one(
    tmp_path: Path,
) -> None:
    # A year at one concurrency under a 90-day half-life weighs ~1e7 s: the most a 1-hour
    # half-life holds is ~3e4 s. What no time holds is refused; what a config change since
    # leaves is kept, scaled to what the new half-life holds (its means and mix unchanged).
    long = HistorySettings(half_life_s=90 * 86400.0, scrape_interval_s=3600.0, warmup_exclude_s=0)
    history = History(long)
    for i in range(400 * 24):
        history.record(obs(T0 + 3600.0 * i, running=2))
    now = T0 + 3600.0 * 400 * 24
    short = HistorySettings(half_life_s=3600.0)
    StateStore(tmp_path, history_settings=long).save(State(history=history))
    for _ in range(2):  # loaded, saved, loaded again
        store = StateStore(tmp_path, history_settings=short, clock=lambda: now)
        state, problem = store.load()
        assert problem is None
        assert state.history.accept_length(4) == pytest.approx(2.6)
        assert state.history.throughput(4, 2) == pytest.approx(150.0)
        assert 0 < state.history.busy_seconds <= 2 * (3600.0 / math.log(2) + 7200.0)
        assert store.save(state) is None
    # A reload (SIGHUP) to the shorter half-life, then a restart of specd: the same.
    history.reconfigure(short)
    StateStore(tmp_path, history_settings=short).save(State(history=history))
    assert StateStore(tmp_path, history_settings=short, clock=lambda: now).load()[1] is None


def test_running_values_that_swing_every_second_keep_the_state_small(tmp_path: Path) -> None:
    # Half a day of scrapes a second, each with another queue length (a batch queue
    # draining, refilled): every length was a cell kept for weeks, ~5 MB a day of state
    # rewritten every minute, past the 16 MiB the next start reads within days (which then
    # moved it aside: everything learned lost).
    history = History(HistorySettings(scrape_interval_s=1.0, warmup_exclude_s=0))
    for i in range(43_200):
        queued = (i * 7919) % 100_000 if i % 2 else 0
        history.record(
            make_observation(T0 + i, running=13, queued=queued, steps=4, gen_throughput=900.0)
        )
    store = StateStore(tmp_path, clock=lambda: T0 + 43_200)
    started = time.perf_counter()
    assert store.save(State(history=history)) is None
    took = time.perf_counter() - started
    size = (tmp_path / STATE_FILE).stat().st_size
    assert size < 512 * 1024, size
    assert took < 2.0  # ~0.05 s here; it was seconds, in the daemon's loop
    state, problem = store.load()
    assert problem is None
    assert state.history.busy_seconds == pytest.approx(history.busy_seconds)


def test_recommendations_are_kept_where_they_change_and_stabilize_as_before() -> None:
    # The step appends one at every tick and drops them only past the stabilization
    # window: a week's window at a scrape a second kept 600,000 (16 MiB). Only where the
    # recommendation changes says anything to the stabilization check, and it says the same.
    rng = random.Random(12)
    for _ in range(300):
        window = rng.choice([0.0, 30.0, 900.0])
        every: Control = Control(current_steps=3)
        state = State()
        t = T0
        for _ in range(40):
            t += rng.choice([1.0, 5.0, 60.0, 600.0])
            steps = rng.choice([3, 3, 3, 4, 0, -5])
            every = every.with_recommendation(t, steps, window)
            state.adopt(state.control().with_recommendation(t, steps, window))
            for target in (3, 4, 0, -5):
                held = _held_for(every.recommendations, target, t)
                kept = _held_for(state.control().recommendations, target, t)
                assert min(held, window) == min(kept, window)
    week = State()
    for i in range(10_000):
        week.adopt(week.control().with_recommendation(T0 + i, 4, 7 * 86400.0))
    assert week.recommendations == [[T0, 4]]


@pytest.mark.parametrize(
    ("parts", "held"),
    [
        ({"version": STATE_VERSION + 1}, "a freeze and a restart journal"),
        ({"version": STATE_VERSION + 1, "journal": None}, "a freeze"),
        ({"version": "2", "frozen": None}, "a restart journal"),
        ({"version": 0, "frozen": "yes", "journal": None}, "a freeze"),
    ],
    ids=["newer-frozen-mid-restart", "newer-frozen", "version-text-mid-restart", "version-0"],
)
def test_a_file_from_a_newer_specd_is_set_aside_and_its_freeze_still_holds(
    tmp_path: Path, parts: dict[str, Any], held: str
) -> None:
    # A rollback to this specd from a newer one: it cannot read what the newer one wrote,
    # so it starts over, the file kept aside for the newer one. A freeze in it (or a restart
    # it was in the middle of, whose env file it cannot judge) still holds specd back.
    path = tmp_path / STATE_FILE
    path.write_text(json.dumps({**_state_dict(), **parts}))
    original = path.read_bytes()
    store = StateStore(tmp_path, clock=lambda: 1_767_229_200.9)
    state, message = store.load()
    assert message is not None
    assert "moved to state.json.corrupt-1767229200" in message
    assert f"it held {held}: frozen until specd unfreeze" in message
    assert (tmp_path / "state.json.corrupt-1767229200").read_bytes() == original
    assert state.frozen is not None
    # Since the freeze in the file began, where it says so; else since this load.
    frozen = {**_state_dict(), **parts}["frozen"]
    since = frozen["since"] if isinstance(frozen, dict) else 1_767_229_200.9
    assert state.frozen["since"] == since
    assert f"state.json held {held} in a file specd cannot read" in state.frozen["reason"]
    assert "specd unfreeze" in state.frozen["reason"]
    assert state.journal is None
    assert state.history.busy_seconds == 0
    # Saved as this specd's, frozen: the next start, status and unfreeze read it so.
    assert store.save(state) is None
    again, problem = store.load()
    assert problem is None
    assert again.frozen == state.frozen


def test_parts_a_newer_specd_wrote_are_kept_through_a_save(tmp_path: Path) -> None:
    """A newer specd ran here, then this one (rolled back): the parts it does not know were
    dropped at its first save, with no word and no copy, so going forward again had lost
    them (a newer specd's fleet marker, say). They are written back as they were read."""
    newer = {"fleet_marker": {"key": "/specd/g/out/box", "until": T0 + 600}, "notes": ["x", 2]}
    (tmp_path / STATE_FILE).write_text(json.dumps(_with(**newer)))
    store = StateStore(tmp_path, clock=lambda: T0 + 60)
    state, problem = store.load()
    assert problem is None
    assert state.restarts == populated().restarts
    assert store.save(state) is None
    written = json.loads((tmp_path / STATE_FILE).read_text())
    assert {k: written[k] for k in newer} == newer
    # One that no save could write (Python's json reads NaN) is read as null, and named.
    (tmp_path / STATE_FILE).write_text(json.dumps(_with(extra={"a": math.nan})))
    state, problem = store.load()
    assert state.unknown == {"extra": {"a": None}}
    assert problem is not None
    assert "extra.a: nan is not a number JSON can hold (read as null)" in problem


def test_a_state_too_big_for_the_next_start_is_not_written(tmp_path: Path) -> None:
    """The next start reads at most MAX_STATE_BYTES: a bigger file it would set aside whole
    (what was learned, a freeze, a restart's journal). Such a save writes nothing and says
    why, and the file keeps the last state that fit; a state at the bound is written."""
    store = StateStore(tmp_path, clock=lambda: T0)
    assert store.save(populated()) is None
    before = (tmp_path / STATE_FILE).read_bytes()
    fits = populated()
    room = MAX_STATE_BYTES - len(encode_json({**fits.to_dict(), "pad": ""}))
    over = populated()
    over.unknown = {"pad": "x" * (room + 1)}
    error = store.save(over)
    assert error is not None
    assert error.startswith(f"cannot write {tmp_path / STATE_FILE}: 16 MiB of state, over the ")
    assert error.endswith("16 MiB a start reads; the file keeps the last state that fit")
    assert (tmp_path / STATE_FILE).read_bytes() == before
    assert leftovers(tmp_path) == []
    fits.unknown = {"pad": "x" * room}
    assert store.save(fits) is None
    assert (tmp_path / STATE_FILE).stat().st_size == MAX_STATE_BYTES
    state, problem = store.load()
    assert problem is None
    assert state.unknown == fits.unknown


def _status_file(path: Path, kind: str) -> None:
    decision = {"t": T0 + 60, "reason": "no_data", "message": "m", "target_steps": None}
    live = {"t": T0 + 60, "steps": None, "source": "observation"}
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to("/etc/passwd")
    elif kind == "huge":
        path.write_text(json.dumps({"last_decision": {**decision, "message": "x" * 300_000}}))
    else:
        path.write_text(
            {
                "garbage": "{not json",
                "a list": "[]",
                "no time": json.dumps({"last_decision": {"reason": "no_data"}}),
                "time NaN": '{"last_decision": {"t": NaN, "reason": "no_data"}}',
                "time absurd": json.dumps({"last_decision": {**decision, "t": 1e300}}),
                "bad live": json.dumps({"last_decision": decision, "live": {"t": "soon"}}),
                "both": json.dumps({"last_decision": decision, "live": live}),
            }[kind]
        )


@pytest.mark.parametrize(
    ("kind", "parts"),
    [
        ("absent", set()),
        ("fifo", set()),
        ("directory", set()),
        ("symlink", set()),
        ("huge", set()),
        ("garbage", set()),
        ("a list", set()),
        ("no time", set()),
        ("time NaN", set()),
        ("time absurd", set()),
        ("bad live", {"last_decision"}),
        ("both", {"last_decision", "live"}),
    ],
)
def test_a_status_file_gives_status_its_valid_parts_and_nothing_else(
    tmp_path: Path, kind: str, parts: set[str]
) -> None:
    """status.json (the last decision and what runs, written at each change of either) is
    read by `specd status` over state.json's where newer: whatever sits there, it reads
    only valid parts, at once (a FIFO never blocks it), and never fails for it."""
    path = tmp_path / STATUS_FILE
    if kind != "absent":
        _status_file(path, kind)
    started = time.monotonic()
    found = read_status(path)
    assert time.monotonic() - started < 1.0
    assert set(found) == parts
    state = populated()
    state.last_decision, state.live = {"t": T0, "reason": "change"}, None
    with_status(state, found)
    assert state.last_decision["reason"] == ("no_data" if parts else "change")
    # Older than what state.json holds: state.json's stands.
    newer = {"t": T0 + 120, "reason": "frozen"}
    state.last_decision = newer
    with_status(state, found)
    assert state.last_decision == newer
