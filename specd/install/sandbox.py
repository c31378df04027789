"""Where specd.service lets specd write, against the directories specd.toml has it write in.

The shipped unit runs specd with ProtectSystem=strict: the whole file system is read-only to
it except /var/lib/specd (StateDirectory=specd) and what ReadWritePaths= names; PrivateTmp=yes
gives it a /tmp and /var/tmp of its own, ProtectHome=yes hides /home, /root and /run/user. A
``[files] state_dir`` or an ``[sglang] env_file`` elsewhere stopped specd's start, or failed
every change ("Read-only file system") and froze specd. `specd install` allows each such
directory (ReadWritePaths=) and creates it for user specd, or refuses what no unit line can
fix; `specd doctor` judges the unit as systemd loaded it.
"""

from __future__ import annotations

import grp
import os
import pwd
import shlex
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from specd.install.layout import Layout
from specd.io.writable import STATE_DIRECTORY, WrittenDir

# What PrivateTmp=yes replaces with the service's own, and what ProtectHome=yes hides.
PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))  # noqa: S108 - paths, not temp files
HOME = (Path("/home"), Path("/root"), Path("/run/user"))
STATE_ROOT = Path("/var/lib")  # StateDirectory= names are relative to it
# What `systemctl show` says of them.
SANDBOX_PROPERTIES = (
    "ProtectSystem",
    "StateDirectory",
    "ReadWritePaths",
    "PrivateTmp",
    "ProtectHome",
)


def _within(path: Path, tops: tuple[Path, ...] | list[Path]) -> bool:
    return any(path == top or top in path.parents for top in tops)


def _yes(value: str) -> bool:
    return value.strip().lower() in ("yes", "true", "on", "1")


@dataclass(frozen=True)
class Sandbox:
    """The parts of a unit's [Service] that decide what it may write."""

    protect_system: str = "no"
    state_dirs: tuple[Path, ...] = ()
    read_write: tuple[Path, ...] = ()
    private_tmp: bool = False
    protect_home: str = "no"

    @classmethod
    def from_properties(cls, props: Mapping[str, str]) -> Sandbox:
        """From ``systemctl show`` (or the unit file's own assignments, last one wins)."""
        return cls(
            protect_system=props.get("ProtectSystem", "no").strip() or "no",
            state_dirs=tuple(STATE_ROOT / name for name in props.get("StateDirectory", "").split()),
            # "-" (ignore if missing) and "+" (outside the root directory) are prefixes.
            read_write=tuple(
                Path(word.lstrip("-+")) for word in shlex.split(props.get("ReadWritePaths", ""))
            ),
            private_tmp=_yes(props.get("PrivateTmp", "no")),
            protect_home=props.get("ProtectHome", "no").strip() or "no",
        )

    @classmethod
    def from_unit_text(cls, text: str) -> Sandbox:
        """The sandbox a unit file's [Service] sets: each key's last assignment; the list
        keys add up, an empty assignment resets them."""
        # Here, not at the top: check-config reads SHIPPED without the unit reader's imports.
        from specd.install.unit import service_assignments  # noqa: PLC0415

        props: dict[str, str] = {}
        for key in SANDBOX_PROPERTIES:
            values = service_assignments(text, key)
            if key in ("StateDirectory", "ReadWritePaths"):
                joined = ""
                for value in values:
                    joined = f"{joined} {value}".strip() if value else ""
                props[key] = joined
            elif values:
                props[key] = values[-1]
        return cls.from_properties(props)

    def hides(self, directory: Path) -> str | None:
        """Why the service sees another directory there than SGLang does, or none at all."""
        if self.private_tmp and _within(directory, PRIVATE_TMP):
            return (
                "PrivateTmp=yes gives specd.service a /tmp and /var/tmp of its own (SGLang "
                "would never see what specd writes there, and it is emptied at every start)"
            )
        if self.protect_home not in ("no", "") and _within(directory, HOME):
            return f"ProtectHome={self.protect_home} hides /home, /root and /run/user from specd"
        return None

    def read_only(self, directory: Path) -> str | None:
        """Why the service may not write in ``directory``, or None when it may."""
        hidden = self.hides(directory)
        if hidden is not None:
            return hidden
        writable = [*self.state_dirs, *self.read_write]
        if _within(directory, writable):
            return None
        if self.protect_system == "strict":
            shown = " ".join(map(str, writable)) or "none"
            return (
                f"ProtectSystem=strict makes it read-only to specd (it may write {shown}: "
                "StateDirectory= and ReadWritePaths=)"
            )
        protected = [Path("/usr"), Path("/boot"), Path("/efi")]
        if self.protect_system == "full":
            protected.append(Path("/etc"))
        if self.protect_system in ("yes", "full") and _within(directory, protected):
            return f"ProtectSystem={self.protect_system} makes it read-only to specd"
        return None


# systemd/specd.service's own (a test holds the two together): check-config judges by it
# without reading the template, whose module costs the daemon's start a quarter second.
SHIPPED = Sandbox(
    protect_system="strict",
    state_dirs=(STATE_DIRECTORY,),
    private_tmp=True,
    protect_home="yes",
)


def needs_read_write(directory: Path) -> bool:
    """A directory the shipped specd.service may write only once ReadWritePaths= names it."""
    return not _within(directory, (STATE_DIRECTORY,))


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _described(info: os.stat_result) -> str:
    """``0755 root:root``"""
    mode = stat.S_IMODE(info.st_mode)
    return f"{mode:04o} {_user_name(info.st_uid)}:{_group_name(info.st_gid)}"


def _may(info: os.stat_result, uid: int | None, gids: set[int], bits: int) -> bool:
    """Owner, group and mode allow ``bits`` (rwx as 4/2/1) to uid (None: no such user yet)."""
    if uid == 0:
        return True
    if uid is not None and info.st_uid == uid:
        return info.st_mode >> 6 & bits == bits
    if info.st_gid in gids:
        return info.st_mode >> 3 & bits == bits
    return info.st_mode & bits == bits


def user_cannot_write(layout: Layout, directory: Path, user: str) -> str | None:
    """Why ``user`` cannot create files in the existing ``directory`` (judged by owner, group
    and mode of it and of each directory on the way; ACLs are not read), or None. A user
    that does not exist yet (install creates it) owns nothing and is in no group."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        uid, gids = None, set()
    else:
        uid, gids = entry.pw_uid, set(os.getgrouplist(user, entry.pw_gid))
    for parent in reversed(directory.parents):
        info = layout.host(parent).stat()
        if not _may(info, uid, gids, 1):
            return f"user {user} cannot enter {parent} ({_described(info)})"
    info = layout.host(directory).stat()
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory"
    if _may(info, uid, gids, 3):
        return None
    return f"user {user} cannot write {directory} ({_described(info)})"


def refusal(written: WrittenDir, why: str) -> str:
    """install's one line for a directory it cannot prepare, naming the fix."""
    return (
        f"{written.key} {written.configured}: specd writes {written.what} in "
        f"{written.directory}, but {why}: keep it under {STATE_DIRECTORY} (the default)"
    )
