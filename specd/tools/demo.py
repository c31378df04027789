"""`specd demo`: specd tuning the embedded SGLang twin through a compressed day.

Everything is real but the GPU server: the twin runs as its own process and is restarted
the way systemd restarts a unit with specd's drop-in (env file re-read at every start);
the daemon is the same `Daemon` as `specd run`, with a demo configuration (a window every
20 s, open for 15 s; short dwell and stabilization); the load generator streams real HTTP
requests. On a terminal it shows a live view; piped (CI logs, ``| tee``) it prints one line
per event and a status line every few seconds instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from specd.daemon import Daemon
from specd.io.config import Config
from specd.tools.load import LoadGenerator
from specd.twin.unit import twin_unit_config

START_STEPS = 3
WINDOW_EVERY_S = 20
WINDOW_OPEN_S = 15
STATUS_EVERY_S = 10.0  # piped output: one status line this often
LIGHT_CONCURRENCY = 2  # one developer's agentic coding session
HEAVY_CONCURRENCY = 24  # a batch job
# The compressed day, as fractions of --duration: quiet, burst, quiet.
PHASES = (
    ("quiet agentic traffic", 0.34, LIGHT_CONCURRENCY),
    ("heavy batch burst", 0.38, HEAVY_CONCURRENCY),
    ("quiet again", 0.28, LIGHT_CONCURRENCY),
)


def demo_config(workdir: Path, twin_port: int, metrics_port: int) -> Config:
    """Production rules, compressed: minutes become seconds."""
    return twin_unit_config(
        workdir,
        twin_port,
        observe={
            "scrape_interval_s": 1.0,
            "stale_after_s": 10.0,
            "history_half_life_s": 12.0,
            "min_history_s": 6.0,
            "warmup_exclude_s": 2.0,
        },
        choose={"stabilization_window_s": 6.0},
        restart={"min_dwell_s": 15.0, "daily_restart_budget": 50, "health_probe_timeout_s": 25.0},
        report={"metrics_port": metrics_port, "log_format": "json"},
        # A window opens every 20 s and stays open 15 s (production: once a night).
        windows=[
            {
                "cron": f"*/{WINDOW_EVERY_S} * * * * *",
                "duration_s": WINDOW_OPEN_S,
                "timezone": "UTC",
            }
        ],
    )


@dataclass
class DemoRecord:
    seconds_at_steps: defaultdict[int, float] = field(default_factory=lambda: defaultdict(float))
    output_tokens: int = 0
    events: list[str] = field(default_factory=list)
    # Why each restart happened ("change: …"), in the order of daemon.state.restarts.
    restart_reasons: list[str] = field(default_factory=list)
    # The last acting decision seen per target step count, until its restart shows up.
    acting: dict[int, str] = field(default_factory=dict)


def note_acting_decision(daemon: Daemon, record: DemoRecord) -> None:
    """Remember why the daemon is restarting: its decision stays current during the restart."""
    d = daemon.last_decision
    if d is not None and d.target_steps is not None and d.acts(daemon.live_steps):
        record.acting[d.target_steps] = f"{d.reason.value}: {d.message}"


def restart_line(elapsed: float, r: dict[str, Any], reason: str) -> str:
    took = float(r.get("duration_s") or 0)
    return (
        f"{elapsed:5.0f} s  restart {r['from_steps']} → {r['to_steps']}: {r['result']} in "
        f"{took:.1f} s — {reason}"
    )


def status_line(daemon: Daemon, elapsed: float, phase: str, conc: int) -> str:
    obs = daemon.last_obs
    d = daemon.last_decision
    steps = obs.steps if obs is not None else "?"
    p50 = daemon.state.history.quantile(0.5)
    decision = f"{d.reason.value}: target {d.target_steps}" if d is not None else "-"
    # As the last decision saw it: read now, a window that closed since sat beside a change
    # decided while it was open ("window closed; decision change").
    decided_at = daemon.state.last_decision.get("t") if daemon.state.last_decision else None
    at = decided_at if isinstance(decided_at, (int, float)) else None
    window = "open" if daemon._window_open(at=at) else "closed"
    offered = f"{p50:.1f}" if p50 is not None else "-"
    return (
        f"{elapsed:5.0f} s  {phase}, {conc} clients; steps {steps}, offered p50 {offered}, "
        f"window {window}; decision {decision}"
    )


def _phase_at(elapsed: float, duration: float) -> tuple[str, int]:
    edge = 0.0
    for name, share, concurrency in PHASES:
        edge += share * duration
        if elapsed < edge:
            return name, concurrency
    return PHASES[-1][0], PHASES[-1][2]


def _view(
    daemon: Daemon,
    elapsed: float,
    duration: float,
    phase: str,
    conc: int,
    record: DemoRecord,
    metrics_url: str,
) -> Group:
    obs = daemon.last_obs
    d = daemon.last_decision
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", width=18)
    table.add_column()
    table.add_row("time", f"{elapsed:5.0f} s of {duration:.0f} s   phase: {phase}")
    table.add_row("load", f"{conc} closed-loop clients")
    if obs is not None:
        accept = f"{obs.accept_length:.2f}" if obs.accept_length is not None else "-"
        table.add_row(
            "SGLang twin",
            f"running {obs.running}, queued {obs.queued}, "
            f"{(obs.gen_throughput or 0):.0f} tok/s, accept length {accept}",
        )
        table.add_row("steps live", Text(str(obs.steps), style="bold green"))
    else:
        table.add_row("SGLang twin", "not answering (restarting?)")
    p50 = daemon.state.history.quantile(0.5)
    table.add_row("offered p50", f"{p50:.1f}" if p50 is not None else "-")
    if d is not None:
        table.add_row("decision", f"{d.reason.value}: target {d.target_steps} — {d.message}")
    table.add_row("window", "OPEN" if daemon._window_open() else "closed")
    table.add_row("metrics", metrics_url)
    events = Text("\n".join(record.events[-8:]) or "(no restarts yet)")
    return Group(table, Text("restarts:", style="bold"), events)


async def _drive(
    daemon: Daemon,
    url: str,
    duration: float,
    record: DemoRecord,
    console: Console,
    metrics_url: str,
    live_view: bool,
) -> None:
    started = time.monotonic()
    seen_restarts = 0
    printed = 0
    last = started
    next_status = 0.0
    async with LoadGenerator(url, max_concurrency=HEAVY_CONCURRENCY, max_tokens=256) as gen:
        live = Live(console=console, refresh_per_second=2, transient=False) if live_view else None
        with live if live is not None else contextlib.nullcontext():
            while (elapsed := time.monotonic() - started) < duration:
                phase, conc = _phase_at(elapsed, duration)
                if gen.concurrency != conc:
                    gen.set_concurrency(conc)
                    record.events.append(f"{elapsed:5.0f} s  load → {conc} clients ({phase})")
                await asyncio.sleep(0.5)
                now = time.monotonic()
                obs = daemon.last_obs
                if obs is not None and obs.steps is not None:
                    record.seconds_at_steps[obs.steps] += now - last
                last = now
                note_acting_decision(daemon, record)
                for r in daemon.state.restarts[seen_restarts:]:
                    reason = record.acting.pop(int(r["to_steps"]), "reason not seen")
                    record.restart_reasons.append(reason)
                    record.events.append(restart_line(elapsed, r, reason))
                seen_restarts = len(daemon.state.restarts)
                if live is not None:
                    live.update(_view(daemon, elapsed, duration, phase, conc, record, metrics_url))
                    continue
                for line in record.events[printed:]:
                    console.print(line, highlight=False, soft_wrap=True)
                printed = len(record.events)
                if elapsed >= next_status:
                    console.print(
                        status_line(daemon, elapsed, phase, conc), highlight=False, soft_wrap=True
                    )
                    next_status = elapsed + STATUS_EVERY_S
            record.output_tokens += gen.take_result().output_tokens
