"""Real processes on loopback for the fleet: a one-member etcd, an ``smg`` gateway in
front of workers, and streaming load through it. Shared by the tests (re-exported from
tests/factories.py) and the fleet bench (bench/bench_fleet.py); failures raise
(AssertionError, RuntimeError) so both report them."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from specd.io.gateway import GatewayClient, GatewayUnavailable
from specd.io.tls import verifying_context
from specd.twin.process import free_port, stop_process


class EtcdProcess:
    """A real one-member etcd on 127.0.0.1, its own data dir and free ports (never
    2379/2380, where Debian's etcd.service may listen). ``stop``/``start`` keep the data
    dir and ports: the same cluster comes back."""

    def __init__(self, data_dir: Path, binary: str | None = None) -> None:
        found = binary or shutil.which("etcd")
        if found is None:
            raise RuntimeError("etcd missing: apt-get install etcd-server")
        self.binary = found
        self.data_dir = data_dir
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> EtcdProcess:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            self.binary,
            "--name=specd-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=specd-test={peer}",
            "--listen-metrics-urls=",
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.post(
                    f"{self.url}/v3/maintenance/status",
                    json={},
                    timeout=1,
                    verify=verifying_context(),
                ).is_success:
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd not up within {timeout_s} s: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 10)
        self.proc = None


# -- the SGLang model gateway (smg) and load through it -------------------------------------

SMG = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
SMG_ADMIN_KEY = "specd-test-admin-key"
# smg's own --health-check-timeout-secs default: SGLang's /health answers after >= 1 s.
HEALTH_PROBE_TIMEOUT_S = 5.0


def servers_out(http: httpx.Client, clients: Mapping[str, GatewayClient]) -> list[str]:
    """The worker URLs (``clients``' keys, each with a client of its gateway) out of
    service now: not ``ready`` in the gateway, or SGLang not answering /health with 200.

    The /health probes run side by side: SGLang's default /health runs a generation and
    answers after a second or more, so one after another a look at four servers would take
    four seconds; a starting or draining server answers 503 at once, a stopped one refuses.
    """

    def routed(client: GatewayClient) -> bool:
        try:
            worker = client.find(client.gateways[0])
        except GatewayUnavailable:
            return False
        return worker is not None and worker.status == "ready"

    def healthy(url: str) -> bool:
        try:
            return http.get(url + "/health", timeout=HEALTH_PROBE_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    with ThreadPoolExecutor(max_workers=max(1, len(clients))) as pool:
        health = dict(zip(clients, pool.map(healthy, clients), strict=True))
    return [url for url, client in clients.items() if not (routed(client) and health[url])]


class SmgGateway:
    """A real ``smg launch`` on loopback in front of ``worker_urls``, its Prometheus
    exporter on a free loopback port too (smg binds 0.0.0.0:29000 otherwise), round robin
    so every worker takes load, and an admin key when ``admin_key`` is set. ``retries=False``
    passes a failed request on to its client instead of retrying it on another worker, so a
    worker restarted while still routed shows up as client errors. ``wait_ready`` blocks
    until every worker is ready."""

    def __init__(
        self,
        worker_urls: list[str],
        *,
        admin_key: str | None = None,
        retries: bool = True,
        port: int | None = None,
    ) -> None:
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_key = admin_key
        self.worker_urls = list(worker_urls)
        argv = [SMG, "launch", "--worker-urls", *worker_urls, "--host", "127.0.0.1",
                "--port", str(self.port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port()), "--policy", "round_robin",
                "--health-check-interval-secs", "1",
                # A loopback gateway's clients are the harness's own, done by the time it
                # stops: its 180 s default grace made every stop wait 5 s for nothing.
                "--shutdown-grace-period-secs", "1"]  # fmt: skip
        if not retries:
            argv.append("--disable-retries")
        if admin_key is not None:
            argv += ["--control-plane-api-keys", f"specd:specd:admin:{admin_key}"]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 30.0) -> SmgGateway:
        end = time.monotonic() + timeout_s
        for worker in self.worker_urls:
            client = GatewayClient([self.url], worker, api_key=self.admin_key, timeout_s=1.0)
            try:
                while True:
                    try:
                        if client.wait_ready(0.5):
                            break
                    except GatewayUnavailable:
                        time.sleep(0.2)
                    if time.monotonic() > end or self.proc.poll() is not None:
                        raise AssertionError(
                            f"smg never routed {worker} as ready: {self.log()[-2000:]}"
                        )
            finally:
                client.close()
        return self

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self._log.close()

    def __enter__(self) -> SmgGateway:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stream_problem(lines: Iterable[str]) -> str | None:
    """Why a streamed completion did not end whole, or None. A worker dying mid-stream makes
    smg send an error event and then ``data: [DONE]``: complete means [DONE] last, no event
    carrying an ``error``, and the last event with a choice giving a ``finish_reason`` (a
    usage-only event, with no choice, may follow it)."""
    last, finished = "", None
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        last = line
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line[len("data: ") :])
        except ValueError:
            return f"not a JSON event: {line[:80]!r}"
        if not isinstance(event, dict):
            return f"not an event object: {line[:80]!r}"
        if "error" in event:
            return f"stream error: {str(event['error'])[:160]}"
        choices = event.get("choices")
        if isinstance(choices, list) and choices:
            first = choices[0]
            finished = first.get("finish_reason") if isinstance(first, dict) else None
    if last != "data: [DONE]":
        return f"stream cut after {last[:80]!r}"
    if finished is None:
        return "stream ended with [DONE] but its last event gave no finish_reason"
    return None


class StreamingLoad:
    """``clients`` threads each sending streaming completions through ``url`` back to back
    and recording how every one ended: ``ok`` counts complete 200s (`_stream_problem`: the
    stream reached ``data: [DONE]`` with a finish_reason and no error event), ``failures``
    says what went wrong with each other one."""

    def __init__(self, url: str, clients: int, max_tokens: int = 40) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]

    def _one(self, http: httpx.Client, model: str) -> str | None:
        body = {"model": model, "prompt": "x", "max_tokens": self.max_tokens, "stream": True}
        try:
            with http.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    return f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                return _stream_problem(resp.iter_lines())
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"

    def _client(self) -> None:
        with httpx.Client(timeout=30.0, verify=verifying_context()) as http:
            # The model the workers serve: the gateway routes by it.
            model = http.get(f"{self.url}/v1/models").json()["data"][0]["id"]
            while not self._stop.is_set():
                problem = self._one(http, model)
                with self._lock:
                    if problem is None:
                        self.ok += 1
                    else:
                        self.failures.append(problem)

    def wait_for(self, ok: int, timeout_s: float = 20.0) -> None:
        end = time.monotonic() + timeout_s
        while self.ok < ok:
            if time.monotonic() > end:
                raise AssertionError(
                    f"load got {self.ok} complete answers, not {ok}: {self.failures[:3]}"
                )
            time.sleep(0.05)

    def __enter__(self) -> StreamingLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=40)
