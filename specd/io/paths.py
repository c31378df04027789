"""Where specd reads its configuration when no ``--config`` names another file.

A module of its own, so that a command's ``--help`` can name it without loading the
configuration's models (pydantic, ~0.15 s of CPU)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_CONFIG_PATH = Path("/etc/specd/specd.toml")
