"""`specd sweep`: measure tok/s per step count and concurrency."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TextIO

from specd.commands.args import MAX_CONCURRENCY, MAX_TOKENS, IntList, Seconds
from specd.commands.check_config import load_for_command
from specd.core.setting import format_setting
from specd.core.setting import parse as parse_setting
from specd.core.settings import DEFAULT_ADAPTIVE_SETS
from specd.io import logs
from specd.io.config import Config
from specd.io.runner import Runner
from specd.tools.sweep import (
    EXIT_FAILED,
    EXIT_SIGNAL_BASE,
    EXIT_USAGE,
    LOG_NAME,
    TWIN_LOAD_TIME_S,
    TWIN_WARMUP_S,
    PlainReporter,
    Reporter,
    RichReporter,
    SweepError,
    SweepPlan,
    SweepReport,
    check_plan,
    describe_setting,
    refuse_earlier_results,
    sweep,
)

STEPS_LIST = IntList(1, 16, max_items=16)
# `--adaptive` without a value: the sets the config lets the model policy consider.
FROM_CONFIG = "[choose]"
CONCURRENCY_LIST = IntList(1, MAX_CONCURRENCY, max_items=64)
DURATION_S = Seconds(0, 86400, above_lo=True)
WARMUP_S = Seconds(0, 86400)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure SGLang at each step count and concurrency: restarts the SGLang unit once per "
        "step count, writes sweep.csv (a calibration table), sweep.md and sweep.png, and puts "
        "the original step count back at the end, on failure and on Ctrl-C. Stop specd first."
    )
    parser.add_argument(
        "--steps",
        type=STEPS_LIST,
        required=True,
        help=f"step counts, e.g. 1,2,3,4 ({STEPS_LIST.spec})",
    )
    parser.add_argument(
        "--off",
        action="store_true",
        help="also measure no speculation (written as steps 0, which the model reads as 'off')",
    )
    parser.add_argument(
        "--adaptive",
        action="append",
        nargs="?",
        const=FROM_CONFIG,
        metavar="SET",
        help="also measure an SGLang adaptive candidate set, e.g. adaptive:3,4 (repeatable; "
        "without a value: [choose] adaptive_candidate_sets); refused where the server cannot "
        "run it; written with the set in sweep.csv's setting column",
    )
    parser.add_argument(
        "--concurrency",
        type=CONCURRENCY_LIST,
        required=True,
        help=f"closed-loop clients, e.g. 1,4,16 ({CONCURRENCY_LIST.spec})",
    )
    parser.add_argument(
        "--duration-s",
        type=DURATION_S,
        default=60.0,
        help=f"measured seconds per point ({DURATION_S.spec}; default 60)",
    )
    parser.add_argument(
        "--warmup-s",
        type=WARMUP_S,
        default=20.0,
        help=f"load before measuring, per step count ({WARMUP_S.spec}; default 20)",
    )
    parser.add_argument(
        "--max-tokens",
        type=MAX_TOKENS,
        default=256,
        help=f"tokens per request ({MAX_TOKENS.spec}; default 256)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default ./sweep-DATE-TIME)"
    )
    parser.add_argument("--config", type=Path, default=None, help="specd config file")
    parser.add_argument("--yes", action="store_true", help="do not ask before restarting SGLang")
    parser.add_argument(
        "--twin",
        action="store_true",
        help="sweep an embedded SGLang twin instead of the configured unit (a demo)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def confirm(
    config: Config, plan: SweepPlan, yes: bool, stdin: TextIO, stderr: TextIO
) -> str | None:
    """None to go ahead, else why not (one line)."""
    if yes:
        return None
    if not stdin.isatty():
        return "refusing to restart SGLang without confirmation: no terminal to ask; pass --yes"
    settings = plan.settings()
    minutes = plan.load_seconds_per_steps() * len(settings) / 60
    print(
        f"This restarts {config.sglang.unit} up to {len(settings) + 1} times ("
        f"{', '.join(map(describe_setting, settings))}), serving nothing while it loads, and "
        "loads it for "
        f"about {minutes:.0f} min. Continue? [y/N] ",
        end="",
        file=stderr,
        flush=True,
    )
    answer = stdin.readline().strip().lower()
    return None if answer in ("y", "yes") else "not confirmed; nothing was changed"


def twin_config(workdir: Path, twin_port: int) -> Config:
    from specd.twin.unit import twin_unit_config  # noqa: PLC0415

    return twin_unit_config(workdir, twin_port, choose=TWIN_CHOOSE)


# The twin's step range (its seed table's speculative rows).
TWIN_CHOOSE: dict[str, int] = {"min_steps": 1, "max_steps": 6}


# The twin starts in about a second: poll its health often so restarts stay short.
FAST_PACING: dict[str, float] = {"health_poll_interval_s": 0.2, "quiet_poll_interval_s": 0.2}


def make_plan(args: argparse.Namespace, config_sets: Sequence[str]) -> SweepPlan:
    """The plan the arguments ask for (``config_sets``: [choose] adaptive_candidate_sets);
    ValueError (one line) when it is not one."""
    adaptive: list[str] = []
    for text in args.adaptive or ():
        wanted = tuple(config_sets) if text == FROM_CONFIG else (text,)
        # A set named twice (in any spelling) is measured once; SweepPlan refuses bad text.
        adaptive += [t for t in wanted if _canonical(t) not in map(_canonical, adaptive)]
    return SweepPlan(
        steps=args.steps,
        concurrency=tuple(sorted(args.concurrency)),
        duration_s=args.duration_s,
        warmup_s=args.warmup_s,
        max_tokens=args.max_tokens,
        off=args.off,
        adaptive=tuple(adaptive),
    )


def _canonical(text: str) -> str:
    try:
        return format_setting(parse_setting(text))
    except ValueError:
        return text


def run(args: argparse.Namespace) -> int:
    out_dir = args.out or Path(f"sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    try:
        # Before the twin starts or the operator is asked: nothing is worth doing then.
        refuse_earlier_results(out_dir)
    except SweepError as exc:
        print(f"specd sweep: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.twin:
        if args.config is not None:
            print("specd sweep: --twin and --config exclude each other", file=sys.stderr)
            return EXIT_USAGE
        try:
            plan = make_plan(args, DEFAULT_ADAPTIVE_SETS)
            # Before the twin starts: a usage error is exit 2 with nothing made, as without.
            check_plan(plan, Config(choose=TWIN_CHOOSE))
        except (ValueError, SweepError) as exc:
            print(f"specd sweep: {exc}", file=sys.stderr)
            return EXIT_USAGE
        return _run_twin(args, plan, out_dir)
    config = load_for_command(args.config)
    if config is None:
        return EXIT_USAGE
    try:
        plan = make_plan(args, config.choose.adaptive_candidate_sets)
    except ValueError as exc:
        print(f"specd sweep: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        check_plan(plan, config)
    except SweepError as exc:
        print(f"specd sweep: {exc}", file=sys.stderr)
        return EXIT_USAGE
    refused = confirm(config, plan, args.yes, sys.stdin, sys.stderr)
    if refused is not None:
        print(f"specd sweep: {refused}", file=sys.stderr)
        return EXIT_USAGE
    return _run_cli(args, config, plan, out_dir, None, None)


def _run_twin(args: argparse.Namespace, plan: SweepPlan, out_dir: Path) -> int:
    from specd.twin.process import free_port  # noqa: PLC0415
    from specd.twin.unit import DEFAULT_STEPS, TwinUnitRunner  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="specd-sweep-twin-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        config = twin_config(workdir, port)
        unit = TwinUnitRunner(
            config.sglang.unit,
            Path(config.sglang.env_file),
            port=port,
            extra_args=["--load-time-s", str(TWIN_LOAD_TIME_S), "--warmup-s", str(TWIN_WARMUP_S)],
        )
        print(f"specd sweep: starting the SGLang twin at steps {DEFAULT_STEPS} on port {port}",
              file=sys.stderr)  # fmt: skip
        try:
            unit.start().wait_healthy(60)
        except RuntimeError as exc:
            unit.stop()
            print(f"specd sweep: the twin did not start: {exc}", file=sys.stderr)
            return EXIT_FAILED
        try:
            return _run_cli(args, config, plan, out_dir, unit, FAST_PACING)
        finally:
            unit.stop()


def _run_cli(
    args: argparse.Namespace,
    config: Config,
    plan: SweepPlan,
    out_dir: Path,
    runner: Runner | None,
    pacing: dict[str, float] | None,
) -> int:
    reporter: Reporter
    if args.json:
        reporter = Reporter()
    elif sys.stderr.isatty():
        reporter = RichReporter(sys.stderr)
    else:
        reporter = PlainReporter(sys.stderr)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        log_file = (out_dir / LOG_NAME).open("a", encoding="utf-8")
    except OSError as exc:
        print(f"specd sweep: cannot write to {out_dir}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    # The restart sequence logs JSON lines; they belong in a file beside the results.
    logs.configure("json", stream=log_file)
    try:
        report = sweep(config, plan, out_dir, runner=runner, reporter=reporter, pacing=pacing)
    except SweepError as exc:
        reporter.close()
        print(f"specd sweep: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        log_file.close()
    if args.json:
        # Where the results are: the default --out is named by the time the sweep began.
        print(json.dumps({**report.to_dict(), "files": [str(p) for p in report.files]}))
    else:
        for path in report.files:
            print(path)
    return exit_code(report)


def exit_code(report: SweepReport) -> int:
    if report.interrupted_by is not None:
        return EXIT_SIGNAL_BASE + int(signal.Signals[report.interrupted_by])
    return 0 if report.ok else EXIT_FAILED
