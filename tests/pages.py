"""A real HTTP server on 127.0.0.1 that serves crafted pages: SGLang as a test wants it."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from factories import LoopbackHTTP


@dataclass
class Route:
    status: int = 200
    body: bytes = b""
    delay_s: float = 0.0
    declared_length: int | None = None  # a Content-Length larger than the body cuts it short
    hang_up: bool = False  # close the connection without answering
    no_length: bool = False  # no Content-Length: the body ends when the connection closes
    headers: tuple[tuple[str, str], ...] = ()  # more headers (Content-Encoding, ...)


@dataclass
class PageServer:
    url: str
    routes: dict[str, Route]
    hits: list[str] = field(default_factory=list)
    # (path, its Authorization header or None) of each request
    authorizations: list[tuple[str, str | None]] = field(default_factory=list)

    def serve(self, path: str, body: str | bytes, status: int = 200, **kw: Any) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.routes[path] = Route(status=status, body=data, **kw)

    def serve_sglang(self, metrics: str, server_info: dict[str, Any] | None) -> None:
        self.serve("/metrics", metrics)
        if server_info is not None:
            self.serve("/server_info", json.dumps(server_info))


@contextlib.contextmanager
def page_server() -> Iterator[PageServer]:
    """Serve ``PageServer.routes`` (path -> Route; 404 elsewhere) until the block ends."""
    state = PageServer(url="", routes={})

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn in front of SGLang
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            state.hits.append(self.path)
            state.authorizations.append((self.path, self.headers.get("Authorization")))
            route = state.routes.get(self.path, Route(status=404, body=b'{"detail":"Not Found"}'))
            if route.delay_s:
                time.sleep(route.delay_s)
            if route.hang_up:
                self.close_connection = True
                return
            try:
                self.send_response(route.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                length = (
                    route.declared_length if route.declared_length is not None else len(route.body)
                )
                if not route.no_length:
                    self.send_header("Content-Length", str(length))
                for name, value in route.headers:
                    self.send_header(name, value)
                if route.declared_length is not None or route.no_length:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(route.body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout tests)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with LoopbackHTTP(Handler) as server:
        state.url = server.url
        yield state
