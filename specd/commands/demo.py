"""`specd demo`: specd tuning the embedded SGLang twin through a compressed day."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from rich.console import Console

from specd.commands.args import PORT_OR_FREE, Seconds
from specd.daemon import Daemon
from specd.io import logs
from specd.io.notify import Notifier
from specd.tools.demo import START_STEPS, DemoRecord, _drive, demo_config
from specd.twin.process import free_port
from specd.twin.unit import TwinUnitRunner

# Each of the three phases needs about 15 s to show a change.
DURATION_S = Seconds(45, 86400)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration-s",
        "--duration",
        dest="duration",
        type=DURATION_S,
        default=180.0,
        help=f"length of the compressed day ({DURATION_S.spec}; default 180)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--metrics-port",
        type=PORT_OR_FREE,
        default=0,
        help=f"where specd serves its metrics ({PORT_OR_FREE.spec}; default 0: a free port)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep state, env file and logs here (default: a temp dir)",
    )


def run(args: argparse.Namespace) -> int:
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="specd-demo-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file there, or no permission
            print(f"specd demo: --workdir {workdir}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    try:
        return _run(args, workdir)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(args: argparse.Namespace, workdir: Path) -> int:
    console = Console(stderr=args.json, soft_wrap=True)
    twin_port = free_port()
    metrics_port = args.metrics_port or free_port()
    config = demo_config(workdir, twin_port, metrics_port)
    log_path = workdir / "specd.log"
    log_file = log_path.open("a")
    logs.configure("json", stream=log_file)
    unit = TwinUnitRunner(
        config.sglang.unit,
        Path(config.sglang.env_file),
        port=twin_port,
        defaults={
            "SPECULATIVE_NUM_STEPS": str(START_STEPS),
            "SPECULATIVE_NUM_DRAFT_TOKENS": str(START_STEPS + 1),
        },
        extra_args=["--load-time-s", "2", "--served-model-name", "demo-qwen35-122b"],
        # The load generator never lets the twin drain (SGLang waits for running requests
        # with no deadline); systemd's TimeoutStopSec would end it, compressed here.
        stop_timeout_s=2.0,
    )
    console.print(f"starting the SGLang twin at steps {START_STEPS} on port {twin_port} …")
    twin = unit.start()
    try:
        twin.wait_healthy(60)
        daemon = Daemon(
            config, None, registry=CollectorRegistry(), runner=unit, notifier=Notifier(environ={})
        )
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        # A --workdir used before holds that run's state: only this run's restarts count.
        restarts_before = len(daemon.state.restarts)
        exit_code: list[int] = []
        thread = threading.Thread(
            target=lambda: exit_code.append(daemon.run()), name="specd", daemon=True
        )
        thread.start()
        # The daemon's start can fail at once (its metrics port taken): say so, not a
        # whole demo of "steps ?" and an empty summary.
        thread.join(timeout=2.0)
        if not thread.is_alive():
            print(
                f"specd demo: specd stopped at start (exit {exit_code[0] if exit_code else '?'}"
                f"); its log: {log_path}: {_last_line(log_path)}",
                file=sys.stderr,
            )
            return 1
        console.print(f"specd runs; its metrics: {metrics_url}; its log: {log_path}")
        record = DemoRecord()
        try:
            asyncio.run(
                _drive(
                    daemon,
                    config.sglang.url,
                    args.duration,
                    record,
                    console,
                    metrics_url,
                    # Piped (CI logs, `| tee`): line events, not frames nobody sees.
                    live_view=console.is_terminal,
                )
            )
        finally:
            daemon.request_stop()
            thread.join(timeout=120)
        summary = _summary(daemon, record, args.duration, restarts_before)
    finally:
        unit.stop()
        log_file.close()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(console, summary)
    return 0


def _last_line(path: Path) -> str:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return lines[-1] if lines else "(empty)"


def _summary(
    daemon: Daemon, record: DemoRecord, duration: float, restarts_before: int = 0
) -> dict[str, Any]:
    restarts = daemon.state.restarts[restarts_before:]
    return {
        "duration_s": duration,
        "restarts": [
            {k: r.get(k) for k in ("from_steps", "to_steps", "result", "duration_s")}
            | {"reason": reason}
            for r, reason in zip(restarts, _reasons(record, restarts), strict=True)
        ],
        "restarts_to_steps": sorted(
            {int(r["to_steps"]) for r in restarts if r.get("result") == "success"}
        ),
        "seconds_at_steps": {
            str(k): round(v, 1) for k, v in sorted(record.seconds_at_steps.items())
        },
        "output_tokens": record.output_tokens,
        "decisions": {reason: int(n) for reason, n in _decision_counts(daemon).items() if n},
        "frozen": daemon.state.frozen,
    }


def _reasons(record: DemoRecord, restarts: list[dict[str, Any]]) -> list[str]:
    # A restart that finished after the drive loop ended (the daemon was mid-restart at
    # the end) has its decision still in `acting`.
    seen = record.restart_reasons[: len(restarts)]
    late = [record.acting.get(int(r["to_steps"]), "reason not seen") for r in restarts[len(seen) :]]
    return seen + late


def _decision_counts(daemon: Daemon) -> dict[str, float]:
    counts: dict[str, float] = {}
    for metric in daemon.metrics.decisions.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                counts[sample.labels["reason"]] = sample.value
    return counts


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    console.rule("summary")
    console.print(f"restarts: {len(s['restarts'])}")
    for r in s["restarts"]:
        console.print(
            f"  {r['from_steps']} → {r['to_steps']}: {r['result']} "
            f"({float(r['duration_s'] or 0):.1f} s) — {r['reason']}",
            highlight=False,
            soft_wrap=True,
        )
    at = ", ".join(f"steps {k}: {v:.0f} s" for k, v in s["seconds_at_steps"].items())
    console.print(f"time at each step count: {at}")
    console.print(f"tokens served to the load generator: {s['output_tokens']}")
    console.print(
        "decisions by reason: " + ", ".join(f"{k} {v}" for k, v in s["decisions"].items())
    )
