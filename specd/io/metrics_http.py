"""specd's /metrics page over HTTP, with a bounded number of connections.

prometheus_client's `start_http_server` starts a thread per connection and waits on each
without end: a local user holding a thousand half-sent requests open (slowloris) took
every file descriptor specd may open (the unit's soft limit, 1024), so specd could not
save its state, read the override file or spawn systemctl, and `accept()` failing with
EMFILE spun a core at 100 %. Here at most ``max_connections`` are served at once; a new
one beyond that closes the oldest (a scrape takes milliseconds: what has been open longest
is what holds a slot for nothing), and each read waits at most ``read_timeout_s``. A
flood can still keep Prometheus from specd's page (its own scrapes fail: SpecdDown), not
specd from its work.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

# Prometheus scrapes one page at a time; a few more for a curl, a second Prometheus.
MAX_CONNECTIONS = 16
# A request is a few hundred bytes, sent at once; the page is answered in milliseconds.
READ_TIMEOUT_S = 10.0


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing: a scrape every few seconds is no news."""


class _BoundedServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stop does not wait for a client
    # Connections the kernel queues before accept() (socketserver's 5 dropped a burst's
    # handshakes, which clients retried a second later).
    request_queue_size = 64
    max_connections = MAX_CONNECTIONS
    read_timeout_s = READ_TIMEOUT_S

    def server_activate(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[socket.socket, float] = {}  # each connection served: since when
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.read_timeout_s)
        with self._lock:
            if len(self._open) >= self.max_connections:
                oldest = min(self._open, key=self._open.__getitem__)
                del self._open[oldest]
                _hang_up(oldest)  # its thread meets the end of its input and finishes
            self._open[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except Exception:
            self._forget(request)
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: socket.socket) -> None:
        with self._lock:
            self._open.pop(request, None)

    def open_connections(self) -> int:
        with self._lock:
            return len(self._open)


def _hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # gone already
        sock.shutdown(socket.SHUT_RDWR)


class MetricsServer:
    """/metrics of ``registry`` on ``address``:``port`` (0: any free port), served from a
    thread until `close`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        address: str,
        port: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        # The address's own family (an IPv6 address binds an AF_INET6 socket), a class
        # attribute that the socket is made from, as prometheus_client does it.
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("_Server", (_BoundedServer,), {"address_family": family})
        httpd: WSGIServer = make_server(
            address, port, make_wsgi_app(registry), server_class, handler_class=_Quiet
        )
        assert isinstance(httpd, _BoundedServer)
        httpd.max_connections = max_connections
        httpd.read_timeout_s = read_timeout_s
        self._httpd = httpd
        self.port = int(self._httpd.server_port)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="specd-metrics", daemon=True
        )
        self._thread.start()

    def open_connections(self) -> int:
        """Connections being served now (at most max_connections)."""
        return self._httpd.open_connections()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
