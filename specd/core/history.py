"""What specd has learned from SGLang's traffic: the `record` step of a tick.

Observations are folded into exponentially decaying, time-weighted sums, so recent
traffic counts most and the state stays small however long specd runs:

- the distribution of offered concurrency (running + queued) in integer bins, with the
  time observed and the busy time (offered > 0): one per concurrency up to 256, then 32
  per doubling (`concurrency_bin`), so a queue of any length, every second a new one,
  adds no more than ~900 bins to a table;
- the mean accept length per step count (only while the spec gauges are fresh);
- the mean throughput per (steps, offered concurrency);
- the capacity (max_running_requests) last seen per step count;
- per hour of the week (UTC), the offered-concurrency distribution again, decaying over
  weeks, for forecasting the next epoch from the same hours on previous days.

Decay costs O(1) per observation: every sum is stored multiplied by 2^((t - ref_t) /
half_life), which keeps the ratios between cells exact, and the whole table is rebased
only when that factor grows large.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from specd.core.acceptance import alpha_from_accept_length
from specd.core.observation import (
    MAX_COUNTER,
    MAX_RUNNING_REQUESTS,
    MAX_STEPS,
    MAX_TOKENS_PER_S,
    accept_length_possible,
    impossible_fields,
    without_impossible,
)
from specd.core.setting import config_key
from specd.core.units import DAY_S, HOUR_S, WEEK_S

if TYPE_CHECKING:
    from specd.core.observation import Observation
    from specd.core.settings import Settings

HOURS_PER_WEEK = 168
_WEEKEND_FIRST_HOUR = 5 * 24  # Saturday 00:00 in hour-of-week (0 = Monday 00:00 UTC)
# Hours of the day × (weekday, weekend): the forecast's "same hours, other days".
DAY_KINDS = 48
# 1970-01-01 00:00 UTC was a Thursday, 72 h after Monday 00:00.
_EPOCH_HOUR_OF_WEEK = 72
# Rebase a table once its scale factor reaches 2^64: far from float overflow, and rare
# (every 64 half-lives).
_REBASE_HALF_LIVES = 64.0
# Cells lighter than this (in seconds of weight) are dropped when serializing.
_PRUNE_WEIGHT_S = 1e-3
# Seconds of acceptance evidence one step count can have gathered: three centuries.
MAX_ACCEPT_SEEN_S = 1e10
# No clock specd runs under shows this (2242), and every later time is past what a date can
# show. A time after the clock reading a state file, but not past this, is the clock's
# fault, not the file's (a dead RTC battery at boot, a box that ran a year ahead and was
# set right): it is read, and taken as that clock's now by whoever counts from it (the
# history's time, its tables', the daemon's records: `records_ahead_of_clock`), rather
# than throw away what was learned and the restarts the budget counts.
LATEST_TIME = float(2**33)
HISTORY_FORMAT = 1
# Adaptive sets whose throughput is learned at once (specd offers at most 16). An SGLang
# naming another config file at every scrape made a key per scrape, and the history, the
# state file and each tick's cost grew without end; past this many the lightest set's cells
# make room.
MAX_ADAPTIVE_KEYS = 32
# The longest half-life a config sets (`observe.history_half_life_s`).
MAX_HALF_LIFE_S = 90 * DAY_S

K = TypeVar("K", bound=Hashable)

# Offered concurrency is learned exactly up to this; above it, in bins of a 32nd of a
# doubling (at most 3.1 % wide: a server's throughput is flat there, past its capacity,
# and a forecast's mix no finer). Each distinct key is a cell of the offered, throughput
# and hour-of-week tables, kept until it decays (weeks): a queue that took a new length
# every scrape grew the state without bound (megabytes a day), past the size the next
# start reads (`specd.io.state.MAX_STATE_BYTES`), which then moved it all aside.
EXACT_CONCURRENCY = 256
_BIN_BITS = 5  # 2**5 bins per doubling


def concurrency_bin(offered: int) -> int:
    """The key ``offered`` requests are learned under: itself up to `EXACT_CONCURRENCY`,
    else the lowest concurrency of its bin."""
    if offered <= EXACT_CONCURRENCY:
        return offered
    width = 1 << (offered.bit_length() - 1 - _BIN_BITS)
    return offered - offered % width


def hour_of_week(t: float) -> int:
    """Hour of the week in UTC for unix time ``t``: 0 = Monday 00:00–01:00."""
    return (math.floor(t / HOUR_S) + _EPOCH_HOUR_OF_WEEK) % HOURS_PER_WEEK


def is_weekend_hour(how: int) -> bool:
    return how % HOURS_PER_WEEK >= _WEEKEND_FIRST_HOUR


def day_kind(how: int) -> int:
    """Index of hour-of-week ``how``'s hour of the day on its kind of day (weekday or
    weekend): the hours the forecast pools when an hour of the week has too little data."""
    return how % 24 + (24 if is_weekend_hour(how) else 0)


def _moments(table: DecayingSums[int] | None, at: float) -> tuple[float, float]:
    """(decayed seconds, decayed seconds × key) of an offered-concurrency table at ``at``."""
    if table is None:
        return 0.0, 0.0
    seconds = weighted = 0.0
    for k, cell in table.cells.items():
        seconds += cell[0]
        weighted += k * cell[0]
    scale = table.scale_at(at)
    return seconds * scale, weighted * scale


def _pow2(x: float) -> float:
    # Clamped so that absurd clock jumps give 0 or a huge-but-finite factor, never an
    # OverflowError.
    return 2.0 ** max(-1000.0, min(1000.0, x))


class DecayingSums(Generic[K]):
    """Vectors of sums per key, all decaying with one half-life, O(1) per update."""

    __slots__ = ("cells", "half_life_s", "ref_t", "revision")

    def __init__(self, half_life_s: float, ref_t: float = 0.0) -> None:
        self.half_life_s = half_life_s
        self.ref_t = ref_t
        self.cells: dict[K, list[float]] = {}
        # Counts the changes of the stored sums (`add`, `rebase`): what is derived from
        # them alone (not from the time they are read at) holds while it is the same.
        self.revision = 0

    def add(self, key: K, t: float, *values: float) -> None:
        self.revision += 1
        if not self.cells:
            self.ref_t = t  # keeps the factors near 1 for the precision of small sums
        x = (t - self.ref_t) / self.half_life_s
        if x > _REBASE_HALF_LIVES:
            self.rebase(t)
            x = 0.0
        factor = _pow2(x)
        cell = self.cells.get(key)
        if cell is None:
            self.cells[key] = [v * factor for v in values]
        else:
            for i, v in enumerate(values):
                cell[i] += v * factor

    def rebase(self, t: float) -> None:
        """Store the sums as their decayed values at ``t``."""
        self.revision += 1
        factor = _pow2(-(t - self.ref_t) / self.half_life_s)
        for cell in self.cells.values():
            for i in range(len(cell)):
                cell[i] *= factor
        self.ref_t = t

    def shift(self, seconds: float) -> None:
        """Move the sums' time by ``seconds`` (the wall clock was stepped): each decays
        from when it really was recorded."""
        self.revision += 1
        self.ref_t += seconds

    def scale_at(self, t: float) -> float:
        """Multiply a stored sum by this to get its decayed value at ``t``."""
        return _pow2(-(t - self.ref_t) / self.half_life_s)

    def to_dict(self, t: float, encode_key: Callable[[K], Any]) -> dict[str, Any]:
        scale = self.scale_at(t)
        cells = [
            [encode_key(key), *(v * scale for v in cell)]
            for key, cell in sorted(self.cells.items(), key=lambda kv: repr(kv[0]))
            if cell[0] * scale >= _PRUNE_WEIGHT_S
        ]
        return {"ref_t": t, "half_life_s": self.half_life_s, "cells": cells}

    @classmethod
    def from_dict(
        cls,
        data: Any,
        half_life_s: float,
        width: int,
        decode_key: Callable[[Any], K],
        *,
        check: Callable[[K, list[float]], str | None] | None = None,
        dropped: list[str] | None = None,
        where: str = "cells",
        at: float | None = None,
        max_weight_s: float | None = None,
    ) -> DecayingSums[K]:
        """Rebuild from `to_dict`. A bad table raises ValueError; a bad cell raises too,
        unless ``dropped`` is given: then it is left out and named there.

        ``at``: when the sums were read last (a history's last observation, a snapshot's
        change); the table cannot have been written after it (`check_time`: its sums would
        be worth 2^(days / half-life) times what anything recorded after them is).
        ``max_weight_s``: the most seconds of weight the table can hold (`max_weight_s`):
        a cell past it, and then the table's sum past it, is no time that passed.
        """
        if not isinstance(data, dict):
            raise ValueError("expected an object")
        ref_t = check_time(data.get("ref_t"), "ref_t")
        if at is not None and ref_t > at:
            ref_t = at  # a clock stepped back a little: the sums as they were written
        table: DecayingSums[K] = cls(half_life_s, ref_t)
        cells = data.get("cells")
        if not isinstance(cells, list):
            raise ValueError("cells: expected a list")
        raw_keys: set[Any] = set()
        for index, row in enumerate(cells):
            try:
                key, values = _cell(row, width, decode_key)
                problem = check(key, values) if check is not None else None
                if problem is None and max_weight_s is not None and values[0] > max_weight_s:
                    problem = _too_heavy(values[0], max_weight_s)
                raw = tuple(row[0]) if isinstance(row[0], list) else row[0]
                if problem is None and raw in raw_keys:
                    problem = f"a second cell for {row[0]!r:.40} (the first is kept)"
                if problem is not None:
                    raise ValueError(problem)
            except ValueError as exc:
                if dropped is None:
                    raise ValueError(f"cells: {exc}") from None
                dropped.append(f"{where}[{index}]: {exc}")
                continue
            raw_keys.add(raw)
            cell = table.cells.get(key)
            if cell is None:
                table.cells[key] = values
            else:  # two keys of one bin (`concurrency_bin`): one cell
                for i, value in enumerate(values):
                    cell[i] += value
        total = sum(cell[0] for cell in table.cells.values())
        if max_weight_s is not None and total > max_weight_s:
            raise ValueError(f"its cells: {_too_heavy(total, max_weight_s)}")
        table.revision += len(table.cells)
        return table

    def distribution(self) -> tuple[dict[K, float] | None, float]:
        """The first value of every cell as a share of their sum (None when it is 0), and
        that sum, as stored: multiply by `scale_at` for its decayed value at a time. The
        shares do not depend on the time they are read at."""
        total = sum(cell[0] for cell in self.cells.values() if cell[0] > 0)
        if total <= 0:
            return None, 0.0
        return {k: cell[0] / total for k, cell in self.cells.items() if cell[0] > 0}, total


def max_weight_s(half_life_s: float, period_s: float | None = None) -> float:
    """The most seconds of weight a table of this half-life can hold, twice over.

    Each observation adds at most the seconds since the one before, so a table holds at
    most the decayed integral of one second per second: half-life / ln 2. An hour-of-week
    table (``period_s``, a week) gets at most an hour of every period. Twice that (and an
    observation's longest interval, two scrapes of an hour) leaves room for a clock
    stepped back, which counts some seconds twice; past it, a weight is no time that
    passed — and would outweigh everything observed after it.
    """
    longest = 2 * HOUR_S
    if period_s is None:
        return 2 * (half_life_s / math.log(2) + longest)
    return 2 * (HOUR_S + longest) / (1 - 2.0 ** (-period_s / half_life_s))


def _cap_weight(table: DecayingSums[Any], most: float) -> bool:
    """Scale ``table`` down to ``most`` seconds of weight in all, if it holds more: what
    a shorter half-life than it was written under keeps of it (means and shares as they
    were, the evidence no more than that half-life can hold). True if it did."""
    total = sum(cell[0] for cell in table.cells.values())
    if total <= most:
        return False
    factor = most / total
    for cell in table.cells.values():
        for i in range(len(cell)):
            cell[i] *= factor
    table.revision += 1
    return True


def _too_heavy(weight: float, most: float) -> str:
    return f"{weight:.6g} s of weight is more time than it can hold ({most:.6g} s)"


def _cell(row: Any, width: int, decode_key: Callable[[Any], K]) -> tuple[K, list[float]]:
    if not isinstance(row, list) or len(row) != width + 1:
        raise ValueError(f"expected [key, {width} numbers], got {row!r:.60}")
    values = [_finite(v, "value") for v in row[1:]]
    if values[0] < 0:
        raise ValueError(f"negative weight {values[0]}")
    return decode_key(row[0]), values


def _mean_of(values: list[float]) -> float | None:
    # Cells hold [weight, weight x value]: the mean, once there is weight to divide by.
    return values[1] / values[0] if values[0] > 0 else None


def _check_offered(key: int, values: list[float]) -> str | None:
    if key > 100 * MAX_RUNNING_REQUESTS:
        return f"{key} requests offered is more than any SGLang server holds"
    return None


def _check_accept(steps: int, values: list[float]) -> str | None:
    length = _mean_of(values)
    if steps > MAX_STEPS:
        return f"{steps} steps is more than SGLang runs"
    if length is not None and not accept_length_possible(length, steps):
        return f"accept length {length:.6g} at {steps} steps is impossible (1 to steps + 1)"
    return None


def _check_throughput(key: tuple[int, int], values: list[float]) -> str | None:
    rate = _mean_of(values)
    if key[0] > MAX_STEPS or key[1] > 100 * MAX_RUNNING_REQUESTS:
        return f"[{key[0]}, {key[1]}] is beyond any SGLang server"
    if rate is not None and not 0 <= rate <= MAX_TOKENS_PER_S:
        return f"{rate:.6g} tokens/s is more than any SGLang server serves"
    return None


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {value!r:.40}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: not finite")
    return float(value)


def check_time(value: Any, name: str) -> float:
    """``value`` as a time specd can have written (a unix time, not before 1970, not past
    `LATEST_TIME`); ValueError naming ``name`` otherwise."""
    number = _finite(value, name)
    if number < 0:
        raise ValueError(f"{name}: {number:.6g} is before 1970")
    if number > LATEST_TIME:
        raise ValueError(f"{name}: {number:.6g} is past any time specd runs at")
    return number


def _int_key(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer key, got {value!r:.40}")
    return value


def _concurrency_key(value: Any) -> int:
    # A file from before the bins: its cells are merged into theirs as they load.
    return concurrency_bin(_int_key(value))


def _pair_key(value: Any) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"expected a [steps, concurrency] key, got {value!r:.40}")
    return _setting_key(value[0]), _concurrency_key(value[1])


def _setting_key(value: Any) -> int:
    # A step count, or an adaptive set's `config_key` (negative, 48 bits).
    if isinstance(value, bool) or not isinstance(value, int) or value < -(2**48):
        raise ValueError(f"expected a step count or an adaptive set's key, got {value!r:.40}")
    return value


def _weighted_quantile(weights: Iterable[tuple[int, float]], q: float) -> float | None:
    """Smallest bin whose cumulative weight reaches q of the total (inverse CDF).

    Bins are integers, so the answer is a concurrency that was really observed.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q!r} outside [0, 1]")
    items = sorted((k, w) for k, w in weights if w > 0)
    total = sum(w for _, w in items)
    if total <= 0:
        return None
    threshold = q * total
    running = 0.0
    for k, w in items:
        running += w
        # A relative epsilon, so float rounding in the sum cannot skip a bin at q = 1.
        if running >= threshold * (1 - 1e-9):
            return float(k)
    return float(items[-1][0])


@dataclass(frozen=True)
class HistorySettings:
    """The knobs of the history (from Settings), kept apart so state can load without it."""

    half_life_s: float = DAY_S
    warmup_exclude_s: float = 120.0
    scrape_interval_s: float = 5.0
    hour_of_week_half_life_s: float = WEEK_S

    def __post_init__(self) -> None:
        for name in ("half_life_s", "scrape_interval_s", "hour_of_week_half_life_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if not (math.isfinite(self.warmup_exclude_s) and self.warmup_exclude_s >= 0):
            raise ValueError(f"warmup_exclude_s must be >= 0, got {self.warmup_exclude_s!r}")

    @property
    def max_interval_s(self) -> float:
        """The most time one observation can stand for: a gap is not traffic."""
        return 2.0 * self.scrape_interval_s

    @classmethod
    def from_config(cls, config: Settings) -> HistorySettings:
        return cls(
            half_life_s=config.observe.history_half_life_s,
            warmup_exclude_s=config.observe.warmup_exclude_s,
            scrape_interval_s=config.observe.scrape_interval_s,
        )


class Recorded(str, enum.Enum):
    """What `History.record` did with an observation."""

    COUNTED = "counted"
    WARMUP = "warmup"  # inside warmup_exclude_s after an SGLang start
    RESTART_DETECTED = "restart_detected"  # counters went back: a start we did not cause
    OUT_OF_ORDER = "out_of_order"  # not after the previous one (clock stepped back)
    IMPOSSIBLE = "impossible"  # a load no SGLang can have: nothing of it is learned


# Counters that only grow while one SGLang process lives.
_COUNTERS = (
    "generation_tokens_total",
    "decode_tokens_total",
    "spec_verify_calls_total",
    "retracted_total",
)


class History:
    """Decaying, time-weighted summary of what SGLang served. Not thread-safe."""

    def __init__(self, settings: HistorySettings | None = None) -> None:
        self.settings = settings if settings is not None else HistorySettings()
        s = self.settings
        self._offered: DecayingSums[int] = DecayingSums(s.half_life_s)
        self._accept: DecayingSums[int] = DecayingSums(s.half_life_s)
        # Per K: seconds of acceptance evidence ever recorded, undecayed. The decayed sums
        # say how recent it is; this, how much was measured (`accept_seen_s`).
        self._accept_seen: dict[int, float] = {}
        self._throughput: DecayingSums[tuple[int, int]] = DecayingSums(s.half_life_s)
        self._hourly: list[DecayingSums[int] | None] = [None] * HOURS_PER_WEEK
        # The hourly tables summed per `day_kind`, kept as they are fed (same half-life, so
        # the sums are the same) instead of merged from up to 5 tables at every forecast.
        self._day_kinds: list[DecayingSums[int] | None] = [None] * DAY_KINDS
        self._capacity: dict[int, int] = {}
        self.last_t: float | None = None
        self.sglang_started_at: float | None = None
        self._counters: dict[str, float] = {}
        self._last_steps: int | None = None
        # What the queries derive from the hourly tables, per table: (table, its revision,
        # `DecayingSums.distribution`). Derived, never state: not persisted, not compared.
        self._distributions: dict[int, tuple[DecayingSums[int], int, Any]] = {}
        # One slot for `specd.core.forecast` to keep its last forecast in, with what it was
        # made of (it checks that before reusing it): derived, never state.
        self.forecast_memo: Any = None
        # And one for what `specd.core.forecast._seen_spread` keeps: derived, never state.
        self.spread_memo: Any = None
        # hour of the day -> (its two day-kind tables, their revisions, shares, seconds then,
        # the first table, that table's `scale_at` then)
        self._any_day: dict[int, tuple[Any, ...]] = {}
        self._throughput_memo: (
            tuple[DecayingSums[tuple[int, int]], int, float, dict[tuple[int, int], Any]] | None
        ) = None
        # (the table made, its cells grouped by key): `throughput_cells`.
        self._throughput_by_key: tuple[Any, dict[int, dict[int, tuple[float, float]]]] | None = None

    # -- folding --------------------------------------------------------------------
    def mark_sglang_start(self, t: float) -> None:
        """SGLang (re)started at ``t``: the next warmup_exclude_s are not representative."""
        self.sglang_started_at = t
        self._counters = {}
        self._last_steps = None

    def shift(self, seconds: float) -> None:
        """Move every time in the history by ``seconds``: the wall clock was stepped (the
        daemon tells it from its boot clock). What was learned stays as long ago as it was,
        so a day's step forward does not decay it by a day, and one back does not make every
        observation until the clock catches up out of order (none learned meanwhile)."""
        if self.last_t is not None:
            self.last_t += seconds
        if self.sglang_started_at is not None:
            self.sglang_started_at += seconds
        tables = (self._offered, self._accept, self._throughput, *self._hourly, *self._day_kinds)
        for table in tables:
            if table is not None:
                table.shift(seconds)

    def reconfigure(self, settings: HistorySettings) -> None:
        """Adopt new settings (config reload); what was learned is kept."""
        self.settings = settings
        at = self._at()
        most = max_weight_s(settings.half_life_s)
        for table in (self._offered, self._accept, self._throughput):
            _change_half_life(table, settings.half_life_s, at)
            _cap_weight(table, most)
        most = max_weight_s(settings.hour_of_week_half_life_s, WEEK_S)
        for hourly in (*self._hourly, *self._day_kinds):
            if hourly is not None:
                _change_half_life(hourly, settings.hour_of_week_half_life_s, at)
        capped = [_cap_weight(hourly, most) for hourly in self._hourly if hourly is not None]
        if any(capped):
            self._rebuild_day_kinds()

    def record(self, obs: Observation) -> Recorded:
        """Fold one observation in; it stands for the time since the previous one."""
        t = obs.t
        if not math.isfinite(t):
            return Recorded.OUT_OF_ORDER
        impossible = impossible_fields(obs)
        if "running" in impossible or "queued" in impossible:
            return Recorded.IMPOSSIBLE
        # The reader rejects what SGLang cannot produce; replay and tools build
        # observations too, and what is learned lasts weeks: check again here.
        obs = without_impossible(obs, impossible=impossible)
        # What an adaptive set serves is recorded under its config file's key: one setting.
        adaptive_key = None
        if obs.adaptive:
            # The steps gauge follows SGLang's own tier changes: neither a restart nor
            # evidence about a static step count (whose capacity would differ).
            obs = replace(obs, steps=None)
            if obs.adaptive_config:
                adaptive_key = config_key(obs.adaptive_config)
        restarted = self._detect_restart(obs)
        if restarted:
            self.sglang_started_at = t
        if obs.steps is not None and obs.max_running_requests is not None:
            # Capacity is fixed at start, so it is valid even during warm-up.
            self._capacity[obs.steps] = obs.max_running_requests
        if obs.steps is not None:
            self._last_steps = obs.steps

        prev_t = self.last_t
        raw_dt = self.settings.scrape_interval_s if prev_t is None else t - prev_t
        self.last_t = t
        prev_decode = self._counters.get("decode_tokens_total")
        self._remember_counters(obs)
        if raw_dt <= 0:
            return Recorded.OUT_OF_ORDER
        if restarted:
            return Recorded.RESTART_DETECTED
        started = self.sglang_started_at
        if started is not None and started <= t < started + self.settings.warmup_exclude_s:
            return Recorded.WARMUP
        dt = min(raw_dt, self.settings.max_interval_s)

        offered = concurrency_bin(max(0, obs.offered))
        self._offered.add(offered, t, dt)
        how = hour_of_week(t)
        hourly = self._hourly[how]
        if hourly is None:
            hourly = self._hourly[how] = DecayingSums(self.settings.hour_of_week_half_life_s)
        hourly.add(offered, t, dt)
        kind = self._day_kinds[day_kind(how)]
        if kind is None:
            kind = self._day_kinds[day_kind(how)] = DecayingSums(hourly.half_life_s)
        kind.add(offered, t, dt)

        steps = obs.steps
        if steps is not None:
            length = obs.accept_length
            if obs.spec_fresh and length is not None and math.isfinite(length) and length >= 1.0:
                self._accept.add(steps, t, dt, dt * length)
                self._accept_seen[steps] = min(
                    self._accept_seen.get(steps, 0.0) + dt, MAX_ACCEPT_SEEN_S
                )
        else:
            steps = adaptive_key
        if steps is None:
            return Recorded.COUNTED
        if offered > 0:
            throughput = self._throughput_of(obs, prev_decode, raw_dt)
            if throughput is not None:
                if steps < 0 and (steps, offered) not in self._throughput.cells:
                    self._room_for_adaptive(steps)
                self._throughput.add((steps, offered), t, dt, dt * throughput)
        return Recorded.COUNTED

    def _room_for_adaptive(self, key: int) -> None:
        """Before a new cell of adaptive set ``key``: past MAX_ADAPTIVE_KEYS sets, the cells
        of the one observed least (decayed seconds) are dropped."""
        table = self._throughput
        seen: dict[int, float] = {}
        for (k, _), cell in table.cells.items():
            if k < 0:
                seen[k] = seen.get(k, 0.0) + cell[0]
        if key in seen or len(seen) < MAX_ADAPTIVE_KEYS:
            return
        lightest = min(seen, key=seen.__getitem__)
        for cell_key in [ck for ck in table.cells if ck[0] == lightest]:
            del table.cells[cell_key]
        table.revision += 1

    def _detect_restart(self, obs: Observation) -> bool:
        if obs.steps is not None and self._last_steps is not None and obs.steps != self._last_steps:
            return True
        for name in _COUNTERS:
            now_value = getattr(obs, name)
            before = self._counters.get(name)
            if now_value is not None and before is not None and now_value < before:
                return True
        return False

    def _remember_counters(self, obs: Observation) -> None:
        for name in _COUNTERS:
            value = getattr(obs, name)
            if value is not None and math.isfinite(value):
                self._counters[name] = value

    def _throughput_of(
        self, obs: Observation, prev_decode: float | None, raw_dt: float
    ) -> float | None:
        # The decode-token counter over the interval is exact; the gen_throughput gauge
        # covers only SGLang's last report interval, so it is the fallback.
        now_decode = obs.decode_tokens_total
        if (
            now_decode is not None
            and prev_decode is not None
            and now_decode >= prev_decode
            and raw_dt <= self.settings.max_interval_s
        ):
            rate = (now_decode - prev_decode) / raw_dt
            # A counter that leapt (a bad page between two good ones) is no rate.
            return rate if rate <= MAX_TOKENS_PER_S else None
        gauge = obs.gen_throughput
        if gauge is not None and math.isfinite(gauge) and gauge >= 0:
            return gauge
        return None

    # -- queries --------------------------------------------------------------------
    def _at(self) -> float:
        return self.last_t if self.last_t is not None else 0.0

    def offered_weights(self) -> dict[int, float]:
        """Decayed seconds spent at each offered concurrency (as of the last observation)."""
        scale = self._offered.scale_at(self._at())
        return {k: cell[0] * scale for k, cell in self._offered.cells.items()}

    def quantile(self, q: float, *, busy_only: bool = True) -> float | None:
        """Quantile of offered concurrency over (busy) time; None without such time."""
        cells = self._offered.cells.items()
        return _weighted_quantile(((k, cell[0]) for k, cell in cells if k > 0 or not busy_only), q)

    @property
    def observed_seconds(self) -> float:
        """Decayed time covered by counted observations."""
        return sum(self.offered_weights().values())

    @property
    def busy_seconds(self) -> float:
        """Decayed time with at least one request offered."""
        return sum([w for k, w in self.offered_weights().items() if k > 0])  # read every tick

    def accept_length(self, steps: int) -> float | None:
        cell = self._accept.cells.get(steps)
        if cell is None or cell[0] <= 0:
            return None
        return cell[1] / cell[0]

    def accept_seconds(self, steps: int) -> float:
        """Decayed time of fresh acceptance evidence at ``steps``."""
        cell = self._accept.cells.get(steps)
        return 0.0 if cell is None else cell[0] * self._accept.scale_at(self._at())

    def accept_seen_s(self, steps: int) -> float:
        """Seconds of acceptance evidence ever recorded at ``steps``, undecayed (at least
        the decayed ones, for a state file older than this count)."""
        return max(self._accept_seen.get(steps, 0.0), self.accept_seconds(steps))

    def alpha(self, steps: int) -> float | None:
        """Per-draft-token acceptance α at ``steps``, inverted from the accept length."""
        length = self.accept_length(steps)
        return None if length is None else alpha_from_accept_length(length, steps)

    def throughput(self, steps: int, concurrency: int) -> float | None:
        """Mean output tokens/s seen at ``steps`` with ``concurrency`` requests offered."""
        cell = self._throughput.cells.get((steps, concurrency))
        if cell is None or cell[0] <= 0:
            return None
        return cell[1] / cell[0]

    def throughput_table(self) -> dict[tuple[int, int], tuple[float, float]]:
        """(steps, concurrency) -> (mean tokens/s, decayed seconds of evidence); an adaptive
        set's cells are keyed by its `specd.core.setting.config_key` (negative)."""
        return dict(self._throughput_made())

    def _throughput_made(self) -> dict[tuple[int, int], tuple[float, float]]:
        table, at = self._throughput, self._at()
        # Read up to three times a tick (the model, the outcome check): made once per
        # (revision, time); readers get a copy or a read-only view.
        memo = self._throughput_memo
        if memo is None or memo[0] is not table or memo[1] != table.revision or memo[2] != at:
            scale = table.scale_at(at)
            made = {
                key: (cell[1] / cell[0], cell[0] * scale)
                for key, cell in table.cells.items()
                if cell[0] > 0
            }
            memo = self._throughput_memo = (table, table.revision, at, made)
        return memo[3]

    def throughput_cells(self, key: int) -> Mapping[int, tuple[float, float]]:
        """`throughput_table`'s cells of one key with concurrency > 0: concurrency ->
        (mean tokens/s, decayed seconds), in the table's order; read-only."""
        return MappingProxyType(self.throughput_by_key().get(key, {}))

    def throughput_by_key(self) -> Mapping[int, Mapping[int, tuple[float, float]]]:
        """`throughput_cells` of every key, keys in the table's order; read-only: shared by
        the readers of this tick (the model, the outcome check)."""
        made = self._throughput_made()
        # Read several times a tick: grouped once per table made, instead of scanning every
        # key's cells at each read.
        grouped = self._throughput_by_key
        if grouped is None or grouped[0] is not made:
            by_key: dict[int, dict[int, tuple[float, float]]] = {}
            for (k, c), cell in made.items():
                if c > 0:
                    by_key.setdefault(k, {})[c] = cell
            grouped = self._throughput_by_key = (made, by_key)
        return grouped[1]

    def capacity(self, steps: int) -> int | None:
        """max_running_requests last seen while SGLang ran ``steps``."""
        return self._capacity.get(steps)

    @property
    def capacities(self) -> dict[int, int]:
        return dict(self._capacity)

    def hour_of_week_weights(self, how: int) -> dict[int, float]:
        """Decayed seconds at each offered concurrency during hour-of-week ``how`` (UTC)."""
        hourly = self._hourly[how % HOURS_PER_WEEK]
        if hourly is None:
            return {}
        scale = hourly.scale_at(self._at())
        return {k: cell[0] * scale for k, cell in hourly.cells.items()}

    def day_kind_weights(self, how: int) -> dict[int, float]:
        """Decayed seconds at each offered concurrency during this hour of the day on every
        day of ``how``'s kind (weekdays, or the weekend), ``how`` itself included."""
        table = self._day_kinds[day_kind(how)]
        if table is None:
            return {}
        scale = table.scale_at(self._at())
        return {k: cell[0] * scale for k, cell in table.cells.items()}

    def hour_moments(
        self, how: int
    ) -> tuple[tuple[float, float], tuple[float, float], tuple[float, float]]:
        """Decayed (seconds, seconds × offered concurrency) during hour-of-week ``how``, during
        its hour of the day on the days of its kind (``how`` included: `day_kind_weights`),
        and on every day of either kind: the means and their weights, no shares made."""
        at = self._at()
        weekdays, weekend = (_moments(table, at) for table in self._day_tables(how % 24))
        return (
            _moments(self._hourly[how % HOURS_PER_WEEK], at),
            weekend if is_weekend_hour(how) else weekdays,  # the kind's table is one of them
            (weekdays[0] + weekend[0], weekdays[1] + weekend[1]),
        )

    def _distribution(
        self, index: int, table: DecayingSums[int] | None
    ) -> tuple[dict[int, float] | None, float]:
        """``table``'s `DecayingSums.distribution` and its decayed seconds now, the first
        derived once per revision of the table (``index``: which table it is)."""
        if table is None:
            return None, 0.0
        memo = self._distributions.get(index)
        if memo is None or memo[0] is not table or memo[1] != table.revision:
            memo = self._distributions[index] = (table, table.revision, table.distribution())
        shares, total = memo[2]
        return shares, total * table.scale_at(self._at())

    def hour_of_week_distribution(self, how: int) -> tuple[dict[int, float] | None, float]:
        """The share of hour-of-week ``how``'s time at each offered concurrency (None without
        any) and its decayed seconds. The shares are the same object while nothing was
        recorded in that hour (whatever the time now): callers may key on it."""
        how %= HOURS_PER_WEEK
        return self._distribution(how, self._hourly[how])

    def day_kind_distribution(self, how: int) -> tuple[dict[int, float] | None, float]:
        """As `hour_of_week_distribution` over this hour of the day on every day of
        ``how``'s kind (`day_kind_weights`)."""
        kind = day_kind(how)
        return self._distribution(HOURS_PER_WEEK + kind, self._day_kinds[kind])

    def _day_tables(self, hour: int) -> tuple[DecayingSums[int] | None, DecayingSums[int] | None]:
        """This hour of the day's tables on weekdays and on the weekend (`day_kind`)."""
        return self._day_kinds[hour], self._day_kinds[hour + 24]

    def hour_of_day_distribution(self, how: int) -> tuple[dict[int, float] | None, float]:
        """As `day_kind_distribution` over this hour of the day on every day seen, weekdays
        and weekends alike. Both tables decay alike, so their shares of the sum do not
        depend on the time read either: derived once per revision of the two."""
        hour = how % 24
        first, second = self._day_tables(hour)
        # Read for every hour of the day at every tick (`specd.core.forecast`): no tuples
        # built to compare, and the reference's scale at the memo's time kept with it (its
        # revision covers what that scale reads: ref_t, half_life_s).
        revisions = (
            -1 if first is None else first.revision,
            -1 if second is None else second.revision,
        )
        memo = self._any_day.get(hour)
        if memo is None or memo[0] is not first or memo[1] is not second or memo[2] != revisions:
            at = self._at()
            merged: dict[int, float] = {}
            for table in (first, second):
                if table is None:
                    continue
                scale = table.scale_at(at)
                for k, cell in table.cells.items():
                    merged[k] = merged.get(k, 0.0) + cell[0] * scale
            total = sum(w for w in merged.values() if w > 0)
            shares = {k: w / total for k, w in merged.items() if w > 0} if total > 0 else None
            reference = first if first is not None else second
            # Stored as seconds at ``at``: rescaled to now when read (the same half-life).
            then = 1.0 if reference is None else reference.scale_at(at)
            memo = self._any_day[hour] = (first, second, revisions, shares, total, reference, then)
        shares, total, reference, then = memo[3], memo[4], memo[5], memo[6]
        if shares is None or reference is None:
            return None, 0.0
        return shares, total * reference.scale_at(self._at()) / then

    def hour_shares(self, how: int, min_seconds: float) -> tuple[dict[int, float] | None, int]:
        """The first of `hour_of_week_distribution` (0), `day_kind_distribution` (1) and
        `hour_of_day_distribution` (2) of ``how`` with ``min_seconds`` of decayed time, and
        which one it is; (None, 3) when none has. The forecast reads it for every hour of
        an epoch at every tick: one call, each table read only when the one before falls
        short."""
        weekdays, weekend = self._day_tables(how % 24)
        if weekdays is None and weekend is None and self._hourly[how % HOURS_PER_WEEK] is None:
            return None, 3  # that hour of the day never seen (a fresh start: most hours)
        readers = (
            self.hour_of_week_distribution,
            self.day_kind_distribution,
            self.hour_of_day_distribution,
        )
        for source, read in enumerate(readers):
            shares, seconds = read(how)
            if seconds >= min_seconds and shares is not None:
                return shares, source
        return None, len(readers)

    def hour_of_day_distributions(self) -> list[tuple[dict[int, float] | None, float]]:
        """`hour_of_day_distribution` of every hour of the day (0-23), the same values: the
        forecast reads all 24 at every tick, a kept one here without a call of its own."""
        at = self._at()
        kinds, kept = self._day_kinds, self._any_day
        out: list[tuple[dict[int, float] | None, float]] = []
        for hour in range(24):
            first, second = kinds[hour], kinds[hour + 24]
            memo = kept.get(hour)
            if (
                memo is None
                or memo[0] is not first
                or memo[1] is not second
                or memo[2][0] != (-1 if first is None else first.revision)
                or memo[2][1] != (-1 if second is None else second.revision)
            ):
                out.append(self.hour_of_day_distribution(hour))
                continue
            shares, total, reference, then = memo[3], memo[4], memo[5], memo[6]
            if shares is None or reference is None:
                out.append((None, 0.0))
                continue
            # `DecayingSums.scale_at(at)`, inlined.
            now = _pow2(-(at - reference.ref_t) / reference.half_life_s)
            out.append((shares, total * now / then))
        return out

    def _rebuild_day_kinds(self) -> None:
        at = self._at()
        kinds: list[DecayingSums[int] | None] = [None] * DAY_KINDS
        for how, hourly in enumerate(self._hourly):
            if hourly is None:
                continue
            index = day_kind(how)
            kind = kinds[index]
            if kind is None:
                kind = kinds[index] = DecayingSums(hourly.half_life_s, at)
            scale = hourly.scale_at(at)
            for k, cell in hourly.cells.items():
                summed = kind.cells.setdefault(k, [0.0])
                summed[0] += cell[0] * scale
        self._day_kinds = kinds

    def hours_quantile(
        self, hours: Iterable[int], q: float, *, busy_only: bool = True
    ) -> float | None:
        """Quantile of offered concurrency over the given hours of the week, merged."""
        merged: dict[int, float] = {}
        for how in set(h % HOURS_PER_WEEK for h in hours):
            for k, w in self.hour_of_week_weights(how).items():
                if k > 0 or not busy_only:
                    merged[k] = merged.get(k, 0.0) + w
        return _weighted_quantile(merged.items(), q)

    # -- persistence ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        at = self._at()
        s = self.settings
        return {
            "format": HISTORY_FORMAT,
            "settings": {
                "half_life_s": s.half_life_s,
                "warmup_exclude_s": s.warmup_exclude_s,
                "scrape_interval_s": s.scrape_interval_s,
                "hour_of_week_half_life_s": s.hour_of_week_half_life_s,
            },
            "last_t": self.last_t,
            "sglang_started_at": self.sglang_started_at,
            "last_steps": self._last_steps,
            "counters": dict(sorted(self._counters.items())),
            "offered": self._offered.to_dict(at, int),
            "accept": self._accept.to_dict(at, int),
            "accept_seen": [[k, v] for k, v in sorted(self._accept_seen.items())],
            "throughput": self._throughput.to_dict(at, list),
            "capacity": [[k, v] for k, v in sorted(self._capacity.items())],
            "hourly": [None if table is None else table.to_dict(at, int) for table in self._hourly],
        }

    @classmethod
    def from_dict(
        cls,
        data: Any,
        settings: HistorySettings | None = None,
        dropped: list[str] | None = None,
        *,
        now: float | None = None,
    ) -> History:
        """Rebuild from `to_dict`; ``settings`` (from the config) win over stored ones.

        Raises ValueError with a one-line reason when the history as a whole is unusable.
        A bad entry (a cell, a capacity, a counter, a table) raises too, unless ``dropped``
        is given: then it is left out, named there, and the rest is kept. Its times must be
        ones specd can have written by ``now`` (`check_time`), and its weights time that
        can have passed (`max_weight_s`).
        """
        if not isinstance(data, dict):
            raise ValueError("history: expected an object")
        if data.get("format") != HISTORY_FORMAT:
            raise ValueError(f"history: unknown format {data.get('format')!r:.20}")
        if settings is None:
            stored = data.get("settings")
            if not isinstance(stored, dict):
                raise ValueError("history.settings: expected an object")
            try:
                settings = HistorySettings(
                    **{f.name: _finite(stored.get(f.name), f.name) for f in fields(HistorySettings)}
                )
            except (TypeError, ValueError) as exc:
                raise ValueError(f"history.settings: {exc}") from None
        history = cls(settings)
        # Salvage: without a ``dropped`` list the first bad entry raises (strict); with
        # one, every bad entry is left out and named, and every good one is kept.
        strict = dropped is None
        notes: list[str] = [] if dropped is None else dropped

        def salvage(where: str, problem: str) -> None:
            if strict:
                raise ValueError(f"{where}: {problem}")
            notes.append(f"history.{where}: {problem}")

        def keyed_rows(
            name: str,
            parse: Callable[[Any], tuple[int, Any]],
            into: dict[int, Any],
            *,
            required: bool,
        ) -> None:
            # A list of [steps, value] rows: a bad row is left out; no list at all loses
            # the whole history if it is a part every history has, else only this part.
            rows = data.get(name, None if required else [])
            if not isinstance(rows, list):
                if required:
                    raise ValueError(f"{name}: expected a list")
                salvage(name, "expected a list")
                return
            for index, row in enumerate(rows):
                try:
                    key, value = parse(row)
                except ValueError as exc:
                    salvage(f"{name}[{index}]", str(exc))
                    continue
                into[key] = value

        try:
            last_t = data.get("last_t")
            # A history from the future cannot be read as of now: every sum in it would
            # outweigh what is observed from now on (it starts over, named).
            at = None if last_t is None else check_time(last_t, "last_t")
            if at is not None and now is not None and at > now:
                at = now  # a clock stepped back: the sums as they were written
            history.last_t = at
            try:
                started = data.get("sglang_started_at")
                history.sglang_started_at = (
                    None if started is None else check_time(started, "sglang_started_at")
                )
                if history.sglang_started_at is not None and now is not None:
                    # Ahead of the clock, its warm-up would exclude what is observed until
                    # then (`warmup_exclude_s` counts from it).
                    history.sglang_started_at = min(history.sglang_started_at, now)
            except ValueError as exc:
                salvage("sglang_started_at", str(exc).partition(": ")[2] or str(exc))
            last_steps = data.get("last_steps")
            try:
                history._last_steps = None if last_steps is None else _steps_key(last_steps)
            except ValueError as exc:
                salvage("last_steps", str(exc))
            counters = data.get("counters", {})
            if not isinstance(counters, dict):
                raise ValueError("counters: expected an object")
            for name, value in counters.items():
                if name not in _COUNTERS:
                    continue
                try:
                    number = _finite(value, f"counters.{name}")
                    if not 0 <= number <= MAX_COUNTER:
                        raise ValueError(f"counters.{name}: {number:.6g} is no token count")
                except ValueError as exc:
                    salvage(f"counters.{name}", str(exc).partition(": ")[2] or str(exc))
                    continue
                history._counters[str(name)] = number
            keep = None if strict else notes
            # The tables were written at the history's last observation (none: never).
            written = at if at is not None else 0.0

            def table(
                raw: Any,
                where: str,
                half_life_s: float,
                width: int,
                key: Callable[[Any], Any],
                check: Callable[..., str | None],
                period_s: float | None = None,
            ) -> DecayingSums[Any] | None:
                """One table, or None when it is unusable (named; strict: raises)."""
                # It may hold what the half-life it was written under allows (a config
                # with a shorter one since), up to the longest any config sets.
                stored = raw.get("half_life_s") if isinstance(raw, dict) else None
                longest = half_life_s
                if (
                    isinstance(stored, (int, float))
                    and not isinstance(stored, bool)
                    and half_life_s < stored <= MAX_HALF_LIFE_S
                ):
                    longest = float(stored)
                try:
                    loaded = DecayingSums.from_dict(
                        raw,
                        half_life_s,
                        width,
                        key,
                        check=check,
                        where=f"history.{where}",
                        dropped=keep,
                        at=written,
                        max_weight_s=max_weight_s(longest, period_s),
                    )
                except ValueError as exc:
                    salvage(where, str(exc))
                    return None
                _cap_weight(loaded, max_weight_s(half_life_s, period_s))
                return loaded

            hl = settings.half_life_s
            history._offered = table(
                data.get("offered"), "offered", hl, 1, _concurrency_key, _check_offered
            ) or DecayingSums(hl)
            history._accept = table(
                data.get("accept"), "accept", hl, 2, _int_key, _check_accept
            ) or DecayingSums(hl)
            history._throughput = table(
                data.get("throughput"), "throughput", hl, 2, _pair_key, _check_throughput
            ) or DecayingSums(hl)
            # Absent from state files older than it: the decayed seconds stand in.
            keyed_rows("accept_seen", _seen_row, history._accept_seen, required=False)
            keyed_rows("capacity", _capacity_row, history._capacity, required=True)
            hourly = data.get("hourly")
            if not isinstance(hourly, list) or len(hourly) != HOURS_PER_WEEK:
                raise ValueError(f"hourly: expected a list of {HOURS_PER_WEEK}")
            hw = settings.hour_of_week_half_life_s
            history._hourly = [
                None
                if h is None
                else table(h, f"hourly[{how}]", hw, 1, _concurrency_key, _check_offered, WEEK_S)
                for how, h in enumerate(hourly)
            ]
            history._rebuild_day_kinds()
        except ValueError as exc:
            raise ValueError(f"history: {exc}") from None
        return history


def _steps_key(value: Any) -> int:
    steps = _int_key(value)
    if steps > MAX_STEPS:
        raise ValueError(f"{steps} steps is more than SGLang runs")
    return steps


def _capacity_row(row: Any) -> tuple[int, int]:
    if not isinstance(row, list) or len(row) != 2:
        raise ValueError(f"expected [steps, requests], got {row!r:.40}")
    steps, requests = _steps_key(row[0]), _int_key(row[1])
    if not 1 <= requests <= MAX_RUNNING_REQUESTS:
        raise ValueError(f"{requests} running requests at most is no capacity")
    return steps, requests


def _seen_row(row: Any) -> tuple[int, float]:
    if not isinstance(row, list) or len(row) != 2:
        raise ValueError(f"expected [steps, seconds], got {row!r:.40}")
    steps, seconds = _steps_key(row[0]), _finite(row[1], "seconds")
    if not 0 <= seconds <= MAX_ACCEPT_SEEN_S:
        raise ValueError(f"{seconds:.6g} s is no time of acceptance evidence")
    return steps, seconds


def _change_half_life(table: DecayingSums[Any], half_life_s: float, at: float) -> None:
    # Decay up to now at the old rate, then continue at the new one.
    if table.half_life_s != half_life_s:
        table.rebase(at)
        table.half_life_s = half_life_s
