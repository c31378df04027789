"""The bound behind ``python -m bench coldstart``: what any policy choosing among the settings
it is offered can still reach of issue 12's token figures after betting the first epoch on
one.

`upper_bound` counts, with the replay's own `specd.tools.replay.Tokens`, an upper bound on
the tokens of any such policy that ran setting S1 from the first window's close to the next
opening: the start K before the first window (as everyone), every window's open stretch at
the best setting second by second (a policy may restart inside a window; no restart is
charged anywhere), S1 for the rest of the first epoch, the best fixed setting in hindsight
for the rest of every later epoch. The settings are the static step counts and, where the
policy is offered them, off and the adaptive sets: a policy that may run a set can hedge
the first epoch with it. Its denominators are the replay's exactly (static step counts and
the oracle's, whatever the policy may choose). `bench.bench_replay` reads it for the
setting specd ran (`first_epoch_setting`); `bench.bench_coldstart` for every S1.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specd.core.choices import offer, table_steps
from specd.core.perftable import PerfTable
from specd.core.setting import SpecSetting, format_setting, static
from specd.io.calibration import read_calibration
from specd.io.config import Config
from specd.tools.replay import (
    DEFAULT_START,
    DEFAULT_START_STEPS,
    REPLAY_TRAITS,
    Key,
    Tokens,
    Trace,
    open_intervals,
    truth_offer,
)
from specd.tools.replay import start_steps as replay_start_steps


@dataclass(frozen=True)
class Bounds:
    """One truth and trace: the replay's denominators and each first-epoch setting's bound."""

    static_tokens: dict[int, float]  # each K from the first window on, as the replay counts it
    oracle_tokens: float
    # S1 (operator form: "4", "off", "adaptive:2,4") → the most any policy running it can
    # serve; static step counts first, in order, then off and the sets as offered.
    upper: dict[str, float]
    seen_min: int  # offered concurrency seen before the first window
    seen_max: int
    seen_mean: float
    # The first window's close and the next opening (trace seconds): S1's stretch.
    first_close_s: float = 0.0
    first_end_s: float = 0.0

    @property
    def best_static_tokens(self) -> float:
        return max(self.static_tokens.values())

    def to_best_static(self, name: str) -> float:
        return self.upper[name] / self.best_static_tokens

    def to_oracle(self, name: str) -> float:
        return self.upper[name] / self.oracle_tokens

    def reaching(self, best_static_min: float, oracle_min: float) -> list[str]:
        """The first-epoch settings with which both figures stay within reach."""
        return [
            name
            for name in self.upper
            if self.to_best_static(name) >= best_static_min and self.to_oracle(name) >= oracle_min
        ]


def _best_each_second(tokens: Tokens, keys: Sequence[Key], a: float, b: float) -> float:
    """Tokens of the best of ``keys`` in every run of the trace between ``a`` and ``b``."""
    t = tokens.trace.t
    if b <= a:
        return 0.0
    total = 0.0
    i = max(bisect.bisect_right(t, a) - 1, 0)
    while i < len(t) - 1 and t[i] < b:
        span = min(t[i + 1], b) - max(t[i], a)
        if span > 0:
            total += span * max(tokens.run_rate(k, i) for k in keys)
        i += 1
    return total


def upper_bound(
    trace: Trace,
    truth: PerfTable,
    opens: Sequence[tuple[float, float]],
    steps: Sequence[int],
    start_steps: int = DEFAULT_START_STEPS,
    restart_s: float = 100.0,
    others: Sequence[SpecSetting] = (),
) -> Bounds:
    """`Bounds` of ``trace`` (seconds from its start) under ``truth``, with the maintenance
    windows ``opens`` ((opened, closes) in trace seconds, in order, as
    `specd.tools.replay.open_intervals` gives them less the trace's start), for a policy
    choosing among the static ``steps`` and ``others`` (off, adaptive sets)."""
    tokens = Tokens(trace, truth, steps)
    settings = [static(k) for k in steps] + [s for s in others if s.kind != "static"]
    named = {format_setting(s): tokens.ensure(s) for s in settings}
    keys = list(named.values())
    first, last = trace.t[0], trace.t[-1]
    inside = [(max(a, first), min(b, last)) for a, b in opens if first < a < last]
    if not inside:
        raise ValueError("no window opens inside the trace: nothing to choose")
    o1 = inside[0][0]
    pre = tokens.between(start_steps, first, o1)
    # The replay's denominators (specd.tools.replay.replay): each static K from the first
    # opening on, restarting into it there unless it is the start K; the oracle's best
    # fixed K per epoch, charged no restart.
    static_tokens = {
        k: pre + tokens.between(k, o1 + (0.0 if k == start_steps else restart_s), last)
        for k in steps
    }
    edges = [a for a, _ in inside] + [last]
    epochs = list(itertools.pairwise(edges))
    oracle = pre + sum(max(tokens.between(k, a, b) for k in steps) for a, b in epochs)
    # Every epoch: its window's open stretch at the best setting second by second, then
    # (the first epoch) S1 or (later ones) the best fixed setting in hindsight.
    closes = [min(b, end) for (_, b), (_, end) in zip(inside, epochs, strict=True)]
    window_part = sum(
        _best_each_second(tokens, keys, a, c) for (a, _), c in zip(epochs, closes, strict=True)
    )
    later = sum(
        max(tokens.between(k, c, end) for k in keys)
        for (_, end), c in zip(epochs[1:], closes[1:], strict=True)
    )
    first_end = epochs[0][1]
    upper = {
        name: pre + window_part + tokens.between(key, closes[0], first_end) + later
        for name, key in named.items()
    }
    seen = [
        (lvl, min(t1, o1) - t0)
        for (t0, t1), lvl in zip(itertools.pairwise(trace.t), trace.level, strict=True)
        if t0 < o1
    ]
    seen_s = sum(s for _, s in seen)
    return Bounds(
        static_tokens=static_tokens,
        oracle_tokens=oracle,
        upper=upper,
        seen_min=min(lvl for lvl, _ in seen),
        seen_max=max(lvl for lvl, _ in seen),
        seen_mean=sum(lvl * s for lvl, s in seen) / seen_s if seen_s > 0 else 0.0,
        first_close_s=closes[0],
        first_end_s=first_end,
    )


def first_epoch_setting(timeline: Sequence[Sequence[Any]], bounds: Bounds) -> str | None:
    """The setting a replay's ``setting_timeline`` ([seconds, operator form] per change)
    ran from the first window's close to the next opening (S1 of `Bounds.upper`); None
    where it changed in between or ran a setting the bound does not cover."""
    changes = [(float(at), str(name)) for at, name in timeline]
    if any(bounds.first_close_s < at < bounds.first_end_s for at, _ in changes):
        return None
    before = [name for at, name in changes if at <= bounds.first_close_s]
    s1 = before[-1] if before else None
    return s1 if s1 is not None and s1 in bounds.upper else None


def offered_others(truth: PerfTable, config: Config) -> list[SpecSetting]:
    """Off and the adaptive sets the model policy may choose in a replay of ``config`` on
    ``truth``, exactly as `specd.core.step` offers them there: what the truth can serve
    (`specd.tools.replay.truth_offer`), on the replay's server, with the calibration's
    rows (a set it cannot predict is not offered)."""
    narrowed, _, _ = truth_offer(truth, config)
    path = narrowed.choose.calibration_file
    calibration = None if path is None else read_calibration(path)
    offered = offer(narrowed.choose, REPLAY_TRAITS, table_steps(calibration))
    return [s for s in offered.settings if s.kind != "static"]


def bounds_of(trace: Trace, truth: PerfTable, config: Config) -> Bounds:
    """`upper_bound` under a replay's ``config``: its windows (the trace starting at
    `specd.tools.replay.DEFAULT_START`), the settings it offers and its restart cost."""
    t0 = DEFAULT_START.timestamp()
    opens = [(a - t0, b - t0) for a, b in open_intervals(config, t0 + trace.t[0], t0 + trace.t[-1])]
    steps = list(range(config.choose.min_steps, config.choose.max_steps + 1))
    return upper_bound(
        trace,
        truth,
        opens,
        steps,
        start_steps=replay_start_steps(config),
        restart_s=config.choose.restart_cost_s,
        others=offered_others(truth, config),
    )
