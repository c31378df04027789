"""The SGLang model gateway (smg 1.x) admin API, for draining this server before a restart.

A drain removes this server's worker from routing on every gateway replica and, after the
restart, adds it back with the URL and labels it had, then waits until every replica reports
it ready. Any replica that cannot be reached raises ``GatewayUnavailable`` with a one-line
reason: with a gateway configured, specd never restarts a server it could not drain. The admin
API key is read from a file and sent as a bearer token; it never appears in an error or a log.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

READY = "ready"


class GatewayUnavailable(Exception):
    """A gateway replica could not be reached or answered nonsense (message: one line)."""


@dataclass(frozen=True)
class Worker:
    """This server as one gateway replica knows it."""

    gateway_url: str
    worker_id: str
    url: str
    status: str
    labels: Mapping[str, str] = field(default_factory=dict)


def read_api_key(path: Path | None) -> str | None:
    """The admin API key from ``path`` (None: no key); a one-line error names the file."""
    if path is None:
        return None
    try:
        key = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise GatewayUnavailable(f"gateway api key file {path}: {exc.strerror}") from None
    if not key:
        raise GatewayUnavailable(f"gateway api key file {path}: empty")
    return key


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


class GatewayClient:
    """Every replica of one gateway; each call is bounded by ``timeout_s``."""

    def __init__(
        self,
        gateway_urls: Sequence[str],
        worker_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 5.0,
        poll_s: float = 0.25,
        stop: threading.Event | None = None,
    ) -> None:
        if not gateway_urls:
            raise ValueError("gateway_urls: at least one gateway URL is needed")
        self._gateways = [u.rstrip("/") for u in gateway_urls]
        self._worker_url = worker_url.rstrip("/")
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._stop = stop or threading.Event()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, gateway: str, path: str, body: Any = None) -> Any:
        try:
            reply = self._http.request(method, gateway + path, json=body)
        except httpx.HTTPError as exc:
            raise GatewayUnavailable(
                f"gateway {gateway}: {method} {path}: {type(exc).__name__}"
            ) from None
        if reply.status_code >= 400:
            raise GatewayUnavailable(
                f"gateway {gateway}: {method} {path}: HTTP {reply.status_code}"
            )
        if not reply.content:
            return None
        try:
            return reply.json()
        except ValueError:
            raise GatewayUnavailable(f"gateway {gateway}: {method} {path}: not JSON") from None

    def _workers(self, gateway: str) -> list[Mapping[str, Any]]:
        data = self._call("GET", gateway, "/workers")
        items = data.get("workers") if isinstance(data, Mapping) else data
        if not isinstance(items, list):
            raise GatewayUnavailable(f"gateway {gateway}: GET /workers: no worker list")
        return [w for w in items if isinstance(w, Mapping)]

    def find(self, gateway: str) -> Worker | None:
        """This server's worker on ``gateway`` (None: not routed there)."""
        for w in self._workers(gateway):
            url = w.get("url")
            if isinstance(url, str) and _same_url(url, self._worker_url):
                raw = w.get("labels")
                labels = (
                    {str(k): str(v) for k, v in raw.items()} if isinstance(raw, Mapping) else {}
                )
                return Worker(
                    gateway_url=gateway,
                    worker_id=str(w.get("id", "")),
                    url=url,
                    status=str(w.get("status", "")),
                    labels=labels,
                )
        return None

    def drain(self) -> list[Worker]:
        """Remove this worker from routing on every replica; returns what each had."""
        found = [self.find(g) for g in self._gateways]
        removed = []
        for worker in found:
            if worker is None:
                continue
            self._call("DELETE", worker.gateway_url, f"/workers/{worker.worker_id}")
            removed.append(worker)
        return removed

    def readd(self, removed: Sequence[Worker], timeout_s: float) -> None:
        """Add the worker back where it is missing, with the URL and labels it had.

        A draining worker answers POST with 409 until its settle time is over, so each
        replica is polled until the old entry is gone (bounded by ``timeout_s``)."""
        labels: Mapping[str, str] = removed[0].labels if removed else {}
        end = time.monotonic() + timeout_s
        for gateway in self._gateways:
            current = self.find(gateway)
            while current is not None and current.status == "draining":
                left = end - time.monotonic()
                if left <= 0 or self._stop.wait(min(self._poll_s, left)):
                    raise GatewayUnavailable(f"gateway {gateway}: worker still draining")
                current = self.find(gateway)
            if current is not None:
                continue
            body: dict[str, Any] = {"url": self._worker_url}
            if labels:
                body["labels"] = dict(labels)
            self._call("POST", gateway, "/workers", body)

    def wait_ready(self, timeout_s: float) -> bool:
        """True once every replica reports the worker ready; False on timeout or stop."""
        end = time.monotonic() + timeout_s
        while True:
            workers = [self.find(g) for g in self._gateways]
            if all(w is not None and w.status == READY for w in workers):
                return True
            left = end - time.monotonic()
            if left <= 0 or self._stop.wait(min(self._poll_s, left)):
                return False
