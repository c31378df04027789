"""`specd load`: closed-loop streaming load against an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from specd.commands.args import CONCURRENCY, MAX_TOKENS, Seconds, quoted
from specd.commands.reason import check_utf8
from specd.core.text import printable
from specd.io.files import KeyFileError, read_key_file
from specd.tools.load import (
    ENDPOINTS,
    LoadProgress,
    LoadRefused,
    LoadResult,
    normalize_base_url,
    run_load,
)

DURATION_S = Seconds(0, 7 * 86400, above_lo=True)


def server_url(value: str) -> str:
    """``--url``: the server's root URL, as ``specd observe --url`` takes it (not .../v1)."""
    try:
        return normalize_base_url(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def model_name(text: str) -> str:
    """``--model``: text a request body can carry. One that is no UTF-8 failed every
    request's encoding in its worker: each died unseen, and the summary said "errors:
    none"."""
    check_utf8(text)
    if not text.strip() or printable(text) != text:
        raise argparse.ArgumentTypeError(f"{quoted(printable(text))} is no model name")
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        required=True,
        type=server_url,
        help="the server's root URL, e.g. http://127.0.0.1:30000 (not .../v1)",
    )
    parser.add_argument(
        "--concurrency",
        type=CONCURRENCY,
        required=True,
        help=f"closed-loop clients ({CONCURRENCY.spec})",
    )
    parser.add_argument(
        "--duration-s",
        "--duration",
        dest="duration",
        type=DURATION_S,
        required=True,
        help=f"how long to run ({DURATION_S.spec})",
    )
    parser.add_argument(
        "--max-tokens",
        type=MAX_TOKENS,
        default=256,
        help=f"per request ({MAX_TOKENS.spec}; default 256)",
    )
    parser.add_argument(
        "--model", type=model_name, default=None, help="model name (default: from /v1/models)"
    )
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: SGLang's ignore_eos, full-length outputs)",
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="file holding the server's API key (SGLang's --api-key), sent as a bearer "
        "token with every request",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON summary object")


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _progress_line(p: LoadProgress) -> str:
    return (
        f"{p.elapsed_s:5.1f}/{p.duration_s:.0f}s  c={p.concurrency}  in-flight={p.in_flight}  "
        f"done={p.requests}  errors={p.errors}  tokens={p.output_tokens}  "
        f"{p.aggregate_tok_s:.1f} tok/s  ttft p50 {_fmt_s(p.ttft_p50_s)}"
    )


def _progress_view(p: LoadProgress) -> Group:
    bar = ProgressBar(total=max(p.duration_s, 1e-9), completed=min(p.elapsed_s, p.duration_s))
    head = Table.grid(padding=(0, 1))
    head.add_row(bar, Text(f"{p.elapsed_s:.1f}/{p.duration_s:.0f} s"))
    stats = Text(
        f"{p.aggregate_tok_s:.1f} tok/s  ttft p50 {_fmt_s(p.ttft_p50_s)}  "
        f"c={p.concurrency} in-flight={p.in_flight} done={p.requests} errors={p.errors}"
    )
    return Group(head, stats)


def _summary_lines(r: LoadResult) -> list[str]:
    kinds = ", ".join(f"{k}: {v}" for k, v in r.errors_by_kind.items())
    return [
        f"concurrency      {r.concurrency}",
        f"duration         {r.duration_s:.2f} s",
        f"requests         {r.requests} finished, {r.in_flight_at_end} cut at the end",
        f"errors           {r.errors}" + (f" ({kinds})" if kinds else ""),
        f"output tokens    {r.output_tokens}",
        f"aggregate        {r.aggregate_tok_s:.1f} tok/s",
        f"per request      {r.per_request_tok_s_mean:.1f} tok/s (mean decode rate)",
        f"TTFT             p50 {_fmt_s(r.ttft_p50_s)}  p90 {_fmt_s(r.ttft_p90_s)}  "
        f"p99 {_fmt_s(r.ttft_p99_s)}",
    ]


# After the result is in, the streams' teardown gets this long; beyond it (thousands of
# streams take many seconds) the process exits and the kernel closes the sockets.
TEARDOWN_GRACE_S = 0.5


async def _measure(
    args: argparse.Namespace,
    stop: asyncio.Event,
    on_result: Callable[[LoadResult], None],
    api_key: str | None = None,
) -> None:
    kwargs: dict[str, Any] = {
        "api_key": api_key,
        "max_tokens": args.max_tokens,
        "model": args.model,
        "endpoint": args.endpoint,
        "ignore_eos": args.ignore_eos,
        "stop": stop,
        "on_result": on_result,
    }
    if sys.stderr.isatty():
        with Live(Text("starting…"), console=Console(stderr=True), transient=True) as live:
            await run_load(
                args.url,
                args.concurrency,
                args.duration,
                on_progress=lambda p: live.update(_progress_view(p)),
                **kwargs,
            )
            return
    last_print = [0.0]

    def plain(p: LoadProgress) -> None:
        # A line every couple of seconds keeps logs readable when piped.
        if p.elapsed_s - last_print[0] >= 2.0:
            last_print[0] = p.elapsed_s
            print(_progress_line(p), file=sys.stderr, flush=True)

    await run_load(args.url, args.concurrency, args.duration, on_progress=plain, **kwargs)


def _run_cli(
    args: argparse.Namespace, api_key: str | None = None
) -> tuple[LoadResult, threading.Thread]:
    """Measure on an event loop in a daemon thread; Ctrl-C or SIGTERM ends it early.

    The main thread only waits, so a signal is seen at once however busy the loop is, and
    the result is reported as soon as it is measured, not after every stream is torn down.
    """
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    outcome: Future[LoadResult] = Future()

    def on_result(result: LoadResult) -> None:
        if not outcome.done():
            outcome.set_result(result)

    def work() -> None:
        try:
            loop.run_until_complete(_measure(args, stop, on_result, api_key))
        except BaseException as exc:  # handed to the main thread, which reports it
            if not outcome.done():
                outcome.set_exception(exc)
        else:
            if not outcome.done():
                outcome.set_exception(RuntimeError("the load ended without a result"))

    def on_signal(signum: int, frame: object) -> None:
        loop.call_soon_threadsafe(stop.set)

    thread = threading.Thread(target=work, name="specd-load", daemon=True)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        thread.start()
        try:
            while True:
                try:
                    result = outcome.result(timeout=0.2)
                    break
                except FutureTimeout:
                    continue
        finally:
            # Also when the run failed (LoadRefused): its loop ended with it.
            thread.join(TEARDOWN_GRACE_S)
            if not thread.is_alive():
                loop.close()
        return result, thread
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _api_key(path: Path | None) -> str | None:
    """The key in ``--api-key-file`` (None: none given); KeyFileError naming the file."""
    return None if path is None else read_key_file(path, "--api-key-file")


def _refused_line(args: argparse.Namespace, refused: LoadRefused) -> str:
    """One line: the server refused the key, and what to pass instead (never the key)."""
    if refused.with_key:
        todo = f"put SGLang's --api-key in {printable(str(args.api_key_file))}"
    else:
        todo = "pass --api-key-file FILE (a file holding the key)"
    return f"specd load: {args.url} refused the run: {refused}; {todo}"


def run(args: argparse.Namespace) -> int:
    try:
        api_key = _api_key(args.api_key_file)
    except KeyFileError as exc:
        print(f"specd load: {printable(str(exc))}", file=sys.stderr)
        return 2
    try:
        result, loop_thread = _run_cli(args, api_key)
    except LoadRefused as refused:
        print(_refused_line(args, refused), file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"specd load: {exc}", file=sys.stderr)
        return 2
    code = _report(args, result)
    if loop_thread.is_alive():
        # Thousands of streams still being torn down: the interpreter's shutdown would
        # wait seconds on that thread. Everything is reported; the kernel closes sockets.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _report(args: argparse.Namespace, result: LoadResult) -> int:
    if args.json:
        print(json.dumps(result.to_dict()))
    elif sys.stdout.isatty():
        Console().print("\n".join(_summary_lines(result)), highlight=False)
    else:
        print("\n".join(_summary_lines(result)))
    if result.output_tokens == 0:
        kinds = ", ".join(f"{k}: {v}" for k, v in result.errors_by_kind.items()) or "none"
        print(
            f"specd load: no output tokens received from {args.url} (errors: {kinds})",
            file=sys.stderr,
        )
        return 1
    return 0
