"""The directories specd writes in, and whether this process can write there now.

specd writes its state (state.json, its lock, the adaptive configs SGLang reads) in
``[files] state_dir``, and SGLang's env file as a new file in ``[sglang] env_file``'s
directory, renamed over the old one. Under specd.service (``ProtectSystem=strict``) only
/var/lib/specd (``StateDirectory=specd``) and the unit's ``ReadWritePaths=`` are writable:
anywhere else every change failed with "Read-only file system", or specd did not start.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from specd.core.settings import Settings

# specd.service's StateDirectory=specd: writable for specd whatever else the unit allows.
STATE_DIRECTORY = Path("/var/lib/specd")


@dataclass(frozen=True)
class WrittenDir:
    """A directory specd writes in, and the config key that puts it there."""

    key: str  # as config problems name keys: "sglang.env_file"
    configured: Path  # the key's value
    directory: Path  # where specd creates files for it
    what: str  # what specd writes there
    also: str = ""  # another key that has specd write there (the env file beside the state)

    @property
    def keys(self) -> str:
        return f"{self.key}, {self.also}" if self.also else self.key


def written_dirs(settings: Settings) -> list[WrittenDir]:
    """state_dir, then the env file's directory (one entry for both when they are one)."""
    return written_dirs_at(settings.files.state_dir, settings.sglang.env_file)


def written_dirs_at(state_dir: Path, env_file: Path) -> list[WrittenDir]:
    """`written_dirs` of a config's two paths."""
    state = Path(os.path.normpath(state_dir))
    env_file = Path(os.path.normpath(env_file))
    what = "its state, lock and adaptive configs"
    if env_file.parent == state:
        return [WrittenDir("files.state_dir", state, state, what, also="sglang.env_file")]
    return [
        WrittenDir("files.state_dir", state, state, what),
        WrittenDir("sglang.env_file", env_file, env_file.parent, "SGLang's env file"),
    ]


def cannot_write(directory: Path) -> str | None:
    """Why this process cannot create a file in ``directory`` now ("read-only file
    system", "permission denied", "it does not exist"), or None when it can."""
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return "it does not exist"
    except OSError as exc:
        return exc.strerror or str(exc)
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return "read-only file system" if read_only else "permission denied"


def fix_for(written: WrittenDir, unit: str) -> str:
    """One line: how to let specd (under specd.service) write there."""
    return (
        f"`specd install --unit {unit}` prepares it (creates it for user specd and adds it to "
        f"specd.service's ReadWritePaths=: ProtectSystem=strict lets specd write only "
        f"{STATE_DIRECTORY} and those), or keep {written.key} under {STATE_DIRECTORY}"
    )


def unwritable(settings: Settings, written: WrittenDir) -> str | None:
    """One line when this process cannot write where ``written`` says, with the fix."""
    why = cannot_write(written.directory)
    if why is None:
        return None
    return (
        f"{written.key}: specd cannot write {written.directory} ({why}), where it writes "
        f"{written.what}; {fix_for(written, settings.sglang.unit)}"
    )


def env_file_unwritable(settings: Settings) -> str | None:
    """`unwritable` of the env file's directory where it is not the state directory (that
    one the state directory's lock already tried): a start refuses it, a reload rejects it."""
    for written in written_dirs(settings)[1:]:
        problem = unwritable(settings, written)
        if problem is not None:
            return problem
    return None
