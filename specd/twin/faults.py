"""Which launches the twin is told to fail: settings named in specd's text form.

``off``, ``4`` (or ``static:4``), ``adaptive:3,4`` or with per-batch slots
``adaptive:1,3/1=1,3;8=0,1`` (specd.core.setting.parse's grammar; the twin does not import
specd's core, so this is the small part of it the twin needs). An adaptive setting is
matched by the config it makes SGLang read: without slots, one slot "1" holds its
candidates, as specd writes it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ENV_FAIL_SETTINGS = "SPECD_TWIN_FAIL_SETTINGS"  # whitespace-separated settings
_INT = re.compile(r"\d{1,5}")


@dataclass(frozen=True)
class SettingKey:
    kind: str  # off | static | adaptive
    steps: int | None = None
    slots: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def __str__(self) -> str:
        if self.kind == "off":
            return "off"
        if self.kind == "static":
            return str(self.steps)
        union = sorted({s for _, c in self.slots for s in c} - {0})
        text = "adaptive:" + ",".join(map(str, union))
        return text + "/" + ";".join(f"{size}={','.join(map(str, c))}" for size, c in self.slots)


def _ints(text: str, where: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not parts or any(not _INT.fullmatch(p) for p in parts):
        raise ValueError(f"{where}: {text!r} is not a comma-separated list of step counts")
    return tuple(sorted({int(p) for p in parts}))


def parse_setting(text: str) -> SettingKey:
    """One setting in specd's text form; ValueError with a one-line message."""
    raw = text.strip().lower()
    where = f"setting {text!r}"
    if raw == "off":
        return SettingKey("off")
    body = raw.removeprefix("static:")
    if _INT.fullmatch(body):
        if int(body) < 1:
            raise ValueError(f"{where}: a static setting drafts 1 step or more ('off': none)")
        return SettingKey("static", steps=int(body))
    if raw.startswith("adaptive:"):
        cand_text, _, slot_text = raw[len("adaptive:") :].partition("/")
        candidates = _ints(cand_text, where)
        if not slot_text:
            return SettingKey("adaptive", slots=((1, candidates),))
        slots: dict[int, tuple[int, ...]] = {}
        for item in slot_text.split(";"):
            size_text, eq, cands_text = item.partition("=")
            if not eq or not _INT.fullmatch(size_text.strip()):
                raise ValueError(f"{where}: slot {item!r} is not BATCH=STEPS,STEPS,...")
            slots[int(size_text)] = _ints(cands_text, where)
        return SettingKey("adaptive", slots=tuple(sorted(slots.items())))
    raise ValueError(f"{where} is not 'off', a step count such as '4', or 'adaptive:1,3,5'")


def adaptive_key(slots: Mapping[int, Mapping[str, Any]]) -> SettingKey:
    """The setting a loaded adaptive config is (slot size → its candidate steps)."""
    return SettingKey(
        "adaptive",
        slots=tuple(
            (size, tuple(sorted({int(s) for s in cfg["candidate_steps"]})))
            for size, cfg in sorted(slots.items())
        ),
    )


def fail_settings(flags: Sequence[str], env: Mapping[str, str]) -> frozenset[SettingKey]:
    """--fail-setting values plus the environment's list."""
    texts: Iterable[str] = [*flags, *env.get(ENV_FAIL_SETTINGS, "").split()]
    return frozenset(parse_setting(t) for t in texts)
