"""`specd load`: closed-loop streaming load against an OpenAI-compatible endpoint.

Each of C clients sends its next streaming request as soon as its previous one ends,
which is how the performance tables in ``data/`` were measured (aggregate output tok/s
at C concurrent closed-loop clients). Works against real SGLang and the twin.

Accounting, per measured window ``[start, end)``:

- output tokens are credited when they arrive, so requests cut at the window's edges
  count only the tokens received inside it: aggregate tok/s = tokens received in the
  window / window length. Counts come from ``usage.completion_tokens``: SGLang sends it
  with every chunk under ``stream_options.continuous_usage_stats`` and in a final chunk
  under ``include_usage``. Between usage reports, chunks carrying text are converted to
  tokens with the tokens-per-chunk ratio learned from finished requests (SGLang and the
  twin put several tokens in one chunk); a server that never reports usage counts one
  token per chunk. At a window's close, requests in flight are re-estimated with the
  latest ratio, and the exact count settles the difference when they finish;
- per-request tok/s is the streaming decode rate: tokens after the first chunk / time
  from the first chunk to the last (SGLang bench_serving's 1 / TPOT), for requests that
  finish in the window;
- TTFT is recorded when a request's first token arrives;
- errors (refused while SGLang restarts, 503, timeouts, broken streams) are counted by
  kind; the client backs off briefly and keeps going. Not a 401 or 403: the server wants an
  API key (SGLang's ``--api-key``) it was not given, and no request will ever succeed, so
  the run stops at once with `LoadRefused` (on /v1/models, before a request is sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import ssl
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from specd.core.text import check_root_url
from specd.io.files import bearer_header

# httpcore imports sniffio on every request; when it is not installed, each miss searches
# sys.path again (about 0.6 ms: seconds of CPU at thousands of clients). None in
# sys.modules makes the miss immediate, as Python documents.
if importlib.util.find_spec("sniffio") is None:
    sys.modules.setdefault("sniffio", None)  # type: ignore[arg-type]

ENDPOINTS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DEFAULT_PROMPT = (
    "Write a detailed, step-by-step explanation of how a lighthouse keeper in the 1890s "
    "spent a stormy winter night, including every task and the reason for it."
)
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
# Long enough for a request queued behind a full batch of long generations.
READ_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 5.0
PROGRESS_INTERVAL_S = 0.5
RAMP_BATCH = 32  # clients that send their first request in the same event-loop turn
# A server refusing the key (SGLang's --api-key answers 401 {"error":"Unauthorized"}).
REFUSED_STATUSES = (401, 403)


@dataclass(frozen=True)
class LoadResult:
    """What one measured window of load achieved."""

    concurrency: int  # highest concurrency in effect during the window
    duration_s: float
    requests: int  # requests that finished successfully inside the window
    errors: int
    output_tokens: int  # tokens received inside the window, finished or not
    aggregate_tok_s: float
    per_request_tok_s_mean: float  # 0.0 when no finished request streamed two chunks
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    in_flight_at_end: int = 0  # requests still streaming when the window closed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LoadProgress:
    """A snapshot of the running window, for live displays."""

    phase: int  # 0-based index into the profile
    phases: int
    elapsed_s: float  # in this phase
    duration_s: float  # of this phase
    concurrency: int
    in_flight: int
    requests: int
    errors: int
    output_tokens: int
    aggregate_tok_s: float
    ttft_p50_s: float | None


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not sorted_values:
        return None
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


class LoadWindow:
    """Accumulates one measured interval. Pure bookkeeping: callers pass the times."""

    def __init__(self, start_s: float, concurrency: int) -> None:
        self.start_s = start_s
        self.concurrency = concurrency
        self.output_tokens = 0.0
        self.requests = 0
        self.ttfts: list[float] = []
        self.decode_rates: list[float] = []
        self.errors: Counter[str] = Counter()

    def add_tokens(self, count: float) -> None:
        # May be negative: a final usage count corrects a chunk-based estimate.
        self.output_tokens += count

    def add_ttft(self, seconds: float) -> None:
        self.ttfts.append(seconds)

    def add_completed(self, decode_tok_s: float | None) -> None:
        self.requests += 1
        if decode_tok_s is not None:
            self.decode_rates.append(decode_tok_s)

    def add_error(self, kind: str) -> None:
        self.errors[kind] += 1

    def note_concurrency(self, concurrency: int) -> None:
        self.concurrency = max(self.concurrency, concurrency)

    def result(self, end_s: float, in_flight: int = 0) -> LoadResult:
        length = max(end_s - self.start_s, 0.0)
        tokens = max(round(self.output_tokens), 0)
        ttfts = sorted(self.ttfts)
        return LoadResult(
            concurrency=self.concurrency,
            duration_s=length,
            requests=self.requests,
            errors=sum(self.errors.values()),
            output_tokens=tokens,
            aggregate_tok_s=tokens / length if length > 0 else 0.0,
            per_request_tok_s_mean=(
                sum(self.decode_rates) / len(self.decode_rates) if self.decode_rates else 0.0
            ),
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p90_s=percentile(ttfts, 90),
            ttft_p99_s=percentile(ttfts, 99),
            errors_by_kind=dict(sorted(self.errors.items())),
            in_flight_at_end=in_flight,
        )


# --- one streaming request -------------------------------------------------------------


class LoadRefused(Exception):
    """The server refused the request for its API key (HTTP 401 or 403): without a key
    (``with_key`` False) or with the wrong one. No request can succeed: the run stops."""

    def __init__(self, where: str, status: int, *, with_key: bool) -> None:
        why = (
            "the key sent is not its API key (SGLang's --api-key)"
            if with_key
            else "it wants an API key (SGLang's --api-key) and none was sent"
        )
        super().__init__(f"{where}: {status}: {why}")
        self.status = status
        self.with_key = with_key


class StreamError(Exception):
    """A request failed; ``kind`` is a short, bounded label for counting."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclass(frozen=True)
class Chunk:
    """What one SSE ``data:`` event says about the output."""

    text_pieces: int  # choices in this chunk that carry text (≈ tokens when no usage)
    usage_tokens: int | None  # completion_tokens so far, when the server reports usage
    finished: bool  # a choice carries a finish_reason


DONE: Literal["done"] = "done"


def parse_sse_line(line: str) -> Chunk | Literal["done"] | None:
    """Parse one line of an OpenAI-style SSE stream.

    Returns None for lines that carry no data (blank, comments, ``event:``), ``DONE``
    for ``data: [DONE]``, else a ``Chunk``. Raises ``StreamError`` for malformed data
    and for error objects the server streams instead of a chunk.
    """
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]":
        return DONE
    try:
        obj = json.loads(payload)
    except ValueError as exc:
        raise StreamError("malformed", f"not JSON: {payload[:80]!r}") from exc
    if not isinstance(obj, dict):
        raise StreamError("malformed", f"not an object: {payload[:80]!r}")
    if obj.get("error") is not None:
        raise StreamError("server_error", str(obj["error"])[:200])
    choices = obj.get("choices") or []
    if not isinstance(choices, list):
        raise StreamError("malformed", "choices is not a list")
    pieces = 0
    finished = False
    for choice in choices:
        if not isinstance(choice, dict):
            raise StreamError("malformed", "a choice is not an object")
        delta = choice.get("delta")
        texts = [choice.get("text")]
        if isinstance(delta, dict):
            texts += [delta.get("content"), delta.get("reasoning_content")]
        if any(isinstance(text, str) and text for text in texts):
            pieces += 1
        if choice.get("finish_reason") is not None:
            finished = True
    usage = obj.get("usage")
    usage_tokens: int | None = None
    if isinstance(usage, dict):
        value = usage.get("completion_tokens")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            usage_tokens = value
    return Chunk(text_pieces=pieces, usage_tokens=usage_tokens, finished=finished)


@dataclass(eq=False)
class StreamTally:
    """Output of one request so far, as its stream arrives."""

    pieces: int = 0  # choices that carried text
    usage_tokens: int | None = None  # latest usage.completion_tokens
    pieces_after_usage: int = 0  # text pieces since that usage report

    def estimate(self, tokens_per_piece: float = 1.0) -> float:
        return (self.usage_tokens or 0) + self.pieces_after_usage * tokens_per_piece

    @property
    def exact(self) -> bool:
        return self.usage_tokens is not None and self.pieces_after_usage == 0


@dataclass
class RequestOutcome:
    """How one request went; its tally was also reported chunk by chunk."""

    tokens: float = 0.0  # exact when the stream ended with a usage report
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    error: str | None = None  # None when the stream ended with [DONE] or a finish_reason


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, StreamError):
        return exc.kind
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ConnectionRefusedError) or "refused" in str(cause).lower():
                return "refused"
            cause = cause.__cause__ or cause.__context__
        return "connect"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return "disconnected"
    return "other"


def request_body(
    endpoint: str, max_tokens: int, model: str | None, prompt: str, ignore_eos: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        # Per-chunk usage (SGLang, vLLM) makes cut-off requests count exactly.
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    # SGLang's extension; the seed table was measured this way (full-length outputs).
    if ignore_eos:
        body["ignore_eos"] = True
    if model is not None:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    tally: StreamTally | None = None,
    on_chunk: Callable[[StreamTally], None] = lambda _tally: None,
    on_first_token: Callable[[float], None] = lambda _ttft: None,
    clock: Callable[[], float] = time.monotonic,
) -> RequestOutcome:
    """Send one streaming request, updating ``tally`` and calling ``on_chunk`` as output
    arrives.

    Never raises for HTTP or stream trouble (the outcome's ``error`` names it);
    cancellation propagates, with the output received so far already reported.
    """
    tally = tally if tally is not None else StreamTally()
    outcome = RequestOutcome()
    started = clock()
    # Decode rate counts the tokens after the first chunk over the time they took.
    started_decode = math.inf
    first_tokens = 0.0
    last_at: float | None = None
    completed = False

    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise StreamError(f"http_{response.status_code}")
            async for line in response.aiter_lines():
                event = parse_sse_line(line)
                if event is None:
                    continue
                if event == DONE:
                    completed = True
                    break
                completed = completed or event.finished
                before = tally.estimate()
                tally.pieces += event.text_pieces
                tally.pieces_after_usage += event.text_pieces
                if event.usage_tokens is not None:
                    tally.usage_tokens, tally.pieces_after_usage = event.usage_tokens, 0
                if tally.estimate() == before:
                    continue
                now = clock()
                if outcome.ttft_s is None:
                    outcome.ttft_s = now - started
                    started_decode, first_tokens = now, tally.estimate()
                    on_first_token(outcome.ttft_s)
                # A usage-only chunk (SGLang's last) recounts tokens that came earlier.
                if event.text_pieces or not tally.pieces:
                    last_at = now
                on_chunk(tally)
            if not completed:
                raise StreamError("incomplete", "stream ended without [DONE] or finish_reason")
    except (httpx.HTTPError, StreamError) as exc:
        outcome.error = _error_kind(exc)
    outcome.tokens = tally.estimate()
    if outcome.error is None and last_at is not None and last_at > started_decode:
        outcome.decode_tok_s = (outcome.tokens - first_tokens) / (last_at - started_decode)
    return outcome


# --- the generator ---------------------------------------------------------------------


def normalize_base_url(url: str) -> str:
    """``http://host:port`` (a trailing ``/`` dropped): the server's root, as every specd
    command takes it; ValueError with a one-line reason otherwise.

    ``http://host:port/v1`` (as OpenAI clients are given it) is refused, naming the root to
    give, as ``specd observe --url`` refuses it: the generator adds /v1/... itself.
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"invalid URL {url!r}: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"URL must look like http://HOST:PORT, got {url!r}")
    return check_root_url(url, uses="it adds /v1/... itself")


class LoadGenerator:
    """Closed-loop streaming clients whose number can change while running.

    Use as ``async with LoadGenerator(url, max_concurrency=32) as gen:``, then
    ``gen.set_concurrency(c)`` any time and ``gen.take_result()`` to close the current
    measurement window and open the next one. Leaving the context cancels the requests
    in flight; take the result first so their partial tokens are counted.

    ``api_key``: sent as a bearer token with every request (SGLang's --api-key). A 401 or
    403 (no key, or the wrong one) is no error to count and retry: it stops every client,
    ``refused`` says why and ``on_refused`` is called once; on /v1/models, entering raises
    `LoadRefused`.
    """

    def __init__(
        self,
        url: str,
        *,
        max_concurrency: int,
        max_tokens: int = 256,
        model: str | None = None,
        endpoint: str = "completions",
        prompt: str = DEFAULT_PROMPT,
        ignore_eos: bool = True,
        read_timeout_s: float = READ_TIMEOUT_S,
        backoff_min_s: float = BACKOFF_MIN_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        api_key: str | None = None,
        on_refused: Callable[[LoadRefused], None] | None = None,
    ) -> None:
        self.base_url = normalize_base_url(url)
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
        if max_concurrency < 1:
            raise ValueError(f"max concurrency must be at least 1, got {max_concurrency}")
        if max_tokens < 1:
            raise ValueError(f"max tokens must be at least 1, got {max_tokens}")
        self.max_concurrency = max_concurrency
        self.max_tokens = max_tokens
        self.model = model
        self.endpoint = endpoint
        self.prompt = prompt
        self.ignore_eos = ignore_eos
        self._read_timeout_s = read_timeout_s
        self._backoff = (backoff_min_s, backoff_max_s)
        self._api_key = api_key
        self._on_refused = on_refused
        self.refused: LoadRefused | None = None  # set when the server refused the key
        self._client: httpx.AsyncClient | None = None  # set while started
        self._ssl: ssl.SSLContext | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._window = LoadWindow(time.monotonic(), 0)
        # Requests streaming now -> tokens already credited to windows for each.
        self._active: dict[StreamTally, float] = {}
        # Tokens and text pieces of finished requests, for the tokens-per-piece ratio.
        self._learned = [0.0, 0]

    @property
    def concurrency(self) -> int:
        return len(self._workers)

    @property
    def in_flight(self) -> int:
        return len(self._active)

    @property
    def tokens_per_piece(self) -> float:
        tokens, pieces = self._learned
        return tokens / pieces if pieces else 1.0

    async def __aenter__(self) -> LoadGenerator:
        self._client = self._new_client()
        if self.model is None:
            self.model = await self._discover_model()
        self._window = LoadWindow(time.monotonic(), self.concurrency)
        return self

    def _new_client(self) -> httpx.AsyncClient:
        # One connection per client: each worker has its own. A single pool shared by
        # thousands of streams costs O(streams) per state change in httpcore (minutes of
        # CPU at 4096 clients, and Ctrl-C waits behind it).
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()  # loaded once, not once per worker
        return httpx.AsyncClient(
            verify=self._ssl,
            headers=bearer_header(self._api_key),
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            timeout=httpx.Timeout(
                connect=CONNECT_TIMEOUT_S, read=self._read_timeout_s, write=10.0, pool=None
            ),
        )

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        workers, self._workers = self._workers, []
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _refuse(self, where: str, status: int) -> LoadRefused:
        refused = LoadRefused(where, status, with_key=self._api_key is not None)
        if self.refused is None:
            self.refused = refused
            if self._on_refused is not None:
                self._on_refused(refused)
        return refused

    async def _discover_model(self) -> str | None:
        # SGLang serves one model and ignores a missing "model"; OpenAI-style servers
        # want the id, so ask once. A server still loading gets requests without it. One
        # that refuses the key (SGLang's --api-key) is told at once: LoadRefused.
        assert self._client is not None
        try:
            response = await self._client.get(f"{self.base_url}/v1/models", timeout=5.0)
            if response.status_code in REFUSED_STATUSES:
                raise self._refuse("GET /v1/models", response.status_code)
            data = response.json().get("data") if response.status_code == 200 else None
            if isinstance(data, list) and data and isinstance(data[0], dict):
                model_id = data[0].get("id")
                # JSON may carry a lone surrogate ("\udcff"), which no request can send.
                if isinstance(model_id, str) and model_id.strip():
                    model_id.encode("utf-8")
                    return model_id
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        return None

    def set_concurrency(self, concurrency: int) -> None:
        """Run exactly ``concurrency`` clients from now on; surplus requests are cancelled."""
        if self._client is None:
            raise RuntimeError("LoadGenerator is not started (use `async with`)")
        if not 0 <= concurrency <= self.max_concurrency:
            raise ValueError(
                f"concurrency must be within 0..{self.max_concurrency}, got {concurrency}"
            )
        added = 0
        while len(self._workers) < concurrency:
            # Started RAMP_BATCH per loop turn: thousands of first requests in one turn
            # would block the loop (and Ctrl-C) for seconds.
            turns = added // RAMP_BATCH
            self._workers.append(asyncio.create_task(self._worker(turns)))
            added += 1
        while len(self._workers) > concurrency:
            self._workers.pop().cancel()
        self._window.note_concurrency(concurrency)

    def take_result(self) -> LoadResult:
        """Close the current window (now) and open the next one."""
        for tally in self._active:
            self._credit(tally)  # with the latest ratio, before the window closes
        now = time.monotonic()
        result = self._window.result(now, self.in_flight)
        self._window = LoadWindow(now, self.concurrency)
        return result

    def progress(self, phase: int = 0, phases: int = 1, duration_s: float = 0.0) -> LoadProgress:
        now = time.monotonic()
        w = self._window
        elapsed = now - w.start_s
        return LoadProgress(
            phase=phase,
            phases=phases,
            elapsed_s=elapsed,
            duration_s=duration_s,
            concurrency=self.concurrency,
            in_flight=self.in_flight,
            requests=w.requests,
            errors=sum(w.errors.values()),
            output_tokens=max(round(w.output_tokens), 0),
            aggregate_tok_s=max(w.output_tokens, 0.0) / elapsed if elapsed > 0 else 0.0,
            ttft_p50_s=percentile(sorted(w.ttfts), 50),
        )

    def _credit(self, tally: StreamTally) -> None:
        # Credits go to the window open now: tokens belong to the window they arrive in.
        estimate = tally.estimate(self.tokens_per_piece)
        self._window.add_tokens(estimate - self._active.get(tally, 0.0))
        self._active[tally] = estimate

    def _add_ttft(self, seconds: float) -> None:
        self._window.add_ttft(seconds)

    async def _worker(self, wait_turns: int = 0) -> None:
        for _ in range(wait_turns):
            await asyncio.sleep(0)
        client = self._new_client()
        try:
            await self._requests(client)
        finally:
            await client.aclose()

    async def _requests(self, client: httpx.AsyncClient) -> None:
        url = self.base_url + ENDPOINTS[self.endpoint]
        backoff = self._backoff[0]
        while self.refused is None:
            body = request_body(
                self.endpoint, self.max_tokens, self.model, self.prompt, self.ignore_eos
            )
            tally = StreamTally()
            self._active[tally] = 0.0
            try:
                outcome = await stream_request(
                    client,
                    url,
                    body,
                    tally=tally,
                    on_chunk=self._credit,
                    on_first_token=self._add_ttft,
                )
            except Exception as exc:
                # Anything but HTTP or stream trouble (a body that cannot be encoded, a
                # fault of this client): a worker that died would go unseen and the summary
                # would say "errors: none"; counted, it backs off and tries again.
                outcome = RequestOutcome(error=f"client_{type(exc).__name__}")
            else:
                if tally.exact and tally.pieces:
                    self._learned[0] += tally.estimate()
                    self._learned[1] += tally.pieces
                self._credit(tally)
            finally:
                del self._active[tally]
            if outcome.error is None:
                self._window.add_completed(outcome.decode_tok_s)
                backoff = self._backoff[0]
                continue
            status = next((s for s in REFUSED_STATUSES if outcome.error == f"http_{s}"), None)
            if status is not None:
                # Not counted and retried: the key is wrong (or missing) for every request.
                self._refuse(f"POST {ENDPOINTS[self.endpoint]}", status)
                return
            self._window.add_error(outcome.error)
            # Cancellation (end of run, lower concurrency) interrupts the pause.
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._backoff[1])


def _validate_profile(profile: Sequence[tuple[float, int]]) -> None:
    if not profile:
        raise ValueError("the load profile is empty")
    for duration_s, concurrency in profile:
        if not (isinstance(duration_s, (int, float)) and math.isfinite(duration_s)) or (
            duration_s <= 0
        ):
            raise ValueError(f"phase duration must be a positive number, got {duration_s!r}")
        if not isinstance(concurrency, int) or concurrency < 0:
            raise ValueError(f"phase concurrency must be an integer >= 0, got {concurrency!r}")


async def run_profile(
    url: str,
    profile: Sequence[tuple[float, int]],
    *,
    max_tokens: int = 256,
    model: str | None = None,
    endpoint: str = "completions",
    ignore_eos: bool = True,
    on_progress: Callable[[LoadProgress], None] | None = None,
    stop: asyncio.Event | None = None,
    progress_interval_s: float = PROGRESS_INTERVAL_S,
    on_result: Callable[[LoadResult], None] | None = None,
    api_key: str | None = None,
) -> list[LoadResult]:
    """Run phases of ``(duration_s, concurrency)`` back to back; one result per phase.

    Requests in flight carry over from one phase to the next (their tokens count where
    they arrive); at the end they are cancelled. Setting ``stop`` ends the run early: the
    phase in progress is measured up to then and later phases are skipped. ``on_result``
    gets each phase's result as soon as it is measured, before the streams are torn down
    (thousands of them take seconds). A server that refuses the key (``api_key``, SGLang's
    --api-key) ends the run at once: `LoadRefused`, no result.
    """
    _validate_profile(profile)
    stop = stop if stop is not None else asyncio.Event()
    # Set by ``stop`` or by the server refusing the key: either ends the phase now.
    halt = asyncio.Event()
    forward = asyncio.create_task(_set_when(stop, halt))
    results: list[LoadResult] = []
    peak = max(1, *(c for _, c in profile))
    try:
        async with LoadGenerator(
            url,
            max_concurrency=peak,
            max_tokens=max_tokens,
            model=model,
            endpoint=endpoint,
            ignore_eos=ignore_eos,
            api_key=api_key,
            on_refused=lambda _refused: halt.set(),
        ) as gen:
            for index, (duration_s, concurrency) in enumerate(profile):
                gen.set_concurrency(concurrency)
                gen.take_result()  # a fresh window, measured at this phase's concurrency
                deadline = time.monotonic() + duration_s
                while (remaining := deadline - time.monotonic()) > 0 and not halt.is_set():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(halt.wait(), min(remaining, progress_interval_s))
                    if on_progress is not None:
                        on_progress(gen.progress(index, len(profile), duration_s))
                if gen.refused is not None:
                    raise gen.refused
                # Taken before leaving the context: in-flight partial tokens stay counted.
                results.append(gen.take_result())
                if on_result is not None:
                    on_result(results[-1])
                if stop.is_set():
                    break
    finally:
        forward.cancel()
    return results


async def _set_when(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


async def run_load(
    url: str,
    concurrency: int,
    duration_s: float,
    *,
    max_tokens: int = 256,
    model: str | None = None,
    endpoint: str = "completions",
    ignore_eos: bool = True,
    on_progress: Callable[[LoadProgress], None] | None = None,
    stop: asyncio.Event | None = None,
    on_result: Callable[[LoadResult], None] | None = None,
    api_key: str | None = None,
) -> LoadResult:
    """``concurrency`` closed-loop clients for ``duration_s`` seconds (or until ``stop``)."""
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    results = await run_profile(
        url,
        [(duration_s, concurrency)],
        max_tokens=max_tokens,
        model=model,
        endpoint=endpoint,
        ignore_eos=ignore_eos,
        on_progress=on_progress,
        stop=stop,
        on_result=on_result,
        api_key=api_key,
    )
    return results[0]
