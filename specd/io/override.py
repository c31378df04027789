"""The on-call override file: /etc/specd/override.toml (read, checked, written).

`specd override` (specd.commands.override) is its command line.

```toml
mode = "pin"                         # "auto" | "pin" | "freeze"
steps = 3                            # pin only, within [min_steps, max_steps]; or instead
# setting = "off"                    # no speculation, or "adaptive:3,4" (SGLang's own
                                     # per-batch switching among those step counts)
expires_at = 2026-05-01T18:00:00Z    # required for pin/freeze; TOML datetime or RFC 3339 text
reason = "batch eval tonight"
apply = "next-window"                # or "now": restart at once, outside any window
```

``read_override`` never raises: a bad file (invalid TOML, unknown key or mode, steps out of
range, missing ``expires_at``, world- or group-writable, owned by someone other than root or
specd) comes back ``valid=False`` with a one-line ``problem``; the daemon then keeps its last
good state. A missing file means no override. A pin or freeze whose ``expires_at`` has
passed is a valid file with nothing in force (`Override.active` is False): specd decides by
itself again, and its expiry stays known (the metrics and `specd override show` say so).
"""

from __future__ import annotations

import os
import pwd
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import tomli_w

from specd.core.override import _UTC, APPLIES, MODES, Override, _as_datetime
from specd.core.setting import UNLISTED_SET, SpecSetting, format_setting, outside_steps
from specd.core.setting import parse as parse_setting
from specd.core.text import duration_text
from specd.io import files, gateway

KEYS = ("mode", "steps", "setting", "expires_at", "reason", "apply")
# An override file is a few lines; anything bigger is not one.
MAX_OVERRIDE_BYTES = 64 * files.KIB
# Readable by specd whatever the umask of the operator who wrote it; writable by root only.
OVERRIDE_FILE_MODE = 0o644
# The service user specd runs as; `show` judges ownership as the daemon will.
DAEMON_USER = "specd"


@dataclass(frozen=True)
class OverrideStatus:
    override: Override | None
    valid: bool
    problem: str | None
    present: bool
    # (mtime_ns, size, inode); (0, 0, 0) when absent. Changes when the file is replaced.
    fingerprint: tuple[int, int, int]
    # Unix time the override was decided (`decided_at`); None when not read.
    written_at: float | None = None


ABSENT = (0, 0, 0)


def _fingerprint(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _link_fingerprint(path: Path) -> tuple[int, int, int]:
    # A file that could not even be opened (a symlink, no permission): its directory entry
    # still changes when it is replaced, so the daemon reports each new problem once.
    try:
        return _fingerprint(os.lstat(path))
    except OSError:
        return ABSENT


def _invalid(problem: str, fingerprint: tuple[int, int, int]) -> OverrideStatus:
    return OverrideStatus(None, False, problem, True, fingerprint)


def _permission_problem(
    st: os.stat_result, path: Path, allowed_uids: tuple[int, ...]
) -> str | None:
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if mode & stat.S_IWOTH:
        return f"{path} is world-writable (mode {mode:04o}); run: chmod o-w {path}"
    # A group-writable file is writable by that group's members, unless it is root's group.
    # Not specd's own: on-call users join group specd to read its state, and a pin they
    # could write would restart SGLang at once; and `specd override show`, run as root,
    # would judge the file otherwise than the daemon.
    if mode & stat.S_IWGRP and st.st_gid != 0:
        return (
            f"{path} is group-writable by gid {st.st_gid} (mode {mode:04o}); run: chmod g-w {path}"
        )
    if st.st_uid not in allowed_uids:
        owners = " or ".join(sorted({_user_name(uid) for uid in allowed_uids}))
        return f"{path} is owned by {_user_name(st.st_uid)}, not by {owners}"
    parent = path.parent.stat()
    if parent.st_mode & stat.S_IWOTH and not parent.st_mode & stat.S_ISVTX:
        return (
            f"{path.parent} is world-writable without the sticky bit: anyone can replace the file"
        )
    return None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def expired(override: Override | None, now: datetime | float) -> str | None:
    """How long ago a pin or freeze expired ("2.0 h"), or None while it holds (or for auto)."""
    if override is None or override.mode == "auto" or override.expires_at is None:
        return None
    current = _as_datetime(now)
    if override.expires_at > current:
        return None
    return duration_text((current - override.expires_at).total_seconds())


def _parse_expires(value: Any) -> datetime:
    if isinstance(value, str):
        text = value.strip().replace("z", "Z")
        try:
            parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(
                f"expires_at: {value!r} is not an RFC 3339 time such as 2026-05-01T18:00:00Z"
            ) from None
        value = parsed
    if not isinstance(value, datetime):
        raise ValueError(
            f"expires_at: expected a date-time with offset such as 2026-05-01T18:00:00Z, "
            f"got {type(value).__name__} {value!r}"
        )
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"expires_at: {value.isoformat()} has no UTC offset; add Z or +HH:MM")
    try:
        return value.astimezone(_UTC)
    except OverflowError:
        # 9999-12-31T23:00:00-05:00 ("forever") is in year 10000 in UTC: no datetime.
        raise ValueError(
            f"expires_at: {value.isoformat()} is outside years 1-9999 in UTC; "
            "for a very long override write e.g. 9999-01-01T00:00:00Z"
        ) from None


def parse_override(
    data: dict[str, Any],
    cfg_min_steps: int,
    cfg_max_steps: int,
    now: datetime | float,
    *,
    listed: Sequence[str] = (),
) -> Override:
    """Validate the file's table. Raises ValueError with a one-line reason. ``listed``:
    the config's adaptive_candidate_sets, which may be pinned past the step range."""
    unknown = [key for key in data if key not in KEYS]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (allowed: {', '.join(KEYS)})")
    if "mode" not in data:
        raise ValueError("mode: missing; one of auto, pin, freeze")
    mode = data["mode"]
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of auto, pin, freeze")
    apply = data.get("apply", "next-window")
    if apply not in APPLIES:
        raise ValueError(f"apply: {apply!r} is not one of next-window, now")
    reason = data.get("reason", "")
    if not isinstance(reason, str):
        raise ValueError(f"reason: expected a string, got {type(reason).__name__}")
    steps = data.get("steps")
    pinned = _pinned_setting(data.get("setting"), mode, cfg_min_steps, cfg_max_steps, listed)
    if pinned is not None and steps is not None:
        raise ValueError("steps and setting: give one of them, not both")
    if pinned is not None and pinned.kind == "static":
        steps, pinned = pinned.steps, None
    elif mode == "pin" and pinned is None:
        if steps is None:
            raise ValueError(
                'steps: required with mode = "pin" (or setting = "off" / "adaptive:…")'
            )
        if not isinstance(steps, int) or isinstance(steps, bool):
            raise ValueError(f"steps: expected an integer, got {type(steps).__name__} {steps!r}")
    if steps is not None:
        if mode != "pin":
            raise ValueError(f'steps: only allowed with mode = "pin" (mode is {mode!r})')
        if not cfg_min_steps <= steps <= cfg_max_steps:
            raise ValueError(
                f"steps: {steps} is outside the configured range {cfg_min_steps}..{cfg_max_steps}"
            )
    expires_at = None
    if "expires_at" in data:
        expires_at = _parse_expires(data["expires_at"])
    if mode != "auto" and expires_at is None:
        raise ValueError(f"expires_at: required with mode = {mode!r}")
    # A passed expires_at is no error: the file is what the on-call wrote, no longer in
    # force (`Override.active`); `expired` says so.
    return Override(
        mode=mode, steps=steps, expires_at=expires_at, reason=reason, apply=apply, setting=pinned
    )


def _pinned_setting(
    value: Any, mode: Any, low: int, high: int, listed: Sequence[str]
) -> SpecSetting | None:
    """The ``setting`` key: any speculative setting in its operator form."""
    if value is None:
        return None
    if mode != "pin":
        raise ValueError(f'setting: only allowed with mode = "pin" (mode is {mode!r})')
    if not isinstance(value, str):
        raise ValueError(
            f'setting: expected a string such as "off", "4" or "adaptive:3,4", '
            f"got {type(value).__name__}"
        )
    try:
        pinned = parse_setting(value)
    except ValueError as exc:
        raise ValueError(f"setting: {exc}") from None
    outside = outside_steps(pinned, low, high, listed) if pinned.kind == "adaptive" else ()
    if outside:
        raise ValueError(
            f"setting: adaptive candidates {', '.join(map(str, outside))} are outside the "
            f"configured range {low}..{high}, and {UNLISTED_SET}"
        )
    return pinned


def unreadable_by(path: Path, user: str) -> str | None:
    """Why ``user`` (the daemon's) cannot read the override file at ``path``, judged by the
    owner, group and mode of the file and of every directory on the way (ACLs are not
    read): root reads a 0600 root file the daemon cannot, and ignores. None when it can,
    when ``user`` is root or ourselves, or when there is no such user."""
    try:
        entry = pwd.getpwnam(user)
        if entry.pw_uid in (0, os.geteuid()):
            return None
        found = gateway.key_file_unreadable_by(path, user)
    except (KeyError, OSError):
        return None
    if found is None:
        return None
    why = found[0]
    if why.startswith("cannot enter "):
        return f"user {user} {why}, so specd cannot read {path}"
    return f"user {user} {why.replace('it', str(path), 1)}, so specd ignores it; {found[1]}"


def read_override(
    path: str | Path,
    cfg_min_steps: int,
    cfg_max_steps: int,
    now: datetime | float,
    *,
    allowed_uids: tuple[int, ...] | None = None,
    as_daemon: bool = False,
    listed: Sequence[str] = (),
) -> OverrideStatus:
    """Read and judge the override file. Never raises. ``as_daemon`` (the commands, run as
    root or an operator): judged as the daemon, running as `DAEMON_USER`, finds it: owned
    by root or that user (`daemon_uids`), and readable by that user. ``listed``: the
    config's adaptive_candidate_sets (`parse_override`)."""
    path = Path(path)
    if as_daemon and allowed_uids is None:
        allowed_uids = daemon_uids()
    uids = allowed_uids if allowed_uids is not None else (0, os.getuid())
    reader = DAEMON_USER if as_daemon else None
    try:
        # Not through a symlink: the ownership and directory checks below must judge the
        # file that is read, and `specd override` replaces the file, never a link target.
        raw, st = files.read_regular_file_and_stat(path, MAX_OVERRIDE_BYTES)
    except files.MissingFileError:
        return OverrideStatus(None, True, None, False, ABSENT)
    except files.FileReadError as exc:
        return _invalid(str(exc), _fingerprint(exc.st) if exc.st else _link_fingerprint(path))
    fingerprint = _fingerprint(st)
    try:
        problem = _permission_problem(st, path, uids)
    except OSError as exc:
        problem = f"cannot check {path.parent}: {exc.strerror or exc}"
    if problem is None and reader is not None:
        problem = unreadable_by(path, reader)
    if problem is not None:
        return _invalid(problem, fingerprint)
    if raw.startswith(files.UTF8_BOM):
        return _invalid(f"{path}: {files.BOM_PROBLEM}", fingerprint)
    try:
        data = files.parse_toml(raw.decode("utf-8"))
        override = parse_override(data, cfg_min_steps, cfg_max_steps, now, listed=listed)
    except UnicodeDecodeError as exc:
        return _invalid(f"{path}: not UTF-8 text (byte {exc.start})", fingerprint)
    except ValueError as exc:  # files.ParseError included: bad, too deep or absurd TOML
        return _invalid(f"{path}: {exc}", fingerprint)
    # Never after now: an mtime in the future (`cp -p` from a host whose clock runs ahead)
    # would leave a `pin --now` no restart of its own to count, and no bound on its loop.
    at = now.timestamp() if isinstance(now, datetime) else now
    decided = min(decided_at(raw, st.st_mtime), at)
    return OverrideStatus(
        replace(override, decided_at=decided), True, None, True, fingerprint, decided
    )


# --- durations and writing --------------------------------------------------------------


def render_override(override: Override, header: str = "") -> str:
    table: dict[str, Any] = {"mode": override.mode}
    if override.steps is not None:
        table["steps"] = override.steps
    if override.setting is not None:
        table["setting"] = format_setting(override.setting)
    if override.expires_at is not None:
        table["expires_at"] = override.expires_at.astimezone(_UTC).replace(microsecond=0)
    table["reason"] = override.reason
    table["apply"] = override.apply
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + tomli_w.dumps(table)


def check_override_text(
    text: str,
    cfg_min_steps: int,
    cfg_max_steps: int,
    now: datetime | float,
    *,
    listed: Sequence[str] = (),
) -> str | None:
    """The problem `read_override` would find in a file of ``text`` (its size and content;
    not its owner or mode, which writing sets), or None."""
    size = len(text.encode("utf-8"))
    if size > MAX_OVERRIDE_BYTES:
        return (
            f"the override would be {size // files.KIB} KiB, larger than the "
            f"{MAX_OVERRIDE_BYTES // files.KIB} KiB allowed (a shorter --reason)"
        )
    try:
        parse_override(files.parse_toml(text), cfg_min_steps, cfg_max_steps, now, listed=listed)
    except ValueError as exc:
        return str(exc)
    return None


# The first line `specd override` writes: who wrote the file, and when.
_WRITTEN_BY = re.compile(r"# written by `specd override \w+` as (.{1,80}) at (\S{1,40})\s*")


def decided_at(raw: bytes, mtime: float) -> float:
    """Unix time the override in ``raw`` was decided: the time in the header `specd override`
    wrote (a hand edit that keeps the header is the same decision), else the file's mtime (a
    hand-written file: every edit is a new one). Never later than the mtime: a header that
    claims a future time is not believed."""
    found = _WRITTEN_BY.fullmatch(raw.split(b"\n", 1)[0].decode("utf-8", "replace"))
    if found is not None:
        try:
            at = datetime.fromisoformat(found[2])
        except ValueError:
            return mtime
        if at.tzinfo is not None and at.utcoffset() is not None:
            return min(at.timestamp(), mtime)
    return mtime


def written_by(path: str | Path) -> str | None:
    """``alice (sudo) at 2026-12-06T10:05:51+00:00`` from the header `specd override` wrote
    in ``path``; None for a file without one (written by hand) or that cannot be read."""
    try:
        raw = files.read_regular_file(path, MAX_OVERRIDE_BYTES)
    except (files.FileReadError, OSError):
        return None
    first = raw.split(b"\n", 1)[0].decode("utf-8", "replace")
    found = _WRITTEN_BY.fullmatch(first)
    return None if found is None else f"{found[1]} at {found[2]}"


def write_override(path: str | Path, text: str) -> None:
    """Replace ``path`` atomically, never through a symlink, mode 0644 (specd reads it)."""
    files.write_text_atomic(path, text, mode=OVERRIDE_FILE_MODE)


def daemon_uids() -> tuple[int, ...]:
    """The owners specd accepts: root and the specd user (or, without one, ourselves)."""
    try:
        return (0, pwd.getpwnam(DAEMON_USER).pw_uid)
    except KeyError:
        return (0, os.getuid())
