"""`specd replay`: a trace through specd's decisions against a truth table."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from specd.commands.args import STEPS, Float, IntRange, Seconds, Timestamp, quoted
from specd.core.perftable import PerfTableError
from specd.core.setting import KINDS
from specd.io.config import (
    Config,
    ConfigError,
    Window,
    check_calibration,
    config_to_dict,
    load_config,
)
from specd.io.tables import read_table
from specd.tools.replay import (
    DEFAULT_RESTART_S,
    DEFAULT_START,
    ReplayError,
    Trace,
    load_trace,
    replay,
)

# A replay runs about 20 000 ticks a second: a year at the default 5 s scrape interval
# takes minutes, anything beyond is refused before any work.
MAX_SPAN_S = 366 * 86400.0
MAX_TICKS = 6_400_000
STEPS_RANGE = IntRange(1, 16)
START = Timestamp(1970, 9000)
RESTART_S = Seconds(0, 86400)
WARMUP_S = Seconds(0, MAX_SPAN_S)
ADAPTIVE_LOSS = Float(0, 0.5)
WINDOW_DURATION_S = Seconds(0, 7 * 86400, above_lo=True)


# -- the command ------------------------------------------------------------------------
def _window_arg(text: str) -> Window:
    parts = text.split(";")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{quoted(text)}: expected 'CRON;DURATION_S;TZ'")
    try:
        duration_s = WINDOW_DURATION_S(parts[1])
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{quoted(text)}: DURATION_S {exc}") from None
    try:
        return Window(cron=parts[0].strip(), duration_s=duration_s, timezone=parts[2].strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{quoted(text)}: {_validation_message(exc)}") from None


def _kinds_arg(text: str) -> tuple[str, ...]:
    kinds = tuple(part.strip() for part in text.split(","))
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(
            f"{quoted(text)}: expected kinds from {', '.join(KINDS)}, comma-separated"
        )
    return kinds


def _validation_message(exc: ValueError) -> str:
    """One line from a pydantic ValidationError (without its URL line), else the text."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for error in errors(include_url=False):
            where = ".".join(str(x) for x in error.get("loc", ()))
            message = str(error.get("msg", "")).removeprefix("Value error, ")
            parts.append(f"{where}: {message}" if where else message)
        if parts:
            return "; ".join(parts)
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _when(at: datetime, clock: str) -> str:
    """``at`` in --start's offset, which it names (windows may be written in another
    zone: a bare 12:00 read as the window's 07:00 UTC)."""
    offset = at.strftime("%z")
    zone = "UTC" if offset in ("+0000", "") else f"{offset[:3]}:{offset[3:]}"
    return at.strftime(f"%a %Y-%m-%d {clock}") + f" {zone}"


def check_span(trace: Trace, step_s: float) -> None:
    """Refuse a trace whose simulated time or tick count would take hours or forever."""
    span = trace.duration_s
    if trace.t[0] > MAX_SPAN_S:
        # A trace of Unix times began 56 years after --start, its weekdays and windows
        # shifted with it.
        raise ReplayError(
            f"the trace's first t_s is {trace.t[0]:g}: t_s counts seconds from --start, not "
            "Unix time; subtract the first t_s from each and pass its time as --start"
        )
    if not math.isfinite(span) or span > MAX_SPAN_S:
        raise ReplayError(
            f"the trace spans {span:g} s; at most {MAX_SPAN_S:g} s (366 days) can be replayed"
        )
    ticks = span / step_s
    if ticks > MAX_TICKS:
        raise ReplayError(
            f"the trace spans {span:g} s = {ticks:.0f} ticks of {step_s:g} s; at most "
            f"{MAX_TICKS} ticks (raise scrape_interval_s or shorten the trace)"
        )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Replay a trace of offered concurrency through specd's own history, forecast, "
        "decide and window code in simulated time, against a ground-truth table; compare "
        "with every static step count and the per-epoch oracle."
    )
    parser.add_argument(
        "--trace",
        required=True,
        type=Path,
        help="CSV with a header t_s,concurrency: seconds from --start, and the requests "
        "offered from then on (running + queued, a whole number) until the next row",
    )
    parser.add_argument("--truth", required=True, type=Path, help="ground-truth performance table")
    parser.add_argument("--calibration", type=Path, help="calibration table for the model policy")
    parser.add_argument("--config", type=Path, help="specd.toml (default: built-in defaults)")
    parser.add_argument(
        "--window",
        action="append",
        type=_window_arg,
        help=f"'CRON;DURATION_S;TZ' (repeatable; DURATION_S {WINDOW_DURATION_S.spec})",
    )
    parser.add_argument("--steps", type=STEPS_RANGE, help=f"allowed steps, {STEPS_RANGE.spec}")
    parser.add_argument(
        "--kinds",
        type=_kinds_arg,
        help="kinds of setting specd may choose, e.g. 'off,static,adaptive' (default: the "
        "config's [choose] kinds)",
    )
    parser.add_argument(
        "--policy",
        choices=("model", "bands"),
        help="default: model with a calibration (here or in the config), else the config's",
    )
    parser.add_argument(
        "--restart-s",
        type=RESTART_S,
        help=f"restart downtime ({RESTART_S.spec}; default: the config's [choose] "
        f"restart_cost_s, {DEFAULT_RESTART_S:g} by default), charged to specd and every "
        "comparison; specd's decisions count it as its restart_cost_s",
    )
    parser.add_argument(
        "--initial-steps", type=STEPS, help=f"steps live at the start ({STEPS.spec}; default 3)"
    )
    parser.add_argument(
        "--warmup-s",
        type=WARMUP_S,
        default=0.0,
        help=f"replay but do not score the trace's first S seconds ({WARMUP_S.spec}; default 0)",
    )
    parser.add_argument(
        "--start",
        type=START,
        default=DEFAULT_START,
        help=f"when the trace starts ({START.spec}; default a Monday)",
    )
    parser.add_argument(
        "--adaptive-loss",
        type=ADAPTIVE_LOSS,
        default=0.0,
        help="share of tokens every adaptive setting serves less than the best candidate of "
        f"each batch's slot, which the truth table gives ({ADAPTIVE_LOSS.spec}; default 0)",
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
    kinds: Sequence[str] | None = None,
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
    if kinds is not None:
        choose["kinds"] = list(kinds)
    try:
        config = Config(**data)
    except ValueError as exc:
        raise ReplayError(_validation_message(exc)) from None
    problems = check_calibration(config)
    if problems:
        # The problem names the config key; name the flag when the flag set it.
        key, sep, rest = problems[0].partition(": ")
        flag = {"choose.calibration_file": calibration, "choose.kinds": kinds}
        flags = {"choose.calibration_file": "--calibration", "choose.kinds": "--kinds"}
        if sep and flag.get(key) is not None:
            raise ReplayError(f"{flags[key]}: {rest}")
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
            kinds=args.kinds,
        )
        truth = read_table(args.truth)
        trace = load_trace(args.trace)
        check_span(trace, config.observe.scrape_interval_s)
        result = replay(
            trace,
            truth,
            config,
            start=args.start,
            # The restart the config's brain expects (the flag set it when given), as the
            # daemon on that config would decide.
            restart_s=config.choose.restart_cost_s,
            initial_steps=args.initial_steps,
            warmup_s=args.warmup_s,
            adaptive_loss_ratio=args.adaptive_loss,
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
    print("\n".join(human_lines(data, args.start)))
    return 0


def _versus(part: dict[str, Any]) -> str:
    """specd against SGLang adaptive over some of the seconds (`where_capacity_binds`)."""
    if part["ratio_to_adaptive"] is None:
        return "SGLang adaptive served nothing there"
    return (
        f"specd ×{part['ratio_to_adaptive']} ({part['specd_tokens']:,} against "
        f"{part['adaptive_tokens']:,} tokens)"
    )


def _restart_lengths(data: dict[str, Any]) -> str:
    """How long the scored restarts served nothing: `` (100 s each)``, or their total and
    range when they differ (an adaptive start captures more CUDA graphs); none: nothing."""
    spans = [
        took
        for (at, _), took in zip(
            data["setting_timeline"][1:], data["change_restart_s"], strict=True
        )
        if at >= data["scored_from_s"]
    ]
    if not spans:
        return ""
    if min(spans) == max(spans):
        return f" ({spans[0]:g} s each)"
    return f" ({sum(spans):,.10g} s in all, {min(spans):g} to {max(spans):g} s each)"


def human_lines(data: dict[str, Any], start: datetime) -> list[str]:
    """The same figures as the JSON, one comparison a line."""
    specd = data["specd_tokens"]
    lines = [
        f"policy {data['policy']}: specd {specd:,} tokens in {data['days']} days, "
        f"{data['restarts']} restarts ({data['restarts_outside_windows']} outside windows), "
        f"{data['restart_lost_tokens']:,} tokens lost restarting{_restart_lengths(data)}",
        f"  oracle per epoch: {data['oracle_tokens']:,} tokens, specd ×{data['ratio_to_oracle']}",
    ]
    for k, tokens in data["static_tokens"].items():
        best = " (best static)" if int(k) == data["best_static_steps"] else ""
        lines.append(f"  static {k}{best}: {tokens:,} tokens, specd ×{data['ratio_to_static'][k]}")
    adaptive = data["adaptive"]
    best_set = data["best_adaptive_set"]
    # On the adaptive line: the best of the configured sets, each run all along.
    hindsight = (
        ""
        if best_set is None
        else f"; best configured set in hindsight {best_set}: "
        f"{data['adaptive_set_tokens'][best_set]:,} tokens, "
        f"specd ×{data['ratio_to_best_adaptive_set']}"
    )
    if adaptive is None:
        lines.append(
            "  SGLang adaptive: not scored (the truth has none of its candidates)" + hindsight
        )
    else:
        slots = " ".join(
            f"≥{b}:[{','.join(map(str, v['candidate_steps']))}]"
            for b, v in adaptive["slots"].items()
        )
        skipped = adaptive["candidates_skipped"]
        lines.append(
            f"  SGLang adaptive {slots}"
            + (f" (not in the truth: {','.join(map(str, skipped))})" if skipped else "")
            + f", capacity {adaptive['capacity']}: {adaptive['tokens']:,} tokens, "
            f"specd ×{data['ratio_to_adaptive']}" + hindsight
        )
        binds, free = adaptive["where_capacity_binds"], adaptive["where_capacity_does_not_bind"]
        if binds is not None and free is not None:
            lines.append(
                f"    where its capacity binds (offered above {adaptive['capacity']}, "
                f"{adaptive['above_capacity_ratio']:.0%} of the time): "
                + _versus(binds)
                + "; elsewhere: "
                + _versus(free)
            )
    loss = data["adaptive_loss_ratio"]
    if loss:
        lines.append(
            f"    every adaptive setting served {loss:.1%} less than the best candidate of "
            "each batch's slot (--adaptive-loss)"
        )
    changes = [
        f"{k} at {_when(start + timedelta(seconds=t), '%H:%M:%S')}"
        + (" (explore)" if reason == "explore" else "")
        for (t, k), reason in zip(data["setting_timeline"][1:], data["change_reasons"], strict=True)
    ]
    first = data["setting_timeline"][0][1]
    lines.append(f"  setting: {first} at the start" + "".join(f", {c}" for c in changes))
    if data["not_offered"]:
        lines.append(
            "  not offered: " + "; ".join(f"{k} ({why})" for k, why in data["not_offered"].items())
        )
    later = data["after_first_day"]
    if later is not None:
        at = _when(start + timedelta(seconds=later["from_s"]), "%H:%M")
        versus_adaptive = (
            ""
            if later["ratio_to_adaptive"] is None
            else f", ×{later['ratio_to_adaptive']} adaptive"
        )
        lines.append(
            f"  after the first day (from {at}): specd ×{later['ratio_to_oracle']} oracle, "
            f"×{later['ratio_to_best_static']} best static ({later['best_static_steps']})"
            + versus_adaptive
        )
    return lines
