"""specd and a directory it cannot write: SGLang's env file in a directory specd.service's
sandbox leaves read-only (ProtectSystem=strict), gone, or on a file system remounted
read-only. Real processes, real read-only tmpfs mounts; under a real systemd:
tests/systemd/test_writable_systemd.py.

Before: `specd run` started, and every change failed at its first write, window after
window; a change whose env file did not exist yet even ended `failed` and froze specd (the
rollback's unlink of the absent file failed with EROFS), though nothing was restarted; a
reload to such an env file was taken."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import tomli_w
from factories import mounted_tmpfs, run_specd, tables
from prometheus_client import CollectorRegistry

from specd.daemon import Daemon
from specd.io.apply import Applier
from specd.io.config import load_config
from specd.io.notify import Notifier
from specd.io.runner import RunResult
from specd.io.sglang import SGLangClient
from specd.twin.process import free_port
from specd.twin.unit import TwinUnitRunner, twin_unit_config

REPO = Path(__file__).resolve().parent.parent
FAST = ["--load-time-s", "0.2"]


@contextlib.contextmanager
def read_only_dir(path: Path) -> Iterator[Path]:
    """A real read-only file system at ``path`` (an empty tmpfs, remounted ro)."""
    with mounted_tmpfs(path, "1m") as mounted:
        subprocess.run(["mount", "-o", "remount,ro", str(mounted)], check=True)
        yield mounted


def write_config(tmp_path: Path, env_file: Path, state_dir: Path | None = None) -> Path:
    path = tmp_path / "specd.toml"
    data = tables(
        url="http://127.0.0.1:9",  # nothing listens: the daemon sees no_data
        env_file=str(env_file),
        state_dir=str(state_dir or tmp_path / "state"),
        override_file=str(tmp_path / "override.toml"),
        metrics_port=0,
        scrape_timeout_s=0.5,
    )
    path.write_text(tomli_w.dumps(data))
    return path


def specd_run(config: Path) -> tuple[int, list[dict[str, Any]]]:
    """`specd run` as specd.service starts it; its exit code and JSON log lines."""
    proc = run_specd("run", "--config", str(config), cwd=REPO)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return proc.returncode, lines


@pytest.mark.parametrize("fault", ["read-only file system", "it does not exist"])
def test_specd_run_refuses_an_env_file_directory_it_cannot_write(
    tmp_path: Path, fault: str
) -> None:
    with contextlib.ExitStack() as stack:
        if fault == "read-only file system":
            directory = stack.enter_context(read_only_dir(tmp_path / "srv"))
        else:
            directory = tmp_path / "gone"
        env_file = directory / "sglang.env"
        code, lines = specd_run(write_config(tmp_path, env_file))
    assert code == 1
    [line] = [x for x in lines if x["event"] == "env_file_unwritable"]
    assert line["level"] == "error"
    assert line["problem"] == (
        f"sglang.env_file: specd cannot write {directory} ({fault}), where it writes SGLang's "
        "env file; `specd install --unit sglang.service` prepares it (creates it for user "
        "specd and adds it to specd.service's ReadWritePaths=: ProtectSystem=strict lets specd "
        "write only /var/lib/specd and those), or keep sglang.env_file under /var/lib/specd"
    )
    # Nothing began: no metrics served, no decision, no state written.
    assert [x["event"] for x in lines] == ["env_file_unwritable"]
    assert not (tmp_path / "state" / "state.json").exists()


def test_specd_run_names_the_fix_for_a_state_directory_it_cannot_write(tmp_path: Path) -> None:
    with read_only_dir(tmp_path / "srv") as directory:
        code, lines = specd_run(write_config(tmp_path, tmp_path / "sglang.env", directory))
    assert code == 1
    [line] = [x for x in lines if x["event"] == "state_dir_unusable"]
    assert line["error"] == "Read-only file system"
    assert line["fix"].startswith("`specd install --unit sglang.service` prepares it")
    assert line["fix"].endswith("or keep files.state_dir under /var/lib/specd")


def refused(argv: Sequence[str], *, timeout_s: float) -> RunResult:
    """No systemd here: what a reload asks of it is refused (it asks nothing it needs)."""
    return RunResult(tuple(argv), 1, "", "no systemd in this test", False, 0.0)


def test_a_reload_to_an_env_file_specd_cannot_write_is_rejected(tmp_path: Path) -> None:
    config_path = write_config(tmp_path, tmp_path / "sglang.env")
    daemon = Daemon(
        load_config(config_path),
        config_path,
        registry=CollectorRegistry(),
        runner=refused,
        notifier=Notifier(environ={}),
    )
    with read_only_dir(tmp_path / "srv") as directory:
        write_config(tmp_path, directory / "sglang.env")
        with structlog.testing.capture_logs() as logs:
            daemon.reload()
    [line] = [x for x in logs if x["event"] == "reload_rejected"]
    assert line["problem"].startswith(
        f"sglang.env_file: specd cannot write {directory} (read-only file system)"
    )
    assert daemon.config.sglang.env_file == tmp_path / "sglang.env"  # the running one kept
    # The same file, once its directory is writable, is taken.
    (tmp_path / "llm").mkdir()
    write_config(tmp_path, tmp_path / "llm" / "sglang.env")
    with structlog.testing.capture_logs() as logs:
        daemon.reload()
    assert not [x for x in logs if x["event"] == "reload_rejected"], logs
    assert daemon.config.sglang.env_file == tmp_path / "llm" / "sglang.env"


def test_an_env_file_write_refused_by_a_read_only_file_system_aborts_without_a_freeze(
    tmp_path: Path,
) -> None:
    """The env file not written yet (a fresh install) in a directory that turned read-only:
    the change restarted nothing and the file is as it was, so it is `aborted` (tried again
    at the next tick), not `failed` (which freezes specd until an operator unfreezes it)."""
    with read_only_dir(tmp_path / "srv") as directory:
        env_file = directory / "sglang.env"
        port = free_port()
        config = twin_unit_config(tmp_path, port, sglang={"env_file": str(env_file)})
        unit = TwinUnitRunner(
            config.sglang.unit, env_file, port=port, extra_args=["--load-time-s", "0.2"]
        )
        twin = unit.start()
        try:
            twin.wait_healthy(30)
            saved: list[dict[str, Any] | None] = []

            def persist(journal: dict[str, Any] | None) -> str | None:
                saved.append(journal)
                return None

            with SGLangClient(config.sglang.url, timeout_s=5.0) as client:
                applier = Applier.from_settings(config, client, unit, persist, threading.Event())
                outcome = applier.apply(4, 3, window_open=lambda: True, force=True)
        finally:
            unit.stop()
        assert not env_file.exists()
    assert outcome.result == "aborted", outcome.message
    assert outcome.message.startswith(f"writing {env_file} failed: [Errno 30] Read-only file")
    assert outcome.message.endswith("; nothing was restarted")
    assert (outcome.restarts_issued, unit.restarted_to) == (0, [])


SETPRIV = shutil.which("setpriv")


@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv")
def test_specd_run_will_not_start_over_a_state_file_it_cannot_read(tmp_path: Path) -> None:
    """A root command left state.json to another user, unreadable to specd's (here: root
    without the capabilities that read any file, as a `specd` user is). The service read it
    as corrupt: moved it aside, started fresh, forgot a freeze and a restart in flight, and
    its next save replaced the file. It now says so and starts nothing, the file as it was."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state = state_dir / "state.json"
    saved = json.dumps({"version": 1, "frozen": {"since": 1.0e9, "reason": "rolled back"}})
    state.write_text(saved)
    state.chmod(0o600)
    nobody = pwd.getpwnam("nobody")
    os.chown(state, nobody.pw_uid, nobody.pw_gid)
    config = write_config(tmp_path, tmp_path / "sglang.env", state_dir)
    assert SETPRIV is not None
    drop = ["--bounding-set", "-dac_override,-dac_read_search"]
    proc = subprocess.run(
        [SETPRIV, *drop, sys.executable, "-m", "specd.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    [line] = [x for x in lines if x["event"] == "state_unreadable"]
    assert "Permission denied" in line["problem"]
    assert f"chown specd:specd {state}" in line["fix"]
    assert [x["event"] for x in lines] == ["state_unreadable"]
    assert state.read_text() == saved
    assert state.stat().st_uid == nobody.pw_uid
    assert sorted(p.name for p in state_dir.iterdir()) == ["specd.lock", "state.json"]


def test_specd_run_does_not_follow_a_symlink_planted_as_its_lock_file(tmp_path: Path) -> None:
    """The lock file was opened following links and truncated to hold the pid: a link to
    state.json (or anything specd's user may write) lost its content."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    target = tmp_path / "precious"
    target.write_text("kept\n")
    (state_dir / "specd.lock").symlink_to(target)
    code, lines = specd_run(write_config(tmp_path, tmp_path / "sglang.env", state_dir))
    assert code == 1
    [line] = [x for x in lines if x["event"] == "state_dir_unusable"]
    assert line["error"] == (
        f"{state_dir / 'specd.lock'} is a symbolic link: specd does not follow it (it would "
        "truncate what it points to); remove it"
    )
    assert target.read_text() == "kept\n"


@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv")
def test_specd_run_names_the_owner_of_a_lock_file_it_cannot_open(tmp_path: Path) -> None:
    """A first `specd run` as another user left specd.lock to it: the service failed with
    "Permission denied" and a fix about ReadWritePaths=, until systemd's start limit."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    lock = state_dir / "specd.lock"
    lock.write_text("")
    lock.chmod(0o640)
    nobody = pwd.getpwnam("nobody")
    os.chown(lock, nobody.pw_uid, nobody.pw_gid)
    config = write_config(tmp_path, tmp_path / "sglang.env", state_dir)
    assert SETPRIV is not None
    proc = subprocess.run(
        [SETPRIV, "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-m",
         "specd.cli", "run", "--config", str(config)],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    [line] = [x for x in lines if x["event"] == "state_dir_unusable"]
    assert line["error"] == (
        f"{lock} belongs to uid {nobody.pw_uid}, and specd (uid 0) cannot open it: a command "
        f"run as another user made it; chown specd:specd {lock}"
    )
