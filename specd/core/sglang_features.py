"""What each SGLang version lets specd see: one table, read from each version's own source.

Pure. ``specd doctor`` names what the running SGLang lacks from it; the reader and the
applier already degrade where a feature is absent, this says so to the operator. The twin
keeps its own profiles (specd/twin/versions.py: it shares nothing with the core) and
tests/core/test_sglang_features.py holds the two to the same versions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Version = tuple[int, int, int]

_VERSION = re.compile(r"^v?([0-9]+)\.([0-9]+)(?:\.([0-9]+))?")
# Longer parts are no version: int() of thousands of digits raises, and the string is
# SGLang's to send (`/server_info`), not ours to trust.
_VERSION_PART_DIGITS = 9


@dataclass(frozen=True)
class Feature:
    """Something SGLang gained at ``since``. Before it: ``what`` (as seen from outside),
    so ``without`` (what that means for specd)."""

    name: str
    since: Version
    what: str
    without: str
    # The /metrics family that shows the feature on the page itself, when one does.
    metric: str | None = None


SERVER_INFO = Feature(
    "server_info",
    (0, 5, 6),
    "no /server_info",
    "specd reads its old name /get_server_info",
)
EFFECTIVE_CAPACITY = Feature(
    "effective_capacity",
    # scheduler.get_internal_state() sets effective_max_running_requests_per_dp from 0.5.8.
    (0, 5, 8),
    "no effective capacity (internal_states[].effective_max_running_requests_per_dp)",
    "specd takes the max_running_requests argument, not what memory left",
)
ACCEPT_RATE_OF_DRAFTS = Feature(
    "accept_rate_of_drafts",
    (0, 5, 11),
    "sglang:spec_accept_rate is accept length / draft tokens, not accepted / proposed drafts",
    "specd reads sglang:spec_accept_length, never that gauge",
)
SPEC_STEPS_GAUGE = Feature(
    "spec_num_steps",
    (0, 5, 13),
    "no sglang:spec_num_steps gauge",
    "the live setting comes from /server_info, read once per SGLang start",
    metric="sglang:spec_num_steps",
)
VERIFY_CALLS = Feature(
    "spec_verify_calls_total",
    (0, 5, 13),
    "no sglang:spec_verify_calls_total",
    "the accept length comes from the gauge only, not windowed from counters",
    metric="sglang:spec_verify_calls_total",
)
ADAPTIVE_SLOTS = Feature(
    "adaptive_slots",
    (0, 5, 13),
    "no per-batch-size slots in --speculative-adaptive-config",
    "an adaptive setting has one candidate list for every batch size",
)
ADAPTIVE_SLOT_ZERO = Feature(
    "adaptive_slot_zero",
    (0, 5, 14),
    "no step 0 (no drafting) in an adaptive slot",
    "adaptive settings with a 0 tier are not offered",
)
STARTUP_PHASES = Feature(
    "startup_phases",
    (0, 5, 18),
    "no sglang:startup_time_seconds{phase}",
    "a slow restart cannot be split into its phases",
    metric="sglang:startup_time_seconds",
)
READY = Feature(
    "ready",
    (0, 5, 20),
    "no /ready",
    "readiness only through /health_generate (a real generation)",
)

FEATURES: tuple[Feature, ...] = (
    SERVER_INFO,
    EFFECTIVE_CAPACITY,
    ACCEPT_RATE_OF_DRAFTS,
    SPEC_STEPS_GAUGE,
    VERIFY_CALLS,
    ADAPTIVE_SLOTS,
    ADAPTIVE_SLOT_ZERO,
    STARTUP_PHASES,
    READY,
)


# The oldest and newest SGLang whose source this table was read from (the twin models the
# same versions): outside them, what a version has is a guess, and doctor says so.
OLDEST_KNOWN: Version = (0, 5, 4)
NEWEST_KNOWN: Version = (0, 5, 23)


def parse_version(text: object) -> Version | None:
    """ "0.5.13", "v0.5.4", "0.5.23rc1", "0.5" → a comparable tuple; None if not a version."""
    if not isinstance(text, str):
        return None
    match = _VERSION.match(text.strip())
    if match is None or any(len(part or "") > _VERSION_PART_DIGITS for part in match.groups()):
        return None
    return (int(match[1]), int(match[2]), int(match[3] or 0))


def version_text(version: Version) -> str:
    return ".".join(str(v) for v in version)


def has(version: Version, feature: Feature) -> bool:
    return version >= feature.since


def lacking(version: Version) -> tuple[Feature, ...]:
    """The features this version does not have yet, oldest first."""
    return tuple(f for f in FEATURES if not has(version, f))
