"""Helpers for the tests of the twin's kinds of setting (off, static, adaptive)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specd.twin import cli as twin_cli

SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "1"]


def fast_table(
    accepts: Mapping[int, float],
    capacity: int | Mapping[int, int] = 64,
    per_token_s: float = 0.002,
) -> str:
    """A table whose rows run fast: one verify per ``per_token_s`` per request at any
    batch, so step counts differ only in tokens per verify (``accepts``) and capacity."""
    rows = ["steps,concurrency,output_tok_s,accept_length,max_running_requests"]
    for steps, accept in sorted(accepts.items()):
        cap = capacity if isinstance(capacity, int) else capacity[steps]
        for c in (1, 8, 16, 32, 64):
            rows.append(f"{steps},{c},{c * accept / per_token_s:g},{accept:g},{cap}")
    return "\n".join(rows) + "\n"


def parse_twin_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    twin_cli.configure(parser)
    return parser.parse_args(argv)


def write_config(tmp_path: Path, body: Any, name: str = "adaptive.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return str(path)
