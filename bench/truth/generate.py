"""Write the bench's ground-truth tables and the sparse, noisy calibrations a sweep measures.

``python bench/truth/generate.py`` (re)writes, next to this file:

* ``k5to2.csv`` — a machine whose best step count moves from 5 (1–8 concurrent) through 4
  and 3 to 2 (48+), with a wider spread between settings at high load than the seed.
* ``lowaccept.csv`` — the seed machine with real-prompt acceptance: per-draft-token α a
  third lower (0.954 → 0.636), so speculation pays much less than the greedy sweep says.
* ``k6to1.csv`` — best step count 6 at one request, 5–4 at 8–12, 3–2 at 16–32, 1 at 48+:
  capacity (KV per request) decides under heavy load.
* ``near.csv`` — the best static (4) serves only 1.8 % more than the start value (3) at
  every concurrency, every other step count at least 3 % less than 3: a small, certain
  gain worth a restart over a long epoch.
* ``lowcap.csv`` — capacities 6–30 (max_running_requests), below the sweep's larger
  concurrencies (16, 32, 64): the plateau is what the sweep measured there.
* ``heavyoff.csv`` — low acceptance (α 0.6) on a machine whose KV and compute bind early:
  under heavy load (16+) no speculation serves most (off 1371 tok/s at 32, 1 step 1208),
  at 1–4 requests 2–3 steps; a case for choosing "off" and adaptive sets with a 0 tier.
* ``*-calibration.csv`` — what ``specd sweep --steps 1,2,3,4,5 --concurrency
  1,2,4,8,16,32`` would measure: truth ±2% noise (seeded), accept length ±1%, exact
  ``max_running_requests``. ``lowaccept`` has no calibration of its own: its machine was
  swept with a greedy benchmark, i.e. ``seed-calibration.csv``. ``k6to1`` and ``lowcap``
  are swept at steps 1–6 and (lowcap) up to 64 concurrent, past every capacity; ``near``
  at steps 1–6; ``heavyoff`` at steps 0–7 up to 64 concurrent (off and every candidate of
  SGLang's default adaptive config measured).
* ``k5to2-off3-calibration.csv`` — a sweep of ``k5to2`` that is off by 3 % from the truth
  at every point, up for odd step counts and down for even ones (a systematic error no
  noise averages out).
* ``near-k5up-calibration.csv`` — a sweep of ``near`` (steps 1–6) that claims 5 serves
  ``K5UP_RATIO`` more than the truth says: 5 looks best at light load, yet serves 3 % less
  than the start value 3. Only what specd observes after changing to 5 can tell.

Truths carry steps 0–7, so SGLang's adaptive mode has all its default candidates
(the seed's twin table has 0–6).

The seed truth is the twin's own table, ``specd/data/seed-qwen35-122b.csv``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from specd.core.perftable import PerfRow, PerfTable
from specd.io.tables import read_table, write_table

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SEED_TRUTH = REPO / "specd" / "data" / "seed-qwen35-122b.csv"
STEPS = tuple(range(1, 7))
ALL_STEPS = tuple(range(0, 8))  # the newer truths: off, and adaptive's deepest default
POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SWEEP_STEPS = (1, 2, 3, 4, 5)
SWEEP_CONCURRENCY = (1, 2, 4, 8, 16, 32)
NOISE_RATIO = 0.02
ACCEPT_NOISE_RATIO = 0.01
OFF_RATIO = 0.03
NEAR_GAIN_RATIO = 0.018  # the best static's edge over the start value
NEAR_OTHERS_RATIO = 0.97  # every other step count at most this much of the start value's
K5UP_RATIO = 0.08  # how much more near-k5up's sweep says 5 serves than it does


@dataclass(frozen=True)
class Machine:
    """The twin preset's shape (specd/twin/preset.py) with its parameters free."""

    alpha: float
    base_s: float
    per_step_s: float
    beyond_s: float  # extra per step past ``beyond_from`` (a reused draft layer tires)
    beyond_from: int
    knee_tokens: float
    sharpness: float
    per_request_s: float
    kv_budget: int

    def accept_length(self, k: int) -> float:
        return (1 - self.alpha ** (k + 1)) / (1 - self.alpha)

    def capacity(self, k: int) -> int:
        return math.floor(self.kv_budget / (k + 2))

    def tok_s(self, k: int, c: float) -> float:
        b = min(c, self.capacity(k))
        t1 = self.base_s + self.per_step_s * k + self.beyond_s * max(0, k - self.beyond_from)
        roof = (1 + (b * (k + 1) / self.knee_tokens) ** self.sharpness) ** (1 / self.sharpness)
        return b * self.accept_length(k) / (t1 * roof + self.per_request_s * (b - 1))

    def table(self, name: str, steps: tuple[int, ...] = STEPS) -> PerfTable:
        rows = []
        for k in steps:
            cap = self.capacity(k)
            for c in sorted(set(POINTS) | {cap}):
                rows.append(
                    PerfRow(
                        k,
                        float(c),
                        round(self.tok_s(k, c), 1),
                        round(self.accept_length(k), 4),
                        cap,
                    )
                )
        return PerfTable(rows, source=name)


K5TO2 = Machine(0.82, 0.015, 0.0016, 0.004, 5, 110.0, 4.0, 0.0002, 420)
# The twin preset's parameters with α a third lower.
LOWACCEPT = Machine(0.954 * 2 / 3, 0.01535, 0.000229, 0.006, 4, 42.0, 6.0, 0.0002, 78)


K6TO1 = Machine(0.90, 0.015, 0.0015, 0.004, 6, 60.0, 4.0, 0.0002, 120)
LOWCAP = Machine(0.80, 0.012, 0.0012, 0.003, 6, 60.0, 4.0, 0.0002, 60)
HEAVYOFF = Machine(0.60, 0.012, 0.0015, 0.003, 6, 24.0, 4.0, 0.0002, 160)


def near(base: Machine, name: str) -> PerfTable:
    """``base`` reshaped so that 4 serves NEAR_GAIN_RATIO more than 3 at every concurrency
    (same capacity: the extra draft token is nearly free here) and every other step count
    at most NEAR_OTHERS_RATIO of 3."""
    cap3 = base.capacity(3)
    rows = []
    for k in ALL_STEPS:
        cap = cap3 if k == 4 else base.capacity(k)
        for c in sorted(set(POINTS) | {cap}):
            three = base.tok_s(3, c)
            if k == 3:
                tok_s = three
            elif k == 4:
                tok_s = three * (1 + NEAR_GAIN_RATIO)
            else:
                tok_s = min(base.tok_s(k, c), three * NEAR_OTHERS_RATIO)
            rows.append(PerfRow(k, float(c), round(tok_s, 1), round(base.accept_length(k), 4), cap))
    return PerfTable(rows, source=name)


def off(truth: PerfTable, ratio: float = OFF_RATIO) -> PerfTable:
    """An exact sweep of ``truth`` off by ``ratio``: up for odd step counts, down for even."""
    rows = []
    for k in SWEEP_STEPS:
        sign = 1 if k % 2 else -1
        for c in SWEEP_CONCURRENCY:
            rows.append(
                PerfRow(
                    k,
                    float(c),
                    round(truth.throughput(k, float(c)) * (1 + sign * ratio), 1),
                    truth.accept_length(k),
                    truth.capacity(k),
                )
            )
    return PerfTable(rows, source="off")


def claims_more(table: PerfTable, steps: int, ratio: float) -> PerfTable:
    """``table`` with every throughput of ``steps`` ``ratio`` higher than measured."""
    rows = [
        PerfRow(
            r.steps,
            r.concurrency,
            round(r.output_tok_s * (1 + ratio), 1) if r.steps == steps else r.output_tok_s,
            r.accept_length,
            r.max_running_requests,
        )
        for r in table.rows
    ]
    return PerfTable(rows, source=f"{table.source}, {steps} claimed {ratio:+.0%}")


def sweep(
    truth: PerfTable,
    seed: int,
    steps: tuple[int, ...] = SWEEP_STEPS,
    concurrency: tuple[int, ...] = SWEEP_CONCURRENCY,
) -> PerfTable:
    """A sparse, noisy measurement of ``truth``, as `specd sweep` would make it."""
    rng = random.Random(seed)
    rows = []
    for k in steps:
        length = truth.accept_length(k)
        measured = (
            None if length is None else round(length * (1 + rng.gauss(0, ACCEPT_NOISE_RATIO)), 3)
        )
        for c in concurrency:
            noise = max(-2 * NOISE_RATIO, min(2 * NOISE_RATIO, rng.gauss(0, NOISE_RATIO)))
            rows.append(
                PerfRow(
                    k,
                    float(c),
                    round(truth.throughput(k, float(c)) * (1 + noise), 1),
                    None if measured is None else max(1.0, measured),
                    truth.capacity(k),
                )
            )
    return PerfTable(rows, source="sweep")


def sweep_sets(
    truth: PerfTable,
    calibration: PerfTable,
    sets: tuple[str, ...],
    loss_ratio: float,
    seed: int,
) -> PerfTable:
    """``calibration`` with the rows ``specd sweep --adaptive`` would add for each of
    ``sets`` whose candidates both tables have: at the calibration's concurrencies, the
    truth's best candidate of each batch's slot served ``loss_ratio`` less (SGLang's
    switching and its extra graphs' memory), with a static row's noise (seeded)."""
    # Imported here: the truths themselves need nothing of the brain's adaptive model.
    from specd.core.adaptive import AdaptiveModel  # noqa: PLC0415
    from specd.core.model import adaptive_slots  # noqa: PLC0415
    from specd.core.setting import format_setting  # noqa: PLC0415
    from specd.core.setting import parse as parse_setting  # noqa: PLC0415

    rng = random.Random(seed)
    concurrency = sorted({r.concurrency for r in calibration.rows})
    rows = list(calibration.rows)
    for setting in dict.fromkeys(map(parse_setting, sets)):  # each set once, in order
        slots = adaptive_slots(setting)
        try:
            served = AdaptiveModel.of(slots, truth)
            told = AdaptiveModel.of(slots, calibration)
        except ValueError:
            continue
        if served.skipped or told.skipped:
            continue
        for c in concurrency:
            noise = max(-2 * NOISE_RATIO, min(2 * NOISE_RATIO, rng.gauss(0, NOISE_RATIO)))
            tok_s = served.throughput(c) * (1 - loss_ratio) * (1 + noise)
            rows.append(
                PerfRow(setting.max_steps, c, round(tok_s, 1), None, None, format_setting(setting))
            )
    return PerfTable(rows, source=f"{calibration.source}, sets swept")


def write_all(out: Path = HERE) -> list[Path]:
    written = []
    seed = read_table(SEED_TRUTH)
    for name, table in (
        ("k5to2", K5TO2.table("k5to2")),
        ("lowaccept", LOWACCEPT.table("lowaccept")),
        ("k6to1", K6TO1.table("k6to1", ALL_STEPS)),
        ("near", near(K5TO2, "near")),
        ("lowcap", LOWCAP.table("lowcap", ALL_STEPS)),
        ("heavyoff", HEAVYOFF.table("heavyoff", ALL_STEPS)),
    ):
        path = out / f"{name}.csv"
        write_table(path, table)
        written.append(path)
    six = tuple(range(1, 7))
    for name, table, rng_seed, steps, concurrency in (
        ("seed", seed, 1, SWEEP_STEPS, SWEEP_CONCURRENCY),
        ("k5to2", read_table(out / "k5to2.csv"), 2, SWEEP_STEPS, SWEEP_CONCURRENCY),
        ("k6to1", read_table(out / "k6to1.csv"), 3, six, SWEEP_CONCURRENCY),
        ("near", read_table(out / "near.csv"), 4, six, SWEEP_CONCURRENCY),
        ("lowcap", read_table(out / "lowcap.csv"), 5, six, (*SWEEP_CONCURRENCY, 64)),
        ("heavyoff", read_table(out / "heavyoff.csv"), 6, ALL_STEPS, (*SWEEP_CONCURRENCY, 64)),
    ):
        path = out / f"{name}-calibration.csv"
        write_table(path, sweep(table, rng_seed, steps, concurrency))
        written.append(path)
    path = out / "k5to2-off3-calibration.csv"
    write_table(path, off(read_table(out / "k5to2.csv")))
    written.append(path)
    path = out / "near-k5up-calibration.csv"
    write_table(path, claims_more(read_table(out / "near-calibration.csv"), 5, K5UP_RATIO))
    written.append(path)
    return written


if __name__ == "__main__":
    for p in write_all():
        print(p)
