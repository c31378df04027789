"""`specd twin`: an HTTP server that looks like SGLang from the outside.

Takes SGLang's own launch flags (unknown ones are accepted and ignored, so a systemd unit
can run the twin with the ExecStart line it would use for SGLang) plus twin flags for the
performance model and for failing on purpose in tests.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specd.twin.preset import PRESET_NAME


class _LenientParser(argparse.ArgumentParser):
    """Keeps unknown SGLang flags (``--trust-remote-code``, ``--mem-fraction-static 0.9``)."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        ns, unknown = self.parse_known_args(args, namespace)
        ns.ignored_args = unknown
        return ns


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K[,K...], got {text!r}") from None


def _csv_words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def configure(parser: argparse.ArgumentParser) -> None:
    # The dispatcher builds a plain parser; unknown SGLang flags must pass through it.
    parser.__class__ = _LenientParser
    sg = parser.add_argument_group("SGLang launch flags (same names and meaning)")
    sg.add_argument("--model-path", "--model", default="Qwen/Qwen3.5-122B-A10B")
    sg.add_argument("--served-model-name", default=None)
    sg.add_argument("--host", default="127.0.0.1")
    sg.add_argument("--port", type=int, default=30000)
    sg.add_argument("--speculative-algorithm", default=None)
    sg.add_argument("--speculative-num-steps", type=int, default=None)
    sg.add_argument("--speculative-eagle-topk", type=int, default=None)
    sg.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    sg.add_argument("--max-running-requests", type=int, default=None)
    sg.add_argument("--enable-metrics", action="store_true")
    sg.add_argument("--dp-size", "--data-parallel-size", type=int, default=1)
    sg.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    sg.add_argument("--decode-log-interval", type=int, default=40)
    tw = parser.add_argument_group("twin")
    tw.add_argument("--preset", default=None, help=f"built-in model (default {PRESET_NAME})")
    tw.add_argument("--table", default=None, help="performance table CSV instead of a preset")
    tw.add_argument("--load-time-s", type=float, default=3.0, help="port closed this long")
    tw.add_argument("--warmup-s", type=float, default=1.0, help="then 503 on /health this long")
    tw.add_argument("--report-interval-s", type=float, default=1.0, help="gauge refresh period")
    tw.add_argument("--seed", type=int, default=None)
    tw.add_argument("--accept-noise", type=float, default=0.02, help="relative sd of L")
    fail = parser.add_argument_group("failure injection")
    fail.add_argument("--fail-start-at-steps", type=_csv_ints, default=[])
    fail.add_argument("--never-healthy", action="store_true")
    fail.add_argument("--slow-s", type=float, default=0.0, help="delay every response")
    fail.add_argument("--garbage-metrics", action="store_true")
    fail.add_argument("--metrics-404", action="store_true")
    fail.add_argument("--server-info-missing", type=_csv_words, default=[])
    fail.add_argument("--metrics-pad-bytes", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    # aiohttp is imported only when the twin really runs (`specd twin --help` stays fast).
    from specd.twin.server import TwinConfigError, resolve, serve  # noqa: PLC0415

    try:
        config = resolve(args, argv=sys.argv)
    except TwinConfigError as exc:
        print(f"specd twin: error: {exc}", file=sys.stderr)
        return 1
    return serve(config)
