"""SGLang's ``--speculative-adaptive`` as the twin runs it, read from each version's own
``speculative/adaptive_spec_params.py`` and the server-argument checks that call it.

* 0.5.11-0.5.12: one candidate list for every batch size (a flat
  ``{"candidate_steps": [...]}``, default ``[1, 3, 7]``), at least two distinct, read when
  the worker starts (a bad file kills the server while it loads); adaptive needs
  ``--disable-overlap-schedule`` (it is implemented for the v1 worker only).
* 0.5.13+: slots keyed by batch size (integer-string keys, each ``{"candidate_steps":
  [...]}``; other keys are tuning shared by every slot), read while the server arguments are
  resolved (a bad file is fatal before anything loads); the batch is padded up to the
  CUDA-graph batch size, then routed to the closest slot at or below it. Step 0 (no
  drafting) in a slot from 0.5.14; before, candidates must be positive.
* Each slot keeps an EMA (alpha 0.2) of accepted drafts per request; after 10 warm-up
  batches, every 5th batch moves the slot's step count down while the EMA is at or below
  ``lower - 0.5 + down_hysteresis`` (-0.25) and up while above ``step - 0.5 +
  up_hysteresis`` (0).

Nothing here imports specd's core: the twin is the stand-in for SGLang, not for specd.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specd.io import files

FLAT, SLOTS = "flat", "slots"
# AdaptiveSpeculativeParams' own default before per-batch slots (0.5.11).
FLAT_DEFAULT_CANDIDATES = (1, 3, 7)
# A config is a few hundred bytes (one slot per batch size); a file 1000x that is not one.
MAX_CONFIG_BYTES = 1 * files.MIB


def _slot(steps: list[int], down: float) -> dict[str, Any]:
    return {"candidate_steps": steps, "up_hysteresis": 0.0, "down_hysteresis": down,
            "ceiling_coeff": 0}  # fmt: skip


# DEFAULT_ADAPTIVE_CONFIG of each version that has slots.
DEFAULT_SLOTS_0_5_13: dict[str, dict[str, Any]] = {
    "1": _slot([1, 3, 7], -0.25),
    "8": _slot([1, 3], 0.0),
    "32": _slot([1], 0.0),
}
DEFAULT_SLOTS_0_5_23: dict[str, dict[str, Any]] = {
    "1": _slot([1, 3, 5, 7], -0.25),
    "8": _slot([0, 1, 3], 0.0),
    "32": _slot([0, 1], 0.0),
    "64": _slot([0], 0.0),
}


class AdaptiveConfigError(ValueError):
    """An adaptive config SGLang refuses; the message is the exception line it dies with."""


@dataclass(frozen=True)
class AdaptiveRules:
    """How one SGLang version runs adaptive mode."""

    config: str  # FLAT or SLOTS
    slot_zero: bool  # step 0 allowed in a slot (0.5.14+), with its probing rules
    needs_no_overlap: bool  # only with --disable-overlap-schedule (0.5.11-0.5.12)
    ceiling: bool  # ceiling_coeff is read (0.5.13+)
    # No --speculative-num-steps: the middle candidate (0.5.2x) or SGLang's usual
    # automatic choice, then checked against the candidates (before).
    initial_middle: bool
    # attn DP message wording changed with the argument refactor (0.5.2x).
    dp_reason: str
    default_slots: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @property
    def config_at_start(self) -> bool:
        """The file is read while the arguments resolve (else when the worker loads)."""
        return self.config == SLOTS


def unsupported_reason(
    rules: AdaptiveRules,
    *,
    algorithm: str | None,
    topk: int | None,
    args: Any,
) -> str | None:
    """adaptive_unsupported_reason(): why adaptive falls back to static, else None."""
    if algorithm not in ("EAGLE", "EAGLE3"):
        return f"speculative_algorithm={algorithm} (only EAGLE/EAGLE3 are supported)"
    if topk is not None and topk != 1:
        return f"speculative_eagle_topk={topk} (only topk=1 is supported)"
    if args.enable_dp_attention:
        return rules.dp_reason
    if rules.needs_no_overlap and not args.disable_overlap_schedule:
        return (
            "the overlap scheduler (spec v2) is enabled "
            "(adaptive is only implemented for EAGLEWorker v1)"
        )
    if args.enable_multi_layer_eagle:
        worker = "MultiLayerEagleWorker" if rules.needs_no_overlap else "MultiLayerEagleWorkerV2"
        return (
            f"enable_multi_layer_eagle=True is not supported ({worker} does not implement adaptive)"
        )
    if args.enable_two_batch_overlap:
        return (
            "enable_two_batch_overlap=True is not supported "
            "(adaptive state swap would discard the TboAttnBackend wrapper)"
        )
    if args.enable_pdmux:
        return (
            "enable_pdmux=True is not supported "
            "(adaptive state swap does not update decode_attn_backend_group)"
        )
    return None


def _read(path: str) -> Any:
    """The JSON in the file at ``path``, read as specd reads a file (``specd.io.files``: a
    regular file only, at most ``MAX_CONFIG_BYTES``, nesting bounded), so a FIFO, a device or
    a huge file is one error line naming it, as SGLang would die on a bad file, never a hang
    or a traceback. The message starts with the exception SGLang would die with."""
    try:
        data = files.read_regular_file(path, MAX_CONFIG_BYTES, follow_symlinks=True)
    except files.MissingFileError as exc:
        raise AdaptiveConfigError(f"FileNotFoundError: {exc}") from None
    except files.FileReadError as exc:
        raise AdaptiveConfigError(f"OSError: {exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AdaptiveConfigError(
            f"UnicodeDecodeError: {path}: is not UTF-8 text (byte {exc.start})"
        ) from None
    try:
        return files.parse_json(text)
    except files.ParseError as exc:
        raise AdaptiveConfigError(f"json.decoder.JSONDecodeError: {path}: {exc}") from None


def load_slots(rules: AdaptiveRules, path: str | None) -> dict[int, dict[str, Any]]:
    """Each slot's minimum batch size → its merged settings (global keys, then the slot's)."""
    if rules.config == FLAT:
        cfg = {} if path is None else _read(path)
        if not isinstance(cfg, dict):
            raise AdaptiveConfigError(
                "ValueError: speculative_adaptive_config must be a JSON object, "
                f"got {type(cfg).__name__}"
            )
        steps = cfg.get("candidate_steps", list(FLAT_DEFAULT_CANDIDATES))
        if not isinstance(steps, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in steps
        ):
            # SGLang 0.5.11 does not check; it fails later on such a list. The twin says so.
            raise AdaptiveConfigError(
                f"ValueError: candidate_steps must be a list of positive ints, got {steps!r}"
            )
        if len(set(steps)) < 2:
            raise AdaptiveConfigError(
                "AssertionError: candidate_steps must have at least 2 distinct values"
            )
        return {1: {**cfg, "candidate_steps": steps}}
    cfg = dict(rules.default_slots) if path is None else _read(path)
    if not isinstance(cfg, dict):
        raise AdaptiveConfigError(
            f"AttributeError: '{type(cfg).__name__}' object has no attribute 'items'"
        )
    low = 0 if rules.slot_zero else 1
    kind = "non-negative" if rules.slot_zero else "positive"
    slots: dict[int, dict[str, Any]] = {}
    for key, entry in cfg.items():
        if not key.isdigit():
            continue
        if not isinstance(entry, dict):
            raise AdaptiveConfigError(
                f"AttributeError: '{type(entry).__name__}' object has no attribute 'get'"
            )
        steps = entry.get("candidate_steps")
        if (
            not isinstance(steps, list)
            or not steps
            or not all(isinstance(s, int) and s >= low for s in steps)
        ):
            raise AdaptiveConfigError(
                f"ValueError: BS {key}: candidate_steps must be a list of {kind} ints, "
                f"got {steps!r}"
            )
        slots[int(key)] = {**cfg, **entry}
    if not slots:
        raise AdaptiveConfigError(
            "ValueError: speculative_adaptive_config must contain at least one integer-string "
            'BS key, e.g. {"1": {"candidate_steps": [1,3,7]}}. '
            f"Got keys: {list(cfg.keys())}"
        )
    return slots


def candidate_union(slots: Mapping[int, Mapping[str, Any]]) -> list[int]:
    """resolve_candidate_steps_from_config(): every slot's steps; one graph set each."""
    return sorted({int(s) for cfg in slots.values() for s in cfg["candidate_steps"]})


def initial_steps_error(steps: int, union: list[int]) -> str:
    return (
        f"ValueError: --speculative-num-steps={steps} is not in the adaptive config "
        f"candidate_steps {union}. Pass one of those values."
    )


def cuda_graph_batch_sizes(max_bs: int) -> list[int]:
    """The decode CUDA-graph batch sizes SGLang captures with speculation, up to the
    largest batch it can run (generate_decode_cuda_graph_batch_sizes, capped)."""
    sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8),
             *range(272, max(max_bs, 272) + 1, 16)]  # fmt: skip
    out = sorted({s for s in sizes if s <= max_bs} | {max_bs})
    return out


class Slot:
    """AdaptiveStepSlot: one batch-size slot's EMA of accepted drafts and its step count."""

    def __init__(self, initial_steps: int, cfg: Mapping[str, Any], rules: AdaptiveRules) -> None:
        self.rules = rules
        self.candidate_steps: list[int] = sorted({int(s) for s in cfg["candidate_steps"]})
        self.ema_alpha = float(cfg.get("ema_alpha", 0.2))
        self.update_interval = int(cfg.get("update_interval", 5))
        self.warmup_batches = int(cfg.get("warmup_batches", 10))
        self.down_hysteresis = float(cfg.get("down_hysteresis", -0.25))
        self.up_hysteresis = float(cfg.get("up_hysteresis", 0.0))
        self.ceiling_coeff = float(cfg.get("ceiling_coeff", 0)) if rules.ceiling else 0.0
        if rules.config == FLAT:
            # The candidate nearest the launch steps, the deeper one on a tie.
            self.current_steps = min(
                self.candidate_steps, key=lambda s: (abs(s - initial_steps), -s)
            )
        elif initial_steps in self.candidate_steps:
            self.current_steps = initial_steps
        else:
            self.current_steps = self.candidate_steps[len(self.candidate_steps) // 2]
        self.ema_accept_len = float(self.current_steps - 1)  # SGLang's neutral start
        self.batch_count = 0

    def update(self, mean_correct_drafts: float) -> bool:
        """One verify's mean accepted drafts per request; True when the step count moved."""
        if not (self.rules.slot_zero and self.current_steps == 0):
            a = self.ema_alpha
            self.ema_accept_len = (1 - a) * self.ema_accept_len + a * mean_correct_drafts
        self.batch_count += 1
        if self.batch_count <= self.warmup_batches:
            return False
        if (self.batch_count - self.warmup_batches) % self.update_interval != 0:
            return False
        return self._recompute()

    def _recompute(self) -> bool:
        old = self.current_steps
        idx = old_idx = self.candidate_steps.index(old)
        cands = self.candidate_steps
        if self.rules.slot_zero and old == 0:
            # After an interval without drafting, probe the smallest positive step.
            idx = min(idx + 1, len(cands) - 1)
            target = cands[idx]
            if target > 0 and self.ema_accept_len < 0:
                self.ema_accept_len = float(target - 1)
            return self._apply(target)
        while idx > 0:
            lower = cands[idx - 1]
            drop = 0.5 if (self.rules.slot_zero and lower == 0) else lower - 0.5
            if self.ema_accept_len <= drop + self.down_hysteresis:
                idx -= 1
            else:
                break
        if not (self.rules.slot_zero and idx < old_idx):
            while idx < len(cands) - 1:
                if self.ema_accept_len > cands[idx] - 0.5 + self.up_hysteresis:
                    idx += 1
                else:
                    break
        target = cands[idx]
        if self.ceiling_coeff > 0:
            ceiling = max(1, math.ceil(self.ema_accept_len * self.ceiling_coeff))
            if ceiling < target <= old:
                while idx > 0 and cands[idx] > ceiling:
                    idx -= 1
                target = cands[idx]
        return self._apply(target)

    def _apply(self, target: int) -> bool:
        if target == self.current_steps:
            return False
        self.current_steps = target
        return True


class Controller:
    """AdaptiveSpeculativeParams: routes a batch to its slot (padded to the CUDA-graph batch
    size, then the closest slot at or below), feeds the slot each verify's result."""

    def __init__(
        self,
        initial_steps: int,
        slots: Mapping[int, Mapping[str, Any]],
        rules: AdaptiveRules,
        cuda_graph_bs: list[int] | None,
    ) -> None:
        self.rules = rules
        self.sizes = sorted(slots)
        self.slots = {size: Slot(initial_steps, slots[size], rules) for size in self.sizes}
        self.cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None
        self.switches = 0

    @property
    def candidate_steps(self) -> list[int]:
        return sorted({s for slot in self.slots.values() for s in slot.candidate_steps})

    def padded(self, batch_size: int) -> int:
        if self.cuda_graph_bs is None:
            return batch_size
        i = bisect.bisect_left(self.cuda_graph_bs, batch_size)
        return self.cuda_graph_bs[i] if i < len(self.cuda_graph_bs) else batch_size

    def slot_size(self, batch_size: int) -> int:
        i = bisect.bisect_right(self.sizes, self.padded(batch_size)) - 1
        return self.sizes[max(0, i)]

    def route(self, batch_size: int) -> Slot:
        return self.slots[self.slot_size(batch_size)]

    def steps_for_batch(self, batch_size: int) -> int:
        return self.route(batch_size).current_steps

    def on_verify(self, mean_correct_drafts: float, batch_size: int) -> bool:
        moved = self.route(batch_size).update(mean_correct_drafts)
        self.switches += moved
        return moved
