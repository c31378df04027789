"""A state directory's specd.lock that is no lock file specd made: the on-call commands
(status, override show/clear/freeze/pin, unfreeze) read it for the daemon's pid. A FIFO
there hung each of them for ever, a symlink to /dev/zero was read until memory ran out,
and `specd run` refused a FIFO or a directory with "Invalid argument" and advice about
ReadWritePaths=. Each command now answers within seconds, says in one line that it cannot
tell whether specd runs and why, and exits as it did; `specd run` names what is there.

Real FIFOs, symlinks, directories and sparse files; each command runs in this process, as
`specd` runs it, in a thread given a few seconds (a regression fails, it does not hang)."""

from __future__ import annotations

import json
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bounded import BOUND_S, bounded, plant_directory, plant_fifo, plant_huge, plant_zero
from factories import run_specd, without_specd_env
from in_process import specd_main

from specd.commands.status import daemon
from specd.io.state import (
    LOCK_FILE,
    UNFREEZE_REQUEST,
    LockFileUnusable,
    State,
    StateStore,
    lock_state_dir,
)
from specd.twin.process import free_port


def _unreadable(path: Path) -> None:
    path.write_text("not a pid\n")
    path.chmod(0o000)


# (make it, what the one line says; None: the kernel's lock table still answers, by the
# file's inode, as for a 0640 lock file whoever runs the command may not read).
HOSTILE = [
    pytest.param(plant_fifo, "is not a regular file (a FIFO)", id="fifo"),
    pytest.param(plant_zero, "is a symbolic link", id="symlink to /dev/zero"),
    pytest.param(plant_directory, "is not a regular file (a directory)", id="directory"),
    pytest.param(plant_huge, "is 64 MiB, larger than the 64 bytes allowed", id="huge regular file"),
    pytest.param(_unreadable, None, id="unreadable"),
]


def setup(tmp_path: Path, make: Callable[[Path], None], frozen: bool = False) -> Path:
    """A config on ``tmp_path`` whose state directory's lock file ``make`` plants; a state
    saved there (frozen if asked); SGLang down. Returns the config's path."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    saved = {"since": time.time() - 60, "reason": "restart to 6 rolled_back"} if frozen else None
    assert StateStore(state_dir).save(State(frozen=saved)) is None
    make(state_dir / LOCK_FILE)
    config = tmp_path / "specd.toml"
    config.write_text(
        f'[sglang]\nurl = "http://127.0.0.1:{free_port()}"\nenv_file = "{tmp_path}/sglang.env"\n'
        f'[files]\nstate_dir = "{state_dir}"\noverride_file = "{tmp_path}/override.toml"\n'
    )
    return config


def specd(config: Path, *argv: str) -> Any:
    """`specd ARGV --config CONFIG` in this process, within BOUND_S."""
    lock = config.parent / "state" / LOCK_FILE
    env = without_specd_env()
    return bounded(lambda: specd_main(*argv, "--config", str(config), env=env), lock)


def clean(config: Path) -> None:
    """The planted lock file gone: what the same command answers without it."""
    lock = config.parent / "state" / LOCK_FILE
    if lock.is_dir() and not lock.is_symlink():
        lock.rmdir()
    else:
        lock.unlink()


@pytest.mark.parametrize(("make", "problem"), HOSTILE)
def test_daemon_says_it_cannot_tell_for_a_lock_file_that_is_no_lock(
    tmp_path: Path, make: Callable[[Path], None], problem: str | None
) -> None:
    make(tmp_path / LOCK_FILE)
    found = bounded(lambda: daemon(tmp_path), tmp_path / LOCK_FILE)
    if problem is None:
        assert found == {"running": False, "pid": None}
        return
    assert (found["running"], found["pid"]) == (None, None), found
    [line] = found["problem"].splitlines()
    assert line.startswith(f"{tmp_path / LOCK_FILE}: {problem}"), line


@pytest.mark.parametrize(("make", "problem"), HOSTILE)
def test_status_says_on_its_specd_line_that_it_cannot_tell(
    tmp_path: Path, make: Callable[[Path], None], problem: str | None
) -> None:
    config = setup(tmp_path, make)
    shown = specd(config, "status")
    as_json = specd(config, "status", "--json")
    assert "Traceback" not in shown.stdout + shown.stderr, shown.stderr
    [line] = [x for x in shown.stdout.splitlines() if x.startswith("specd ")]
    said = json.loads(as_json.stdout)["daemon"]
    if problem is None:
        assert line.startswith("specd          NOT RUNNING"), line
        assert said == {"running": False, "pid": None}
    else:
        assert line.startswith(
            "specd          ? (cannot tell whether `specd run` holds its state directory's "
            f"lock: {config.parent / 'state' / LOCK_FILE}: {problem}"
        ), line
        assert said["running"] is None, said
        assert problem in said["problem"], said
        # Said once, on the line that says whether specd runs.
        assert sum(LOCK_FILE in x for x in shown.stdout.splitlines()) == 1, shown.stdout
    clean(config)
    assert (shown.returncode, as_json.returncode) == (
        specd(config, "status").returncode,
        specd(config, "status", "--json").returncode,
    )


OVERRIDES = [
    pytest.param(["override", "show"], id="show"),
    pytest.param(["override", "clear", "--reason", "t"], id="clear"),
    pytest.param(["override", "freeze", "--for", "2h", "--reason", "t"], id="freeze"),
    pytest.param(["override", "pin", "4", "--for", "2d", "--reason", "t"], id="pin"),
]


@pytest.mark.parametrize("argv", OVERRIDES)
@pytest.mark.parametrize(("make", "problem"), HOSTILE)
def test_override_notes_that_it_cannot_tell_whether_specd_runs(
    tmp_path: Path, make: Callable[[Path], None], problem: str | None, argv: list[str]
) -> None:
    config = setup(tmp_path, make)
    done = specd(config, *argv)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    notes = [x for x in done.stdout.splitlines() if x.startswith("note: ")]
    if problem is None:
        assert notes == [
            "note: specd is not running: nothing reads this file until it starts "
            "(`systemctl start specd`)"
        ], done.stdout
    else:
        [note] = notes
        assert note.startswith(
            f"note: cannot tell whether specd runs: {config.parent / 'state' / LOCK_FILE}: "
            f"{problem}"
        ), done.stdout
    clean(config)
    (tmp_path / "override.toml").unlink(missing_ok=True)
    assert done.returncode == specd(config, *argv).returncode


@pytest.mark.parametrize(("make", "problem"), HOSTILE)
def test_unfreeze_says_it_cannot_tell_whether_specd_runs(
    tmp_path: Path, make: Callable[[Path], None], problem: str | None
) -> None:
    config = setup(tmp_path, make, frozen=True)
    done = specd(config, "unfreeze", "--reason", "fixed")
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("unfreeze requested")]
    if problem is None:
        assert line == (
            "unfreeze requested; specd is not running: it clears the freeze when it starts"
        )
    else:
        assert line.startswith(
            "unfreeze requested; specd clears it within one tick if it runs, else when it "
            f"starts (cannot tell whether it runs: {config.parent / 'state' / LOCK_FILE}: "
            f"{problem}"
        ), line
    assert done.returncode == 0
    # Asked all the same: a running specd clears the freeze at its next tick.
    assert (config.parent / "state" / UNFREEZE_REQUEST).is_file()


def _socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))


# What `specd run` finds at its lock file, and the kind its refusal names.
NOT_A_FILE = [
    pytest.param(plant_fifo, "a FIFO", id="fifo"),
    pytest.param(plant_directory, "a directory", id="directory"),
    pytest.param(_socket, "a socket", id="socket"),
]


@pytest.mark.parametrize(("make", "kind"), NOT_A_FILE)
def test_taking_the_lock_names_what_is_there_instead_of_a_file(
    tmp_path: Path, make: Callable[[Path], None], kind: str
) -> None:
    lock = tmp_path / LOCK_FILE
    make(lock)
    before = lock.lstat()

    def take() -> str:
        with pytest.raises(LockFileUnusable) as refused:
            lock_state_dir(tmp_path)
        return str(refused.value)

    assert bounded(take, lock) == (
        f"{lock} is {kind}, not a regular file: specd keeps its lock in a regular file it "
        "makes there; remove it"
    )
    after = lock.lstat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)


def test_specd_run_refuses_a_fifo_at_its_lock_file_naming_it(tmp_path: Path) -> None:
    """It said `state_dir_unusable` with "Invalid argument" (truncating the FIFO) and advised
    `specd install` and ReadWritePaths=, which change nothing."""
    config = setup(tmp_path, plant_fifo)
    lock = tmp_path / "state" / LOCK_FILE
    proc = run_specd("run", "--config", str(config), env=without_specd_env(), timeout=BOUND_S * 3)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    [line] = [x for x in lines if x["event"] == "state_dir_unusable"]
    assert line["error"] == (
        f"{lock} is a FIFO, not a regular file: specd keeps its lock in a regular file it "
        "makes there; remove it"
    )
    assert "fix" not in line
    assert stat.S_ISFIFO(lock.lstat().st_mode)
