"""The install manifest: every file install wrote (with what was there before), every directory
it created, the user and the service it added, and ``systemctl cat`` of the unit before. Written
before each change, so uninstall can undo exactly what happened, byte for byte."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from specd.install.layout import MANIFEST_FILE, InstallError, Layout
from specd.io.files import write_atomic

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
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(manifest, indent=2) + "\n").encode(), mode=0o600)
