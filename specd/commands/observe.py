"""`specd observe`: scrape SGLang once and print what specd sees.

An SGLang started with ``--api-key`` refuses /server_info without the key: ``--api-key-file``
names a file holding it. Without that option, the config's ``[sglang] server_api_key_file``
is used when ``--url`` is that config's ``[sglang] url`` (``--config``, else the default
config where one is readable): the key of one server is never sent to another.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specd.commands.args import Seconds
from specd.core.acceptance import alpha_from_accept_length
from specd.core.observation import Observation, ScrapeError
from specd.core.text import check_root_url, printable
from specd.io.config import DEFAULT_CONFIG_PATH, Config, ConfigError, load_config
from specd.io.files import KeyFileError, read_key_file
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
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="file holding SGLang's --api-key (default: the config's [sglang] "
        "server_api_key_file when --url is its [sglang] url)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="where [sglang] server_api_key_file is read "
        f"(default {DEFAULT_CONFIG_PATH}, where readable)",
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


def config_key_file(config: Config, url: str) -> Path | None:
    """The config's [sglang] server_api_key_file where ``url`` (a `sglang_url`) is its
    [sglang] url, else None: the key of one server is never sent to another."""
    try:
        same = check_base_url(config.sglang.url) == url
    except ValueError:
        return None
    return config.sglang.server_api_key_file if same else None


def api_key_file(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """The key file to send SGLang's --api-key from (None: none), and where it was named
    (a one-line note, None for --api-key-file). KeyFileError for an --api-key-file that is
    not usable, ConfigError for a --config that is not; the default config is used only
    when it loads."""
    if args.api_key_file is not None:
        # Read once here, so that a file not usable is named as the option that named it.
        read_key_file(args.api_key_file, "--api-key-file")
        return args.api_key_file, None
    if args.config is not None:
        config = load_config(args.config, calibration=False)
    else:
        try:
            config = load_config(None, calibration=False)
        except (ConfigError, OSError, ValueError):
            return None, None  # not readable here (0600 specd:specd) or not valid: no key
    path = config_key_file(config, args.url)
    if path is None:
        return None, None
    shown = args.config if args.config is not None else DEFAULT_CONFIG_PATH
    return path, f"[sglang] server_api_key_file of {shown}"


def _failed(args: argparse.Namespace, error: ScrapeError, named: Path | None) -> str:
    """The one line saying why the scrape failed; for SGLang's --api-key, how to pass it."""
    if error.kind == "api_key" and named is None:
        said = error.reason.split(" (", 1)[0]  # "GET /server_info: 401 Unauthorized"
        return (
            f"specd observe: SGLang at {args.url} runs with --api-key ({said}): pass "
            "--api-key-file FILE, a file holding its key (or --config CONFIG whose [sglang] "
            "url is this one, with server_api_key_file set)"
        )
    return f"specd observe: {error.kind}: {error.reason}"


def run(args: argparse.Namespace) -> int:
    try:
        named, source = api_key_file(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"specd observe: {args.config}: {printable(problem)}", file=sys.stderr)
        return 2
    except KeyFileError as exc:
        print(f"specd observe: {printable(str(exc))}", file=sys.stderr)
        return 2
    with SGLangClient(args.url, timeout_s=args.timeout_s, api_key=named) as client:
        result = client.observe()
    if isinstance(result, ScrapeError):
        line = _failed(args, result, named)
        if source is not None and result.kind == "api_key":
            line += f" (the key file is the {source})"
        print(printable(line), file=sys.stderr)
        return 1
    print(json.dumps(result.to_dict(), indent=2) if args.json else _table(result))
    return 0
