"""The configured calibration table, read from its file for the brain.

The core never reads files: the daemon asks `CalibrationFile.current()` each tick and hands
the result to `step`. A stat per tick, a re-read and a new α fit only when the file changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from specd.core.choices import Offer, as_applied, for_policy, offer, table_steps
from specd.core.model import Calibration
from specd.core.perftable import PerfTableError
from specd.core.setting import SpecSetting, adaptive_config_name, format_setting
from specd.core.setting import parse as parse_setting
from specd.core.text import one_line
from specd.io.tables import read_table

if TYPE_CHECKING:
    from specd.core.setting import ServerTraits
    from specd.core.settings import ChooseSettings


class CalibrationError(ValueError):
    """A calibration that cannot be used; one line naming the file."""


def read_calibration(path: str | Path) -> Calibration:
    """The table at ``path`` with its fitted α; CalibrationError if it cannot be used."""
    p = Path(path)
    try:
        table = read_table(p)
    except PerfTableError as exc:
        raise CalibrationError(str(exc)) from None
    if not any(k >= 1 for k in table.steps()):
        raise CalibrationError(f"{p}: calibration has no speculative step count (steps >= 1)")
    return Calibration.of(table)


UNKNOWN_CHOICES = (
    "unknown while the calibration cannot be read ({problem}): a running specd offers from "
    "the last good table it read, which only it knows; its next start refuses the file"
)


def configured_offer(
    choose: ChooseSettings,
    traits: ServerTraits | None,
    static_only: str | None,
    algorithm: str | None = None,
) -> tuple[Offer | None, list[str]]:
    """What specd may choose on a server of ``traits`` with the configured calibration
    (read once), as the daemon offers it (`specd.core.choices.offer`), and what doctor and
    status say of it: `Offer.lines`, then `swept_lines`; None and why, one line, where the
    configured calibration cannot be read. ``algorithm``: the one specd
    applies ([sglang] speculative_algorithm), standing in where the server runs off
    (`specd.core.choices.as_applied`, as the daemon judges it)."""
    traits = as_applied(traits, algorithm)
    calibration: Calibration | None = None
    if choose.calibration_file is not None:
        try:
            calibration = read_calibration(choose.calibration_file)
        except CalibrationError as exc:
            # Not what no calibration offers (everything, rows unchecked): the daemon keeps
            # its last good table.
            return None, [UNKNOWN_CHOICES.format(problem=one_line(exc, 200))]
    got = for_policy(
        offer(
            choose, traits, None if calibration is None else table_steps(calibration), static_only
        ),
        choose.policy,
    )
    return got, [*got.lines(), *swept_lines(calibration, got.settings)]


def swept_lines(calibration: Calibration | None, offered: Sequence[SpecSetting]) -> list[str]:
    """One line per adaptive set of ``offered`` the calibration swept (``specd sweep
    --adaptive`` rows): the ratio of its rows to its candidates' that the model predicts it
    by (`Calibration.set_factor`); then one per set it swept that is not offered. None
    without a calibration."""
    if calibration is None:
        return []
    sets = [s for s in offered if s.kind == "adaptive"]
    lines = []
    for setting in sets:
        factor = calibration.set_factor(setting)
        if factor is not None:
            lines.append(
                f"{format_setting(setting)}: swept: predicted at {factor:.3f} × its "
                "candidates' rows until it has served here"
            )
    # A sweep of a set specd may not choose is read by nothing: say so, not nothing.
    names = {adaptive_config_name(s) for s in sets}  # one set however written
    lines += [
        f"{text}: swept, but not offered: specd does not choose it (not in [choose] "
        "adaptive_candidate_sets, or not offered on this server)"
        for text in calibration.table.measured_settings()
        if adaptive_config_name(parse_setting(text)) not in names
    ]
    return lines


class CalibrationFile:
    """One configured calibration path; `current` re-reads it only when it changes.

    A file that was good and turns unusable under the running daemon (swapped for a bad
    one, removed, half written) keeps the last good calibration in use, as a bad reload
    keeps the running config: a broken file must not turn specd into a daemon without a
    calibration, which explores from the bands and restarts SGLang to learn what the good
    file said. The problem is still returned, so every decision names it."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self._key: tuple[int, int, int, int] | None = None
        self._good: Calibration | None = None  # the last calibration the file gave
        self._problem: str | None = None  # why the file as last read gives none

    def current(self) -> tuple[Calibration | None, str | None]:
        """(the calibration, None); (the last good one or None, a one-line problem) when
        the file cannot be used now; (None, None) when unset."""
        if self.path is None:
            return None, None
        try:
            st = self.path.stat()
        except OSError as exc:
            self._key = None
            return self._good, f"{self.path}: cannot read calibration: {exc.strerror or exc}"
        # A new inode too: editors and `specd sweep` replace the file by renaming.
        key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._key:
            try:
                self._good, self._problem = read_calibration(self.path), None
            except CalibrationError as exc:
                self._problem = str(exc)
            self._key = key
        return self._good, self._problem
