"""Test data and helpers shared by the test modules (imported as ``factories``: tests/ is
on sys.path)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from specd.core.observation import Observation
from specd.core.perftable import PerfTable
from specd.core.settings import TABLE_OF_KEY
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
        pytest.skip(f"SKIPPED LOUDLY: cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def seed_table() -> PerfTable:
    """The seed preset as specd reads a table (the twin keeps its own table type)."""
    from specd.twin.preset import preset_table  # noqa: PLC0415 - the twin is a test aid here

    return PerfTable.from_csv_text(preset_table().to_csv_text(), source="seed preset")


# ---- SGLang versions: each one's own pages (tests/fixtures/metrics/versions/) ----

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

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle(self) -> None:
                with contextlib.suppress(ConnectionResetError):
                    super().handle()  # a client closing its kept-alive connection

            def do_GET(self) -> None:
                hits.append(self.path)
                body = routes.get(self.path)
                status = 200 if body is not None else 404
                body = body if body is not None else b'{"detail":"Not Found"}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def make_fixtures_module() -> ModuleType:
    """tests/fixtures/metrics/make_fixtures.py, loaded as a module (it is a script, not a
    package): the pages tests derive from SGLang's own."""
    path = Path(__file__).resolve().parent / "fixtures" / "metrics" / "make_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_fixtures", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
