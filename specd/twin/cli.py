"""`specd twin`: an HTTP server that looks like SGLang from the outside.

Takes the launch flags of the SGLang version it is (``--sglang-version``): every option
that version has, so a systemd unit runs the twin with the ExecStart line it would use for
SGLang; those the twin does not model are accepted and ignored; one that version does not
have is refused as SGLang refuses it. Plus twin flags for the performance model and for
failing on purpose in tests.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, cast

from specd.commands.args import PORT_OR_FREE, Float, Int, IntList, Seconds
from specd.twin.faults import ENV_FAIL_SETTINGS, parse_setting
from specd.twin.preset import PRESET_NAME
from specd.twin.sglang_args import OPTIONS
from specd.twin.versions import DEFAULT_VERSION, VERSIONS


class _Unmodelled(argparse.Action):
    """An option of that SGLang the twin does not model: its words are kept (for
    /server_info and the start's log line), as that SGLang's argparse would read them."""

    def __init__(self, *args: Any, removed: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.removed = removed

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        words = [] if values is None else [values] if isinstance(values, str) else list(values)
        namespace.ignored_args.extend([self.option_strings[0], *words])
        if self.removed is not None and namespace.removed_flag is None:
            # SGLang's DeprecatedAction raises this ValueError as argparse meets the flag.
            namespace.removed_flag = self.removed


class _SGLangParser(argparse.ArgumentParser):
    """Reads a command line as the SGLang it names (``--sglang-version``) would.

    SGLang's prepare_server_args runs argparse's parse_args over its options: an option it
    does not have, one given without its value, or an abbreviation that fits several is
    refused (exit 2), and a unique prefix is taken for its option. The twin adds that
    version's options it does not model, so the same words get the same answer. The twin's
    own flags, and the modelled ones that version lacks, are never taken as abbreviations
    (an SGLang abbreviation must not land on one); resolve() refuses the latter by name.
    """

    # Set by configure(): the modelled SGLang options and the twin's own.
    sglang_options: frozenset[str] = frozenset()
    twin_own: frozenset[str] = frozenset()
    exact_only: frozenset[str] = frozenset()

    def _get_option_tuples(self, option_string: str) -> Any:
        candidates = super()._get_option_tuples(option_string)
        return [t for t in candidates if not set(t[0].option_strings) & self.exact_only]

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        argv = list(sys.argv[1:] if args is None else args)
        ns = namespace if namespace is not None else argparse.Namespace()
        ns.ignored_args, ns.removed_flag = [], None
        options = OPTIONS.get(_named_version(argv))
        if options is None:
            # A version the twin does not know: resolve() says so; keep every other word.
            ns, unknown = self.parse_known_args(argv, ns)
            ns.ignored_args = unknown
            return ns
        have = {o for strings, _, _ in options for o in strings}
        self.exact_only = frozenset(self.twin_own | (self.sglang_options - have))
        for strings, nargs, removed in options:
            if not any(o in self._option_string_actions for o in strings):
                self.add_argument(*strings, nargs=nargs, action=_Unmodelled, removed=removed,
                                  dest=argparse.SUPPRESS, help=argparse.SUPPRESS)  # fmt: skip
        return super().parse_args(argv, ns)


def _named_version(argv: Sequence[str]) -> str:
    """The --sglang-version the words give (the twin's flags are never abbreviated)."""
    version = DEFAULT_VERSION
    for i, word in enumerate(argv):
        if word == "--sglang-version" and i + 1 < len(argv):
            version = argv[i + 1]
        elif word.startswith("--sglang-version="):
            version = word.partition("=")[2]
    return version


def _setting_text(text: str) -> str:
    try:
        parse_setting(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _csv_words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# Bounds SGLang itself would never need to exceed; negative, NaN or absurd values are
# refused here, before the twin starts.
COUNT = Int(0, 1_000_000)  # SGLang's own checks (e.g. steps >= 1) follow in resolve()
SIZE = Int(1, 1024)
LOG_EVERY = Int(1, 1_000_000)
STEP_LIST = IntList(0, 64)
SEED = Int(0, 2**32 - 1)
LOAD_S = Seconds(0, 3600)
INTERVAL_S = Seconds(0, 3600, above_lo=True)
NOISE = Float(0, 1)
PAD_BYTES = Int(0, 64 * 1024 * 1024)


def _sglang_flags(sg: argparse._ArgumentGroup) -> None:
    """The SGLang launch flags the twin reads (names and meaning as SGLang's)."""
    sg.add_argument("--model-path", "--model", default="Qwen/Qwen3.5-122B-A10B")
    sg.add_argument("--served-model-name", default=None)
    sg.add_argument("--host", default="127.0.0.1")
    sg.add_argument(
        "--port",
        type=PORT_OR_FREE,
        default=30000,
        help=f"{PORT_OR_FREE.spec}; 0: a free port, announced on stderr as "
        "'[twin] listening on http://HOST:PORT'",
    )
    sg.add_argument("--speculative-algorithm", default=None)
    sg.add_argument("--speculative-num-steps", type=COUNT, default=None, help=COUNT.spec)
    sg.add_argument("--speculative-eagle-topk", type=COUNT, default=None, help=COUNT.spec)
    sg.add_argument("--speculative-num-draft-tokens", type=COUNT, default=None, help=COUNT.spec)
    sg.add_argument("--speculative-adaptive", action="store_true")
    sg.add_argument("--speculative-adaptive-config", default=None)
    # What SGLang's adaptive mode checks before it falls back to static.
    for flag in (
        "--disable-overlap-schedule",
        "--enable-dp-attention",
        "--enable-multi-layer-eagle",
        "--enable-two-batch-overlap",
        "--enable-pdmux",
    ):
        sg.add_argument(flag, action="store_true")
    sg.add_argument("--max-running-requests", type=COUNT, default=None, help=COUNT.spec)
    sg.add_argument(
        "--max-total-tokens",
        type=COUNT,
        default=None,
        help=f"KV pool size per scheduler, at most what memory gives ({COUNT.spec})",
    )
    sg.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix cache: finished sequences leave the KV pool (nothing to evict)",
    )
    sg.add_argument("--enable-metrics", action="store_true")
    sg.add_argument("--enable-metrics-for-all-schedulers", action="store_true")
    sg.add_argument("--dp-size", "--data-parallel-size", type=SIZE, default=1, help=SIZE.spec)
    sg.add_argument(
        "--attn-dp-size",
        "--attention-data-parallel-size",
        type=COUNT,
        default=None,
        help="attention DP groups (SGLang 0.5.23; the old form is --dp-size N "
        f"--enable-dp-attention; {COUNT.spec})",
    )
    sg.add_argument("--tp-size", "--tensor-parallel-size", type=SIZE, default=1, help=SIZE.spec)
    sg.add_argument("--decode-log-interval", type=LOG_EVERY, default=40, help=LOG_EVERY.spec)
    sg.add_argument(
        "--skip-server-warmup",
        action="store_true",
        help="report healthy without sending the warm-up request first",
    )


def _dests() -> tuple[str, ...]:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group()
    _sglang_flags(group)
    return tuple(action.dest for action in group._group_actions)


# The parsed arguments that are SGLang's own: what /server_info reports. The twin's own
# flags (performance model, failure injection) are not SGLang's and stay out of it.
SGLANG_DESTS: tuple[str, ...] = _dests()


def configure(parser: argparse.ArgumentParser) -> None:
    # The dispatcher builds a plain parser; it must read the words as that SGLang would.
    parser.__class__ = _SGLangParser
    sglang = parser.add_argument_group("SGLang launch flags (same names and meaning)")
    _sglang_flags(sglang)
    tw = parser.add_argument_group("twin")
    tw.add_argument(
        "--sglang-version",
        default=DEFAULT_VERSION,
        help=f"SGLang version to look like: {', '.join(VERSIONS)} (default {DEFAULT_VERSION})",
    )
    tw.add_argument("--preset", default=None, help=f"built-in model (default {PRESET_NAME})")
    tw.add_argument("--table", default=None, help="performance table CSV instead of a preset")
    tw.add_argument(
        "--load-time-s", type=LOAD_S, default=3.0, help=f"port closed this long ({LOAD_S.spec})"
    )
    tw.add_argument(
        "--warmup-s", type=LOAD_S, default=1.0, help=f"then 503 on /health ({LOAD_S.spec})"
    )
    tw.add_argument(
        "--health-first-look-s",
        type=LOAD_S,
        default=1.0,
        help="/health_generate (and /health, unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION "
        "is false) looks for its generation's answer this long after sending it: "
        f"SGLang's 1 s by default, shorter for tests of a twin that loads in a blink "
        f"({LOAD_S.spec})",
    )
    tw.add_argument(
        "--report-interval-s",
        type=INTERVAL_S,
        default=1.0,
        help=f"gauge refresh period ({INTERVAL_S.spec})",
    )
    tw.add_argument(
        "--graph-set-s",
        type=LOAD_S,
        default=None,
        help="capture time of one CUDA-graph set; adaptive mode captures one per candidate "
        f"step, so each candidate beyond the first adds it to the load (default a quarter of "
        f"--load-time-s; {LOAD_S.spec})",
    )
    tw.add_argument("--seed", type=SEED, default=None, help=SEED.spec)
    tw.add_argument(
        "--accept-noise", type=NOISE, default=0.02, help=f"relative sd of L ({NOISE.spec})"
    )
    fail = parser.add_argument_group("failure injection")
    fail.add_argument(
        "--fail-start-at-steps",
        type=STEP_LIST,
        default=(),
        help=f"fail to start at these static step counts, 0 = no speculation ({STEP_LIST.spec})",
    )
    fail.add_argument(
        "--fail-setting",
        type=_setting_text,
        action="append",
        default=[],
        metavar="SETTING",
        help="fail to start when launched with this setting in specd's text form: off, 4, "
        f"adaptive:3,4, adaptive:1,3/1=1,3;8=0,1 (repeatable; also ${ENV_FAIL_SETTINGS}, "
        "whitespace-separated)",
    )
    fail.add_argument(
        "--never-healthy",
        action="store_true",
        help="a generation that never comes back: /health_generate (and /health) answer 503 "
        "after SGLANG_HEALTH_CHECK_TIMEOUT seconds (20 by default), as SGLang's do",
    )
    fail.add_argument(
        "--slow-s", type=LOAD_S, default=0.0, help=f"delay every response ({LOAD_S.spec})"
    )
    fail.add_argument("--garbage-metrics", action="store_true")
    fail.add_argument("--metrics-404", action="store_true")
    fail.add_argument("--server-info-missing", type=_csv_words, default=[])
    fail.add_argument("--metrics-pad-bytes", type=PAD_BYTES, default=0, help=PAD_BYTES.spec)
    reader = cast(_SGLangParser, parser)
    reader.sglang_options = frozenset(o for a in sglang._group_actions for o in a.option_strings)
    reader.twin_own = frozenset(
        o for group in (tw, fail) for a in group._group_actions for o in a.option_strings
    )


def run(args: argparse.Namespace) -> int:
    # The twin serves plain HTTP and is never a TLS client, yet importing aiohttp builds two
    # verifying TLS contexts from the system CA bundle: a fifth of a start's CPU, and every
    # restart of the stand-in SGLang is a start. This process (the twin alone: the demo
    # runs it as a child) trusts no CA file unless its environment names one.
    os.environ.setdefault("SSL_CERT_FILE", os.devnull)
    # aiohttp is imported only when the twin really runs (`specd twin --help` stays fast),
    # and then only once it listens (specd.twin.launch).
    from specd.twin.launch import TwinConfigError, resolve, serve  # noqa: PLC0415

    try:
        config = resolve(args, argv=sys.argv)
    except TwinConfigError as exc:
        print(f"specd twin: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return serve(config)
