"""specd.io.files with real files: FIFOs, devices, sparse files, symlinks, umasks, threads."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specd.io import files

CAP = 64 * files.KIB


def within_a_second(call: Callable[[], Any]) -> Any:
    """Run ``call`` in a thread; it must return or raise within a second (no hang)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("ok", call()))
        except BaseException as exc:
            outcome.append(("raised", exc))

    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=1.0)
    assert not worker.is_alive(), "did not answer within a second"
    assert time.monotonic() - started < 1.0
    kind, value = outcome[0]
    if kind == "raised":
        raise value
    return value


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# -- bounded reads ------------------------------------------------------------------------


def test_a_regular_file_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * CAP)
    assert within_a_second(lambda: files.read_regular_file(path, CAP)) == b"x" * CAP


def test_a_missing_file_is_its_own_error_and_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(files.MissingFileError) as info:
        files.read_regular_file(tmp_path / "none", CAP)
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, files.FileReadError)
    assert str(info.value) == f"{tmp_path / 'none'}: cannot read: No such file or directory"


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _sparse_huge(tmp_path: Path) -> Path:
    path = tmp_path / "huge"
    with path.open("wb") as handle:
        handle.truncate(300 * 1024**3)  # 300 GiB, no blocks: only the size is huge
    return path


def _grown_past_cap(tmp_path: Path) -> Path:
    path = tmp_path / "big"
    path.write_bytes(b"#" * (CAP + 1))
    return path


def _link_to_secret(tmp_path: Path) -> Path:
    secret = tmp_path / "secret"
    secret.write_bytes(b"password")
    link = tmp_path / "link"
    link.symlink_to(secret)
    return link


def _link_to_dev_zero(tmp_path: Path) -> Path:
    link = tmp_path / "zero"
    link.symlink_to("/dev/zero")
    return link


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (_fifo, "is not a regular file (a FIFO)"),
        (lambda tmp: Path("/dev/zero"), "is not a regular file (a character device)"),
        (lambda tmp: Path("/dev/urandom"), "is not a regular file (a character device)"),
        (lambda tmp: tmp, "is not a regular file (a directory)"),
        (_sparse_huge, "is 3.072e+05 MiB, larger than the 64 KiB allowed"),
        (_grown_past_cap, "is 64 KiB, larger than the 64 KiB allowed"),
        (_link_to_secret, "is a symbolic link; specd reads only a regular file here"),
        (_link_to_dev_zero, "is a symbolic link"),
        (lambda tmp: (tmp / "file", (tmp / "file").write_text(""))[0] / "x", "cannot read"),
    ],
    ids=[
        "fifo",
        "dev-zero",
        "dev-urandom",
        "directory",
        "sparse-300g",
        "cap+1",
        "link",
        "link-dev",
        "not-a-dir",
    ],
)
def test_anything_but_a_small_regular_file_is_one_line_within_a_second(
    tmp_path: Path, make: Callable[[Path], Path], problem: str
) -> None:
    path = make(tmp_path)
    with pytest.raises(files.FileReadError) as info:
        within_a_second(lambda: files.read_regular_file(path, CAP))
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert problem in message
    assert "\n" not in message
    assert not isinstance(info.value, files.MissingFileError)


def test_the_size_message_names_a_file_one_byte_over() -> None:
    # 64 KiB + 1 prints as 64 KiB; the cap check itself is exact.
    assert files.size_text(CAP + 1) == "64 KiB"
    assert files.size_text(512) == "512 bytes"


def test_a_link_is_followed_only_when_asked(tmp_path: Path) -> None:
    link = _link_to_secret(tmp_path)
    assert files.read_regular_file(link, CAP, follow_symlinks=True) == b"password"
    dev = _link_to_dev_zero(tmp_path)
    with pytest.raises(files.FileReadError, match="a character device"):
        within_a_second(lambda: files.read_regular_file(dev, CAP, follow_symlinks=True))


def test_a_fifo_with_a_writer_is_still_refused_without_reading(tmp_path: Path) -> None:
    path = _fifo(tmp_path)
    # A writer that never writes: a blocking open or read would wait for it forever.
    writer = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        with pytest.raises(files.FileReadError, match="a FIFO"):
            within_a_second(lambda: files.read_regular_file(path, CAP))
    finally:
        os.close(writer)


def test_the_stat_comes_with_the_bytes_and_with_the_error(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"abc")
    data, st = files.read_regular_file_and_stat(path, CAP)
    assert (data, st.st_ino, st.st_size) == (b"abc", path.stat().st_ino, 3)
    fifo = _fifo(tmp_path)
    with pytest.raises(files.FileReadError) as info:
        files.read_regular_file_and_stat(fifo, CAP)
    assert info.value.st is not None
    assert stat.S_ISFIFO(info.value.st.st_mode)


def test_text_must_be_utf8(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_bytes(b"ok \xff")
    with pytest.raises(files.FileReadError, match=r"is not UTF-8 text \(byte 3\)"):
        files.read_text_file(path, CAP)
    path.write_text("é")
    assert files.read_text_file(path, CAP) == "é"


# -- a file read while it is written ------------------------------------------------------

FULL = b'[sglang]\nurl = "http://10.0.0.2:30000"\n[restart]\ndaily_restart_budget = 3\n'
HALF = FULL[: FULL.index(b"[restart]")]  # cut at a line: still TOML


def put(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


def rewritten_alike(path: Path) -> None:
    # The same bytes written again a second later: still a write in progress.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def renamed_alike(path: Path) -> None:
    new = path.with_name("new")
    new.write_bytes(path.read_bytes())
    os.replace(new, path)


def appended(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"#\n")


def idle(path: Path) -> None:
    pass


@pytest.mark.parametrize(
    ("first", "meanwhile", "expected", "waits"),
    [
        pytest.param(FULL, [idle], FULL, 1, id="the same at once"),
        pytest.param(HALF, [put(FULL), idle], FULL, 2, id="cut at a line, then written out"),
        pytest.param(b"", [put(HALF), put(FULL), idle], FULL, 3, id="empty, half, whole"),
        pytest.param(FULL, [rewritten_alike, idle], FULL, 2, id="the same bytes written again"),
        pytest.param(FULL, [renamed_alike, idle], FULL, 2, id="the same bytes renamed over it"),
        pytest.param(None, [put(FULL), idle], FULL, 2, id="missing, then there"),
        pytest.param(None, [idle], "cannot read: No such file", 1, id="missing for good"),
        pytest.param(
            FULL,
            [appended] * 9,
            "still changing after 10 reads 0.5 s apart (a write in progress?)",
            9,
            id="written all along",
        ),
        pytest.param(FULL, [], "not read: specd is stopping", 1, id="specd stops meanwhile"),
    ],
)
def test_a_file_is_read_once_two_reads_agree(
    tmp_path: Path,
    first: bytes | None,
    meanwhile: list[Callable[[Path], None]],
    expected: bytes | str,
    waits: int,
) -> None:
    """A reload read specd.toml once: caught in the middle of a write (`cp`, an editor),
    a file cut at a line is still TOML, and was applied. Each pause here is the moment
    the writer gets on with it; the file is real."""
    path = tmp_path / "specd.toml"
    if first is not None:
        path.write_bytes(first)
    pauses: list[float] = []

    def pause(seconds: float) -> bool:
        pauses.append(seconds)
        if len(pauses) > len(meanwhile):
            return True  # the stop event, set
        meanwhile[len(pauses) - 1](path)
        return False

    def read() -> bytes:
        return files.read_settled(path, CAP, pause=pause, interval_s=0.5, reads=10)

    if isinstance(expected, bytes):
        assert read() == expected
    else:
        with pytest.raises(files.FileReadError) as info:
            read()
        assert info.value.problem.startswith(expected)
    assert pauses == [0.5] * waits


# -- parsing: deep nesting and absurd input -----------------------------------------------

DEEP = 100_000


@pytest.mark.parametrize(
    "text",
    ["[" * DEEP, "[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP],
    ids=["open-brackets", "balanced-brackets", "objects"],
)
def test_deep_json_is_invalid_not_a_recursion_error(text: str) -> None:
    with pytest.raises(files.ParseError) as info:
        within_a_second(lambda: files.parse_json(text))
    assert str(info.value).startswith("invalid JSON: ")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * DEEP,
        "a = " + "[" * DEEP + "]" * DEEP,
        "a = " + "{b = " * DEEP + "1" + "}" * DEEP,
        "a = " + "{b = " * 2000 + "1" + "}" * 2000,
    ],
    ids=["open-arrays", "balanced-arrays", "inline-tables", "inline-tables-2000"],
)
def test_deep_toml_is_invalid_not_a_recursion_error(text: str) -> None:
    with pytest.raises(files.ParseError) as info:
        within_a_second(lambda: files.parse_toml(text))
    assert str(info.value).startswith("invalid TOML: ")
    assert "\n" not in str(info.value)


def test_nesting_within_the_limit_parses_and_one_more_level_does_not() -> None:
    depth = files.MAX_NESTING_DEPTH
    assert files.parse_json("[" * depth + "]" * depth) is not None
    with pytest.raises(files.ParseError, match=f"nested deeper than {depth} levels"):
        files.parse_json("[" * (depth + 1) + "]" * (depth + 1))
    table = "a = " + "{b = " * (depth - 1) + "1" + "}" * (depth - 1)
    assert files.parse_toml(table)["a"]["b"]
    with pytest.raises(files.ParseError, match=f"nested deeper than {depth} levels"):
        files.parse_toml("a = " + "{b = " * depth + "1" + "}" * depth)


def test_a_lone_surrogate_can_be_replaced_where_the_text_is_specds_own() -> None:
    text = '{"a\\udfff": ["x\\ud800y", {"k": "\\ud800"}], "n": 1}'
    with pytest.raises(files.ParseError, match="not Unicode text"):
        files.parse_json(text)
    assert files.parse_json(text, replace_lone_surrogates=True) == {
        "a?": ["x?y", {"k": "?"}],
        "n": 1,
    }
    # Only that: too deep is still too deep.
    depth = files.MAX_NESTING_DEPTH + 1
    with pytest.raises(files.ParseError, match="nested deeper"):
        files.parse_json("[" * depth + '"\\ud800"' + "]" * depth, replace_lone_surrogates=True)


@pytest.mark.parametrize(
    ("parse", "text", "problem"),
    [
        (files.parse_json, '{"a": ', "invalid JSON: Expecting value"),
        (files.parse_json, b"\xff", "invalid JSON: not UTF-8"),
        (files.parse_toml, "a = \n", "invalid TOML: Invalid value (at line 1, column 5)"),
        # Python refuses to read an integer of more than 4300 digits (a ValueError).
        (files.parse_toml, "a = " + "1" * 5000, "invalid TOML: Exceeds the limit"),
        (files.parse_json, "[" + "1" * 5000 + "]", "invalid JSON: Exceeds the limit"),
        # A lone surrogate: valid JSON escapes, no Unicode text; nothing could encode it.
        (files.parse_json, '{"a": "x\\ud800"}', "invalid JSON: a string that is not Unicode"),
        (files.parse_json, '{"\\udfff": 1}', "invalid JSON: a string that is not Unicode"),
        (files.parse_json, '[[["\\ud800"]]]', "invalid JSON: a string that is not Unicode"),
        (files.parse_toml, 'a = "\\ud800"', "invalid TOML: "),  # TOML refuses it itself
    ],
)
def test_plain_bad_input_is_one_line(parse: Callable[[Any], Any], text: Any, problem: str) -> None:
    with pytest.raises(files.ParseError) as info:
        parse(text)
    assert problem in str(info.value)
    assert "\n" not in str(info.value)


# -- atomic writes ------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o777])
@pytest.mark.parametrize("mode", [0o644, 0o600, 0o640])
def test_the_mode_is_the_one_asked_for_whatever_the_umask(
    tmp_path: Path, umask: int, mode: int
) -> None:
    path = tmp_path / "sglang.env"
    path.write_bytes(b"old\n")
    path.chmod(0o666)
    old = os.umask(umask)
    try:
        files.write_atomic(path, b"new\n", mode=mode)
    finally:
        os.umask(old)
    assert path.read_bytes() == b"new\n"
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir()] == ["sglang.env"]


def test_a_symlink_at_the_target_is_replaced_and_its_target_untouched(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"password")
    secret.chmod(0o600)
    link = tmp_path / "sglang.env"
    link.symlink_to(secret)
    files.write_atomic(link, b"SPECD_SPEC_STEPS=3\n", mode=0o644)
    assert not link.is_symlink()
    assert link.read_bytes() == b"SPECD_SPEC_STEPS=3\n"
    assert stat.S_IMODE(os.lstat(link).st_mode) == 0o644
    assert secret.read_bytes() == b"password"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_a_dangling_symlink_at_the_target_creates_nothing_at_its_target(tmp_path: Path) -> None:
    link = tmp_path / "state.json"
    link.symlink_to(tmp_path / "elsewhere")
    files.write_atomic(link, b"{}", mode=0o600)
    assert not (tmp_path / "elsewhere").exists()
    assert link.read_bytes() == b"{}"


def test_concurrent_writers_never_share_a_temporary_file(tmp_path: Path) -> None:
    # A fixed temp name makes two writers interleave into one file; unique names cannot.
    path = tmp_path / "out.csv"
    payloads = [bytes([65 + i]) * 200_000 for i in range(8)]
    errors: list[BaseException] = []

    def write(data: bytes) -> None:
        try:
            for _ in range(5):
                files.write_atomic(path, data, mode=0o644)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert path.read_bytes() in payloads
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("make_bad", ["missing_dir", "dir_is_file", "target_is_dir"])
def test_a_failed_write_raises_oserror_and_leaves_nothing(tmp_path: Path, make_bad: str) -> None:
    if make_bad == "missing_dir":
        path = tmp_path / "nope" / "sglang.env"
    elif make_bad == "dir_is_file":
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / "sglang.env"
    else:
        path = tmp_path / "sglang.env"
        path.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(OSError):
        files.write_atomic(path, b"x", mode=0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_remove_durably_removes_a_link_not_its_target(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    files.remove_durably(link)
    assert not link.is_symlink()
    assert target.read_bytes() == b"keep"
    files.remove_durably(link)  # already gone: nothing to do
    files.remove_durably(tmp_path / "no-dir" / "x")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"k3y\n", None),
        (b"  k3y with space  \n", None),
        (b"", "empty"),
        (b"\n\n", "empty"),
        (b"line1\nline2\n", "more than one line, or a control character"),
        (b"k\x00y", "more than one line, or a control character"),
        (b"\xff\xfe", "not UTF-8"),
        (b"k" * 5000, "larger than"),
    ],
)
def test_a_key_file_is_one_line_of_text(
    tmp_path: Path, content: bytes, problem: str | None
) -> None:
    path = tmp_path / "key"
    path.write_bytes(content)
    if problem is None:
        assert files.read_key_file(path, "key file") == content.decode().strip()
        return
    with pytest.raises(files.KeyFileError, match=r"^key file [^\n]+$") as info:
        files.read_key_file(path, "key file")
    assert problem in str(info.value)
    assert "k3y" not in str(info.value)


def test_a_key_file_that_is_a_fifo_or_missing_is_one_line_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    for path in (fifo, tmp_path / "missing"):
        with pytest.raises(files.KeyFileError, match=r"^key file [^\n]+$"):
            files.read_key_file(path, "key file")
    assert time.monotonic() - started < 1
