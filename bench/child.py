"""One measurement in a child interpreter that runs a given tree's own code.

A benchmark comparing two trees (base against this one) measures each in a process of its
own, so neither imports the other's modules and each starts as cold as the other;
`export_revision` writes the base tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_json(tree: Path, argv: list[str], what: str, prefix: Sequence[str] = ()) -> Any:
    """``python argv`` in ``tree`` with its code first on the path (run by ``prefix``, a
    tool such as valgrind, when given); the last line it printed, read as JSON.
    RuntimeError naming ``what`` with the end of its stderr when it fails."""
    proc = subprocess.run(
        [*prefix, sys.executable, *argv],
        capture_output=True,
        text=True,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


REPO = Path(__file__).resolve().parents[1]


def export_revision(rev: str, into: Path) -> Path:
    """``rev`` of this repository as a plain tree in ``into`` (git archive, no worktree)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", rev],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {rev}: {archive.stderr.decode(errors='replace')[-300:]}")
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def short_revision(rev: str) -> str:
    """``rev``'s abbreviated commit hash."""
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", rev],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
