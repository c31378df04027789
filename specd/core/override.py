"""The on-call override as the brain reads it (the file is io.override's job)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Literal

from specd.core.setting import SpecSetting, format_setting

Mode = Literal["auto", "pin", "freeze"]


Apply = Literal["next-window", "now"]


MODES: tuple[Mode, ...] = ("auto", "pin", "freeze")


APPLIES: tuple[Apply, ...] = ("next-window", "now")


_UTC = timezone.utc


@dataclass(frozen=True)
class Override:
    mode: Mode
    steps: int | None
    expires_at: datetime | None
    reason: str
    apply: Apply
    # A pin of a setting that is not a static step count ("off", "adaptive:3,4"); a static
    # pin says its count in ``steps`` and leaves this None.
    setting: SpecSetting | None = None
    # Unix time the operator decided it (the header `specd override` writes, else the
    # file's mtime: io.override.decided_at); None where not read from a file. Not part of
    # what the override says: the same pin written again means the same.
    decided_at: float | None = field(default=None, compare=False)

    @property
    def pinned_name(self) -> str | None:
        """What a pin holds as the operator writes it ("4", "off", "adaptive:3,4"); None
        for auto and freeze."""
        if self.mode != "pin":
            return None
        if self.setting is not None:
            return format_setting(self.setting)
        return None if self.steps is None else str(self.steps)

    def active(self, now: datetime | float) -> bool:
        """True while a pin or freeze is in force (auto is never "active")."""
        if self.mode == "auto" or self.expires_at is None:
            return False
        return _as_datetime(now) < self.expires_at


def _as_datetime(now: datetime | float) -> datetime:
    if isinstance(now, datetime):
        if now.tzinfo is None:
            raise ValueError("now must be timezone-aware")
        return now
    return datetime.fromtimestamp(now, _UTC)
