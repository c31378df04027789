"""free_port: a port is handed out once per process, from the process's slice when it has one."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from specd.twin import process
from specd.twin.process import HOST, free_port, use_port_slice

# Above the test workers' slices (tests/conftest.py) and below the kernel's ephemeral range.
FIRST, END = 32100, 32108


@pytest.fixture
def own_slice() -> Iterator[None]:
    """This test's slice; the worker's own comes back after it."""
    saved = process._slice
    try:
        yield
    finally:
        process._slice = saved


def test_a_process_without_a_slice_never_gets_the_same_port_twice(own_slice: None) -> None:
    # Nothing binds these, so the kernel is free to offer any of them again: 500 draws from
    # its ~14,000 odd ephemeral ports repeat one about nine times over without the record.
    process._slice = None
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_a_slice_hands_out_each_free_port_once_skipping_ones_in_use(own_slice: None) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind((HOST, FIRST + 3))
        held.listen()
        use_port_slice(FIRST, END)
        got = [free_port() for _ in range(END - FIRST - 1)]
        # The slice is spent (its one other port is in use): the kernel chooses.
        spent = free_port()
    assert sorted(got) == [p for p in range(FIRST, END) if p != FIRST + 3]
    assert not FIRST <= spent < END


def test_a_child_forked_after_the_slice_was_set_uses_the_kernel(own_slice: None) -> None:
    use_port_slice(FIRST, END)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(write_end, str(free_port()).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    port = int(os.read(read_end, 16))
    os.close(read_end)
    os.waitpid(pid, 0)
    assert not FIRST <= port < END


@pytest.mark.parametrize(("first", "end"), [(0, 10), (100, 100), (200, 100), (65000, 65537)])
def test_a_slice_that_is_not_ports_is_refused(own_slice: None, first: int, end: int) -> None:
    with pytest.raises(ValueError, match="bad port slice"):
        use_port_slice(first, end)
