"""Test data and helpers shared by the test modules (imported as ``factories``: tests/ is
on sys.path)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from specd.core.history import History
from specd.core.observation import Observation
from specd.core.perftable import PerfTable
from specd.core.settings import TABLE_OF_KEY
from specd.io.tls import verifying_context
from specd.tools import loopback
from specd.tools.loopback import (  # noqa: F401 - re-exported
    SMG,
    SMG_ADMIN_KEY,
    SmgGateway,
    StreamingLoad,
    servers_out,
)
from specd.twin.process import TwinProcess


def tables(**fields: Any) -> dict[str, Any]:
    """Settings by key name, put into their tables: ``tables(max_steps=4, windows=[...])``
    is ``{"choose": {"max_steps": 4}, "windows": [...]}`` (every key is in one table only)."""
    data: dict[str, Any] = {}
    for key, value in fields.items():
        if key in TABLE_OF_KEY:
            data.setdefault(TABLE_OF_KEY[key], {})[key] = value
        else:
            data[key] = value  # bands, windows, or a whole table
    return data


def make_observation(t: float = 0.0, **fields: Any) -> Observation:
    """An Observation with neutral defaults: one running request at 4 steps (topk 1, draft
    tokens steps + 1), SGLang 0.5.23, one DP rank, nothing else known. Tests set the fields
    they are about; ``spec_fresh`` follows ``running`` and ``draft_tokens`` follows
    ``steps`` unless given."""
    steps = fields.get("steps", 4)
    values: dict[str, Any] = {
        "t": t,
        "running": 1,
        "queued": 0,
        "accept_length": None,
        "steps": steps,
        "draft_tokens": None if steps is None else steps + 1,
        "topk": 1,
        "algorithm": "NEXTN",
        "max_running_requests": None,
        "token_usage": None,
        "gen_throughput": None,
        "generation_tokens_total": None,
        "decode_tokens_total": None,
        "spec_verify_calls_total": None,
        "retracted_total": None,
        "version": "0.5.23",
        "dp_ranks": 1,
        "launch_command": None,
        **fields,
    }
    values.setdefault("spec_fresh", values["running"] > 0)
    return Observation(**values)


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small tmpfs at ``path`` (created), for full-disk and read-only tests; needs root."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        why = f"cannot mount a tmpfs: {mounted.stderr.strip()}"
        # CI runs as root, where a failed mount is a broken machine, not a reason to skip.
        if os.geteuid() == 0 and os.environ.get("SPECD_ALLOW_SKIP") != "1":
            pytest.fail(f"{why} (as root; SPECD_ALLOW_SKIP=1 skips)")
        pytest.skip(f"SKIPPED LOUDLY: {why} (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def seed_table() -> PerfTable:
    """The seed preset as specd reads a table (the twin keeps its own table type)."""
    from specd.twin.preset import preset_table  # noqa: PLC0415 - the twin is a test aid here

    return PerfTable.from_csv_text(preset_table().to_csv_text(), source="seed preset")


def serve(
    history: History,
    steps: int,
    start: float,
    until: float,
    offered: int,
    tok_s: float,
    scrape_s: float = 60.0,
    *,
    adaptive_config: str | None = None,
) -> Observation:
    """Record SGLang at ``steps`` serving ``tok_s`` with ``offered`` requests from ``start``
    to ``until``, one scrape every ``scrape_s`` (decode counter from 0, as after a
    restart); returns the last scrape. With ``adaptive_config``, SGLang runs its adaptive
    mode from that file (``steps``: the tier its gauge shows)."""
    served, t = 0.0, start
    adaptive = {"adaptive": True, "adaptive_config": adaptive_config} if adaptive_config else {}
    last = make_observation(t, running=offered, steps=steps, **adaptive)
    while t <= until:
        last = make_observation(
            t,
            running=offered,
            steps=steps,
            max_running_requests=64,
            decode_tokens_total=served,
            generation_tokens_total=served,
            **adaptive,
        )
        history.record(last)
        served += tok_s * scrape_s
        t += scrape_s
    return last


def without_specd_env() -> dict[str, str]:
    """This process's environment without its SPECD_* settings: a child `specd` reads only
    the files and arguments its test gives it."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}


def run_specd(
    *argv: str,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """`specd ARGV` as its own process (the installed entry point's module), its output
    captured as text; ``env`` None inherits this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "specd.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
        cwd=cwd,
    )


# ---- SGLang versions: each one's own pages (tests/fixtures/metrics/versions/) ----

REPO = Path(__file__).resolve().parents[1]
VERSION_PAGES = Path(__file__).resolve().parent / "fixtures" / "metrics" / "versions"
OLD_VERSIONS = ("0.5.4", "0.5.11")  # no sglang:spec_num_steps / spec_num_draft_tokens gauges


def version_page(version: str, which: str = "loaded") -> str:
    return (VERSION_PAGES / f"sglang-{version}-{which}.prom").read_text()


def version_server_info(version: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (VERSION_PAGES / f"sglang-{version}-server_info.json").read_text()
    )
    return data


# A twin that starts in about a second: short load and warm-up, frequent decode reports.
FAST_TWIN_VERSION_ARGS = ("--load-time-s", "0.3", "--warmup-s", "0.3", "--report-interval-s", "0.2")
SPEC4_ARGS = (
    "--speculative-algorithm", "NEXTN",
    "--speculative-num-steps", "4",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "5",
)  # fmt: skip


def version_twin(version: str, *extra: str) -> TwinProcess:
    """A twin (not yet started) as SGLang ``version`` with metrics, NEXTN at 4 steps."""
    return TwinProcess(
        [*SPEC4_ARGS, "--enable-metrics", "--sglang-version", version, *FAST_TWIN_VERSION_ARGS,
         *extra]
    )  # fmt: skip


def version_info_paths(version: str) -> tuple[str, ...]:
    # /server_info since 0.5.6; the old name stays as an alias.
    return ("/get_server_info",) if version == "0.5.4" else ("/server_info", "/get_server_info")


class LoopbackHTTP:
    """A real HTTP server on 127.0.0.1 (a free port) for ``handler``, served from a daemon
    thread; ``close`` (or leaving a ``with``) stops it."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> LoopbackHTTP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class QuietHandler(BaseHTTPRequestHandler):
    """A loopback server's handler: HTTP/1.1 (kept-alive connections), no access log, and a
    client closing its kept-alive connection is not an error."""

    protocol_version = "HTTP/1.1"

    def handle(self) -> None:
        with contextlib.suppress(ConnectionResetError):
            super().handle()

    def send_body(self, status: int, body: bytes, content_type: str | None = None) -> None:
        self.send_response(status)
        if content_type is not None:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class StaticSGLang:
    """A real HTTP server on 127.0.0.1 answering with one version's committed pages."""

    def __init__(self, version: str, *, with_info: bool = True) -> None:
        self.version = version
        self.routes: dict[str, bytes] = {"/metrics": version_page(version).encode()}
        if with_info:
            body = json.dumps(version_server_info(version)).encode()
            for path in version_info_paths(version):
                self.routes[path] = body
        self.hits: list[str] = []
        routes, hits = self.routes, self.hits

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                body = routes.get(self.path)
                status = 200 if body is not None else 404
                self.send_body(status, body if body is not None else b'{"detail":"Not Found"}')

        self.server = LoopbackHTTP(Handler)
        self.url = self.server.url

    def close(self) -> None:
        self.server.close()


class QuickStopSmg(SmgGateway):
    """``SmgGateway`` whose stop is a SIGKILL: at a test's stop of its gateway no client is
    left to finish for (the load has ended, or the test takes the gateway away on purpose,
    which a crash does as well), and smg's graceful stop took ~0.5 s of its 1 s grace."""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()


class QueuedRemovalGateway:
    """A real HTTP server on 127.0.0.1 with smg's admin API for one worker, whose removal,
    as smg's, is queued: DELETE answers 202 and the entry stays ``ready`` (routed) until the
    job runs ``applies_after_s`` later (None: never — a gateway whose job queue is stuck);
    then it is ``draining``. ``deletes`` counts the DELETEs."""

    def __init__(self, worker_url: str, applies_after_s: float | None) -> None:
        self.applies_after_s = applies_after_s
        self.deletes = 0
        self.removed_at: float | None = None
        gate = self

        class Handler(QuietHandler):
            def _send_json(self, status: int, data: Any) -> None:
                self.send_body(status, json.dumps(data).encode(), "application/json")

            def do_GET(self) -> None:
                worker = {"id": "w-1", "url": worker_url, "status": gate.status(),
                          "worker_type": "regular", "runtime_type": "sglang"}  # fmt: skip
                self._send_json(200, {"workers": [worker], "total": 1})

            def do_DELETE(self) -> None:
                gate.deletes += 1
                if gate.removed_at is None:
                    gate.removed_at = time.monotonic()
                queued = "Worker removal queued for background processing"
                self._send_json(202, {"status": "accepted", "worker_id": "w-1", "message": queued})

        self.server = LoopbackHTTP(Handler)
        self.url = self.server.url

    def status(self) -> str:
        """The worker's status now: ``draining`` once its removal's job has run."""
        done = (
            self.removed_at is not None
            and self.applies_after_s is not None
            and time.monotonic() >= self.removed_at + self.applies_after_s
        )
        return "draining" if done else "ready"

    def __enter__(self) -> QueuedRemovalGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.close()


def load_script(path: Path, name: str) -> ModuleType:
    """A script of the repository (not a package) loaded as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_fixtures_module() -> ModuleType:
    """tests/fixtures/metrics/make_fixtures.py, loaded as a module: the pages tests derive
    from SGLang's own."""
    path = Path(__file__).resolve().parent / "fixtures" / "metrics" / "make_fixtures.py"
    return load_script(path, "make_fixtures")


# A sweep at 1, 2, 4, 8, 16, 32, 64 of a step count whose capacity is 13 (the seed's steps
# 4): 16, 32 and 64 measured the plateau, with a little noise between them.
TABLE_SWEEP = (
    "steps,concurrency,output_tok_s,max_running_requests\n"
    "4,1,277,13\n4,2,520,\n4,4,900,\n4,8,1400,\n4,16,1610,\n4,32,1630,\n4,64,1620,\n"
    "2,1,186,\n2,2,350,\n2,4,640,\n"
    "3,1,234,40\n3,2,450,\n3,4,800,\n3,8,1200,\n"
)


# (rule, steps, concurrency, tok/s) every reader of a table must give for TABLE_SWEEP: specd's
# model (specd.core.perftable) and the twin (specd.twin.table), which share no code.
READING_RULES: list[tuple[str, int, float, float]] = [
    # A measured point comes back exactly, below, at and past capacity.
    ("measured point exact", 4, 1, 277.0),
    ("measured point exact", 4, 8, 1400.0),
    ("measured point exact", 4, 16, 1610.0),
    ("measured point exact", 4, 32, 1630.0),
    ("measured point exact", 4, 64, 1620.0),
    # At capacity and up to the first plateau point: the first plateau point, not an
    # interpolation between 8 and 16 at 13 (= 1531.25).
    ("plateau at capacity", 4, 13, 1610.0),
    ("plateau at capacity", 4, 14.5, 1610.0),
    ("plateau past capacity", 4, 24, 1620.0),  # between two plateau points
    ("plateau past capacity", 4, 48, 1625.0),
    # Measured only below capacity: read up to capacity, flat from there.
    ("plateau past capacity", 3, 40, 1200.0),
    ("plateau past capacity", 3, 100, 1200.0),
    ("linear between", 4, 3, 710.0),
    ("linear between", 4, 10, 1400.0 + 210.0 * 2 / 5),  # 8 → capacity 13 at 1610
    ("linear between", 3, 6, 1000.0),
    ("from the origin", 4, 0.5, 138.5),
    ("flat past the last", 2, 9, 640.0),  # no capacity
    ("flat past the last", 4, 1000, 1620.0),
]


def system_binary(name: str, package: str) -> str:
    """The path of ``name``, a tool scripts/install-system-deps installs (Debian's
    ``package``); missing, a failure, or a skip where SPECD_ALLOW_SKIP=1 allows it."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("SPECD_ALLOW_SKIP") == "1":
            pytest.skip(f"{name} missing (apt-get install {package})")
        pytest.fail(f"{name} missing: run scripts/install-system-deps (or SPECD_ALLOW_SKIP=1)")
    return path


def etcd_binary() -> str:
    """The etcd server (Debian's etcd-server)."""
    return system_binary("etcd", "etcd-server")


class EtcdProcess(loopback.EtcdProcess):
    """specd.tools.loopback.EtcdProcess, failing (or skipping) the test when etcd is missing."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir, etcd_binary())

    def reset(self) -> EtcdProcess:
        """As fresh for the next test: running (a test may have stopped it), no lease, no
        key. One etcd per module reset between its tests costs a few requests, where one
        per test cost a start and a stop (~1 s) each."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        with httpx.Client(base_url=self.url, timeout=5, verify=verifying_context()) as http:
            leases = http.post("/v3/lease/leases", json={}).raise_for_status().json()
            for lease in leases.get("leases", []):
                http.post("/v3/lease/revoke", json={"ID": lease["ID"]}).raise_for_status()
            everything = {"key": "AA==", "range_end": "AA=="}  # "\0" to "\0": every key
            http.post("/v3/kv/deleterange", json=everything).raise_for_status()
            left = http.post("/v3/kv/range", json={**everything, "count_only": True})
            assert int(left.raise_for_status().json().get("count", 0)) == 0
        return self


@pytest.fixture(scope="module", name="etcd_server")
def module_etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """One real etcd for a test module that imports this and ``module_etcd``."""
    server = EtcdProcess(tmp_path_factory.mktemp("etcd") / "etcd").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(name="etcd")
def module_etcd(etcd_server: EtcdProcess) -> EtcdProcess:
    """The module's etcd (in place of conftest's one per test), running, with no lease and
    no key: ``from factories import module_etcd, module_etcd_server`` in the module."""
    return etcd_server.reset()


class Killed(BaseException):
    """specd dying (SIGKILL) at a chosen point: nothing in apply or the daemon may catch it."""


# Runs ``main`` (``module:function``, a main(argv)) once per argv in one interpreter:
# interpreter start-up, not parsing, is what costs CPU on a 2-core CI machine. Whatever
# escapes ``main`` is printed and its code is "raised".
_MAINS_DRIVER = """
import contextlib, importlib, io, json, sys, time, traceback
module, _, function = sys.argv[1].partition(":")
main = getattr(importlib.import_module(module), function)
results = []
for argv in json.loads(sys.argv[2]):
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except Exception:
            traceback.print_exc()
            code = "raised"
    results.append([code, out.getvalue(), err.getvalue(), time.monotonic() - started])
print(json.dumps(results))
"""


def run_mains(main: str, argvs: list[list[str]]) -> list[tuple[object, str, str, float]]:
    """(exit code, stdout, stderr, seconds) of ``main`` run on each of ``argvs``, in order."""
    proc = subprocess.run(
        [sys.executable, "-c", _MAINS_DRIVER, main, json.dumps(argvs)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert len(results) == len(argvs)
    return [tuple(r) for r in results]


@dataclass
class NotifySocket:
    """A real AF_UNIX SOCK_DGRAM socket as systemd's NOTIFY_SOCKET; records every message."""

    path: Path
    messages: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode(errors="replace")))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()

    def times(self, line: str) -> list[float]:
        return [t for t, m in self.messages if line in m.split("\n")]


def gzip_bomb(decoded_bytes: int, layers: int = 1) -> bytes:
    """``decoded_bytes`` of zeros gzipped ``layers`` times (each layer ~1000:1), made a
    megabyte at a time: what a hostile server sends with Content-Encoding gzip."""

    def gzipped(chunks: Iterator[bytes]) -> bytes:
        packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
        return b"".join(packer.compress(c) for c in chunks) + packer.flush()

    mb = b"\0" * (1 << 20)
    body = gzipped(mb for _ in range(decoded_bytes >> 20))
    for _ in range(layers - 1):
        body = gzipped(iter([body]))
    return body
