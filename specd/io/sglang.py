"""Reading SGLang: its /metrics page and /server_info, turned into one Observation.

This is the only module in specd that speaks HTTP to SGLang. Every failure (time
out, refused connection, HTTP error, malformed page, missing metric) comes back as
a ``ScrapeError`` value with a one-line reason; no exception escapes the client.

How series are combined (as SGLang's metrics collector emits them): SGLang reports one series per
scheduler that has metrics enabled, i.e. the first TP rank of each DP replica (with
``--enable-metrics-for-all-schedulers`` every TP rank, each with the same counts).
specd keeps one series per replica (the lowest-ranked one), sums counts across
replicas, weights the accept length by running requests, and skips the per-priority
breakdown series that priority scheduling adds next to the totals (``priority=""``).

Gauges that lag: SGLang before 0.5.2x logs an idle scheduler's stats only 30 s after its last
log, so for up to 30 s after the last request ends the page still says it runs (0.5.23 logs
at once). ``realtime_tokens_total`` (0.5.11+) counts every forward pass; once it has stood
still for ``STALE_LOAD_AFTER_S`` while the page says requests run, specd reads none running.

Cost and time: /server_info makes SGLang ask every scheduler, so it is read once per SGLang
start (again when the page shows a new start, after a failed scrape, or on request), and
every request runs against one deadline: a whole scrape, however slowly a server sends its
bytes, ends within the configured timeout.
"""

from __future__ import annotations

import contextlib
import enum
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import httpcore
import httpx

from specd import __version__
from specd.core.observation import (
    MAX_DRAFT_TOKENS,
    MAX_STEPS,
    Observation,
    ScrapeError,
    impossible_fields,
    without_impossible,
)
from specd.core.text import ascii_count, check_http_url, one_line, redact_command
from specd.io import files
from specd.io.answers import unasked_encoding
from specd.io.promtext import PromTextError, Sample, select_samples
from specd.io.tls import context_for

RUNNING = "sglang:num_running_reqs"
QUEUED = "sglang:num_queue_reqs"
ACCEPT_LENGTH = "sglang:spec_accept_length"
SPEC_STEPS = "sglang:spec_num_steps"
SPEC_DRAFT_TOKENS = "sglang:spec_num_draft_tokens"
KV_USAGE = "sglang:token_usage"
GEN_THROUGHPUT = "sglang:gen_throughput"
GENERATION_TOKENS = "sglang:generation_tokens_total"
REALTIME_TOKENS = "sglang:realtime_tokens_total"
VERIFY_CALLS = "sglang:spec_verify_calls_total"
RETRACTED = "sglang:num_retracted_requests_total"
# Gauges SGLang labels with the scheduler's pid (multiprocess mode): new pids, new start.
RETRACTED_NOW = "sglang:num_retracted_reqs"
PAUSED_NOW = "sglang:num_paused_reqs"
# prometheus_client's process collector; SGLang's multiprocess page lacks it, a proxy may not.
PROCESS_START = "process_start_time_seconds"
# The sample names specd reads; everything else on the page is skipped unparsed.
FAMILIES: tuple[str, ...] = (
    RUNNING,
    QUEUED,
    ACCEPT_LENGTH,
    SPEC_STEPS,
    SPEC_DRAFT_TOKENS,
    KV_USAGE,
    GEN_THROUGHPUT,
    GENERATION_TOKENS,
    REALTIME_TOKENS,
    VERIFY_CALLS,
    RETRACTED,
    RETRACTED_NOW,
    PAUSED_NOW,
    PROCESS_START,
)
# Counters that only fall when SGLang started again.
_COUNTERS = (
    "generation_tokens_total",
    "decode_tokens_total",
    "spec_verify_calls_total",
    "retracted_total",  # appears at the first retraction: gone again means a new start
)
# Schedulers of one DP replica differ only in these labels and report the same batch.
_RANK_LABELS = ("pp_rank", "tp_rank", "moe_ep_rank")
# No forward pass for this long while the page says requests run: the running gauge is the
# last batch's (SGLang < 0.5.2x refreshes an idle scheduler's gauges every 30 s). A forward
# pass, even a long prompt's prefill chunk, takes well under this.
STALE_LOAD_AFTER_S = 5.0
# A real page is ~100 KB per DP rank; far beyond that is a misconfigured exporter,
# and reading it whole would cost memory and CPU on every tick.
DEFAULT_MAX_PAGE_BYTES = 32 * 1024 * 1024
# SGLang writes each family specd reads once a scheduler rank (15 series on one rank), so
# this is room for ~650 ranks. Within the byte cap a page can hold a million such lines,
# which took ~9 s and ~0.5 GB to read: past this bound the page is refused unread.
MAX_SERIES = 10_000
_METRICS_PATH = "/metrics"
# Paths SGLang's key middleware lets through in every version (specd/twin/auth.py): the
# key goes only where it is needed, not to every scrape. Whoever binds SGLang's port while
# it is down (a restart's load, a crash) gets what specd sends, and /metrics is asked for
# every few seconds; /server_info once per SGLang start.
_KEYLESS_PATHS = ("/metrics", "/health")
_INFO_PATHS = ("/server_info", "/get_server_info")  # the second is SGLang < 0.5.6's
# Reads wait at most this long before calling the client's ``beat``: a slow but bounded
# read still shows the daemon's loop alive to the watchdog.
READ_SLICE_S = 1.0


class HealthStatus(enum.Enum):
    OK = "ok"
    UNHEALTHY = "unhealthy"
    DOWN = "down"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class ParsedMetrics:
    """What the /metrics page alone says, combined across series.

    ``steps`` and ``draft_tokens`` are the gauges' values (None before 0.5.13);
    ``observation_from`` settles them against /server_info. ``accept_length`` is
    None when no series has measured one (speculation off, or no decode yet).
    ``retracted_total`` is None when SGLang has not retracted anything yet (the
    counter appears at the first retraction) or predates the counter. A field whose
    series hold a value no gauge or counter can have (NaN, ±Inf, negative; a step count
    that is not whole) is None too, and named with that value in ``rejected``:
    `observation_from` passes it on, as it does the values only it finds impossible.
    """

    running: int
    queued: int
    accept_length: float | None
    spec_fresh: bool
    steps: int | None
    draft_tokens: int | None
    token_usage: float | None
    gen_throughput: float | None
    generation_tokens_total: float | None
    decode_tokens_total: float | None
    spec_verify_calls_total: float | None
    retracted_total: float | None
    dp_ranks: int
    # What identifies this start of SGLang, when the page shows it: the schedulers' pids
    # and the process start time.
    scheduler_pids: frozenset[str] = frozenset()
    process_start_s: float | None = None
    # Tokens the schedulers processed, every mode (prefill and decode): it moves with every
    # forward pass (0.5.11+; None before, or before the first).
    processed_tokens_total: float | None = None
    # (field, the value as the page spells it) of each field left unknown above.
    rejected: tuple[tuple[str, str], ...] = ()

    def same_start(self, before: ParsedMetrics) -> bool:
        """Whether this page and ``before`` come from the same start of SGLang."""
        if (self.steps, self.draft_tokens, self.dp_ranks) != (
            before.steps,
            before.draft_tokens,
            before.dp_ranks,
        ):
            return False
        if self.scheduler_pids != before.scheduler_pids:
            return False
        if self.process_start_s != before.process_start_s:
            return False
        for name in _COUNTERS:
            now, then = getattr(self, name), getattr(before, name)
            if then is not None and (now is None or now < then):
                return False
        return True


def _one_line(text: str, limit: int = 200) -> str:
    return one_line(text, limit)


def _value(value: float) -> str:
    # The exposition format's spelling, so a reason can be grepped for in the page.
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _series(sample: Sample) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
    shown = f"{sample.name}{{{labels}}}" if labels else sample.name
    # Shortened so that what is wrong with it still fits in a one-line reason.
    return shown if len(shown) <= 140 else shown[:139] + "…"


def _rank_order(value: str) -> tuple[int, int, str]:
    rank = ascii_count(value, 9)
    return (0, rank, "") if rank is not None else (1, 0, value)


def _per_replica(samples: list[Sample]) -> list[Sample]:
    """One series per DP replica (and per other label value, e.g. is_streaming)."""
    chosen: dict[frozenset[tuple[str, str]], tuple[tuple[tuple[int, int, str], ...], Sample]] = {}
    for sample in samples:
        if sample.labels.get("priority", ""):
            continue  # a per-priority breakdown of the total next to it
        key = _replica_key(sample)
        rank = tuple(_rank_order(sample.labels.get(k, "")) for k in _RANK_LABELS)
        held = chosen.get(key)
        if held is None or rank < held[0]:
            chosen[key] = (rank, sample)
    return [sample for _, sample in chosen.values()]


def _replica_key(sample: Sample) -> frozenset[tuple[str, str]]:
    return frozenset(
        (k, v) for k, v in sample.labels.items() if k not in _RANK_LABELS and k != "priority"
    )


def _sum(samples: list[Sample] | None) -> float | None:
    return math.fsum(s.value for s in samples) if samples else None


def _bad_value(value: float) -> bool:
    # No gauge or counter specd reads can hold these.
    return not math.isfinite(value) or value < 0


def parse_metrics(text: str, *, t: float = 0.0) -> ParsedMetrics | ScrapeError:
    """Read specd's families from a /metrics page; ``t`` stamps a returned error.

    A bad running or queued value fails the scrape (there is no observation without the
    load); a bad value anywhere else costs its field only (`ParsedMetrics.rejected`).
    """
    try:
        found = select_samples(text, FAMILIES, max_samples=MAX_SERIES)
    except PromTextError as exc:
        return ScrapeError("malformed", _one_line(f"GET /metrics: {exc}"), t)
    for name in (RUNNING, QUEUED):
        for sample in found.get(name, []):
            if _bad_value(sample.value):
                return ScrapeError(
                    "malformed",
                    _one_line(f"GET /metrics: {_series(sample)} is {_value(sample.value)}"),
                    t,
                )
    replicas = {name: _per_replica(samples) for name, samples in found.items()}
    for name in (RUNNING, QUEUED):
        if not replicas.get(name):
            hint = "" if "sglang:" in text else " (no sglang: metrics at all: not SGLang?)"
            return ScrapeError("missing", f"GET /metrics: {name} not in page{hint}", t)
        for sample in replicas[name]:
            if not sample.value.is_integer():
                return ScrapeError(
                    "malformed",
                    _one_line(
                        f"GET /metrics: {_series(sample)} is {_value(sample.value)}, not whole"
                    ),
                    t,
                )

    try:
        return _aggregate(found, replicas)
    except OverflowError:
        # Finite values near 1.8e308 can still overflow when added: not a page to trust.
        return ScrapeError("malformed", "GET /metrics: values too large to add up", t)


class _Checked:
    """The series each field is read from, with the bad ones taken out as rejections."""

    def __init__(self) -> None:
        self.rejected: list[tuple[str, str]] = []

    def good(
        self, field: str, series: list[Sample] | None, *, whole: bool = False
    ) -> list[Sample] | None:
        """``series``, or None (``field`` rejected) when one of them is impossible."""
        for sample in series or []:
            if _bad_value(sample.value) or (whole and not sample.value.is_integer()):
                self.rejected.append((field, _value(sample.value)))
                return None
        return series


def _aggregate(found: dict[str, list[Sample]], replicas: dict[str, list[Sample]]) -> ParsedMetrics:
    check = _Checked()
    running_series = replicas[RUNNING]
    running_by_replica = {_replica_key(s): s.value for s in running_series}
    running = int(sum(running_by_replica.values()))
    queued = int(sum(s.value for s in replicas[QUEUED]))

    # 0 means "no speculation" or "no decode measured yet": not an accept length.
    measured = [
        (s.value, running_by_replica.get(_replica_key(s), 0.0))
        for s in check.good("accept_length", replicas.get(ACCEPT_LENGTH)) or []
        if s.value > 0
    ]
    weight = sum(w for _, w in measured)
    accept_length: float | None
    if not measured:
        accept_length = None
    elif weight > 0:
        accept_length = math.fsum(v * w for v, w in measured) / weight
    else:
        # Idle: the gauges hold their last values; report them, marked not fresh.
        accept_length = math.fsum(v for v, _ in measured) / len(measured)

    def busiest(field: str, name: str) -> int | None:
        series = check.good(field, replicas.get(name), whole=True)
        if not series:
            return None
        top = max(series, key=lambda s: running_by_replica.get(_replica_key(s), 0.0))
        return int(top.value)

    steps = busiest("steps", SPEC_STEPS)
    draft_tokens = busiest("draft_tokens", SPEC_DRAFT_TOKENS)
    usage = check.good("token_usage", replicas.get(KV_USAGE))
    gen_throughput = _sum(check.good("gen_throughput", replicas.get(GEN_THROUGHPUT)))
    generation = _sum(check.good("generation_tokens_total", replicas.get(GENERATION_TOKENS)))
    decode = [s for s in found.get(REALTIME_TOKENS, []) if s.labels.get("mode") == "decode"]
    decoded = _sum(check.good("decode_tokens_total", _per_replica(decode)))
    # Only a progress signal, no field of the Observation: a bad series just leaves it out.
    realtime = replicas.get(REALTIME_TOKENS) or []
    processed = None if any(_bad_value(s.value) for s in realtime) else _sum(realtime)
    verify_calls = _sum(check.good("spec_verify_calls_total", replicas.get(VERIFY_CALLS)))
    retracted = _sum(check.good("retracted_total", replicas.get(RETRACTED)))
    # Only the pid labels of these gauges are read: their values cannot matter.
    pids = frozenset(
        s.labels["pid"]
        for name in (RETRACTED_NOW, PAUSED_NOW)
        for s in found.get(name, [])
        if "pid" in s.labels
    )
    # It only tells starts apart: a time no process started at is left out, not rejected.
    started = [s.value for s in found.get(PROCESS_START, []) if not _bad_value(s.value)]
    return ParsedMetrics(
        running=running,
        queued=queued,
        accept_length=accept_length,
        spec_fresh=running > 0,
        steps=steps,
        draft_tokens=draft_tokens,
        # Each replica has its own KV pool of the same size: the mean is the server's.
        token_usage=math.fsum(s.value for s in usage) / len(usage) if usage else None,
        gen_throughput=gen_throughput,
        generation_tokens_total=generation,
        decode_tokens_total=decoded,
        spec_verify_calls_total=verify_calls,
        retracted_total=retracted,
        dp_ranks=len(running_series),
        scheduler_pids=pids,
        process_start_s=min(started) if started else None,
        processed_tokens_total=processed,
        rejected=tuple(check.rejected),
    )


def _int_field(info: Mapping[str, Any] | None, key: str) -> int | None:
    value = info.get(key) if info is not None else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value)


def _redacted(command: str | None) -> str | None:
    """SGLang's launch_command without the values of --api-key and --admin-api-key (it
    carries them as given), before specd shows or logs it."""
    return None if command is None else redact_command(command)


def _str_field(info: Mapping[str, Any] | None, key: str) -> str | None:
    value = info.get(key) if info is not None else None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return " ".join(value)
    return value if isinstance(value, str) and value else None


def _spec_on(info: Mapping[str, Any] | None) -> bool | None:
    if info is None or "speculative_algorithm" not in info:
        return None
    algorithm = info["speculative_algorithm"]
    return isinstance(algorithm, str) and algorithm.upper() not in ("", "NONE")


def _live(
    metric: int | None,
    from_info: int | None,
    spec_on: bool | None,
    adaptive: bool,
    drafted: bool,
) -> int | None:
    # Until its first decode log (40 decode batches after a start) a speculative server's
    # gauge reads its default 0; only adaptive mode (0 = "no drafting" tier) makes 0 a real
    # value then. Without /server_info the page itself says whether it drafted: its verify
    # steps (spec_verify_calls_total, there wherever the gauge is).
    unknown_zero = spec_on is True or (spec_on is None and drafted)
    if metric is not None and (metric > 0 or adaptive or not unknown_zero):
        return metric
    if spec_on is False:
        return 0
    return from_info


def _per_dp_capacities(info: Mapping[str, Any] | None) -> list[int]:
    """Each DP rank's effective max_running_requests (SGLang 0.5.8+); [] if any is unusable."""
    states = info.get("internal_states") if info is not None else None
    if not isinstance(states, list):
        return []
    key = "effective_max_running_requests_per_dp"
    per_dp = [_int_field(s, key) for s in states if isinstance(s, dict)]
    usable = [v for v in per_dp if v is not None and v > 0]
    return usable if len(usable) == len(per_dp) else []


def _effective_max_running(info: Mapping[str, Any] | None, dp_ranks: int) -> int | None:
    """The most requests the server runs at once, all DP ranks together.

    SGLang 0.5.8+ says each DP rank's own limit (`effective_max_running_requests_per_dp`,
    after memory sizing): their sum. Before, /server_info has the argument only, and each
    DP rank's scheduler takes ``max_running_requests // dp_size`` of it with DP attention
    (the ranks share one model) but all of it without (each DP replica is a server of its
    own: ``dp_size`` of them, or the replicas the page shows when /server_info lacks it).
    """
    per_dp = _per_dp_capacities(info)
    if per_dp:
        return sum(per_dp)
    argument = _int_field(info, "max_running_requests")
    if argument is None or info is None or info.get("enable_dp_attention") is True:
        return argument
    replicas = _int_field(info, "dp_size")
    return argument * (replicas if replicas is not None and replicas >= 1 else max(dp_ranks, 1))


def _most_running(obs: Observation, info: Mapping[str, Any] | None) -> int | None:
    """The most requests SGLang's schedulers can run at once, all DP ranks together; None
    when /server_info does not say (not read yet, or what it says was rejected).

    Each scheduler admits a request only while its running batch is below its effective
    max_running_requests (`effective_max_running_requests_per_dp`, fixed for a start), so
    their sum bounds ``num_running_reqs`` exactly: no slack. Without the per-rank values
    (SGLang < 0.5.8) the argument bounds it, counted once per replica without DP attention
    (`_effective_max_running`).
    """
    if obs.max_running_requests is None:
        return None
    per_dp = _per_dp_capacities(info)
    if per_dp:
        return sum(per_dp) if len(per_dp) >= obs.dp_ranks else max(per_dp) * obs.dp_ranks
    return obs.max_running_requests


def _from_info(
    info: Mapping[str, Any] | None,
    key: str,
    high: int,
    rejected: list[tuple[str, str]],
    name: str,
) -> int | None:
    return _within(_int_field(info, key), high, rejected, name)


def _within(value: int | None, high: int, rejected: list[tuple[str, str]], name: str) -> int | None:
    if value is not None and not 0 <= value <= high:
        if name not in (n for n, _ in rejected):
            rejected.append((name, f"{value!r:.40}"))
        return None
    return value


def observation_from(
    parsed: ParsedMetrics, server_info: Mapping[str, Any] | None, t: float
) -> Observation:
    """Combine a parsed page with /server_info (None when it could not be read).

    Values SGLang cannot produce (a negative capacity, an accept length past steps + 1,
    ...) become unknown and are named in ``Observation.rejected``: one bad field costs
    that field, never the scrape, and never reaches the history.
    """
    spec_on = _spec_on(server_info)
    adaptive = bool(server_info.get("speculative_adaptive")) if server_info is not None else False
    # What the page itself could not hold first, then what /server_info and the bounds add:
    # one list, one `Observation.rejected`, one metric and log line per field.
    rejected: list[tuple[str, str]] = list(parsed.rejected)
    # /server_info's settings only stand in where the page has no gauge: check them on
    # their own, so a lie there never hides what the page says.
    info_steps = _from_info(server_info, "speculative_num_steps", MAX_STEPS, rejected, "steps")
    info_drafts = _from_info(
        server_info, "speculative_num_draft_tokens", MAX_DRAFT_TOKENS, rejected, "draft_tokens"
    )
    page_steps = _within(parsed.steps, MAX_STEPS, rejected, "steps")
    page_drafts = _within(parsed.draft_tokens, MAX_DRAFT_TOKENS, rejected, "draft_tokens")
    drafted = (parsed.spec_verify_calls_total or 0) > 0
    obs = Observation(
        t=t,
        running=parsed.running,
        queued=parsed.queued,
        accept_length=parsed.accept_length if spec_on is not False else None,
        spec_fresh=parsed.spec_fresh,
        steps=_live(page_steps, info_steps, spec_on, adaptive, drafted),
        draft_tokens=_live(page_drafts, info_drafts, spec_on, adaptive, drafted),
        topk=_int_field(server_info, "speculative_eagle_topk") if spec_on is not False else None,
        algorithm=_str_field(server_info, "speculative_algorithm") if spec_on else None,
        max_running_requests=_effective_max_running(server_info, parsed.dp_ranks),
        token_usage=parsed.token_usage,
        gen_throughput=parsed.gen_throughput,
        generation_tokens_total=parsed.generation_tokens_total,
        decode_tokens_total=parsed.decode_tokens_total,
        spec_verify_calls_total=parsed.spec_verify_calls_total,
        retracted_total=parsed.retracted_total,
        version=_str_field(server_info, "version"),
        dp_ranks=parsed.dp_ranks,
        launch_command=_redacted(_str_field(server_info, "launch_command")),
        rejected=tuple(name for name, _ in rejected),
        rejected_values=tuple(value for _, value in rejected),
        adaptive=adaptive and spec_on is True,
        adaptive_config=(
            _str_field(server_info, "speculative_adaptive_config") if adaptive else None
        ),
    )
    return without_impossible(obs, adaptive=adaptive)


def _impossible_load(obs: Observation, info: Mapping[str, Any] | None) -> str | None:
    """Why the load ``obs`` reports cannot be (one line), or None when it can.

    Running cannot be unknown, and the forecast learns offered load from it: a load past
    what the server holds fails the scrape (no change, `specd_scrape_errors_total` and a
    `scrape_failed` line name it) rather than reach the history. Rejecting the capacity
    instead would let the load in, and which of the two lies specd cannot tell. A failed
    scrape reads /server_info again, so a capacity from before a restart specd did not see
    costs one scrape, not every scrape.
    """
    if {"running", "queued"} & set(impossible_fields(obs)):
        return (
            f"GET /metrics: {RUNNING} {obs.running} / {QUEUED} {obs.queued} "
            "is more than any SGLang server holds"
        )
    most = _most_running(obs, info)
    if most is not None and obs.running > most:
        return (
            f"GET /metrics: {RUNNING} {obs.running} is more than the {most} requests "
            "this SGLang runs at once (max_running_requests, /server_info)"
        )
    return None


def check_base_url(base_url: str) -> str:
    """The URL without a trailing slash; ValueError with a one-line reason if unusable."""
    try:
        url = httpx.URL(check_http_url(base_url))
    except (ValueError, httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"invalid SGLang URL: {exc}") from None
    return str(url).rstrip("/")


class _Deadline(threading.local):
    """The monotonic time by which the request in flight must be over (per thread)."""

    at: float | None = None

    @contextlib.contextmanager
    def until(self, at: float) -> Iterator[None]:
        before = self.at
        self.at = at
        try:
            yield
        finally:
            self.at = before

    def end(self, timeout: float | None) -> float | None:
        """The earlier of the deadline and ``timeout`` seconds from now (None: neither)."""
        own = None if timeout is None else time.monotonic() + timeout
        if self.at is None or own is None:
            return self.at if own is None else own
        return min(self.at, own)


class _DeadlineStream(httpcore.NetworkStream):
    """A socket whose every read and write ends by the request's deadline.

    httpx's timeouts bound each read, so a server sending a byte a second never times out;
    here each read gets only what is left of the whole request. Reads also wait in slices
    and call ``beat`` between them, so a long but bounded wait shows the loop alive.
    """

    def __init__(
        self,
        inner: httpcore.NetworkStream,
        deadline: _Deadline,
        beat: Callable[[], None] | None,
    ) -> None:
        self._inner = inner
        self._deadline = deadline
        self._beat = beat

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        end = self._deadline.end(timeout)
        while True:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise httpcore.ReadTimeout("deadline of the request passed")
            if self._beat is None:
                return self._inner.read(max_bytes, left)
            try:
                return self._inner.read(
                    max_bytes, READ_SLICE_S if left is None else min(left, READ_SLICE_S)
                )
            except httpcore.ReadTimeout:
                # Nothing was read in this slice: the socket is as it was, wait again.
                self._beat()

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        end = self._deadline.end(timeout)
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            raise httpcore.WriteTimeout("deadline of the request passed")
        self._inner.write(buffer, left)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        end = self._deadline.end(timeout)
        left = None if end is None else max(end - time.monotonic(), 0.0)
        inner = self._inner.start_tls(ssl_context, server_hostname, left)
        return _DeadlineStream(inner, self._deadline, self._beat)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, deadline: _Deadline, beat: Callable[[], None] | None) -> None:
        self._inner = httpcore.SyncBackend()
        self._deadline = deadline
        self._beat = beat

    def _left(self, timeout: float | None) -> float | None:
        end = self._deadline.end(timeout)
        if end is None:
            return None
        left = end - time.monotonic()
        if left <= 0:
            raise httpcore.ConnectTimeout("deadline of the request passed")
        return left

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._inner.connect_tcp(
            host, port, self._left(timeout), local_address, socket_options
        )
        return _DeadlineStream(stream, self._deadline, self._beat)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._inner.connect_unix_socket(path, self._left(timeout), socket_options)
        return _DeadlineStream(stream, self._deadline, self._beat)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _DeadlineTransport(httpx.HTTPTransport):
    def __init__(self, base_url: str, deadline: _Deadline, beat: Callable[[], None] | None) -> None:
        tls = context_for(base_url, trust_env=False)  # only paths under base_url are asked
        super().__init__(verify=tls, trust_env=False)
        # httpx has no parameter for its pool's network backend: the pool is replaced by
        # one with httpx's defaults and ours (tests/io/test_sglang.py trickles bytes at it).
        limits = httpx.Limits()
        self._pool = httpcore.ConnectionPool(
            ssl_context=tls,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_DeadlineBackend(deadline, beat),
        )


# Where specd is given SGLang's --api-key: named in every message about it.
SERVER_KEY_SETTING = "[sglang] server_api_key_file"


class SGLangClient:
    """A synchronous client for one SGLang server; reuses its connection across ticks.

    Every public call runs against one deadline (``timeout_s``, or the probe's own): all its
    requests, headers and bodies included, end by then. ``beat`` is called while a read
    waits, at least every ``READ_SLICE_S``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 3.0,
        clock: Callable[[], float] = time.time,
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
        beat: Callable[[], None] | None = None,
        api_key: str | Path | None = None,
    ) -> None:
        self.base_url = check_base_url(base_url)
        # SGLang's --api-key: a key, or a file read at each request ([sglang] server_api_key_file).
        self._api_key = api_key
        self.timeout_s = timeout_s
        self.max_page_bytes = max_page_bytes
        self._clock = clock
        self._info_paths = list(_INFO_PATHS)
        self._info_path: str | None = None
        self._deadline = _Deadline()
        # /server_info of the SGLang start the last page came from, and that page: None
        # means read /server_info with the next scrape.
        self._info: dict[str, Any] | None = None
        self._page: ParsedMetrics | None = None
        # When the processed-tokens counter last moved, and its value then.
        self._moved: tuple[float, float] | None = None
        # identity: compressing a page to send it over loopback only costs CPU on both
        # ends. trust_env=False: an HTTP(S)_PROXY meant for the internet must not
        # capture the local server.
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout_s,
            headers={"Accept-Encoding": "identity", "User-Agent": f"specd/{__version__}"},
            trust_env=False,
            transport=_DeadlineTransport(self.base_url, self._deadline, beat),
        )

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _deadline_from_now(self) -> float:
        return time.monotonic() + self.timeout_s

    def _auth(self) -> dict[str, str]:
        """The Authorization header SGLang's --api-key asks for ({} without a key).
        KeyFileError where the key file cannot be used."""
        key = self._api_key
        if isinstance(key, Path):
            key = files.read_key_file(key, SERVER_KEY_SETTING)
        return files.bearer_header(key)

    def _refused(self, where: str, resp: httpx.Response, t: float) -> ScrapeError:
        """A 401/403: SGLang runs with --api-key and specd sent none, or the wrong one."""
        said = f"{where}: {resp.status_code} {resp.reason_phrase}"
        if self._api_key is None:
            why = f"SGLang runs with --api-key: set {SERVER_KEY_SETTING}"
        elif isinstance(self._api_key, Path):
            why = f"the key in {self._api_key} is not SGLang's --api-key"
        else:
            why = "the key given is not SGLang's --api-key"
        return ScrapeError("api_key", f"{said} ({why})", t)

    def _get(
        self, path: str, t: float, deadline: float, *, none_on_404: bool = False
    ) -> bytes | ScrapeError | None:
        where = f"GET {path}"
        try:
            headers = {} if path.startswith(_KEYLESS_PATHS) else self._auth()
        except files.KeyFileError as exc:
            return ScrapeError("api_key", f"{where}: {exc}", t)
        try:
            with (
                self._deadline.until(deadline),
                self._http.stream("GET", path, headers=headers) as resp,
            ):
                if resp.status_code == 404 and none_on_404:
                    return None
                if resp.status_code in (401, 403):
                    return self._refused(where, resp, t)
                if resp.status_code != 200:
                    hint = ""
                    if path == _METRICS_PATH and resp.status_code == 404:
                        hint = " (metrics disabled: start SGLang with --enable-metrics)"
                    return ScrapeError(
                        "http_status", f"{where}: {resp.status_code} {resp.reason_phrase}{hint}", t
                    )
                too_big = ScrapeError(
                    "malformed", f"{where}: response larger than {self.max_page_bytes} bytes", t
                )
                declared = resp.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > self.max_page_bytes:
                    return too_big
                encoding = unasked_encoding(resp)
                if encoding is not None:
                    return ScrapeError(
                        "malformed",
                        f"{where}: Content-Encoding {encoding}, where specd asks for identity",
                        t,
                    )
                chunks: list[bytes] = []
                size = 0
                # Raw: the cap counts what arrives (decoded, a few KB of nested gzip is
                # gigabytes before the first chunk is counted).
                for chunk in resp.iter_raw():
                    size += len(chunk)
                    if size > self.max_page_bytes:
                        return too_big
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.TimeoutException:
            return ScrapeError("timeout", f"{where}: no answer within {self.timeout_s:g} s", t)
        except httpx.ConnectError as exc:
            return ScrapeError(
                "refused", _one_line(f"{where}: cannot connect to {self.base_url}: {exc}"), t
            )
        except httpx.RemoteProtocolError as exc:
            return ScrapeError("malformed", _one_line(f"{where}: broken response: {exc}"), t)
        except httpx.HTTPError as exc:
            return ScrapeError(
                "refused", _one_line(f"{where}: connection failed: {type(exc).__name__} {exc}"), t
            )

    def _metrics_text(self, t: float, deadline: float) -> str | ScrapeError:
        body = self._get(_METRICS_PATH, t, deadline)
        assert body is not None  # only with none_on_404
        if isinstance(body, ScrapeError):
            return body
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return ScrapeError("malformed", f"GET {_METRICS_PATH}: not UTF-8 ({exc.reason})", t)

    def _server_info(self, t: float, deadline: float) -> dict[str, Any] | ScrapeError:
        for path in list(self._info_paths):
            result = self._get(path, t, deadline, none_on_404=True)
            if result is None:
                continue
            if isinstance(result, ScrapeError):
                return result
            # Remember which one answered, so an old SGLang costs one request per read.
            self._info_paths.remove(path)
            self._info_paths.insert(0, path)
            self._info_path = path
            return self._info_json(path, result, t)
        return ScrapeError("http_status", "GET /server_info and /get_server_info: 404 Not Found", t)

    @staticmethod
    def _info_json(path: str, result: bytes, t: float) -> dict[str, Any] | ScrapeError:
        try:
            # Bounded nesting, Unicode strings only: a config name with a lone surrogate
            # would raise where the history keys it (`specd.core.setting.config_key`).
            info = files.parse_json(result)
        except files.ParseError as exc:
            return ScrapeError("malformed", _one_line(f"GET {path}: {exc}"), t)
        if not isinstance(info, dict):
            return ScrapeError("malformed", f"GET {path}: not a JSON object", t)
        return info

    @property
    def info_path(self) -> str | None:
        """The endpoint that last answered for /server_info: "/server_info", or
        "/get_server_info" on SGLang before 0.5.6 (None until one answered)."""
        return self._info_path

    @property
    def last_server_info(self) -> dict[str, Any] | None:
        """/server_info of the start the last observation came from (None before a read)."""
        return self._info

    @property
    def live_algorithm(self) -> str | None:
        """The --speculative-algorithm of the start /server_info last described (None
        before a read, or when SGLang runs without speculation)."""
        info = self._info
        if not _spec_on(info):
            return None
        assert info is not None
        algorithm = info["speculative_algorithm"]
        return algorithm if isinstance(algorithm, str) else None

    @property
    def last_page(self) -> ParsedMetrics | None:
        """What the last good /metrics page itself said (None before one, or after a failed
        scrape): unlike an Observation, its steps are the gauge's alone (None before 0.5.13),
        never filled in from /server_info."""
        return self._page

    def metrics_text(self) -> str | ScrapeError:
        """The raw /metrics page."""
        t = self._clock()
        try:
            return self._metrics_text(t, self._deadline_from_now())
        except Exception as exc:
            return ScrapeError(
                "malformed", _one_line(f"GET /metrics: {type(exc).__name__}: {exc}"), t
            )

    def server_info(self) -> dict[str, Any] | ScrapeError:
        """/server_info read now (/get_server_info when SGLang is older than 0.5.6).

        A fresh read also becomes what ``observe`` reports until the page shows a new start:
        the applier's verification after a restart reads it this way.
        """
        t = self._clock()
        try:
            info = self._server_info(t, self._deadline_from_now())
        except Exception as exc:
            info = ScrapeError(
                "malformed", _one_line(f"GET /server_info: {type(exc).__name__}: {exc}"), t
            )
        # The next page is the first one known to come from the start this read saw.
        self._info = info if isinstance(info, dict) else None
        self._page = None
        return info

    def observe(self) -> Observation | ScrapeError:
        """Scrape /metrics (and /server_info once per SGLang start) into one Observation.

        /metrics decides success; when only /server_info fails the Observation is
        still returned, with the fields only /server_info knows set to None, and
        /server_info is read again with the next scrape. But a /server_info refused for
        SGLang's --api-key fails the scrape (kind api_key): no decision without it.
        """
        t = self._clock()
        deadline = self._deadline_from_now()
        try:
            text = self._metrics_text(t, deadline)
            parsed = text if isinstance(text, ScrapeError) else parse_metrics(text, t=t)
            if isinstance(parsed, ScrapeError):
                # Whatever comes back next may be another start of SGLang.
                self._info = self._page = None
                return parsed
            if self._info is None or (self._page is not None and not parsed.same_start(self._page)):
                info = self._server_info(t, deadline)
                if isinstance(info, ScrapeError) and info.kind == "api_key":
                    # /metrics is open under --api-key, /server_info is not: without what it
                    # says (version, algorithm, capacity, adaptive mode) nothing is decided,
                    # and a restart could not be verified. Said, not silently done without.
                    self._info = self._page = None
                    return info
                self._info = info if isinstance(info, dict) else None
            self._page = parsed
            obs = self._without_stale_load(parsed, observation_from(parsed, self._info, t))
            problem = _impossible_load(obs, self._info)
            if problem is not None:
                # The load decides everything: a page that lies about it is no page, and
                # /server_info is read again with the next one.
                self._info = self._page = None
                return ScrapeError("malformed", problem, t)
            return obs
        except Exception as exc:
            self._info = self._page = None
            return ScrapeError("malformed", _one_line(f"observe: {type(exc).__name__}: {exc}"), t)

    def _without_stale_load(self, parsed: ParsedMetrics, obs: Observation) -> Observation:
        """``obs`` with no request running when the page's running gauge is a past batch's:
        it says requests run, yet no forward pass was counted for STALE_LOAD_AFTER_S."""
        total = parsed.processed_tokens_total
        if total is None:
            self._moved = None
            return obs
        moved = self._moved
        if moved is None or total != moved[1]:
            self._moved = (obs.t, total)
            return obs
        if obs.running > 0 and obs.t - moved[0] >= STALE_LOAD_AFTER_S:
            return replace(obs, running=0, spec_fresh=False)
        return obs

    def health_generate(self, timeout_s: float) -> HealthStatus:
        """GET /health_generate: SGLang runs a 1-token generation (20 s internal limit).

        ``timeout_s`` bounds the whole probe, however slowly the answer comes.
        """
        try:
            with (
                self._deadline.until(time.monotonic() + timeout_s),
                # Exempt from --api-key in every SGLang: no key is sent (a key file gone
                # bad must not read as an SGLang that is not well).
                self._http.stream("GET", "/health_generate", timeout=timeout_s) as resp,
            ):
                return HealthStatus.OK if resp.status_code == 200 else HealthStatus.UNHEALTHY
        except httpx.TimeoutException:
            return HealthStatus.TIMEOUT
        except httpx.ConnectError:
            return HealthStatus.DOWN
        except Exception:
            # Accepted, then dropped or garbled: there is a server, and it is not well.
            return HealthStatus.UNHEALTHY
