"""`specd observe`: scrape SGLang once and print what specd sees."""

from __future__ import annotations

import argparse
import json
import sys
import time

from specd.commands.args import Seconds
from specd.core.acceptance import alpha_from_accept_length
from specd.core.observation import Observation, ScrapeError
from specd.core.text import check_root_url, printable
from specd.io.sglang import SGLangClient, check_base_url


def sglang_url(value: str) -> str:
    """``--url``: SGLang's root URL (a path such as /v1, copied from an OpenAI client, would
    read /v1/metrics and be blamed on metrics being off)."""
    try:
        url = check_base_url(value)
        check_root_url(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return url


TIMEOUT_S = Seconds(0, 300, above_lo=True)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        required=True,
        type=sglang_url,
        help="SGLang's root URL, e.g. http://127.0.0.1:30000 (not .../v1)",
    )
    parser.add_argument("--json", action="store_true", help="print the Observation as JSON")
    parser.add_argument(
        "--timeout-s",
        type=TIMEOUT_S,
        default=3.0,
        help=f"per-request timeout ({TIMEOUT_S.spec}; default 3)",
    )


def _table(obs: Observation) -> str:
    alpha = (
        alpha_from_accept_length(obs.accept_length, obs.steps)
        if obs.accept_length is not None and obs.steps
        else None
    )
    when = time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(obs.t))
    rows: list[tuple[str, object]] = [
        ("time", f"{when} ({obs.t:.3f})"),
        ("version", obs.version),
        ("running", obs.running),
        ("queued", obs.queued),
        ("offered", obs.offered),
        ("max_running_requests", obs.max_running_requests),
        ("dp_ranks", obs.dp_ranks),
        ("algorithm", obs.algorithm),
        ("steps", obs.steps),
        ("draft_tokens", obs.draft_tokens),
        ("topk", obs.topk),
        ("accept_length", None if obs.accept_length is None else f"{obs.accept_length:.3f}"),
        ("alpha (derived)", None if alpha is None else f"{alpha:.3f}"),
        ("spec_fresh", "yes" if obs.spec_fresh else "no (idle: spec gauges are stale)"),
        ("token_usage", obs.token_usage),
        ("gen_throughput", obs.gen_throughput),
        ("generation_tokens_total", obs.generation_tokens_total),
        ("decode_tokens_total", obs.decode_tokens_total),
        ("spec_verify_calls_total", obs.spec_verify_calls_total),
        ("retracted_total", obs.retracted_total),
        ("launch_command", obs.launch_command),
        (
            "rejected",
            ", ".join(
                f"{name} ({value})"
                for name, value in zip(obs.rejected, obs.rejected_values, strict=False)
            )
            or None,
        ),
    ]
    # What SGLang said (its launch command, version, algorithm) is shown, never run by the
    # terminal: an escape in it would clear the screen or retitle the window.
    return "\n".join(
        f"{name:<24} {'-' if value is None else printable(str(value))}" for name, value in rows
    )


def run(args: argparse.Namespace) -> int:
    with SGLangClient(args.url, timeout_s=args.timeout_s) as client:
        result = client.observe()
    if isinstance(result, ScrapeError):
        print(f"specd observe: {result.kind}: {result.reason}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_dict(), indent=2) if args.json else _table(result))
    return 0
