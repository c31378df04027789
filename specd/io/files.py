"""Every file specd reads or writes goes through here: one atomic write, one bounded read.

Writing: a temporary file with a unique name in the target's directory (created with
O_CREAT|O_EXCL|O_NOFOLLOW, so neither a planted file nor a symlink is ever opened), an
explicit mode, fsync, rename over the target (a symlink there is replaced, never written
through), fsync of the directory. A reader sees the old file or the new one, even after a
power cut.

Reading: regular files only, at most a cap of bytes, opened without blocking (a FIFO must
not hang specd) and, for files specd owns, without following a symlink. Every problem is
one ``FileReadError`` whose message is one line naming the file.

Parsing: JSON and TOML whose nesting is too deep, or whose size exhausts memory, an
integer too long for Python to read, or a string that is no Unicode text (JSON's "\\ud800",
a lone surrogate no encoder takes), are invalid input like any other (``ParseError``),
never an exception that kills specd later.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specd.core import text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

KIB = 1024
MIB = 1024 * KIB
# Deeper than any file specd or an operator writes (state.json: ~5 levels), and far below
# the interpreter's recursion limit, so whatever walks the parsed value later cannot recurse
# out of stack either.
MAX_NESTING_DEPTH = 64
# Some Windows editors start a text file with it (see text.BOM_PROBLEM).
UTF8_BOM = b"\xef\xbb\xbf"
BOM_PROBLEM = text.BOM_PROBLEM
_TEMP_ATTEMPTS = 16


class FileReadError(ValueError):
    """A file that cannot be read as asked; the message is one line naming the file."""

    def __init__(
        self,
        path: str | Path,
        problem: str,
        st: os.stat_result | None = None,
        *,
        os_errno: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.problem = problem
        # What fstat said, when the file could be opened (callers fingerprint it).
        self.st = st
        # The system's refusal to open or read it (EACCES, EIO, ...): the file may be fine.
        self.os_errno = os_errno
        super().__init__(f"{path}: {problem}")


class MissingFileError(FileReadError, FileNotFoundError):
    """The file does not exist (for most callers: nothing there yet, not a problem).

    Also a FileNotFoundError, so ``except FileNotFoundError`` keeps meaning "absent".
    """


class ParseError(ValueError):
    """Text that is not valid JSON/TOML for specd; the message is one line."""


# -- reading ------------------------------------------------------------------------------


def file_kind(mode: int) -> str:
    """What a path whose ``st_mode`` is ``mode`` holds when it is no regular file ("a FIFO",
    "a directory", ...), as messages name it."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def size_text(n: int) -> str:
    if n >= MIB:
        return f"{n / MIB:.4g} MiB"
    if n >= KIB:
        return f"{n / KIB:.4g} KiB"
    return f"{n} bytes"


def read_regular_file(path: str | Path, max_bytes: int, *, follow_symlinks: bool = False) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes`` of them.

    Raises ``MissingFileError`` when nothing is there and ``FileReadError`` for anything
    else: a FIFO, device, socket or directory, a file larger than ``max_bytes``, a symlink
    (unless ``follow_symlinks``: for operator-provided files such as tables), a read error.
    Never blocks on a FIFO and never reads more than ``max_bytes + 1`` bytes.
    """
    return read_regular_file_and_stat(path, max_bytes, follow_symlinks=follow_symlinks)[0]


def read_regular_file_and_stat(
    path: str | Path, max_bytes: int, *, follow_symlinks: bool = False
) -> tuple[bytes, os.stat_result]:
    """``read_regular_file`` and the file's fstat (for ownership checks, fingerprints)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except ValueError:
        # A NUL in the path: os refuses it before any system call.
        raise FileReadError(path, "cannot read: the path holds a NUL character") from None
    except FileNotFoundError:
        raise MissingFileError(path, f"cannot read: {os.strerror(errno.ENOENT)}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise FileReadError(
                path, "is a symbolic link; specd reads only a regular file here"
            ) from None
        raise FileReadError(
            path, f"cannot read: {exc.strerror or exc}", os_errno=exc.errno
        ) from None
    st: os.stat_result | None = None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileReadError(path, f"is not a regular file ({file_kind(st.st_mode)})", st)
        if st.st_size > max_bytes:
            raise FileReadError(
                path,
                f"is {size_text(st.st_size)}, larger than the {size_text(max_bytes)} allowed",
                st,
            )
        # Read until EOF or one byte past the cap: the file may grow after the fstat.
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise FileReadError(path, f"grew larger than the {size_text(max_bytes)} allowed", st)
        return b"".join(chunks), st
    except OSError as exc:
        raise FileReadError(
            path, f"cannot read: {exc.strerror or exc}", st, os_errno=exc.errno
        ) from None
    finally:
        os.close(fd)


def read_settled(
    path: str | Path,
    max_bytes: int,
    *,
    pause: Callable[[float], bool],
    interval_s: float,
    reads: int,
    follow_symlinks: bool = False,
) -> bytes:
    """``read_regular_file``, once two reads ``interval_s`` apart find the file the same:
    its bytes, size, inode, modification and change times, or the same problem. A file
    read in the middle of a write (an editor's, a `cp`'s: truncated at a line, it may
    still parse) has changed by the next read. ``pause(seconds)`` waits between reads and
    returns True to give up (specd is stopping). Raises what the settled read raised, or
    ``FileReadError`` when the file still changed at the last of ``reads`` reads."""

    def look() -> tuple[bytes | FileReadError, object]:
        try:
            data, st = read_regular_file_and_stat(path, max_bytes, follow_symlinks=follow_symlinks)
        except FileReadError as exc:
            return exc, (type(exc), exc.problem)
        return data, (data, st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns)

    _, seen = look()
    for _ in range(reads - 1):
        if pause(interval_s):
            raise FileReadError(path, "not read: specd is stopping")
        result, now = look()
        if now == seen:
            if isinstance(result, FileReadError):
                raise result
            return result
        seen = now
    raise FileReadError(
        path,
        f"still changing after {reads} reads {interval_s:g} s apart (a write in progress?)",
    )


def read_text_file(path: str | Path, max_bytes: int, *, follow_symlinks: bool = False) -> str:
    """``read_regular_file`` decoded as UTF-8; bad bytes are a ``FileReadError``."""
    data = read_regular_file(path, max_bytes, follow_symlinks=follow_symlinks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileReadError(path, f"is not UTF-8 text (byte {exc.start})") from None


# -- parsing ------------------------------------------------------------------------------


class TextError(ParseError):
    """A string or key that is not Unicode text (a lone surrogate)."""


def _check_value(value: Any, max_depth: int, *, text: bool = True) -> None:
    """Nesting within ``max_depth``; with ``text``, every string and key Unicode text."""
    # Iterative: the point is not to recurse on hostile input.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if text:
                _check_text(item)
            continue
        if isinstance(item, dict):
            for key in item:
                if text and isinstance(key, str):
                    _check_text(key)
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise ParseError(f"nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


def _check_text(item: str) -> None:
    try:
        item.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise TextError(
            f"a string that is not Unicode text (a lone surrogate at character {exc.start})"
        ) from None


def _replace_surrogates(value: Any) -> Any:
    """``value`` with "?" for each lone surrogate of its strings and keys; its nesting is
    bounded already (`_check_value`), so recursing is safe."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_replace_surrogates(k): _replace_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_surrogates(v) for v in value]
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(
    text: str | bytes,
    *,
    max_depth: int = MAX_NESTING_DEPTH,
    finite: bool = False,
    replace_lone_surrogates: bool = False,
) -> Any:
    """JSON text → value. ``ParseError`` (one line) for bad, too deep or absurd input;
    ``finite``: NaN and Infinity too (Python reads them; no JSON encoder writes them back).
    ``replace_lone_surrogates``: a string that is no Unicode text gets "?" for each lone
    surrogate instead of refusing the whole text (specd's own files: a stray message must
    not cost what it learned)."""
    try:
        value = json.loads(text, parse_constant=_no_constant) if finite else json.loads(text)
    except RecursionError:
        raise ParseError(f"invalid JSON: nested deeper than {max_depth} levels") from None
    except MemoryError:
        raise ParseError("invalid JSON: too large to parse") from None
    except UnicodeDecodeError as exc:
        raise ParseError(f"invalid JSON: not UTF-8 (byte {exc.start})") from None
    except ValueError as exc:
        raise ParseError(f"invalid JSON: {_one_line(exc)}") from None
    try:
        _check_value(value, max_depth)
    except ParseError as exc:
        if not (replace_lone_surrogates and isinstance(exc, TextError)):
            raise ParseError(f"invalid JSON: {exc}") from None
        _check_value(value, max_depth, text=False)
        value = _replace_surrogates(value)
    return value


def parse_toml(text: str, *, max_depth: int = MAX_NESTING_DEPTH) -> dict[str, Any]:
    """TOML text → table. ``ParseError`` (one line) for bad, too deep or absurd input."""
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise ParseError(f"invalid TOML: nested deeper than {max_depth} levels") from None
    except MemoryError:
        raise ParseError("invalid TOML: too large to parse") from None
    except tomllib.TOMLDecodeError as exc:
        raise ParseError(f"invalid TOML: {_one_line(exc)}") from None
    except ValueError as exc:
        # tomllib's own: an integer past Python's digit limit ("Exceeds the limit (4300
        # digits) for integer string conversion").
        raise ParseError(f"invalid TOML: {_one_line(exc)}") from None
    try:
        _check_value(value, max_depth)
    except ParseError as exc:
        raise ParseError(f"invalid TOML: {exc}") from None
    return value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# -- writing ------------------------------------------------------------------------------


def _open_dir(directory: Path) -> int:
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def write_atomic(path: str | Path, data: bytes, *, mode: int) -> None:
    """Replace ``path`` by ``data`` with permissions ``mode``, atomically and durably.

    A symlink at ``path`` is replaced by the new regular file; its target is never opened.
    The mode is set explicitly (the umask does not narrow it). Raises OSError; on failure
    the old file is intact and no temporary file is left behind.
    """
    target = Path(path)
    name = target.name
    if name in ("", ".", ".."):
        raise IsADirectoryError(errno.EISDIR, "not a file name", str(target))
    dir_fd = _open_dir(target.parent)
    try:
        fd, tmp = _create_temp(dir_fd, name, mode)
        try:
            try:
                os.fchmod(fd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            # rename(2) replaces whatever entry is at the name, a symlink included.
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _create_temp(dir_fd: int, name: str, mode: int) -> tuple[int, str]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_TEMP_ATTEMPTS):
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, mode, dir_fd=dir_fd), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", name)


def write_text_atomic(path: str | Path, text: str, *, mode: int) -> None:
    write_atomic(path, text.encode("utf-8"), mode=mode)


def remove_durably(path: str | Path) -> None:
    """Remove ``path`` (a symlink itself, never its target) and fsync the directory.

    A missing file is already removed. Raises OSError.
    """
    target = Path(path)
    try:
        dir_fd = _open_dir(target.parent)
    except FileNotFoundError:
        return  # no directory, no file
    try:
        try:
            # Looked up first: unlink(2) on a read-only file system fails (EROFS) even for a
            # name that is not there, and a rollback that had nothing to remove failed.
            os.stat(target.name, dir_fd=dir_fd, follow_symlinks=False)
            os.unlink(target.name, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# A key file (an API key: SGLang's --api-key, the gateway's admin key) holds one key.
MAX_KEY_FILE_BYTES = 4096


class KeyFileError(ValueError):
    """A key file that cannot be used; the message is one line naming it."""


def read_key_file(path: Path, what: str) -> str:
    """The key in ``path`` (stripped), read at each call so a rotated key takes effect.
    Bounded and regular files only: a FIFO or a huge file there must not hang or swamp
    specd. Symlinks are followed (secret mounts are symlinks). KeyFileError otherwise."""
    try:
        key = read_text_file(path, MAX_KEY_FILE_BYTES, follow_symlinks=True).strip()
    except FileReadError as exc:
        raise KeyFileError(f"{what} {exc}") from None
    if not key:
        raise KeyFileError(f"{what} {path}: empty")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        # A header value cannot carry it (a second line, a control character).
        raise KeyFileError(f"{what} {path}: more than one line, or a control character")
    return key


def bearer_header(key: str | None) -> dict[str, str]:
    """The header a key travels in to SGLang (--api-key) or smg ({} without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}
