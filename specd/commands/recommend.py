"""`specd recommend --url URL`: what specd would decide now, against a live server.

Changes nothing: it reads the daemon's state file (when there is one) for the learned
history, restarts and freeze, samples the server a few times, and runs the same
`step` as the daemon on a copy. Useful before installing specd (what
would it do with this traffic?) and on call (why is it not acting?). Exits 1, as `specd
observe` does, when not one scrape of SGLang answered.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from specd.commands.args import Int, Seconds
from specd.commands.check_config import load_for_command
from specd.commands.observe import config_key_file, sglang_url
from specd.core.choices import as_applied
from specd.core.history import History, HistorySettings
from specd.core.model import PerformanceModel
from specd.core.observation import Observation, ScrapeError
from specd.core.outcome import Measured, measured
from specd.core.setting import SpecSetting, format_setting, parse, traits_from_server_info
from specd.core.step import StepContext, step
from specd.io.apply import read_static_only, read_stop_timeout_s, restart_needs_s
from specd.io.calibration import CalibrationFile
from specd.io.config import DEFAULT_CONFIG_PATH
from specd.io.override import daemon_uids, read_override
from specd.io.runner import SubprocessRunner
from specd.io.sglang import SGLangClient
from specd.io.state import (
    STATE_FILE,
    State,
    StateNotRead,
    held_freeze,
    read_state,
    salvage_note,
)

SAMPLES = Int(1, 1000)
INTERVAL_S = Seconds(0, 3600)


def _learned_state(state_dir: Path, settings: HistorySettings) -> tuple[State, str, bool]:
    """The state as the daemon reads it, where its history comes from, and whether what
    it holds is unknown (the file not read at all: a freeze in it may stand)."""
    path = state_dir / STATE_FILE
    dropped: list[str] = []
    now = time.time()
    try:
        state = read_state(path, settings, dropped, now=now)
        if dropped:
            return state, f"history from {path} ({salvage_note(dropped)})", False
        return state, f"history from {path}", False
    except FileNotFoundError:
        return State(history=History(settings)), "no state file: history from samples only", False
    except (OSError, ValueError) as exc:
        fresh = State(history=History(settings))
        # As the daemon keeps it: the freeze (or the restart in flight) of a file it cannot
        # read as a state (a newer specd's) still holds.
        fresh.frozen = held_freeze(exc, now)
        unknown = isinstance(exc, (OSError, StateNotRead))
        return fresh, f"state file unusable ({exc}): samples only", unknown


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        required=True,
        type=sglang_url,
        help="SGLang's root URL, e.g. http://127.0.0.1:30000 (not .../v1)",
    )
    parser.add_argument("--config", type=Path, default=None, help=f"default {DEFAULT_CONFIG_PATH}")
    parser.add_argument(
        "--samples", type=SAMPLES, default=5, help=f"scrapes to take ({SAMPLES.spec}; default 5)"
    )
    parser.add_argument(
        "--interval-s",
        type=INTERVAL_S,
        default=1.0,
        help=f"between scrapes ({INTERVAL_S.spec}; default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _text(setting: SpecSetting | None, steps: int) -> str:
    return format_setting(setting) if setting is not None else str(steps)


def _measured_json(row: Measured) -> dict[str, Any]:
    return {
        "setting": row.setting,
        "observed_s": row.observed_s,
        "observed_tok_s": row.observed_tok_s,
        "concurrencies": list(row.concurrencies),
        "predicted_tok_s": row.predicted_tok_s,
        "interval": None if row.interval is None else list(row.interval),
    }


def _measured_text(row: Measured) -> str:
    seen = ",".join(str(c) for c in row.concurrencies[:8]) + (
        ",…" if len(row.concurrencies) > 8 else ""
    )
    hours = row.observed_s / 3600
    text = f"{row.setting}: {row.observed_tok_s:.0f} tok/s over {hours:.1f} h at {seen}"
    if row.predicted_tok_s is None or row.interval is None:
        return text + " (no prediction)"
    low, high = row.interval
    return text + f", predicted {row.predicted_tok_s:.0f} ({low:.0f}–{high:.0f})"


def run(args: argparse.Namespace) -> int:
    config = load_for_command(args.config)
    if config is None:
        return 2
    settings = HistorySettings.from_config(config)
    state, source, unknown = _learned_state(Path(config.files.state_dir), settings)
    history = state.history
    last: Observation | ScrapeError | None = None
    pause = threading.Event()
    try:
        client = SGLangClient(
            args.url,
            timeout_s=config.observe.scrape_timeout_s,
            api_key=config_key_file(config, args.url),
        )
    except ValueError as exc:
        print(f"specd recommend: {exc}", file=sys.stderr)
        return 2
    traits = None
    read_any = False
    with client:
        info = client.server_info()
        if not isinstance(info, ScrapeError):
            # What may be chosen on this server (specd.core.choices), as the daemon offers it:
            # a server running off names no algorithm, and the config's stands in.
            traits = as_applied(traits_from_server_info(info), config.sglang.speculative_algorithm)
        for i in range(args.samples):
            last = client.observe()
            if isinstance(last, Observation):
                history.record(last)
                read_any = True
            if i + 1 < args.samples:
                pause.wait(args.interval_s)
    now = time.time()
    status = read_override(
        Path(config.files.override_file),
        config.choose.min_steps,
        config.choose.max_steps,
        now,
        allowed_uids=daemon_uids(),
        listed=config.choose.adaptive_candidate_sets,
    )
    override = status.override if status.valid else None
    calibration, calibration_problem = CalibrationFile(config.choose.calibration_file).current()
    runner = SubprocessRunner()
    stop_timeout_s = read_stop_timeout_s(
        runner, config.sglang.unit, config.restart.restart_command_timeout_s
    )
    context = StepContext(
        config=config,
        history=history,
        override=override,
        control=state.control(),
        calibration=calibration,
        calibration_problem=calibration_problem,
        traits=traits,
        # What the unit can be given, and how long a restart takes (its stop timeout), as
        # the daemon reads them at start (`systemctl show`): a window closing sooner is
        # no time to restart in.
        static_only=read_static_only(runner, config.sglang.unit),
        restart_needs_s=restart_needs_s(stop_timeout_s, config.choose.restart_cost_s),
    )
    outcome = step(context, last, now)
    current, rec, decision = outcome.current, outcome.pick, outcome.decision
    # Measured against predicted per setting, with the model of the decision when it made
    # one (the decision above is the daemon's own; this only shows what it stood on).
    plan = rec.plan if rec is not None else None
    model = (
        plan.model
        if plan is not None and plan.model is not None
        else PerformanceModel(calibration, history)
    )
    # None: unknown, as the state file could not be read (a freeze in it may stand).
    would_restart = None if unknown and outcome.acts else outcome.acts
    sets = [parse(text) for text in config.choose.adaptive_candidate_sets]
    rows = measured(history, model, sets, config.choose.calibration_noise_ratio)
    out: dict[str, Any] = {
        "url": args.url,
        "history": source,
        "current_steps": current,
        # What runs as the operator writes it: under adaptive there is no step count.
        "current_setting": outcome.live_name,
        "offered_now": last.offered if isinstance(last, Observation) else None,
        "offered_p50": history.quantile(0.5),
        "scrape_error": last.reason if isinstance(last, ScrapeError) else None,
        "recommendation": (
            {"steps": rec.steps, "setting": _text(rec.setting, rec.steps), "why": rec.why}
            if rec
            else None
        ),
        "decision": {
            "target_steps": decision.target_steps,
            "target_setting": decision.target_name,
            "reason": decision.reason.value,
            "message": decision.message,
            "would_restart": would_restart,
        },
        "measured": [_measured_json(row) for row in rows],
    }
    # As `specd observe`: not one answer from SGLang is a failure, whatever was printed.
    code = 0 if read_any else 1
    if args.json:
        print(json.dumps(out, indent=2))
        return code
    live = outcome.live_name
    print(
        f"SGLang         {args.url}: "
        + (f"steps {live}" if live is not None and live.isdigit() else live or "steps ?")
        + (f", offered {out['offered_now']}" if out["offered_now"] is not None else "")
        + (f" (scrape failed: {out['scrape_error']})" if out["scrape_error"] else "")
    )
    print(f"history        {source}")
    print(
        "policy picks   "
        + (
            f"{_text(rec.setting, rec.steps)}: {rec.why}"
            if rec
            else "nothing yet (no busy history)"
        )
    )
    wanted = decision.target_name or (
        None if decision.target_steps is None else str(decision.target_steps)
    )
    target = "no target" if wanted is None else f"target {wanted}"
    print(f"decision       {decision.reason.value}: {target} — {decision.message}")
    for row in rows:
        print(f"measured       {_measured_text(row)}")
    # The daemon's answer; this command itself restarts nothing.
    if would_restart is None:
        print(
            f"would restart  unknown: to {wanted} unless the state file, which could not be "
            "read, holds a freeze (run as root or as a member of group specd)"
        )
    else:
        print("would restart  " + (f"yes, to {wanted}" if outcome.acts else "no"))
    return code
