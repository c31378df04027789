"""Reading a streamed HTTP answer whole, bounded in size and in time: the etcd and gateway
clients' (SGLang's reader bounds its requests at the socket, `specd.io.sglang`). Every
client asks for identity: a compressed answer is refused, not decoded past the cap."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from specd.core.text import one_line


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
    encoding = unasked_encoding(resp)
    if encoding is not None:
        raise httpx.DecodingError(f"Content-Encoding {encoding}, where specd asks for identity")
    chunks: list[bytes] = []
    size = 0
    # Raw: bytes as sent, the cap on what arrives. Decoded, a few KB of nested gzip is
    # gigabytes before the first chunk is counted.
    for chunk in resp.iter_raw():
        beat()
        size += len(chunk)
        if size > max_bytes:
            return None
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout("answer not complete by the deadline")
        chunks.append(chunk)
    return b"".join(chunks)


def unasked_encoding(resp: httpx.Response) -> str | None:
    """The Content-Encoding of ``resp`` when it is not identity (specd asks every server
    for identity, `Accept-Encoding`), else None."""
    encoding = resp.headers.get("content-encoding", "").strip().lower()
    return None if encoding in ("", "identity") else one_line(encoding, 40)
