"""The twin's scheduler: admits requests up to capacity, streams tokens at the table's rate.

Tokens accrue continuously: every running request gets ``throughput(n) / n`` tok/s while
``n`` requests run. The loop wakes every ~50 ms (or at the next projected finish) to hand
the accrued whole tokens to the clients in one chunk each, which keeps CPU low at 16+
streams while finish times stay exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specd.twin.adaptive import Controller
from specd.twin.exposition import MetricState, cache_copies, cache_ranks
from specd.twin.families import BY_NAME
from specd.twin.table import PerfTable

TICK_S = 0.05
# A stalled event loop must not turn one advance() into an unbounded loop of verify batches.
MAX_BATCHES_PER_ADVANCE = 100_000
# An idle scheduler logs its stats again only this long after its last log (every version
# here; 0.5.23 also at once when its running gauge no longer matches the running batch).
IDLE_LOG_EVERY_S = 30.0
# KV tokens reserved per running request: sets max_total_num_tokens and token_usage.
KV_TOKENS_PER_REQUEST = 8192
# An eviction pass over the radix tree: a fixed cost and a little per token freed.
EVICTION_S_BASE = 0.0005
EVICTION_S_PER_TOKEN = 2e-7
# What the twin's scheduler spends on a request before its decode: receiving it, and
# prefilling its prompt (per token).
REQUEST_PROCESS_S = 0.0002
PREFILL_S_PER_TOKEN = 20e-6
# SGLang's NewTokenRatioTracker at its defaults (SGLANG_INIT_NEW_TOKEN_RATIO 0.7 x
# --schedule-conservativeness 1, SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14,
# SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS 600): down a step per decode batch, back up when idle.
NEW_TOKEN_RATIO_INIT = 0.7
NEW_TOKEN_RATIO_MIN = NEW_TOKEN_RATIO_INIT * 0.14
NEW_TOKEN_RATIO_DECAY = (NEW_TOKEN_RATIO_INIT - NEW_TOKEN_RATIO_MIN) / 600


@dataclass(eq=False)
class Request:
    prompt_tokens: int
    max_tokens: int
    streaming: bool
    arrival: float
    rank: int = 0
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    produced: float = 0.0
    emitted: int = 0
    verifies: float = 0.0  # verify forwards that produced its tokens
    retractions: int = 0  # times it was pushed back to the queue for lack of KV memory
    chunks: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)

    @property
    def kv_tokens(self) -> int:
        """KV slots its sequence holds: the prompt and every token generated so far."""
        return self.prompt_tokens + self.emitted


@dataclass
class _RankStats:
    """One scheduler's reporting: tokens since its last decode log, the decode batches run
    at that log, when it was, and when it last logged its stats at all."""

    tokens: float = 0.0
    logged_batches: float = 0.0
    decode_log_t: float = 0.0
    log_t: float = 0.0


class Engine:
    def __init__(
        self,
        table: PerfTable,
        *,
        steps: int,
        draft_tokens: int,
        max_running: int,
        state: MetricState,
        accept_length: float,
        accept_noise: float = 0.02,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        controller: Controller | None = None,
        accept_lengths: dict[int, float] | None = None,
        decode_log_interval: int = 40,
        radix_cache: bool = True,
    ) -> None:
        self.table = table
        self.steps = steps  # the live tier under adaptive mode
        self.launch_draft_tokens = draft_tokens
        self.controller = controller
        self.accept_lengths = dict(accept_lengths or {steps: accept_length})
        self._batch_phase = 0.0  # fraction of the current verify batch done
        # Since the last report: verify forwards, tokens they gave, drafts accepted.
        self._window = [0.0, 0.0, 0.0]
        self._lifetime = [0.0, 0.0]  # verify forwards and their tokens since start
        # Decode batches each rank's scheduler has run: SGLang folds its lifetime accept
        # counts in at every --decode-log-interval-th, so none are known before the first.
        self.decode_log_interval = decode_log_interval
        self._decode_batches = [0.0] * max(state.dp_size, 1)
        # Per rank, for /v1/loads: prompt tokens prefilled, and SGLang's decode moments
        # (batches, sum of batch sizes, of step us, of squared sizes, of size x step us, and
        # tokens generated).
        self.prefill_tokens = [0] * max(state.dp_size, 1)
        # Decode forward passes each rank has run (each a CUDA-graph replay), and those since
        # it was last idle (what its new-token ratio has decayed by).
        self._forwards = [0.0] * max(state.dp_size, 1)
        self._busy_forwards = [0.0] * max(state.dp_size, 1)
        self.decode_moments = [[0.0] * 6 for _ in range(max(state.dp_size, 1))]
        # Each rank's prefix cache: the KV of finished sequences stays in the pool, evictable,
        # least recently finished first (token counts); retractions since the last log.
        self.radix_cache = radix_cache
        self._cache: list[deque[int]] = [deque() for _ in range(max(state.dp_size, 1))]
        self._retracted = [0] * max(state.dp_size, 1)
        self.draft_tokens = draft_tokens
        self.max_running = max_running
        # Each DP rank's scheduler admits up to its own limit (max_running is their sum,
        # and /server_info reports each): the server-wide cap alone let one rank run more
        # than the capacity it reports.
        self.max_running_per_rank = max(max_running // max(state.dp_size, 1), 1)
        self.state = state
        self.accept_length = accept_length
        self.accept_noise = accept_noise
        self.rng = random.Random(seed)  # noqa: S311  (simulation noise, not crypto)
        self.clock = clock
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._rr = itertools.cycle(range(state.dp_size))
        self._last = clock()
        self._wake = asyncio.Event()
        start = clock()
        self._stats = [_RankStats(decode_log_t=start, log_t=start) for _ in range(state.dp_size)]
        self._last_report = clock()

    # -- requests --------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        self.advance()
        req.rank = next(self._rr)
        self.waiting.append(req)
        self._admit()
        self._wake.set()

    def abort(self, req: Request) -> None:
        self.advance()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            return
        self.state.inc("sglang:num_aborted_requests_total")
        self._admit()
        self._wake.set()

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def per_request_rate(self, n: int) -> float:
        return self.table.throughput(self.steps, n) / n if n else 0.0

    def batch_size(self) -> int:
        """The decode batch one scheduler runs: the running requests of the fullest rank."""
        ranks = self.state.dp_size
        if ranks <= 1:
            return len(self.running)
        return max(sum(1 for r in self.running if r.rank == k) for k in range(ranks))

    def _decode(self, dt: float, longest: float) -> tuple[float, float, float]:
        """Tokens and verify forwards per running request over ``dt`` seconds, and the
        seconds the batch ran: no longer than its longest request (``longest`` tokens left)
        needs. A scheduler with nothing left runs no batch, however late this look comes
        (a starved event loop: a 1 s gap counted 50 verify batches after an 8-token request
        had finished, and a fresh server showed a decode log).

        Static: the table's rate at the launch steps. Adaptive: verify batch by verify batch,
        each at the tier its slot holds now (the table's row of that step count), each
        feeding its accepted drafts to the slot, which may move the tier for the next one.
        """
        n = len(self.running)
        if self.controller is None:
            rate = self.per_request_rate(n)
            ran = min(dt, longest / rate) if rate > 0 else dt
            self._count(self.steps, rate * ran)
            return rate * ran, rate * ran / self.accept_length if self.steps > 0 else 0.0, ran
        batch = self.batch_size()
        tokens = verifies = ran = 0.0
        left = dt
        for _ in range(MAX_BATCHES_PER_ADVANCE):
            self.steps = self.controller.steps_for_batch(batch)
            rate = self.per_request_rate(n)
            accept = self.accept_lengths[self.steps]
            per_s = rate / accept  # verify batches per second
            need = (1.0 - self._batch_phase) / per_s if per_s > 0 else math.inf
            if rate > 0:
                left = min(left, (longest - tokens) / rate)  # done once the longest is
            span = min(need, left)
            ran += span
            tokens += rate * span
            if self.steps > 0:
                verifies += per_s * span
            self._count(self.steps, rate * span)
            if need > left:
                self._batch_phase += left * per_s
                break
            left -= need
            self._batch_phase = 0.0
            drafts = 0.0
            if self.steps > 0:
                noisy = (accept - 1.0) * (1.0 + self.rng.gauss(0, self.accept_noise))
                drafts = min(max(noisy, 0.0), float(self.steps))
            self.controller.on_verify(drafts, batch)
        return tokens, verifies, ran

    def _count(self, steps: int, tokens_per_request: float) -> None:
        accept = self.accept_lengths.get(steps, 1.0)
        forwards = tokens_per_request * len(self.running) / accept
        self._window[0] += forwards
        self._window[1] += forwards * accept
        self._window[2] += forwards * (accept - 1.0)
        self._lifetime[0] += forwards
        self._lifetime[1] += forwards * accept

    def lifetime_accept_length(self, rank: int = 0) -> float | None:
        """Tokens per verify since start (SGLang's avg_spec_accept_length and /v1/loads'
        speculative accept_length): the launch step count's under static mode, the mix of
        the tiers run under adaptive mode. None without speculation, or before the rank's
        first decode log (SGLang's lifetime counts are still 0 then: the warm-up's few
        decode batches are not one)."""
        if self.draft_tokens <= 0 and self.controller is None:
            return None
        if self._decode_batches[rank] < self.decode_log_interval:
            return None
        forwards, tokens = self._lifetime
        if self.controller is None or forwards <= 0:
            return self.accept_length
        return tokens / forwards

    # -- simulation ------------------------------------------------------------------

    def _admit(self) -> None:
        now = self.clock()
        ranks = max(self.state.dp_size, 1)
        if ranks == 1:
            admitted = False
            while self.waiting and len(self.running) < self.max_running:
                if not self._fits(self.waiting[0]):
                    break
                self._start(self.waiting.popleft(), now)
                admitted = True
            self._prefill_passes({0} if admitted else set())
            return
        per_rank = [0] * ranks
        for req in self.running:
            per_rank[req.rank] += 1
        started: set[int] = set()
        for req in list(self.waiting):
            if min(per_rank) >= self.max_running_per_rank:
                break
            if per_rank[req.rank] >= self.max_running_per_rank or not self._fits(req):
                continue  # its rank is full; a later request on another rank may go
            self.waiting.remove(req)
            per_rank[req.rank] += 1
            self._start(req, now)
            started.add(req.rank)
        self._prefill_passes(started)

    def _prefill_passes(self, ranks: set[int]) -> None:
        """One prefill forward (no CUDA graph) per rank that admitted requests together."""
        for rank in ranks:
            self.state.inc("sglang:cuda_graph_passes_total", 1, rank, (("mode", "prefill_none"),))

    def _pool(self, rank: int) -> float:
        """The rank's KV pool in tokens; unbounded when never sized (an engine driven
        alone, without the server that sizes it)."""
        total = self.state.get("sglang:max_total_num_tokens", rank)
        return total if total > 0 else math.inf

    def _fits(self, req: Request) -> bool:
        """Whether the request's sequence fits the rank's KV pool beside its running ones
        (the prefix cache gives way); a rank that runs nothing takes it regardless."""
        running = [r for r in self.running if r.rank == req.rank]
        total = self._pool(req.rank)
        return not running or sum(r.kv_tokens for r in running) + req.kv_tokens <= total

    def _start(self, req: Request, now: float) -> None:
        req.admitted = now
        self.running.append(req)
        st = self.state
        if req.retractions:
            # Back from a retraction: its prompt and output so far are prefilled again.
            st.inc("sglang:realtime_tokens_total", req.kv_tokens, req.rank,
                   (("mode", "prefill_compute"),))  # fmt: skip
            self._make_room(req.rank)
            return
        fam = BY_NAME["sglang:queue_time_seconds"]
        self.state.observe(fam, now - req.arrival, rank=req.rank)
        self.prefill_tokens[req.rank] += req.prompt_tokens
        st.inc("sglang:prefill_effective_tokens_total", req.prompt_tokens, req.rank,
               (("mode", "input"),))  # fmt: skip
        # The prefill log reports the tracker's ratio as it stands.
        decayed = NEW_TOKEN_RATIO_INIT - NEW_TOKEN_RATIO_DECAY * self._busy_forwards[req.rank]
        st.set("sglang:new_token_ratio", max(decayed, NEW_TOKEN_RATIO_MIN), req.rank)
        stages = BY_NAME["sglang:per_stage_req_latency_seconds"]
        st.observe(stages, REQUEST_PROCESS_S, req.rank, (("stage", "request_process"),))
        st.observe(stages, req.prompt_tokens * PREFILL_S_PER_TOKEN, req.rank,
                   (("stage", "prefill_forward"),))  # fmt: skip
        self.state.inc("sglang:realtime_tokens_total", req.prompt_tokens, req.rank,
                       (("mode", "prefill_compute"),))  # fmt: skip
        self._make_room(req.rank)

    # -- the KV pool: prefix cache, eviction, retraction ------------------------------

    def _make_room(self, rank: int, keep: frozenset[int] = frozenset()) -> None:
        """Fit the rank's sequences into its KV pool, as SGLang's allocation does: evict
        cached sequences (least recently finished first), and when the running ones alone
        overflow it, retract them (fewest generated tokens first, then longest prompt; never
        the last one, nor one finishing now: ``keep`` holds their ids) back to the queue."""
        total = self._pool(rank)
        running = [r for r in self.running if r.rank == rank]
        used = sum(r.kv_tokens for r in running)
        cache = self._cache[rank]
        over = used + sum(cache) - total
        freed = 0
        while over > freed and cache:
            freed += cache.popleft()
        if freed:
            self._evicted(rank, freed)
        victims = sorted(
            (r for r in running if id(r) not in keep),
            key=lambda r: (r.emitted, -r.prompt_tokens),
        )
        while used > total and victims and len(running) > 1:
            req = victims.pop(0)
            running.remove(req)
            used -= req.kv_tokens
            self._retract(req)

    def _evicted(self, rank: int, tokens: int) -> None:
        st = self.state
        key = rank if cache_ranks(st) != (-1,) else -1
        copies = cache_copies(st)
        counter = BY_NAME["sglang:evicted_tokens_total"]
        variant = counter.variants[0]
        st.inc(counter.name, tokens * copies, key, variant)
        for _ in range(copies):
            st.observe(BY_NAME["sglang:eviction_duration_seconds"], EVICTION_S_BASE +
                       tokens * EVICTION_S_PER_TOKEN, key, variant)  # fmt: skip

    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        req.retractions += 1
        self.waiting.appendleft(req)
        st, rank = self.state, req.rank
        st.inc("sglang:num_retracted_requests_total", 1, rank)
        st.inc("sglang:num_retracted_input_tokens_total", req.prompt_tokens, rank)
        st.inc("sglang:num_retracted_output_tokens_total", req.emitted, rank)
        self._retracted[rank] += 1

    def advance(self) -> None:
        now = self.clock()
        dt = max(0.0, now - self._last)
        self._last = now
        # A scheduler with nothing to run resets its new-token ratio (self_check_during_idle).
        busy = {req.rank for req in self.running} | {req.rank for req in self.waiting}
        for rank in range(len(self._busy_forwards)):
            if rank not in busy:
                self._busy_forwards[rank] = 0.0
        if not self.running:
            return
        longest = max(req.max_tokens - req.produced for req in self.running)
        gained, verifies, dt = self._decode(dt, longest)
        # Every running request takes part in each of its rank's decode batches.
        sizes: dict[int, int] = {}
        for req in self.running:
            sizes[req.rank] = sizes.get(req.rank, 0) + 1
        for rank, size in sizes.items():
            # A verify per decode batch, or a token per batch without speculation.
            self._decode_batches[rank] += verifies if verifies > 0 else gained
            # A decode forward per verify, or per token without speculation.
            before = self._forwards[rank]
            self._forwards[rank] += verifies if verifies > 0 else gained
            self._busy_forwards[rank] += verifies if verifies > 0 else gained
            passes = math.floor(self._forwards[rank]) - math.floor(before)
            if passes > 0:
                self.state.inc("sglang:cuda_graph_passes_total", passes, rank,
                               (("mode", "decode_cuda_graph"),))  # fmt: skip
            if verifies > 0:
                moments, step_us = self.decode_moments[rank], dt * 1e6
                for i, value in enumerate((verifies, verifies * size, step_us,
                                           verifies * size * size, size * step_us,
                                           gained * size)):  # fmt: skip
                    moments[i] += value
        done: list[Request] = []
        for req in self.running:
            before = req.emitted
            if gained > 0:
                share = min(gained, req.max_tokens - req.produced) / gained
                req.verifies += verifies * share
            req.produced = min(float(req.max_tokens), req.produced + gained)
            if req.max_tokens - req.produced < 1e-6:
                req.produced = float(req.max_tokens)
            whole = min(req.max_tokens, math.floor(req.produced + 1e-9))
            if whole > before:
                if req.first_token is None:
                    req.first_token = now
                req.emitted = whole
                req.chunks.put_nowait(whole - before)
                self._stats[req.rank].tokens += whole - before
                # Counted at every decode batch (0.5.11+), not at the decode log.
                self.state.inc("sglang:realtime_tokens_total", whole - before, req.rank,
                               (("mode", "decode"),))  # fmt: skip
            if req.emitted >= req.max_tokens:
                done.append(req)
        finishing = frozenset(id(r) for r in done)
        for rank in sizes:
            self._make_room(rank, finishing)
        # SGLang logs a rank's stats at its decode batch, the finishing requests still in it.
        logged = [self._maybe_decode_log(rank, now) for rank in sizes]
        if any(logged):
            self._window = [0.0, 0.0, 0.0]
        for req in done:
            self.running.remove(req)
            self._finish(req, now)
        if done:
            self._admit()

    def _finish(self, req: Request, now: float) -> None:
        req.finished = now
        req.chunks.put_nowait(None)
        if self.radix_cache:
            self._cache[req.rank].append(req.kv_tokens)  # stays in the pool, evictable
        st = self.state
        streaming = st.request_labels(req.streaming)
        first = req.first_token if req.first_token is not None else now
        st.observe(
            BY_NAME["sglang:time_to_first_token_seconds"], first - req.arrival, -1, streaming
        )
        st.observe(BY_NAME["sglang:e2e_request_latency_seconds"], now - req.arrival, -1, streaming)
        if req.emitted > 1:
            tpot = (now - first) / (req.emitted - 1)
            st.observe(BY_NAME["sglang:request_time_per_output_token_seconds"], tpot, -1, streaming)
            itl = BY_NAME["sglang:inter_token_latency_seconds"]
            hist_key = (itl.name, -1, ())
            st.observe(itl, tpot)
            # One observation per token gap, like SGLang; add the rest in bulk.
            hist = st.hists[hist_key]
            extra = req.emitted - 2
            if extra > 0:
                hist.total += tpot * extra
                hist.count += extra
                for i, bound in enumerate(hist.buckets):
                    if tpot <= bound:
                        hist.counts[i] += extra
        st.observe(BY_NAME["sglang:prompt_tokens_histogram"], req.prompt_tokens)
        st.observe(BY_NAME["sglang:uncached_prompt_tokens_histogram"], req.prompt_tokens)
        st.observe(BY_NAME["sglang:generation_tokens_histogram"], req.emitted)
        st.inc("sglang:prompt_tokens_total", req.prompt_tokens, -1, streaming)
        st.inc("sglang:generation_tokens_total", req.emitted, -1, streaming)
        st.inc("sglang:num_requests_total", 1, -1, streaming)
        st.inc("sglang:cached_tokens_total", 0, -1, st.cache_source("device"))
        if req.verifies > 0:
            st.inc("sglang:spec_verify_calls_total", math.ceil(req.verifies - 1e-9))

    async def run(self) -> None:
        while True:
            self.advance()
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            rate = self.per_request_rate(len(self.running))
            horizon = TICK_S
            if rate > 0:
                soonest = min(r.max_tokens - r.produced for r in self.running) / rate
                horizon = min(horizon, max(soonest, 0.001))
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=horizon)

    # -- reporting (SGLang's decode log interval) --------------------------------------

    def report(self) -> None:
        """Each rank's scheduler's logs between decode logs (every --report-interval-s).

        A busy scheduler's running, queued and memory gauges are refreshed (SGLang logs them
        at each prefill batch besides its decode logs). Throughput and the speculative gauges
        change only at a decode log (`_maybe_decode_log`, as the batches run): every
        --decode-log-interval decode batches, so the warm-up's few leave them at 0. An idle
        scheduler logs (gen_throughput 0, the rest as they stand) only IDLE_LOG_EVERY_S after
        its last log, so until then its gauges show the last batch; 0.5.23 logs at once when
        its running gauge is stale."""
        self.advance()
        now = self.clock()
        st = self.state
        spent = max(now - self._last_report, 0.0)
        for rank, stats in enumerate(self._stats):
            running = sum(1 for r in self.running if r.rank == rank)
            queued = sum(1 for r in self.waiting if r.rank == rank)
            # 0.5.23's scheduler time accounting: its loop polls without sleeping (unless
            # --sleep-on-idle), so its process burns a core; the loop's time goes to the
            # batch it runs, or to idle.
            st.inc("sglang:scheduler_process_cpu_seconds_total", spent, rank)
            busy = running or queued
            stage = ("category", "run_batch" if busy else "idle")
            st.inc("sglang:scheduler_stage_seconds_total", spent, rank,
                   (stage, ("forward_overlap", "none")))  # fmt: skip
            if busy:
                self._log_batch(rank, running, queued)
                stats.log_t = now
                continue
            st.inc("sglang:scheduler_idle_seconds_total", spent, rank)
            stale = st.profile.idle_log_when_stale and st.get("sglang:num_running_reqs", rank) != 0
            if stale or now - stats.log_t > IDLE_LOG_EVERY_S:
                self._log_batch(rank, 0, 0)
                st.set("sglang:gen_throughput", 0.0, rank)
                stats.log_t = now
        self._last_report = now

    def _log_batch(self, rank: int, running: int, queued: int) -> None:
        """The gauges every log sets: load and the KV pool."""
        st = self.state
        st.set("sglang:num_running_reqs", running, rank)
        st.set("sglang:num_queue_reqs", queued, rank)
        used = sum(r.kv_tokens for r in self.running if r.rank == rank)
        cached = sum(self._cache[rank])
        total = st.get("sglang:max_total_num_tokens", rank) or 1.0
        st.set("sglang:num_used_tokens", used, rank)
        st.set("sglang:kv_used_tokens", used, rank)
        st.set("sglang:kv_evictable_tokens", cached, rank)
        st.set("sglang:kv_available_tokens", total - used - cached, rank)
        # Retractions since the last log (then cleared, as SGLang's reporter does).
        st.set("sglang:num_retracted_reqs", self._retracted[rank], rank)
        self._retracted[rank] = 0
        st.set("sglang:token_usage", used / total, rank)
        st.set("sglang:full_token_usage", used / total, rank)
        st.set("sglang:decode_sum_seq_lens", used, rank)

    def _maybe_decode_log(self, rank: int, now: float) -> bool:
        """The rank's decode log, if it has run another --decode-log-interval batches."""
        stats, every = self._stats[rank], self.decode_log_interval
        if math.floor(self._decode_batches[rank] / every) <= math.floor(
            stats.logged_batches / every
        ):
            return False
        running = sum(1 for r in self.running if r.rank == rank)
        queued = sum(1 for r in self.waiting if r.rank == rank)
        self._log_batch(rank, running, queued)
        self._decode_log(rank, stats, now)
        return True

    def _decode_log(self, rank: int, stats: _RankStats, now: float) -> None:
        """The figures of a decode log: throughput over the time since the previous one
        (idle time included, as SGLang's gap), the window's accept length, the live setting."""
        st = self.state
        st.set("sglang:gen_throughput", stats.tokens / max(now - stats.decode_log_t, 1e-6), rank)
        if self.controller is not None:
            self._report_adaptive(rank)
        elif self.steps > 0:
            noisy = self.accept_length * (1 + self.rng.gauss(0, self.accept_noise))
            accept = min(max(noisy, 1.0), float(self.steps + 1))
            st.set("sglang:spec_accept_length", accept, rank)
            if not st.profile.accept_rate_of_drafts:
                # Before 0.5.11 the gauge was tokens per verify over draft tokens.
                rate = accept / self.draft_tokens if self.draft_tokens else 0
            elif self.draft_tokens > 1:
                rate = (accept - 1) / (self.draft_tokens - 1)
            else:
                rate = 0
            st.set("sglang:spec_accept_rate", rate, rank)
            st.set("sglang:spec_num_steps", float(self.steps), rank)
            st.set("sglang:spec_num_draft_tokens", float(self.draft_tokens), rank)
        stats.tokens = 0.0
        stats.logged_batches = self._decode_batches[rank]
        stats.decode_log_t = stats.log_t = now

    def _report_adaptive(self, rank: int) -> None:
        """SGLang's decode-log figures under adaptive mode: accept length over the window's
        forwards whatever their tier; accept rate over the *launch* draft tokens (SGLang
        divides by speculative_num_draft_tokens - 1 as resolved at start, so the gauge is off
        whenever the tier is not the launch one); the live tier's steps and draft tokens."""
        st = self.state
        forwards, tokens, drafts = self._window
        if forwards > 0:
            noisy = tokens / forwards * (1 + self.rng.gauss(0, self.accept_noise))
            st.set("sglang:spec_accept_length", max(noisy, 1.0), rank)
            per_round = self.launch_draft_tokens - 1
            st.set("sglang:spec_accept_rate", drafts / (forwards * per_round) if per_round > 0
                   else 0.0, rank)  # fmt: skip
        st.set("sglang:spec_num_steps", float(self.steps), rank)
        st.set("sglang:spec_num_draft_tokens", float(self.steps + 1), rank)
