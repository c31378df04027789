"""`specd replay`: the daemon's own brain (`specd.core.step`) over a trace, in simulated time.

Simulated time ticks every ``scrape_interval_s`` of the config, like the daemon: each tick
records an Observation built from the trace and the truth table into `History` and, near a
window, runs `step` exactly as the daemon's loop does (same control state, same restart
bookkeeping). Outside a window (and its lead-in, see `evaluated_spans`) nothing can act —
every acting path runs through `windows.is_open` — so `step` runs only there; the
decisions are the daemon's, tick for tick (tests/tools/test_replay_is_daemon.py), at a
fraction of the cost. A restart serves nothing for ``--restart-s``.

Compared in the same run: specd, every static K in the allowed range, the oracle (the
best fixed K of each epoch — window opening to window opening — in hindsight) and SGLang's
``--speculative-adaptive`` with its default slots (`specd.core.adaptive`: the best
candidate of each batch's slot, capacity of the deepest candidate). Before the first
window no one can choose: each of them runs the start K there, as specd does, and its own
setting from that window's opening on. One that differs from the start K restarts into it
then, and serves nothing while it does, as specd (the oracle alone is charged no restart:
it is the bound of choosing in hindsight). Tokens come from the
truth table, piecewise constant per trace row; tokens specd's K would have served while
SGLang restarts are lost. ``setting_timeline`` (each change and when it was issued) with
``change_restart_s`` (how long each change's restart took: ``restart_s``, an adaptive start
more) recounts specd's tokens from the truth alone, as ``static_restart_s``,
``adaptive_set_restart_s`` and ``adaptive.restart_s`` (what each comparison's restart at
the first window took) recount theirs; ``explorations`` counts the
changes that were safe explorations (reason ``explore``), per step count and per rolling
week. ``--warmup-s`` replays the start of a trace without scoring it (steady state, as a
daemon that has run a while).
"""

from __future__ import annotations

import bisect
import codecs
import csv
import functools
import io
import itertools
import math
import time  # only to measure decision cost; simulated time is t
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specd.core import windows
from specd.core.adaptive import DEFAULT_SLOTS, AdaptiveModel, Slots
from specd.core.decide import Control, Reason
from specd.core.forecast import Forecast, forecast_epoch, score
from specd.core.history import History, HistorySettings
from specd.core.model import (
    Calibration,
    adaptive_restart_extra_s,
    adaptive_slots,
    restart_extra_s,
)
from specd.core.observation import Observation
from specd.core.perftable import PerfTable, csv_rows
from specd.core.setting import (
    ServerTraits,
    SpecSetting,
    adaptive_config_name,
    format_setting,
    off,
    static,
)
from specd.core.setting import parse as parse_setting
from specd.core.step import StepContext, step
from specd.core.text import BOM_PROBLEM
from specd.core.units import DAY_S, WEEK_S
from specd.io import files
from specd.io.calibration import read_calibration
from specd.io.config import Config

DEFAULT_START = datetime(2026, 1, 5, tzinfo=timezone.utc)  # a Monday
# The replayed server runs whatever the truth has rows for: a chain drafter on an SGLang
# with per-batch adaptive slots and step 0 in them.
REPLAY_TRAITS = ServerTraits(
    algorithm="NEXTN",
    topk=1,
    dp_attention=False,
    multi_layer_eagle=False,
    two_batch_overlap=False,
    pdmux=False,
    version=(0, 5, 23),
)
DEFAULT_RESTART_S = 100.0
# The step count everyone runs before the first window, unless the caller names one: the
# seed campaign's value, within the config's allowed range.
DEFAULT_START_STEPS = 3
# The longest trace replay reads: 115 days of 1-second rows (the bench runs up to 100).
# Measured at this cap, a level change at every row (`python -m bench replaymem --rows 10`,
# truth k5to2, --steps 1-6; the README's replay section) peaks at 343 MiB RSS, and 638 MiB
# with a distinct gap between every two rows (the median sorts them) in a 248 MiB file;
# before the trace was kept in arrays and `Tokens` in sparse prefix sums: 6,497 MiB,
# enough for the OOM killer to pick a process on the GPU box that runs SGLang. What is
# left is mostly the parse: the file's bytes and 16 bytes a row of arrays, then 16 a run.
MAX_TRACE_ROWS = 10_000_000
# Room for MAX_TRACE_ROWS rows of "t_s,concurrency" (~25 bytes each); held while parsing.
MAX_TRACE_BYTES = 256 * files.MIB
# What to do with a trace over either cap.
TRACE_TOO_LONG = (
    "resample it coarser, e.g. to 10-second rows "
    f"(1-second rows fit up to {MAX_TRACE_ROWS // 86400} days)"
)
# Levels are kept as 64-bit integers; a float above 2**53 holds no exact whole number of
# requests anyway.
MAX_CONCURRENCY = float(2**53)
# Bytes of the trace checked for UTF-8 at a time.
_UTF8_CHUNK = files.MIB
# Distinct gap values `_median_gap` counts before it sorts every gap instead.
_MAX_GAP_VALUES = 65_536


class ReplayError(ValueError):
    """Bad replay input; one line."""


# -- the trace --------------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    """Offered concurrency, piecewise constant: ``level[i]`` from ``t[i]`` to ``t[i+1]``.

    `load_trace` and `trace_from_rows` keep both in arrays (8 bytes a run each), not lists
    of Python numbers (a list of floats takes 32 bytes an item)."""

    t: Sequence[float]  # run starts (seconds from the trace start), then the end
    level: Sequence[int]

    @property
    def duration_s(self) -> float:
        return self.t[-1] - self.t[0]

    def at(self, s: float) -> int:
        i = bisect.bisect_right(self.t, s) - 1
        return self.level[min(max(i, 0), len(self.level) - 1)]


FRACTIONAL_CONCURRENCY = (
    "concurrency must be a whole number of requests (running + queued, as SGLang's gauges "
    "count them); an average over time (avg_over_time) is not one: export the gauges' "
    "values at each step"
)


def load_trace(path: str | Path) -> Trace:
    """Read ``t_s,concurrency`` rows; the last row lasts as long as the median row.

    The rows are parsed as the file's bytes are decoded, a few KiB at a time: neither the
    whole text as one str nor every row is held at once, only the bytes and one float
    array each for the times and the levels (the file must be UTF-8 first: checked before
    any row, so a bad byte is found as it was when the whole file was decoded at once)."""
    p = Path(path)
    try:
        data = files.read_regular_file(p, MAX_TRACE_BYTES, follow_symlinks=True)
        _check_utf8(p, data)
    except files.FileReadError as exc:
        too_large = exc.st is not None and exc.st.st_size > MAX_TRACE_BYTES
        raise ReplayError(f"{exc}: {TRACE_TOO_LONG}" if too_large else str(exc)) from None
    if data.startswith(files.UTF8_BOM):
        raise ReplayError(f"{p}: {BOM_PROBLEM}")
    times = array("d")
    levels = array("d")
    # As io.StringIO(text, newline="") split it (lines end at \n, \r or \r\n, kept), but
    # without StringIO's copy of the whole text at 4 bytes a character.
    text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", newline="")
    rows = csv_rows(csv.reader(text), str(p), ReplayError)
    header = [c.strip() for c in next(rows, (1, []))[1]]
    if header[:2] != ["t_s", "concurrency"]:
        raise ReplayError(f"{p}:1: header must be t_s,concurrency")
    for n, row in rows:
        if not row or not "".join(row).strip():
            continue
        if len(row) < 2:
            raise ReplayError(f"{p}:{n}: expected t_s,concurrency")
        try:
            t, c = float(row[0]), float(row[1])
        except ValueError:
            raise ReplayError(f"{p}:{n}: not numbers: {','.join(row)[:60]!r}") from None
        if not (math.isfinite(t) and math.isfinite(c)) or c < 0:
            raise ReplayError(f"{p}:{n}: t_s must be finite, concurrency >= 0")
        if c > MAX_CONCURRENCY:
            raise ReplayError(f"{p}:{n}: concurrency must be at most 2**53, got {c:g}")
        if not c.is_integer():
            # Rounded, an average's 0.45 was no request at all: a replay of nothing that
            # scored specd level with everyone.
            raise ReplayError(f"{p}:{n}: {FRACTIONAL_CONCURRENCY}, got {c:g}")
        if times and t <= times[-1]:
            raise ReplayError(f"{p}:{n}: t_s must increase ({t:g} after {times[-1]:g})")
        times.append(t)
        levels.append(c)
        if len(times) > MAX_TRACE_ROWS:
            raise ReplayError(f"{p}: more than {MAX_TRACE_ROWS} rows: {TRACE_TOO_LONG}")
    if not times:
        raise ReplayError(f"{p}: no rows")
    if not any(levels):
        raise ReplayError(f"{p}: concurrency is 0 in every row: no request to replay")
    del text, data, rows  # the bytes: before the runs are made
    return trace_from_rows(times, levels)


def _check_utf8(path: Path, data: bytes) -> None:
    """FileReadError naming the first byte of ``data`` that is not UTF-8, as decoding it
    whole would, without a str of the whole file."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(data)
    for at in range(0, len(data), _UTF8_CHUNK):
        pending = len(decoder.getstate()[0])  # bytes of a character the last chunk began
        try:
            decoder.decode(view[at : at + _UTF8_CHUNK], final=at + _UTF8_CHUNK >= len(data))
        except UnicodeDecodeError as exc:
            raise files.FileReadError(
                path, f"is not UTF-8 text (byte {at - pending + exc.start})"
            ) from None


def trace_from_rows(times: Sequence[float], levels: Sequence[float]) -> Trace:
    last = _median_gap(times)
    t = array("d")
    level = array("q")
    for s, c in zip(times, levels, strict=True):
        c_int = round(c)
        if not level or level[-1] != c_int:
            t.append(float(s))
            level.append(c_int)
    t.append(float(times[-1]) + last)
    return Trace(t, level)


def _median_gap(times: Sequence[float]) -> float:
    """``sorted(gaps)[len(gaps) // 2]`` of the gaps between consecutive ``times`` (1.0 for
    one row), counting each gap value once while few values recur (a trace of 1-second rows
    has one) instead of sorting a list of every gap; the sort past `_MAX_GAP_VALUES`."""
    if len(times) < 2:
        return 1.0
    half = (len(times) - 1) // 2
    counts: dict[float, int] = {}
    for a, b in itertools.pairwise(times):
        gap = b - a
        counts[gap] = counts.get(gap, 0) + 1
        if len(counts) > _MAX_GAP_VALUES:
            return sorted(b - a for a, b in itertools.pairwise(times))[half]
    seen = 0
    for gap in sorted(counts):
        seen += counts[gap]
        if seen > half:
            return gap
    raise AssertionError("unreachable: the counts add up to every gap")


# -- tokens from the truth --------------------------------------------------------------
def _static_rate(truth: PerfTable, k: int, c: int) -> float:
    return truth.throughput(k, float(c))


# The key `Tokens` files SGLang's adaptive mode under (step counts are >= 0).
ADAPTIVE = -1
# Tokens' keys: a step count (0: off), `ADAPTIVE`, or an adaptive setting specd chose.
Key = int | SpecSetting
# What the simulated server reports as the --speculative-adaptive-config it runs.
ADAPTIVE_CONFIG_DIR = "/var/lib/specd"
# Rates remembered per key, by offered concurrency: a trace rarely has more levels, and one
# that has is counted as well, only slower (the memo starts over when full).
_MAX_RATE_MEMO = 16_384
# `Tokens` keeps each key's prefix sum at every _STRIDE-th run only (half a byte a run a
# key; a list of every run's rate and one of its sum took ~40, most of replay's memory with
# every step count, adaptive set and ceiling it counts) and adds the runs since, one by one
# in the order the sums were made, so to the very same bits: a few µs a call.
_STRIDE = 16
# `_cum`s remembered (a tick asks for the run its segment began in and the run it is in).
_MAX_RECENT = 64


class Tokens:
    """Cumulative tokens served per K over the trace (prefix sums over runs); also, under
    `ADAPTIVE`, by SGLang's adaptive mode when ``adaptive`` is given, and under each
    adaptive setting `ensure` was asked for (`models` holds what it runs). Every adaptive
    setting serves ``adaptive_loss_ratio`` less than the best candidate of each batch's
    slot (`adaptive_rate`).

    Per key only every `_STRIDE`-th prefix sum is kept, in an array; a run's rate is the
    key's rate at the run's level, remembered by level (`run_rate`)."""

    def __init__(
        self,
        trace: Trace,
        truth: PerfTable,
        steps: Sequence[int],
        adaptive: AdaptiveModel | None = None,
        adaptive_loss_ratio: float = 0.0,
    ) -> None:
        if not 0.0 <= adaptive_loss_ratio < 1.0:
            raise ReplayError(f"adaptive loss must be 0..1 (below 1), got {adaptive_loss_ratio!r}")
        self.trace = trace
        self.truth = truth
        self.adaptive_loss_ratio = adaptive_loss_ratio
        self._rate_at: dict[Key, Callable[[int], float]] = {}
        self._memo: dict[Key, dict[int, float]] = {}
        # key → its prefix sums at runs 0, _STRIDE, 2·_STRIDE, ... (`_cum`).
        self.marks: dict[Key, array[float]] = {}
        # (key, ceiling) → the same of the runs with more offered than the ceiling only.
        self._above: dict[tuple[Key, int], array[float]] = {}
        # (key, ceiling, run) → `_cum`, for the ticks of a run: the same runs asked again.
        self._recent: dict[tuple[Key, int | None, int], float] = {}
        self.models: dict[SpecSetting, AdaptiveModel] = {}
        for k in steps:
            self._add(k, functools.partial(_static_rate, truth, k))
        if adaptive is not None:
            self._add(ADAPTIVE, functools.partial(self.adaptive_rate, adaptive))

    def ensure(self, setting: SpecSetting) -> Key:
        """The key ``setting``'s tokens are under, counted from the truth on first use
        (off: the steps-0 row; adaptive: `specd.core.adaptive` over the truth)."""
        if setting.kind != "adaptive":
            k = setting.max_steps
            if k not in self.marks:
                self._add(k, functools.partial(_static_rate, self.truth, k))
            return k
        if setting not in self.marks:
            model = AdaptiveModel.of(adaptive_slots(setting), self.truth)
            self.models[setting] = model
            self._add(setting, functools.partial(self.adaptive_rate, model))
        return setting

    def adaptive_rate(self, model: AdaptiveModel, concurrency: float) -> float:
        """What an adaptive setting serves at ``concurrency`` offered: the best candidate of
        its batch's slot, less ``adaptive_loss_ratio``."""
        return model.throughput(float(concurrency)) * (1.0 - self.adaptive_loss_ratio)

    def _add(self, key: Key, rate_at: Callable[[int], float]) -> None:
        self._rate_at[key] = rate_at
        self._memo[key] = {}
        self.marks[key] = self._prefix(key, None)

    def level_rate(self, key: Key, c: int) -> float:
        """What ``key`` serves at ``c`` offered (0 at none)."""
        memo = self._memo[key]
        rate = memo.get(c)
        if rate is None:
            if len(memo) >= _MAX_RATE_MEMO:
                memo.clear()
            rate = memo[c] = self._rate_at[key](c) if c > 0 else 0.0
        return rate

    def run_rate(self, key: Key, i: int, above: int | None = None) -> float:
        """``key``'s rate in run ``i``; with ``above``, 0 unless more than that is offered."""
        c = self.trace.level[i]
        if above is not None and c <= above:
            return 0.0
        return self.level_rate(key, c)

    def _prefix(self, key: Key, above: int | None) -> array[float]:
        """Tokens served before runs 0, _STRIDE, 2·_STRIDE, ...: prefix sums of each run's
        rate × its seconds (with ``above``, of the runs with more offered than that only)."""
        marks = array("d", [0.0])
        total = 0.0
        level_rate = self.level_rate
        left = _STRIDE
        for (a, b), c in zip(itertools.pairwise(self.trace.t), self.trace.level, strict=True):
            rate = 0.0 if above is not None and c <= above else level_rate(key, c)
            total = total + rate * (b - a)
            left -= 1
            if not left:
                marks.append(total)
                left = _STRIDE
        return marks

    def _cum(self, k: Key, i: int, above: int | None) -> float:
        """Tokens ``k`` served before run ``i`` (with ``above``, only in the runs with more
        offered than that): the mark at or before it, plus the runs since, summed as
        `_prefix` summed them."""
        known = self._recent.get((k, above, i))
        if known is not None:
            return known
        if above is None:
            marks = self.marks[k]
        else:
            found = self._above.get((k, above))
            if found is None:
                found = self._above[(k, above)] = self._prefix(k, above)
            marks = found
        start = i - i % _STRIDE
        total = marks[start // _STRIDE]
        t, level, level_rate = self.trace.t, self.trace.level, self.level_rate
        for r in range(start, i):
            c = level[r]
            rate = 0.0 if above is not None and c <= above else level_rate(k, c)
            total = total + rate * (t[r + 1] - t[r])
        if len(self._recent) >= _MAX_RECENT:
            self._recent.clear()
        self._recent[(k, above, i)] = total
        return total

    def upto(self, k: Key, s: float, above: int | None = None) -> float:
        """Tokens ``k`` serves from the trace's start to ``s``; with ``above``, only in
        the seconds with more offered than that."""
        t = self.trace.t
        s = min(max(s, t[0]), t[-1])
        i = min(bisect.bisect_right(t, s) - 1, len(t) - 2)
        return self._cum(k, i, above) + self.run_rate(k, i, above) * (s - t[i])

    def between(self, k: Key, a: float, b: float, above: int | None = None) -> float:
        return max(0.0, self.upto(k, b, above) - self.upto(k, a, above))


# -- the replay -------------------------------------------------------------------------
@dataclass
class ReplayResult:
    specd_tokens: float
    oracle_tokens: float
    static_tokens: dict[int, float]
    restarts: int
    restarts_outside_windows: int
    days: float
    # (trace second, K) of the start and each change: 0 for off, None for an adaptive set.
    steps_timeline: list[tuple[float, int | None]]
    forecast_mean_error_ratio: float | None
    forecast_median_error_ratio: float | None
    forecast_total_variation: float | None
    epochs: int
    # Wall time of each tick's `step` (preemption on a shared box included).
    decision_ms_mean: float
    decision_ms_p99: float
    decision_ms_max: float
    # The same ticks in this thread's CPU time (`time.thread_time`): what the decision
    # itself costs, whatever else the machine runs.
    decision_cpu_ms_mean: float = 0.0
    decision_cpu_ms_p99: float = 0.0
    decision_cpu_ms_max: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)
    # (unix t, target steps, reason) of every tick replay decided at, from each window's
    # lead-in on: tick for tick the daemon's decisions.
    decisions: list[tuple[float, int | None, str]] = field(default_factory=list)
    restart_s: float = DEFAULT_RESTART_S
    # The share of tokens every adaptive setting served less than the best candidate of
    # each batch's slot (0: that upper bound).
    adaptive_loss_ratio: float = 0.0
    scored_from_s: float = 0.0  # trace seconds
    # What the live K would have served while SGLang restarted (scored span).
    restart_lost_tokens: float = 0.0
    adaptive: AdaptiveResult | None = None
    # The reason of each change in steps_timeline[1:] (the decision that restarted).
    change_reasons: list[str] = field(default_factory=list)
    # How long each of those changes' restart served nothing (restart_s, and an adaptive
    # start's extra CUDA-graph sets).
    change_restart_s: list[float] = field(default_factory=list)
    # What each comparison's restart into its setting at the first window served nothing
    # (0: the start setting, no restart), by step count and by adaptive set.
    static_restart_s: dict[int, float] = field(default_factory=dict)
    adaptive_set_restart_s: dict[str, float] = field(default_factory=dict)
    # steps_timeline with each setting in its operator form ("off", "4", "adaptive:1,3").
    setting_timeline: list[tuple[float, str]] = field(default_factory=list)
    # Tokens of each adaptive set of the config the truth can score, run all along.
    adaptive_set_tokens: dict[str, float] = field(default_factory=dict)
    # Kinds and adaptive sets of the config the truth cannot serve, left out of specd's
    # choices: each with why.
    not_offered: dict[str, str] = field(default_factory=dict)
    # The same comparison from the first window opening a day or more into the scored span
    # on (None: the trace ends first): what specd does once it has seen a day, apart from
    # the cold start, when it knew only the first hours.
    after_first_day: AfterFirstDay | None = None

    @property
    def best_adaptive_set(self) -> str | None:
        """The best single adaptive config in hindsight, of the configured sets."""
        sets = self.adaptive_set_tokens
        return max(sets, key=lambda text: sets[text]) if sets else None

    @property
    def explorations(self) -> list[tuple[float, int]]:
        """(trace second, steps) of each exploration begun in the scored span."""
        # An exploration is of a static step count (never None: adaptive in the timeline).
        return [
            (t, k)
            for (t, k), reason in zip(self.steps_timeline[1:], self.change_reasons, strict=True)
            if reason == Reason.EXPLORE.value and t >= self.scored_from_s and k is not None
        ]

    def explorations_dict(self) -> dict[str, Any]:
        """How often specd explored: in all, per step count, each one, and the most of one
        step count begun in any 7 days (specd allows one)."""
        begun = self.explorations
        per_steps: dict[int, int] = {}
        for _, k in begun:
            per_steps[k] = per_steps.get(k, 0) + 1
        most = max(
            (sum(1 for u, j in begun if j == k and t <= u < t + WEEK_S) for t, k in begun),
            default=0,
        )
        return {
            "count": len(begun),
            "per_steps": {str(k): n for k, n in sorted(per_steps.items())},
            "timeline": [[_seconds(t), k] for t, k in begun],
            "max_per_steps_per_week": most,
        }

    @property
    def adaptive_tokens(self) -> float | None:
        return None if self.adaptive is None else self.adaptive.tokens

    @property
    def best_static_steps(self) -> int:
        return _best_static(self.static_tokens)

    def to_dict(self) -> dict[str, Any]:
        best = self.best_static_steps
        best_tokens = self.static_tokens[best]
        return {
            "specd_tokens": round(self.specd_tokens),
            "oracle_tokens": round(self.oracle_tokens),
            "ratio_to_oracle": _ratio(self.specd_tokens, self.oracle_tokens),
            "static_tokens": {str(k): round(v) for k, v in sorted(self.static_tokens.items())},
            "static_restart_s": {
                str(k): _seconds(v) for k, v in sorted(self.static_restart_s.items())
            },
            "best_static_steps": best,
            "ratio_to_best_static": _ratio(self.specd_tokens, best_tokens),
            "ratio_to_static": {
                str(k): _ratio(self.specd_tokens, v) for k, v in sorted(self.static_tokens.items())
            },
            "adaptive_tokens": None if self.adaptive is None else round(self.adaptive.tokens),
            "ratio_to_adaptive": (
                None if self.adaptive is None else _ratio(self.specd_tokens, self.adaptive.tokens)
            ),
            "adaptive": None if self.adaptive is None else self.adaptive.to_dict(),
            # From the unrounded tokens, rounded once (a rounded ratio less 1 kept its
            # rounding error: 0.012299999999999978). The oracle serves no less than any
            # static K (each epoch's best, no restart); summed epoch by epoch its float total
            # can land ulps under the best's, which must not read as a gap of -0.0 %.
            "oracle_gap_ratio": (
                max(0.0, round(self.oracle_tokens / best_tokens - 1.0, 4))
                if best_tokens > 0
                else 0.0
            ),
            "gap_captured_ratio": (
                None
                if self.oracle_tokens <= best_tokens
                else round(
                    (self.specd_tokens - best_tokens) / (self.oracle_tokens - best_tokens), 4
                )
            ),
            "restarts": self.restarts,
            "restarts_per_day": round(self.restarts / self.days, 3) if self.days > 0 else None,
            "restarts_outside_windows": self.restarts_outside_windows,
            "days": round(self.days, 4),
            "epochs": self.epochs,
            # Each change: [trace second the restart was issued, steps]; the first entry is
            # the start. SGLang serves nothing for change_restart_s[i] after change i.
            "steps_timeline": [[_seconds(t), k] for t, k in self.steps_timeline],
            "change_reasons": list(self.change_reasons),
            "change_restart_s": [_seconds(s) for s in self.change_restart_s],
            # Explorations (changes with reason explore) begun in the scored span.
            "explorations": self.explorations_dict(),
            # [trace second, setting] of the same start and changes.
            "setting_timeline": [[_seconds(t), text] for t, text in self.setting_timeline],
            "kinds_chosen": _kinds_chosen(self.setting_timeline),
            "not_offered": dict(self.not_offered),
            "adaptive_set_tokens": {k: round(v) for k, v in self.adaptive_set_tokens.items()},
            "adaptive_set_restart_s": {
                k: _seconds(v) for k, v in self.adaptive_set_restart_s.items()
            },
            "best_adaptive_set": self.best_adaptive_set,
            "ratio_to_best_adaptive_set": (
                None
                if self.best_adaptive_set is None
                else _ratio(self.specd_tokens, self.adaptive_set_tokens[self.best_adaptive_set])
            ),
            "restart_s": self.restart_s,
            "adaptive_loss_ratio": self.adaptive_loss_ratio,
            "scored_from_s": _seconds(self.scored_from_s),
            "restart_lost_tokens": round(self.restart_lost_tokens),
            "forecast_mean_error_ratio": self.forecast_mean_error_ratio,
            "forecast_median_error_ratio": self.forecast_median_error_ratio,
            "forecast_total_variation": self.forecast_total_variation,
            "decision_ms_mean": round(self.decision_ms_mean, 3),
            "decision_ms_p99": round(self.decision_ms_p99, 3),
            "decision_ms_max": round(self.decision_ms_max, 3),
            "decision_cpu_ms_mean": round(self.decision_cpu_ms_mean, 3),
            "decision_cpu_ms_p99": round(self.decision_cpu_ms_p99, 3),
            "decision_cpu_ms_max": round(self.decision_cpu_ms_max, 3),
            "reasons": dict(sorted(self.reasons.items())),
            "after_first_day": (
                None if self.after_first_day is None else self.after_first_day.to_dict()
            ),
        }


@dataclass(frozen=True)
class AfterFirstDay:
    """specd against the oracle, each static K and SGLang's adaptive mode, all counted
    from ``from_s`` (a window opening a day or more into the scored span) to the end."""

    from_s: float  # trace seconds
    specd_tokens: float
    oracle_tokens: float
    static_tokens: dict[int, float]
    adaptive_tokens: float | None

    def to_dict(self) -> dict[str, Any]:
        best = _best_static(self.static_tokens)
        return {
            "from_s": _seconds(self.from_s),
            "specd_tokens": round(self.specd_tokens),
            "oracle_tokens": round(self.oracle_tokens),
            "ratio_to_oracle": _ratio(self.specd_tokens, self.oracle_tokens),
            "best_static_steps": best,
            "ratio_to_best_static": _ratio(self.specd_tokens, self.static_tokens[best]),
            "ratio_to_adaptive": (
                None
                if self.adaptive_tokens is None
                else _ratio(self.specd_tokens, self.adaptive_tokens)
            ),
        }


def _best_static(tokens_by_steps: Mapping[int, float]) -> int:
    """The step count that served most (a tie to the shallower)."""
    return max(tokens_by_steps, key=lambda k: (tokens_by_steps[k], -k))


def _kinds_chosen(timeline: Sequence[tuple[float, str]]) -> dict[str, int]:
    """How many of the changes went to each kind of setting."""
    counts = {"off": 0, "static": 0, "adaptive": 0}
    for _, text in timeline[1:]:
        counts[parse_setting(text).kind] += 1
    return counts


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b > 0 else 1.0


def _seconds(t: float) -> float | int:
    return int(t) if float(t).is_integer() else round(t, 3)


@dataclass(frozen=True)
class AdaptiveResult:
    """SGLang's adaptive mode over the same trace and truth."""

    slots: Slots
    skipped: tuple[int, ...]  # configured candidates the truth lacks
    capacity: int | None
    tokens: float
    # Share of the scored span with more offered than the adaptive capacity: there the
    # deepest candidate's KV sizing binds.
    above_capacity_ratio: float | None
    # specd against it in those seconds, and in the rest (None without a capacity).
    where_capacity_binds: CapacityPart | None = None
    where_capacity_does_not_bind: CapacityPart | None = None
    # What its restart into the slots at the first window served nothing.
    restart_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "slots": self.slots.to_sglang_config(),
            "candidates_skipped": list(self.skipped),
            "capacity": self.capacity,
            "tokens": round(self.tokens),
            "restart_s": _seconds(self.restart_s),
            "above_capacity_ratio": (
                None if self.above_capacity_ratio is None else round(self.above_capacity_ratio, 4)
            ),
            "where_capacity_binds": (
                None if self.where_capacity_binds is None else self.where_capacity_binds.to_dict()
            ),
            "where_capacity_does_not_bind": (
                None
                if self.where_capacity_does_not_bind is None
                else self.where_capacity_does_not_bind.to_dict()
            ),
        }


@dataclass(frozen=True)
class CapacityPart:
    """specd's and SGLang adaptive's tokens over some of the scored seconds: those with more
    offered than adaptive's capacity (its deepest candidate's KV sizing binds), or the rest."""

    specd_tokens: float
    adaptive_tokens: float

    def to_dict(self) -> dict[str, Any]:
        # No ratio where adaptive served nothing (no such seconds, or only its restart).
        return {
            "specd_tokens": round(self.specd_tokens),
            "adaptive_tokens": round(self.adaptive_tokens),
            "ratio_to_adaptive": (
                _ratio(self.specd_tokens, self.adaptive_tokens)
                if self.adaptive_tokens > 0
                else None
            ),
        }


def _share_above(trace: Trace, ceiling: int | None, a: float, b: float) -> float | None:
    """Share of [a, b] (trace seconds) with offered concurrency above ``ceiling``."""
    if ceiling is None or b <= a:
        return None
    above = 0.0
    for i, level in enumerate(trace.level):
        lo, hi = max(trace.t[i], a), min(trace.t[i + 1], b)
        if hi > lo and level > ceiling:
            above += hi - lo
    return above / (b - a)


def open_intervals(config: Config, start: float, end: float) -> list[tuple[float, float]]:
    """Every maintenance window (opened, closes) overlapping [start, end], by specd's code."""
    out: list[tuple[float, float]] = []
    at = datetime.fromtimestamp(start, timezone.utc)
    current = windows.current_window(config.windows, at)
    if current is not None:
        out.append((current[0].timestamp(), current[1].timestamp()))
        at = current[1]
    while True:
        opened = windows.next_open(config.windows, at)
        if opened.timestamp() > end:  # a window opening at the last tick still counts
            return out
        closes = windows.next_close(config.windows, opened)
        out.append((opened.timestamp(), closes.timestamp()))
        at = closes


class SimulatedServer:
    """SGLang as replay sees it: the trace's offered concurrency served at the live setting
    by the truth table (off: its steps-0 row; adaptive: `specd.core.adaptive` over it); a
    restart serves nothing until it is back.

    The daemon's replay-equivalence test reads the same server through the daemon's real
    loop, so both see the very same observations.
    """

    def __init__(
        self, trace: Trace, truth: PerfTable, tokens: Tokens, t0: float, steps: int | SpecSetting
    ):
        self.trace, self.truth, self.tokens, self.t0 = trace, truth, tokens, t0
        self.setting = _as_setting(steps)
        self.key = tokens.ensure(self.setting)
        self.serving_from = trace.t[0]  # trace seconds; also the counters' zero

    @property
    def steps(self) -> int | None:
        """The static step count live (0: off; None under adaptive mode)."""
        return None if self.setting.kind == "adaptive" else self.setting.max_steps

    def restart(self, steps: int | SpecSetting, s: float, restart_s: float) -> None:
        """A restart to ``steps`` issued at trace second ``s``; back ``restart_s`` later."""
        self.setting = _as_setting(steps)
        self.key = self.tokens.ensure(self.setting)
        self.serving_from = s + restart_s

    def up(self, s: float) -> bool:
        return s >= self.serving_from

    def observe(self, s: float) -> Observation:
        """The observation a scrape at trace second ``s`` returns while SGLang is up."""
        setting, truth = self.setting, self.truth
        offered = self.trace.at(s)
        served = self.tokens.between(self.key, self.serving_from, s)
        config: str | None = None
        if setting.kind == "adaptive":
            model = self.tokens.models[setting]
            # The tier SGLang runs for this batch; capacity is the deepest candidate's.
            k, cap = model.choice(float(offered)), model.capacity
            tok_s = self.tokens.adaptive_rate(model, offered) if offered > 0 else 0.0
            config = f"{ADAPTIVE_CONFIG_DIR}/{adaptive_config_name(setting)}"
        else:
            k, cap = setting.max_steps, truth.capacity(setting.max_steps)
            tok_s = truth.throughput(k, float(offered)) if offered > 0 else 0.0
        running = offered if cap is None else min(offered, cap)
        drafting = k > 0
        return Observation(
            t=self.t0 + s,
            running=running,
            queued=offered - running,
            accept_length=truth.accept_length(k) if drafting else None,
            spec_fresh=offered > 0 and drafting,
            steps=k,
            draft_tokens=k + 1 if drafting else None,
            topk=1 if setting.kind != "off" else None,
            algorithm=REPLAY_TRAITS.algorithm if setting.kind != "off" else None,
            max_running_requests=cap,
            token_usage=None,
            gen_throughput=tok_s,
            generation_tokens_total=served,
            decode_tokens_total=served,
            spec_verify_calls_total=None,
            retracted_total=None,
            version="replay",
            dp_ranks=1,
            launch_command=None,
            adaptive=setting.kind == "adaptive",
            adaptive_config=config,
        )


def _steps_of(setting: SpecSetting) -> int | None:
    """A setting as steps_timeline shows it: K, 0 for off, None for an adaptive set."""
    return None if setting.kind == "adaptive" else setting.max_steps


def truth_offer(
    truth: PerfTable, config: Config
) -> tuple[Config, list[SpecSetting], dict[str, str]]:
    """What the truth can serve: the config with the kinds and sets it cannot left out of
    specd's choices (as a server that cannot run a setting is not offered it), the sets it
    can score, and what was left out, why. Nothing left to choose is an error."""
    choose = config.choose
    have = set(truth.steps())
    left_out: dict[str, str] = {}
    kinds = list(choose.kinds)
    if "off" in kinds and 0 not in have:
        kinds.remove("off")
        left_out["off"] = "the truth has no steps-0 row"
    sets: list[SpecSetting] = []
    kept: list[str] = []
    for text in choose.adaptive_candidate_sets:
        setting = parse_setting(text)
        lacking = sorted(setting.table_steps - have)
        if not lacking:
            sets.append(setting)
            kept.append(text)
        elif "adaptive" in kinds:
            left_out[text] = f"the truth has no steps {','.join(map(str, lacking))}"
    if "adaptive" in kinds and not kept:
        kinds.remove("adaptive")
    if not kinds:
        raise ReplayError(
            f"{truth.source}: the truth can serve none of kinds {list(choose.kinds)}: "
            + "; ".join(f"{what}: {why}" for what, why in left_out.items())
        )
    if left_out:
        narrowed = choose.model_copy(
            update={
                "kinds": tuple(kinds),
                "adaptive_candidate_sets": tuple(kept) or choose.adaptive_candidate_sets,
            }
        )
        config = config.model_copy(update={"choose": narrowed})
    return config, sets, left_out


def _as_setting(steps: int | SpecSetting) -> SpecSetting:
    if isinstance(steps, SpecSetting):
        return steps
    return off() if steps == 0 else static(steps)


def evaluated_spans(
    config: Config, opens: Sequence[tuple[float, float]]
) -> list[tuple[float, float, float]]:
    """(step from, report from, until) per window, in unix time.

    Outside a window nothing can act, so replay runs `step` only from well before each
    window: 2·(stabilization window + tick) ahead, so that from one such span ahead on
    (``report from``) its control state — the recommendations of the last stabilization
    window — and so every decision is exactly the daemon's, which steps at every tick.
    """
    lead = config.choose.stabilization_window_s + config.observe.scrape_interval_s
    return [(a - 2 * lead, a - lead, b) for a, b in opens]


def start_steps(config: Config) -> int:
    """The step count a replay under ``config`` starts at by default: `DEFAULT_START_STEPS`
    clamped to the allowed range."""
    return min(max(DEFAULT_START_STEPS, config.choose.min_steps), config.choose.max_steps)


def replay(
    trace: Trace,
    truth: PerfTable,
    config: Config,
    *,
    start: datetime = DEFAULT_START,
    restart_s: float = DEFAULT_RESTART_S,
    initial_steps: int | None = None,
    warmup_s: float = 0.0,
    calibration: Calibration | None = None,
    adaptive_slots: Slots | None = DEFAULT_SLOTS,
    adaptive_loss_ratio: float = 0.0,
) -> ReplayResult:
    """Replay ``trace`` (seconds from ``start``) under ``config`` against ``truth``.

    The first ``warmup_s`` of the trace are replayed (specd learns and acts) but not
    scored: tokens, restarts and days count from there on, for steady-state comparisons.
    SGLang's adaptive mode with ``adaptive_slots`` is scored beside (None: not; a truth
    with none of the candidates: not either). Every adaptive setting, specd's and SGLang's
    default alike, serves ``adaptive_loss_ratio`` less than the best candidate of each
    batch's slot (its switching, and the KV its extra graphs take: 0 scores that upper
    bound); specd's calibration does not know it, only what specd observes does.
    """
    allowed = list(range(config.choose.min_steps, config.choose.max_steps + 1))
    missing = [k for k in allowed if k not in truth.steps()]
    if missing:
        raise ReplayError(
            f"{truth.source}: truth has no steps {','.join(map(str, missing))} "
            f"(allowed {config.choose.min_steps}-{config.choose.max_steps}; narrow it with --steps)"
        )
    config, sets, left_out = truth_offer(truth, config)
    t0 = start.timestamp()  # absolute time of t_s = 0
    first, last = trace.t[0], trace.t[-1]
    adaptive: AdaptiveModel | None = None
    if adaptive_slots is not None:
        try:
            adaptive = AdaptiveModel.of(adaptive_slots, truth)
        except ValueError:
            adaptive = None  # the truth cannot say what any candidate serves
    tokens = Tokens(trace, truth, allowed, adaptive, adaptive_loss_ratio)
    if warmup_s >= last - first:
        # Nothing would be scored: every figure 0 tokens, every ratio meaningless.
        raise ReplayError(
            f"warmup {warmup_s:g} s leaves nothing to score: the trace spans "
            f"{last - first:g} s (its last row lasting as long as the median one)"
        )

    # What a restart into a setting takes, for specd and for every comparison alike (an
    # adaptive start captures one CUDA-graph set more per candidate; off is none).
    def restart_into_s(key: Key) -> float:
        if isinstance(key, SpecSetting):
            return restart_s + restart_extra_s(key, config)
        if key == ADAPTIVE and adaptive is not None:
            drafting = [c for c in adaptive.configured.candidates() if c > 0]
            return restart_s + adaptive_restart_extra_s(len(drafting), config)
        return restart_s

    opens = open_intervals(config, t0 + first, t0 + last)
    scored_from = min(first + max(warmup_s, 0.0), last)
    set_keys = {format_setting(a): tokens.ensure(a) for a in sets}
    k = initial_steps if initial_steps is not None else start_steps(config)
    if k not in allowed:
        raise ReplayError(
            f"initial steps {k} outside the allowed "
            f"{config.choose.min_steps}-{config.choose.max_steps}"
        )

    if calibration is None and config.choose.calibration_file is not None:
        calibration = read_calibration(config.choose.calibration_file)
    history = History(HistorySettings.from_config(config))
    step_s = config.observe.scrape_interval_s
    server = SimulatedServer(trace, truth, tokens, t0, k)
    control = Control(current_steps=k)
    live = static(k)
    timeline: list[tuple[float, SpecSetting]] = [(first, live)]
    restart_spans: list[float] = []  # how long each change's restart served nothing
    change_reasons: list[str] = []
    segments: list[tuple[Key, float, float]] = []  # (setting, from, to) in trace seconds
    outside = 0
    reasons: dict[str, int] = {}
    decisions: list[tuple[float, int | None, str]] = []
    costs: list[float] = []  # wall ms per decision
    cpu_costs: list[float] = []  # this thread's CPU ms per decision
    # SGLang has been up long enough at the start: no warm-up to exclude.
    history.mark_sglang_start(t0 + first - config.observe.warmup_exclude_s - step_s)
    spans = evaluated_spans(config, opens)
    span_i = 0
    forecasts: dict[int, Forecast] = {}
    n_ticks = int((last - first) // step_s) + 1
    for n in range(n_ticks):
        s = first + n * step_s
        if not server.up(s):
            continue  # SGLang is loading: the scrape fails, nothing is recorded
        t = t0 + s
        obs = server.observe(s)
        history.record(obs)
        while span_i < len(spans) and spans[span_i][2] <= t:
            span_i += 1
        if span_i >= len(spans) or t < spans[span_i][0]:
            continue
        win_open = opens[span_i][0]
        if win_open <= t and span_i not in forecasts:
            # What specd expected of the coming epoch when the window opened, scored
            # against the trace at the end.
            nxt = opens[span_i + 1][0] if span_i + 1 < len(opens) else t0 + last
            made = forecast_epoch(history, opens[span_i][1], nxt)
            if made is not None:
                forecasts[span_i] = made
        # No unit to stop in the simulation: a restart needs just the start, as specd
        # estimates it (the daemon adds the unit's stop timeout).
        context = StepContext(
            config,
            history,
            None,
            control,
            calibration,
            restart_needs_s=config.choose.restart_cost_s,
            traits=REPLAY_TRAITS,
        )
        began, began_cpu = time.perf_counter(), time.thread_time()
        outcome = step(context, obs, t)
        cpu_costs.append((time.thread_time() - began_cpu) * 1000)
        costs.append((time.perf_counter() - began) * 1000)
        control = outcome.control
        decision = outcome.decision
        if t >= spans[span_i][1]:
            decisions.append((t, decision.target_steps, decision.reason.value))
        reasons[decision.reason.value] = reasons.get(decision.reason.value, 0) + 1
        target = decision.target_setting
        if outcome.acts and target is not None:
            if not any(a <= t < b for a, b in opens):
                outside += 1
            segments.append((server.key, server.serving_from, s))
            live = target
            took = restart_into_s(live)
            server.restart(live, s, took)
            # As the daemon: the restart is recorded when SGLang is back, and its warm-up
            # is kept out of the history.
            back = t0 + server.serving_from
            control = control.after_restart(back)
            history.mark_sglang_start(back)
            timeline.append((s, live))
            restart_spans.append(took)
            change_reasons.append(decision.reason.value)
    segments.append((server.key, server.serving_from, last))

    def specd_from(start: float, above: int | None = None) -> float:
        return sum(
            tokens.between(kk, max(a, start), min(b, last), above)
            for kk, a, b in segments
            if min(b, last) > max(a, start)
        )

    specd_tokens = specd_from(scored_from)
    # Before the first window of the scored span no one can choose: every comparison (each
    # static step count, each adaptive set, SGLang's adaptive mode and the oracle) runs what
    # specd ran there, and its own setting from that window's opening on. A comparison
    # whose setting differs restarts into it then and serves nothing meanwhile, as specd
    # does: the same rule for everyone. The oracle, the best fixed K per epoch (window
    # opening to window opening) in hindsight, is charged no restart: it is the bound.
    live_then = tokens.ensure([kk for at, kk in timeline if at <= scored_from][-1])
    bounds = [scored_from]
    bounds += [o - t0 for o, _ in opens if scored_from < o - t0 < last]
    bounds.append(last)
    epochs = list(itertools.pairwise(bounds))
    chooses_first = any(a <= t0 + scored_from < b for a, b in opens)
    fixed_until = scored_from if chooses_first else bounds[1]
    oracle = 0.0
    if epochs and not chooses_first:
        oracle += tokens.between(live_then, *epochs.pop(0))
    # The best fixed K's tokens of each epoch, by the epoch's start.
    epoch_best = {a: max(tokens.between(kk, a, b) for kk in allowed) for a, b in epochs}
    oracle += sum(epoch_best.values())

    def charged_s(key: Key) -> float:
        """What a comparison's restart into ``key`` at the first window serves nothing."""
        return 0.0 if key == live_then else restart_into_s(key)

    def from_first_window(key: Key, above: int | None = None) -> float:
        served_from = fixed_until + charged_s(key)
        return tokens.between(live_then, scored_from, fixed_until, above) + tokens.between(
            key, min(served_from, last), last, above
        )

    static_tokens = {kk: from_first_window(kk) for kk in allowed}
    # Each adaptive set specd may consider, run from the first window on: the best single
    # adaptive config in hindsight is the best of these.
    set_tokens = {text: from_first_window(key) for text, key in set_keys.items()}
    scored_restarts = sum(1 for at, _ in timeline[1:] if at >= scored_from)
    lost = sum(
        tokens.between(tokens.ensure(old), max(at, scored_from), min(at + took, last))
        for ((_, old), (at, _)), took in zip(
            itertools.pairwise(timeline), restart_spans, strict=True
        )
    )
    adaptive_result = None
    if adaptive is not None:
        adaptive_tokens = from_first_window(ADAPTIVE)
        binds = rest = None
        if adaptive.capacity is not None:
            binds = CapacityPart(
                specd_from(scored_from, adaptive.capacity),
                from_first_window(ADAPTIVE, adaptive.capacity),
            )
            rest = CapacityPart(
                specd_tokens - binds.specd_tokens, adaptive_tokens - binds.adaptive_tokens
            )
        adaptive_result = AdaptiveResult(
            slots=adaptive.slots,
            skipped=adaptive.skipped,
            capacity=adaptive.capacity,
            tokens=adaptive_tokens,
            above_capacity_ratio=_share_above(trace, adaptive.capacity, scored_from, last),
            where_capacity_binds=binds,
            where_capacity_does_not_bind=rest,
            restart_s=charged_s(ADAPTIVE),
        )
    # From the first opening a day in on, each comparison runs its own setting already:
    # specd's tokens from then, the oracle's epochs from then, each static K and SGLang's
    # adaptive mode from then (no restart: they made theirs at the first window).
    settled = next((b for b in bounds[1:-1] if b >= scored_from + DAY_S), None)
    after_first_day = None
    if settled is not None:
        after_first_day = AfterFirstDay(
            from_s=settled,
            specd_tokens=specd_from(settled),
            oracle_tokens=sum(best for a, best in epoch_best.items() if a >= settled),
            static_tokens={kk: tokens.between(kk, settled, last) for kk in allowed},
            adaptive_tokens=(None if adaptive is None else tokens.between(ADAPTIVE, settled, last)),
        )
    mean_err, median_err, tv = _forecast_quality(forecasts.values(), trace, t0)
    return ReplayResult(
        specd_tokens=specd_tokens,
        oracle_tokens=oracle,
        static_tokens=static_tokens,
        restarts=scored_restarts,
        restarts_outside_windows=outside,
        days=(last - scored_from) / 86400.0,
        steps_timeline=[(at, _steps_of(setting)) for at, setting in timeline],
        setting_timeline=[(at, format_setting(setting)) for at, setting in timeline],
        adaptive_set_tokens=set_tokens,
        not_offered=left_out,
        forecast_mean_error_ratio=mean_err,
        forecast_median_error_ratio=median_err,
        forecast_total_variation=tv,
        epochs=len(bounds) - 1,
        decision_ms_mean=_mean(costs),
        decision_ms_p99=_p99(costs),
        decision_ms_max=max(costs, default=0.0),
        decision_cpu_ms_mean=_mean(cpu_costs),
        decision_cpu_ms_p99=_p99(cpu_costs),
        decision_cpu_ms_max=max(cpu_costs, default=0.0),
        reasons=reasons,
        decisions=decisions,
        restart_s=restart_s,
        adaptive_loss_ratio=adaptive_loss_ratio,
        scored_from_s=scored_from,
        restart_lost_tokens=lost,
        adaptive=adaptive_result,
        change_reasons=change_reasons,
        change_restart_s=restart_spans,
        static_restart_s={kk: charged_s(kk) for kk in allowed},
        adaptive_set_restart_s={text: charged_s(key) for text, key in set_keys.items()},
        after_first_day=after_first_day,
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _p99(values: Sequence[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))] if values else 0.0


def _forecast_quality(
    forecasts: Iterable[Forecast], trace: Trace, t0: float
) -> tuple[float | None, float | None, float | None]:
    """Mean and median |relative error| of the forecast mean, and the mean total variation
    distance, of the epoch forecasts specd made at each window opening, against what the
    trace then held."""
    errors: list[float] = []
    tvs: list[float] = []
    for forecast in forecasts:
        actual: dict[int, float] = {}
        s, stop = forecast.start - t0, min(forecast.end - t0, trace.t[-1])
        i = max(bisect.bisect_right(trace.t, s) - 1, 0)
        while s < stop and i < len(trace.level):
            seg_end = min(trace.t[i + 1], stop)
            if seg_end > s:
                actual[trace.level[i]] = actual.get(trace.level[i], 0.0) + seg_end - s
            s = max(s, seg_end)
            i += 1
        result = score(forecast, actual)
        if result is not None:
            errors.append(abs(result.mean_error_ratio))
            tvs.append(result.total_variation)
    if not errors:
        return None, None, None
    median = sorted(errors)[len(errors) // 2]
    return (
        round(sum(errors) / len(errors), 4),
        round(median, 4),
        round(sum(tvs) / len(tvs), 4),
    )
