"""The install manifest: every file install wrote (with what was there before), every directory
it created, the user and the service it added, and ``systemctl cat`` of the unit before. Written
before each change, so uninstall can undo exactly what happened, byte for byte."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import TYPE_CHECKING, Any

from specd.install.layout import MANIFEST_FILE, InstallError, Layout
from specd.io.files import write_atomic

if TYPE_CHECKING:
    from specd.install.plan import FileChange

MANIFEST_VERSION = 1


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def new_manifest(unit: str, cat_before: str) -> dict[str, Any]:
    return {
        "version": MANIFEST_VERSION,
        "unit": unit,
        "cat_before": cat_before,
        "files": {},
        "dirs": [],
        "user_created": False,
        "enabled_specd": False,
    }


def load_manifest(layout: Layout) -> dict[str, Any] | None:
    raw = layout.read(MANIFEST_FILE)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise InstallError(f"{MANIFEST_FILE}: not JSON ({exc}); remove by hand") from None
    if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
        raise InstallError(f"{MANIFEST_FILE}: not a specd install manifest (version 1)")
    return data


def save_manifest(layout: Layout, manifest: dict[str, Any]) -> None:
    path = layout.host(MANIFEST_FILE)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (json.dumps(manifest, indent=2) + "\n").encode(), mode=0o600)
    except OSError as exc:
        # The manifest's path, not the temporary file beside it that the error names.
        raise InstallError(f"cannot write {MANIFEST_FILE}: {exc.strerror or exc}") from None


def original_record(change: FileChange) -> dict[str, Any]:
    """What was at ``change.path`` before install, for uninstall to put back exactly: the
    bytes (UTF-8 text as it is, anything else in base64), mode, owner, or the symlink."""
    record: dict[str, Any] = {"original": None}
    if change.link is not None:
        record["link"] = change.link
    if change.old is None:
        return record
    try:
        record["original"] = change.old.decode("utf-8")
    except UnicodeDecodeError:
        record["original_base64"] = base64.b64encode(change.old).decode("ascii")
    record["mode"] = change.mode
    if change.owner is not None:
        record["uid"], record["gid"] = change.owner
    return record


def original_bytes(record: dict[str, Any]) -> bytes | None:
    """The bytes `original_record` kept (None: there was no file). A manifest of an older
    specd has the text only, and no mode: 0644 is what it wrote."""
    if "original_base64" in record:
        try:
            return base64.b64decode(str(record["original_base64"]), validate=True)
        except (binascii.Error, ValueError):
            raise InstallError(f"{MANIFEST_FILE}: original_base64 is not base64") from None
    original = record.get("original")
    return None if original is None else str(original).encode()
