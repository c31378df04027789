"""`specd load`: closed-loop streaming load against an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from specd.tools.load import (
    ENDPOINTS,
    LoadProgress,
    LoadResult,
    _positive_float,
    _positive_int,
    normalize_base_url,
    run_load,
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:30000")
    parser.add_argument(
        "--concurrency", type=_positive_int, required=True, help="closed-loop clients"
    )
    parser.add_argument("--duration", type=_positive_float, required=True, help="seconds")
    parser.add_argument(
        "--max-tokens", type=_positive_int, default=256, help="per request (default 256)"
    )
    parser.add_argument("--model", default=None, help="model name (default: from /v1/models)")
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: SGLang's ignore_eos, full-length outputs)",
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


async def _run_cli(args: argparse.Namespace) -> LoadResult:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Ctrl-C or SIGTERM ends the run early and still reports what was measured.
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    kwargs: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "model": args.model,
        "endpoint": args.endpoint,
        "ignore_eos": args.ignore_eos,
        "stop": stop,
    }
    try:
        if sys.stderr.isatty():
            with Live(Text("starting…"), console=Console(stderr=True), transient=True) as live:
                return await run_load(
                    args.url,
                    args.concurrency,
                    args.duration,
                    on_progress=lambda p: live.update(_progress_view(p)),
                    **kwargs,
                )
        last_print = [0.0]

        def plain(p: LoadProgress) -> None:
            # A line every couple of seconds keeps logs readable when piped.
            if p.elapsed_s - last_print[0] >= 2.0:
                last_print[0] = p.elapsed_s
                print(_progress_line(p), file=sys.stderr, flush=True)

        return await run_load(
            args.url, args.concurrency, args.duration, on_progress=plain, **kwargs
        )
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def run(args: argparse.Namespace) -> int:
    try:
        normalize_base_url(args.url)
        result = asyncio.run(_run_cli(args))
    except ValueError as exc:
        print(f"specd load: {exc}", file=sys.stderr)
        return 2
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
