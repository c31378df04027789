"""specd and a directory it cannot write: SGLang's env file on a file system remounted
read-only. Real read-only tmpfs mounts.

Before: a change whose env file did not exist yet ended `failed` and froze specd (the
rollback's unlink of the absent file failed with EROFS), though nothing was restarted."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tomli_w
from factories import mounted_tmpfs, tables

from specd.io.apply import Applier
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
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    return proc.returncode, lines


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
