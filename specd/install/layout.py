"""Where install and uninstall put things, the one error they raise, and the ``Layout`` that maps
system paths to a root: ``/`` in production, a temporary directory in tests."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specd.core.text import is_service_name
from specd.io.files import MIB, FileReadError, MissingFileError, read_regular_file
from specd.io.runner import Runner, RunResult

DROPIN_NAME = "50-specd.conf"
SPECD_UNIT = "specd.service"
SPECD_USER = "specd"
UNITS_DIR = Path("/etc/systemd/system")
STATE_DIR = Path("/var/lib/specd")
ENV_FILE = STATE_DIR / "sglang.env"
CONFIG_DIR = Path("/etc/specd")
CONFIG_FILE = CONFIG_DIR / "specd.toml"
OVERRIDE_FILE = CONFIG_DIR / "override.toml"
# In /etc/specd rather than specd's state dir: the daemon can write /var/lib/specd, and a
# manifest it could edit would let it steer what root deletes at uninstall.
MANIFEST_FILE = CONFIG_DIR / "install-manifest.json"
POLKIT_FILE = Path("/etc/polkit-1/rules.d/50-specd.rules")
SYSUSERS_FILE = Path("/etc/sysusers.d/specd.conf")
# What uninstall archives (specd's state, env file, override) and what install moves aside
# (an override from an earlier installation), one dated directory per run. Outside specd's
# own directories: those are removed.
ARCHIVE_ROOT = Path("/var/backups/specd")
SYSTEMCTL_TIMEOUT_S = 30.0
START_TIMEOUT_S = 120.0
# What `Layout.read` reads at most: above any file install reads or writes (the manifest,
# which holds what install replaced, included).
MAX_READ_BYTES = 16 * MIB


class InstallError(Exception):
    """install/uninstall cannot go on; the message is one line for the operator."""


class UnusableFile(InstallError, OSError):
    """A file `Layout.read` will not read (a FIFO, a device, a directory, one too big); the
    message is one line naming it. An InstallError: install, uninstall and doctor stop on it
    and say that line. An OSError: a reader that skips a file it cannot read (an
    EnvironmentFile= of the unit, the url of a specd.toml) skips this one too."""


@dataclass(frozen=True)
class Layout:
    """Where the system's files are: ``/`` in production, a directory in tests."""

    root: Path = Path("/")

    def host(self, path: Path) -> Path:
        return self.root / path.relative_to("/")

    def read(self, path: Path, max_bytes: int = MAX_READ_BYTES) -> bytes | None:
        """The bytes of the system's file ``path``; None when nothing is there.

        Read as specd reads a file it does not trust (`specd.io.files.read_regular_file`):
        without blocking, a regular file only, at most ``max_bytes``; a symbolic link is
        followed (units, configs and env files may be links to the files they manage).
        A FIFO there hung install, uninstall and doctor; a link to /dev/zero was read
        until memory ran out. Raises ``UnusableFile`` (one line naming ``path``) for
        anything but a regular file, or a bigger one; ``OSError`` with its errno when the
        system refuses the read (``PermissionError``: doctor and --dry-run tell it apart)."""
        try:
            return read_regular_file(self.host(path), max_bytes, follow_symlinks=True)
        except MissingFileError:
            return None
        except FileReadError as exc:
            if exc.os_errno is not None:
                raise OSError(exc.os_errno, os.strerror(exc.os_errno), str(path)) from None
            raise UnusableFile(f"{path} {exc.problem}") from None


def stamp(now_s: float) -> str:
    """A UTC time for names of archives and backups: sorts, and has no ':' (a path)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now_s))


def check_unit_name(unit: str) -> str:
    if not is_service_name(unit):
        raise InstallError(f"{unit!r} is not a systemd service name such as sglang.service")
    return unit


def run_checked(
    runner: Runner, argv: Sequence[str], timeout_s: float = SYSTEMCTL_TIMEOUT_S
) -> RunResult:
    result = runner(list(argv), timeout_s=timeout_s)
    if not result.ok:
        raise InstallError(result.summary())
    return result
