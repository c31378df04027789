"""A call given a few seconds and a memory cap, for tests of what must not hang or read
without bound (a FIFO, a symlink to /dev/zero planted where specd reads a file): a
regression fails the test, it does not hang the suite or wake the OOM killer."""

from __future__ import annotations

import contextlib
import os
import resource
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
# What is checked answers in well under a second; a hung one is failed after this long.
BOUND_S = 10.0
# What a call may map beyond what the process holds when it starts: reading /dev/zero
# without bound ends in a MemoryError within it, not in the OOM killer.
HEADROOM_BYTES = 2 << 30


@contextlib.contextmanager
def address_space_cap() -> Iterator[None]:
    """This process's address space capped at what it maps now plus HEADROOM_BYTES."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = mapped + HEADROOM_BYTES
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def release(path: Path) -> None:
    """Lets a reader blocked opening the FIFO at ``path`` go on (and read end of file)."""
    with contextlib.suppress(OSError):
        if stat.S_ISFIFO(path.lstat().st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def bounded(call: Callable[[], T], *planted: Path) -> T:
    """``call()`` within BOUND_S, in a thread; fails the test if it takes longer. A reader
    that hangs on a FIFO ``planted`` is let go, so the failure is all it costs."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # raised again in the test's thread
            result["error"] = exc

    with address_space_cap():
        thread = threading.Thread(target=target, daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(BOUND_S)
        hung = thread.is_alive()
        while thread.is_alive() and time.monotonic() - started < 3 * BOUND_S:
            for path in planted:
                release(path)
            thread.join(0.1)
    assert not hung, f"did not return within {BOUND_S} s"
    if "error" in result:
        raise result["error"]
    value: T = result["value"]
    return value


# What a test plants where specd reads a file: each is no file to read.
def plant_fifo(path: Path) -> None:
    os.mkfifo(path, 0o640)


def plant_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def plant_directory(path: Path) -> None:
    path.mkdir()


def plant_huge(path: Path) -> None:
    # Sparse: 64 MiB of size, no disk.
    with path.open("wb") as file:
        file.truncate(64 << 20)
