"""`specd uninstall`: undo what the manifest says install did, byte for byte, and archive
every file specd itself wrote (state, env file, override) under one dated directory it names,
so that nothing of this installation acts on the next one."""

from __future__ import annotations

import contextlib
import difflib
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from specd.install.execute import move_to_archive
from specd.install.layout import (
    ARCHIVE_ROOT,
    CONFIG_DIR,
    CONFIG_FILE,
    MANIFEST_FILE,
    SPECD_UNIT,
    SPECD_USER,
    START_TIMEOUT_S,
    STATE_DIR,
    SYSTEMCTL_TIMEOUT_S,
    InstallError,
    Layout,
    check_unit_name,
    run_checked,
    stamp,
)
from specd.install.manifest import load_manifest, original_bytes, sha256
from specd.install.render import configured_files, specd_owned
from specd.io.files import write_atomic
from specd.io.runner import Runner


def _archive_copy(layout: Layout, path: Path, archive: Path) -> Path:
    """A copy of an edited file kept in the archive before install's change is undone."""
    to = archive / path.relative_to("/")
    for parent in reversed(to.parents):
        if not layout.host(parent).is_dir():
            layout.host(parent).mkdir(mode=0o700)
    shutil.copy2(layout.host(path), layout.host(to))
    return to


def uninstall(
    layout: Layout, runner: Runner, restart_sglang: bool, out: Any, now_s: float | None = None
) -> int:
    manifest = load_manifest(layout)
    if manifest is None:
        raise InstallError(f"nothing to uninstall: no {MANIFEST_FILE} (specd install never ran)")
    unit = check_unit_name(str(manifest["unit"]))
    when = stamp(time.time() if now_s is None else now_s)
    archive = ARCHIVE_ROOT / f"uninstall-{when}"
    config_raw = layout.read(CONFIG_FILE)
    files, problem = configured_files(
        None if config_raw is None else config_raw.decode("utf-8", "replace")
    )
    if problem is not None:
        print(
            f"note: {CONFIG_FILE}: {problem}; looking for specd's files where specd "
            "keeps them by default",
            file=out,
        )
    if manifest.get("enabled_specd"):
        result = runner(["systemctl", "disable", "--now", SPECD_UNIT], timeout_s=START_TIMEOUT_S)
        print(("ran " if result.ok else "failed: ") + result.summary(), file=out)
        if not result.ok:
            _stop(runner, out)
        # A specd that failed (its start refused) would stay listed as failed once its unit
        # file is gone, and leave the system "degraded"; a no-op otherwise.
        runner(["systemctl", "reset-failed", SPECD_UNIT], timeout_s=SYSTEMCTL_TIMEOUT_S)
    # specd is stopped: nothing writes its files while they move.
    owned = specd_owned(layout, files)
    for path in owned:
        move_to_archive(layout, path, archive / path.relative_to("/"))
    if owned:
        print(f"archived specd's own files in {archive}/:", file=out)
        for path in owned:
            print(f"  {path} → {archive / path.relative_to('/')}", file=out)
    else:
        print("no state, env file or override of specd's to archive", file=out)
    recorded: dict[str, dict[str, Any]] = manifest["files"]
    for name, record in sorted(recorded.items()):
        path = Path(name)
        target = layout.host(path)
        current = layout.read(path)
        if current is not None and sha256(current) != record.get("sha256"):
            if path == CONFIG_FILE:
                backup = path.with_name(f"{path.name}.specd-uninstall-{when}")
                write_atomic(layout.host(backup), current, mode=_mode_of(target))
                print(f"{path} was edited since install: kept it as {backup}", file=out)
            else:
                kept = _archive_copy(layout, path, archive)
                print(f"{path} was edited since install: kept a copy as {kept}", file=out)
        original = original_bytes(record)
        link = record.get("link")
        if link is not None:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            target.symlink_to(str(link))
            print(f"restored {path} (a symlink to {link})", file=out)
        elif original is None:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            print(f"removed {path}", file=out)
        else:
            write_atomic(target, original, mode=int(record.get("mode", 0o644)))
            if "uid" in record:
                os.chown(target, int(record["uid"]), int(record["gid"]))
            print(f"restored {path}", file=out)
    before = manifest.get("state_dir_before")
    state = layout.host(STATE_DIR)
    if isinstance(before, dict) and state.is_dir() and not state.is_symlink():
        os.chown(state, int(before["uid"]), int(before["gid"]))
        os.chmod(state, int(before["mode"]))
        print(
            f"gave {STATE_DIR}/ back its owner and mode from before install "
            f"({before['uid']}:{before['gid']} {int(before['mode']):04o})",
            file=out,
        )
    for name in reversed(manifest["dirs"]):
        path = Path(name)
        if path == CONFIG_DIR:
            continue  # after the manifest, which lives in it
        _remove_dir(layout, path, out)
    if manifest.get("user_created"):
        result = runner(["userdel", SPECD_USER], timeout_s=SYSTEMCTL_TIMEOUT_S)
        print(("ran " if result.ok else "failed: ") + result.summary(), file=out)
    run_checked(runner, ["systemctl", "daemon-reload"])
    print("ran systemctl daemon-reload", file=out)
    layout.host(MANIFEST_FILE).unlink()
    if str(CONFIG_DIR) in manifest["dirs"]:
        _remove_dir(layout, CONFIG_DIR, out)
    cat = runner(["systemctl", "cat", "--no-pager", unit], timeout_s=SYSTEMCTL_TIMEOUT_S)
    if not cat.ok and _unit_gone(runner, unit):
        # Deleted since install: everything of specd's is gone, which is what was asked.
        print(
            f"note: {unit} no longer exists (no unit file): nothing to compare"
            + (" or restart" if restart_sglang else ""),
            file=out,
        )
        return 0
    if not cat.ok:
        raise InstallError(cat.summary())
    cat_now = cat.stdout
    if cat_now == manifest.get("cat_before"):
        print(f"✓ `systemctl cat {unit}` is byte-for-byte what it was before install", file=out)
    else:
        print(f"✗ `systemctl cat {unit}` differs from before install:", file=out)
        before = str(manifest.get("cat_before", "")).splitlines(keepends=True)
        out.writelines(difflib.unified_diff(before, cat_now.splitlines(keepends=True)))
    if restart_sglang:
        run_checked(runner, ["systemctl", "restart", unit], START_TIMEOUT_S)
        print(f"ran systemctl restart {unit}", file=out)
    else:
        print(
            f"{unit} keeps its current process until its next restart "
            f"(`specd uninstall --restart-sglang` or `systemctl restart {unit}`).",
            file=out,
        )
    return 0


RUNNING_STATES = ("active", "activating", "reloading", "deactivating", "refreshing")


def _running(runner: Runner) -> bool:
    shown = runner(["systemctl", "is-active", SPECD_UNIT], timeout_s=SYSTEMCTL_TIMEOUT_S)
    return shown.stdout.strip() in RUNNING_STATES


def _stop(runner: Runner, out: Any) -> None:
    """specd stopped after its disable failed (a read-only /etc/systemd/system: `disable
    --now` then stops nothing), or InstallError before anything else is touched: a running
    specd would go on restarting SGLang with its state moved from under it."""
    if not _running(runner):
        return
    stopped = runner(["systemctl", "stop", SPECD_UNIT], timeout_s=START_TIMEOUT_S)
    print(("ran " if stopped.ok else "failed: ") + stopped.summary(), file=out)
    if _running(runner):
        raise InstallError(
            f"{SPECD_UNIT} still runs: uninstall changed nothing else (it does not move "
            f"specd's files from under it); stop it (`systemctl stop {SPECD_UNIT}`) and run "
            "uninstall again"
        )


def _unit_gone(runner: Runner, unit: str) -> bool:
    shown = runner(
        ["systemctl", "show", "--property=LoadState", "--value", unit],
        timeout_s=SYSTEMCTL_TIMEOUT_S,
    )
    return shown.ok and shown.stdout.strip() == "not-found"


def _mode_of(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return 0o600


def _remove_dir(layout: Layout, path: Path, out: Any) -> None:
    """Remove a directory install created; one that holds something else is kept, and said."""
    target = layout.host(path)
    if not target.is_dir():
        return
    try:
        target.rmdir()
    except OSError:
        left = sorted(child.name for child in target.iterdir())
        print(f"kept {path}/: it holds {', '.join(left)}", file=out)
        return
    print(f"removed {path}/", file=out)
