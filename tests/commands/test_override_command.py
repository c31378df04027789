"""`specd override` as the on-call reads it: the times it names are the ones `specd status`
and the daemon's decisions name, in the same text; it says whose override it replaces, and
refuses or flags a pin the server cannot run, as the daemon judges it."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import httpx
import pytest
from factories import run_specd, version_twin
from in_process import specd_main

from specd.cli import main
from specd.commands import override as override_cmd_module
from specd.commands.status import collect, render
from specd.core.history import HistorySettings
from specd.core.override import Override
from specd.io import override as override_io
from specd.io.config import load_config
from specd.io.state import State, StateStore
from specd.twin.process import free_port
from specd.twin.standin import UNIT, make_standin

UTC = timezone.utc


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("SPECD_"):
            monkeypatch.delenv(name)


def zoned_config(tmp_path: Path, zone: str, opens_in_h: int) -> Path:
    """A daily one-hour window in ``zone`` opening ``opens_in_h`` hours after this hour
    began there (never open now)."""
    hour = (datetime.now(ZoneInfo(zone)).hour + opens_in_h) % 24
    path = tmp_path / "specd.toml"
    path.write_text(
        '[sglang]\nurl = "http://127.0.0.1:9"\n'
        f'[files]\nstate_dir = "{tmp_path / "state"}"\n'
        f'override_file = "{tmp_path / "override.toml"}"\n'
        f'[[windows]]\ncron = "0 {hour} * * *"\nduration_s = 3600\ntimezone = "{zone}"\n'
    )
    return path


ZONES = ["Europe/Berlin", "America/New_York", "Asia/Kolkata", "UTC"]


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize(
    "argv",
    [
        ["pin", "3", "--for", "1d"],
        ["pin", "3", "--for", "1d", "--now"],
        ["freeze", "--for", "20h"],
    ],
    ids=["pin", "pin-now", "freeze"],
)
def test_what_override_writes_is_named_in_the_text_status_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], zone: str, argv: list[str]
) -> None:
    """`specd override pin` said `until 2026-12-07 10:05:28Z` and `in the next maintenance
    window (2026-12-07 02:00Z)` where status said `until 2026-12-07T10:05:28+00:00` and
    `next opens 2026-12-07T03:00:00+01:00` for the same instants."""
    cfg = zoned_config(tmp_path, zone, opens_in_h=6)
    assert main(["override", *argv, "--reason", "incident 7", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    now = time.time()
    info = collect(load_config(cfg), now, "down")
    expires = info["override"]["expires_at"]
    assert f"until {expires} (" in out
    assert f"override       {argv[0]} " in render(info, now)
    assert f"until {expires} (" in render(info, now)
    if argv[0] == "pin" and "--now" not in argv:
        assert f"in the next maintenance window ({info['next_window_open_at']})" in out
    # Nothing in UTC-with-a-Z beside the offsets: one way of writing a time.
    assert "Z " not in out
    assert "Z)" not in out


@pytest.mark.parametrize("zone", ZONES)
def test_a_pin_refused_for_expiring_first_names_both_times_as_status_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], zone: str
) -> None:
    cfg = zoned_config(tmp_path, zone, opens_in_h=6)
    before = datetime.now(UTC).replace(microsecond=0)
    assert main(["override", "pin", "3", "--for", "1h", "--reason", "r", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    opens = collect(load_config(cfg), time.time(), "down")["next_window_open_at"]
    assert f"before the next maintenance window opens ({opens})" in err
    expiries = {(before + timedelta(hours=1, seconds=s)).isoformat() for s in (0, 1, 2)}
    assert any(f"the pin expires at {e}," in err for e in expiries), err


def ending_config(tmp_path: Path, left_s: int) -> Path:
    """A daily window in UTC that opened this minute and closes in ``left_s`` seconds, and
    an hour's window opening 12 hours after this hour began."""
    now = datetime.now(UTC)
    opened = now.replace(second=0, microsecond=0)
    path = tmp_path / "specd.toml"
    path.write_text(
        '[sglang]\nurl = "http://127.0.0.1:9"\n'
        f'[files]\nstate_dir = "{tmp_path / "state"}"\n'
        f'override_file = "{tmp_path / "override.toml"}"\n'
        f'[[windows]]\ncron = "{opened.minute} {opened.hour} * * *"\n'
        f"duration_s = {int((now - opened).total_seconds()) + left_s}\n"
        'timezone = "UTC"\n'
        f'[[windows]]\ncron = "0 {(opened.hour + 12) % 24} * * *"\nduration_s = 3600\n'
        'timezone = "UTC"\n'
    )
    return path


@pytest.mark.parametrize(
    ("left_s", "setting", "written", "when"),
    [
        # A static restart takes up to 190 s here (systemd's default 90 s stop timeout, no
        # unit to read, + restart_cost_s 100); SGLang's own set 60 s more.
        (600, "3", True, "now, inside the open maintenance window"),
        (220, "3", True, "now, inside the open maintenance window"),
        (220, "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0", False, None),
        # The window's last minutes hold no restart: a 1 h pin never applied (it waited,
        # window_ending, then window_closed, and expired), yet was written.
        (60, "3", False, None),
    ],
)
def test_a_pin_in_the_last_minutes_of_a_window_waits_for_the_next(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    left_s: int,
    setting: str,
    written: bool,
    when: str | None,
) -> None:
    cfg = ending_config(tmp_path, left_s)
    argv = ["override", "pin", setting, "--for", "1h", "--reason", "r", "--config", str(cfg)]
    assert main(argv) == (0 if written else 2)
    out, err = capsys.readouterr()
    assert (tmp_path / "override.toml").exists() is written
    if written:
        assert when is not None
        assert when in out, out
        return
    (said,) = err.splitlines()
    assert said.startswith("specd override: the open maintenance window closes at "), said
    assert ", too soon for one restart (up to " in said
    # 12 h to the next window, and its restart: 13 h at most.
    assert re.search(
        r"it would never apply. Restart at once with --now, or pin --for 1[23]h ", said
    )
    # Long enough for the next window, it waits for it, and says so.
    again = ["override", "pin", setting, "--for", "13h", "--reason", "r", "--config", str(cfg)]
    assert main(again) == 0
    out = capsys.readouterr().out
    assert "in the next maintenance window (" in out
    assert "): the open one closes at " in out


def _with_restarts(cfg_path: Path, times: list[float]) -> None:
    """A state file whose restarts (one SGLang restart each) are at ``times``."""
    cfg = load_config(cfg_path)
    store = StateStore(cfg.files.state_dir, history_settings=HistorySettings.from_config(cfg))
    restarts = [
        {"t": t, "from_steps": 3, "to_steps": 4, "result": "success", "restarts": 1} for t in times
    ]
    assert store.save(State(restarts=restarts)) is None


@pytest.mark.parametrize(
    ("reason", "ago_s", "held"),
    [
        ("drain_unavailable", 60, True),
        ("fleet_unavailable", 60, True),
        ("state_unsaved", 60, True),
        ("window_closed", 60, False),  # a pin applied now needs no window
        ("drain_unavailable", 3600, False),  # an hour old: no longer what holds it
        # Its time moves on only with a save, which is what fails: as old as it may be.
        ("state_unsaved", 3600, True),
    ],
)
def test_a_pin_now_says_what_holds_every_restart(
    tmp_path: Path, reason: str, ago_s: float, held: bool
) -> None:
    """`pin --now` said "restarts at once" while the gateway could not drain this server
    (or etcd, or a state save, failed): the daemon held it (drain_unavailable …)."""
    cfg_path = zoned_config(tmp_path, "UTC", opens_in_h=6)
    cfg = load_config(cfg_path)
    now = datetime.now(UTC).replace(microsecond=0)
    last = {"t": now.timestamp() - ago_s, "reason": reason, "message": "3 → 4 waits"}
    store = StateStore(cfg.files.state_dir, history_settings=HistorySettings.from_config(cfg))
    assert store.save(State(last_decision=last)) is None
    pin = replace(
        Override("pin", 4, now + timedelta(hours=2), "r", "now"), decided_at=now.timestamp()
    )
    said = override_cmd_module._when(cfg, pin, now)
    if held:
        assert said == (
            f"at once (apply = now) once what held specd's last decision clears: {reason} "
            f"({datetime.fromtimestamp(last['t'], UTC).isoformat()} "
            f"({'60 s' if ago_s == 60 else '60.0 min'} ago); `specd status` says what)"
        ), said
    else:
        assert said == "at once (apply = now)"


def test_unfreeze_says_a_pin_now_that_spent_its_restarts_makes_no_more(
    tmp_path: Path,
) -> None:
    """A failed `pin --now` (the change and its rollback: two restarts) with a daily budget
    of 2: the daemon makes no more for it (restart_budget), while unfreeze said it restarts
    into it at once."""
    from specd.commands import unfreeze  # noqa: PLC0415

    cfg_path = zoned_config(tmp_path, "UTC", opens_in_h=6)
    cfg_path.write_text(cfg_path.read_text() + "[restart]\ndaily_restart_budget = 2\n")
    cfg = load_config(cfg_path)
    now = time.time()
    expires = datetime.fromtimestamp(now + 7200, UTC)
    text = f'mode = "pin"\nsteps = 2\napply = "now"\nexpires_at = {expires.isoformat()}\n'
    (tmp_path / "override.toml").write_text(text)
    os.utime(tmp_path / "override.toml", (now - 600, now - 600))
    status = override_io.read_override(tmp_path / "override.toml", 1, 6, now)
    assert status.valid, status.problem
    said = unfreeze._next(cfg, status, "2", "3", now, [now - 300, now - 300])
    assert said.startswith(
        "the override pins 2 steps with apply = now, but not again: it has made 2 restarts "
        "since it was written"
    ), said
    assert "at once" not in said


SHORT_THEN_LONG_WINDOWS = (
    '[[windows]]\ncron = "0 0 * * *"\nduration_s = 60\ntimezone = "UTC"\n'
    '[[windows]]\ncron = "0 2 * * *"\nduration_s = 3600\ntimezone = "UTC"\n'
)


def test_when_names_what_holds_the_restart_as_the_daemon_does(tmp_path: Path) -> None:
    """`override show` said a pin restarts "now, inside the open maintenance window" or "at
    once" while the daemon held it on the restart budget; and named a next window too short
    for one restart as when it goes out."""
    cfg_path = zoned_config(tmp_path, "UTC", opens_in_h=6)
    now = datetime.now(UTC).replace(microsecond=0)
    expires = now + timedelta(days=2)
    waiting = Override("pin", 4, expires, "r", "next-window")
    applied_now = replace(
        Override("pin", 4, expires, "r", "now"), decided_at=now.timestamp() - 3600
    )
    # Nothing restarted yet.
    cfg = load_config(cfg_path)
    assert override_cmd_module._when(cfg, applied_now, now) == "at once (apply = now)"
    assert override_cmd_module._when(cfg, waiting, now).startswith(
        "in the next maintenance window ("
    )
    # The daily budget (4) spent in the last half hour, by the pin itself since it was
    # written.
    _with_restarts(cfg_path, [now.timestamp() - 60 * m for m in (30, 25, 20, 15)])
    held = override_cmd_module._when(cfg, waiting, now)
    assert "; none before " in held, held
    assert "(restart budget: 4 restarts in 24 h, 4 allowed)" in held
    spent = override_cmd_module._when(cfg, applied_now, now)
    assert spent.startswith("not at once: it has made 4 restarts since it was written"), spent
    # A next window of a minute holds no restart: the one after it is when it goes out.
    cfg_path.write_text(cfg_path.read_text().split("[[windows]]")[0] + SHORT_THEN_LONG_WINDOWS)
    at_night = now.replace(hour=23, minute=38, second=0)
    text = override_cmd_module._when(load_config(cfg_path), waiting, at_night)
    assert text.startswith(
        "in the first maintenance window with time for one restart "
        f"({(at_night + timedelta(hours=2, minutes=22)).isoformat()}): the next, at "
        f"{(at_night + timedelta(minutes=22)).isoformat()}, closes too soon for one restart"
    ), text


@pytest.mark.parametrize(("left_s", "says"), [
    (600, "a change it wants restarts SGLang inside the open maintenance window"),
    # The daemon says window_ending there (one restart needs up to 3.2 min).
    (120, "a change it wants restarts SGLang in the next maintenance window ("),
])  # fmt: skip
def test_unfreeze_says_when_a_change_goes_out_as_the_daemon_waits(
    tmp_path: Path, left_s: int, says: str
) -> None:
    from specd.commands import unfreeze  # noqa: PLC0415

    cfg = load_config(ending_config(tmp_path, left_s))
    now = time.time()
    nothing = override_io.read_override(tmp_path / "none.toml", 1, 6, now)
    text = unfreeze._next(cfg, nothing, None, "3", now, [])
    assert says in text, text
    if left_s < 190:
        assert ": the open one closes at " in text
        assert "too soon for one restart (up to 3.2 min)" in text


@pytest.mark.parametrize(
    ("expires_at", "shown"),
    [
        ("2000-01-01T00:00:00Z", "2000-01-01T00:00:00+00:00"),
        # Written with another offset (or fractions of a second): said in UTC to the second.
        ("2000-01-01T01:00:00.75+01:00", "2000-01-01T00:00:00+00:00"),
    ],
)
def test_an_expired_override_names_its_expiry_as_status_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], expires_at: str, shown: str
) -> None:
    cfg = zoned_config(tmp_path, "Europe/Berlin", opens_in_h=6)
    override = tmp_path / "override.toml"
    override.write_text(f'mode = "freeze"\nexpires_at = {expires_at}\nreason = "old"\n')
    override.chmod(0o644)
    assert main(["override", "show", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert f" ago ({shown})" in out
    now = time.time()
    info = collect(load_config(cfg), now, "down")
    assert info["override"]["expires_at"] == shown
    assert f" ago ({shown})" in render(info, now)


FAILED = "restart to 6 rolled_back: not healthy"


@pytest.mark.parametrize(
    ("state", "argv", "note"),
    [
        pytest.param(
            "frozen",
            ["pin", "2", "--for", "4h", "--now"],
            'until unfrozen: `specd unfreeze --retry-pin --reason "..."`',
            id="pin now: unfreeze --retry-pin",
        ),
        pytest.param(
            "frozen",
            ["pin", "2", "--for", "1d"],
            'until unfrozen: `specd unfreeze --reason "..."`',
            id="next window: unfreeze",
        ),
        pytest.param("frozen", ["show"], "until unfrozen", id="show, the pin in force"),
        pytest.param("unreadable", ["pin", "2", "--for", "4h", "--now"], "cannot tell", id="?"),
        pytest.param("not frozen", ["pin", "2", "--for", "4h", "--now"], None, id="no note"),
        pytest.param("frozen", ["freeze", "--for", "4h"], None, id="a freeze: no note"),
    ],
)
def test_a_pin_written_while_specd_is_frozen_says_the_freeze_holds_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    state: str,
    argv: list[str],
    note: str | None,
) -> None:
    """SpecdBacklogWhileBlocked's runbook said "frozen: apply now with `specd override pin N
    --now`", and the command said "it restarts at once", while a freeze holds every change,
    a pin too, until `specd unfreeze` (which refuses a pin applied now without
    --retry-pin): nothing restarted, and nothing said why."""
    cfg = zoned_config(tmp_path, "UTC", opens_in_h=6)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    if state == "frozen":
        saved = State(frozen={"since": time.time() - 600, "reason": FAILED})
        assert StateStore(state_dir).save(saved) is None
    elif state == "unreadable":
        (state_dir / "state.json").mkdir()  # as a user outside group specd reads it: not at all
    else:
        assert StateStore(state_dir).save(State()) is None
    if argv == ["show"]:
        pin = ["override", "pin", "2", "--for", "4h", "--now", "--reason", "r"]
        assert main([*pin, "--config", str(cfg)]) == 0
        capsys.readouterr()
    reason = [] if argv == ["show"] else ["--reason", "backlog"]
    assert main(["override", *argv, *reason, "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    if note is None:
        assert not [n for n in notes if "frozen" in n.lower()], out
        return
    [said] = [n for n in notes if "frozen" in n.lower()]
    assert note in said, said
    if state == "frozen":
        assert said.startswith("note: specd is FROZEN since 20"), said
        assert f"({FAILED})" in said, said


def run_as(cfg: Path, user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """`specd override` run by ``user`` through sudo (root's USER, the caller's SUDO_USER)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECD_", "SUDO_"))}
    env |= {"USER": "root", "LOGNAME": "root", "SUDO_USER": user}
    return specd_main("override", *argv, "--config", str(cfg), env=env)


FREEZE = ["freeze", "--for", "2h", "--reason", "investigating latency"]
PIN = ["pin", "4", "--for", "1d", "--reason", "batch eval"]


@pytest.mark.parametrize(
    ("before", "argv", "says"),
    [
        # A colleague's freeze, replaced by a pin: the on-call hears whose and what.
        (FREEZE, PIN, "replaces the freeze in force until "),
        (PIN, ["clear", "--reason", "eval done"], "replaces the pin 4 steps in force until "),
        (PIN, FREEZE, "replaces the pin 4 steps in force until "),
        # Nothing in force: nothing to say.
        (None, PIN, None),
        (["clear"], PIN, None),
    ],
)
def test_an_override_says_whose_override_in_force_it_replaces(
    tmp_path: Path, before: list[str] | None, argv: list[str], says: str | None
) -> None:
    """Two on-calls: alice froze specd while investigating; bob, not knowing, pinned a step
    count. bob's pin replaced her freeze without a word."""
    cfg = zoned_config(tmp_path, "Europe/Berlin", opens_in_h=6)
    if before is not None:
        first = run_as(cfg, "alice", *before)
        assert first.returncode == 0, first.stderr
        assert "as alice (sudo) at " in (tmp_path / "override.toml").read_text()
    done = run_as(cfg, "bob", *argv)
    assert done.returncode == 0, done.stderr
    # Who wrote it, under sudo: the one who ran sudo, not root.
    assert "as bob (sudo) at " in (tmp_path / "override.toml").read_text()
    replaced = [x for x in done.stdout.splitlines() if "replaces" in x]
    if says is None:
        assert replaced == []
        return
    (said,) = replaced
    assert says in said
    assert re.search(r"until \S+\+00:00 \(in \d+(\.\d)? (h|min)\)", said), said
    assert before is not None
    assert f": {before[-1]}" in said  # its reason
    assert re.search(r"written by alice \(sudo\) at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", said)


def served_config(tmp_path: Path, url: str) -> Path:
    path = zoned_config(tmp_path, "UTC", opens_in_h=6)
    path.write_text(path.read_text().replace("http://127.0.0.1:9", url))
    return path


def override_cmd(
    cfg: Path, path_env: str, *argv: str, process: bool = False
) -> subprocess.CompletedProcess[str]:
    """`specd override ARGV` with ``path_env`` as PATH; in-process unless ``process``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    env["PATH"] = path_env
    if not process:
        return specd_main("override", *argv, "--config", str(cfg), env=env)
    return run_specd("override", *argv, "--config", str(cfg), env=env)


# A pin this server or its unit cannot run: refused before it replaces what is in force.
STATIC_ONLY = "reads ${SPECULATIVE_NUM_STEPS}, not $SPECD_SPECULATIVE_ARGS"
DP_ATTENTION = ("--dp-size", "2", "--enable-dp-attention", "--tp-size", "2")


class Servers:
    """The SGLangs the tests ask, each started on first use and shared by the module: the
    override command only reads them (/server_info, `systemctl show`), never restarts them."""

    def __init__(self, top: Path, stack: contextlib.ExitStack) -> None:
        self.top, self.stack = top, stack
        self.started: dict[str, tuple[str, str]] = {}

    def url_and_path(self, server: str) -> tuple[str, str]:
        """("static-only unit": the stand-in unit, whose drop-in takes step counts only; "DP
        attention": a twin with it; "down") -> its URL, and the PATH to run specd with."""
        if server == "down":  # a port free now: one chosen long ago may serve another test
            return f"http://127.0.0.1:{free_port()}", os.environ.get("PATH", "/usr/bin:/bin")
        if server not in self.started:
            self.started[server] = self._start(server)
        return self.started[server]

    def _start(self, server: str) -> tuple[str, str]:
        path_env = os.environ.get("PATH", "/usr/bin:/bin")
        if server == "static-only unit":
            standin = make_standin(self.top, free_port())
            self.stack.callback(standin.stop)
            assert standin.systemctl("restart", UNIT).returncode == 0
            wait_healthy(standin.url())
            return standin.url(), f"{standin.bin_dir}:{path_env}"
        if server == "DP attention":
            twin = self.stack.enter_context(version_twin("0.5.23", *DP_ATTENTION))
            twin.wait_healthy()
            return twin.url, path_env
        raise AssertionError(server)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with contextlib.ExitStack() as stack:
        yield Servers(tmp_path_factory.mktemp("servers"), stack)


def serving(tmp_path: Path, servers: Servers, server: str) -> tuple[Path, str]:
    """A config for SGLang as ``server`` (see Servers), and the PATH to run specd with."""
    url, path_env = servers.url_and_path(server)
    return served_config(tmp_path, url), path_env


@pytest.mark.parametrize(
    ("server", "setting", "refused"),
    [
        # The unit's drop-in takes static step counts only (the stand-in's, as before
        # `specd install` rewrote it).
        ("static-only unit", "off", STATIC_ONLY),
        ("static-only unit", "adaptive:3,4", STATIC_ONLY),
        ("static-only unit", "4", None),
        # What /server_info says the server runs.
        ("DP attention", "adaptive:3,4", "adaptive mode does not run with DP attention"),
        ("DP attention", "off", None),
        ("DP attention", "4", None),
        # SGLang down: nothing to check against; written, and said so.
        ("down", "adaptive:3,4", None),
    ],
)
@pytest.mark.parametrize("now", [False, True], ids=["next-window", "now"])
def test_a_pin_the_server_cannot_run_is_refused_before_it_replaces_anything(
    tmp_path: Path, servers: Servers, server: str, setting: str, refused: str | None, now: bool
) -> None:
    """`pin off --now` on a unit whose drop-in takes step counts only was written and said
    "restarts at once, once it has checked": specd then held every decision `unsupported`,
    restarting nothing and choosing nothing, until the pin expired."""
    cfg, path_env = serving(tmp_path, servers, server)
    first = override_cmd(cfg, path_env, *FREEZE)
    assert first.returncode == 0, first.stderr
    before = (tmp_path / "override.toml").read_bytes()
    argv = ["pin", setting, "--for", "1d", "--reason", "try it", *(["--now"] if now else [])]
    # One refusal from a real process: its exit status and stderr as the on-call's shell
    # gets them (the rest in-process, through the same entry point).
    process = (server, setting, now) == ("static-only unit", "off", True)
    done = override_cmd(cfg, path_env, *argv, process=process)
    if refused is None:
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "override.toml").read_bytes() != before
        assert ("could not ask" if server == "down" else "checked: SGLang at ") in done.stdout
        return
    assert done.returncode == 2, done.stdout + done.stderr
    (said,) = done.stderr.splitlines()
    assert said.startswith(f"specd override: this server cannot run {setting}: ")
    assert refused in said
    assert "nothing written" in said
    assert (tmp_path / "override.toml").read_bytes() == before


@pytest.mark.parametrize(
    ("setting", "refused"),
    [
        # Listed in [choose] adaptive_candidate_sets (the default list): the policy may run
        # it past max_steps 6, so the on-call may pin it (it was refused: "7 steps is
        # outside the configured range 1..6").
        ("adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0", None),
        (
            "adaptive:3,7",
            "specd override: 7 steps is outside the configured range 1..6, and the set is not "
            "one of [choose] adaptive_candidate_sets",
        ),
        ("7", "specd override: 7 steps is outside the configured range 1..6"),
    ],
)
def test_a_pin_may_hold_what_the_policy_may_choose(
    tmp_path: Path, servers: Servers, setting: str, refused: str | None
) -> None:
    cfg, path_env = serving(tmp_path, servers, "down")
    done = override_cmd(cfg, path_env, "pin", setting, "--for", "1d", "--reason", "x")
    if refused is None:
        assert done.returncode == 0, done.stderr
        assert setting in (tmp_path / "override.toml").read_text()
        return
    assert (done.returncode, done.stderr.strip()) == (2, refused)
    assert not (tmp_path / "override.toml").exists()


def wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url} never healthy")


@pytest.mark.parametrize(
    ("server", "pinned", "says"),
    [
        ("static-only unit", 'setting = "off"', "BUT this server cannot run it: "),
        ("static-only unit", 'setting = "adaptive:3,4"', "BUT this server cannot run it: "),
        ("static-only unit", "steps = 4", "checked: SGLang at "),
        ("DP attention", 'setting = "adaptive:3,4"', "BUT this server cannot run it: "),
        ("DP attention", 'setting = "off"', "checked: SGLang at "),
        ("down", 'setting = "off"', "could not ask SGLang whether it can run it"),
    ],
)
def test_show_says_whether_the_server_can_run_the_pin_as_the_daemon_judges_it(
    tmp_path: Path, servers: Servers, server: str, pinned: str, says: str
) -> None:
    """A hand-written pin of off on a step-variable drop-in: show said "specd runs no
    speculation ... once it has checked", while specd held it `unsupported`."""
    cfg, path_env = serving(tmp_path, servers, server)
    override = tmp_path / "override.toml"
    override.write_text(
        f'mode = "pin"\n{pinned}\nexpires_at = 2099-01-01T00:00:00Z\nreason = "r"\n'
    )
    override.chmod(0o644)
    done = override_cmd(cfg, path_env, "show")
    assert done.returncode == 0, done.stderr
    assert says in done.stdout
    assert "once it has checked" not in done.stdout
    if "BUT" in says:
        assert "`specd override clear`" in done.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="judging another user's access needs root")
def test_show_and_status_call_a_file_the_daemon_cannot_read_invalid(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A freeze written by hand with root's umask 077: `override show` and `status` (as
    root) said it was in force; specd (as its user) could not read it and ignored it."""
    monkeypatch.setattr(override_io, "DAEMON_USER", "nobody")
    top = Path(tempfile.mkdtemp(dir="/tmp", prefix="specd-override-"))
    try:
        top.chmod(0o755)
        cfg = zoned_config(top, "UTC", opens_in_h=6)
        override = top / "override.toml"
        override.write_text('mode = "freeze"\nexpires_at = 2999-01-01T00:00:00Z\nreason = "r"\n')
        override.chmod(0o600)
        assert main(["override", "show", "--config", str(cfg)]) == 1
        out = capsys.readouterr().out
        assert out.startswith(f"INVALID: user nobody cannot read {override} (0600 root:root)")
        info = collect(load_config(cfg), time.time(), "down")
        assert info["mode"] is None
        assert "user nobody cannot read" in info["override"]["problem"]
        # What `specd override` writes, the daemon's user reads.
        assert (
            main(["override", "freeze", "--for", "1h", "--reason", "r", "--config", str(cfg)]) == 0
        )
        assert "valid, freeze" in capsys.readouterr().out
    finally:
        shutil.rmtree(top)


def test_a_pin_never_says_it_checked_a_unit_systemd_did_not_show(
    tmp_path: Path, servers: Servers
) -> None:
    """`systemctl show` failed (no bus, a polkit refusal) and the pin still said "checked:
    SGLang at ... and sglang.service can run it", of a unit it never read."""
    cfg, path_env = serving(tmp_path, servers, "DP attention")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    failing = bin_dir / "systemctl"
    failing.write_text("#!/bin/sh\necho 'Failed to connect to bus: Host is down' >&2\nexit 1\n")
    failing.chmod(0o755)
    done = override_cmd(cfg, f"{bin_dir}:{path_env}", "pin", "4", "--for", "1d", "--reason", "r")
    assert done.returncode == 0, done.stderr
    assert "can run it; sglang.service could not be read (" in done.stdout, done.stdout
    assert "and sglang.service can run it" not in done.stdout
    assert "restart's verification tells" in done.stdout
