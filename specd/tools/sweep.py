"""`specd sweep`: the hand-tuning campaign in one command.

For each setting (each step count K; with ``--off`` no speculation, written as steps 0;
with ``--adaptive`` SGLang's adaptive candidate sets the server can run): apply it through
the daemon's own restart sequence (env file, `systemctl restart`, /health_generate,
verify), warm up, run closed-loop load at each concurrency, and record aggregate and
per-request tok/s, TTFT, accept length and ``max_running_requests``. Writes ``sweep.csv``
(the performance-table format the model policy and the twin read; adaptive rows carry
their set in the ``setting`` column), ``sweep.md``, ``sweep.json`` and ``sweep.png``, and
puts the original setting (off or static K) back at the end, on failure, and on
SIGINT/SIGTERM.

The restart journal goes to state.json like the daemon's, so a sweep killed mid-restart is
finished (rolled back or verified) by the daemon's reconcile on its next start. The daemon
must not run during a sweep: it would restart SGLang and overwrite state.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import os
import re
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, TextIO, TypeVar

import httpx

from specd.core.adaptive import AdaptiveModel
from specd.core.choices import offer
from specd.core.history import HistorySettings
from specd.core.model import Calibration, adaptive_slots
from specd.core.observation import Observation, ScrapeError
from specd.core.perftable import PerfRow, PerfTable
from specd.core.setting import (
    SpecSetting,
    describe_server,
    format_setting,
    outside_steps,
    static,
    traits_from_server_info,
)
from specd.core.setting import off as setting_off
from specd.core.setting import parse as parse_setting
from specd.io import files, tables
from specd.io.apply import Applier, ApplyOutcome, setting_of_steps, setting_steps
from specd.io.config import Config
from specd.io.runner import Runner, SubprocessRunner
from specd.io.sglang import SERVER_KEY_SETTING, SGLangClient
from specd.io.state import State, StateStore
from specd.io.tls import verifying_context
from specd.tools.load import LoadGenerator, LoadRefused, LoadResult

CSV_NAME = "sweep.csv"
MARKDOWN_NAME = "sweep.md"
JSON_NAME = "sweep.json"
CHART_NAME = "sweep.png"
LOG_NAME = "sweep.log"
# Results for the operator (and the model policy, for the CSV): readable by all.
OUTPUT_FILE_MODE = 0o644
# Accept-length gauges are sampled this often while load runs.
SAMPLE_INTERVAL_S = 0.5
# Before each point, load runs until every client finished one request, at most
# max(this, --duration-s) seconds.
SETTLE_MIN_CAP_S = 30.0
SETTLE_POLL_S = 0.05
# The daemon's /metrics answers within this or is taken as not running.
DAEMON_PROBE_TIMEOUT_S = 1.0
# Twin mode: a compressed model load, so a demo sweep takes a minute, not an hour.
TWIN_LOAD_TIME_S = 1.0
TWIN_WARMUP_S = 0.3
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_SIGNAL_BASE = 128


class SweepError(Exception):
    """A sweep that cannot start; the message is one line."""


_T = TypeVar("_T")


@dataclass(frozen=True)
class SweepPlan:
    steps: tuple[int, ...]
    concurrency: tuple[int, ...]
    duration_s: float = 60.0
    warmup_s: float = 20.0
    max_tokens: int = 256
    # Measure no speculation too (rows with steps 0): the operator's --off.
    off: bool = False
    # SGLang adaptive candidate sets to measure, in their text form ("adaptive:3,4").
    adaptive: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("--steps: give at least one step count")
        canonical = []
        for text in self.adaptive:
            try:
                setting = parse_setting(text)
            except ValueError as exc:
                raise ValueError(f"--adaptive: {exc}") from None
            if setting.kind != "adaptive":
                raise ValueError(f"--adaptive: {text!r} is not an adaptive set (adaptive:3,4)")
            canonical.append(format_setting(setting))
        if len(set(canonical)) != len(canonical):
            raise ValueError("--adaptive: a set is listed twice")
        object.__setattr__(self, "adaptive", tuple(canonical))
        if not self.concurrency:
            raise ValueError("--concurrency: give at least one concurrency")
        if len(set(self.steps)) != len(self.steps):
            raise ValueError("--steps: a step count is listed twice")
        if len(set(self.concurrency)) != len(self.concurrency):
            raise ValueError("--concurrency: a value is listed twice")
        if min(self.concurrency) < 1:
            raise ValueError("--concurrency: values must be at least 1")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"--duration-s must be > 0, got {self.duration_s}")
        if not (math.isfinite(self.warmup_s) and self.warmup_s >= 0):
            raise ValueError(f"--warmup-s must be >= 0, got {self.warmup_s}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {self.max_tokens}")

    def settings(self) -> list[SpecSetting]:
        """What the sweep measures: each static K, then off, then each adaptive set."""
        out = [static(k) for k in self.steps]
        if self.off:
            out.append(setting_off())
        return out + [parse_setting(text) for text in self.adaptive]

    @property
    def points(self) -> int:
        return len(self.settings()) * len(self.concurrency)

    def load_seconds_per_steps(self) -> float:
        return self.warmup_s + self.duration_s * len(self.concurrency)


@dataclass(frozen=True)
class SweepPoint:
    """One measured (steps, concurrency) point."""

    steps: int
    concurrency: int
    output_tok_s: float
    per_request_tok_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    accept_length: float | None
    max_running_requests: int | None
    requests: int
    errors: int
    duration_s: float
    # An adaptive set (text form) for its points, whose ``steps`` is its deepest candidate;
    # None for static K and off (steps 0).
    setting: str | None = None

    @property
    def label(self) -> str:
        return label_of(self.steps, self.setting)


def label_of(steps: int, setting: str | None) -> str:
    """How a point's setting reads in progress lines and the report."""
    if setting is not None:
        return setting
    return "off" if steps == 0 else f"steps {steps}"


def describe_setting(setting: SpecSetting) -> str:
    return label_of(
        setting.max_steps, format_setting(setting) if setting.kind == "adaptive" else None
    )


def failure_key(setting: SpecSetting) -> int | str:
    """The report's key for a setting: its step count (0 = off), an adaptive set's text."""
    steps = setting_steps(setting)
    return format_setting(setting) if steps is None else steps


@dataclass
class SweepReport:
    """What a sweep did; ``ok`` only when every K was measured and the original restored."""

    original_steps: int
    plan: SweepPlan
    out_dir: Path
    points: list[SweepPoint] = field(default_factory=list)
    # K (0 = off) or adaptive set -> why it was not (fully) measured.
    failed_steps: dict[int | str, str] = field(default_factory=dict)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    interrupted_by: str | None = None
    error: str | None = None
    restored: bool = False
    final_steps: int | None = None
    files: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.restored
            and not self.failed_steps
            and self.interrupted_by is None
            and self.error is None
        )

    def table(self) -> PerfTable | None:
        rows = [
            PerfRow(
                steps=p.steps,
                concurrency=float(p.concurrency),
                output_tok_s=round(p.output_tok_s, 1),
                accept_length=None if p.accept_length is None else round(p.accept_length, 4),
                max_running_requests=p.max_running_requests,
                setting=p.setting,
            )
            for p in self.points
        ]
        return PerfTable(rows, source=str(self.out_dir / CSV_NAME)) if rows else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "out_dir": str(self.out_dir),
            "original_steps": self.original_steps,
            "final_steps": self.final_steps,
            "restored": self.restored,
            "plan": asdict(self.plan),
            "points": [asdict(p) for p in self.points],
            "failed_steps": {str(k): v for k, v in self.failed_steps.items()},
            "restarts": self.restarts,
            "interrupted_by": self.interrupted_by,
            "error": self.error,
        }


# -- progress -------------------------------------------------------------------------------


class Reporter:
    """Where a sweep tells its progress; the base class says nothing (tests, --json)."""

    def start(self, plan: SweepPlan, order: Sequence[SpecSetting], original: int) -> None:
        """The sweep begins; ``original`` is SGLang's step count (0 = off)."""

    def phase(self, text: str) -> None:
        """A new activity (restarting, warming up, measuring ...)."""

    def point(self, done: int, total: int, point: SweepPoint, eta_s: float | None) -> None:
        """A point was measured."""

    def tick(self, progress_s: float, eta_s: float | None) -> None:
        """Time passes inside a phase (``progress_s`` of planned work done)."""

    def message(self, text: str) -> None:
        """Something the operator should read (failures, restore)."""

    def close(self) -> None:
        """The sweep is over."""


def _runs(steps: int) -> str:
    return "no speculation" if steps == 0 else f"{steps} steps"


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def describe_point(p: SweepPoint) -> str:
    ttft = "-" if p.ttft_p50_s is None else f"{p.ttft_p50_s * 1000:.0f} ms"
    accept = "-" if p.accept_length is None else f"{p.accept_length:.2f}"
    errors = f", {p.errors} errors" if p.errors else ""
    return (
        f"{p.label} c={p.concurrency}: {p.output_tok_s:.1f} tok/s "
        f"(per request {p.per_request_tok_s:.1f}, TTFT p50 {ttft}, accept {accept}{errors})"
    )


class PlainReporter(Reporter):
    """One line per event: for logs and pipes."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def _say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, plan: SweepPlan, order: Sequence[SpecSetting], original: int) -> None:
        self._say(
            f"sweep: {', '.join(map(describe_setting, order))} × concurrency "
            f"{','.join(map(str, plan.concurrency))}; SGLang runs {_runs(original)} now"
        )

    def phase(self, text: str) -> None:
        self._say(text)

    def point(self, done: int, total: int, point: SweepPoint, eta_s: float | None) -> None:
        self._say(f"[{done}/{total}] {describe_point(point)}  ETA {format_eta(eta_s)}")

    def message(self, text: str) -> None:
        self._say(text)


class RichReporter(Reporter):
    """A progress bar with ETA on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        from rich.console import Console  # noqa: PLC0415  (only on a terminal)
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

        self.console = Console(file=stream)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            console=self.console,
            transient=False,
        )
        self.task = self.progress.add_task("starting", total=1.0, eta="?")
        self.total_s = 1.0

    def start(self, plan: SweepPlan, order: Sequence[SpecSetting], original: int) -> None:
        self.console.print(
            f"sweep: {', '.join(map(describe_setting, order))} × concurrency "
            f"{','.join(map(str, plan.concurrency))}; SGLang runs {_runs(original)} now"
        )
        self.total_s = plan.load_seconds_per_steps() * len(order)
        self.progress.update(self.task, total=self.total_s)
        self.progress.start()

    def phase(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def tick(self, progress_s: float, eta_s: float | None) -> None:
        self.progress.update(self.task, completed=min(progress_s, self.total_s),
                             eta=format_eta(eta_s))  # fmt: skip

    def point(self, done: int, total: int, point: SweepPoint, eta_s: float | None) -> None:
        self.progress.console.print(f"[{done}/{total}] {describe_point(point)}", highlight=False)
        self.progress.update(self.task, eta=format_eta(eta_s))

    def message(self, text: str) -> None:
        self.progress.console.print(text, highlight=False, markup=False)

    def close(self) -> None:
        self.progress.stop()


# -- the journal in state.json ------------------------------------------------------------------


class StateJournal:
    """Persists the restart journal into state.json, where the daemon reconciles it."""

    def __init__(self, config: Config) -> None:
        self.store = StateStore(
            Path(config.files.state_dir), history_settings=HistorySettings.from_config(config)
        )
        self.state: State | None = None
        self.problem: str | None = None

    def open(self) -> None:
        """Load state.json; refuse when it holds an unfinished restart (SweepError)."""
        state, problem = self.store.load()
        if problem is not None:
            self.problem = problem
        if state.journal is not None and state.journal.get("phase") not in (
            "done",
            "rolled_back",
            "failed",
            "aborted",
        ):
            raise SweepError(
                f"{self.store.path} holds an unfinished restart ({state.journal.get('phase')}); "
                "start specd once so it reconciles it, then stop it and sweep"
            )
        self.state = state

    def __call__(self, journal: dict[str, Any] | None) -> None:
        assert self.state is not None
        self.state.journal = journal
        error = self.store.save(self.state)
        if error is not None:
            raise OSError(error)
        _match_owner(self.store.path, self.store.state_dir)

    def clear(self) -> None:
        """The sequence ended and was reported: nothing for the daemon to reconcile."""
        if self.state is not None and self.state.journal is not None:
            self(None)


def _match_owner(path: Path, directory: Path) -> None:
    # `sudo specd sweep` would leave a root-owned 0600 state.json the specd user cannot
    # read; give it to whoever owns the state directory, as the daemon wrote it.
    if os.geteuid() != 0:
        return
    with contextlib.suppress(OSError):
        owner = directory.stat()
        if path.stat().st_uid != owner.st_uid:
            os.chown(path, owner.st_uid, owner.st_gid)


def daemon_running(config: Config) -> str | None:
    """A one-line reason when specd's own /metrics answers (the daemon runs), else None."""
    if config.report.metrics_port == 0:
        return None
    host = config.report.metrics_listen_address
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104
    netloc = f"[{host}]" if ":" in host else host
    url = f"http://{netloc}:{config.report.metrics_port}/metrics"
    try:
        response = httpx.get(
            url,
            timeout=DAEMON_PROBE_TIMEOUT_S,
            trust_env=False,
            verify=verifying_context(trust_env=False),
        )
    except httpx.HTTPError:
        return None
    if response.status_code == 200 and "specd_" in response.text:
        return (
            f"specd is running (its metrics answer on {url}); stop it first "
            "(`systemctl stop specd`): it would restart SGLang and overwrite state.json "
            "during the sweep"
        )
    return None


# -- measuring ----------------------------------------------------------------------------


def steps_order(steps: Sequence[_T], original: _T) -> list[_T]:
    """The original setting last (when swept), so the sweep ends where it began without a
    restart."""
    rest = [k for k in steps if k != original]
    return [*rest, original] if original in steps else rest


def accept_length_between(
    first: Observation | ScrapeError | None,
    last: Observation | ScrapeError | None,
    samples: Sequence[Observation],
) -> float | None:
    """Accept length over a measured window.

    From the counters (Δ generated tokens / Δ verify steps) when SGLang has them and they
    moved; else the mean of the gauge while requests ran (it holds stale values when idle).
    """
    if isinstance(first, Observation) and isinstance(last, Observation):
        tokens = _delta(first.generation_tokens_total, last.generation_tokens_total)
        verifies = _delta(first.spec_verify_calls_total, last.spec_verify_calls_total)
        if tokens is not None and verifies is not None and verifies > 0 and tokens >= verifies:
            return tokens / verifies
    fresh = [s.accept_length for s in samples if s.spec_fresh and s.accept_length is not None]
    return sum(fresh) / len(fresh) if fresh else None


def _delta(before: float | None, after: float | None) -> float | None:
    if before is None or after is None or after < before:
        return None
    return after - before


@dataclass
class _Clock:
    """Planned-work accounting for the ETA."""

    plan: SweepPlan
    order_len: int
    done_load_s: float = 0.0
    restart_durations: list[float] = field(default_factory=list)
    restarts_left: int = 0

    def eta(self, in_phase_s: float = 0.0) -> float | None:
        load_left = self.plan.load_seconds_per_steps() * self.order_len - self.done_load_s
        load_left -= in_phase_s
        if self.restarts_left and not self.restart_durations:
            return None  # no restart measured yet: its length is anyone's guess
        mean_restart = (
            sum(self.restart_durations) / len(self.restart_durations)
            if self.restart_durations
            else 0.0
        )
        return max(load_left, 0.0) + self.restarts_left * mean_restart


def restore_by_hand(config: Config, original: SpecSetting) -> str:
    """What the operator does when the sweep could not put ``original`` back: a pin that
    specd, started again (the sweep wants it stopped), applies at once."""
    pin = shlex.join(
        [
            "specd",
            "override",
            "pin",
            format_setting(original),
            "--for",
            "1d",
            "--reason",
            "the sweep could not restore it",
            "--now",
        ]
    )
    return (
        f"fix it by hand: `{pin}`, then start specd, which restarts SGLang into it; or "
        f"write it in the env file {config.sglang.env_file} and restart {config.sglang.unit}"
    )


class _Sweeper:
    def __init__(
        self,
        config: Config,
        plan: SweepPlan,
        out_dir: Path,
        runner: Runner,
        reporter: Reporter,
        stop: threading.Event,
        pacing: Mapping[str, Any],
    ) -> None:
        self.config = config
        self.plan = plan
        self.out_dir = out_dir
        self.runner = runner
        self.reporter = reporter
        self.stop = stop
        self.pacing = dict(pacing)
        self.client = SGLangClient(
            config.sglang.url,
            timeout_s=config.observe.scrape_timeout_s,
            api_key=config.sglang.server_api_key_file,
        )
        self.journal = StateJournal(config)
        # What SGLang runs: off or static K (adaptive while one is measured); None: unknown.
        self.current: SpecSetting | None = None

    def close(self) -> None:
        self.client.close()

    # -- restarts ---------------------------------------------------------------------
    def _apply(self, target: SpecSetting, *, stop: threading.Event) -> ApplyOutcome:
        applier = Applier.from_settings(
            self.config, self.client, self.runner, self.journal, stop, **self.pacing
        )
        outcome = applier.apply_setting(target, self.current, window_open=lambda: True, force=True)
        # The outcome is reported below; the daemon has nothing left to reconcile.
        try:
            self.journal.clear()
        except OSError as exc:
            self.reporter.message(f"warning: {exc}")
        return outcome

    def change_to(self, target: SpecSetting, report: SweepReport, clock: _Clock) -> ApplyOutcome:
        before = "unknown" if self.current is None else describe_setting(self.current)
        self.reporter.phase(f"restarting SGLang: {before} → {describe_setting(target)}")
        outcome = self._apply(target, stop=self.stop)
        report.restarts.append(outcome.to_dict())
        if outcome.restarts_issued:
            clock.restart_durations.append(outcome.duration_s)
        self._follow(outcome, target)
        return outcome

    def _follow(self, outcome: ApplyOutcome, target: SpecSetting) -> None:
        """What SGLang runs after ``outcome``."""
        if outcome.result == "success":
            self.current = target
        elif outcome.result == "rolled_back":
            self.current = (
                None if outcome.from_setting is None else parse_setting(outcome.from_setting)
            )
        elif outcome.result == "failed":
            self.current = None

    def restore(self, report: SweepReport) -> None:
        original = setting_of_steps(report.original_steps)
        assert original is not None  # the sweep starts only on off or a static K
        said = _runs(report.original_steps)
        if self.current == original:
            report.restored, report.final_steps = True, report.original_steps
            return
        self.reporter.phase(f"restoring {said}")
        self.reporter.message(f"restoring the original {said} …")
        # A fresh stop event: Ctrl-C already stopped the sweep, it must not stop the restore.
        outcome = self._apply(original, stop=threading.Event())
        report.restarts.append(outcome.to_dict())
        self._follow(outcome, original)
        report.final_steps = setting_steps(self.current)
        report.restored = self.current == original
        if report.restored:
            self.reporter.message(f"restored: SGLang runs {said} again")
        else:
            self.reporter.message(
                f"RESTORE FAILED: SGLang is not back on {said} ({outcome.result}: "
                f"{outcome.message}); {restore_by_hand(self.config, original)}"
            )

    # -- load -------------------------------------------------------------------------
    async def measure(
        self,
        setting: SpecSetting,
        capacity: int | None,
        clock: _Clock,
        on_point: Callable[[SweepPoint], None],
    ) -> str | None:
        """Warm up and measure every concurrency at ``setting``; a problem, or None."""
        try:
            return await self._measure(setting, capacity, clock, on_point)
        except (LoadRefused, files.KeyFileError) as exc:
            # No request of the sweep can succeed (SGLang's --api-key): stop, and restore.
            return f"{describe_setting(setting)}: {exc}"

    async def _measure(
        self,
        setting: SpecSetting,
        capacity: int | None,
        clock: _Clock,
        on_point: Callable[[SweepPoint], None],
    ) -> str | None:
        plan = self.plan
        steps = setting.max_steps
        text = format_setting(setting) if setting.kind == "adaptive" else None
        label = describe_setting(setting)
        if plan.warmup_s > 0:
            self.reporter.phase(f"{label}: warming up")
            async with self._generator(plan.concurrency[0]) as gen:
                gen.set_concurrency(plan.concurrency[0])
                await self._wait(plan.warmup_s, clock)
            clock.done_load_s += plan.warmup_s
        for concurrency in plan.concurrency:
            if self.stop.is_set():
                return None
            # A generator per point: the tokens-per-chunk ratio it learns (for servers that
            # report usage only at a stream's end) then belongs to this concurrency alone.
            async with self._generator(concurrency) as gen:
                self.reporter.phase(f"{label}: settling c={concurrency}")
                gen.set_concurrency(concurrency)
                await self._settle(gen, concurrency)
                self.reporter.phase(f"{label}: measuring c={concurrency}")
                gen.take_result()
                first = await asyncio.to_thread(self.client.observe)
                samples: list[Observation] = []
                await self._wait(plan.duration_s, clock, samples)
                # Whole request cycles: a window shorter than one request would rest on
                # estimates of the requests in flight.
                await self._settle(gen, concurrency)
                result = gen.take_result()
                if gen.refused is not None:
                    raise gen.refused
            last = await asyncio.to_thread(self.client.observe)
            clock.done_load_s += plan.duration_s
            if self.stop.is_set():
                return None
            if capacity is None:
                capacity = _capacity_of(first, last)
            problem = _load_problem(result, label)
            if problem is not None:
                return problem
            on_point(
                SweepPoint(
                    steps=steps,
                    concurrency=concurrency,
                    output_tok_s=result.aggregate_tok_s,
                    per_request_tok_s=result.per_request_tok_s_mean,
                    ttft_p50_s=result.ttft_p50_s,
                    ttft_p90_s=result.ttft_p90_s,
                    accept_length=accept_length_between(first, last, samples),
                    max_running_requests=capacity,
                    requests=result.requests,
                    errors=result.errors,
                    duration_s=result.duration_s,
                    setting=text,
                )
            )
        return None

    def _generator(self, concurrency: int) -> LoadGenerator:
        path = self.config.sglang.server_api_key_file
        return LoadGenerator(
            self.config.sglang.url,
            max_concurrency=concurrency,
            max_tokens=self.plan.max_tokens,
            # Read for each point: a key rotated mid-sweep is the one sent.
            api_key=None if path is None else files.read_key_file(path, SERVER_KEY_SETTING),
        )

    async def _settle(self, gen: LoadGenerator, concurrency: int) -> None:
        """Run until the window holds as many finished requests as there are clients.

        Before a point: steady state, and the tokens-per-chunk ratio is learned. After
        one: the window spans whole request cycles. Bounded: a server that finishes nothing
        is measured anyway and reported by its result (no output tokens).
        """
        deadline = time.monotonic() + max(SETTLE_MIN_CAP_S, self.plan.duration_s)
        while not self.stop.is_set() and time.monotonic() < deadline:
            if gen.progress().requests >= concurrency:
                return
            await asyncio.sleep(SETTLE_POLL_S)

    async def _wait(
        self, seconds: float, clock: _Clock, samples: list[Observation] | None = None
    ) -> None:
        start = time.monotonic()
        base = clock.done_load_s
        while not self.stop.is_set():
            elapsed = time.monotonic() - start
            if elapsed >= seconds:
                return
            await asyncio.sleep(min(SAMPLE_INTERVAL_S, seconds - elapsed))
            elapsed = min(time.monotonic() - start, seconds)
            self.reporter.tick(base + elapsed, clock.eta(elapsed))
            if samples is not None:
                obs = await asyncio.to_thread(self.client.observe)
                if isinstance(obs, Observation):
                    samples.append(obs)


def _capacity_of(*observations: Observation | ScrapeError | None) -> int | None:
    for obs in observations:
        if isinstance(obs, Observation) and obs.max_running_requests is not None:
            return obs.max_running_requests
    return None


def _load_problem(result: LoadResult, label: str) -> str | None:
    if result.output_tokens > 0:
        return None
    kinds = ", ".join(f"{k}: {v}" for k, v in result.errors_by_kind.items()) or "none"
    return (
        f"no output tokens at {label} c={result.concurrency} "
        f"({result.requests} requests, errors: {kinds})"
    )


def _current_steps(client: SGLangClient) -> int:
    """SGLang's step count now, 0 for no speculation. SweepError when it cannot be told, or
    when SGLang runs adaptive mode: the sweep can put back off or a static K only."""
    info = client.server_info()
    if isinstance(info, dict):
        if info.get("speculative_adaptive") is True:
            raise SweepError(
                f"SGLang runs {describe_server(info)}; the sweep restores only no speculation "
                "or a static step count: switch SGLang to one first"
            )
        algorithm = info.get("speculative_algorithm", "")
        if algorithm is None or str(algorithm).upper() == "NONE":
            return 0
        value = info.get("speculative_num_steps")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    obs = client.observe()
    if isinstance(obs, Observation) and obs.steps is not None:
        return obs.steps
    why = info.reason if isinstance(info, ScrapeError) else "no speculative_num_steps"
    if isinstance(obs, ScrapeError):
        why += f"; {obs.reason}"
    raise SweepError(f"cannot tell which step count SGLang runs now: {why}")


# -- the entry point -----------------------------------------------------------------------


def check_plan(plan: SweepPlan, config: Config) -> None:
    low, high = config.choose.min_steps, config.choose.max_steps
    outside = [k for k in plan.steps if not low <= k <= high]
    if outside:
        raise SweepError(
            f"--steps {','.join(map(str, outside))} outside the configured range "
            f"{low}..{high} (min_steps/max_steps)"
        )
    listed = config.choose.adaptive_candidate_sets
    for setting in plan.settings():
        # The rule a pin is held to: what the policy may choose (a listed set, SGLang's
        # own reaching 7), a sweep may measure.
        if setting.kind == "adaptive" and outside_steps(setting, low, high, listed):
            raise SweepError(
                f"--adaptive {format_setting(setting)}: candidates outside the configured "
                f"range {low}..{high} (min_steps/max_steps), and not one of [choose] "
                "adaptive_candidate_sets"
            )


def with_live_algorithm(config: Config, info: Mapping[str, Any]) -> Config:
    """``config`` with the algorithm SGLang runs now when it names none: once the sweep
    has restarted SGLang into off, the server no longer reports it, and an adaptive set
    (or the way back) must still be written with it."""
    algorithm = info.get("speculative_algorithm")
    if config.sglang.speculative_algorithm is not None or not isinstance(algorithm, str):
        return config
    algorithm = algorithm.upper()
    if not re.fullmatch(r"[A-Z0-9_]{1,32}", algorithm) or algorithm == "NONE":
        return config
    sglang = config.sglang.model_copy(update={"speculative_algorithm": algorithm})
    return config.model_copy(update={"sglang": sglang})


def check_offered(plan: SweepPlan, config: Config, info: Mapping[str, Any]) -> None:
    """Refuse adaptive sets this server cannot run (SweepError naming why), judged as the
    daemon judges them (`choices.offer`) on the traits of its /server_info, with the
    algorithm specd applies when the server runs none now (off)."""
    if not plan.adaptive:
        return
    traits = traits_from_server_info(info)
    algorithm = config.sglang.speculative_algorithm or traits.algorithm
    traits = replace(traits, algorithm=algorithm.upper() if algorithm else None)
    choose = config.choose.model_copy(
        update={"kinds": ("adaptive",), "adaptive_candidate_sets": plan.adaptive}
    )
    offered = offer(choose, traits)
    why = offered.kinds["adaptive"]
    if why is not None:
        raise SweepError(f"--adaptive: this server cannot run SGLang's adaptive mode: {why}")
    for text, reason in offered.refused:
        raise SweepError(f"--adaptive {text}: this server cannot run it: {reason}")


@contextlib.contextmanager
def signals_stop(stop: threading.Event, reporter: Reporter) -> Iterator[list[str]]:
    """SIGINT/SIGTERM set ``stop`` (the sweep then restores and exits) instead of killing."""
    caught: list[str] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not caught:
            reporter.message(f"{name}: stopping the sweep; SGLang's original steps come back next")
        else:
            reporter.message(f"{name}: still restoring SGLang's original steps, please wait")
        caught.append(name)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield caught
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def earlier_results(out_dir: Path) -> list[str]:
    """The result files of an earlier sweep in ``out_dir`` (its log aside, which appends).
    A new sweep must not write beside them: one interrupted before its first point writes
    no sweep.csv, and the earlier run's would pass for its calibration."""
    names = (CSV_NAME, MARKDOWN_NAME, JSON_NAME, CHART_NAME)
    return [name for name in names if os.path.lexists(out_dir / name)]


def refuse_earlier_results(out_dir: Path) -> None:
    """SweepError, in one line, where ``out_dir`` holds an earlier sweep's results."""
    found = earlier_results(out_dir)
    if found:
        raise SweepError(
            f"{out_dir} already holds an earlier sweep's results ({', '.join(found)}); "
            "choose another --out, or move them away first"
        )


def sweep(
    config: Config,
    plan: SweepPlan,
    out_dir: Path,
    *,
    runner: Runner | None = None,
    reporter: Reporter | None = None,
    stop: threading.Event | None = None,
    pacing: Mapping[str, Any] | None = None,
    handle_signals: bool = True,
) -> SweepReport:
    """Run the sweep and write its files; raises SweepError only before touching SGLang.

    ``runner`` restarts the unit (default: systemctl); tests pass a ``TwinUnitRunner``.
    ``pacing`` goes to the ``Applier`` (tests poll a fast twin more often).
    ``handle_signals`` makes SIGINT/SIGTERM stop and restore (main thread only).
    """
    check_plan(plan, config)
    refuse_earlier_results(out_dir)
    problem = daemon_running(config)
    if problem is not None:
        raise SweepError(problem)
    reporter = reporter or Reporter()
    stop = stop or threading.Event()
    sweeper = _Sweeper(
        config, plan, out_dir, runner or SubprocessRunner(), reporter, stop, pacing or {}
    )
    try:
        sweeper.journal.open()
        original = _current_steps(sweeper.client)
        info = sweeper.client.server_info()
        if isinstance(info, dict):
            sweeper.config = with_live_algorithm(config, info)
        elif plan.adaptive:
            raise SweepError(
                f"cannot read SGLang's /server_info to tell whether it runs adaptive "
                f"mode: {info.reason}"
            )
        if plan.adaptive:
            assert isinstance(info, dict)
            check_offered(plan, sweeper.config, info)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SweepError(f"cannot create {out_dir}: {exc.strerror or exc}") from None
        if sweeper.journal.problem is not None:
            reporter.message(f"warning: {sweeper.journal.problem}")
        sweeper.current = setting_of_steps(original)
        if sweeper.current is None:
            raise SweepError(f"SGLang runs {original} steps, which specd cannot put back")
        report = SweepReport(original_steps=original, plan=plan, out_dir=out_dir)
        with signals_stop(stop, reporter) if handle_signals else _no_signals() as caught:
            _run(sweeper, report)
            sweeper.restore(report)
            if caught:
                report.interrupted_by = caught[0]
    finally:
        sweeper.close()
    report.files = write_outputs(report)
    reporter.close()
    return report


@contextlib.contextmanager
def _no_signals() -> Iterator[list[str]]:
    yield []


def _run(sweeper: _Sweeper, report: SweepReport) -> None:
    plan = sweeper.plan
    original = setting_of_steps(report.original_steps)
    assert original is not None  # `sweep` starts only on off or a static K
    order = steps_order(plan.settings(), original)
    clock = _Clock(plan, len(order))
    clock.restarts_left = sum(1 for k in order if k != original) + (0 if original in order else 1)
    sweeper.reporter.start(plan, order, report.original_steps)

    def on_point(point: SweepPoint) -> None:
        report.points.append(point)
        sweeper.reporter.point(len(report.points), plan.points, point, clock.eta())

    try:
        for setting in order:
            if sweeper.stop.is_set():
                return
            key, label = failure_key(setting), describe_setting(setting)
            capacity: int | None = None
            if sweeper.current != setting:
                outcome = sweeper.change_to(setting, report, clock)
                clock.restarts_left = max(0, clock.restarts_left - 1)
                if outcome.result == "aborted" and sweeper.stop.is_set():
                    return  # interrupted before any restart: nothing failed
                if outcome.result != "success":
                    report.failed_steps[key] = f"{outcome.result}: {outcome.message}"
                    sweeper.reporter.message(
                        f"{label} failed ({outcome.result}): {outcome.message}"
                    )
                    clock.done_load_s += plan.load_seconds_per_steps()
                    if sweeper.current is None:
                        report.error = f"SGLang's state is unknown after {label} failed"
                        return
                    # SGLang is healthy on the previous K again: the other Ks can still run.
                    continue
                capacity = outcome.capacity
            problem = asyncio.run(sweeper.measure(setting, capacity, clock, on_point))
            if problem is not None:
                report.failed_steps[key] = problem
                report.error = problem
                sweeper.reporter.message(f"stopping: {problem}")
                return
            write_outputs(report, chart=False)
    except Exception as exc:  # the restore must still run; the reason is reported
        report.error = f"internal error: {exc!r}"
        sweeper.reporter.message(f"stopping: {report.error}")


# -- outputs ------------------------------------------------------------------------------


def markdown(report: SweepReport) -> str:
    plan = report.plan
    lines = [
        "# specd sweep",
        "",
        f"Steps {', '.join(map(str, plan.steps))}"
        f"{', off' if plan.off else ''}{''.join(f', {a}' for a in plan.adaptive)} × concurrency "
        f"{', '.join(map(str, plan.concurrency))}; {plan.duration_s:g} s per point after "
        f"{plan.warmup_s:g} s warm-up; {plan.max_tokens} tokens per request. "
        f"SGLang ran {_runs(report.original_steps)} before the sweep.",
        "",
        "| steps | concurrency | aggregate tok/s | per-request tok/s | TTFT p50 ms "
        "| TTFT p90 ms | accept length | max_running_requests | requests | errors | setting |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|",
    ]

    def ms(value: float | None) -> str:
        return "" if value is None else f"{value * 1000:.0f}"

    for p in sorted(report.points, key=lambda p: (p.setting or "", p.steps, p.concurrency)):
        lines.append(
            f"| {p.steps} | {p.concurrency} | {p.output_tok_s:.1f} | {p.per_request_tok_s:.1f} "
            f"| {ms(p.ttft_p50_s)} | {ms(p.ttft_p90_s)} "
            f"| {'' if p.accept_length is None else f'{p.accept_length:.2f}'} "
            f"| {'' if p.max_running_requests is None else p.max_running_requests} "
            f"| {p.requests} | {p.errors} | {_setting_cell(p)} |"
        )
    best = best_steps(report.points)
    if best:
        lines += ["", "Best setting by aggregate throughput:", ""]
        lines += [f"- c={c}: {label} ({tok:.1f} tok/s)" for c, (label, tok) in best.items()]
    checks = adaptive_checks(report)
    if checks:
        lines += [
            "",
            "Adaptive sets against what the static rows predict (the best candidate of each "
            "batch's slot, at the deepest candidate's capacity):",
            "",
            *checks,
        ]
    if report.failed_steps:
        lines += ["", "Not measured:", ""]
        lines += [
            f"- {k if isinstance(k, str) else label_of(k, None)}: {why}"
            for k, why in report.failed_steps.items()
        ]
    if report.interrupted_by:
        lines += ["", f"Interrupted by {report.interrupted_by}."]
    if report.error:
        lines += ["", f"Stopped: {report.error}"]
    final = "an unknown setting" if report.final_steps is None else _runs(report.final_steps)
    restored = (
        f"Restored the original {_runs(report.original_steps)}."
        if report.restored
        else f"NOT restored: SGLang runs {final} (was {_runs(report.original_steps)})."
    )
    lines += ["", restored, ""]
    return "\n".join(lines)


def adaptive_checks(report: SweepReport) -> list[str]:
    """One line per measured adaptive point: measured vs predicted from this sweep's own
    static rows, as the model predicts a set (`specd.core.adaptive`)."""
    table = report.table()
    if table is None:
        return []
    lines: list[str] = []
    calibration = Calibration.of(table)
    for text in table.measured_settings():
        setting = parse_setting(text)
        try:
            predicted = AdaptiveModel.of(adaptive_slots(setting), table)
        except ValueError as exc:
            lines.append(f"- {text}: not predicted: {exc}")
            continue
        if predicted.skipped:
            missing = ",".join(map(str, predicted.skipped))
            lines.append(f"- {text}: not predicted: the sweep has no rows for steps {missing}")
            continue
        for p in sorted(
            (p for p in report.points if p.setting == text), key=lambda p: p.concurrency
        ):
            want = predicted.throughput(float(p.concurrency))
            error = f" ({(p.output_tok_s / want - 1) * 100:+.1f} %)" if want > 0 else ""
            lines.append(
                f"- {text} c={p.concurrency}: measured {p.output_tok_s:.1f} tok/s, "
                f"predicted {want:.1f}{error}"
            )
        factor = calibration.set_factor(setting)
        if factor is not None:
            lines.append(
                f"- {text}: as the calibration, specd predicts it at {factor:.3f} × its "
                "candidates' rows (measured over predicted, at most 1) until it has served here"
            )
    return lines


def _setting_cell(p: SweepPoint) -> str:
    """The setting column: the adaptive set, "off" for steps 0, else the static K."""
    return p.setting or ("off" if p.steps == 0 else str(p.steps))


def best_steps(points: Sequence[SweepPoint]) -> dict[int, tuple[str, float]]:
    """concurrency -> (setting label, tok/s) of the fastest measured setting."""
    best: dict[int, tuple[str, float]] = {}
    for p in points:
        held = best.get(p.concurrency)
        if held is None or p.output_tok_s > held[1]:
            best[p.concurrency] = (p.label, p.output_tok_s)
    return dict(sorted(best.items()))


def render_chart(points: Sequence[SweepPoint], path: Path) -> None:
    import matplotlib  # noqa: PLC0415  (heavy; only when a chart is written)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    try:
        for steps, setting in sorted({(p.steps, p.setting or "") for p in points}):
            curve = sorted(
                (p.concurrency, p.output_tok_s)
                for p in points
                if (p.steps, p.setting or "") == (steps, setting)
            )
            ax.plot(
                [c for c, _ in curve],
                [t for _, t in curve],
                marker="o",
                label=label_of(steps, setting or None),
            )
        concurrencies = sorted({p.concurrency for p in points})
        if len(concurrencies) > 1 and concurrencies[-1] / concurrencies[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("concurrent requests (closed loop)")
        ax.set_ylabel("aggregate output tok/s")
        ax.set_title("specd sweep: throughput vs concurrency, one line per setting")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png")
    finally:
        plt.close(fig)
    files.write_atomic(path, png.getvalue(), mode=OUTPUT_FILE_MODE)


def write_outputs(report: SweepReport, *, chart: bool = True) -> list[Path]:
    """Write what was measured so far; a file that cannot be written is reported, not raised."""
    out = report.out_dir
    written: list[Path] = []
    table = report.table()
    jobs: list[tuple[Path, Callable[[Path], None]]] = [
        (out / JSON_NAME, lambda p: _write_text(p, json.dumps(report.to_dict(), indent=2) + "\n")),
        (out / MARKDOWN_NAME, lambda p: _write_text(p, markdown(report))),
    ]
    if table is not None:
        jobs.append((out / CSV_NAME, lambda p: tables.write_table(p, table)))
        if chart:
            jobs.append((out / CHART_NAME, lambda p: render_chart(report.points, p)))
    for path, write in jobs:
        try:
            write(path)
        except (OSError, ValueError) as exc:
            if report.error is None:
                report.error = f"cannot write {path}: {exc}"
            continue
        written.append(path)
    return written


def _write_text(path: Path, text: str) -> None:
    files.write_text_atomic(path, text, mode=OUTPUT_FILE_MODE)
