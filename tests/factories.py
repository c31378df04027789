"""Test data shared by the test modules (imported as ``factories``: tests/ is on sys.path)."""

from __future__ import annotations

from typing import Any

from specd.observe import Observation


def make_observation(t: float = 0.0, **fields: Any) -> Observation:
    """An Observation with neutral defaults: one running request at 4 steps (topk 1, draft
    tokens steps + 1), SGLang 0.5.23, one DP rank, nothing else known. Tests set the fields
    they are about; ``spec_fresh`` follows ``running`` and ``draft_tokens`` follows
    ``steps`` unless given."""
    steps = fields.get("steps", 4)
    values: dict[str, Any] = {
        "t": t,
        "running": 1,
        "queued": 0,
        "accept_length": None,
        "steps": steps,
        "draft_tokens": None if steps is None else steps + 1,
        "topk": 1,
        "algorithm": "NEXTN",
        "max_running_requests": None,
        "token_usage": None,
        "gen_throughput": None,
        "generation_tokens_total": None,
        "decode_tokens_total": None,
        "spec_verify_calls_total": None,
        "retracted_total": None,
        "version": "0.5.23",
        "dp_ranks": 1,
        "launch_command": None,
        **fields,
    }
    values.setdefault("spec_fresh", values["running"] > 0)
    return Observation(**values)
