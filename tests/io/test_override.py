from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from factories import run_specd, without_specd_env
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.cli import main
from specd.commands.args import parse_duration
from specd.core.override import Override
from specd.core.setting import adaptive, off
from specd.io import override as override_io
from specd.io.override import ABSENT, expired, read_override, write_override, written_by

UTC = timezone.utc
NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
OWN = (0, os.getuid())


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("SPECD_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str, mode: int = 0o644) -> Path:
    path = tmp_path / "override.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'mode = "pin"\nsteps = 3\nexpires_at = 2026-05-01T16:00:00Z\nreason = "eval"\n',
            Override("pin", 3, datetime(2026, 5, 1, 16, tzinfo=UTC), "eval", "next-window"),
        ),
        (
            'mode = "pin"\nsteps = 2\nexpires_at = "2026-05-01T18:00:00+02:00"\napply = "now"\n',
            Override("pin", 2, datetime(2026, 5, 1, 16, tzinfo=UTC), "", "now"),
        ),
        (
            'mode = "freeze"\nexpires_at = 2026-05-02T00:00:00-04:00\nreason = "incident"\n',
            Override(
                "freeze", None, datetime(2026, 5, 2, 4, tzinfo=UTC), "incident", "next-window"
            ),
        ),
        ('mode = "auto"\n', Override("auto", None, None, "", "next-window")),
        (
            'mode = "pin"\nsetting = "off"\nexpires_at = 2026-05-01T16:00:00Z\n',
            Override("pin", None, datetime(2026, 5, 1, 16, tzinfo=UTC), "", "next-window", off()),
        ),
        (
            'mode = "pin"\nsetting = " adaptive:4,3 "\nexpires_at = 2026-05-01T16:00:00Z\n',
            Override(
                "pin",
                None,
                datetime(2026, 5, 1, 16, tzinfo=UTC),
                "",
                "next-window",
                adaptive((3, 4)),
            ),
        ),
        (  # a static setting is the same pin as steps = 4
            'mode = "pin"\nsetting = "4"\nexpires_at = 2026-05-01T16:00:00Z\n',
            Override("pin", 4, datetime(2026, 5, 1, 16, tzinfo=UTC), "", "next-window"),
        ),
        (  # the latest instant there is, and an offset that stays inside it
            'mode = "freeze"\nexpires_at = "9999-12-31T23:59:59.999999+00:00"\n',
            Override("freeze", None, datetime.max.replace(tzinfo=UTC), "", "next-window"),
        ),
        (
            'mode = "freeze"\nexpires_at = 9999-12-31T23:00:00+05:00\n',
            Override("freeze", None, datetime(9999, 12, 31, 18, tzinfo=UTC), "", "next-window"),
        ),
        (
            'mode = "auto"\nexpires_at = 2020-01-01T00:00:00Z\n',
            Override("auto", None, datetime(2020, 1, 1, tzinfo=UTC), "", "next-window"),
        ),
    ],
)
def test_valid_override(tmp_path: Path, text: str, expected: Override) -> None:
    status = read_override(write(tmp_path, text), 1, 6, NOW, allowed_uids=OWN)
    assert (status.valid, status.present, status.problem) == (True, True, None)
    assert status.override == expected


SGLANGS_OWN = "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0"


@pytest.mark.parametrize(
    ("listed", "valid"),
    [
        # One of [choose] adaptive_candidate_sets: the policy may choose it past max_steps,
        # so may the on-call (a pin of what specd itself ran was refused).
        ((SGLANGS_OWN, "adaptive:3,4"), True),
        (("adaptive:3,4",), False),
        ((), False),
    ],
)
def test_a_listed_adaptive_set_may_be_pinned_past_the_step_range(
    tmp_path: Path, listed: tuple[str, ...], valid: bool
) -> None:
    text = f'mode = "pin"\nsetting = "{SGLANGS_OWN}"\nexpires_at = 2026-05-01T16:00:00Z\n'
    status = read_override(write(tmp_path, text), 1, 6, NOW, allowed_uids=OWN, listed=listed)
    assert status.valid is valid, status.problem
    if valid:
        assert status.override is not None
        assert status.override.pinned_name == SGLANGS_OWN
    else:
        assert status.problem is not None
        assert status.problem.endswith(
            "setting: adaptive candidates 7 are outside the configured range 1..6, and the set "
            "is not one of [choose] adaptive_candidate_sets"
        ), status.problem
    problem = override_io.check_override_text(text, 1, 6, NOW, listed=listed)
    assert (problem is None) is valid


PIN_NOW = 'mode = "pin"\nsteps = 3\nexpires_at = 2099-01-01T00:00:00Z\napply = "now"\n'
HEADER = "# written by `specd override pin` as alice at 2026-05-01T10:00:00+00:00\n"


@pytest.mark.parametrize(
    ("text", "mtime", "decided"),
    [
        # `specd override` wrote it: its header's time, kept by a hand edit under it.
        (
            HEADER + PIN_NOW,
            NOW.timestamp() - 3600,
            datetime(2026, 5, 1, 10, tzinfo=UTC).timestamp(),
        ),
        # Written by hand: every edit is a new decision, at the file's mtime.
        (PIN_NOW, NOW.timestamp() - 3600, NOW.timestamp() - 3600),
        # An mtime ahead of the clock (`cp -p` from a host whose clock runs ahead): now. It
        # left a pin applied now no restart of its own to count, so no bound on its loop.
        (PIN_NOW, NOW.timestamp() + 365 * 86400, NOW.timestamp()),
    ],
)
def test_the_override_carries_when_it_was_decided(
    tmp_path: Path, text: str, mtime: float, decided: float
) -> None:
    """The brain counts a pin's own restarts from it (a pin applied now bounds its loop)."""
    path = write(tmp_path, text)
    os.utime(path, (mtime, mtime))
    status = read_override(path, 1, 6, NOW, allowed_uids=OWN)
    assert status.override is not None
    assert status.override.decided_at == decided == status.written_at
    # Not part of what it says: the same pin decided at another time is the same pin.
    assert status.override == Override(
        "pin", 3, datetime(2099, 1, 1, tzinfo=UTC), "", "now", decided_at=0.0
    )


@pytest.mark.parametrize(
    ("expires_at", "ago"),
    [
        ("2026-05-01T11:00:00Z", "60.0 min"),
        ("2026-05-01T12:00:00Z", "0 s"),
        ("2026-05-01T12:00:01Z", None),
    ],
)
@pytest.mark.parametrize("body", ['mode = "pin"\nsteps = 3\n', 'mode = "freeze"\n'])
def test_an_expired_override_is_a_valid_file_with_nothing_in_force(
    tmp_path: Path, body: str, expires_at: str, ago: str | None
) -> None:
    """What the on-call wrote stays known after it expires (its expiry is exported, so the
    expired-in-file alert can fire); it is no longer in force."""
    status = read_override(
        write(tmp_path, f"{body}expires_at = {expires_at}\n"), 1, 6, NOW, allowed_uids=OWN
    )
    assert (status.valid, status.present, status.problem) == (True, True, None)
    assert status.override is not None
    assert status.override.expires_at == datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    assert status.override.active(NOW) is (ago is None)
    assert expired(status.override, NOW) == ago


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("mode = \n", "invalid TOML: Invalid value (at line 1, column 8)"),
        ('mode = "pinned"\n', "mode: 'pinned' is not one of auto, pin, freeze"),
        ("steps = 3\n", "mode: missing; one of auto, pin, freeze"),
        ("", "mode: missing"),
        ('\ufeffmode = "auto"\n', "starts with a UTF-8 byte order mark (BOM)"),
        ('mode = "auto"\nstep = 3\n', "unknown key 'step'"),
        ('mode = "pin"\nexpires_at = 2026-05-01T16:00:00Z\n', "steps: required"),
        ('mode = "pin"\nsteps = 9\nexpires_at = 2026-05-01T16:00:00Z\n', "outside the configured"),
        ('mode = "pin"\nsteps = 0\nexpires_at = 2026-05-01T16:00:00Z\n', "range 1..6"),
        ('mode = "pin"\nsteps = "3"\nexpires_at = 2026-05-01T16:00:00Z\n', "expected an integer"),
        ('mode = "pin"\nsteps = true\nexpires_at = 2026-05-01T16:00:00Z\n', "expected an integer"),
        ('mode = "pin"\nsteps = 3\n', "expires_at: required with mode = 'pin'"),
        ('mode = "freeze"\n', "expires_at: required with mode = 'freeze'"),
        ('mode = "pin"\nsteps = 3\nexpires_at = 2026-05-01T16:00:00\n', "has no UTC offset"),
        ('mode = "pin"\nsteps = 3\nexpires_at = "tomorrow"\n', "is not an RFC 3339 time"),
        ('mode = "pin"\nsteps = 3\nexpires_at = 2026-05-02\n', "expected a date-time"),
        # "Forever" with an offset is past year 9999 in UTC (an OverflowError used to escape
        # the reader, which never raises: the daemon's tick, `specd status`, `override show`).
        ('mode = "freeze"\nexpires_at = 9999-12-31T23:00:00-05:00\n', "outside years 1-9999"),
        ('mode = "freeze"\nexpires_at = "9999-12-31T23:59:59-00:01"\n', "outside years 1-9999"),
        ('mode = "pin"\nsteps = 3\nexpires_at = 0001-01-01T00:30:00+01:00\n', "outside years"),
        ('mode = "freeze"\nsteps = 3\nexpires_at = 2026-05-02T00:00:00Z\n', "only allowed with"),
        ('mode = "auto"\napply = "immediately"\n', "apply: 'immediately' is not one of"),
        ('mode = "auto"\nreason = 42\n', "reason: expected a string"),
        (
            'mode = "pin"\nsteps = 3\nsetting = "off"\nexpires_at = 2026-05-01T16:00:00Z\n',
            "give one of them, not both",
        ),
        ('mode = "freeze"\nsetting = "off"\nexpires_at = 2026-05-02T00:00:00Z\n', "setting: only"),
        ('mode = "pin"\nsetting = 3\nexpires_at = 2026-05-01T16:00:00Z\n', "expected a string"),
        ('mode = "pin"\nsetting = "banana"\nexpires_at = 2026-05-01T16:00:00Z\n', "'banana' is"),
        ('mode = "pin"\nsetting = "9"\nexpires_at = 2026-05-01T16:00:00Z\n', "range 1..6"),
        (
            'mode = "pin"\nsetting = "adaptive:3,9"\nexpires_at = 2026-05-01T16:00:00Z\n',
            "candidates 9 are outside the configured range 1..6",
        ),
        ('mode = "pin"\nsetting = "adaptive:"\nexpires_at = 2026-05-01T16:00:00Z\n', "setting:"),
    ],
)
def test_invalid_override(tmp_path: Path, text: str, problem: str) -> None:
    status = read_override(write(tmp_path, text), 1, 6, NOW, allowed_uids=OWN)
    assert (status.valid, status.present, status.override) == (False, True, None)
    assert status.problem is not None
    assert problem in status.problem
    assert "\n" not in status.problem


@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        (0o666, "world-writable (mode 0666)"),
        (0o646, "world-writable"),
        (0o640, None),
        (0o600, None),
        (0o444, None),
    ],
)
def test_file_permissions(tmp_path: Path, mode: int, problem: str | None) -> None:
    path = write(tmp_path, 'mode = "auto"\n', mode)
    status = read_override(path, 1, 6, NOW, allowed_uids=OWN)
    assert status.valid is (problem is None)
    assert problem is None or problem in (status.problem or "")


def test_group_writable_by_a_foreign_group(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("changing a file's group to a foreign one needs root")
    path = write(tmp_path, 'mode = "auto"\n', 0o664)
    os.chown(path, -1, 4242)
    status = read_override(path, 1, 6, NOW, allowed_uids=OWN)
    assert status.problem is not None
    assert "group-writable by gid 4242" in status.problem
    os.chown(path, -1, os.getgid())
    assert read_override(path, 1, 6, NOW, allowed_uids=OWN).valid


def test_group_writable_by_specds_own_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On-call users join group specd to read its state: a 0664 root:specd override let them
    pin with apply = now (a restart at once, outside any window) although only root and
    specd may write one, and `specd override show` (root's gid, 0) called the same file
    invalid. Only root's group may write it."""
    if os.getuid() != 0:
        pytest.skip("changing a file's group to a foreign one needs root")
    path = write(tmp_path, 'mode = "auto"\n', 0o664)
    os.chown(path, -1, 4242)
    monkeypatch.setattr(os, "getgid", lambda: 4242)  # as the daemon, run as group specd
    status = read_override(path, 1, 6, NOW, allowed_uids=OWN)
    assert status.problem is not None
    assert "group-writable by gid 4242" in status.problem
    path.chmod(0o644)
    assert read_override(path, 1, 6, NOW, allowed_uids=OWN).valid


def test_owned_by_another_user(tmp_path: Path) -> None:
    path = write(tmp_path, 'mode = "auto"\n')
    if os.getuid() == 0:
        os.chown(path, 4242, -1)
        status = read_override(path, 1, 6, NOW, allowed_uids=OWN)
        assert status.problem is not None
        assert "owned by uid 4242, not by root" in status.problem
    # Whoever we are: an owner outside the allowed list is refused.
    status = read_override(path, 1, 6, NOW, allowed_uids=(4343,))
    assert not status.valid


@pytest.mark.parametrize(
    ("dir_mode", "valid"),
    [(0o777, False), (0o1777, True), (0o755, True)],
)
def test_parent_directory_that_anyone_can_write(tmp_path: Path, dir_mode: int, valid: bool) -> None:
    parent = tmp_path / "etc"
    parent.mkdir()
    path = write(parent, 'mode = "auto"\n')
    parent.chmod(dir_mode)
    assert read_override(path, 1, 6, NOW, allowed_uids=OWN).valid is valid


def test_missing_file_is_no_override(tmp_path: Path) -> None:
    status = read_override(tmp_path / "none.toml", 1, 6, NOW)
    assert (status.valid, status.present, status.override, status.problem) == (
        True,
        False,
        None,
        None,
    )
    assert status.fingerprint == ABSENT


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda d: (d / "dir.toml").mkdir() or d / "dir.toml", "is not a regular file"),
        (lambda d: (d / "f", (d / "f").write_text(""))[0] / "x.toml", "cannot read"),
        (
            lambda d: (d / "big.toml", (d / "big.toml").write_text("#" * 70000))[0],
            "larger than",
        ),
        (lambda d: (d / "bin.toml", (d / "bin.toml").write_bytes(b"\xff"))[0], "not UTF-8"),
    ],
)
def test_unreadable_override(tmp_path: Path, make: object, problem: str) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    status = read_override(path, 1, 6, NOW, allowed_uids=OWN)
    assert (status.valid, status.present) == (False, True)
    assert problem in (status.problem or "")


def test_fingerprint_changes_when_the_file_is_replaced(tmp_path: Path) -> None:
    path = write(tmp_path, 'mode = "auto"\n')
    first = read_override(path, 1, 6, NOW, allowed_uids=OWN).fingerprint
    assert read_override(path, 1, 6, NOW, allowed_uids=OWN).fingerprint == first
    replacement = tmp_path / "new.toml"
    replacement.write_text('mode = "auto"\nreason = "x"\n')
    os.replace(replacement, path)
    assert read_override(path, 1, 6, NOW, allowed_uids=OWN).fingerprint != first


@pytest.mark.parametrize(
    ("override", "now", "active"),
    [
        (Override("pin", 3, NOW + timedelta(hours=1), "", "now"), NOW, True),
        (Override("pin", 3, NOW + timedelta(hours=1), "", "now"), NOW + timedelta(hours=1), False),
        (Override("freeze", None, NOW, "", "next-window"), NOW - timedelta(seconds=1), True),
        (Override("freeze", None, NOW, "", "next-window"), NOW.timestamp(), False),
        (Override("freeze", None, NOW, "", "next-window"), NOW.timestamp() - 0.5, True),
        (Override("auto", None, None, "", "next-window"), NOW, False),
        (Override("auto", None, NOW + timedelta(days=1), "", "next-window"), NOW, False),
    ],
)
def test_active(override: Override, now: datetime | float, active: bool) -> None:
    assert override.active(now) is active


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("4h", 14400), ("1d", 86400), ("1h30m", 5400), ("1.5h", 5400)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text).total_seconds() == seconds


@pytest.mark.parametrize("text", ["", "4", "h", "4x", "-1h", "0m", "4h 30m", "1w"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


# --- the `specd override` command -------------------------------------------------------


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    return make_config(tmp_path, window_opens_in_h=0)


def make_config(
    tmp_path: Path, window_opens_in_h: int, restart_cost_s: float | None = None
) -> tuple[Path, Path]:
    """A config whose one daily two-hour window opened at the start of this hour (0, open
    now) or opens ``window_opens_in_h`` hours after it."""
    override = tmp_path / "override.toml"
    config = tmp_path / "specd.toml"
    hour = (datetime.now(UTC).hour + window_opens_in_h) % 24
    cost = "" if restart_cost_s is None else f"restart_cost_s = {restart_cost_s}\n"
    config.write_text(
        f'[files]\noverride_file = "{override}"\n[choose]\nmin_steps = 2\nmax_steps = 5\n{cost}'
        "[[bands]]\nmax_concurrency = 4\nsteps = 4\n[[bands]]\nsteps = 3\n"
        f'[[windows]]\ncron = "0 {hour} * * *"\nduration_s = 7200\ntimezone = "UTC"\n'
    )
    return config, override


def test_pin_writes_a_valid_file(
    setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config, override = setup
    before = datetime.now(UTC)
    assert (
        main(["override", "pin", "3", "--for", "4h", "--reason", "eval", "--config", str(config)])
        == 0
    )
    assert "valid, pin 3 steps" in capsys.readouterr().out
    assert stat.S_IMODE(override.stat().st_mode) == 0o644
    assert sorted(p.name for p in override.parent.iterdir()) == ["override.toml", "specd.toml"]
    status = read_override(override, 2, 5, datetime.now(UTC), allowed_uids=OWN)
    assert status.override is not None
    assert (status.override.mode, status.override.steps, status.override.apply) == (
        "pin",
        3,
        "next-window",
    )
    assert status.override.reason == "eval"
    assert status.override.expires_at is not None
    left = status.override.expires_at - before
    assert timedelta(hours=4) - timedelta(seconds=2) <= left <= timedelta(hours=4, seconds=2)


@pytest.mark.parametrize(
    ("argv", "code", "mode", "apply"),
    [
        (["pin", "5", "--for", "30m", "--reason", "r", "--now"], 0, "pin", "now"),
        (["freeze", "--for", "2h", "--reason", "incident"], 0, "freeze", "next-window"),
        (["clear"], 0, "auto", "next-window"),
        (["pin", "6", "--for", "30m", "--reason", "r"], 2, None, None),  # above max_steps
        (["pin", "1", "--for", "30m", "--reason", "r"], 2, None, None),  # below min_steps
        (["pin", "3", "--for", "soon", "--reason", "r"], 2, None, None),
        (["freeze", "--for", "31d", "--reason", "r"], 2, None, None),
        (["pin", "off", "--for", "30m", "--reason", "r"], 0, "pin", "next-window"),
        (["pin", "adaptive:3,4", "--for", "30m", "--reason", "r", "--now"], 0, "pin", "now"),
        (["pin", "adaptive:3,6", "--for", "30m", "--reason", "r"], 2, None, None),
        (["pin", "adaptive:", "--for", "30m", "--reason", "r"], 2, None, None),
        (["pin", "sometimes", "--for", "30m", "--reason", "r"], 2, None, None),
    ],
)
def test_override_commands(
    setup: tuple[Path, Path], argv: list[str], code: int, mode: str | None, apply: str | None
) -> None:
    config, override = setup
    try:
        returned = main(["override", *argv, "--config", str(config)])
    except SystemExit as exc:  # argparse refuses a bad --for before the command runs
        returned = exc.code
    assert returned == code
    if mode is None:
        assert not override.exists()
        return
    status = read_override(override, 2, 5, datetime.now(UTC), allowed_uids=OWN)
    assert status.override is not None
    assert (status.override.mode, status.override.apply) == (mode, apply)


def test_file_flag_overrides_the_configured_path(setup: tuple[Path, Path], tmp_path: Path) -> None:
    config, configured = setup
    other = tmp_path / "other.toml"
    assert (
        main(
            [
                "override",
                "freeze",
                "--for",
                "1h",
                "--reason",
                "r",
                "--file",
                str(other),
                "--config",
                str(config),
            ]
        )
        == 0
    )
    assert other.exists()
    assert not configured.exists()


@pytest.mark.parametrize(
    ("text", "file_mode", "code", "says"),
    [
        (None, 0o644, 0, "no override file; specd decides automatically"),
        ('mode = "auto"\n', 0o644, 0, "valid, mode auto"),
        ('mode = "freeze"\nexpires_at = 2999-01-01T00:00:00Z\n', 0o644, 0, "makes no step changes"),
        (
            'mode = "pin"\nsteps = 3\nexpires_at = 2999-01-01T00:00:00Z\napply = "now"\n',
            0o644,
            0,
            "restarts at once",
        ),
        (
            'mode = "pin"\nsteps = 3\nexpires_at = 2999-01-01T00:00:00Z\n',
            0o644,
            0,
            "maintenance window",
        ),
        (
            'mode = "pin"\nsteps = 3\nexpires_at = 2000-01-01T00:00:00Z\n',
            0o644,
            0,
            "specd decides automatically again; delete the file",
        ),
        ('mode = "pin"\nsteps = 9\nexpires_at = 2999-01-01T00:00:00Z\n', 0o644, 1, "range 2..5"),
        ('mode = "auto"\n', 0o666, 1, "world-writable"),
        ("mode = \n", 0o644, 1, "invalid TOML"),
    ],
)
def test_show(
    setup: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    text: str | None,
    file_mode: int,
    code: int,
    says: str,
) -> None:
    config, override = setup
    if text is not None:
        override.write_text(text)
        override.chmod(file_mode)
    assert main(["override", "show", "--config", str(config)]) == code
    out = capsys.readouterr().out
    assert says in out
    if code:
        assert "INVALID" in out
        assert "keeps its last good state" in out


def test_show_invalid_as_a_real_process(setup: tuple[Path, Path]) -> None:
    config, override = setup
    override.write_text('mode = "pin"\nsteps = 3\n')
    proc = run_specd("override", "show", "--config", str(config), env=without_specd_env())
    assert proc.returncode == 1, proc.stderr
    assert "INVALID" in proc.stdout
    assert "expires_at: required" in proc.stdout
    assert proc.stderr == ""


def test_a_config_whose_files_table_is_broken_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A problem outside [files] does not stop the on-call (tests/commands/
    # test_oncall_bad_config.py); one in it does: no default override file is read instead.
    config = tmp_path / "specd.toml"
    config.write_text("max_step = 3\n[files]\noverride_file = 'override.toml'\n")
    assert main(["override", "show", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "files.override_file: 'override.toml' must be an absolute path" in err
    config.write_text(f"max_step = 3\n[files]\noverride_file = '{tmp_path}/override.toml'\n")
    assert main(["override", "show", "--config", str(config)]) == 0
    assert "max_step: unknown key" in capsys.readouterr().err


def test_unwritable_target_is_one_line(
    setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = setup
    target = tmp_path / "no-such-dir" / "override.toml"
    argv = ["override", "clear", "--file", str(target), "--config", str(config)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot write" in err


def _override_link(d: Path, target: str) -> Path:
    path = d / "override.toml"
    path.symlink_to(target)
    return path


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        # Deep, yet within the 64 KiB cap: the parser's recursion is what is tested.
        (lambda d: write(d, "a = " + "[" * 60_000), "invalid TOML: nested deeper than"),
        (
            lambda d: write(d, "mode = " + "{a = " * 10_000 + "1" + "}" * 10_000),
            "invalid TOML: nested deeper than",
        ),
        (lambda d: (os.mkfifo(d / "override.toml"), d / "override.toml")[1], "(a FIFO)"),
        (lambda d: _override_link(d, "/dev/zero"), "is a symbolic link"),
        (lambda d: _override_link(d, "/dev/urandom"), "is a symbolic link"),
        (
            lambda d: (write(d, ""), os.truncate(d / "override.toml", 2**40))[0],
            "larger than the 64 KiB allowed",
        ),
    ],
    ids=["deep-arrays", "deep-inline-tables", "fifo", "dev-zero", "dev-urandom", "sparse-1t"],
)
def test_a_hostile_override_is_invalid_in_one_line_within_a_second(
    tmp_path: Path, make: Any, problem: str
) -> None:
    path = make(tmp_path)
    started = time.monotonic()
    status = read_override(path, 1, 6, NOW, allowed_uids=OWN)
    assert time.monotonic() - started < 1.0
    assert (status.valid, status.present, status.override) == (False, True, None)
    assert status.problem is not None
    assert problem in status.problem
    assert str(path) in status.problem
    assert "\n" not in status.problem
    # A fingerprint, so the daemon logs a problem once and sees the file replaced.
    assert status.fingerprint != ABSENT


def test_writing_the_override_replaces_a_symlink_not_its_target(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.toml"
    target.write_text("# keep\n")
    path = _override_link(tmp_path, str(target))
    write_override(path, 'mode = "auto"\n')
    assert not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert target.read_text() == "# keep\n"
    assert read_override(path, 1, 6, NOW, allowed_uids=OWN).valid


@pytest.mark.parametrize(
    ("argument", "steps", "setting", "says"),
    [
        ("4", 4, None, "specd runs 4 steps"),
        ("off", None, off(), "specd runs no speculation"),
        ("adaptive:4,3", None, adaptive((3, 4)), "SGLang's adaptive mode adaptive:3,4"),
    ],
)
def test_pin_of_any_setting_round_trips(
    setup: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    argument: str,
    steps: int | None,
    setting: object,
    says: str,
) -> None:
    config, override = setup
    argv = ["override", "pin", argument, "--for", "1h", "--reason", "try", "--config", str(config)]
    assert main(argv) == 0
    assert says in capsys.readouterr().out
    status = read_override(override, 2, 5, datetime.now(UTC), allowed_uids=OWN)
    assert status.override is not None
    assert (status.override.steps, status.override.setting) == (steps, setting)
    assert main(["override", "show", "--config", str(config)]) == 0
    assert says in capsys.readouterr().out


@pytest.mark.parametrize(
    ("restart_cost_s", "shortest"),
    [
        # 11–12 h to the window: 12 h reaches it whatever the minute now.
        (0, "12h"),
        # ... and an hour's restart into it: 13 h (the default 100 s made the shortest
        # --for depend on the minute it ran at: 13 h in the first 100 s of an hour).
        (3600, "13h"),
    ],
)
def test_a_refused_pin_names_the_shortest_for_that_reaches_into_the_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restart_cost_s: float, shortest: str
) -> None:
    config, _ = make_config(tmp_path, window_opens_in_h=12, restart_cost_s=restart_cost_s)
    argv = ["override", "pin", "3", "--for", "2h", "--reason", "tonight"]
    assert main([*argv, "--config", str(config)]) == 2
    assert f"or pin --for {shortest} or more; nothing written" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        # The window opens in 11–12 h: a 2 h pin waiting for it would never apply.
        (
            ["pin", "3", "--for", "2h", "--reason", "tonight"],
            2,
            "before the next maintenance window opens",
        ),
        (["pin", "adaptive:3,4", "--for", "1h", "--reason", "r"], 2, "would never apply"),
        (["pin", "3", "--for", "2h", "--reason", "now", "--now"], 0, "restarts at once"),
        (["pin", "3", "--for", "14h", "--reason", "tonight"], 0, "in the next maintenance window"),
        # Nothing changes outside a window anyway: a short freeze is harmless.
        (["freeze", "--for", "2h", "--reason", "incident"], 0, "makes no step changes"),
    ],
)
def test_a_pin_that_expires_before_the_next_window_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, says: str
) -> None:
    config, override = make_config(tmp_path, window_opens_in_h=12)
    assert main(["override", *argv, "--config", str(config)]) == code
    captured = capsys.readouterr()
    assert says in (captured.err if code else captured.out)
    assert override.exists() is (code == 0)
    if code:
        assert "nothing written" in captured.err
        assert len(captured.err.splitlines()) == 1


@pytest.mark.parametrize(
    ("reason", "says"),
    [
        ("x" * 70_000, "70000 characters; at most 2000"),
        ("x" * 2001, "2001 characters; at most 2000"),
        ("", "say why"),
        ("   ", "say why"),
        ("ok\x1b[2Jgone", "control characters"),
        ("two\nlines", "control characters"),
    ],
)
def test_a_pin_specd_would_ignore_leaves_the_file_in_force_untouched(
    setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str], reason: str, says: str
) -> None:
    config, override = setup
    argv = ["override", "freeze", "--for", "1h", "--reason", "incident", "--config", str(config)]
    assert main(argv) == 0
    before = override.read_bytes()
    capsys.readouterr()
    argv = ["override", "pin", "3", "--for", "1h", "--reason", reason, "--config", str(config)]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse refuses a bad --reason before the command runs
        code = exc.code
    assert code == 2
    assert says in capsys.readouterr().err
    assert override.read_bytes() == before


def test_show_prints_a_hand_written_reason_without_its_control_characters(
    setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config, override = setup
    override.write_text(
        'mode = "freeze"\nexpires_at = 2999-01-01T00:00:00Z\nreason = "see \\u001b[2Jticket"\n'
    )
    override.chmod(0o644)
    assert main(["override", "show", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "reason: see \\x1b[2Jticket" in out


def test_a_freeze_longer_than_the_cli_allows_names_the_config_way(
    setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    config, _ = setup
    with pytest.raises(SystemExit):
        main(["override", "freeze", "--for", "31d", "--reason", "r", "--config", str(config)])
    err = capsys.readouterr().err
    assert "restart.daily_restart_budget = 0" in err
    assert "min_steps" not in err


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_who_wrote_an_override_is_read_from_any_first_line_in_one_line(head: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "override.toml"
        path.write_bytes(head + b'\nmode = "auto"\n')
        who = written_by(path)
        assert who is None or ("\n" not in who and len(who) <= 125)


@pytest.mark.parametrize(
    ("head", "who"),
    [
        (
            "# written by `specd override pin` as alice (sudo) at 2026-12-06T10:05:51+00:00",
            "alice (sudo) at 2026-12-06T10:05:51+00:00",
        ),
        ("# written by `specd override freeze` as root at 2026-12-06T10:05:51Z", "root at "),
        ("# by hand, see INC-42", None),
        ("", None),
    ],
)
def test_who_wrote_an_override(tmp_path: Path, head: str, who: str | None) -> None:
    path = tmp_path / "override.toml"
    path.write_text(f'{head}\nmode = "auto"\n')
    found = written_by(path)
    assert (found is None) if who is None else (found is not None and found.startswith(who))
    assert written_by(tmp_path / "absent.toml") is None


def _kernel_lets(user: str, path: Path) -> bool:
    """Whether ``user`` can open ``path`` for reading, asked of the kernel: a forked child
    takes the user's ids and tries (no exec: the interpreter may be where it cannot go)."""
    entry = pwd.getpwnam(user)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgroups(os.getgrouplist(user, entry.pw_gid))
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            with open(path, "rb"):
                os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="judging another user's access needs root")
@pytest.mark.parametrize("dir_mode", [0o755, 0o750, 0o700])
@pytest.mark.parametrize("group", ["root", "nogroup"])
@pytest.mark.parametrize("file_mode", [0o644, 0o640, 0o604, 0o600, 0o400])
def test_a_file_the_daemon_user_cannot_read_is_invalid_as_the_daemon_finds_it(
    monkeypatch: pytest.MonkeyPatch, dir_mode: int, group: str, file_mode: int
) -> None:
    """Written by hand as root with umask 077 (0600 root:root), the file was valid to
    `override show` and `status`, run as root, while specd, running as its own user, could
    not read it and ignored it."""
    monkeypatch.setattr(override_io, "DAEMON_USER", "nobody")
    top = Path(tempfile.mkdtemp(dir="/tmp", prefix="specd-override-"))
    try:
        top.chmod(0o755)
        directory = top / "etc"
        directory.mkdir()
        os.chown(directory, 0, grp.getgrnam(group).gr_gid)
        directory.chmod(dir_mode)
        path = directory / "override.toml"
        path.write_text('mode = "freeze"\nexpires_at = 2999-01-01T00:00:00Z\nreason = "r"\n')
        os.chown(path, 0, grp.getgrnam(group).gr_gid)
        path.chmod(file_mode)
        readable = _kernel_lets("nobody", path)
        status = read_override(path, 1, 6, NOW, as_daemon=True)
        assert status.valid is readable, status.problem
        if not readable:
            assert status.problem is not None
            assert status.problem.startswith("user nobody cannot ")
            assert "\n" not in status.problem
        # The daemon itself reads as itself: unchanged.
        assert read_override(path, 1, 6, NOW, allowed_uids=(0,)).valid
    finally:
        shutil.rmtree(top)
