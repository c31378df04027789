"""Which settings specd may choose for the epoch ahead: what the operator allows ([choose]
kinds, adaptive_candidate_sets), what the server can run (its traits, /server_info), what
its unit can be given (a unit still wired with the step variables takes static K only) and
what the calibration can predict (off needs its steps-0 row, a set a row for each of its
step counts: a prediction of the rest would be a guess about the deepest candidate's
capacity).

Pure. The model policy predicts only what `offer` returns; `specd doctor` and `specd
status` print each kind with the reason it is not offered.

SGLang's adaptive mode runs for EAGLE, EAGLE3 and NEXTN chains (topk 1) without DP
attention, multi-layer EAGLE, two-batch overlap or PD multiplexing
(`specd.core.setting.unavailable`); specd offers it only where the config file has
per-batch-size slots (0.5.13+, `sglang_features.ADAPTIVE_SLOTS`), and a set with a 0
("no drafting") tier only where a slot may hold it (0.5.14+).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from specd.core.setting import (
    KINDS,
    Kind,
    ServerTraits,
    SpecSetting,
    adaptive,
    format_setting,
    off,
    static,
    unavailable,
)
from specd.core.setting import parse as parse_setting
from specd.core.sglang_features import ADAPTIVE_SLOTS, version_text

if TYPE_CHECKING:
    from specd.core.model import Calibration
    from specd.core.settings import ChooseSettings


# The policies that choose among kinds of setting (off, static, adaptive); the others pick
# a static K only (`specd.core.decide.POLICIES`).
CHOOSES_KINDS = frozenset({"model"})


@dataclass(frozen=True)
class Offer:
    """The settings specd may choose, and why each kind or set is not offered."""

    # Each kind with the reason it is not offered; None when it is.
    kinds: dict[Kind, str | None]
    settings: tuple[SpecSetting, ...]  # static K ascending, then off, then adaptive sets
    refused: tuple[tuple[str, str], ...] = ()  # (adaptive set, why) the server cannot run

    def allows(self, kind: Kind) -> bool:
        return self.kinds.get(kind) is None

    def lines(self) -> list[str]:
        """One line per kind, then per refused set: for doctor and status."""
        out = []
        for kind in KINDS:
            why = self.kinds[kind]
            if why is not None:
                out.append(f"{kind}: not offered: {why}")
                continue
            chosen = [format_setting(s) for s in self.settings if s.kind == kind]
            if kind == "static":
                steps = [s.steps for s in self.settings if s.steps is not None]
                text = f"steps {min(steps)}-{max(steps)}" if steps else "no step count"
            elif kind == "adaptive":
                text = " ".join(chosen) if chosen else "none of the sets"
            else:
                text = "no speculation"
            out.append(f"{kind}: offered ({text})")
        out.extend(f"{text}: not offered: {why}" for text, why in self.refused)
        return out


def as_applied(traits: ServerTraits | None, algorithm: str | None) -> ServerTraits | None:
    """``traits`` with ``algorithm`` (the one specd applies) standing in where the server
    reports none: SGLang running off says no algorithm, yet specd can start it on one (the
    daemon's `_traits`; otherwise off could never be left)."""
    if traits is None or traits.algorithm is not None or algorithm is None:
        return traits
    return replace(traits, algorithm=algorithm.upper(), topk=1)


def for_policy(got: Offer, policy: str) -> Offer:
    """``got`` as ``policy`` reads it: one outside `CHOOSES_KINDS` picks a static K only,
    so it offers no other kind, whatever the server could run (doctor and status say why)."""
    if policy in CHOOSES_KINDS:
        return got
    why = (
        f'the {policy} policy picks a static step count only (policy "model", which a '
        "calibration_file selects, chooses among every kind)"
    )
    kinds: dict[Kind, str | None] = {
        k: v if k == "static" or v is not None else why for k, v in got.kinds.items()
    }
    settings = tuple(s for s in got.settings if s.kind == "static")
    return Offer(kinds, settings, got.refused)


def _adaptive_kind(traits: ServerTraits | None) -> str | None:
    """Why this server cannot run SGLang's adaptive mode as specd writes it, or None."""
    if traits is None:
        return "the server's /server_info has not been read"
    why = unavailable(adaptive((1,)), traits, allow_off=True)
    if why is not None:
        return why
    need = version_text(ADAPTIVE_SLOTS.since)
    if traits.version is None:
        return f"needs SGLang >= {need} (per-batch slots); the server's version is unknown"
    if traits.version < ADAPTIVE_SLOTS.since:
        return (
            f"needs SGLang >= {need} (per-batch slots); the server runs "
            f"{version_text(traits.version)}"
        )
    return None


def cannot_run(
    traits: ServerTraits | None, static_only: str | None, setting: SpecSetting
) -> str | None:
    """Why a server with ``traits`` whose unit can be given static K only when
    ``static_only`` names why, cannot run ``setting`` (any operator's setting, whatever
    [choose] allows); None when it can, or when /server_info has not been read to say."""
    if setting.kind != "static" and static_only is not None:
        return static_only
    if traits is None:
        return None
    if setting.kind == "adaptive":
        return _adaptive_kind(traits) or unavailable(setting, traits, allow_off=True)
    return unavailable(setting, traits, allow_off=True)


def table_steps(calibration: Calibration | None) -> frozenset[int] | None:
    """The step counts ``calibration`` has rows for, as `offer` reads them (None: no
    calibration)."""
    return None if calibration is None else frozenset(calibration.table.steps())


def _unpredictable(setting: SpecSetting, table_steps: frozenset[int] | None) -> str | None:
    lacking = sorted(setting.table_steps - table_steps) if table_steps is not None else []
    if not lacking:
        return None
    return f"the calibration has no rows for steps {','.join(map(str, lacking))}"


# Pure and keyed by frozen values: every tick asks, and they change only on a reload.
@functools.lru_cache(maxsize=64)
def offer(
    choose: ChooseSettings,
    traits: ServerTraits | None,
    table_steps: frozenset[int] | None = None,
    static_only: str | None = None,
) -> Offer:
    """The settings of ``choose`` that a server with ``traits`` can run (None: not read
    yet; static K and off are offered then, as specd has always run static K).

    ``traits.algorithm`` must be the algorithm specd applies: a server running "off"
    reports none, and static K stays offered only if the caller keeps the algorithm.
    ``table_steps``: the step counts the calibration has rows for (None: no calibration,
    nothing to leave out). ``static_only``: why the unit can be given static K only (its
    wiring), or None."""
    allowed = set(choose.kinds)
    kinds: dict[Kind, str | None] = {}
    for kind in KINDS:
        if kind not in allowed:
            kinds[kind] = f"not in [choose] kinds ({', '.join(choose.kinds)})"
        elif kind == "static":
            kinds[kind] = None if traits is None else unavailable(static(1), traits, allow_off=True)
        elif static_only is not None:
            kinds[kind] = static_only
        elif kind == "off":
            lacks_off = table_steps is not None and 0 not in table_steps
            kinds[kind] = "the calibration has no steps-0 row" if lacks_off else None
        else:
            kinds[kind] = _adaptive_kind(traits)
    settings: list[SpecSetting] = []
    refused: list[tuple[str, str]] = []
    if kinds["static"] is None:
        settings += [static(k) for k in range(choose.min_steps, choose.max_steps + 1)]
    if kinds["off"] is None:
        settings.append(off())
    if kinds["adaptive"] is None:
        assert traits is not None
        for text in choose.adaptive_candidate_sets:
            setting = parse_setting(text)
            why = unavailable(setting, traits, allow_off=True) or _unpredictable(
                setting, table_steps
            )
            if why is None:
                settings.append(setting)
            else:
                refused.append((text, why))
    return Offer(kinds, tuple(settings), tuple(refused))
