"""specd.io.tables with real files: calibration, truth and sweep tables on disk."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from factories import seed_table

from specd.core.perftable import PerfTable, PerfTableError
from specd.io import tables
from specd.io.calibration import CalibrationFile

GOOD = "steps,concurrency,output_tok_s\n3,1,230\n4,1,280\n"


def test_a_table_round_trips_through_a_file_written_atomically(tmp_path: Path) -> None:
    table = seed_table()
    path = tmp_path / "seed.csv"
    old = os.umask(0o077)
    try:
        tables.write_table(path, table)
    finally:
        os.umask(old)
    assert tables.read_table(path) == table
    assert stat.S_IMODE(path.stat().st_mode) == tables.TABLE_FILE_MODE
    assert [p.name for p in tmp_path.iterdir()] == ["seed.csv"]


def test_an_operator_may_keep_a_table_behind_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real.csv"
    real.write_text(GOOD)
    link = tmp_path / "cal.csv"
    link.symlink_to(real)
    assert tables.read_table(link).steps() == [3, 4]


def _fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "t.csv")
    return tmp_path / "t.csv"


def _huge(tmp_path: Path) -> Path:
    path = tmp_path / "t.csv"
    with path.open("wb") as handle:
        handle.truncate(10 * 1024**3)
    return path


def _link_to(target: str) -> Callable[[Path], Path]:
    def make(tmp_path: Path) -> Path:
        (tmp_path / "t.csv").symlink_to(target)
        return tmp_path / "t.csv"

    return make


def _latin1(tmp_path: Path) -> Path:
    path = tmp_path / "t.csv"
    path.write_bytes(b"steps,concurrency,output_tok_s\n# caf\xe9\n3,1,230\n")
    return path


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (_fifo, "is not a regular file (a FIFO)"),
        (_link_to("/dev/zero"), "is not a regular file (a character device)"),
        (_link_to("/dev/urandom"), "is not a regular file (a character device)"),
        (_huge, "larger than the 4 MiB allowed"),
        (lambda tmp: tmp / "none.csv", "cannot read: No such file or directory"),
        (_latin1, "is not UTF-8 text (byte 36)"),
    ],
    ids=["fifo", "dev-zero", "dev-urandom", "sparse-10g", "missing", "latin1"],
)
def test_a_bad_table_file_is_one_line_within_a_second(
    tmp_path: Path, make: Callable[[Path], Path], problem: str
) -> None:
    path = make(tmp_path)
    started = time.monotonic()
    with pytest.raises(PerfTableError) as info:
        tables.read_table(path)
    assert time.monotonic() - started < 1.0
    assert str(info.value).startswith(f"{path}: ")
    assert problem in str(info.value)
    assert "\n" not in str(info.value)


def test_a_parse_error_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("steps,concurrency,output_tok_s\n3,1,abc\n")
    with pytest.raises(PerfTableError, match=rf"^{path}:2: output_tok_s is not a number"):
        tables.read_table(path)


def test_a_calibration_is_reread_only_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "cal.csv"
    path.write_text(GOOD)
    source = CalibrationFile(path)
    first, problem = source.current()
    assert problem is None
    assert first is not None
    assert source.current()[0] is first
    replacement = tmp_path / "new.csv"
    replacement.write_text(GOOD + "5,1,300\n")
    os.replace(replacement, path)  # a new inode, as an editor or `specd sweep` writes it
    again = source.current()[0]
    assert again is not None
    assert again.table.steps() == [3, 4, 5]
    assert isinstance(first.table, PerfTable)
    path.unlink()
    kept, problem = source.current()
    assert kept is again  # the last good one stays in use, with the problem said
    assert problem is not None
    assert "cannot read calibration" in problem
    # Never read good: nothing to keep.
    assert CalibrationFile(path).current()[0] is None


def test_a_calibration_swapped_for_one_csv_cannot_read_is_a_problem_not_a_crash(
    tmp_path: Path,
) -> None:
    """The running daemon re-reads its calibration when the file changes: a field over the
    csv module's 128 KiB limit raised csv.Error out of the tick and took specd down."""
    path = tmp_path / "cal.csv"
    path.write_text(GOOD)
    source = CalibrationFile(path)
    good, problem = source.current()
    assert problem is None
    bad = tmp_path / "new.csv"
    bad.write_text(GOOD + "1" * 200_000 + ",1,300\n")
    os.replace(bad, path)
    calibration, problem = source.current()
    assert calibration is good  # the last good one, kept
    assert problem is not None
    assert f"{path}:4: not a CSV row (field larger than field limit" in problem
    assert "\n" not in problem
