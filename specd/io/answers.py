"""Reading a streamed HTTP answer whole, bounded in size and in time: the etcd and gateway
clients' (SGLang's reader bounds its requests at the socket, `specd.io.sglang`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx


def read_capped(
    resp: httpx.Response, max_bytes: int, deadline: float, beat: Callable[[], None]
) -> bytes | None:
    """The body of ``resp`` (opened with ``stream``), complete by ``deadline``
    (``time.monotonic()``), ``beat()`` called with each piece; None when it is over
    ``max_bytes``, declared or sent. A server trickling bytes resets httpx's read timeout
    with each one: past the deadline this raises ``httpx.ReadTimeout``."""
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        return None
    chunks: list[bytes] = []
    size = 0
    for chunk in resp.iter_bytes():
        beat()
        size += len(chunk)
        if size > max_bytes:
            return None
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout("answer not complete by the deadline")
        chunks.append(chunk)
    return b"".join(chunks)
