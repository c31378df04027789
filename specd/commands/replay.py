"""`specd replay`: a trace through specd's decisions against a truth table."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from specd.core.perftable import PerfTable, PerfTableError
from specd.io.config import (
    Config,
    ConfigError,
    Window,
    check_calibration,
    config_to_dict,
    load_config,
)
from specd.tools.replay import DEFAULT_RESTART_S, DEFAULT_START, ReplayError, load_trace, replay


# -- the command ------------------------------------------------------------------------
def _window_arg(text: str) -> Window:
    parts = text.split(";")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'CRON;DURATION_S;TZ'")
    try:
        return Window(cron=parts[0].strip(), duration_s=float(parts[1]), timezone=parts[2].strip())
    except ValueError as exc:
        first = str(exc).splitlines()
        detail = first[2].strip() if len(first) > 2 else first[0]
        raise argparse.ArgumentTypeError(f"{text!r}: {detail}") from None


def _steps_arg(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN-MAX, e.g. 1-5") from None
    if not 1 <= a <= b <= 16:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX <= 16")
    return a, b


def _start_arg(text: str) -> datetime:
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an ISO 8601 time") from None
    return at if at.tzinfo is not None else at.replace(tzinfo=timezone.utc)


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds >= 0")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Replay a trace of offered concurrency through specd's own history, forecast, "
        "decide and window code in simulated time, against a ground-truth table; compare "
        "with every static step count and the per-epoch oracle."
    )
    parser.add_argument("--trace", required=True, type=Path, help="CSV t_s,concurrency")
    parser.add_argument("--truth", required=True, type=Path, help="ground-truth performance table")
    parser.add_argument("--calibration", type=Path, help="calibration table for the model policy")
    parser.add_argument("--config", type=Path, help="specd.toml (default: built-in defaults)")
    parser.add_argument(
        "--window", action="append", type=_window_arg, help="'CRON;DURATION_S;TZ' (repeatable)"
    )
    parser.add_argument("--steps", type=_steps_arg, help="allowed steps MIN-MAX")
    parser.add_argument(
        "--policy",
        choices=("model", "bands"),
        help="default: model with a calibration (here or in the config), else the config's",
    )
    parser.add_argument(
        "--restart-s", type=_seconds_arg, default=DEFAULT_RESTART_S, help="restart downtime, s"
    )
    parser.add_argument("--initial-steps", type=int, help="steps live at the start (default 3)")
    parser.add_argument(
        "--warmup-s",
        type=_seconds_arg,
        default=0.0,
        help="replay but do not score the trace's first S seconds (default 0)",
    )
    parser.add_argument(
        "--start", type=_start_arg, default=DEFAULT_START, help="ISO 8601 (default a Monday)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def build_config(
    base: Config,
    *,
    window_list: Sequence[Window] | None = None,
    steps: tuple[int, int] | None = None,
    policy: str | None = None,
    calibration: Path | None = None,
    restart_s: float | None = None,
) -> Config:
    """``base`` with the replay's overrides, validated again as a whole."""
    data = config_to_dict(base)
    if window_list:
        data["windows"] = [w.model_dump() for w in window_list]
    choose = data.setdefault("choose", {})
    if steps is not None:
        choose["min_steps"], choose["max_steps"] = steps
        data["bands"] = [
            {**b, "steps": min(max(b["steps"], steps[0]), steps[1])} for b in data["bands"]
        ]
    if calibration is not None:
        choose["calibration_file"] = str(calibration.resolve())
        # A calibration makes the model the default policy, as in the config.
        choose["policy"] = "model"
    if policy is not None:
        choose["policy"] = policy
    if restart_s is not None:
        choose["restart_cost_s"] = restart_s
    try:
        config = Config(**data)
    except ValueError as exc:
        raise ReplayError(str(exc).splitlines()[-1].strip()) from None
    problems = check_calibration(config)
    if problems:
        raise ReplayError(problems[0])
    return config


def run(args: argparse.Namespace) -> int:
    try:
        base = load_config(args.config) if args.config is not None else Config()
        config = build_config(
            base,
            window_list=args.window,
            steps=args.steps,
            policy=args.policy,
            calibration=args.calibration,
            restart_s=args.restart_s,
        )
        truth = PerfTable.from_csv(args.truth)
        trace = load_trace(args.trace)
        result = replay(
            trace,
            truth,
            config,
            start=args.start,
            restart_s=args.restart_s,
            initial_steps=args.initial_steps,
            warmup_s=args.warmup_s,
        )
    except ConfigError as exc:
        print(f"specd replay: {args.config}: {'; '.join(exc.problems)}", file=sys.stderr)
        return 2
    except (ReplayError, PerfTableError, ValueError) as exc:
        print(f"specd replay: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    data = result.to_dict()
    data["policy"] = config.choose.policy
    if args.json:
        print(json.dumps(data))
        return 0
    print(
        f"policy {config.choose.policy}: specd {data['specd_tokens']:,} tokens, oracle "
        f"{data['oracle_tokens']:,} (×{data['ratio_to_oracle']}), best static "
        f"{data['best_static_steps']} (×{data['ratio_to_best_static']}); "
        f"{data['restarts']} restarts in {data['days']} days, "
        f"{data['restarts_outside_windows']} outside windows"
    )
    for kk, v in data["static_tokens"].items():
        print(f"  static {kk}: {v:,} tokens")
    return 0
