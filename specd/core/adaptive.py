"""SGLang's ``--speculative-adaptive`` as a throughput model: a set of candidate step counts
per batch-size slot, switched per batch with no restart.

SGLang (0.5.23, ``srt/speculative/adaptive_spec_params.py``) reads slots from
``--speculative-adaptive-config`` (``{"1": {"candidate_steps": [1, 3, 5, 7]}, ...}``, a
batch-size threshold per key) or its ``DEFAULT_ADAPTIVE_CONFIG`` (`DEFAULT_SLOTS`). A batch
runs in the slot of the largest threshold at or below its size (a batch below every
threshold in the first slot), at one of that slot's candidates; 0 means no drafting. Every
candidate is built at start and every request's KV is sized for the deepest candidate, so
the server's capacity is the deepest candidate's ``max_running_requests``.

The model here takes, for each batch, the best candidate of its slot: an upper bound of
what SGLang's acceptance-driven switching achieves (it moves between candidates by an
average of accepted drafts, with hysteresis, so it can sit at a worse one). Candidates the
table cannot predict are skipped, and a slot left without any is as if not configured
(SGLang's routing then sends its batches to the slot below). The candidate set is general:
`DEFAULT_SLOTS` is SGLang's, and any other set specd may choose is a `Slots` too.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

# The largest step count a candidate may have (SGLang builds a CUDA graph set per candidate).
MAX_CANDIDATE_STEPS = 16
# Batch sizes `Slots.slot_for` remembers per set of slots (whole concurrencies, in practice).
_ROUTED_MAX = 4096


class Throughputs(Protocol):
    """What the model reads: a `PerfTable` (replay's truth) or the `PerformanceModel`."""

    def steps(self) -> list[int]: ...

    def capacity(self, steps: int) -> int | None: ...

    def throughput(self, steps: int, concurrency: float) -> float: ...


@dataclass(frozen=True)
class Slot:
    """Batches of ``min_batch`` requests or more (up to the next slot) run one of these."""

    min_batch: int
    candidates: tuple[int, ...]


@dataclass(frozen=True)
class Slots:
    """Batch-size thresholds → candidate step counts, sorted by threshold."""

    slots: tuple[Slot, ...]

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError("adaptive slots: at least one slot is needed")
        thresholds = [s.min_batch for s in self.slots]
        if thresholds != sorted(set(thresholds)):
            raise ValueError(f"adaptive slots: batch thresholds must increase, got {thresholds}")
        for slot in self.slots:
            if slot.min_batch < 1:
                raise ValueError(f"adaptive slots: batch threshold {slot.min_batch} is below 1")
            if not slot.candidates:
                raise ValueError(f"adaptive slots: batch {slot.min_batch} has no candidates")
            if list(slot.candidates) != sorted(set(slot.candidates)):
                raise ValueError(
                    f"adaptive slots: batch {slot.min_batch} candidates must increase, "
                    f"got {list(slot.candidates)}"
                )
            bad = [k for k in slot.candidates if not 0 <= k <= MAX_CANDIDATE_STEPS]
            if bad:
                raise ValueError(
                    f"adaptive slots: batch {slot.min_batch} candidate steps {bad} outside "
                    f"0-{MAX_CANDIDATE_STEPS}"
                )

    @classmethod
    def of(cls, mapping: Mapping[int, Sequence[int]]) -> Slots:
        """From ``{min_batch: candidates}`` (any order; candidates deduplicated)."""
        return cls(tuple(Slot(int(b), tuple(sorted(set(mapping[b])))) for b in sorted(mapping)))

    def to_sglang_config(self) -> dict[str, dict[str, list[int]]]:
        """The ``--speculative-adaptive-config`` JSON object for these slots."""
        return {str(s.min_batch): {"candidate_steps": list(s.candidates)} for s in self.slots}

    def candidates(self) -> list[int]:
        """Every candidate of every slot: what SGLang builds at start."""
        return list(self.candidate_steps)

    @functools.cached_property
    def candidate_steps(self) -> tuple[int, ...]:
        """`candidates` as a tuple, made once per (immutable) Slots: the model reads it for
        every adaptive set at every tick."""
        return tuple(sorted({k for s in self.slots for k in s.candidates}))

    @functools.cached_property
    def _thresholds(self) -> tuple[int, ...]:
        # Once per (immutable) Slots: slot_for runs per concurrency bin per tick.
        return tuple(s.min_batch for s in self.slots)

    @functools.cached_property
    def _routed(self) -> dict[float, Slot]:
        # A memo of `slot_for` (a pure function of these immutable slots) per batch size.
        return {}

    @functools.cached_property
    def _usable_for(self) -> dict[tuple[int, ...], tuple[Slots, tuple[int, ...], int] | str]:
        # A memo of `_usable` (pure, of these immutable slots) per table's steps.
        return {}

    def slot_for(self, batch: float) -> Slot:
        """The slot a batch of ``batch`` requests runs in (SGLang's routing)."""
        slot = self._routed.get(batch)
        if slot is None:
            i = bisect.bisect_right(self._thresholds, batch) - 1
            slot = self.slots[max(i, 0)]
            if len(self._routed) < _ROUTED_MAX:
                self._routed[batch] = slot
        return slot

    def describe(self) -> str:
        return " ".join(f"≥{s.min_batch}:[{','.join(map(str, s.candidates))}]" for s in self.slots)


def _usable(slots: Slots, steps: tuple[int, ...]) -> tuple[Slots, tuple[int, ...], int]:
    """``slots`` with only the candidates of ``steps`` (a table's), the candidates left out,
    and the deepest one kept; ValueError when none is kept."""
    # Kept per steps on the (immutable) slots: the model reads it for every adaptive set
    # at every tick, and a cache keyed by the slots hashed them (a Python call per slot).
    memo = slots._usable_for
    found = memo.get(steps)
    if found is None:
        found = _usable_made(slots, steps)
        if len(memo) < _ROUTED_MAX:
            memo[steps] = found
    if isinstance(found, str):
        raise ValueError(found)
    return found


def _usable_made(slots: Slots, steps: tuple[int, ...]) -> tuple[Slots, tuple[int, ...], int] | str:
    """`_usable`, or why none is kept."""
    known = set(steps)
    kept = {
        s.min_batch: tuple(k for k in s.candidates if k in known)
        for s in slots.slots
        if any(k in known for k in s.candidates)
    }
    skipped = tuple(k for k in slots.candidates() if k not in known)
    if not kept:
        return (
            f"adaptive slots {slots.describe()}: the table has none of the candidates "
            f"(it has steps {','.join(map(str, sorted(known))) or '-'})"
        )
    usable = Slots.of(kept)
    return usable, skipped, max(usable.candidates())


# SGLang 0.5.23's DEFAULT_ADAPTIVE_CONFIG (srt/speculative/adaptive_spec_params.py).
DEFAULT_SLOTS = Slots.of({1: (1, 3, 5, 7), 8: (0, 1, 3), 32: (0, 1), 64: (0,)})


@dataclass(frozen=True)
class AdaptiveModel:
    """A candidate set over what a table (or the model) says each candidate serves."""

    configured: Slots
    slots: Slots  # the configured slots with only the candidates ``table`` knows
    table: Throughputs
    skipped: tuple[int, ...]  # configured candidates the table lacks
    capacity: int | None  # the deepest known candidate's: every request's KV is sized so

    @classmethod
    def of(cls, slots: Slots, table: Throughputs) -> AdaptiveModel:
        usable, skipped, deepest = _usable(slots, tuple(table.steps()))
        return cls(slots, usable, table, skipped, table.capacity(deepest))

    def batch(self, concurrency: float) -> float:
        """Requests running at ``concurrency`` offered: the rest queue past capacity."""
        return concurrency if self.capacity is None else min(concurrency, float(self.capacity))

    def choice(self, concurrency: float) -> int:
        """The candidate the batch at ``concurrency`` runs (the best of its slot)."""
        return self._best(concurrency)[0]

    def throughput(self, concurrency: float) -> float:
        """Aggregate output tok/s at ``concurrency`` offered."""
        return self._best(concurrency)[1]

    def _best(self, concurrency: float) -> tuple[int, float]:
        if not math.isfinite(concurrency) or concurrency < 0:
            raise ValueError(f"concurrency must be a finite number >= 0, got {concurrency!r}")
        batch = self.batch(concurrency)
        slot = self.slots.slot_for(batch)
        # Ties go to the shallower candidate (less drafting for the same tokens).
        rates = [(self.table.throughput(k, batch), -k) for k in slot.candidates]
        rate, neg_k = max(rates)
        return -neg_k, rate
