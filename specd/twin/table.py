"""The twin's performance table: aggregate output tok/s per (speculative steps, concurrency).

The twin's own reading of the CSV format specd shares with it
(``steps,concurrency,output_tok_s[,accept_length][,max_running_requests][,setting]``, see the
design's "Performance tables"): a measured point comes back exactly, linear between points,
the plateau from the capacity on, flat past the last point. Rows whose ``setting`` is an
adaptive set (`specd sweep --adaptive`) are skipped: the twin's adaptive mode runs on the
static rows of its candidates, as SGLang's switches among them. It is deliberately not specd's
``specd.core.perftable``: the twin is the stand-in for the GPU server, so its truth must not
share code with the model it is used to test (the import-linter contract in pyproject.toml).
The file itself is read as specd reads every file (``specd.io.files``): a regular file only, at
most ``MAX_TABLE_BYTES``, so a FIFO or a huge file is one line, never a hang or a traceback.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from specd.io import files

REQUIRED_COLUMNS = ("steps", "concurrency", "output_tok_s")
OPTIONAL_COLUMNS = ("accept_length", "max_running_requests", "setting")
ALL_COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS
# As specd's own (specd.io.tables): the seed table is 1 KB and a dense sweep ~50 KB.
MAX_TABLE_BYTES = 4 * files.MIB


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
    # The points the curve is read through, set once all rows are in.
    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)

    def finish(self) -> None:
        """Every measured point at or past capacity is the plateau, kept as measured, and
        the plateau starts at capacity with the first of them; measured only below
        capacity, the curve is read up to capacity and flat past it (the rest queue)."""
        self.xs, self.ys = list(self.concurrency), list(self.tok_s)
        if self.capacity is None:
            return
        cap = float(self.capacity)
        first = bisect.bisect_left(self.xs, cap)
        if first < len(self.xs):
            if self.xs[first] > cap:
                self.xs.insert(first, cap)
                self.ys.insert(first, self.ys[first])
        else:
            self.ys.append(_interpolate(self.xs, self.ys, cap))
            self.xs.append(cap)


def _interpolate(xs: list[float], ys: list[float], c: float) -> float:
    if c <= xs[0]:
        return ys[0] * c / xs[0]
    if c >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, c)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (c - x0) / (x1 - x0)


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
            curve.finish()

    # -- reading -----------------------------------------------------------------------

    @classmethod
    def from_csv(cls, path: str | Path) -> PerfTable:
        """The table in the CSV file at ``path``; ``PerfTableError`` (one line naming the file)
        for a file that is missing, not a regular file (a FIFO would hang the twin), larger
        than ``MAX_TABLE_BYTES``, not UTF-8 or not a table. A symlink is followed (an
        operator's table, not the twin's state)."""
        try:
            text = files.read_text_file(path, MAX_TABLE_BYTES, follow_symlinks=True)
        except files.FileReadError as exc:
            raise PerfTableError(str(exc)) from None
        return cls.from_csv_text(text, source=str(path))

    @classmethod
    def from_csv_text(cls, text: str, source: str = "<table>") -> PerfTable:
        # Excel's "CSV UTF-8" starts with one: refused as specd refuses it, by name (read as
        # part of the first header cell it was an "unknown: steps" header).
        if text.startswith("\ufeff"):
            raise PerfTableError(f"{source}: {files.BOM_PROBLEM}")
        reader = csv.reader(io.StringIO(text))
        header: list[str] | None = None
        rows: list[PerfRow] = []
        for line_no, raw_cells in _csv_rows(reader, source):
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
            row = _parse_row(values, f"{source}:{line_no}")
            if _measures_steps(values.get("setting", ""), row.steps, f"{source}:{line_no}"):
                rows.append(row)
        if header is None:
            raise PerfTableError(f"{source}: empty file (no header)")
        return cls(rows, source=source)

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

    def throughput(self, steps: int, concurrency: float) -> float:
        """Aggregate output tok/s at ``concurrency`` closed-loop clients: a measured point
        exactly, linear between points (from the origin below the first), the plateau at
        and past ``max_running_requests``, flat past the last point."""
        if not math.isfinite(concurrency) or concurrency < 0:
            raise ValueError(f"concurrency must be a finite number >= 0, got {concurrency!r}")
        curve = self._curve(steps)
        return _interpolate(curve.xs, curve.ys, concurrency)

    def _curve(self, steps: int) -> _StepCurve:
        try:
            return self._curves[steps]
        except KeyError:
            known = ",".join(str(s) for s in self.steps())
            raise KeyError(
                f"{self.source}: no data for steps {steps} (table has steps {known})"
            ) from None


def _csv_rows(reader: Iterator[list[str]], source: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells); the csv module's own errors (a field over its 128 KiB limit)
    as one ``PerfTableError`` naming the source and line, not a traceback."""
    line_no = 0
    try:
        for line_no, cells in enumerate(reader, start=1):
            yield line_no, cells
    except csv.Error as exc:
        raise PerfTableError(f"{source}:{line_no + 1}: not a CSV row ({exc})") from None


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


def _measures_steps(setting: str, steps: int, where: str) -> bool:
    """Whether a row measured its step count (empty, K, "static:K" or "off" at steps 0);
    False for an adaptive set's row. Anything else is not a setting."""
    text = setting.lower()
    if text.startswith("adaptive:"):
        return False
    if text in ("", str(steps), f"static:{steps}") or (text == "off" and steps == 0):
        return True
    shown = setting if len(setting) <= 40 else setting[:40] + "…"
    raise PerfTableError(f"{where}: setting {shown!r} does not match steps {steps}")


def _fmt(value: float) -> str:
    text = f"{value:.6g}" if not float(value).is_integer() else str(int(value))
    return text
