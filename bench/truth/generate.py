"""Write the bench's ground-truth tables and the sparse, noisy calibrations a sweep measures.

``python bench/truth/generate.py`` (re)writes, next to this file:

* ``k5to2.csv`` — a machine whose best step count moves from 5 (1–8 concurrent) through 4
  and 3 to 2 (48+), with a wider spread between settings at high load than the seed.
* ``lowaccept.csv`` — the seed machine with real-prompt acceptance: per-draft-token α a
  third lower (0.954 → 0.636), so speculation pays much less than the greedy sweep says.
* ``*-calibration.csv`` — what ``specd sweep --steps 1,2,3,4,5 --concurrency
  1,2,4,8,16,32`` would measure: truth ±2% noise (seeded), accept length ±1%, exact
  ``max_running_requests``. ``lowaccept`` has no calibration of its own: its machine was
  swept with a greedy benchmark, i.e. ``seed-calibration.csv``.

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
POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
SWEEP_STEPS = (1, 2, 3, 4, 5)
SWEEP_CONCURRENCY = (1, 2, 4, 8, 16, 32)
NOISE_RATIO = 0.02
ACCEPT_NOISE_RATIO = 0.01


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

    def table(self, name: str) -> PerfTable:
        rows = []
        for k in STEPS:
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


def sweep(truth: PerfTable, seed: int) -> PerfTable:
    """A sparse, noisy measurement of ``truth``, as `specd sweep` would make it."""
    rng = random.Random(seed)
    rows = []
    for k in SWEEP_STEPS:
        length = truth.accept_length(k)
        measured = (
            None if length is None else round(length * (1 + rng.gauss(0, ACCEPT_NOISE_RATIO)), 3)
        )
        for c in SWEEP_CONCURRENCY:
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


def write_all(out: Path = HERE) -> list[Path]:
    written = []
    seed = read_table(SEED_TRUTH)
    for name, table in (
        ("k5to2", K5TO2.table("k5to2")),
        ("lowaccept", LOWACCEPT.table("lowaccept")),
    ):
        path = out / f"{name}.csv"
        write_table(path, table)
        written.append(path)
    for name, table, rng_seed in (
        ("seed", seed, 1),
        ("k5to2", read_table(out / "k5to2.csv"), 2),
    ):
        path = out / f"{name}-calibration.csv"
        write_table(path, sweep(table, rng_seed))
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write_all():
        print(p)
