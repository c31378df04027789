"""The performance model and the "model" policy: which step count serves most tokens.

The model predicts aggregate output tok/s at (steps K, offered concurrency c) from

* a calibration table (``specd sweep`` output, the format of ``specd/data/*.csv``), and
* what specd observed while SGLang ran at each K (``History``): throughput per (K, c),
  capacity per K, accept length per K. Observed throughput rescales that K's curve, and
  wins over the calibration as its (decayed, so recent) evidence grows past
  ``OBSERVED_PIVOT_S``.

Acceptance: the live accept length L at the K specd saw is inverted into α
(``L = (1 − α^(K+1)) / (1 − α)``); predictions at every K are scaled by
``L(α_live, K) / L_calibration(K)``, because at a fixed iteration time throughput is
proportional to the tokens each verify step emits (temperature > 0 traffic and long
contexts accept less than a greedy benchmark).

Capacity: above ``max_running_requests(K)`` requests queue. A curve is read as a table is
(`specd.core.perftable.reading_points`): a measured point exactly, linear between, every
point at or past capacity the plateau as measured, flat past the last.

A K the calibration lacks is extrapolated from the nearest measured K: accept length from
α, single-request iteration time ``L/tok_s`` extended linearly from the two nearest measured
K, and capacity from the KV budget ``cap·(K+2)``. Such a K is marked ``extrapolated`` and the
policy discounts it (lower confidence).

The policy (`plan`, registered as ``"model"`` in `specd.core.decide.POLICIES`) forecasts
the offered concurrency of the coming epoch (`specd.core.forecast`), predicts the
tokens each K would serve until the next window opens, charges a change the tokens lost
while SGLang restarts (``restart_cost_s``), and changes only on evidence: the predicted
gain in tokens (net of the restart) must beat the prediction interval of the difference
(`EVIDENCE_Z` standard errors), and the relative gain must beat ``min_gain_ratio`` (0 by
default: the evidence decides). Where the best is not sure to serve more than the live
setting but a lesser one is, the one of those that serves most is chosen: a set whose gain
drowns in its untried tier's interval does not hold back a K measured to serve more. While
most of the epoch's hours were never seen (`Forecast.recent_ratio` above what
``min_forecast_seen_ratio`` allows), the best is the shallowest (`_depth`: most room for
requests) of those the top prediction is not sure to beat and that surely beat the live one
(`_safest`): traffic heavier than the hours seen is what such a guess misses, and a deep K
collapses there. Unless the hours seen show a daily rhythm: then recent traffic says nothing
of the unseen hours, and the best is the static K (or off) whose worst loss is least if
they are like the quietest or the busiest hour seen (`_robust`, minimax regret), the target
only where the live one's worst loss is larger beyond the interval. Each K's relative
standard error comes from the calibration's noise (``calibration_noise_ratio``), shrinks
with the seconds observed at that K (``OBSERVED_PIVOT_S``) in the load bands of the epoch's
traffic (`load_band`: what K did at night says little of the day's load), and grows with how
far an extrapolated K lies from a measured one.
It reads no clock and no file: "now" is the history's last observation, and the calibration
comes in as a `Calibration` value.

Beyond static K (`specd.core.choices` offers what the server runs and [choose] kinds
allows): "off" is predicted from the steps-0 row (never scaled by acceptance, never
extrapolated), an adaptive set as the best candidate of each batch-size slot at the
capacity of its deepest candidate (`specd.core.adaptive` over this model; a set with a
candidate the model cannot read without extrapolating is no candidate), its error the
largest of its candidates', its restart `adaptive_restart_extra_s_per_candidate` longer per
candidate beyond the first. What a set served while it ran here (the history's cells under
its config file's key) corrects its prediction as a K's observation corrects its curve (one
ratio for every load, trusted as those seconds grow) and narrows its error at the loads it
was seen at, as a K's does. Before it runs, what a sweep measured of it (``specd sweep
--adaptive``: the table's rows with its ``setting`` cell) corrects it the same way, as the
calibration: by the ratio of those rows to its candidates' rows at the same concurrencies
(`Calibration.set_factor`), which its own observation then outweighs; not swept, it starts
from what the other sets served here (`PerformanceModel.set_prior`: switching costs every set
on a box alike, as `_box_prior` reads the step counts). Every choice meets the same evidence
gate;
`Plan.predictions` keys them by `specd.core.setting.setting_key` (K, 0 for off, negative
for a set).
"""

from __future__ import annotations

import bisect
import enum
import functools
import math
import operator
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, NamedTuple

from specd.core import windows
from specd.core.acceptance import accept_length_from_alpha
from specd.core.adaptive import AdaptiveModel, Slots
from specd.core.forecast import Forecast, forecast_epoch
from specd.core.perftable import PerfTable, interpolate, reading_points
from specd.core.setting import (
    SpecSetting,
    adaptive_config_name,
    format_setting,
    observed_keys,
    off,
    runs_adaptive_config,
    setting_key,
    static,
)
from specd.core.setting import parse as parse_setting

if TYPE_CHECKING:
    from specd.core.choices import Offer
    from specd.core.history import History
    from specd.core.settings import Settings

# Seconds of (decayed) observation at which observed data and the calibration weigh the
# same; an hour of traffic at one (K, c) outweighs a sweep point.
OBSERVED_PIVOT_S = 600.0
# Fresh acceptance evidence needed before live α replaces the calibration's.
MIN_ACCEPT_EVIDENCE_S = 300.0
# Lower confidence of an extrapolated K: its predicted throughput counts this much less.
EXTRAPOLATION_DISCOUNT_RATIO = 0.10
# Standard errors the predicted gain must clear: about a 95 % one-sided interval.
EVIDENCE_Z = 2.0
# A setting of another kind than the live one loses a tie to every one of the same kind.
MAX_TIE_DISTANCE = 1000


class Source(str, enum.Enum):
    """Where a K's prediction comes from; a log field."""

    CALIBRATION = "calibration"
    OBSERVED = "observed"
    EXTRAPOLATED = "extrapolated"


# -- the model --------------------------------------------------------------------------
class _Curve(NamedTuple):
    """Points of one K's throughput curve, and how to scale them. A tuple: every tick's
    model makes one or two per K (a frozen dataclass's init cost a tenth of the model)."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    capacity: int | None
    scale: float  # acceptance scaling times the observed correction
    source: Source
    # Concurrency is clamped here before reading the points: an extrapolated K reads its
    # neighbour's curve, whose plateau lies at the neighbour's capacity, not its own.
    clamp_at: int | None = None
    evidence_s: float = 0.0  # decayed seconds observed at this K
    distance: int = 0  # K away from the nearest measured K (extrapolated curves)
    # The calibration's reading of (xs, ys) per whole concurrency, before ``scale``
    # (`Calibration.reading`: shared by every tick's model); None: read the points.
    readings: dict[int, float] | None = None


def _read(
    xs: tuple[float, ...],
    ys: tuple[float, ...],
    readings: dict[int, float],
    concurrencies: Collection[int],
) -> list[float]:
    """A calibration curve's reading (before its scale) at each of ``concurrencies``
    (whole), from its ``readings`` (`Calibration.reading`), each one not read yet in the
    run interpolated once and kept there."""
    try:
        # Int keys, most of them small ints (one object each): found by identity.
        return list(map(readings.__getitem__, concurrencies))
    except KeyError:
        for c in concurrencies:
            if c not in readings:
                readings[c] = interpolate(xs, ys, float(c))
        return list(map(readings.__getitem__, concurrencies))


def observed_shrink(evidence_s: float) -> float:
    """What ``evidence_s`` decayed seconds observed leave of a prediction's relative error:
    an hour at ``OBSERVED_PIVOT_S`` = 600 s divides the variance by 7."""
    return math.sqrt(OBSERVED_PIVOT_S / (OBSERVED_PIVOT_S + max(evidence_s, 0.0)))


# Read for every cell observed at every K at every tick: a whole concurrency's band is
# looked up, not computed again.
@functools.lru_cache(maxsize=4096)
def load_band(concurrency: int) -> int:
    """The load band of a whole concurrency (≥ 1): the power of two it lies within a
    factor √2 of, as log2 (1; 2; 3–5; 6–11; 12–22; 23–45; ...), the sweep's doubling
    concurrencies. Observation in one band says how that load serves, not another's."""
    return round(math.log2(concurrency))


def _fit_alpha(measured: Sequence[tuple[int, float]]) -> float:
    """The α whose L(α, K) best fits the measured accept lengths (least relative squares).

    The misfit is convex in α here, so a ternary search finds its minimum.
    """

    def misfit(alpha: float) -> float:
        return sum(((accept_length_from_alpha(alpha, k) - m) / m) ** 2 for k, m in measured)

    lo, hi = 0.0, 1.0
    for _ in range(60):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if misfit(a) <= misfit(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


@dataclass(frozen=True)
class Calibration:
    """A calibration table and the α fitted to its accept lengths, computed once per table
    (the daemon builds one when the file changes, replay once per run)."""

    table: PerfTable
    alpha: float | None
    # Each K's measured (concurrencies, tok/s), in the table's order: the model reads them
    # at every tick, and the table does not change under a Calibration.
    points: Mapping[int, tuple[tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    # A memo of `reading`, a pure function of this (immutable) table: (K, capacity) → the
    # points K's curve is read through and its reading per whole concurrency, filled as
    # ticks read them. Every tick's model reads the same few curves at the same bins.
    _readings: dict[
        tuple[int, int | None],
        tuple[tuple[float, ...], tuple[float, ...], dict[int, float]],
    ] = field(default_factory=dict, compare=False, repr=False, hash=False)
    # A memo of `set_factor` per adaptive setting (pure, as `_readings`).
    _set_factors: dict[SpecSetting, float | None] = field(
        default_factory=dict, compare=False, repr=False, hash=False
    )

    def reading(
        self, k: int, capacity: int | None
    ) -> tuple[tuple[float, ...], tuple[float, ...], dict[int, float]]:
        """`_shape` of K at ``capacity``, and a dict of `interpolate` over those points
        per whole concurrency (filled by the readers: `PerformanceModel._raw`, `_read`)."""
        key = (k, capacity)
        found = self._readings.get(key)
        if found is None:
            xs, ys = _shape(self, k, capacity)
            found = self._readings[key] = (xs, ys, {})
        return found

    def set_factor(self, setting: SpecSetting) -> float | None:
        """What a sweep measured of the adaptive ``setting`` (the table's rows with its
        ``setting`` cell, `PerfTable.setting_rows`) over what its candidates' rows in the same
        table predict at those concurrencies (each batch at the best of its slot,
        `AdaptiveModel`): SGLang's switching and its extra CUDA graphs' KV, which no step
        count's row shows. One ratio for every load, as a set's observation is read
        (`PerformanceModel.observed_set`). At most 1: the best candidate of each batch is all
        a set can serve, so a swept row above it is the sweep's noise. None: the table has
        no row of it, or cannot predict it from its candidates' rows."""
        try:
            return self._set_factors[setting]
        except KeyError:
            pass
        found: float | None = None
        # The same set however written: one config file (``adaptive:1,3`` and its default
        # slots spelled out run alike), as the history keys it.
        name = adaptive_config_name(setting)
        rows = [
            r
            for r in self.table.setting_rows
            if r.setting is not None and adaptive_config_name(parse_setting(r.setting)) == name
        ]
        if rows:
            try:
                composed: AdaptiveModel | None = AdaptiveModel.of(
                    adaptive_slots(setting), self.table
                )
            except ValueError:
                composed = None
            if composed is not None and not composed.skipped:
                measured = predicted = 0.0
                for r in rows:
                    rate = composed.throughput(r.concurrency)
                    if rate > 0:  # where its rows predict nothing, a swept row says nothing
                        measured += r.output_tok_s
                        predicted += rate
                if predicted > 0:
                    found = min(measured / predicted, 1.0)
        self._set_factors[setting] = found
        return found

    @classmethod
    def of(cls, table: PerfTable) -> Calibration:
        measured = [
            (k, length)
            for k in table.steps()
            if k >= 1 and (length := table.accept_length(k)) is not None and 1.0 <= length <= k + 1
        ]
        points: dict[int, tuple[tuple[float, ...], tuple[float, ...]]] = {}
        for k in table.steps():
            rows = [r for r in table.rows if r.steps == k]
            points[k] = (
                tuple(r.concurrency for r in rows),
                tuple(r.output_tok_s for r in rows),
            )
        return cls(table, _fit_alpha(measured) if measured else None, points)


def _shape(
    cal: Calibration, k: int, capacity: int | None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """K's calibration points, read as the table reads them with ``capacity`` (observed
    capacity wins over the table's): measured points as measured, every point at or past
    capacity the plateau, flat past capacity when measured only below it."""
    xs, ys = cal.points.get(k, ((), ()))
    return reading_points(xs, ys, capacity)


class LiveAcceptance(NamedTuple):
    """What specd measured of this box's acceptance (`live_acceptance`)."""

    alpha: float | None  # the α every step count's sweep row is scaled by; None: the sweep's
    measured_s: float  # seconds of accept lengths measured, undecayed
    lengths: tuple[tuple[int, float, float], ...]  # per K: (K, mean accept length, seconds)


def live_acceptance(history: History | None) -> LiveAcceptance:
    """Evidence-weighted α over the K specd observed (recent K weigh most), once
    `MIN_ACCEPT_EVIDENCE_S` of it was measured, however long ago: while an adaptive set or
    speculation off runs, SGLang reports no accept length of a step count, and this box's
    acceptance, even days old, is newer than the calibration's."""
    if history is None:
        return LiveAcceptance(None, 0.0, ())
    total = weighted = measured = 0.0
    lengths: list[tuple[int, float, float]] = []
    for k in range(1, 17):
        seconds = history.accept_seconds(k)
        if seconds <= 0:
            continue
        a, length = history.alpha(k), history.accept_length(k)
        if a is not None and length is not None:
            total += seconds
            weighted += seconds * a
            seen = history.accept_seen_s(k)
            measured += seen
            lengths.append((k, length, seen))
    alpha = weighted / total if measured >= MIN_ACCEPT_EVIDENCE_S else None
    return LiveAcceptance(alpha, measured, tuple(lengths))


class PerformanceModel:
    """Predicted aggregate output tok/s per (steps, offered concurrency)."""

    def __init__(
        self, calibration: Calibration | PerfTable | None, history: History | None = None
    ) -> None:
        fitted = Calibration.of(calibration) if isinstance(calibration, PerfTable) else calibration
        self.calibration = fitted.table if fitted is not None else None
        self._fitted = fitted
        calibration = self.calibration
        cal_steps = [k for k in calibration.steps() if k >= 1] if calibration else []
        self._cal_steps = cal_steps
        # Steps 0 (no speculation) is a row of its own: never scaled by acceptance, never
        # extrapolated from the speculative rows.
        self._off_row = calibration is not None and 0 in calibration.steps()
        observed: dict[int, dict[int, tuple[float, float]]] = {}
        observed_sets: dict[int, dict[int, tuple[float, float]]] = {}
        capacities: dict[int, int] = {}
        if history is not None:
            # The table's cells grouped by K once per tick (`History.throughput_by_key`, the
            # same cells in the same order as `throughput_table`'s, concurrency > 0).
            for k, cells in history.throughput_by_key().items():
                kept = {c: cell for c, cell in cells.items() if cell[1] > 0}
                if kept:
                    # An adaptive set's cells are under its config file's key (negative).
                    (observed if k >= 0 else observed_sets)[k] = kept
            capacities = {k: v for k, v in history.capacities.items() if v > 0}
        self._observed = observed
        self._observed_sets = observed_sets
        self._alpha_cal = fitted.alpha if fitted is not None else None
        self.alpha_live = live_acceptance(history).alpha
        self._curves: dict[int, _Curve] = {}
        self._capacities = capacities
        # Per K: whole concurrency → predicted tok/s (this model's `throughput`).
        self._values: dict[int, dict[int, float]] = {}
        # Per (K, mix): predicted tok/s at each of the mix's levels (`levels`).
        self._levels: dict[tuple[int, Mix], list[float]] = {}
        # Per K: decayed seconds observed per load band (`error_at`).
        self._bands: dict[int, dict[int, float]] = {}
        self._steps: list[int] | None = None
        # Per adaptive setting: its AdaptiveModel's fields but the table (`adaptive`).
        self._adaptive: dict[
            SpecSetting, tuple[Slots, Slots, tuple[int, ...], int | None] | None
        ] = {}
        self._box: dict[int, tuple[_Curve, tuple[float, float, float]]] | None = None
        # Per adaptive setting: `_set_sums`.
        self._set_memo: dict[SpecSetting, tuple[float, float, float, dict[int, float]]] = {}

    # -- acceptance --------------------------------------------------------------------
    def _cal_accept_length(self, k: int) -> float | None:
        # From the α fitted over all the calibration's K: one noisy measurement at one K
        # would otherwise skew that K's scaling. A calibration without accept lengths is
        # taken to have accepted like the live traffic.
        alpha = self._alpha_cal if self._alpha_cal is not None else self.alpha_live
        return None if alpha is None else accept_length_from_alpha(alpha, k)

    def accept_length(self, steps: int) -> float | None:
        """Predicted live accept length at ``steps``."""
        alpha = self.alpha_live if self.alpha_live is not None else self._alpha_cal
        return None if alpha is None else accept_length_from_alpha(alpha, steps)

    def _acceptance_scale(self, k: int) -> float:
        cal_length = self._cal_accept_length(k)
        live = None if self.alpha_live is None else accept_length_from_alpha(self.alpha_live, k)
        if cal_length is None or live is None or cal_length <= 0:
            return 1.0
        return live / cal_length

    # -- curves ------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The K this model can predict without extrapolating (0: speculation off)."""
        if self._steps is None:
            self._steps = sorted(
                set(self._cal_steps) | set(self._observed) | ({0} if self._off_row else set())
            )
        return list(self._steps)

    def can_predict(self, steps: int) -> bool:
        return self._curve(steps) is not None

    def source(self, steps: int) -> Source | None:
        curve = self._curve(steps)
        return None if curve is None else curve.source

    def relative_error(self, steps: int, noise_ratio: float) -> float:
        """Relative standard error of ``steps``' prediction.

        The calibration's noise, shrunk as observation at this K outweighs it (an hour
        observed at ``OBSERVED_PIVOT_S`` = 600 s divides the variance by 7), and an
        extrapolated K adds the discount per K of distance from its nearest measured K.
        """
        curve = self._curve(steps)
        if curve is None:
            raise ValueError(f"no calibration or observation to predict steps {steps}")
        error = self.prior_error(noise_ratio) * observed_shrink(curve.evidence_s)
        return error + EXTRAPOLATION_DISCOUNT_RATIO * curve.distance

    def prior_error(self, noise_ratio: float) -> float:
        """A prediction's relative error before observation: the calibration's noise, at
        least 5 % where only observation predicts (no calibration)."""
        return noise_ratio if self.calibration is not None else max(noise_ratio, 0.05)

    def error_at(self, steps: int, noise_ratio: float, mix: Mix) -> tuple[float, float]:
        """``steps``' relative standard error over ``mix``, and the seconds observed that it
        counts: `relative_error`, with the observation at each of the mix's levels only
        what was observed at ``steps`` in that level's load band (`load_band`), each level
        weighted by its share of the tokens predicted. What a step count did at night says
        little of how a day's load serves there: its correction is shared by every load,
        its error is not."""
        curve = self._curve(steps)
        if curve is None:
            raise ValueError(f"no calibration or observation to predict steps {steps}")
        base = self.prior_error(noise_ratio)
        extrapolation = EXTRAPOLATION_DISCOUNT_RATIO * curve.distance
        seconds = self._band_seconds(steps)
        if not seconds:
            return base + extrapolation, 0.0  # never observed: nothing shrinks it
        weights = list(map(operator.mul, mix.shares, self.levels(steps, mix)))
        weight = sum(weights, 0.0)
        if weight <= 0:
            return self.relative_error(steps, noise_ratio), curve.evidence_s
        shrinks = {band: observed_shrink(s) for band, s in seconds.items()}
        by_level = [shrinks.get(band, 1.0) for band in mix.bands]
        shrink = sum(map(operator.mul, weights, by_level), 0.0) / weight
        # The seconds observed at one load that would shrink the error as much.
        evidence = OBSERVED_PIVOT_S / (shrink * shrink) - OBSERVED_PIVOT_S
        return base * shrink + extrapolation, evidence

    def _band_seconds(self, steps: int) -> dict[int, float]:
        """Decayed seconds observed at ``steps`` per load band (once per model)."""
        found = self._bands.get(steps)
        if found is None:
            found = {}
            for c, (_, w) in self._observed.get(steps, {}).items():
                band = load_band(c)
                found[band] = found.get(band, 0.0) + w
            self._bands[steps] = found
        return found

    def evidence_s(self, steps: int) -> float:
        """Decayed seconds of throughput observed at ``steps`` (0 when it cannot be predicted)."""
        curve = self._curve(steps)
        return 0.0 if curve is None else curve.evidence_s

    def capacity(self, steps: int) -> int | None:
        curve = self._curve(steps)
        return None if curve is None else curve.capacity

    def _curve(self, k: int) -> _Curve | None:
        if k in self._curves:
            return self._curves[k]
        curve = self._build_curve(k)
        if curve is not None:
            self._curves[k] = curve
        return curve

    def _shape(self, k: int, capacity: int | None) -> tuple[tuple[float, ...], tuple[float, ...]]:
        assert self._fitted is not None, "only a model with a calibration reads its points"
        xs, ys, _ = self._fitted.reading(k, capacity)
        return xs, ys

    def _calibration_curve(self, k: int, capacity: int | None, scale: float) -> _Curve:
        """K's calibration curve at ``capacity``, read through the calibration's memo."""
        assert self._fitted is not None, "only a model with a calibration reads its points"
        xs, ys, readings = self._fitted.reading(k, capacity)
        return _Curve(xs, ys, capacity, scale, Source.CALIBRATION, readings=readings)

    def _build_curve(self, k: int) -> _Curve | None:
        if k < 0:
            return None
        cal = self.calibration
        observed = self._observed.get(k, {})
        if k == 0 and cal is not None and self._off_row:
            capacity = self._capacities.get(0, cal.capacity(0))
            off_curve = self._calibration_curve(0, capacity, 1.0)
            return self._corrected(off_curve, self._observed_sums(off_curve, observed), prior=1.0)
        if cal is not None and k in self._cal_steps:
            prior = self._box_prior(k)
            # An observed K's curve and sums were made for the box already: the same values.
            boxed = self._box_sums().get(k)
            if boxed is not None:
                return self._corrected(boxed[0], boxed[1], prior=prior)
            capacity = self._capacities.get(k, cal.capacity(k))
            base = self._calibration_curve(k, capacity, self._acceptance_scale(k))
            return self._corrected(base, self._observed_sums(base, observed), prior=prior)
        if observed:
            points = sorted(observed.items())
            capacity = self._capacities.get(k)
            xs, ys = reading_points(
                [float(c) for c, _ in points], [v for _, (v, _) in points], capacity
            )
            seen = sum(w for _, (_, w) in points)
            return _Curve(xs, ys, capacity, 1.0, Source.OBSERVED, evidence_s=seen)
        if k == 0:
            return None  # without drafting the speculative rows say nothing about it
        return self._extrapolated(k)

    @staticmethod
    def _observed_sums(
        base: _Curve, observed: Mapping[int, tuple[float, float]]
    ) -> tuple[float, float, float]:
        """(tokens observed, tokens ``base`` predicts, seconds) at the concurrencies seen:
        the totals are exact (counter deltas), whereas single bins are not — a scrape
        interval's tokens are filed under the concurrency at its end, so across level
        changes low bins read high and high bins low."""
        if not observed:
            return 0.0, 0.0, 0.0
        readings, scale = base.readings, base.scale
        if readings is not None and base.clamp_at is None:
            # By `map`, not a loop per cell: the model sums two K's cells at every tick.
            predicted_at = list(map(scale.__mul__, _read(base.xs, base.ys, readings, observed)))
        else:
            predicted_at = [PerformanceModel._raw(base, float(c)) for c in observed]
        rates, seconds = zip(*observed.values(), strict=True)
        if min(predicted_at) <= 0:
            # Where the curve predicts nothing the cell says nothing of it: left out.
            kept = [i for i, p in enumerate(predicted_at) if p > 0]
            rates = tuple(rates[i] for i in kept)
            seconds = tuple(seconds[i] for i in kept)
            predicted_at = [predicted_at[i] for i in kept]
        return (
            sum(map(operator.mul, seconds, rates), 0.0),
            sum(map(operator.mul, seconds, predicted_at), 0.0),
            sum(seconds, 0.0),
        )

    def _box_sums(self) -> dict[int, tuple[_Curve, tuple[float, float, float]]]:
        """Every calibrated speculative K observed: its calibration curve and its
        `_observed_sums`, once per model (`_box_prior` reads the sums of all, and
        `_build_curve` corrects each one's curve by its own)."""
        if self._box is None:
            box: dict[int, tuple[_Curve, tuple[float, float, float]]] = {}
            for k, observed in self._observed.items():
                if k >= 1 and k in self._cal_steps and observed and self.calibration is not None:
                    capacity = self._capacities.get(k, self.calibration.capacity(k))
                    base = self._calibration_curve(k, capacity, self._acceptance_scale(k))
                    box[k] = (base, self._observed_sums(base, observed))
            self._box = box
        return self._box

    def _box_prior(self, k: int) -> float:
        """What every other step count observed says of this box against the calibration:
        each one's correction (its observed tokens over its predicted ones, shrunk toward 1
        while its evidence is thin), and of those the one nearest 1 when all lean the same
        way, else 1. A box off from its calibration (its clocks, its prompts, a sweep that
        stopped short of its load) is off for every K alike, so a K not yet observed starts
        from that; a correction the others do not share is that K's own (a sweep point off,
        an oversold K) and lends nothing."""
        return _shared(sums for j, (_, sums) in self._box_sums().items() if j != k)

    @staticmethod
    def _corrected(base: _Curve, sums: tuple[float, float, float], *, prior: float) -> _Curve:
        """Scale a calibration curve by how observed throughput compared with it: one ratio
        per K, of all tokens observed to all predicted at the concurrencies seen (``sums``:
        `_observed_sums` of ``base``), shrunk toward ``prior`` (`_box_prior`) while evidence
        is thin."""
        seen, predicted, weight = sums
        if predicted <= 0:
            if prior == 1.0:
                return base
            # `dataclasses.replace(base, scale=...)`, built directly: once per curve per tick.
            return _Curve(
                base.xs,
                base.ys,
                base.capacity,
                base.scale * prior,
                base.source,
                base.clamp_at,
                base.evidence_s,
                base.distance,
                base.readings,
            )
        trust = weight / (weight + OBSERVED_PIVOT_S)
        ratio = prior + (seen / predicted - prior) * trust
        source = Source.OBSERVED if trust >= 0.5 else base.source
        return _Curve(
            base.xs,
            base.ys,
            base.capacity,
            base.scale * ratio,
            source,
            base.clamp_at,
            evidence_s=weight,
            distance=base.distance,
            readings=base.readings,
        )

    def _extrapolated(self, k: int) -> _Curve | None:
        """A K the calibration lacks, from its nearest measured neighbours."""
        cal = self.calibration
        known = [s for s in self._cal_steps if cal is not None and cal.throughput(s, 1.0) > 0]
        if cal is None or len(known) < 2:
            return None
        near = sorted(known, key=lambda s: (abs(s - k), s))[:2]
        ka, kb = near
        la, lb = self._cal_accept_length(ka), self._cal_accept_length(kb)
        lk = self._cal_accept_length(k)
        if la is None or lb is None or lk is None:
            return None
        # Single-request iteration time: tokens per step / tokens per second.
        ta = la / cal.throughput(ka, 1.0)
        tb = lb / cal.throughput(kb, 1.0)
        slope = max(0.0, (ta - tb) / (ka - kb))
        tk = ta + slope * (k - ka)
        if tk <= 0:
            return None
        factor = (lk / la) * (ta / tk)
        cap_a = self._capacities.get(ka, cal.capacity(ka))
        # KV cache per request grows with K + 2 (the seed's inference); each known capacity
        # is floored, so the largest cap·(K + 2) is the best bound on the budget.
        budgets = [
            c * (s + 2)
            for s in known
            if (c := self._capacities.get(s, cal.capacity(s))) is not None
        ]
        capacity = max(1, math.floor(max(budgets) / (k + 2))) if budgets else None
        xs, ys_a = self._shape(ka, cap_a)
        ys = tuple(y * factor for y in ys_a)
        base = _Curve(
            xs,
            ys,
            capacity,
            self._acceptance_scale(k),
            Source.EXTRAPOLATED,
            capacity,
            distance=abs(k - ka),
        )
        sums = self._observed_sums(base, self._observed.get(k, {}))
        return self._corrected(base, sums, prior=self._box_prior(k))

    @staticmethod
    def _raw(curve: _Curve, c: float) -> float:
        c = float(c)
        if curve.clamp_at is not None:
            c = min(c, float(curve.clamp_at))
        readings = curve.readings
        if readings is None or not c.is_integer():
            return interpolate(curve.xs, curve.ys, c) * curve.scale
        # The calibration's points do not change: their reading at c is read once per run.
        value = readings.get(int(c))
        if value is None:
            value = readings[int(c)] = interpolate(curve.xs, curve.ys, c)
        return value * curve.scale

    def throughput(self, steps: int, concurrency: float) -> float:
        """Predicted aggregate output tok/s; ValueError if ``steps`` cannot be predicted."""
        if not math.isfinite(concurrency) or concurrency < 0:
            raise ValueError(f"concurrency must be a finite number >= 0, got {concurrency!r}")
        if concurrency == 0:
            return 0.0
        c_bin = round(concurrency)
        if c_bin == concurrency:
            cached = self._values.get(steps, {}).get(c_bin)
            if cached is not None:
                return cached
        curve = self._curve(steps)
        if curve is None:
            raise ValueError(f"no calibration or observation to predict steps {steps}")
        value = self._raw(curve, concurrency)
        if c_bin == concurrency:
            self._values.setdefault(steps, {})[c_bin] = value
        return value

    def levels(self, steps: int, mix: Mix) -> list[float]:
        """Predicted tok/s of ``steps`` at each of ``mix``'s levels, in their order (once per
        model and mix: the static candidates and the adaptive sets' tiers read the same)."""
        key = (steps, mix)
        found = self._levels.get(key)
        if found is not None:
            return found
        curve = self._curve(steps)
        if curve is None:
            raise ValueError(f"no calibration or observation to predict steps {steps}")
        readings = curve.readings
        if readings is not None and curve.clamp_at is None:
            # By `map`, not a loop per level: this runs for every candidate at every tick.
            raw = _read(curve.xs, curve.ys, readings, mix.levels)
            found = list(map(curve.scale.__mul__, raw))
        else:
            found = [self._raw(curve, float(c)) for c in mix.levels]
        self._levels[key] = found
        return found

    def rate(self, steps: int, mix: Mix) -> float:
        """Mean tok/s over a distribution of offered concurrency (shares sum to 1)."""
        return sum(map(operator.mul, mix.shares, self.levels(steps, mix)), 0.0)

    def adaptive(self, setting: SpecSetting) -> AdaptiveModel | None:
        """``setting``'s candidate sets over this model (once per model); None when the
        model has none of its candidates."""
        # One lookup when kept: a setting's hash is a Python call (a frozen dataclass's).
        try:
            kept = self._adaptive[setting]
        except KeyError:
            try:
                found = AdaptiveModel.of(adaptive_slots(setting), self)
            except ValueError:
                self._adaptive[setting] = None
                return None
            self._adaptive[setting] = (found.configured, found.slots, found.skipped, found.capacity)
            return found
        if kept is None:
            return None
        # Kept without the model it reads: an AdaptiveModel in the model's own memo would
        # make a reference cycle, and every tick's model (curves, memos) would then wait
        # for the garbage collector, whose runs inside ticks made the decision's p99.
        configured, slots, skipped, capacity = kept
        return AdaptiveModel(configured, slots, self, skipped, capacity)

    def swept_set(self, setting: SpecSetting) -> float | None:
        """The calibration's correction of the adaptive ``setting`` from its swept rows
        (`Calibration.set_factor`); None: not swept."""
        return None if self._fitted is None else self._fitted.set_factor(setting)

    def _set_sums(self, setting: SpecSetting) -> tuple[float, float, float, dict[int, float]]:
        """What the adaptive ``setting`` served here against what its candidates' curves
        predict at the same concurrencies (each batch at the best of its slot), once per
        model: (tokens seen, tokens predicted, decayed seconds, seconds per load band), all
        0 when never observed or not predictable."""
        found = self._set_memo.get(setting)
        if found is not None:
            return found
        seen = predicted = weight = 0.0
        bands: dict[int, float] = {}
        am = self.adaptive(setting)
        if am is not None:
            for key in observed_keys(setting):
                for c, (tok_s, w) in self._observed_sets.get(key, {}).items():
                    rate = am.throughput(float(c))
                    if rate <= 0:
                        continue  # where it predicts nothing a cell says nothing of it
                    seen += w * tok_s
                    predicted += w * rate
                    weight += w
                    band = load_band(c)
                    bands[band] = bands.get(band, 0.0) + w
        found = self._set_memo[setting] = (seen, predicted, weight, bands)
        return found

    def set_prior(self, setting: SpecSetting, others: Sequence[SpecSetting] = ()) -> float:
        """What ``setting`` is predicted to serve of its candidates' rows before it has run
        here: what a sweep measured of it (`swept_set`); else what the sets of ``others``
        served here, read as `_box_prior` reads the other step counts — each one's ratio
        (trusted as its seconds grow), and of those the one nearest 1 when all lean the
        same way, else 1. SGLang's switching costs every set on a box alike; a shortfall
        the others do not share is that set's own and lends nothing."""
        swept = self.swept_set(setting)
        if swept is not None:
            return swept
        return _shared(self._set_sums(other)[:3] for other in others if other != setting)

    def set_served(self, setting: SpecSetting) -> tuple[float, float] | None:
        """What the adaptive ``setting`` served here over what its candidates' curves
        predict at the same concurrencies (each batch at the best of its slot), and the
        decayed seconds behind it; None: never observed, or not predictable."""
        seen, predicted, weight, _ = self._set_sums(setting)
        if weight <= 0 or predicted <= 0:
            return None
        return seen / predicted, weight

    def observed_set(
        self, setting: SpecSetting, mix: Mix, others: Sequence[SpecSetting] = ()
    ) -> tuple[float, float, float] | None:
        """What the adaptive ``setting`` served while it ran on this box, read as a step
        count's observation is (`_corrected`, `error_at`): (the factor that corrects its
        prediction — its tokens observed over those its candidates' curves predict at the
        same concurrencies, each batch at the best of its slot, trusted as its seconds grow
        past `OBSERVED_PIVOT_S` over its prior (`set_prior` with ``others``) —, the
        decayed seconds observed, and the seconds of those that count at ``mix``'s load,
        weighted by load band). One correction for every load, as a step count's: per
        band, a set's would stand against a step count's that is not, and every noisy band
        would tip the choice between the two (a bench day/night case flapped so). None:
        never observed, or not predictable."""
        seen, predicted, weight, bands = self._set_sums(setting)
        if weight <= 0 or predicted <= 0:
            return None
        am = self.adaptive(setting)
        assert am is not None  # observed and predicted: `_set_sums` read it
        prior = self.set_prior(setting, others)
        factor = prior + (seen / predicted - prior) * weight / (weight + OBSERVED_PIVOT_S)
        levels = zip(mix.levels, mix.shares, strict=True)
        by_level = [share * am.throughput(float(c)) for c, share in levels]
        total = sum(by_level, 0.0)
        if total <= 0:
            return factor, weight, 0.0
        shrink = 0.0
        for w, band in zip(by_level, mix.bands, strict=True):
            shrink += w * observed_shrink(bands.get(band, 0.0))
        shrink /= total
        return factor, weight, OBSERVED_PIVOT_S / (shrink * shrink) - OBSERVED_PIVOT_S

    def slots_rate(self, slots: Slots, mix: Mix) -> float:
        """Mean tok/s over ``mix`` (batches: fold it at the capacity first) with each batch
        at the best candidate of its slot (`AdaptiveModel.throughput`): per slot, the
        levels it routes (SGLang's `Slots.slot_for`: a batch below the first threshold
        runs in the first slot), each at the most any of its candidates serves there."""
        levels = mix.levels
        best: list[float] = []
        start = 0
        tiers = slots.slots
        for i, slot in enumerate(tiers):
            end = (
                bisect.bisect_left(levels, tiers[i + 1].min_batch)
                if i + 1 < len(tiers)
                else len(levels)
            )
            if end > start:
                rows = [self.levels(k, mix)[start:end] for k in slot.candidates]
                best += rows[0] if len(rows) == 1 else map(max, *rows)
            start = end
        return sum(map(operator.mul, mix.shares, best), 0.0)

    def saturation(self, steps: Sequence[int]) -> int | None:
        """The concurrency beyond which none of ``steps`` serves more (all queue)."""
        caps = [self.capacity(k) for k in steps]
        if not caps or any(c is None for c in caps):
            return None
        return max(c for c in caps if c is not None)


def _shared(sums: Iterable[tuple[float, float, float]]) -> float:
    """What several observations lend one not yet made (`_box_prior`, `set_prior`): of
    each one's (tokens seen, tokens predicted, seconds), its correction shrunk toward 1
    while its seconds are few; of those, the one nearest 1 when all lean the same way, else
    1 (a correction the others do not share is that one's own)."""
    shared: float | None = None
    for seen, predicted, weight in sums:
        if predicted <= 0:
            continue
        lean = (seen / predicted - 1.0) * weight / (weight + OBSERVED_PIVOT_S)
        if shared is None:
            shared = lean
        elif lean * shared <= 0:
            return 1.0
        elif abs(lean) < abs(shared):
            shared = lean
    return 1.0 if shared is None else 1.0 + shared


@dataclass(frozen=True, eq=False)
class Mix:
    """A distribution of offered concurrency as the model reads it: the whole concurrencies
    above 0 ascending (``levels``) and each one's share. Compared and hashed by identity:
    a model keeps each candidate's predictions per mix (`PerformanceModel.levels`)."""

    levels: tuple[int, ...]
    shares: tuple[float, ...]
    # `folded` per ceiling: the adaptive sets that share their deepest K fold alike.
    _folds: dict[int, Mix] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def bands(self) -> tuple[int, ...]:
        """Each level's `load_band`, in order (once per mix)."""
        return tuple(map(load_band, self.levels))

    @classmethod
    def of(cls, weights: Mapping[int, float]) -> Mix:
        """From ``{concurrency: share}`` (concurrency 0 and below serve nothing: left out)."""
        levels = sorted(c for c in weights if c > 0)
        return cls(tuple(levels), tuple(weights[c] for c in levels))

    def folded(self, ceiling: int | None) -> Mix:
        """Concurrency above ``ceiling`` only queues: count it at the ceiling (fewer levels,
        the same total)."""
        levels = self.levels
        if ceiling is None or not levels or levels[-1] <= ceiling:
            return self
        found = self._folds.get(ceiling)
        if found is None:
            cut = bisect.bisect_right(levels, ceiling)
            shares = self.shares
            above = math.fsum(shares[cut:])
            if ceiling < 1:
                found = Mix((), ())
            elif cut and levels[cut - 1] == ceiling:
                found = Mix(levels[:cut], (*shares[: cut - 1], shares[cut - 1] + above))
            else:
                found = Mix((*levels[:cut], ceiling), (*shares[:cut], above))
            self._folds[ceiling] = found
        return found


# -- the policy -------------------------------------------------------------------------
class StepPrediction(NamedTuple):
    """One setting's prediction for the epoch. A tuple: a dozen are made at every tick,
    and a frozen dataclass's init (a call per field) was a few percent of a decision."""

    # The setting's key (`specd.core.setting.setting_key`): K for static K, 0 for off, a
    # negative number for an adaptive set (``Plan.settings`` has it).
    steps: int
    tok_s: float  # mean predicted output tok/s over the epoch
    source: Source
    # Predicted tokens until the next window opens, net of a restart (if it changes K)
    # and of the discount of an extrapolated K.
    tokens: float
    error_ratio: float = 0.0  # relative standard error of tok_s
    # Decayed seconds observed at this step count on this box at the epoch's load (the
    # seconds at one load that narrow its error as much: `PerformanceModel.error_at`).
    evidence_s: float = 0.0

    @property
    def interval(self) -> tuple[float, float]:
        """The prediction interval of tok_s (± `EVIDENCE_Z` standard errors)."""
        half = EVIDENCE_Z * self.error_ratio * self.tok_s
        return max(self.tok_s - half, 0.0), self.tok_s + half


@dataclass(frozen=True)
class Plan:
    """What the model policy predicted, for the decision, the metric and the log line."""

    now: float
    until: float  # when the next window opens: the end of the chosen setting's reign
    forecast: Forecast
    predictions: dict[int, StepPrediction]
    best: int
    target: int
    gain_ratio: float  # predicted tokens of ``best`` over those of ``current``, minus 1
    why: str
    # Predicted extra tokens of ``best`` over ``current`` and the half-width of its
    # interval; a change needs gain_tokens > margin_tokens.
    gain_tokens: float = 0.0
    margin_tokens: float = 0.0
    # The keys of ``predictions`` that are not a static K: off (0) and adaptive sets.
    settings: Mapping[int, SpecSetting] = field(default_factory=dict)
    # The model it predicted with (built once per tick; the outcome check reads it too):
    # a means to the prediction, not part of it, so equal plans compare equal.
    model: PerformanceModel | None = field(default=None, compare=False, repr=False)
    # Set where the epoch's hours were mostly never seen and a daily rhythm shows: each
    # static K's (and off's) worst loss across the hours seen (`_robust`), by which the
    # best and the target were chosen instead.
    robust_regrets: Mapping[int, float] | None = None

    def setting_of(self, key: int) -> SpecSetting:
        return self.settings.get(key) or static(key)

    @property
    def target_setting(self) -> SpecSetting:
        return self.setting_of(self.target)

    def static_only(self, current: int) -> Plan:
        """This plan over static step counts alone, the live setting ``current`` held (a K,
        or an adaptive set's key): its best static K (or ``current``) and that one's
        evidence against ``current``. Where an adaptive set or off was best yet not sure to
        serve more, the static K that may still be worth measuring is this plan's best."""
        predictions = {k: p for k, p in self.predictions.items() if k >= 1 or k == current}
        if self.best in predictions:
            return replace(self, predictions=predictions)
        best = max(predictions, key=_preference(predictions, current))
        gain = gain_tokens = margin = 0.0
        if best != current:
            gain, gain_tokens, margin, _ = _evidence(
                predictions[best], predictions[current], None, current
            )
        return replace(
            self,
            predictions=predictions,
            best=best,
            gain_ratio=gain,
            gain_tokens=gain_tokens,
            margin_tokens=margin,
        )


# `_next_epoch` trusts a kept epoch this far before the opening that ends it: a unix time
# read as a datetime rounds to the microsecond.
_EPOCH_EDGE_S = 1e-3


@dataclass
class _Epoch:
    """The last epoch `_next_epoch` found, and for which times it holds: from then until
    the next window opens when none was open (no window opens in between, so
    `windows.next_close` reads the same window), or until the open one closes."""

    since: float = math.inf
    until: float = -math.inf
    epoch: tuple[float, float] = (0.0, 0.0)


@functools.lru_cache(maxsize=64)  # one per configured windows, as windows._holder
def _epoch_holder(configured: tuple[windows.WindowLike, ...]) -> _Epoch:
    return _Epoch()


def _next_epoch(config: Settings, now: float) -> tuple[float, float] | None:
    """(next window close, the following window open) as unix times; None without one."""
    configured = tuple(config.windows)
    held = _epoch_holder(configured)
    if held.since <= now < held.until:
        return held.epoch
    at = datetime.fromtimestamp(now, timezone.utc)
    try:
        # `windows.next_close`, with the opening it reads kept when no window is open.
        current = windows.current_window(config.windows, at)
        opening = None
        if current is None:
            opening = windows.next_open(config.windows, at)
            current = windows.current_window(config.windows, opening)
        assert current is not None  # next_open returns an opening, which is inside a window
        close = current[1]
        opens = windows.next_open_kept(configured, close)
    except ValueError:
        return None
    epoch = close.timestamp(), opens.timestamp()
    if opening is not None:
        held.since, held.until, held.epoch = now, opening.timestamp() - _EPOCH_EDGE_S, epoch
    elif close - at < windows.LOOKBACK:
        # Open: until it closes every time lies in the same chain of windows, which closes
        # then (followed to its end here: not cut at LOOKBACK).
        held.since, held.until, held.epoch = now, close.timestamp() - _EPOCH_EDGE_S, epoch
    return epoch


@functools.lru_cache(maxsize=256)  # pure, keyed by the frozen setting: read at every tick
def adaptive_slots(setting: SpecSetting) -> Slots:
    """An adaptive setting's slots as `specd.core.adaptive` models them (no slots: one
    candidate list for every batch size, as SGLang reads a config with one slot "1")."""
    if setting.kind != "adaptive":
        raise ValueError(f"setting {format_setting(setting)} is not adaptive")
    return Slots.of(dict(setting.slots) if setting.slots else {1: setting.candidates})


def adaptive_restart_extra_s(candidates: int, config: Settings) -> float:
    """What an adaptive start with ``candidates`` drafting step counts takes beyond a static
    one: one CUDA-graph set more to capture per candidate beyond the first."""
    return config.choose.adaptive_restart_extra_s_per_candidate * max(candidates - 1, 0)


def restart_extra_s(setting: SpecSetting, config: Settings) -> float:
    """What a restart into ``setting`` takes beyond a static one (0 unless adaptive)."""
    if setting.kind != "adaptive":
        return 0.0
    return adaptive_restart_extra_s(len(setting.candidates), config)


def restart_cost_s(setting: SpecSetting, config: Settings) -> float:
    """Serving time a restart into ``setting`` loses."""
    return config.choose.restart_cost_s + restart_extra_s(setting, config)


def _adaptive_rate(
    model: PerformanceModel, setting: SpecSetting, mix: Mix
) -> tuple[float, tuple[int, ...]] | None:
    """Mean tok/s of an adaptive setting over ``mix`` (the best candidate of each batch's
    slot at the deepest candidate's capacity, `specd.core.adaptive`) and the step counts it
    reads; None when the model cannot predict every candidate."""
    am = model.adaptive(setting)
    if am is None or am.skipped:
        return None
    # Past the deepest candidate's capacity every batch is the same: one level (exact). So
    # each level is the batch itself, read in its slot as `AdaptiveModel.throughput` does.
    rate = model.slots_rate(am.slots, mix.folded(am.capacity))
    return rate, am.slots.candidate_steps


def covers(setting: SpecSetting | None, current: int | None) -> bool:
    """Whether the adaptive ``setting`` runs the static K ``current`` in every slot and at
    its capacity (K is its deepest candidate: every request's KV is sized for K, as under
    K): at every batch it then runs K or a candidate the model predicts to serve more."""
    if setting is None or setting.kind != "adaptive" or current is None or current < 1:
        return False
    slots = adaptive_slots(setting)
    return max(slots.candidate_steps) == current and all(
        current in slot.candidates for slot in slots.slots
    )


def _evidence(
    new: StepPrediction, held: StepPrediction, setting: SpecSetting | None, current: int
) -> tuple[float, float, float, bool]:
    """A change from ``held`` to ``new``: (relative gain, extra tokens, the interval's
    half-width, whether ``new`` is an adaptive set covering the live K)."""
    gain = new.tokens / held.tokens - 1.0 if held.tokens > 0 else math.inf
    margin = EVIDENCE_Z * math.hypot(new.error_ratio * new.tokens, held.error_ratio * held.tokens)
    return gain, new.tokens - held.tokens, margin, covers(setting, current)


def _beats(
    gain: float, gain_tokens: float, margin: float, covering: bool, config: Settings
) -> bool:
    """Whether a change's evidence is enough: its extra tokens beyond the interval (a set
    that covers the live K serves at least what K serves at every batch: it can lose only
    its restart, which the point prediction is net of, so it needs only a gain) and its
    gain beyond ``min_gain_ratio``."""
    return gain_tokens > (0.0 if covering else margin) and gain > config.choose.min_gain_ratio


def _depth(key: int, settings: Mapping[int, SpecSetting]) -> int:
    """Draft tokens a request's KV is sized for: a static K's K, a set's deepest candidate,
    0 for off. The shallower, the more requests fit."""
    setting = settings.get(key)
    return key if setting is None else setting.max_steps


def _safest(
    predictions: Mapping[int, StepPrediction],
    settings: Mapping[int, SpecSetting],
    best: int,
    current: int | None,
    config: Settings,
) -> int:
    """Of the settings ``best`` is not sure to serve more than (within the prediction
    interval, as any change is judged) and that are sure to serve more than the live one
    (a change to them is warranted), the shallowest: where the evidence cannot tell them
    apart, the one with most room for requests loses least if the traffic is heavier than
    forecast. ``best`` when it is the live setting, or not sure to serve more than it: the
    plan keeps the live one then."""

    def sure(new: int, old: int) -> bool:
        evidence = _evidence(predictions[new], predictions[old], settings.get(new), old)
        return _beats(*evidence, config)

    if current == best:
        return best
    live = current if current is not None and current in predictions else None
    if live is not None and not sure(best, live):
        return best
    near = [
        k
        for k in predictions
        if k == best or (not sure(best, k) and (live is None or sure(k, live)))
    ]
    return min(near, key=lambda k: (_depth(k, settings), -predictions[k].tokens))


class _Robust(NamedTuple):
    key: int
    # Each static K's (and off's) largest relative loss, across `Forecast.scenarios`,
    # against the best of them there.
    regrets: dict[int, float]


def _robust(
    model: PerformanceModel,
    forecast: Forecast,
    predictions: Mapping[int, StepPrediction],
    ceiling: int | None,
    current: int | None,
) -> _Robust | None:
    """Where most of the epoch's hours were never seen and the hours seen show a daily
    rhythm, what they hold is unknown: any of the hours seen may be what they are like.
    The static K (or off) whose worst loss across the quietest and the busiest of them
    (`Forecast.scenarios`) is least, ties to the shallowest: minimax regret, the bet that
    loses least whichever way the day goes. None without scenarios. Adaptive sets are
    left out: what a set serves is known only from its tiers' rows, a shaky base for a bet
    on unseen hours."""
    keys = [k for k in predictions if k >= 0 and predictions[k].tok_s > 0]
    if not forecast.scenarios or not keys:
        return None
    # What a prediction's tokens make of its rate: the time it serves, net of a restart
    # and of an extrapolation's discount.
    serving = {k: predictions[k].tokens / predictions[k].tok_s for k in keys}
    regrets = dict.fromkeys(keys, 0.0)
    for _, weights in forecast.scenarios:
        mix = Mix.of(weights).folded(ceiling)
        tokens = {k: model.rate(k, mix) * serving[k] for k in keys}
        most = max(tokens.values())
        if most <= 0:
            continue  # an idle hour: no setting serves more than another
        for k in keys:
            regrets[k] = max(regrets[k], (most - tokens[k]) / most)
    # Ties (within rounding) to the live one, then to the most room for requests.
    key = min(keys, key=lambda k: (round(regrets[k], 9), k != current, k))
    return _Robust(key, regrets)


def _robust_why(
    forecast: Forecast,
    robust: _Robust,
    best: int,
    target: int,
    current: int | None,
    gain: float,
    labels: Mapping[int, str],
) -> str:
    hours = " and ".join(f"{hour:02d}:00" for hour, _ in forecast.scenarios)
    losses = " ".join(
        f"{labels[k]}:{robust.regrets[k] * 100:.1f}%" for k in sorted(robust.regrets, key=_order)
    )
    head = (
        f"; {forecast.recent_ratio * 100:.0f}% of the epoch in hours of the day never seen, "
        f"while the hours seen show a daily rhythm: worst loss if those are like the hour "
        f"seen at {hours} (UTC) {losses}"
    )
    if current is None or best == current:
        return f"{head}; {labels[best]} loses least"
    gain_text = f"{gain * 100:.1f} points"
    if target == current:
        return (
            f"{head}; {labels[best]} loses least, {gain_text} less than {labels[current]}, "
            f"within the prediction interval: keeping {labels[current]}"
        )
    return f"{head}; {labels[best]} loses least, {gain_text} less than {labels[current]}"


def _preference(
    predictions: Mapping[int, StepPrediction], current: int | None
) -> Callable[[int], tuple[float, int]]:
    """The order of choices, best last: most tokens, ties to the nearest the live one."""
    return lambda k: (predictions[k].tokens, -_distance(k, current))


def _distance(key: int, current: int | None) -> int:
    """Ties go to the setting nearest the live one: the same kind, the nearer K."""
    if current is None or key == current:
        return 0
    if key >= 0 and current >= 0:
        return abs(key - current)
    return MAX_TIE_DISTANCE


def plan(
    history: History,
    config: Settings,
    current: int | None,
    calibration: Calibration | None = None,
    avoid: Callable[[Mapping[int, float]], Mapping[int, str]] | None = None,
    *,
    offer: Offer | None = None,
    live_adaptive_config: str | None = None,
) -> Plan | None:
    """The model policy's full prediction; None without data to predict from.

    ``current`` is the static K live (0: off); under SGLang's adaptive mode it is None and
    ``live_adaptive_config`` names the config file it runs. ``offer`` (`specd.core.choices`)
    is what may be chosen; without one, static K in min_steps..max_steps. ``avoid``, given
    the forecast's concurrency mix, names the step counts to leave out of the candidates
    (`specd.core.outcome`; the live one always stays in), and why."""
    now = history.last_t
    if now is None:
        return None
    epoch = _next_epoch(config, now)
    if epoch is None:
        return None
    epoch_start, until_t = epoch
    forecast = forecast_epoch(history, epoch_start, until_t)
    if forecast is None:
        return None
    model = PerformanceModel(calibration, history)
    offered = (
        offer.settings
        if offer is not None
        else tuple(static(k) for k in range(config.choose.min_steps, config.choose.max_steps + 1))
    )
    if live_adaptive_config is not None:
        current = next(
            (
                setting_key(s)
                for s in offered
                if s.kind == "adaptive" and runs_adaptive_config(s, live_adaptive_config)
            ),
            None,
        )
    # An avoided adaptive set is skipped by its key (negative), off by its (0), as a step
    # count is.
    skipped = {
        k: why
        for k, why in (avoid(forecast.weights) if avoid is not None else {}).items()
        if k != current and (k <= 0 or config.choose.min_steps <= k <= config.choose.max_steps)
    }
    candidates = [
        s.max_steps
        for s in offered
        if s.kind != "adaptive" and model.can_predict(s.max_steps) and s.max_steps not in skipped
    ]
    # Every set offered, avoided or not, says what switching costs on this box (`set_prior`).
    sets = [s for s in offered if s.kind == "adaptive"]
    adaptives = [s for s in sets if setting_key(s) not in skipped]
    settings: dict[int, SpecSetting] = {0: off()} if 0 in candidates else {}
    reads = {
        k for s in adaptives for k in adaptive_slots(s).candidate_steps if model.can_predict(k)
    }
    if not candidates and not adaptives:
        return None
    horizon = max(until_t - now, 0.0)
    predictions: dict[int, StepPrediction] = {}
    ceiling = model.saturation(sorted({*candidates, *reads}))
    mix = Mix.of(forecast.weights).folded(ceiling)
    noise = config.choose.calibration_noise_ratio
    # Per K read, once a tick: (source, relative error, evidence) — the adaptive sets share
    # their tiers with each other and with the static candidates.
    facts: dict[int, tuple[Source | None, float, float]] = {}
    for k in candidates:
        known = model.source(k)
        source = known or Source.EXTRAPOLATED
        tok_s = model.rate(k, mix)
        trusted = (
            tok_s * (1 - EXTRAPOLATION_DISCOUNT_RATIO) if source is Source.EXTRAPOLATED else tok_s
        )
        # Off and static K restart alike (`restart_cost_s`: only an adaptive start is longer).
        cost = config.choose.restart_cost_s
        serving = horizon if k == current else max(horizon - cost, 0.0)
        error, evidence = model.error_at(k, noise, mix)
        facts[k] = (known, error, evidence)
        predictions[k] = StepPrediction(k, tok_s, source, trusted * serving, error, evidence)
    # Each set predicted off its rows before it has run here, and why (said in the message).
    priors: list[str] = []
    for setting in adaptives:
        predicted = _adaptive_rate(model, setting, mix)
        if predicted is None:
            continue
        tok_s, steps = predicted
        key = setting_key(setting)
        tiers = []
        for k in steps:
            fact = facts.get(k)
            if fact is None:
                fact = facts[k] = (model.source(k), *model.error_at(k, noise, mix))
            tiers.append(fact)
        observed = all(fact[0] is Source.OBSERVED for fact in tiers)
        error = max(fact[1] for fact in tiers)
        # Its tiers are static Ks' rows: it is as well known as its least observed tier...
        evidence = min(fact[2] for fact in tiers)
        own = model.observed_set(setting, mix, sets)
        if own is not None:
            # ...or as what it served itself while it ran here, which corrects it as a step
            # count's observation corrects its curve (over its prior, below).
            factor, seconds, counted = own
            tok_s *= factor
            observed = observed or seconds >= OBSERVED_PIVOT_S
            if counted > evidence:
                error = min(error, model.prior_error(noise) * observed_shrink(counted))
                evidence = counted
        else:
            # Not run here: what a sweep measured of it, else what the other sets served
            # here, corrects its rows (its error stays its tiers').
            prior = model.set_prior(setting, sets)
            tok_s *= prior
            if prior != 1.0:
                swept = model.swept_set(setting) is not None
                priors.append(
                    f"{format_setting(setting)} ×{prior:.3f} "
                    + ("(swept)" if swept else "(as the other sets served here)")
                )
        source = Source.OBSERVED if observed else Source.CALIBRATION
        serving = horizon if key == current else max(horizon - restart_cost_s(setting, config), 0.0)
        predictions[key] = StepPrediction(key, tok_s, source, tok_s * serving, error, evidence)
        settings[key] = setting
    if not predictions:
        return None
    keys = list(predictions)
    preference = _preference(predictions, current)
    best = max(keys, key=preference)
    top = best
    unseen = forecast.recent_ratio > 1.0 - config.choose.min_forecast_seen_ratio + 1e-9
    robust = _robust(model, forecast, predictions, ceiling, current) if unseen else None
    if robust is not None and current is not None and current not in robust.regrets:
        # The live setting has no worst case to weigh against (an adaptive set, whose rows
        # are its tiers'): no bet on unseen hours away from it, the hold stands.
        robust = None
    if unseen and robust is None:
        best = _safest(predictions, settings, best, current, config)
    target, gain, gain_tokens, margin = best, 0.0, 0.0, 0.0
    covering = False
    runner_up: tuple[int, float] | None = None
    if robust is not None:
        best = top = target = robust.key
        if current is not None and current in robust.regrets and best != current:
            # The live setting's worst case against the robust one's, beyond their interval.
            held = predictions[current]
            gain = robust.regrets[current] - robust.regrets[best]
            spread = EVIDENCE_Z * math.hypot(predictions[best].error_ratio, held.error_ratio)
            gain_tokens, margin = gain * held.tokens, spread * held.tokens
            if not _beats(gain, gain_tokens, margin, False, config):
                target = current
    elif current is not None and current in predictions and best != current:
        held = predictions[current]
        gain, gain_tokens, margin, covering = _evidence(
            predictions[best], held, settings.get(best), current
        )
        if not _beats(gain, gain_tokens, margin, covering, config):
            target = current
            # The best is not sure to serve more than the live one, but a lesser choice may
            # be: take the one that serves most of those that are (beyond their interval).
            for k in sorted(keys, key=preference, reverse=True):
                if k in (best, current) or predictions[k].tokens <= held.tokens:
                    continue
                change = _evidence(predictions[k], held, settings.get(k), current)
                if _beats(*change, config):
                    target, runner_up = k, (k, change[0])
                    break
    elif current is not None and current not in predictions:
        gain = math.inf
    labels = {k: (format_setting(settings[k]) if k in settings else str(k)) for k in predictions}
    why = _why(
        forecast, predictions, now, until_t, best, target, current, gain, margin, config, labels
    )
    if robust is not None:
        why = _why_head(forecast, predictions, now, until_t, labels) + _robust_why(
            forecast, robust, best, target, current, gain, labels
        )
    if priors:
        why += "; of their candidates' rows, before they run here: " + ", ".join(priors)
    if top != best:
        why += (
            f"; {labels[top]} predicted most, {labels[best]} not surely less and with more "
            "room for requests"
        )
    if runner_up is not None:
        k, up = runner_up
        up_text = "∞" if math.isinf(up) else f"{up * 100:+.1f}%"
        why += f"; {labels[k]} serves {up_text} beyond its interval: {current} → {labels[k]}"
    if covering and target == best != current:
        why += (
            f"; {labels[best]} runs {current} at {current}'s capacity where {current} serves "
            f"most: it can lose only its restart"
        )
    if skipped:
        why += "; avoiding " + "; ".join(why_k for _, why_k in sorted(skipped.items()))
    return Plan(
        now,
        until_t,
        forecast,
        predictions,
        best,
        target,
        gain,
        why,
        gain_tokens,
        margin,
        settings,
        model,
        robust.regrets if robust is not None else None,
    )


def _why(
    forecast: Forecast,
    predictions: Mapping[int, StepPrediction],
    now: float,
    until: float,
    best: int,
    target: int,
    current: int | None,
    gain: float,
    margin: float,
    config: Settings,
    labels: Mapping[int, str],
) -> str:
    head = _why_head(forecast, predictions, now, until, labels)
    if predictions[best].source is Source.EXTRAPOLATED:
        head += f" (~ extrapolated, counted {EXTRAPOLATION_DISCOUNT_RATIO * 100:g}% lower)"
    shown = labels[best]
    if current is None or best == current:
        return f"{head}; {shown} best"
    gain_text = "∞" if math.isinf(gain) else f"{gain * 100:+.1f}%"
    held = predictions.get(current) if current is not None else None
    extra = predictions[best].tokens - held.tokens if held is not None else math.inf
    evidence = "" if math.isinf(extra) else f" ({extra:.0f} tokens, interval ±{margin:.0f})"
    if target != best:
        floor = config.choose.min_gain_ratio
        # Kept, or a lesser choice that is sure to serve more (`plan` says which).
        kept = f": keeping {labels[current]}" if target == current else ""
        if extra <= margin:
            return (
                f"{head}; {shown} best by {gain_text}{evidence} net of the restart, "
                f"within the prediction interval{kept}"
            )
        return (
            f"{head}; {shown} best by {gain_text}{evidence} net of the restart, below "
            f"min_gain_ratio {floor * 100:g}%{kept}"
        )
    return f"{head}; {shown} best by {gain_text}{evidence} net of the restart"


def _why_head(
    forecast: Forecast,
    predictions: Mapping[int, StepPrediction],
    now: float,
    until: float,
    labels: Mapping[int, str],
) -> str:
    rates = " ".join(
        f"{labels[k]}:{p.tok_s:.0f}±{p.tok_s * p.error_ratio * EVIDENCE_Z:.0f}"
        f"{'~' if p.source is Source.EXTRAPOLATED else ''}"
        for k, p in sorted(predictions.items(), key=lambda kp: _order(kp[0]))
    )
    return (
        # The epoch decided for ends when the window after it opens: outside a window,
        # the window after the next.
        f"model: epoch to the window opening in {(until - now) / 3600:.1f} h, forecast mean "
        f"offered {forecast.mean():.1f} ({forecast.source}), predicted tok/s {rates}"
    )


def _order(key: int) -> tuple[int, int]:
    """Static K ascending, then off, then adaptive sets (in the order they were keyed)."""
    return (0, key) if key > 0 else (1, 0) if key == 0 else (2, 0)
