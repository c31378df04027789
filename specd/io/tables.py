"""Performance tables on disk: calibration, truth and sweep CSVs (format: core.perftable).

The parser is pure (``PerfTable.from_csv_text``); this module reads and writes the files:
regular files only, at most ``MAX_TABLE_BYTES``, written atomically. An operator may keep a
table behind a symlink (it is their data, not specd's state), so links are followed on read.
"""

from __future__ import annotations

from pathlib import Path

from specd.core.perftable import PerfTable, PerfTableError
from specd.io import files

# The seed table is 1 KB and a dense sweep ~50 KB; a table 100x that is not one.
MAX_TABLE_BYTES = 4 * files.MIB
TABLE_FILE_MODE = 0o644

# str(path) -> ((device, inode, mtime_ns, size), table): the daemon asks every tick.


def read_table(path: str | Path) -> PerfTable:
    """The table in the CSV file at ``path``. ``PerfTableError`` (one line, names the file)."""
    table, _ = _read(path)
    return table


def _read(path: str | Path) -> tuple[PerfTable, tuple[int, int, int, int]]:
    try:
        data, st = files.read_regular_file_and_stat(path, MAX_TABLE_BYTES, follow_symlinks=True)
    except files.FileReadError as exc:
        raise PerfTableError(str(exc)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PerfTableError(f"{path}: is not UTF-8 text (byte {exc.start})") from None
    key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    return PerfTable.from_csv_text(text, source=str(path)), key


def write_table(path: str | Path, table: PerfTable) -> None:
    """Replace ``path`` with ``table`` as CSV, atomically, mode 0644. Raises OSError."""
    files.write_text_atomic(path, table.to_csv_text(), mode=TABLE_FILE_MODE)
