"""Scrape-to-Observation CPU cost: prometheus_client's full parse vs specd's selective one.

For each page size it prints, side by side in one run: CPU ms to parse the whole page
with prometheus_client, CPU ms of ``parse_metrics`` (specd's families only), their
ratio, and CPU and wall ms of a whole ``SGLangClient.observe()`` (GET /metrics + GET
/server_info over loopback HTTP + parse). The pages are served by a separate process,
so only specd's side of the scrape counts towards its CPU time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

from prometheus_client.parser import text_string_to_metric_families

from specd.core.observation import Observation
from specd.io.sglang import SGLangClient, parse_metrics

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "metrics"
TARGET_CPU_MS = 5.0  # issue 2: a ~2,000-sample page, scrape to Observation
PAGES = (
    ("one TP rank", "sglang-0.5.23-loaded.prom"),
    ("2 DP ranks", "dp2.prom"),
    ("4 DP ranks", "dp4-2000.prom"),
)


@dataclass(frozen=True)
class Row:
    page: str
    samples: int
    kbytes: float
    full_parse_ms: float
    fast_parse_ms: float
    ratio: float
    observe_cpu_ms: float
    observe_wall_ms: float


def _make_fixtures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {FIXTURES / 'make_fixtures.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _full_parse(text: str) -> int:
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def cpu_ms(fn: Callable[[], object], min_s: float, min_reps: int) -> float:
    """Mean CPU ms per call, over at least ``min_reps`` calls and ``min_s`` CPU seconds."""
    reps = 0
    start = time.process_time()
    while True:
        fn()
        reps += 1
        spent = time.process_time() - start
        if reps >= min_reps and spent >= min_s:
            return spent / reps * 1000.0


def _serve(directory: Path) -> None:
    """Serve DIR/NAME.prom at /NAME/metrics and DIR/server_info.json at /NAME/server_info."""
    info = (directory / "server_info.json").read_bytes()
    pages = {p.stem: p.read_bytes() for p in directory.glob("*.prom")}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            name, _, endpoint = self.path.strip("/").partition("/")
            body = {"metrics": pages.get(name), "server_info": info}.get(endpoint)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(httpd.server_address[1], flush=True)
    httpd.serve_forever()


def measure(quick: bool) -> list[Row]:
    mf = _make_fixtures()
    min_s = 0.1 if quick else 0.5
    named = [(label, (FIXTURES / name).read_text()) for label, name in PAGES]
    named.append(("5 MB, scanner paths", mf.big_page()))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="specd-bench-") as tmp:
        for i, (_, text) in enumerate(named):
            (Path(tmp) / f"p{i}.prom").write_text(text)
        (Path(tmp) / "server_info.json").write_text(
            json.dumps(mf.server_infos()["server_info-loaded.json"])
        )
        server = subprocess.Popen(
            [sys.executable, "-m", "bench.bench_observe", "--serve", tmp],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            for i, (label, text) in enumerate(named):
                big = len(text) > 1_000_000
                full = cpu_ms(
                    partial(_full_parse, text),
                    min_s=0.0 if big else min_s,
                    min_reps=1 if big else 3,
                )
                fast = cpu_ms(partial(parse_metrics, text), min_s=min_s, min_reps=3)
                with SGLangClient(f"http://127.0.0.1:{port}/p{i}") as client:
                    first = client.observe()
                    if not isinstance(first, Observation):
                        raise RuntimeError(f"{label}: {first.reason}")
                    wall_start = time.perf_counter()
                    cpu_start = time.process_time()
                    reps = 0
                    while reps < 5 or (
                        time.process_time() - cpu_start < min_s
                        and time.perf_counter() - wall_start < 10 * min_s
                    ):
                        client.observe()
                        reps += 1
                    observe_cpu = (time.process_time() - cpu_start) / reps * 1000.0
                    observe_wall = (time.perf_counter() - wall_start) / reps * 1000.0
                samples = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
                rows.append(
                    Row(
                        page=label,
                        samples=samples,
                        kbytes=len(text.encode()) / 1024,
                        full_parse_ms=full,
                        fast_parse_ms=fast,
                        ratio=full / fast,
                        observe_cpu_ms=observe_cpu,
                        observe_wall_ms=observe_wall,
                    )
                )
        finally:
            server.terminate()
            server.wait(timeout=10)
    return rows


def report(rows: list[Row]) -> str:
    head = (
        f"{'page':<22}{'samples':>8}{'KB':>8}{'full parse':>12}{'specd parse':>13}"
        f"{'ratio':>8}{'observe CPU':>13}{'observe wall':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.page:<22}{r.samples:>8}{r.kbytes:>8.0f}{r.full_parse_ms:>10.2f}ms"
            f"{r.fast_parse_ms:>11.3f}ms{r.ratio:>7.0f}x{r.observe_cpu_ms:>11.3f}ms"
            f"{r.observe_wall_ms:>12.3f}ms"
        )
    target = next(r for r in rows if r.page == "4 DP ranks")
    verdict = "met" if target.observe_cpu_ms <= TARGET_CPU_MS else "NOT met"
    lines.append(
        f"\ntarget: scrape-to-Observation of a ~2,000-sample page <= {TARGET_CPU_MS:g} ms CPU: "
        f"{target.observe_cpu_ms:.2f} ms ({verdict})"
    )
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench observe", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--quick", action="store_true", help="shorter timing loops")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        _serve(args.serve)
        return 0
    rows = measure(quick=args.quick)
    print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
