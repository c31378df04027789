"""Carrying out an install plan, recording each change in the manifest before making it."""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import stat
from pathlib import Path
from typing import Any

from specd.install.layout import (
    CONFIG_DIR,
    START_TIMEOUT_S,
    STATE_DIR,
    InstallError,
    Layout,
    run_checked,
)
from specd.install.manifest import (
    load_manifest,
    new_manifest,
    original_record,
    save_manifest,
    sha256,
)
from specd.install.plan import Plan
from specd.install.unit import UnitView
from specd.io.files import write_atomic
from specd.io.runner import Runner


def _archive_dirs(layout: Layout, to: Path) -> None:
    """The directories above ``to``; the archive is root's alone."""
    for parent in reversed(to.parents):
        here = layout.host(parent)
        if not here.is_dir():
            here.mkdir(mode=0o700)


def move_to_archive(layout: Layout, path: Path, to: Path) -> None:
    """Move ``path`` to ``to`` (another file system is fine)."""
    _archive_dirs(layout, to)
    shutil.move(str(layout.host(path)), str(layout.host(to)))


def copy_to_archive(layout: Layout, data: bytes, to: Path) -> None:
    """Keep ``data`` (a file as it was before install replaced it) at ``to``."""
    _archive_dirs(layout, to)
    write_atomic(layout.host(to), data, mode=0o600)


def execute(plan: Plan, layout: Layout, runner: Runner, view: UnitView, out: Any) -> None:
    """Carry the plan out, recording every change in the manifest before making it. A step
    that fails stops it with the path or command that failed, what was done before it, and
    what to run (the manifest has every change made so far)."""
    done: list[str] = []
    try:
        _carry_out(plan, layout, runner, view, out, done)
    except InstallError as exc:
        raise InstallError(f"{exc}\n{_after_failure(done)}") from None
    except OSError as exc:
        # A path under the layout's root is the system's path in production.
        where = f": {exc.filename}" if exc.filename else ""
        raise InstallError(f"{exc.strerror or exc}{where}\n{_after_failure(done)}") from None


def _after_failure(done: list[str]) -> str:
    if not done:
        return "install changed nothing yet; run `specd install` again once that is fixed"
    return (
        f"install stopped after: {'; '.join(done)}\n"
        "run `specd install` again once that is fixed (it goes on from there), or "
        "`specd uninstall` to take back what it did"
    )


def _carry_out(
    plan: Plan, layout: Layout, runner: Runner, view: UnitView, out: Any, done: list[str]
) -> None:
    def did(what: str) -> None:
        done.append(what)
        print(what, file=out)

    manifest = load_manifest(layout)
    if manifest is None:
        manifest = new_manifest(plan.unit, view.cat)
        state = layout.host(STATE_DIR)
        if state.is_dir() and not state.is_symlink():
            # specd.service's StateDirectory= makes it specd's, 0751: uninstall gives it back.
            info = state.stat()
            manifest["state_dir_before"] = {
                "mode": stat.S_IMODE(info.st_mode),
                "uid": info.st_uid,
                "gid": info.st_gid,
            }
    if manifest["unit"] != plan.unit:
        raise InstallError(
            f"specd is installed for {manifest['unit']}; run `specd uninstall` before "
            f"installing it for {plan.unit}"
        )
    for move in plan.moves:
        move_to_archive(layout, move.path, move.to)
        did(f"moved {move.path} to {move.to} ({move.why})")
    config_dir = layout.host(CONFIG_DIR)
    if not config_dir.is_dir():
        config_dir.mkdir(mode=0o755, parents=True)
        manifest["dirs"].append(str(CONFIG_DIR))
        done.append(f"created {CONFIG_DIR}/")
    for change in plan.files:
        target = layout.host(change.path)
        name = str(change.path)
        if change.backup is not None and change.old is not None:
            try:
                copy_to_archive(layout, change.old, change.backup)
            except OSError as exc:
                raise InstallError(
                    f"cannot keep {change.path} as {change.backup}: {exc.strerror or exc}"
                ) from None
            did(f"kept {change.path} (not written by specd install) as {change.backup}")
        first = name not in manifest["files"]
        record = manifest["files"].setdefault(name, original_record(change))
        record["sha256"] = sha256(change.new)
        try:
            if not target.parent.is_dir():
                target.parent.mkdir(parents=True, mode=0o755)
                manifest["dirs"].append(str(change.path.parent))
            save_manifest(layout, manifest)
            write_atomic(target, change.new, mode=change.mode)
            if change.owner is not None:
                os.chown(target, *change.owner)
        except OSError as exc:
            # The file's own path, not the temporary one beside it the error names.
            if first and layout.read(change.path) == change.old:
                del manifest["files"][name]
                save_manifest(layout, manifest)
            raise InstallError(f"cannot write {change.path}: {exc.strerror or exc}") from None
        did(f"wrote {change.path}")
    if plan.create_user:
        manifest["user_created"] = True
        save_manifest(layout, manifest)
    users = [c for c in plan.commands if c[0] == "systemd-sysusers"]
    for argv in users:
        run_checked(runner, argv)
        did("ran " + shlex.join(argv))
    for directory in plan.dirs:
        target = layout.host(directory.path)
        manifest["dirs"].append(str(directory.path))
        save_manifest(layout, manifest)
        target.mkdir(mode=directory.mode, parents=True, exist_ok=True)
        owner = pwd.getpwnam(directory.owner)
        os.chown(target, owner.pw_uid, owner.pw_gid)
        did(f"created {directory.path}")
    for argv in plan.commands:
        if argv in users:
            continue
        if argv[:2] == ("systemctl", "enable"):
            manifest["enabled_specd"] = True
            save_manifest(layout, manifest)
        run_checked(runner, argv, START_TIMEOUT_S)
        did("ran " + shlex.join(argv))
    save_manifest(layout, manifest)
