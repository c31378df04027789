"""Performance tables: aggregate output tok/s per (speculative steps, concurrency).

The CSV format is
``steps,concurrency,output_tok_s[,accept_length][,max_running_requests][,setting]``:
aggregate output tokens/s of the whole server at that many concurrent closed-loop clients;
steps 0 means speculation off; empty cells are unknown. ``setting`` names the kind of
setting a row measured (`specd.core.setting.parse` form): empty, the step count or "off"
for the static and off rows the curves are built from; an adaptive set ("adaptive:3,4",
steps = its deepest candidate) for rows kept apart (`measured_settings`), so static
prediction never reads them and a measured adaptive set can be checked against the model.
Values no server measures refuse the whole table with ``file:line: problem``: steps past
``MAX_STEPS``, a concurrency or capacity past ``MAX_RUNNING_REQUESTS``, a throughput past
``MAX_TOKENS_PER_S`` (core.observation's bounds), an accept length below 1 or past
steps + 1 by more than ``ACCEPT_LENGTH_NOISE_RATIO`` (so an off row's is empty or 1).
The twin serves from a table, `specd sweep` writes one, and the model policy reads one.
``specd.io.tables`` reads and writes the files (bounded, atomic); this module parses and
renders text.

Reading a table (`reading_points`, `interpolate`; the model, replay's truth and `specd
sweep` read it so): a measured point comes back exactly; between measured points the
curve is linear, below the first it scales from the origin, past the last it stays flat.
With a capacity (``max_running_requests``) clients beyond it queue, so every point at or
past capacity measured the plateau: they come back as measured, and from capacity up to
the first of them the curve is that point's value. A curve measured only below capacity
is read up to capacity and flat from there.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from specd.core.observation import MAX_RUNNING_REQUESTS, MAX_STEPS, MAX_TOKENS_PER_S
from specd.core.setting import format_setting
from specd.core.setting import parse as parse_setting
from specd.core.text import BOM_PROBLEM

REQUIRED_COLUMNS = ("steps", "concurrency", "output_tok_s")
OPTIONAL_COLUMNS = ("accept_length", "max_running_requests", "setting")
# A row's accept length is measured: every verify yields the bonus token plus at most one
# per step, so 1 <= L <= steps + 1, give or take the measurement's noise (bench/truth's
# generated sweeps carry 1 % of it, floored at 1: an off row there reads 1.005). Past
# that a row did not measure what it says (50 at 1 step), and the table is refused.
ACCEPT_LENGTH_NOISE_RATIO = 0.02
# The longest setting text a row may hold ("adaptive:..." with 16 slots of 8 candidates is
# well under this); longer is not a setting and is refused before parsing.
MAX_SETTING_CHARS = 512

_K = TypeVar("_K", int, str)
ALL_COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS


def csv_rows(
    reader: Iterator[list[str]], source: str, error: type[Exception]
) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) of a CSV reader; the csv module's own errors (a field over its
    128 KiB limit, a NUL byte) as ``error`` naming the source and line, not a traceback: a
    file handed to specd must never take a command, or the running daemon, down."""
    line_no = 0
    try:
        for line_no, cells in enumerate(reader, start=1):
            yield line_no, cells
    except csv.Error as exc:
        raise error(f"{source}:{line_no + 1}: not a CSV row ({exc})") from None


class PerfTableError(ValueError):
    """A table file that cannot be used; the message is one line with the location."""


@dataclass(frozen=True)
class PerfRow:
    steps: int
    concurrency: float
    output_tok_s: float
    accept_length: float | None = None
    max_running_requests: int | None = None
    # An adaptive set in its text form (`format_setting`); None for a static or off row.
    setting: str | None = None


@dataclass
class _StepCurve:
    concurrency: list[float] = field(default_factory=list)
    tok_s: list[float] = field(default_factory=list)
    accept_length: float | None = None
    capacity: int | None = None
    # The points the curve is read through (`reading_points`), set once all rows are in.
    xs: tuple[float, ...] = ()
    ys: tuple[float, ...] = ()


def interpolate(xs: Sequence[float], ys: Sequence[float], c: float) -> float:
    """Piecewise-linear through (xs, ys): from the origin below the first point, flat past
    the last; a point of ``xs`` comes back exactly."""
    if c <= xs[0]:
        return ys[0] * c / xs[0]
    if c >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, c)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (c - x0) / (x1 - x0)


def reading_points(
    xs: Sequence[float], ys: Sequence[float], capacity: float | None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The points a curve measured at (xs, ys), sorted by xs, is read through.

    Without a capacity they are the measured points. With one, every measured point at or
    past it is the plateau and is kept as measured; a point at capacity is added with the
    first plateau point's value, so the plateau starts there, not at the next measured
    concurrency. Measured only below capacity: the curve is read up to capacity (one point
    added there) and flat past it, because the clients beyond capacity queue.
    """
    points = list(zip(xs, ys, strict=True))
    if capacity is None or not points:
        return tuple(xs), tuple(ys)
    cap = float(capacity)
    below = [(x, y) for x, y in points if x < cap]
    plateau = [(x, y) for x, y in points if x >= cap]
    if plateau:
        if plateau[0][0] > cap:
            plateau.insert(0, (cap, plateau[0][1]))
        out = below + plateau
    else:
        bx, by = [x for x, _ in below], [y for _, y in below]
        out = [*below, (cap, interpolate(bx, by, cap))]
    return tuple(x for x, _ in out), tuple(y for _, y in out)


class PerfTable:
    """Throughput per step count, piecewise-linear in concurrency, saturating at capacity."""

    def __init__(self, rows: Iterable[PerfRow], source: str = "<table>") -> None:
        self.source = source
        ordered = sorted(rows, key=lambda r: (r.setting or "", r.steps, r.concurrency))
        # Static and off rows: the curves every prediction reads.
        self.rows: list[PerfRow] = [r for r in ordered if r.setting is None]
        # Adaptive rows: measured to check a prediction, never read as a step count's curve.
        self.setting_rows: list[PerfRow] = [r for r in ordered if r.setting is not None]
        if not self.rows:
            raise PerfTableError(
                f"{source}: no data rows" if not self.setting_rows else
                f"{source}: no static or off rows (only adaptive ones)"
            )  # fmt: skip
        self._curves: dict[int, _StepCurve] = _curves(
            self.rows, lambda r: r.steps, lambda r: f"steps {r.steps}", source
        )
        self._setting_curves: dict[str, _StepCurve] = _curves(
            self.setting_rows, lambda r: r.setting or "", lambda r: f"{r.setting}", source
        )

    # -- reading -----------------------------------------------------------------------

    @classmethod
    def from_csv_text(cls, text: str, source: str = "<table>") -> PerfTable:
        """Parse the CSV text of a table; ``source`` names it in every error."""
        if text.startswith("\ufeff"):
            raise PerfTableError(f"{source}: {BOM_PROBLEM}")
        reader = csv.reader(io.StringIO(text))
        header: list[str] | None = None
        rows: list[PerfRow] = []
        for line_no, raw_cells in csv_rows(reader, source, PerfTableError):
            cells = [c.strip() for c in raw_cells]
            if not cells or all(not c for c in cells) or cells[0].startswith("#"):
                continue
            if header is None:
                header = cells
                unknown = [c for c in header if c not in ALL_COLUMNS]
                missing = [c for c in REQUIRED_COLUMNS if c not in header]
                if unknown or missing:
                    raise PerfTableError(
                        f"{source}:{line_no}: header must be "
                        f"{','.join(REQUIRED_COLUMNS)}[,accept_length][,max_running_requests][,setting]"
                        f" (unknown: {','.join(unknown) or '-'}; missing: "
                        f"{','.join(missing) or '-'})"
                    )
                continue
            if len(cells) != len(header):
                raise PerfTableError(
                    f"{source}:{line_no}: expected {len(header)} cells, got {len(cells)}"
                )
            values = dict(zip(header, cells, strict=True))
            rows.append(_parse_row(values, f"{source}:{line_no}"))
        if header is None:
            raise PerfTableError(f"{source}: empty file (no header)")
        return cls(rows, source=source)

    # -- writing -----------------------------------------------------------------------

    def to_csv_text(self) -> str:
        rows = self.rows + self.setting_rows
        has_accept = any(r.accept_length is not None for r in rows)
        has_capacity = any(r.max_running_requests is not None for r in rows)
        # Written only when there is an adaptive row: a static table reads as it always did.
        has_setting = bool(self.setting_rows)
        columns = list(REQUIRED_COLUMNS)
        if has_accept:
            columns.append("accept_length")
        if has_capacity:
            columns.append("max_running_requests")
        if has_setting:
            columns.append("setting")
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        for r in rows:
            line = [str(r.steps), _fmt(r.concurrency), _fmt(r.output_tok_s)]
            if has_accept:
                line.append("" if r.accept_length is None else _fmt(r.accept_length))
            if has_capacity:
                line.append("" if r.max_running_requests is None else str(r.max_running_requests))
            if has_setting:
                line.append(r.setting or "")
            writer.writerow(line)
        return out.getvalue()

    # -- queries -----------------------------------------------------------------------

    def steps(self) -> list[int]:
        return sorted(self._curves)

    def capacity(self, steps: int) -> int | None:
        return self._curve(steps).capacity

    def accept_length(self, steps: int) -> float | None:
        return self._curve(steps).accept_length

    def points(self, steps: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The points ``steps``' curve is read through (`reading_points`)."""
        curve = self._curve(steps)
        return curve.xs, curve.ys

    def throughput(self, steps: int, concurrency: float) -> float:
        """Aggregate output tok/s at ``concurrency`` closed-loop clients.

        A measured point comes back exactly; linear between measured points, from the
        origin below the first, flat past the last; at and past ``max_running_requests``
        the plateau the points there measured (`reading_points`).
        """
        if not math.isfinite(concurrency) or concurrency < 0:
            raise ValueError(f"concurrency must be a finite number >= 0, got {concurrency!r}")
        curve = self._curve(steps)
        return interpolate(curve.xs, curve.ys, concurrency)

    def measured_settings(self) -> list[str]:
        """The adaptive sets the table measured, in their text form."""
        return sorted(self._setting_curves)

    def setting_capacity(self, setting: str) -> int | None:
        return self._setting_curve(setting).capacity

    def setting_throughput(self, setting: str, concurrency: float) -> float:
        """Measured aggregate tok/s of an adaptive set, read as a step count's curve is."""
        if not math.isfinite(concurrency) or concurrency < 0:
            raise ValueError(f"concurrency must be a finite number >= 0, got {concurrency!r}")
        curve = self._setting_curve(setting)
        return interpolate(curve.xs, curve.ys, concurrency)

    def _setting_curve(self, setting: str) -> _StepCurve:
        try:
            return self._setting_curves[setting]
        except KeyError:
            known = " ".join(self.measured_settings()) or "none"
            raise KeyError(
                f"{self.source}: no rows for setting {setting} (measured: {known})"
            ) from None

    def _curve(self, steps: int) -> _StepCurve:
        try:
            return self._curves[steps]
        except KeyError:
            known = ",".join(str(s) for s in self.steps())
            raise KeyError(
                f"{self.source}: no data for steps {steps} (table has steps {known})"
            ) from None

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PerfTable)
            and self.rows == other.rows
            and self.setting_rows == other.setting_rows
        )

    __hash__ = None  # type: ignore[assignment]


def _curves(
    rows: Sequence[PerfRow],
    key: Callable[[PerfRow], _K],
    name: Callable[[PerfRow], str],
    source: str,
) -> dict[_K, _StepCurve]:
    """One curve per key from rows sorted by (key, concurrency)."""
    curves: dict[_K, _StepCurve] = {}
    for row in rows:
        curve = curves.setdefault(key(row), _StepCurve())
        if curve.concurrency and curve.concurrency[-1] == row.concurrency:
            raise PerfTableError(
                f"{source}: duplicate row for {name(row)} at concurrency {row.concurrency:g}"
            )
        curve.concurrency.append(row.concurrency)
        curve.tok_s.append(row.output_tok_s)
        # The first known value per step wins; tables written by sweep repeat it.
        if row.accept_length is not None and curve.accept_length is None:
            curve.accept_length = row.accept_length
        if row.max_running_requests is not None and curve.capacity is None:
            curve.capacity = row.max_running_requests
    for curve in curves.values():
        curve.xs, curve.ys = reading_points(curve.concurrency, curve.tok_s, curve.capacity)
    return curves


def _fmt(value: float) -> str:
    text = f"{value:.6g}" if not float(value).is_integer() else str(int(value))
    return text


def _parse_row(values: dict[str, str], where: str) -> PerfRow:
    def number(
        name: str, *, integer: bool = False, minimum: float = 0.0, maximum: float = math.inf
    ) -> float | None:
        raw = values.get(name, "")
        if raw == "":
            return None
        try:
            value = float(raw)
        except ValueError:
            raise PerfTableError(f"{where}: {name} is not a number: {raw!r}") from None
        if not math.isfinite(value) or value < minimum:
            raise PerfTableError(f"{where}: {name} must be a finite number >= {minimum:g}")
        if integer and not value.is_integer():
            raise PerfTableError(f"{where}: {name} must be a whole number, got {raw!r}")
        if value > maximum:
            # Bounds of what one server does (core.observation): past them, not a measurement.
            raise PerfTableError(f"{where}: {name} {raw} is more than {maximum:g}")
        return value

    steps = number("steps", integer=True, maximum=MAX_STEPS)
    concurrency = number("concurrency", maximum=MAX_RUNNING_REQUESTS)
    tok_s = number("output_tok_s", maximum=MAX_TOKENS_PER_S)
    for name, value in (("steps", steps), ("concurrency", concurrency), ("output_tok_s", tok_s)):
        if value is None:
            raise PerfTableError(f"{where}: {name} is required")
    assert steps is not None
    assert concurrency is not None
    assert tok_s is not None
    if concurrency <= 0:
        raise PerfTableError(f"{where}: concurrency must be > 0")
    accept = number("accept_length", minimum=1.0)
    if accept is not None and accept > (steps + 1) * (1 + ACCEPT_LENGTH_NOISE_RATIO):
        raise PerfTableError(
            f"{where}: accept_length {values['accept_length']} is more than steps + 1 = "
            f"{int(steps) + 1} (each verify accepts at most one token per step and the bonus)"
        )
    capacity = number(
        "max_running_requests", integer=True, minimum=1.0, maximum=MAX_RUNNING_REQUESTS
    )
    return PerfRow(
        steps=int(steps),
        concurrency=concurrency,
        output_tok_s=tok_s,
        accept_length=accept,
        max_running_requests=None if capacity is None else int(capacity),
        setting=_parse_setting(values.get("setting", ""), int(steps), where),
    )


def _parse_setting(raw: str, steps: int, where: str) -> str | None:
    """The adaptive set a row measured, canonical; None for a static or off row (whose
    cell, when given, must agree with its steps)."""
    if raw == "":
        return None
    if len(raw) > MAX_SETTING_CHARS:
        raise PerfTableError(f"{where}: setting is longer than {MAX_SETTING_CHARS} characters")
    try:
        setting = parse_setting(raw)
    except ValueError as exc:
        raise PerfTableError(f"{where}: {exc}") from None
    if setting.max_steps != steps:
        raise PerfTableError(
            f"{where}: setting {format_setting(setting)} runs at most {setting.max_steps} "
            f"steps, the row says steps {steps}"
        )
    return format_setting(setting) if setting.kind == "adaptive" else None
