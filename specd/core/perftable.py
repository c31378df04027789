"""Performance tables: aggregate output tok/s per (speculative steps, concurrency).

The CSV format is
``steps,concurrency,output_tok_s[,accept_length][,max_running_requests]``: aggregate
output tokens/s of the whole server at that many concurrent closed-loop clients; steps 0
means speculation off; empty cells are unknown. The twin serves from a table, `specd
sweep` writes one, and the model policy reads one. ``specd.io.tables`` reads and writes
the files (bounded, atomic); this module parses and renders text.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

REQUIRED_COLUMNS = ("steps", "concurrency", "output_tok_s")
OPTIONAL_COLUMNS = ("accept_length", "max_running_requests")
ALL_COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS


class PerfTableError(ValueError):
    """A table file that cannot be used; the message is one line with the location."""


@dataclass(frozen=True)
class PerfRow:
    steps: int
    concurrency: float
    output_tok_s: float
    accept_length: float | None = None
    max_running_requests: int | None = None


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
        self.rows: list[PerfRow] = sorted(rows, key=lambda r: (r.steps, r.concurrency))
        self._curves: dict[int, _StepCurve] = {}
        for row in self.rows:
            curve = self._curves.setdefault(row.steps, _StepCurve())
            if curve.concurrency and curve.concurrency[-1] == row.concurrency:
                raise PerfTableError(
                    f"{source}: duplicate row for steps {row.steps} at concurrency "
                    f"{row.concurrency:g}"
                )
            curve.concurrency.append(row.concurrency)
            curve.tok_s.append(row.output_tok_s)
            # The first known value per step wins; tables written by sweep repeat it.
            if row.accept_length is not None and curve.accept_length is None:
                curve.accept_length = row.accept_length
            if row.max_running_requests is not None and curve.capacity is None:
                curve.capacity = row.max_running_requests
        if not self._curves:
            raise PerfTableError(f"{source}: no data rows")
        for curve in self._curves.values():
            curve.xs, curve.ys = reading_points(curve.concurrency, curve.tok_s, curve.capacity)

    # -- reading -----------------------------------------------------------------------

    @classmethod
    def from_csv_text(cls, text: str, source: str = "<table>") -> PerfTable:
        """Parse the CSV text of a table; ``source`` names it in every error."""
        reader = csv.reader(io.StringIO(text))
        header: list[str] | None = None
        rows: list[PerfRow] = []
        for line_no, raw_cells in enumerate(reader, start=1):
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
                        f"{','.join(REQUIRED_COLUMNS)}[,accept_length][,max_running_requests]"
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
        has_accept = any(r.accept_length is not None for r in self.rows)
        has_capacity = any(r.max_running_requests is not None for r in self.rows)
        columns = list(REQUIRED_COLUMNS)
        if has_accept:
            columns.append("accept_length")
        if has_capacity:
            columns.append("max_running_requests")
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(columns)
        for r in self.rows:
            line = [str(r.steps), _fmt(r.concurrency), _fmt(r.output_tok_s)]
            if has_accept:
                line.append("" if r.accept_length is None else _fmt(r.accept_length))
            if has_capacity:
                line.append("" if r.max_running_requests is None else str(r.max_running_requests))
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

    def _curve(self, steps: int) -> _StepCurve:
        try:
            return self._curves[steps]
        except KeyError:
            known = ",".join(str(s) for s in self.steps())
            raise KeyError(
                f"{self.source}: no data for steps {steps} (table has steps {known})"
            ) from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerfTable) and self.rows == other.rows

    __hash__ = None  # type: ignore[assignment]


def _fmt(value: float) -> str:
    text = f"{value:.6g}" if not float(value).is_integer() else str(int(value))
    return text


def _parse_row(values: dict[str, str], where: str) -> PerfRow:
    def number(name: str, *, integer: bool = False, minimum: float = 0.0) -> float | None:
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
        return value

    steps = number("steps", integer=True)
    concurrency = number("concurrency")
    tok_s = number("output_tok_s")
    for name, value in (("steps", steps), ("concurrency", concurrency), ("output_tok_s", tok_s)):
        if value is None:
            raise PerfTableError(f"{where}: {name} is required")
    assert steps is not None
    assert concurrency is not None
    assert tok_s is not None
    if concurrency <= 0:
        raise PerfTableError(f"{where}: concurrency must be > 0")
    accept = number("accept_length", minimum=1.0)
    capacity = number("max_running_requests", integer=True, minimum=1.0)
    return PerfRow(
        steps=int(steps),
        concurrency=concurrency,
        output_tok_s=tok_s,
        accept_length=accept,
        max_running_requests=None if capacity is None else int(capacity),
    )
