"""What one scrape of SGLang tells specd: an Observation, or a ScrapeError saying why not."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

ErrorKind = Literal["timeout", "refused", "http_status", "malformed", "missing", "api_key"]

# Bounds of what SGLang can report. Far past any real server, so a value outside them is a
# bug or a hostile page, never traffic: it is rejected field by field (the field becomes
# unknown) and never reaches the history specd learns from.
MAX_STEPS = 64  # SGLang's CUDA graphs for draft steps make even 16 impractical
MAX_DRAFT_TOKENS = 4096  # topk x steps + 1 for the widest trees anyone runs
MAX_TOPK = 256
MAX_RUNNING_REQUESTS = 1_000_000  # requests one server keeps in its batch at once
MAX_TOKENS_PER_S = 10_000_000.0  # one server's generation rate; real ones do < 1e5
# A cumulative token counter past 2**53 no longer counts single tokens in a float: no
# real server gets there (100k tok/s for 2,800 years).
MAX_COUNTER = float(2**53)
# Accept length is a mean of whole numbers of tokens, computed in floats.
_ACCEPT_SLACK = 1e-6
# The cumulative counters among CHECKED_FIELDS: one bound each, checked last.
_COUNTER_FIELDS = (
    "generation_tokens_total",
    "decode_tokens_total",
    "spec_verify_calls_total",
    "retracted_total",
)
# Fields whose values `impossible_fields` checks; also the metric's label values.
CHECKED_FIELDS = (
    "running",
    "queued",
    "steps",
    "draft_tokens",
    "topk",
    "max_running_requests",
    "accept_length",
    "token_usage",
    "gen_throughput",
    *_COUNTER_FIELDS,
)


@dataclass(frozen=True)
class Observation:
    t: float
    running: int
    queued: int
    accept_length: float | None
    spec_fresh: bool
    steps: int | None
    draft_tokens: int | None
    topk: int | None
    algorithm: str | None
    max_running_requests: int | None
    token_usage: float | None
    gen_throughput: float | None
    generation_tokens_total: float | None
    decode_tokens_total: float | None
    spec_verify_calls_total: float | None
    retracted_total: float | None
    version: str | None
    dp_ranks: int
    launch_command: str | None
    # Fields SGLang reported values for that it cannot produce; each is None above.
    rejected: tuple[str, ...] = ()
    # What each rejected field held, in the same order (for the log line).
    rejected_values: tuple[str, ...] = ()
    # SGLang's own per-batch switching is on (/server_info `speculative_adaptive`): `steps`
    # is then the tier live at this moment, not a setting.
    adaptive: bool = False
    # The --speculative-adaptive-config file it runs (/server_info), when it names one.
    adaptive_config: str | None = None

    @property
    def offered(self) -> int:
        return self.running + self.queued

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "offered": self.offered}


@dataclass(frozen=True)
class ScrapeError:
    kind: ErrorKind
    reason: str
    t: float


def _whole_in(value: int | None, low: int, high: int) -> bool:
    return value is None or low <= value <= high


def _number_in(value: float | None, high: float) -> bool:
    return value is None or (math.isfinite(value) and 0.0 <= value <= high)


def accept_length_possible(length: float, steps: int | None, *, adaptive: bool = False) -> bool:
    """Whether SGLang can report a mean accept length ``length`` while running ``steps``.

    Every verify accepts the bonus token plus at most one token per draft step, so
    1 <= length <= steps + 1. An adaptive server's window spans its tiers: there only
    the deepest possible bound holds.
    """
    if not math.isfinite(length) or length < 1.0 - _ACCEPT_SLACK:
        return False
    deepest = MAX_STEPS if adaptive or steps is None else steps
    return length <= deepest + 1 + _ACCEPT_SLACK


def impossible_fields(obs: Observation, *, adaptive: bool = False) -> tuple[str, ...]:
    """The fields of ``obs`` holding values SGLang cannot produce, in CHECKED_FIELDS order."""
    # One test after the other, in CHECKED_FIELDS order: every scrape and every tick of a
    # replay (twice: `History.record` asks, then `without_impossible`) runs this.
    bad: list[str] = []
    if not _whole_in(obs.running, 0, MAX_RUNNING_REQUESTS):
        bad.append("running")
    if not _whole_in(obs.queued, 0, 100 * MAX_RUNNING_REQUESTS):
        bad.append("queued")
    steps_known = _whole_in(obs.steps, 0, MAX_STEPS)
    if not steps_known:
        bad.append("steps")
    if not _whole_in(obs.draft_tokens, 0, MAX_DRAFT_TOKENS):
        bad.append("draft_tokens")
    if not _whole_in(obs.topk, 1, MAX_TOPK):
        bad.append("topk")
    if not _whole_in(obs.max_running_requests, 1, MAX_RUNNING_REQUESTS):
        bad.append("max_running_requests")
    if obs.accept_length is not None and not accept_length_possible(
        obs.accept_length, obs.steps if steps_known else None, adaptive=adaptive or obs.adaptive
    ):
        bad.append("accept_length")
    # Used / size of the KV pool; specd only shows it: only what no share can be.
    if not _number_in(obs.token_usage, math.inf):
        bad.append("token_usage")
    if not _number_in(obs.gen_throughput, MAX_TOKENS_PER_S):
        bad.append("gen_throughput")
    for name in _COUNTER_FIELDS:
        if not _number_in(getattr(obs, name), MAX_COUNTER):
            bad.append(name)
    return tuple(bad)


def without_impossible(
    obs: Observation, *, adaptive: bool = False, impossible: tuple[str, ...] | None = None
) -> Observation:
    """``obs`` with every impossible field unknown (None) and named in ``rejected``.

    ``running`` and ``queued`` cannot be unknown: an observation with an impossible one
    is not an observation at all; callers check for them first. ``impossible``: what
    `impossible_fields` (with the same ``adaptive``) found, when the caller asked already.
    """
    if impossible is None:
        impossible = impossible_fields(obs, adaptive=adaptive)
    bad = [name for name in impossible if name not in ("running", "queued")]
    if not bad:
        return obs
    fresh = [name for name in bad if name not in obs.rejected]
    unknown: dict[str, Any] = dict.fromkeys(bad)
    return replace(
        obs,
        rejected=(*obs.rejected, *fresh),
        rejected_values=(*obs.rejected_values, *(f"{getattr(obs, n)!r:.40}" for n in fresh)),
        **unknown,
    )
