"""One verifying TLS context per process for specd's HTTP clients.

httpx builds a new ``ssl.SSLContext`` for every client it makes and loads the whole CA bundle
into it (~150 certificates parsed: 60 ms of CPU or more), even for a plain ``http://`` URL
that never uses it. specd makes its clients on start, on reload and per command, and a
tool or test that polls a server makes one per request; so each asks this module for the
context instead, made by httpx's own ``create_ssl_context`` (the same certificates, the
same checks) the first time and shared afterwards. An ``SSLContext`` is safe to share
between clients and threads.
"""

from __future__ import annotations

import functools
import ssl
from urllib.parse import urlsplit

import httpx


@functools.cache
def verifying_context(*, trust_env: bool = True) -> ssl.SSLContext:
    """httpx's default context: ``trust_env`` reads ``SSL_CERT_FILE``/``SSL_CERT_DIR``
    (as an httpx client with ``trust_env=True`` does), else certifi's bundle."""
    return httpx.create_ssl_context(trust_env=trust_env)


@functools.cache
def _trusting_nothing() -> ssl.SSLContext:
    # Checks certificates and host names as strictly as the verifying one, with no CA
    # loaded: any TLS handshake through it fails.
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def context_for(*urls: str, trust_env: bool = True) -> ssl.SSLContext:
    """The context of a client that requests ``urls`` only and follows no redirect (httpx's
    default): `verifying_context` when any of them is not plain ``http://``; for plain HTTP,
    where no TLS happens at all, one that trusts no certificate, so that a command or daemon
    talking to a loopback SGLang or etcd does not load the CA bundle (~20 ms of CPU) for
    nothing."""
    if all(urlsplit(url).scheme == "http" for url in urls):
        return _trusting_nothing()
    return verifying_context(trust_env=trust_env)
