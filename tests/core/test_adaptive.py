from __future__ import annotations

import pytest

from specd.core.adaptive import DEFAULT_SLOTS, AdaptiveModel, Slot, Slots
from specd.core.perftable import PerfRow, PerfTable

# SGLang 0.5.23's DEFAULT_ADAPTIVE_CONFIG, candidate_steps per batch key, as it ships
# (srt/speculative/adaptive_spec_params.py; hysteresis fields left out).
SGLANG_0_5_23_DEFAULT = {
    "1": {"candidate_steps": [1, 3, 5, 7]},
    "8": {"candidate_steps": [0, 1, 3]},
    "32": {"candidate_steps": [0, 1]},
    "64": {"candidate_steps": [0]},
}


def test_default_slots_are_sglangs() -> None:
    assert DEFAULT_SLOTS.to_sglang_config() == SGLANG_0_5_23_DEFAULT
    assert DEFAULT_SLOTS.candidates() == [0, 1, 3, 5, 7]


@pytest.mark.parametrize(
    ("batch", "slot"),
    [(0.5, 1), (1, 1), (7, 1), (7.9, 1), (8, 8), (31, 8), (32, 32), (63, 32), (64, 64), (999, 64)],
)
def test_a_batch_runs_in_the_slot_of_the_largest_threshold_at_or_below_it(
    batch: float, slot: int
) -> None:
    assert DEFAULT_SLOTS.slot_for(batch).min_batch == slot


def test_a_batch_below_every_threshold_runs_in_the_first_slot() -> None:
    slots = Slots.of({4: (3,), 16: (1,)})
    assert slots.slot_for(1).min_batch == 4


def _table(capacity: dict[int, int], rate: dict[int, dict[int, float]]) -> PerfTable:
    rows = [
        PerfRow(k, float(c), v, None, capacity.get(k))
        for k, points in rate.items()
        for c, v in points.items()
    ]
    return PerfTable(rows, source="t")


# Per step count: tok/s at 1, 8, 16, 40 concurrent (linear between); capacities shrink with
# depth, as KV per request grows.
TABLE_RATES = {
    0: {1: 50.0, 8: 400.0, 16: 700.0, 40: 1200.0},
    1: {1: 90.0, 8: 600.0, 16: 1000.0, 40: 1300.0},
    3: {1: 150.0, 8: 800.0, 16: 1100.0, 40: 1150.0},
    5: {1: 190.0, 8: 700.0, 16: 900.0, 40: 900.0},
    7: {1: 200.0, 8: 650.0, 16: 800.0, 40: 800.0},
}
TABLE = _table({0: 60, 1: 40, 3: 30, 5: 20, 7: 16}, TABLE_RATES)


@pytest.mark.parametrize(
    ("concurrency", "choice", "tok_s"),
    [
        (1, 7, 200.0),  # slot ≥1: best of 1, 3, 5, 7
        (4, 3, 150 + (800 - 150) * 3 / 7),  # 3 beats 5 and 7 at 4 (linear between 1 and 8)
        (8, 3, 800.0),  # slot ≥8: best of 0, 1, 3
        (12, 3, 950.0),
        (16, 3, 1100.0),
        # Past capacity the batch is the deepest candidate's capacity (7: 16), not more.
        (32, 3, 1100.0),
        (200, 3, 1100.0),
    ],
)
def test_throughput_is_the_best_candidate_of_the_batchs_slot(
    concurrency: float, choice: int, tok_s: float
) -> None:
    model = AdaptiveModel.of(DEFAULT_SLOTS, TABLE)
    assert model.capacity == 16
    assert model.choice(concurrency) == choice
    assert model.throughput(concurrency) == pytest.approx(tok_s, rel=1e-12)


def test_capacity_is_the_deepest_candidates_and_missing_candidates_are_skipped() -> None:
    # No 7 and no 0 in the table: the deepest known candidate is 5 (capacity 20), the slot
    # ≥64 (only 0) is left out, so a batch of 64+ would run in ≥32 — at 1, the only one left.
    table = _table(
        {1: 40, 3: 30, 5: 20},
        {k: v for k, v in TABLE_RATES.items() if k in (1, 3, 5)},
    )
    model = AdaptiveModel.of(DEFAULT_SLOTS, table)
    assert model.skipped == (0, 7)
    assert model.capacity == 20
    assert model.slots == Slots((Slot(1, (1, 3, 5)), Slot(8, (1, 3)), Slot(32, (1,))))
    assert model.choice(1) == 5
    assert model.throughput(100) == pytest.approx(max(table.throughput(k, 20) for k in (1, 3)))


def test_a_general_candidate_set() -> None:
    # Issue 15's sets: any slots, e.g. one slot of two candidates for every batch.
    model = AdaptiveModel.of(Slots.of({1: (3, 1)}), TABLE)
    assert model.capacity == 30  # 3 is the deepest
    assert model.choice(1) == 3
    assert model.choice(30) == 1
    assert model.throughput(100) == pytest.approx(TABLE.throughput(1, 30))


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({}, "at least one slot"),
        ({0: (1,)}, "threshold 0 is below 1"),
        ({1: ()}, "batch 1 has no candidates"),
        ({1: (-1, 2)}, r"candidate steps \[-1\] outside 0-16"),
        ({1: (17,)}, r"candidate steps \[17\] outside"),
    ],
)
def test_bad_slots_are_refused_in_one_line(
    mapping: dict[int, tuple[int, ...]], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        Slots.of(mapping)
    assert "\n" not in str(info.value)


def test_unsorted_slots_are_refused() -> None:
    with pytest.raises(ValueError, match="thresholds must increase"):
        Slots((Slot(8, (1,)), Slot(1, (3,))))
    with pytest.raises(ValueError, match="candidates must increase"):
        Slots((Slot(1, (3, 1)),))


def test_a_table_without_any_candidate_is_refused() -> None:
    table = _table({2: 10}, {2: {1: 100.0}})
    with pytest.raises(ValueError, match="the table has none of the candidates"):
        AdaptiveModel.of(DEFAULT_SLOTS, table)


@pytest.mark.parametrize("concurrency", [-1.0, float("nan"), float("inf")])
def test_bad_concurrency(concurrency: float) -> None:
    with pytest.raises(ValueError, match="concurrency must be"):
        AdaptiveModel.of(DEFAULT_SLOTS, TABLE).throughput(concurrency)
