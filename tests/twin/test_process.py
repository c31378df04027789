"""free_port: a port is handed out once per process, from the process's own ports when it has
them (use_ports), else the kernel's choice."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from specd.twin import process
from specd.twin.process import HOST, free_port, use_ports

# Below the test workers' shares (tests/conftest.py: 10000-32767) and the kernel's
# ephemeral range (32768 up): no one else is handed these.
OWN = range(9100, 9108)


@pytest.fixture
def own_ports() -> Iterator[None]:
    """This test's ports; the worker's own come back after it."""
    saved = process._own
    try:
        yield
    finally:
        process._own = saved


def test_a_process_without_ports_of_its_own_never_gets_the_same_port_twice(
    own_ports: None,
) -> None:
    # Nothing binds these, so the kernel is free to offer any of them again: 500 draws from
    # its ~14,000 odd ephemeral ports repeat one about nine times over without the record.
    process._own = None
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_own_ports_are_each_handed_out_once_skipping_ones_in_use(own_ports: None) -> None:
    held_port = OWN[3]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind((HOST, held_port))
        held.listen()
        use_ports(OWN)
        got = [free_port() for _ in range(len(OWN) - 1)]
        # All handed out but the one in use: the kernel chooses.
        spent = free_port()
    assert sorted(got) == [p for p in OWN if p != held_port]
    assert spent not in OWN


def test_a_child_forked_after_the_ports_were_set_uses_the_kernel(own_ports: None) -> None:
    use_ports(OWN)
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
    assert port not in OWN


@pytest.mark.parametrize("ports", [range(0), range(0, 10), range(65530, 65537), [80, -1]])
def test_ports_that_are_not_ports_are_refused(own_ports: None, ports: range | list[int]) -> None:
    with pytest.raises(ValueError, match="bad ports to hand out"):
        use_ports(ports)
