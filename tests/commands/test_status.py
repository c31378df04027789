"""specd status: which settings specd may choose on the running SGLang, and why not."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from factories import FAST_TWIN_VERSION_ARGS, make_observation
from hypothesis import given, settings
from hypothesis import strategies as st
from version_twins import VersionTwins

from specd.commands.doctor import Doctor
from specd.commands.status import collect, daemon, render, server_info
from specd.core.acceptance import accept_length_from_alpha
from specd.core.history import History, HistorySettings
from specd.core.outcome import Avoided, ChangeSnapshot
from specd.core.setting import adaptive, setting_key
from specd.io.apply import Journal
from specd.io.config import load_config
from specd.io.runner import SubprocessRunner
from specd.io.sglang import SGLangClient
from specd.io.state import LOCK_FILE, STATE_VERSION, State, StateStore
from specd.twin.process import TwinProcess, free_port

NOW = 1_764_000_000.0


def config_file(tmp_path: Path, url: str, kinds: str, policy: str = "model") -> Path:
    """The model policy unless told: the one that chooses among kinds of setting."""
    path = tmp_path / "specd.toml"
    path.write_text(
        f'[sglang]\nurl = "{url}"\nenv_file = "{tmp_path}/sglang.env"\n'
        f'[files]\nstate_dir = "{tmp_path}"\noverride_file = "{tmp_path}/override.toml"\n'
        f'[choose]\npolicy = "{policy}"\nkinds = {kinds}\n'
    )
    return path


@pytest.mark.parametrize(
    ("version", "lines"),
    [
        (
            "0.5.23",
            [
                "choices        off: offered (no speculation)",
                "               static: offered (steps 1-6)",
                "               adaptive: offered (adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;"
                "64=0 adaptive:1,3 adaptive:2,4 adaptive:3,4 adaptive:1,2,3)",
            ],
        ),
        (
            "0.5.11",
            [
                "choices        off: offered (no speculation)",
                "               static: offered (steps 1-6)",
                "               adaptive: not offered: needs SGLang >= 0.5.13 (per-batch "
                "slots); the server runs 0.5.11",
            ],
        ),
    ],
)
def test_status_names_the_choices_on_the_running_server(
    tmp_path: Path, version_twins: VersionTwins, version: str, lines: list[str]
) -> None:
    twin = version_twins(version)
    config = load_config(config_file(tmp_path, twin.url, '["off", "static", "adaptive"]'))
    info = collect(config, NOW, server_info(config))
    text = render(info, NOW)
    assert "\n".join(lines) in text, text
    assert info["choices"]["kinds"]["static"] is None
    assert info["choices"]["server_problem"] is None


def test_status_under_the_bands_policy_names_static_only(
    tmp_path: Path, version_twins: VersionTwins
) -> None:
    """The bands policy (no calibration: the default install) picks a static K only."""
    twin = version_twins("0.5.23")
    path = config_file(tmp_path, twin.url, '["off", "static", "adaptive"]', policy="bands")
    config = load_config(path)
    info = collect(config, NOW, server_info(config))
    why = (
        'the bands policy picks a static step count only (policy "model", which a '
        "calibration_file selects, chooses among every kind)"
    )
    assert info["choices"]["kinds"] == {"off": why, "static": None, "adaptive": why}
    assert f"choices        off: not offered: {why}\n" in render(info, NOW)


def test_status_names_what_the_calibration_and_the_unit_leave_out(
    tmp_path: Path, version_twins: VersionTwins
) -> None:
    calibration = tmp_path / "cal.csv"
    calibration.write_text(
        "steps,concurrency,output_tok_s,setting\n"
        + "".join(f"{k},1,{100 + k},\n" for k in (1, 2, 3, 4))
        # adaptive:3,4 swept at one request: 90 tok/s where its best candidate's row says 104.
        + '4,1,90,"adaptive:3,4"\n'
    )
    twin = version_twins("0.5.23")
    path = config_file(tmp_path, twin.url, '["off", "static", "adaptive"]')
    path.write_text(path.read_text() + f'calibration_file = "{calibration}"\n')
    config = load_config(path)
    info = collect(config, NOW, server_info(config))
    wired = "sglang.service's ExecStart= reads ${SPECULATIVE_NUM_STEPS}"
    static_only = collect(config, NOW, server_info(config), wired)
    text = render(info, NOW)
    assert "choices        off: not offered: the calibration has no steps-0 row\n" in text
    assert "adaptive: offered (adaptive:1,3 adaptive:2,4 adaptive:3,4 adaptive:1,2,3)" in text
    assert (
        "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0: not offered: the calibration has no "
        "rows for steps 0,5,7"
    ) in text
    assert static_only["choices"]["kinds"] == {"off": wired, "static": None, "adaptive": wired}
    said = "adaptive:3,4: swept: predicted at 0.865 × its candidates' rows until it has served"
    assert f"               {said} here\n" in text
    # Where the unit takes step counts only, no set is offered: the sweep is read by nothing.
    assert "adaptive:3,4: swept, but not offered" in "\n".join(static_only["choices"]["lines"])


def test_status_says_when_sglang_did_not_answer(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    config = load_config(config_file(tmp_path, f"http://127.0.0.1:{port}", '["static"]'))
    info = collect(config, NOW, server_info(config))
    text = render(info, NOW)
    assert "choices        off: not offered: not in [choose] kinds (static)\n" in text
    assert "               static: offered (steps 1-6)\n" in text
    assert f"(http://127.0.0.1:{port} did not answer /server_info: " in text


ADAPTIVE_34 = adaptive((3, 4))


def test_status_names_each_avoided_setting_as_the_operator_writes_it(tmp_path: Path) -> None:
    # An adaptive set's key is a hash: shown bare it says nothing at 3 a.m.
    port = free_port()
    config = load_config(config_file(tmp_path, f"http://127.0.0.1:{port}", '["static"]'))
    mix = ((2, 1.0),)
    avoided = [
        Avoided(4, NOW - 3600, mix, 0.05, 3),
        Avoided(setting_key(ADAPTIVE_34), NOW - 1800, mix, 0.031, 3, setting=ADAPTIVE_34),
        Avoided(
            0,
            NOW - 900,
            mix,
            0.2,
            setting_key(ADAPTIVE_34),
            from_setting=ADAPTIVE_34,
        ),
    ]
    assert StateStore(tmp_path).save(State(avoided=avoided)) is None
    info = collect(config, NOW, server_info(config))
    text = render(info, NOW)
    shown = [
        line.split(" (regression")[0] for line in text.splitlines() if line.startswith("avoided")
    ]
    assert shown == [
        "avoided        4 steps: served 5.0% less than 3",
        "avoided        adaptive:3,4: served 3.1% less than 3",
        "avoided        off: served 20.0% less than adaptive:3,4",
    ]
    # Until then only for traffic like it regressed under: the daemon runs it again where
    # the traffic moves (status said "until …" alone while specd restarted into it).
    lines = [line for line in text.splitlines() if line.startswith("avoided")]
    assert all(
        line.endswith(
            ", for traffic like it regressed under (offered 2 (100%)): where the mix moves "
            "more than regression_lift_mix_ratio 0.5 from it, specd may run it again"
        )
        for line in lines
    ), lines
    named = [
        (e["steps"], e["from_steps"], e["setting"], e["from_setting"]) for e in info["avoided"]
    ]
    assert named == [
        (4, 3, "4", "3"),
        (None, 3, "adaptive:3,4", "3"),
        (0, None, "off", "adaptive:3,4"),
    ]


@pytest.mark.parametrize(
    ("live", "decision", "shown"),
    [
        # Under SGLang's adaptive mode there is no step count: the set is what runs.
        (
            {"steps": None, "setting": "adaptive:2,4"},
            {"target_steps": None, "target_setting": "adaptive:2,4"},
            ("adaptive:2,4", "adaptive:2,4"),
        ),
        ({"steps": 0, "setting": "off"}, {"target_steps": 3, "target_setting": "3"}, ("off", "3")),
        # A state file from before names step counts only.
        ({"steps": 0}, {"target_steps": 4}, ("off", "4")),
        ({"steps": None}, {}, ("?", "?")),
    ],
)
def test_status_shows_what_runs_and_what_specd_wants_as_settings(
    tmp_path: Path, live: dict[str, object], decision: dict[str, object], shown: tuple[str, str]
) -> None:
    port = free_port()
    config = load_config(config_file(tmp_path, f"http://127.0.0.1:{port}", '["static"]'))
    last = {"t": NOW - 60, "reason": "within_tolerance", "message": "m", **decision}
    state = State(live={"t": NOW - 60, "source": "observation", **live}, last_decision=last)
    assert StateStore(tmp_path).save(state) is None
    text = render(collect(config, NOW, server_info(config)), NOW)
    assert f"steps live     {shown[0]} (observation" in text
    assert f"target         {shown[1]}\n" in text


def test_status_counts_the_sglang_restarts_the_budget_counts(tmp_path: Path) -> None:
    """A rollback is two SGLang restarts; SGLang found untouched, none; an entry from before
    specd counted them, one. `restarts 24h` counted entries: 4, where SGLang was restarted
    5 times."""
    port = free_port()
    config = load_config(config_file(tmp_path, f"http://127.0.0.1:{port}", '["static"]'))
    restarts = [
        {"t": NOW - 7200, "result": "success"},
        {"t": NOW - 3600, "result": "rolled_back", "restarts": 2},
        {"t": NOW - 1800, "result": "rolled_back", "restarts": 2},
        {"t": NOW - 600, "result": "rolled_back", "restarts": 0},
        {"t": NOW - 2 * 86400, "result": "success", "restarts": 1},  # a day ago: free
    ]
    assert StateStore(tmp_path).save(State(restarts=restarts)) is None
    info = collect(config, NOW, server_info(config))
    assert (info["sglang_restarts_last_24h"], info["restart_budget_remaining"]) == (5, 0)
    assert "restarts 24h   5 (budget left 0)\n" in render(info, NOW)


def _measured(seconds: float, days_after: float) -> History:
    """``seconds`` of accept lengths at 3 steps (α 0.636), then ``days_after`` days of an
    adaptive set, which reports none of a step count."""
    history = History(HistorySettings(warmup_exclude_s=0))
    length = accept_length_from_alpha(0.636, 3)
    t = NOW - days_after * 86400 - seconds
    while t < NOW - days_after * 86400:
        history.record(make_observation(t, running=2, steps=3, accept_length=length))
        t += 5
    if days_after:
        history.record(make_observation(NOW, running=2, steps=3, accept_length=2.0, adaptive=True))
    return history


@pytest.mark.parametrize(
    ("seconds", "days_after", "alpha", "line"),
    [
        (0.0, 0.0, None, "acceptance     the sweep's: none measured yet"),
        (
            60.0,
            0.0,
            None,
            "acceptance     the sweep's: 60 s measured of the 5.0 min needed (3 steps 2.30 tokens "
            "per verify over 60 s)",
        ),
        # A week on a set: days old, what this box accepts is still newer than the sweep.
        (
            3 * 3600.0,
            7.0,
            0.636,
            "acceptance     α 0.636 measured here (3 steps 2.30 tokens per verify over 3.0 h): "
            "every step count is predicted with it",
        ),
    ],
)
def test_status_says_what_specd_measured_of_the_acceptance(
    tmp_path: Path, seconds: float, days_after: float, alpha: float | None, line: str
) -> None:
    port = free_port()
    config = load_config(config_file(tmp_path, f"http://127.0.0.1:{port}", '["static"]'))
    assert StateStore(tmp_path).save(State(history=_measured(seconds, days_after))) is None
    info = collect(config, NOW, server_info(config))
    assert info["acceptance"]["alpha"] == (
        None if alpha is None else pytest.approx(alpha, abs=1e-6)
    )
    assert line in render(info, NOW).splitlines()


@pytest.mark.parametrize(
    ("override", "line", "mode"),
    [
        (None, None, "auto"),
        ('mode = "auto"\n', "override       auto: specd decides", "auto"),
        (
            'mode = "pin"\nsteps = 3\nexpires_at = 2099-01-01T00:00:00Z\nreason = "eval"\n',
            "override       pin 3 steps until 2099-01-01T00:00:00+00:00 (in 640808.0 h): eval",
            "pin",
        ),
        (
            'mode = "pin"\nsetting = "adaptive:3,4"\nexpires_at = 2099-01-01T00:00:00Z\n',
            "override       pin adaptive:3,4 until 2099-01-01T00:00:00+00:00 (in 640808.0 h)",
            "pin",
        ),
        (
            'mode = "freeze"\nexpires_at = 2099-01-01T00:00:00Z\nreason = "a \\u001b[2J b"\n',
            "override       freeze until 2099-01-01T00:00:00+00:00 (in 640808.0 h): a \\x1b[2J b",
            "freeze",
        ),
        (
            # NOW is 2025-11-24T16:00:00Z: expired two hours before.
            'mode = "pin"\nsteps = 4\nexpires_at = 2025-11-24T14:00:00Z\nreason = "night"\n',
            "override       pin 4 steps EXPIRED 2.0 h ago (2025-11-24T14:00:00+00:00): night; "
            "specd decides by itself: delete the file or `specd override clear`",
            "auto",
        ),
        (
            'mode = "pinned"\n',
            "override       INVALID, ignored (specd keeps its last good state): ",
            None,
        ),
    ],
)
def test_status_says_what_the_override_file_holds(
    tmp_path: Path, override: str | None, line: str | None, mode: str | None
) -> None:
    port = free_port()  # nothing listens there
    config = load_config(config_file(tmp_path, f"http://127.0.0.1:{port}", '["static"]'))
    if override is not None:
        (tmp_path / "override.toml").write_text(override)
        (tmp_path / "override.toml").chmod(0o644)
    info = collect(config, NOW, server_info(config))
    text = render(info, NOW)
    assert info["mode"] == mode
    if line is None:
        assert "override " not in text
    else:
        assert line in text, text
        assert "\x1b" not in text
        assert "None" not in text.split("override       ", 1)[1].splitlines()[0]


@pytest.mark.parametrize(
    ("part", "value", "named"),
    [
        ("last_decision", {"t": 1e308, "reason": "change", "message": "4 → 3"}, "last_decision.t"),
        ("last_decision", {"t": "now", "reason": "change"}, "last_decision.t"),
        ("live", {"t": 1e308, "steps": 3, "source": "observation"}, "live.t"),
        ("live", {"t": NOW, "steps": 3, "source": "observation", "x": float("nan")}, "live.x"),
        ("frozen", {"since": -1e308, "reason": "restart failed"}, "frozen.since"),
        (
            "avoided",
            [{"steps": 5, "t": 1e308, "from_steps": 4, "shortfall_ratio": 0.1, "mix": [[2, 1]]}],
            "avoided[0]: t",
        ),
    ],
    ids=[
        "decided-1e308",
        "decided-text",
        "live-1e308",
        "live-nan",
        "frozen-1e308",
        "avoided-1e308",
    ],
)
def test_status_reads_a_damaged_state_as_the_daemon_does(
    tmp_path: Path, part: str, value: object, named: str
) -> None:
    # A time past what a date can show crashed `specd status` with a traceback, and a NaN
    # made `specd status --json` print what is not JSON.
    config = load_config(config_file(tmp_path, "http://127.0.0.1:9", '["static"]'))
    data = State(last_decision={"t": NOW - 60, "reason": "within_tolerance"}).to_dict()
    data[part] = value
    (tmp_path / "state.json").write_text(json.dumps(data))
    info = collect(config, NOW, "down")
    text = render(info, NOW)
    assert info["state_unreadable"]
    assert named in info["state_problem"]
    assert "state          " in text
    json.dumps(info, allow_nan=False, default=str)


def test_status_shows_text_from_the_state_without_acting_on_the_terminal(tmp_path: Path) -> None:
    # A restart's failure message carries what systemctl and SGLang said; a hand edit,
    # anything: printed raw, an escape clears or retitles the on-call's terminal.
    config = load_config(config_file(tmp_path, "http://127.0.0.1:9", '["static"]'))
    frozen = {"since": NOW - 60, "reason": "restart failed: \x1b[2Jgone"}
    decision = {"t": NOW - 5, "reason": "frozen", "message": "held\x1b]0;pwned\x07\nnext line"}
    assert StateStore(tmp_path).save(State(frozen=frozen, last_decision=decision)) is None
    text = render(collect(config, NOW, "down"), NOW)
    assert "\x1b" not in text
    assert "\x07" not in text
    assert "restart failed: \\x1b[2Jgone" in text
    assert "held\\x1b]0;pwned\\x07\\x0anext line" in text


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_state_file_status_cannot_read_is_unknown_not_the_defaults(
    tmp_path: Path, kind: str
) -> None:
    """Not read at all (as a user outside group specd gets: Permission denied; root reads
    through permissions, so a directory and a FIFO stand in here), status printed an empty
    state's defaults as facts: frozen no, last decision never, 0 restarts, budget left."""
    config = load_config(config_file(tmp_path, "http://127.0.0.1:9", '["static"]'))
    path = tmp_path / "state.json"
    if kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    info = collect(config, NOW, "down")
    text = render(info, NOW)
    assert info["state_unreadable"]
    assert info["state_unknown"]
    unknown = "UNKNOWN: the state file could not be read (below)"
    for label in ("frozen         ", "last decision  ", "restarts 24h   "):
        assert f"{label}{unknown}" in text, text
    assert "frozen         no" not in text


@pytest.mark.parametrize(
    ("override", "frozen", "mode_line", "frozen_line"),
    [
        # The on-call's freeze: no failed restart, yet every change is held ("frozen no"
        # beside "mode freeze").
        ('mode = "freeze"', None, "mode           freeze",
         "frozen         no failed restart; the override freezes specd (mode freeze)"),
        # Frozen by a failed restart, a pin in the file: the freeze holds the pin too (the
        # daemon's gauge and STATUS= say freeze; status said "mode pin").
        ('mode = "pin"\nsteps = 4', {"since": NOW - 600, "reason": "restart to 4 rolled_back"},
         "mode           pin (held: specd is FROZEN, see below)", "frozen         YES, FROZEN"),
        ('mode = "pin"\nsteps = 4', None, "mode           pin", "frozen         no"),
    ],
)  # fmt: skip
def test_the_mode_and_frozen_lines_agree_with_what_holds_changes(
    tmp_path: Path,
    override: str,
    frozen: dict[str, object] | None,
    mode_line: str,
    frozen_line: str,
) -> None:
    config = load_config(config_file(tmp_path, "http://127.0.0.1:9", '["static"]'))
    assert StateStore(config.files.state_dir).save(State(frozen=frozen)) is None
    (tmp_path / "override.toml").write_text(
        f'{override}\nexpires_at = 2025-11-25T16:00:00Z\nreason = "r"\n'
    )
    (tmp_path / "override.toml").chmod(0o644)
    lines = render(collect(config, NOW, "down"), NOW).splitlines()
    assert mode_line in [line for line in lines if line.startswith("mode ")]
    (shown,) = [line for line in lines if line.startswith("frozen ")]
    assert shown.startswith(frozen_line), shown


@pytest.mark.parametrize(
    ("windows_toml", "note"),
    [
        # The next window holds a restart: nothing more to say.
        ('[[windows]]\ncron = "0 2 * * *"\nduration_s = 3600\ntimezone = "UTC"\n', None),
        # A minute at midnight holds none (systemd's 90 s stop + 100 s start): the daemon
        # waits for 02:00, and the window line named midnight alone.
        (
            '[[windows]]\ncron = "0 0 * * *"\nduration_s = 60\ntimezone = "UTC"\n'
            '[[windows]]\ncron = "0 2 * * *"\nduration_s = 3600\ntimezone = "UTC"\n',
            "; a restart can go out from 2025-11-25T02:00:00+00:00 (in 10.0 h) (too short before)",
        ),
        (
            '[[windows]]\ncron = "0 0 * * *"\nduration_s = 60\ntimezone = "UTC"\n',
            "; no window ahead holds one restart",
        ),
    ],
)
def test_the_window_line_says_when_a_restart_can_go_out(
    tmp_path: Path, windows_toml: str, note: str | None
) -> None:
    path = config_file(tmp_path, "http://127.0.0.1:9", '["static"]')
    path.write_text(path.read_text() + windows_toml)
    (line,) = [
        x
        for x in render(collect(load_config(path), NOW, "down"), NOW).splitlines()
        if x.startswith("window ")
    ]
    if note is None:
        assert "restart" not in line, line
    else:
        assert line.endswith(note), line


def test_status_shows_the_freeze_a_newer_specds_state_holds(tmp_path: Path) -> None:
    # The daemon cannot read it: it sets it aside and stays frozen for the freeze in it.
    config = load_config(config_file(tmp_path, "http://127.0.0.1:9", '["static"]'))
    data = State(frozen={"since": NOW - 60, "reason": "restart failed"}).to_dict()
    newer = STATE_VERSION + 1
    (tmp_path / "state.json").write_text(json.dumps({**data, "version": newer}))
    info = collect(config, NOW, "down")
    assert info["state_unreadable"]
    assert f"version {newer} is newer than this specd understands" in info["state_problem"]
    assert info["frozen"] is not None
    # Since when the file says, not since this run of status ("0 s ago" at every run).
    assert "YES, FROZEN since 2025-11-24T15:59:00+00:00 (60 s ago)" in render(info, NOW)


def _utc(year: int, month: int, day: int, hour: int) -> float:
    return datetime(year, month, day, hour, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize(
    ("cron", "now", "opens", "closes"),
    [
        # Winter: 03:00 CET is 02:00Z, shown as the cron reads it.
        (
            "0 3 * * *",
            _utc(2026, 12, 6, 12),
            "2026-12-07T03:00:00+01:00",
            "2026-12-07T04:00:00+01:00",
        ),
        (
            "0 3 * * *",
            _utc(2026, 7, 1, 12),
            "2026-07-02T03:00:00+02:00",
            "2026-07-02T04:00:00+02:00",
        ),
        # Spring forward: 02:30 does not exist that night; the window opens at the jump.
        (
            "30 2 * * *",
            _utc(2026, 3, 28, 12),
            "2026-03-29T03:00:00+02:00",
            "2026-03-29T04:00:00+02:00",
        ),
        # Fall back: opens at the first 02:30 and closes an hour later, at the second: the
        # same wall-clock time, told apart by the offset alone.
        (
            "30 2 * * *",
            _utc(2026, 10, 24, 12),
            "2026-10-25T02:30:00+02:00",
            "2026-10-25T02:30:00+01:00",
        ),
    ],
)
def test_status_shows_window_times_on_the_windows_own_clock(
    tmp_path: Path, cron: str, now: float, opens: str, closes: str
) -> None:
    path = config_file(tmp_path, "http://127.0.0.1:9", '["static"]')
    with path.open("a") as file:
        file.write(
            f'[[windows]]\ncron = "{cron}"\nduration_s = 3600.0\ntimezone = "Europe/Berlin"\n'
        )
    info = collect(load_config(path), now, "down")
    # The epoch seconds stay as they were; the ISO 8601 strings are new beside them.
    assert info["next_window_open"] == datetime.fromisoformat(opens).timestamp()
    assert info["next_window_close"] == datetime.fromisoformat(closes).timestamp()
    assert (info["next_window_open_at"], info["next_window_close_at"]) == (opens, closes)
    assert json.loads(json.dumps(info, default=str))["next_window_open_at"] == opens
    line = next(x for x in render(info, now).splitlines() if x.startswith("window "))
    assert f"next opens {opens} (in " in line
    assert f", closes {closes} (in " in line


def _holder(state_dir: Path) -> subprocess.Popen[str]:
    """A process holding ``state_dir`` as `specd run` does (specd.io.state.lock_state_dir)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom specd.io.state import lock_state_dir\n"
            f"lock_state_dir({str(state_dir)!r})\nprint('held', flush=True)\ntime.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "held\n"
    return proc


PLANNED = {"phase": "planned", "from_setting": "3", "to_setting": "4"}


@pytest.mark.parametrize(
    ("saved_ago_s", "running", "journal", "acts", "stale"),
    [
        (30, True, None, False, False),
        # Saved every minute while specd runs: 10 minutes old, its writes fail (a full
        # disk): status showed the decision of then, exit 0, and nothing of the failure.
        (600, True, None, False, True),
        # Not running: what it saved last, as always.
        (600, False, None, False, False),
        # A restart runs (its journal): its loads and rollbacks save at their phases.
        (600, True, PLANNED, False, False),
        # A change began (saved with it): its wait for a quiet moment, before any journal,
        # saves nothing for up to quiet_deadline_s (600 s) more.
        (600, True, None, True, False),
        (900, True, None, True, True),
    ],
)
def test_status_says_when_a_running_specd_no_longer_saves(
    tmp_path: Path,
    saved_ago_s: float,
    running: bool,
    journal: dict[str, str] | None,
    acts: bool,
    stale: bool,
) -> None:
    config = load_config(config_file(tmp_path, "http://127.0.0.1:9", '["static"]'))
    now = time.time()
    decision = {"t": now - saved_ago_s, "reason": "change", "message": "3 → 4", "acts": acts}
    state = State(journal=journal, last_decision=decision)
    assert StateStore(config.files.state_dir).save(state) is None
    os.utime(tmp_path / "state.json", (now - saved_ago_s, now - saved_ago_s))
    holder = _holder(tmp_path) if running else None
    try:
        info = collect(config, now, "down")
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    problem = info["state_problem"] or ""
    assert ("not saved since" in problem) is stale, problem
    assert info["state_unreadable"] is stale
    if stale:
        assert "while specd runs (it saves every 60 s): its writes fail" in problem
        assert f"state          {problem}" in render(info, now)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_status_tells_a_held_state_directory_from_a_left_one(tmp_path: Path, how: str) -> None:
    state_dir = tmp_path / "state"
    assert daemon(state_dir) == {"running": False, "pid": None}  # never ran
    holder = _holder(state_dir)
    try:
        assert daemon(state_dir) == {"running": True, "pid": holder.pid}
    finally:
        holder.send_signal(getattr(signal, how))
        holder.wait()
    # The lock file stays, with the dead process's pid in it: not a running specd.
    assert (state_dir / LOCK_FILE).read_text().strip() == str(holder.pid)
    assert daemon(state_dir) == {"running": False, "pid": None}
    assert daemon(state_dir, tmp_path / "no-proc-locks") == {"running": None, "pid": None}


def _lock_line(pid: int, inode: int) -> str:
    return f"1: FLOCK  ADVISORY  WRITE {pid} fe:00:{inode} 0 EOF"


@given(
    st.lists(
        st.one_of(
            st.text(st.characters(exclude_categories=("Cs",)), max_size=80),
            st.builds(_lock_line, st.integers(0, 2**22), st.integers(0, 2**40)),
        ),
        max_size=20,
    )
)
@settings(max_examples=200, deadline=None)
def test_status_reads_any_lock_table_and_sees_only_its_own_lock(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state_dir = Path(tmp)
        (state_dir / LOCK_FILE).write_text("4242\n")
        inode = (state_dir / LOCK_FILE).stat().st_ino
        locks = state_dir / "locks"
        locks.write_text("\n".join(lines), errors="surrogateescape")
        ours = _lock_line(4242, inode) in lines
        assert daemon(state_dir, locks) == (
            {"running": True, "pid": 4242} if ours else {"running": False, "pid": None}
        )


# A date and time as status could print one: ISO 8601 or "2026-12-06 10:05:20 UTC".
_TIME = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d(:\d\d)?\S*( UTC)?")


def test_every_time_status_prints_is_iso_8601_with_its_offset(tmp_path: Path) -> None:
    """Window times were `2026-12-07T03:00:00+01:00`, the override's expiry
    `2026-12-07T10:05:28+00:00`, every other time `2026-12-06 10:05:20 UTC`: three ways
    of writing a time in one screen, four with the decisions' `…T02:00Z`."""
    path = config_file(tmp_path, "http://127.0.0.1:9", '["static"]')
    with path.open("a") as file:
        file.write(
            '[gateway]\nurls = ["http://127.0.0.1:9"]\n'
            '[[windows]]\ncron = "0 3 * * *"\nduration_s = 3600.0\n'
            'timezone = "Europe/Berlin"\n'
        )
    config = load_config(path)
    state = State(
        live={"t": NOW - 5, "steps": 3, "setting": "3", "source": "observation"},
        last_decision={"t": NOW - 5, "reason": "frozen", "message": "frozen (x); holding 3"},
        frozen={"since": NOW - 600, "reason": "restart to 6 rolled_back"},
        avoided=[Avoided(5, NOW - 3600, ((2, 1.0),), 0.031, 3)],
        gateway={
            "probe": {"t": NOW - 30, "problem": None, "not_ready_replicas": 0},
            "last_drain": {"t": NOW - 900, "result": "idle", "duration_s": 4.0},
        },
    )
    assert StateStore(config.files.state_dir).save(state) is None
    (tmp_path / "override.toml").write_text(
        'mode = "freeze"\nexpires_at = 2025-11-25T16:00:00Z\nreason = "r"\n'
    )
    (tmp_path / "override.toml").chmod(0o644)
    text = render(collect(config, NOW, "down"), NOW)
    found = [m.group(0) for m in _TIME.finditer(text)]
    assert len(found) >= 10, text  # live, decision, frozen, window ×2, override, avoided ×2,
    # gateway, last drain
    for shown in found:
        assert "UTC" not in shown, text
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", shown), shown


# A journal as the applier writes it (the fields its start reads back).
_JOURNAL = {
    **Journal(
        phase="restart_issued",
        from_steps=3,
        to_steps=4,
        unit="sglang.service",
        env_file="/var/lib/specd/sglang.env",
        previous_env=None,
        previous_env_encoding="utf-8",
        started_at=NOW - 120,
        from_setting="3",
        to_setting="4",
    ).to_dict()
}


@pytest.mark.parametrize(
    ("journal", "running", "said", "unsaid"),
    [
        # In flight, specd running: the change and where it stands.
        (
            _JOURNAL,
            True,
            "restart        IN PROGRESS: 3 steps → 4 steps, restart_issued (started "
            "2025-11-24T15:58:00+00:00 (2.0 min ago))",
            "not running",
        ),
        # specd stopped (killed) mid-restart: its next start finishes it.
        (_JOURNAL, False, "; specd is not running: its next start finishes it", "shutdown"),
        # A shutdown cut it short: it read "in progress: restart_issued", yet the next start
        # only verifies the previous setting SGLang booted on.
        (
            {**_JOURNAL, "shutdown": "`systemctl is-system-running`: stopping"},
            False,
            "restart        3 steps → 4 steps cut short by a shutdown (started "
            "2025-11-24T15:58:00+00:00 (2.0 min ago); `systemctl is-system-running`: stopping): "
            "the env file is back on 3 steps, which SGLang boots on; specd's next start "
            "verifies it, restarting nothing",
            "restart_issued",
        ),
        # The rollback waits out the unit's start limit: until when.
        (
            {**_JOURNAL, "phase": "rolling_back", "refused_until": NOW + 300},
            True,
            "rolling_back (started 2025-11-24T15:58:00+00:00 (2.0 min ago)); the rollback waits "
            "out sglang.service's start limit until 2025-11-24T16:05:00+00:00 (in 5.0 min)",
            "not running",
        ),
        # A damaged journal (hand-edited, another version's) is shown as the freeze specd's
        # start makes of it, never a crash nor a restart its start would finish.
        (
            {"phase": ["x"], "to_setting": "\x1b[2J", "started_at": "yesterday"},
            False,
            "restart        UNUSABLE journal (restart journal version None unknown; ? → "
            "\\x1b[2J): specd's next start cannot finish it and freezes",
            "\x1b",
        ),
        (
            {**_JOURNAL, "phase": "zzz", "to_steps": 99},
            False,
            "restart        UNUSABLE journal (restart journal phase 'zzz' unknown; 3 steps → "
            "4 steps): specd's next start cannot finish it and freezes",
            "IN PROGRESS",
        ),
    ],
)
def test_status_says_what_an_unfinished_restart_waits_for(
    tmp_path: Path, journal: dict[str, object], running: bool, said: str, unsaid: str
) -> None:
    config = load_config(config_file(tmp_path, "http://127.0.0.1:9", '["static"]'))
    assert StateStore(config.files.state_dir).save(State(journal=journal)) is None
    info = collect(config, NOW, "down")
    info["daemon"] = {"running": running, "pid": 4242 if running else None}
    text = render(info, NOW)
    line = next(x for x in text.splitlines() if x.startswith("restart  "))
    assert said in line, line
    assert unsaid not in line, line


EXPLORED = [
    # (id, [choose] policy, explorations [seconds before NOW, steps], live steps, the line
    # or None)
    ("bands-never-explore", "bands", [[13 * 3600, 5]], 5, None),
    ("none-this-week", "model", [], 3, "explored       none in the last 7 days (at most 2 a "
     "week, one per step count)"),
    # Started at the window's opening 13 h ago (03:00 UTC), measured until the next one.
    ("one-measuring", "model", [[13 * 3600, 5]], 5, "explored       1 of 2 in the last 7 days: "
     "5 steps 2025-11-24T03:00:00+00:00 (13.0 h ago), measured until the window "
     "2025-11-25T03:00:00+00:00 (in 11.0 h)"),
    # Rolled back to 3 (or changed from since): the daemon measures 5 no more (it said
    # "measured until the window" all the same).
    ("one-rolled-back", "model", [[13 * 3600, 5]], 3, "explored       1 of 2 in the last 7 "
     "days: 5 steps 2025-11-24T03:00:00+00:00 (13.0 h ago), no longer runs: measured no more "
     "(its epoch ends 2025-11-25T03:00:00+00:00 (in 11.0 h))"),
    # One measured and done, one older than the rolling week (not shown).
    ("one-done", "model", [[61 * 3600, 2], [8 * 86400, 4]], 2, "explored       1 of 2 in the "
     "last 7 days: 2 steps 2025-11-22T03:00:00+00:00 (61.0 h ago)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "explorations", "live", "line"),
    [pytest.param(*e[1:], id=e[0]) for e in EXPLORED],
)
def test_status_says_which_step_counts_were_explored_and_until_when(
    tmp_path: Path, policy: str, explorations: list[list[float]], live: int, line: str | None
) -> None:
    """A step count that changed at an odd hour, with no change in load, is an exploration:
    the on-call sees which, since when and until when, beside the week's allowance."""
    path = tmp_path / "specd.toml"
    path.write_text(
        f'[sglang]\nurl = "http://127.0.0.1:{free_port()}"\nenv_file = "{tmp_path}/sglang.env"\n'
        f'[files]\nstate_dir = "{tmp_path}"\noverride_file = "{tmp_path}/override.toml"\n'
        f'[choose]\npolicy = "{policy}"\n'
    )
    config = load_config(path)
    state = State(
        explorations=[[NOW - ago, steps] for ago, steps in explorations],
        live={"t": NOW - 60, "steps": live, "setting": str(live), "source": "observation"},
    )
    assert StateStore(tmp_path).save(state) is None
    info = collect(config, NOW, server_info(config))
    shown = [x for x in render(info, NOW).splitlines() if x.startswith("explored")]
    assert shown == ([] if line is None else [line])


TOMORROW_04 = NOW + 12 * 3600  # the close of the window after the change's epoch
VERIFYING = [
    # (id, the change being verified, the line or None). NOW is Monday 16:00 UTC; the
    # change was made at the window's opening, 03:00.
    ("none", None, None),
    ("a-step-count", ChangeSnapshot(NOW - 13 * 3600, 3, 4, (), 0.02, TOMORROW_04),
     "verifying      3 → 4 2025-11-24T03:00:00+00:00 (13.0 h ago), predicted +2.0% for its "
     "epoch: goes back if it serves less beyond noise, until the window closes "
     "2025-11-25T04:00:00+00:00 (in 12.0 h)"),
    ("an-adaptive-set-unpredicted", ChangeSnapshot(
        NOW - 13 * 3600, 3, setting_key(adaptive((3, 4))), (), None, TOMORROW_04,
        to_setting=adaptive((3, 4))),
     "verifying      3 → adaptive:3,4 2025-11-24T03:00:00+00:00 (13.0 h ago): goes back if it "
     "serves less beyond noise, until the window closes 2025-11-25T04:00:00+00:00 (in 12.0 h)"),
    # Its verification lapsed: the policy judges later traffic, not this change's outcome.
    ("lapsed", ChangeSnapshot(NOW - 37 * 3600, 3, 4, (), 0.02, NOW - 12 * 3600), None),
]  # fmt: skip


@pytest.mark.parametrize(("snap", "line"), [pytest.param(*v[1:], id=v[0]) for v in VERIFYING])
def test_status_names_the_change_being_verified_and_until_when(
    tmp_path: Path, snap: ChangeSnapshot | None, line: str | None
) -> None:
    """After a change the on-call sees that specd is checking it, what it predicted, and
    until when it would still go back."""
    path = tmp_path / "specd.toml"
    path.write_text(
        f'[sglang]\nurl = "http://127.0.0.1:{free_port()}"\nenv_file = "{tmp_path}/sglang.env"\n'
        f'[files]\nstate_dir = "{tmp_path}"\noverride_file = "{tmp_path}/override.toml"\n'
    )
    config = load_config(path)
    if snap is not None:
        snap = ChangeSnapshot(
            snap.t, snap.from_steps, snap.to_steps, snap.cells, snap.predicted_gain_ratio,
            snap.until, snap.from_setting, snap.to_setting, ((1, 1.02, 1.0),),
        )  # fmt: skip
    assert StateStore(tmp_path).save(State(verifying=snap)) is None
    info = collect(config, NOW, server_info(config))
    shown = [x for x in render(info, NOW).splitlines() if x.startswith("verifying")]
    assert shown == ([] if line is None else [line])
    if line is None:
        assert info["verifying"] is None
    else:
        assert snap is not None
        assert info["verifying"]["since"] == snap.t
        assert info["verifying"]["predicted_bands"] == [[1, 1.02, 1.0]]
        assert json.loads(json.dumps(info["verifying"])) == info["verifying"]


CHANGED_AT = "2025-11-24T03:00:00+00:00"
SAID = [
    # (id, the outcome the daemon's last decision carries, the line status shows or None)
    ("this-change", f"outcome of 3 → 4 at {CHANGED_AT}: 1200 s observed < 1800 s needed",
     f"               outcome of 3 → 4 at {CHANGED_AT}: 1200 s observed < 1800 s needed"),
    # What a terminal would act on is shown, not sent.
    ("escapes", f"outcome of 3 → 4 at {CHANGED_AT}: \x1b[2J\nbad",
     f"               outcome of 3 → 4 at {CHANGED_AT}: \\x1b[2J\\x0abad"),
    # The tick that made the change judged the change before it: not this one's.
    ("another-change", "outcome of 2 → 3 at 2025-11-23T03:00:00+00:00: regression", None),
    ("not-text", 7, None),
    ("none", None, None),
]  # fmt: skip


@pytest.mark.parametrize(("said", "line"), [pytest.param(*v[1:], id=v[0]) for v in SAID])
def test_status_shows_the_daemons_verdict_on_the_change_being_verified(
    tmp_path: Path, said: object, line: str | None
) -> None:
    path = tmp_path / "specd.toml"
    path.write_text(
        f'[sglang]\nurl = "http://127.0.0.1:{free_port()}"\nenv_file = "{tmp_path}/sglang.env"\n'
        f'[files]\nstate_dir = "{tmp_path}"\noverride_file = "{tmp_path}/override.toml"\n'
    )
    config = load_config(path)
    snap = ChangeSnapshot(NOW - 13 * 3600, 3, 4, (), 0.02, TOMORROW_04)
    decision = {"t": NOW - 60, "reason": "within_tolerance", "message": "4 is live"}
    state = State(verifying=snap, last_decision={**decision, "outcome": said})
    assert StateStore(tmp_path).save(state) is None
    info = collect(config, NOW, server_info(config))
    lines = render(info, NOW).splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("verifying"))
    shown = [x for x in lines[at + 1 :] if x.startswith("               outcome")]
    assert shown == ([] if line is None else [line])
    assert info["verifying"]["outcome"] == (said if line is not None else None)


@pytest.mark.parametrize("algorithm", ["NEXTN", None])
def test_a_server_running_off_is_judged_with_the_algorithm_specd_applies(
    tmp_path: Path, algorithm: str | None
) -> None:
    """After `pin off` SGLang reports no algorithm: the daemon (and `override pin`) take the
    configured one, so specd can start it on static K again; status and doctor said static
    could not be offered, and doctor passed 'specd may choose ' with nothing after it."""
    args = ["--enable-metrics", "--sglang-version", "0.5.23", *FAST_TWIN_VERSION_ARGS]
    with TwinProcess(args) as twin:
        twin.wait_healthy(20)
        path = config_file(tmp_path, twin.url, '["static"]', policy="bands")
        if algorithm is not None:
            text = path.read_text().replace(
                "[sglang]\n", f'[sglang]\nspeculative_algorithm = "{algorithm}"\n'
            )
            path.write_text(text)
        config = load_config(path)
        info = collect(config, NOW, server_info(config))
        found = Doctor(path, SubprocessRunner())
        found.config = config
        with SGLangClient(twin.url, timeout_s=5) as client:
            assert found.check_sglang(client).ok
        check = found.check_choices()
    if algorithm is not None:
        assert info["choices"]["kinds"]["static"] is None
        assert (check.ok, check.detail) == (True, "specd may choose static")
    else:
        assert "no speculative algorithm" in str(info["choices"]["kinds"]["static"])
        assert not check.ok
        assert (
            check.detail == "specd can choose no setting on this server (each kind's reason below)"
        )
