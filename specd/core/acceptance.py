"""Acceptance: per-draft-token α and the accept length L = (1 − α^(K+1)) / (1 − α)."""

from __future__ import annotations

import functools
import math


def accept_length_from_alpha(alpha: float, steps: int) -> float:
    """Expected tokens per verify step with chain drafting: 1 + α + … + α^K."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be within [0, 1], got {alpha!r}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps!r}")
    if alpha == 1.0:
        return float(steps + 1)
    return (1.0 - alpha ** (steps + 1)) / (1.0 - alpha)


# Pure: the model inverts every observed step count's accept length at every tick, and only
# the live one's changes from tick to tick.
@functools.lru_cache(maxsize=256)
def alpha_from_accept_length(L: float, steps: int) -> float | None:
    """Invert L = (1 − α^(K+1)) / (1 − α); None when L is impossible at K steps."""
    length = L
    if steps < 1 or not math.isfinite(length) or length < 1.0 or length > steps + 1 + 1e-9:
        return None
    if length == 1.0:
        return 0.0
    if length >= steps + 1:
        return 1.0
    if steps == 1:
        return length - 1.0
    if steps == 2:
        return (math.sqrt(4.0 * length - 3.0) - 1.0) / 2.0
    # L(α) rises monotonically from 1 (α=0) to K+1 (α=1): bisect.
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2.0
        if accept_length_from_alpha(mid, steps) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0
