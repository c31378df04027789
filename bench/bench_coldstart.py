"""The first epoch's bet: what any policy can still reach after it (bench/results/coldstart.md).

At the first window of a bench trace specd has seen only the hours before it, and the
setting it picks there runs until the next window opens: for the daily windows, Monday
03:00 to Tuesday 03:00, after three hours of traffic. ``python -m bench coldstart`` asks,
for each truth, trace and setting S1 that could run through that first epoch, how much of
issue 12's two token figures *any* policy offered the same settings can still reach, by an
upper bound on its tokens (`bench.firstepoch.upper_bound`: windows at the best setting
second by second, the best fixed one in hindsight for every later epoch, no restart
charged) over the replay's own denominators, on the same traces, truths and windows as
``python -m bench replay``, for both of its policies: the default (static K, off and the
adaptive sets the truth can serve) and `model static` (static K only). A policy that ran S1
through the first epoch serves at most the bound, so where the bound is below a figure no
policy reaches it with that S1. Where two traces looked alike before their first window
(`ALIKE`) and no S1 reaches a figure on both, no policy reaches it on both without telling
the two apart from those first hours.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` and `specd` importable
    sys.path.insert(0, str(REPO))

from bench.bench_replay import (  # noqa: E402
    BEST_STATIC_MIN,
    DAYS,
    ORACLE_MIN,
    RESTART_S,
    STATIC_POLICY,
    STEPS,
    TRUTHS,
    case_config,
    check_days,
    short_setting,
)
from bench.firstepoch import Bounds, bounds_of  # noqa: E402
from bench.traces import generate as traces  # noqa: E402
from specd.io.tables import read_table  # noqa: E402
from specd.tools.replay import DEFAULT_START_STEPS, load_trace  # noqa: E402

RESULTS = REPO / "bench" / "results" / "coldstart.md"
# Traces that show alike before their first window opens: three quiet hours of one to a few
# requests (weekly's nights are 1-4 concurrent, steady_low's 1-3).
ALIKE = (("weekly", "steady_low"),)
POLICIES = ("model", STATIC_POLICY)
Results = dict[tuple[str, str, str], Bounds]  # (truth, trace, policy) → its bounds


def case(
    truth: tuple[str, Path, Path], trace_name: str, trace_path: Path, policy: str = "model"
) -> Bounds:
    """One bench case, with the config of ``python -m bench replay``'s ``policy`` (its
    windows, the settings it offers and its restart)."""
    _, truth_path, calibration = truth
    config = case_config(calibration, trace_name, policy)
    return bounds_of(load_trace(trace_path), read_table(truth_path), config)


def _reaching(bounds: Bounds) -> list[str]:
    return bounds.reaching(BEST_STATIC_MIN, ORACLE_MIN)


def _names(names: Sequence[str]) -> str:
    return ", ".join(short_setting(n) for n in names) if names else "none"


def _both(results: Results, truth: str, a: str, b: str, policy: str) -> tuple[str, str, str]:
    """The settings reaching both figures on ``a``, on ``b``, and on both."""
    on_a = _reaching(results[(truth, a, policy)])
    on_b = _reaching(results[(truth, b, policy)])
    both = [n for n in on_a if n in on_b]
    return _names(on_a), _names(on_b), _names(both) if both else "**none**"


def markdown(results: Results, names: Sequence[str], days: float) -> str:
    truths = list(dict.fromkeys(t for t, _, _ in results))
    lines = [
        "# The first epoch's bet: what any policy can still reach after it",
        "",
        f"{days:g}-day bench traces, the truths, windows, step counts {STEPS[0]}–{STEPS[1]}, "
        f"start K {DEFAULT_START_STEPS} and {RESTART_S:g} s restart of `python -m bench "
        "replay`. For each setting S1 run through the first epoch (the first window's "
        "opening to the next one's), an upper bound on the tokens of any policy offered the "
        "same settings: the start K before the first window (as everyone), every window's "
        "open stretch at the best setting second by second, S1 for the rest of the first "
        "epoch, the best fixed setting in hindsight for the rest of every later epoch, and "
        "no restart charged. Divided by the replay's own denominators (the best static step "
        "count from the first window on, the per-epoch oracle of static step counts), it is "
        "the most any policy that ran S1 there can reach of issue 12's figures (×best "
        f"static ≥ {BEST_STATIC_MIN:g}, ×oracle ≥ {ORACLE_MIN:g}). Two policies, as the "
        "replay's: `model static` is offered the static step counts; the default also off "
        "and the adaptive sets the truth can serve (A2,4 is `adaptive:2,4`; A1,3,5,7 "
        "SGLang's default slots), which can hedge the first epoch: a set runs its best "
        "candidate at each batch size, for the KV of its deepest.",
        "",
        "Reproduce: `.venv/bin/python -m bench coldstart` (`--days N`).",
        "",
        "## Traces that look alike at their first window",
        "",
    ]
    for a, b in ALIKE:
        if a not in names or b not in names:
            continue
        first = results[(truths[0], a, "model")]
        second = results[(truths[0], b, "model")]
        lines += [
            f"Before the first window, `{a}` showed {first.seen_min}–{first.seen_max} "
            f"concurrent (mean {first.seen_mean:.1f}) and `{b}` {second.seen_min}–"
            f"{second.seen_max} (mean {second.seen_mean:.1f}). An S1 that reaches both "
            "figures on one and not the other makes a policy bet the first day on telling "
            "them apart from those hours; **none** says no policy offered those settings "
            "passes both rows without that bet.",
            "",
            f"| truth | static K only: S1 reaching both figures on {a} | on {b} | on both "
            f"| every setting: on {a} | on {b} | on both |",
            "|---|---|---|---|---|---|---|",
        ]
        for truth in truths:
            cells = [
                *_both(results, truth, a, b, STATIC_POLICY),
                *_both(results, truth, a, b, "model"),
            ]
            lines.append(f"| {truth} | " + " | ".join(cells) + " |")
        lines.append("")
    for policy, what in (
        (STATIC_POLICY, "static K only (`model static`)"),
        ("model", "every setting offered (the default)"),
    ):
        rows = {(t, n): bounds for (t, n, p), bounds in results.items() if p == policy}
        columns = list(dict.fromkeys(s for bounds in rows.values() for s in bounds.upper))
        lines += [
            f"## Every case, {what}: the bound per first-epoch S1, ×best static / ×oracle",
            "",
            "| truth | trace | seen before the first window | "
            + " | ".join(f"S1 = {short_setting(c)}" for c in columns)
            + " | S1 reaching both |",
            "|---|---|---|" + "--:|" * len(columns) + "---|",
        ]
        for (truth, name), bounds in rows.items():
            bound_cells = " | ".join(
                f"{bounds.to_best_static(c):.4f} / {bounds.to_oracle(c):.4f}"
                if c in bounds.upper
                else "–"
                for c in columns
            )
            lines.append(
                f"| {truth} | {name} | {bounds.seen_min}–{bounds.seen_max} "
                f"(mean {bounds.seen_mean:.1f}) | {bound_cells} | {_names(_reaching(bounds))} |"
            )
        lines.append("")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench coldstart", description=__doc__)
    parser.add_argument("--days", type=DAYS, default=7.0, help=f"trace length ({DAYS.spec})")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    names = list(traces.PATTERNS)
    check_days(parser, args.days, names)
    results: Results = {}
    with tempfile.TemporaryDirectory(prefix="specd-traces-") as tmp:
        paths = {n: traces.write(n, Path(tmp) / f"{n}.csv", args.days) for n in names}
        for entry in TRUTHS:
            truth = entry[0]
            for name in names:
                for policy in POLICIES:
                    bounds = results[(truth, name, policy)] = case(entry, name, paths[name], policy)
                    print(
                        f"{truth:>13} {name:>13} {policy:>12}: S1 reaching both "
                        f"{_names(_reaching(bounds))}"
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(results, names, args.days), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
