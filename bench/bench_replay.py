"""Replay every bench trace against every truth table; write bench/results/replay.md.

``python -m bench replay`` (or ``.venv/bin/python bench/bench_replay.py``) generates the
week-long 1-second traces (bench/traces/generate.py) into a temporary directory, then runs
`specd.replay` — specd's own history, forecast, decide and window code — for each (truth,
trace) pair with the model policy and a sparse noisy calibration, and with the bands policy
for comparison. It checks issue 4's acceptance on each model row and exits 1 if one fails.
Decision cost (two policy calls and decide per tick, as the daemon does) is measured in the
same runs. ``--days N`` shortens the traces; ``--only NAME`` runs one trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` and `specd` importable
    sys.path.insert(0, str(REPO))

from bench.traces import generate as traces  # noqa: E402
from specd.commands.replay import build_config  # noqa: E402
from specd.io.config import Config, Window  # noqa: E402
from specd.io.tables import read_table  # noqa: E402
from specd.tools.replay import load_trace, replay  # noqa: E402

TRUTH = REPO / "bench" / "truth"
RESULTS = REPO / "bench" / "results" / "replay.md"
SEED = REPO / "specd" / "data" / "seed-qwen35-122b.csv"
# (name, truth table, calibration a sweep measured)
TRUTHS = (
    ("seed (twin)", SEED, TRUTH / "seed-calibration.csv"),
    ("k5to2", TRUTH / "k5to2.csv", TRUTH / "k5to2-calibration.csv"),
    ("lowaccept", TRUTH / "lowaccept.csv", TRUTH / "seed-calibration.csv"),
)
DAILY = ("0 3 * * mon-sun", 3600.0, "UTC")
WINDOWS: dict[str, tuple[tuple[str, float, str], ...]] = {
    # Before the team arrives and before the batch jobs start.
    "day_night": (("0 7 * * mon-sun", 3600.0, "UTC"), ("0 19 * * mon-sun", 3600.0, "UTC")),
    "weekly": (DAILY,),
    "steady_low": (DAILY,),
    "steady_heavy": (DAILY,),
    "bursty": (DAILY,),
}
STEPS = (1, 6)
RESTART_S = 100.0


@dataclass(frozen=True)
class Row:
    truth: str
    trace: str
    policy: str
    result: dict[str, Any]
    seconds: float

    def failures(self) -> list[str]:
        r = self.result
        out = []
        if r["ratio_to_oracle"] < 0.97:
            out.append(f"ratio_to_oracle {r['ratio_to_oracle']} < 0.97")
        if r["ratio_to_best_static"] < 0.99:
            out.append(f"ratio_to_best_static {r['ratio_to_best_static']} < 0.99")
        captured = r["gap_captured_ratio"]
        if r["oracle_gap_ratio"] > 0.03 and (captured is None or captured < 2 / 3):
            out.append(f"captured {captured} of a {r['oracle_gap_ratio']:.1%} gap < 2/3")
        if (r["restarts_per_day"] or 0) > 2:
            out.append(f"{r['restarts_per_day']} restarts/day > 2")
        if r["restarts_outside_windows"]:
            out.append(f"{r['restarts_outside_windows']} restarts outside windows")
        return out


def run_one(truth: tuple[str, Path, Path], trace_name: str, trace_path: Path, policy: str) -> Row:
    name, truth_path, calibration = truth
    windows = [Window(cron=c, duration_s=d, timezone=z) for c, d, z in WINDOWS[trace_name]]
    config = build_config(
        Config(),
        window_list=windows,
        steps=STEPS,
        policy=policy,
        calibration=calibration,
        restart_s=RESTART_S,
    )
    began = time.perf_counter()
    result = replay(load_trace(trace_path), read_table(truth_path), config, restart_s=RESTART_S)
    return Row(name, trace_name, policy, result.to_dict(), time.perf_counter() - began)


def markdown(rows: list[Row], days: float) -> str:
    lines = [
        "# specd replay: specd vs best static vs oracle",
        "",
        f"Week-long traces ({days:g} days, 1-second rows, bench/traces/generate.py), steps "
        f"{STEPS[0]}–{STEPS[1]}, restart {RESTART_S:g} s, start K 3, config defaults otherwise. "
        "Truth: the table tokens are served from; the model policy gets the sparse noisy "
        "calibration (bench/truth/). Oracle: best fixed K per epoch (window opening to window "
        "opening) in hindsight, no restart cost. Millions of tokens.",
        "",
        "Reproduce: `.venv/bin/python -m bench replay` (or `.venv/bin/python "
        "bench/bench_replay.py`); one run: `specd replay --trace T.csv --truth TABLE.csv "
        "--calibration CAL.csv --window '0 3 * * mon-sun;3600;UTC' --steps 1-6 --json`.",
        "",
        "| truth | trace | policy | specd | best static (K) | oracle | ×oracle | ×best static "
        "| oracle gap | gap captured | restarts/day | outside windows | decision ms mean/p99 "
        "| forecast err (median) | replay s | check |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for row in rows:
        r = row.result
        best = r["best_static_steps"]
        captured = "–" if r["gap_captured_ratio"] is None else f"{r['gap_captured_ratio']:.2f}"
        fails = row.failures()
        check = (
            "–" if row.policy != "model" else ("ok" if not fails else "FAIL: " + "; ".join(fails))
        )
        err = r["forecast_median_error_ratio"]
        static = r["static_tokens"][str(best)] / 1e6
        ms = f"{r['decision_ms_mean']:.2f}/{r['decision_ms_p99']:.2f}"
        lines.append(
            f"| {row.truth} | {row.trace} | {row.policy} | {r['specd_tokens'] / 1e6:.1f} "
            f"| {static:.1f} ({best}) | {r['oracle_tokens'] / 1e6:.1f} "
            f"| {r['ratio_to_oracle']:.4f} | {r['ratio_to_best_static']:.4f} "
            f"| {r['oracle_gap_ratio']:.1%} | {captured} | {r['restarts_per_day']} "
            f"| {r['restarts_outside_windows']} | {ms} "
            f"| {'–' if err is None else f'{err:.1%}'} | {row.seconds:.1f} | {check} |"
        )
    return "\n".join(lines) + "\n"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench replay", description=__doc__)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--only", choices=sorted(traces.PATTERNS))
    parser.add_argument("--no-bands", action="store_true", help="skip the bands comparison")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--json", action="store_true", help="also print each result as JSON")
    args = parser.parse_args(argv)
    names = [args.only] if args.only else list(traces.PATTERNS)
    policies = ["model"] if args.no_bands else ["model", "bands"]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="specd-traces-") as tmp:
        for name in names:
            path = traces.write(name, Path(tmp) / f"{name}.csv", args.days)
            for truth in TRUTHS:
                for policy in policies:
                    row = run_one(truth, name, path, policy)
                    rows.append(row)
                    r = row.result
                    print(
                        f"{row.truth:>12} {name:>13} {policy:>5}: "
                        f"×oracle {r['ratio_to_oracle']:.4f} "
                        f"×best static {r['ratio_to_best_static']:.4f} "
                        f"gap {r['oracle_gap_ratio']:.1%} "
                        f"restarts {r['restarts']} ({row.seconds:.1f} s)"
                        + ("" if policy != "model" or not row.failures() else "  FAIL"),
                        flush=True,
                    )
                    if args.json:
                        print(
                            json.dumps({"truth": row.truth, "trace": name, "policy": policy, **r})
                        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(rows, args.days), encoding="utf-8")
    print(f"wrote {args.out}")
    return 1 if any(row.failures() for row in rows if row.policy == "model") else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
