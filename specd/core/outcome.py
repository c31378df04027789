"""Verify each change by its outcome: did the new step count serve more than the old one?

The model policy changes on a prediction; this module checks it against what happened.
At a change (`Reason.CHANGE`), `snapshot` keeps the history's throughput cells of the new
step count as they were at that moment (`ChangeSnapshot`, carried in ``Control``). At every
tick after it, `verdict` subtracts that snapshot — decayed by the history's own half-life,
so both sums decay alike — from the current cells: what remains is what the new step
count served *since the change*, per offered concurrency. It is compared, weighted by the
time seen at each concurrency, with what the old step count serves at the same
concurrencies: its own observed mean there (from the history), blended with the model's
prediction as that bin's evidence is thin (`specd.core.model.OBSERVED_PIVOT_S`).

The model predicted the change for its epoch (until the next window opens), so that is what
is verified: the snapshot lapses when the window at the end of that epoch closes
(``ChangeSnapshot.until``); a regression found by then goes back in that window. Later
traffic is the policy's to judge again, not this change's outcome. What was predicted is
kept too, per load band of the forecast (``ChangeSnapshot.predicted``: the model's ratio
of the new setting to the old, and the band's share of the epoch): a change made for a busy
day may be predicted to serve less at night, and serving less there is what it was made
expecting.

A regression is a shortfall beyond noise: the old step count's baseline exceeds what the
new one served by more than ``regression_min_ratio`` and than the prediction interval of
the difference (`EVIDENCE_Z` standard errors; each side's relative error is the
calibration's noise shrunk by the seconds observed, as in
`PerformanceModel.relative_error`), once the new step count has been observed for
``outcome_min_observed_s`` busy seconds since the change; and, where the change was
predicted at the traffic seen, the ratio over its epoch (its load bands seen since as
served there, the rest as predicted) is a loss by as much: half an hour of night traffic
says nothing of the day's bands. `step` puts the regressed step count on an avoid list at
once (`Avoided`): the policies skip it for ``regression_avoid_s`` unless the traffic they
expect moved far from the mix it regressed under (the total variation distance of the
concurrency mix beyond ``regression_lift_mix_ratio``). While the traffic the policy
expects is that close, `decide` goes back at the next window (`Reason.REGRESSION`, under
the usual window, dwell and budget rules; a pin or a freeze wins), or in the window the
change was made in while it is open and the shortfall is against the prediction (the
dwell does not hold that); for other traffic (the night's batch jobs after a day's
change) the policy decides.

Every kind of setting is verified alike: ``from_steps``/``to_steps`` are setting keys
(`specd.core.setting.setting_key`: K, 0 for off, negative for an adaptive set), and an
adaptive set's cells are the history's under its config file's key
(`specd.core.setting.observed_keys`), whatever tier `sglang:spec_num_steps` shows; the
old adaptive set's prediction is the model's (`specd.core.adaptive.AdaptiveModel`).

Pure: no hidden state besides the snapshot and the avoid list, both values; time is the
history's or ``now``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from specd.core import windows
from specd.core.adaptive import AdaptiveModel
from specd.core.history import DecayingSums, check_time, concurrency_bin, max_weight_s
from specd.core.model import (
    EVIDENCE_Z,
    OBSERVED_PIVOT_S,
    Calibration,
    PerformanceModel,
    adaptive_slots,
    load_band,
    observed_shrink,
)
from specd.core.observation import MAX_RUNNING_REQUESTS, MAX_STEPS, MAX_TOKENS_PER_S
from specd.core.setting import (
    SpecSetting,
    format_setting,
    observed_keys,
    parse,
    runs_adaptive_config,
    setting_key,
)
from specd.core.text import utc_time

if TYPE_CHECKING:
    from specd.core.history import History
    from specd.core.settings import Settings

# Less than this (seconds of decayed weight) at a concurrency since the change is nothing.
_MIN_CELL_S = 1e-6
# Mix entries below this share are not kept in the avoid list (bounded state).
_MIN_MIX_SHARE = 1e-3
# A change's prediction: the load bands kept (a band per doubling of concurrency; bands 24
# and up, 12 million requests offered, are within what specd accepts but past any server's
# and are left out), and the largest ratio one can be.
MAX_PREDICTED_BANDS = 24
MAX_PREDICTED_RATIO = 1e3


def _keys(key: int, setting: SpecSetting | None) -> tuple[int, ...]:
    """The history keys of the setting ``key`` (``setting``: the adaptive set it is)."""
    return observed_keys(setting) if setting is not None else (key,)


def label(key: int, setting: SpecSetting | None) -> str:
    """A setting key's operator form: an adaptive set's key is a hash, not a name."""
    return format_setting(setting) if setting is not None else ("off" if key == 0 else str(key))


def _adaptive(setting: SpecSetting | None) -> SpecSetting | None:
    return setting if setting is not None and setting.kind == "adaptive" else None


@functools.lru_cache(maxsize=64)  # the change verified, named at every tick
def _stamp(t: float) -> str:
    return utc_time(t)


@dataclass(frozen=True)
class ChangeSnapshot:
    """A change specd made, and the new step count's throughput cells at that moment.

    ``cells``: (offered concurrency, decayed seconds, decayed seconds × tok/s), as of ``t``
    (the history's `DecayingSums` cells of ``to_steps``, scaled to ``t``).
    """

    t: float
    from_steps: int
    to_steps: int
    cells: tuple[tuple[int, float, float], ...] = ()
    # What the policy predicted the change would gain (tok/s of to over from, minus 1).
    predicted_gain_ratio: float | None = None
    # When the verification lapses (`verification_end`); None: never.
    until: float | None = None
    # The adaptive sets of from_steps / to_steps (their setting keys); None: static K or off.
    from_setting: SpecSetting | None = None
    to_setting: SpecSetting | None = None
    # What the policy predicted to_steps serves relative to from_steps, per load band of the
    # traffic it forecast: (band, ratio, share of the epoch) (`predicted_bands`); empty: not
    # predicted.
    predicted: tuple[tuple[int, float, float], ...] = ()

    def lapsed(self, now: float) -> bool:
        return self.until is not None and now >= self.until


@dataclass(frozen=True)
class Avoided:
    """A step count that served less than the one before it: the policies skip it."""

    steps: int
    t: float  # when specd went back
    # Share of busy time per offered concurrency it regressed under (sums to ~1).
    mix: tuple[tuple[int, float], ...]
    shortfall_ratio: float  # how much less it served than the old step count
    from_steps: int  # the step count it was compared with
    # The adaptive set ``steps`` keys (None: a static K or off), for naming it.
    setting: SpecSetting | None = None
    from_setting: SpecSetting | None = None

    @property
    def name(self) -> str:
        """The avoided setting's operator form ("4", "off", "adaptive:3,4")."""
        return label(self.steps, self.setting)

    @property
    def from_name(self) -> str:
        return label(self.from_steps, self.from_setting)


@dataclass(frozen=True)
class Verdict:
    """The outcome of the change in ``Control.verifying``, as of the latest observation."""

    from_steps: int
    to_steps: int
    observed_s: float  # busy seconds observed at to_steps since the change (decayed)
    observed_tok_s: float  # what to_steps served there, time-weighted mean
    baseline_tok_s: float  # what from_steps serves at the same concurrencies
    margin_tok_s: float  # half-width of the interval of the difference
    # It served less beyond noise, after the minimum time...
    beyond_noise: bool
    # ...and the traffic the policy expects is like the traffic it served less under: go back.
    regressed: bool
    why: str
    mix: tuple[tuple[int, float], ...]  # the concurrency mix seen since the change
    # The adaptive sets of from_steps / to_steps; None: static K or off.
    from_setting: SpecSetting | None = None
    to_setting: SpecSetting | None = None
    # When the change was made (the snapshot's time): going back in its own window.
    changed_at: float | None = None
    # What to_steps was predicted to serve at the traffic seen since (tok/s; None: not
    # predicted there); the change's ratio over its epoch, the bands seen as served and the
    # rest as predicted; and whether that ratio is a loss beyond noise.
    predicted_tok_s: float | None = None
    epoch_ratio: float | None = None
    short_of_prediction: bool | None = None

    @property
    def to_name(self) -> str:
        """The changed-to setting's operator form ("4", "off", "adaptive:3,4")."""
        return label(self.to_steps, self.to_setting)

    @property
    def from_name(self) -> str:
        return label(self.from_steps, self.from_setting)

    @property
    def shortfall_ratio(self) -> float:
        """How much less to_steps served than from_steps (negative: it served more)."""
        if self.baseline_tok_s <= 0:
            return 0.0
        return 1.0 - self.observed_tok_s / self.baseline_tok_s


# -- the snapshot -------------------------------------------------------------------------
def verification_end(config: Settings, t: float) -> float:
    """When the outcome of a change made at ``t`` stops being verified: the close of the
    window that ends its epoch (the first window opening after ``t``'s)."""
    # One second on: `next_open` answers a window opening at exactly ``t`` with ``t``.
    at = datetime.fromtimestamp(t + 1.0, tz=timezone.utc)
    try:
        opened = windows.next_open(config.windows, at)
        return windows.next_close(config.windows, opened).timestamp()
    except ValueError:  # no window in the horizon: no later window to go back in either
        return t


def snapshot(
    history: History,
    from_steps: int,
    to_steps: int,
    predicted_gain_ratio: float | None = None,
    until: float | None = None,
    from_setting: SpecSetting | None = None,
    to_setting: SpecSetting | None = None,
    predicted: tuple[tuple[int, float, float], ...] = (),
) -> ChangeSnapshot:
    """The snapshot of a change from ``from_steps`` to ``to_steps`` (setting keys; an
    adaptive set given as ``from_setting`` / ``to_setting``) made now (the history's
    latest observation), verified until ``until``; ``predicted``: `predicted_bands`."""
    t = history.last_t if history.last_t is not None else 0.0
    from_setting, to_setting = _adaptive(from_setting), _adaptive(to_setting)
    cells = tuple(
        sorted((c, w, ws) for c, (w, ws) in _cells(history, to_steps, to_setting).items())
    )
    return ChangeSnapshot(
        t,
        from_steps,
        to_steps,
        cells,
        predicted_gain_ratio,
        until,
        from_setting,
        to_setting,
        predicted,
    )


def heading(snap: ChangeSnapshot) -> str:
    """How every verdict on ``snap`` begins ("outcome of 3 → 4 at <its time>"): `specd
    status` finds the daemon's verdict on the change it shows by it."""
    old, new = label(snap.from_steps, snap.from_setting), label(snap.to_steps, snap.to_setting)
    return f"outcome of {old} → {new} at {_stamp(snap.t)}"


def predicted_bands(
    model: PerformanceModel,
    mix: Mapping[int, float],
    from_key: int,
    to_key: int,
    from_setting: SpecSetting | None = None,
    to_setting: SpecSetting | None = None,
) -> tuple[tuple[int, float, float], ...]:
    """What ``model`` predicts the setting ``to_key`` serves relative to ``from_key`` (setting
    keys; adaptive sets given as settings) per load band (`specd.core.model.load_band`) of
    the offered concurrencies in ``mix`` (the forecast a change is made on; weights by
    concurrency): (band, ratio, the band's share of what ``from_key`` was predicted to serve
    over it), for the bands below `MAX_PREDICTED_BANDS` (those a state file holds). The
    verdict reads the epoch from it: the bands seen as served, the rest as predicted. Empty
    when the model predicts either setting not."""
    new = _predictor(model, to_key, _adaptive(to_setting))
    old = _predictor(model, from_key, _adaptive(from_setting))
    if new is None or old is None:
        return ()
    sums: dict[int, list[float]] = {}
    for c, w in mix.items():
        b = load_band(c) if c > 0 and w > 0 else MAX_PREDICTED_BANDS
        if b >= MAX_PREDICTED_BANDS:
            continue
        band = sums.setdefault(b, [0.0, 0.0])
        band[0] += w * new(float(c))
        band[1] += w * old(float(c))
    total = sum(o for _, o in sums.values())
    if not total > 0 or not math.isfinite(total):
        return ()
    return tuple(
        (b, n / o, o / total) for b, (n, o) in sorted(sums.items()) if o > 0 and _ratio_ok(n / o)
    )


def _ratio_ok(value: float) -> bool:
    return math.isfinite(value) and 0.0 <= value <= MAX_PREDICTED_RATIO


def _cells(
    history: History, key: int, setting: SpecSetting | None
) -> dict[int, tuple[float, float]]:
    """Offered concurrency → (decayed seconds, decayed seconds × tok/s) of a setting."""
    keys = _keys(key, setting)
    out: dict[int, tuple[float, float]] = {}
    if len(keys) == 1:
        # One key: its cells alone, in the table's order (the same sums as the scan below).
        for c, (tok_s, weight) in history.throughput_cells(keys[0]).items():
            w0, ws0 = out.get(c, (0.0, 0.0))
            out[c] = (w0 + weight, ws0 + weight * tok_s)
        return out
    for (k, c), (tok_s, weight) in history.throughput_table().items():
        if k in keys and c > 0:
            w0, ws0 = out.get(c, (0.0, 0.0))
            out[c] = (w0 + weight, ws0 + weight * tok_s)
    return out


def since_change(snap: ChangeSnapshot, history: History) -> dict[int, tuple[float, float]]:
    """Offered concurrency → (decayed seconds, mean tok/s) ``snap.to_steps`` served since
    the change: the current cells minus the snapshot, decayed alike."""
    at = history.last_t if history.last_t is not None else snap.t
    # The snapshot decays as the history does: the same half-life, from its own time.
    decay = DecayingSums[int](history.settings.half_life_s, snap.t).scale_at(at)
    before = {c: (w * decay, ws * decay) for c, w, ws in snap.cells}
    out: dict[int, tuple[float, float]] = {}
    for c, (weight, weighted) in _cells(history, snap.to_steps, snap.to_setting).items():
        w0, ws0 = before.get(c, (0.0, 0.0))
        w = weight - w0
        if w <= _MIN_CELL_S:
            continue
        out[c] = (w, max(weighted - ws0, 0.0) / w)
    return out


def _normalized_mix(weights: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
    # Lists, not generators, for the sums and the tuple: the same terms in the same order,
    # read at every tick of a verification.
    total = sum([w for c, w in weights.items() if c > 0 and w > 0])
    if total <= 0:
        return ()
    return tuple(
        [
            (c, w / total)
            for c, w in sorted(weights.items())
            if c > 0 and w > 0 and w / total >= _MIN_MIX_SHARE
        ]
    )


def mix_distance(a: Mapping[int, float], b: Mapping[int, float]) -> float:
    """Total variation distance of two busy concurrency mixes (0 same, 1 disjoint); 0 when
    either is empty (no traffic to tell a change by)."""
    return _normalized_distance(_normalized_mix(a), _normalized_mix(b))


def _normalized_distance(
    a: tuple[tuple[int, float], ...], b: tuple[tuple[int, float], ...]
) -> float:
    """`mix_distance` of two mixes `_normalized_mix` made already."""
    pa, pb = dict(a), dict(b)
    if not pa or not pb:
        return 0.0
    return 0.5 * sum([abs(pa.get(c, 0.0) - pb.get(c, 0.0)) for c in set(pa) | set(pb)])


def _error_ratio(noise_ratio: float, evidence_s: float) -> float:
    # As `PerformanceModel.relative_error` for an observed step count: the calibration's
    # noise, shrunk as observation outweighs it.
    return noise_ratio * observed_shrink(evidence_s)


def verdict(
    snap: ChangeSnapshot | None,
    history: History,
    config: Settings,
    current: int | None,
    calibration: Calibration | None = None,
    coming: Mapping[int, float] | None = None,
    model: PerformanceModel | None = None,
    live_config: str | None = None,
) -> Verdict | None:
    """The outcome of ``snap`` while its new step count is live; None when there is no
    change to verify, its verification lapsed, it is not live, or nothing comparable was
    seen since. A shortfall beyond noise is a regression to go back from only while the
    ``coming`` traffic (the concurrency mix the policy expects; None: the same) is like the
    traffic it was seen under (``regression_lift_mix_ratio``). ``model``: the policy's
    `PerformanceModel` of this tick (of ``calibration`` and ``history``), else built here.
    ``current``: the static K live (0: off; None under SGLang's adaptive mode, reading the
    config file ``live_config``)."""
    if snap is None:
        return None
    if snap.to_setting is not None:
        if current is not None or not runs_adaptive_config(snap.to_setting, live_config):
            return None
    elif current is None or current != snap.to_steps:
        return None
    if history.last_t is not None and snap.lapsed(history.last_t):
        return None
    seen = since_change(snap, history)
    if not seen:
        return None
    if model is None:
        model = PerformanceModel(calibration, history)
    old = snap.from_steps
    old_observed = {
        c: (ws / w, w) for c, (w, ws) in _cells(history, old, snap.from_setting).items() if w > 0
    }
    predict = _predictor(model, old, snap.from_setting)
    bands = {b: (ratio, share) for b, ratio, share in snap.predicted}
    total_w = served = baseline = 0.0
    # The cells in a band the change was predicted for, by band: [seconds, served, baseline].
    seen_bands: dict[int, list[float]] = {}
    mix: dict[int, float] = {}
    for c, (w, tok_s) in seen.items():
        obs_tok_s, obs_w = old_observed.get(c, (0.0, 0.0))
        if predict is not None:
            predicted = predict(float(c))
            # The old step count's own mean at c, trusted as its evidence there grows.
            base = (obs_w * obs_tok_s + OBSERVED_PIVOT_S * predicted) / (obs_w + OBSERVED_PIVOT_S)
        elif obs_w > 0:
            base = obs_tok_s
        else:
            continue  # nothing says what the old step count serves here
        total_w += w
        served += w * tok_s
        baseline += w * base
        mix[c] = w
        band = load_band(c) if bands else None
        if band is not None and band in bands:
            sums = seen_bands.setdefault(band, [0.0, 0.0, 0.0])
            sums[0] += w
            sums[1] += w * tok_s
            sums[2] += w * base
    if total_w <= 0 or baseline <= 0:
        return None
    served /= total_w
    baseline /= total_w
    noise = config.choose.calibration_noise_ratio
    old_evidence = sum(w for _, w in old_observed.values())
    margin = EVIDENCE_Z * math.hypot(
        _error_ratio(noise, total_w) * served, _error_ratio(noise, old_evidence) * baseline
    )
    needed = config.choose.outcome_min_observed_s
    floor_ratio = config.choose.regression_min_ratio
    # The epoch the change was predicted for, its bands seen since as served there and the
    # rest as predicted: a loss, by as much as a shortfall must be. A band counts as seen
    # after as long as observation takes to outweigh a prediction (a burst's few seconds
    # say nothing of the busy hours that band stands for).
    predicted_tok_s: float | None = None
    epoch_ratio: float | None = None
    short_of_prediction: bool | None = None
    # What the new setting was predicted to serve at the traffic seen: the old one's
    # baseline there times the predicted ratio of each band.
    seen_s = sum(v[0] for v in seen_bands.values())
    seen_base = sum(v[2] for v in seen_bands.values())
    seen_predicted = sum(bands[b][0] * v[2] for b, v in seen_bands.items())
    if seen_s > 0 and seen_base > 0:
        predicted_tok_s = seen_predicted / seen_s
    measured_ratio = {
        b: v[1] / v[2] for b, v in seen_bands.items() if v[0] >= OBSERVED_PIVOT_S and v[2] > 0
    }
    shares = sum(share for _, share in bands.values())
    if measured_ratio and shares > 0:  # shares of nothing (a hand-edited state): unknown
        epoch_ratio = (
            sum(share * measured_ratio.get(b, ratio) for b, (ratio, share) in bands.items())
            / shares
        )
        short_of_prediction = 1.0 - epoch_ratio > max(margin / baseline, floor_ratio)
    short_of_old = baseline - served > max(margin, floor_ratio * baseline)
    beyond_noise = total_w >= needed and short_of_old and short_of_prediction is not False
    # The mix seen, normalized once: compared with the coming traffic and kept in the verdict.
    seen_mix = _normalized_mix(mix)
    moved = 0.0 if coming is None else _normalized_distance(_normalized_mix(coming), seen_mix)
    regressed = beyond_noise and moved <= config.choose.regression_lift_mix_ratio
    old_label, new_label = label(old, snap.from_setting), label(snap.to_steps, snap.to_setting)
    head = heading(snap)
    diff = served / baseline - 1.0
    expected = (
        ""
        if snap.predicted_gain_ratio is None
        else f", predicted {snap.predicted_gain_ratio * 100:+.1f}% for its epoch"
    )
    if epoch_ratio is not None:
        there = seen_predicted / seen_base - 1.0  # a band counted as seen has a baseline
        expected += (
            f", {there * 100:+.1f}% at the traffic seen: {(epoch_ratio - 1) * 100:+.1f}% for "
            "its epoch with what it served there"
        )
    measured = (
        f"{new_label} served {served:.0f} tok/s over {total_w / 3600:.1f} h since, "
        f"{old_label} serves {baseline:.0f} at the same concurrencies "
        f"({diff * 100:+.1f}%, interval ±{margin / baseline * 100:.1f}%{expected})"
    )
    if regressed:
        why = f"{head}: regression, {measured}"
    elif beyond_noise:
        why = (
            f"{head}: regression under other traffic than expected now (mix "
            f"{moved:.2f} away > {config.choose.regression_lift_mix_ratio:g}), the policy "
            f"decides, {measured}"
        )
    elif total_w < needed:
        why = f"{head}: {total_w:.0f} s observed < {needed:.0f} s needed, {measured}"
    elif short_of_prediction is False and short_of_old:
        why = (
            f"{head}: no regression, it serves less at the traffic seen but as "
            f"much as predicted for its epoch, {measured}"
        )
    else:
        why = f"{head}: no regression beyond noise, {measured}"
    return Verdict(
        old,
        snap.to_steps,
        total_w,
        served,
        baseline,
        margin,
        beyond_noise,
        regressed,
        why,
        seen_mix,
        snap.from_setting,
        snap.to_setting,
        snap.t,
        predicted_tok_s,
        epoch_ratio,
        short_of_prediction,
    )


def _predictor(
    model: PerformanceModel, key: int, setting: SpecSetting | None
) -> Callable[[float], float] | None:
    """The model's tok/s of a setting by offered concurrency; None when it cannot predict
    it (an adaptive set: every candidate, as `specd.core.model.plan` predicts it)."""
    if setting is None:
        if not model.can_predict(key):
            return None
        return lambda c: model.throughput(key, c)
    try:
        am = AdaptiveModel.of(adaptive_slots(setting), model)
    except ValueError:
        return None
    if am.skipped:
        return None
    # As the calibration predicts it: what a sweep measured of the set corrects its rows.
    swept = model.swept_set(setting)
    return am.throughput if swept is None else (lambda c: am.throughput(c) * swept)


# -- measured against predicted (specd recommend) ---------------------------------------
@dataclass(frozen=True)
class Measured:
    """What one setting served in the history, and what the model predicts for it at the
    same concurrencies (time-weighted), with its prediction interval."""

    setting: str  # operator form ("4", "off", "adaptive:3,4")
    key: int  # `setting_key`
    observed_s: float  # decayed busy seconds
    observed_tok_s: float
    concurrencies: tuple[int, ...]  # the offered concurrencies it was seen at
    predicted_tok_s: float | None = None  # None: the model cannot predict it
    interval: tuple[float, float] | None = None


def measured(
    history: History,
    model: PerformanceModel,
    adaptive_sets: Sequence[SpecSetting],
    noise_ratio: float,
) -> tuple[Measured, ...]:
    """Every setting with observations in ``history``: static K and off by their key, an
    adaptive set of ``adaptive_sets`` by its config file's keys (an adaptive config that is
    none of them is left out: nothing says which set it was)."""
    sets = {k: s for s in adaptive_sets if s.kind == "adaptive" for k in observed_keys(s)}
    groups: dict[int, tuple[SpecSetting | None, dict[int, tuple[float, float]]]] = {}
    for (k, c), (tok_s, weight) in history.throughput_table().items():
        if c <= 0 or weight <= 0:
            continue
        found = sets.get(k) if k < 0 else None
        if k < 0 and found is None:
            continue
        key = setting_key(found) if found is not None else k
        cells = groups.setdefault(key, (found, {}))[1]
        w0, ws0 = cells.get(c, (0.0, 0.0))
        cells[c] = (w0 + weight, ws0 + weight * tok_s)
    out: list[Measured] = []
    for key, (found, cells) in sorted(groups.items(), key=lambda item: (item[0] < 0, abs(item[0]))):
        total = sum(w for w, _ in cells.values())
        served = sum(ws for _, ws in cells.values()) / total
        row = Measured(label(key, found), key, total, served, tuple(sorted(cells)))
        predict = _predictor(model, key, found)
        if predict is not None:
            predicted = sum(w * predict(float(c)) for c, (w, _) in cells.items()) / total
            steps = found.candidates if found is not None else (key,)
            half = EVIDENCE_Z * max(model.relative_error(k, noise_ratio) for k in steps)
            interval = (max(predicted * (1 - half), 0.0), predicted * (1 + half))
            row = replace(row, predicted_tok_s=predicted, interval=interval)
        out.append(row)
    return tuple(out)


# -- the avoid list -----------------------------------------------------------------------
def avoid_entry(found: Verdict, now: float) -> Avoided:
    """The avoid-list entry of a regression specd goes back from at ``now``."""
    return Avoided(
        found.to_steps,
        now,
        found.mix,
        found.shortfall_ratio,
        found.from_steps,
        found.to_setting,
        found.from_setting,
    )


def with_avoided(
    entries: Sequence[Avoided], entry: Avoided, now: float, config: Settings
) -> tuple[Avoided, ...]:
    """``entries`` still in force at ``now``, with ``entry`` replacing any of its steps."""
    kept = [e for e in current_entries(entries, now, config) if e.steps != entry.steps]
    return tuple(sorted([*kept, entry], key=lambda e: (e.t, e.steps)))


def current_entries(
    entries: Sequence[Avoided], now: float, config: Settings
) -> tuple[Avoided, ...]:
    """The entries whose time-to-live has not run out at ``now``."""
    ttl = config.choose.regression_avoid_s
    return tuple(e for e in entries if now - e.t < ttl)


def avoided(
    entries: Sequence[Avoided], now: float, config: Settings, mix: Mapping[int, float]
) -> dict[int, str]:
    """Step count → why the policies skip it, for traffic of concurrency ``mix``: entries
    in force, unless that traffic moved far from the mix each regressed under."""
    lift = config.choose.regression_lift_mix_ratio
    out: dict[int, str] = {}
    for e in current_entries(entries, now, config):
        if mix_distance(mix, dict(e.mix)) > lift:
            continue
        out[e.steps] = (
            f"{e.name} served {e.shortfall_ratio * 100:.1f}% less than {e.from_name} "
            f"(went back {_stamp(e.t)})"
        )
    return out


# -- persistence (state.json) -------------------------------------------------------------
def _steps(value: Any, name: str) -> int:
    # A setting key: K, 0 (off) or an adaptive set's (negative, 48 bits; `setting_key`).
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**48) <= value <= MAX_STEPS:
        raise ValueError(
            f"{name}: expected a setting (step count 0..{MAX_STEPS}), got {value!r:.40}"
        )
    return value


def _setting_of(data: dict[str, Any], name: str, key: int) -> SpecSetting | None:
    """The adaptive set stored as ``name`` for setting key ``key``; None for K or off."""
    text = data.get(name)
    if text is None:
        if key < 0:
            raise ValueError(f"{name}: the adaptive set of key {key} is missing")
        return None
    if not isinstance(text, str):
        raise ValueError(f"{name}: expected an adaptive setting such as 'adaptive:3,4'")
    setting = parse(text)
    if setting.kind != "adaptive" or setting_key(setting) != key:
        raise ValueError(f"{name}: {text!r:.60} is not the adaptive set of key {key}")
    return setting


def _setting_text(setting: SpecSetting | None) -> str | None:
    return None if setting is None else format_setting(setting)


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r:.40}")
    return float(value)


def _concurrency(value: Any) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 1 <= value <= 100 * MAX_RUNNING_REQUESTS
    ):
        raise ValueError(f"expected an offered concurrency, got {value!r:.40}")
    return value


def _check_cell(c: int, values: list[float]) -> str | None:
    weight, weighted = values
    if weight > 0 and not 0 <= weighted / weight <= MAX_TOKENS_PER_S:
        return f"{weighted / weight:.6g} tokens/s at {c} is more than any SGLang server serves"
    return None


def snapshot_to_dict(snap: ChangeSnapshot, half_life_s: float) -> dict[str, Any]:
    table: DecayingSums[int] = DecayingSums(half_life_s, snap.t)
    table.cells = {c: [w, ws] for c, w, ws in snap.cells}
    return {
        "t": snap.t,
        "from_steps": snap.from_steps,
        "to_steps": snap.to_steps,
        "predicted_gain_ratio": snap.predicted_gain_ratio,
        "until": snap.until,
        "cells": table.to_dict(snap.t, int),
        "from_setting": _setting_text(snap.from_setting),
        "to_setting": _setting_text(snap.to_setting),
        "predicted": [[band, ratio, share] for band, ratio, share in snap.predicted],
    }


# How long after its change a verification can last: the windows' horizon, and a year.
_MAX_VERIFYING_S = 6 * 366 * 86400.0


def snapshot_from_dict(
    data: Any, half_life_s: float, dropped: list[str] | None = None
) -> ChangeSnapshot:
    """Rebuild from `snapshot_to_dict`. A bad snapshot raises ValueError; a bad cell does
    too unless ``dropped`` is given: then it is left out and named there. Its time must be
    one specd can have written (`specd.core.history.check_time`); one ahead of the clock
    the daemon takes as now."""
    if not isinstance(data, dict):
        raise ValueError("verifying: expected an object or null")
    try:
        t = check_time(data.get("t"), "t")
        from_steps = _steps(data.get("from_steps"), "from_steps")
        to_steps = _steps(data.get("to_steps"), "to_steps")
        gain = data.get("predicted_gain_ratio")
        gain_ratio = None if gain is None else _number(gain, "predicted_gain_ratio")
        until = data.get("until")
        until_t = None if until is None else _number(until, "until")
        if until_t is not None and not t <= until_t <= t + _MAX_VERIFYING_S:
            raise ValueError(f"until: {until_t:.6g} is not within the windows' horizon of t")
        table = DecayingSums.from_dict(
            data.get("cells"),
            half_life_s,
            2,
            # Keyed as the history's throughput cells it is subtracted from.
            lambda value: concurrency_bin(_concurrency(value)),
            check=_check_cell,
            dropped=dropped,
            where="verifying.cells",
            at=t,
            # The new setting's throughput cells at the change: as much as they can hold.
            max_weight_s=max_weight_s(half_life_s),
        )
        from_setting = _setting_of(data, "from_setting", from_steps)
        to_setting = _setting_of(data, "to_setting", to_steps)
        predicted = _predicted(data.get("predicted"))
    except ValueError as exc:
        raise ValueError(f"verifying: {exc}") from None
    if from_steps == to_steps:
        raise ValueError(f"verifying: from_steps and to_steps are both {to_steps}")
    scale = table.scale_at(t)
    cells = tuple(sorted((c, w * scale, ws * scale) for c, (w, ws) in table.cells.items()))
    return ChangeSnapshot(
        t, from_steps, to_steps, cells, gain_ratio, until_t, from_setting, to_setting, predicted
    )


def _predicted(value: Any) -> tuple[tuple[int, float, float], ...]:
    """`ChangeSnapshot.predicted` from its JSON; absent (an older specd's) is none."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_PREDICTED_BANDS:
        raise ValueError(
            f"predicted: expected a list of at most {MAX_PREDICTED_BANDS} [band, ratio, share]"
        )
    out: dict[int, tuple[float, float]] = {}
    for i, entry in enumerate(value):
        if (
            not isinstance(entry, list)
            or len(entry) != 3
            or isinstance(entry[0], bool)
            or not isinstance(entry[0], int)
            or not 0 <= entry[0] < MAX_PREDICTED_BANDS
            or entry[0] in out
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in entry[1:])
            or not _ratio_ok(float(entry[1]))
            or not 0.0 <= float(entry[2]) <= 1.0
        ):
            raise ValueError(
                f"predicted[{i}]: expected [band 0–{MAX_PREDICTED_BANDS - 1}, once; ratio "
                f"0–{MAX_PREDICTED_RATIO:g}; share 0–1], got {entry!r:.40}"
            )
        out[entry[0]] = (float(entry[1]), float(entry[2]))
    return tuple((b, r, share) for b, (r, share) in sorted(out.items()))


def avoided_to_dict(entry: Avoided) -> dict[str, Any]:
    return {
        "steps": entry.steps,
        "t": entry.t,
        "from_steps": entry.from_steps,
        "shortfall_ratio": entry.shortfall_ratio,
        "mix": [[c, share] for c, share in entry.mix],
        "setting": _setting_text(entry.setting),
        "from_setting": _setting_text(entry.from_setting),
    }


def avoided_from_dict(index: int, data: Any) -> Avoided:
    """One avoid-list entry from `avoided_to_dict`; ValueError naming ``avoided[index]``.
    Its time must be one specd can have written (`specd.core.history.check_time`)."""
    where = f"avoided[{index}]"
    try:
        if not isinstance(data, dict):
            raise ValueError(f"expected an object, got {data!r:.40}")
        mix = data.get("mix")
        if not isinstance(mix, list):
            raise ValueError("mix: expected a list of [concurrency, share]")
        shares: dict[int, float] = {}
        for row in mix:
            if not isinstance(row, list) or len(row) != 2:
                raise ValueError(f"mix: expected [concurrency, share], got {row!r:.40}")
            share = _number(row[1], "mix share")
            if not 0 <= share <= 1:
                raise ValueError(f"mix: share {share:.6g} is not in [0, 1]")
            # Keyed as the forecast's mix it is compared with (`concurrency_bin`).
            key = concurrency_bin(_concurrency(row[0]))
            shares[key] = shares.get(key, 0.0) + share
        shortfall = _number(data.get("shortfall_ratio"), "shortfall_ratio")
        if not -1 <= shortfall <= 1:
            raise ValueError(f"shortfall_ratio: {shortfall:.6g} is not in [-1, 1]")
        steps = _steps(data.get("steps"), "steps")
        from_steps = _steps(data.get("from_steps"), "from_steps")
        return Avoided(
            steps=steps,
            t=check_time(data.get("t"), "t"),
            mix=tuple(sorted(shares.items())),
            shortfall_ratio=shortfall,
            from_steps=from_steps,
            setting=_setting_of(data, "setting", steps),
            from_setting=_setting_of(data, "from_setting", from_steps),
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
