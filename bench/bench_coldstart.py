"""The first epoch's bet: what any policy can still reach after it (bench/results/coldstart.md).

At the first window of a bench trace specd has seen only the hours before it, and the
setting it picks there runs until the next window opens: for the daily windows, Monday
03:00 to Tuesday 03:00, after three hours of traffic. ``python -m bench coldstart`` asks,
for each truth, trace and step count K1 that could run through that first epoch, how much
of issue 12's two token figures *any* policy choosing among the static step counts can
still reach, by an upper bound on its tokens (`bench.firstepoch.upper_bound`: windows at
the best step count second by second, the best fixed one in hindsight for every later
epoch, no restart charged) over the replay's own denominators, on the same traces, truths
and windows as ``python -m bench replay``. A policy that ran K1 through the first epoch
serves at most the bound, so where the bound is below a figure no policy reaches it with
that K1. Where two traces looked alike before their first window (`ALIKE`) and no K1
reaches a figure on both, no policy reaches it on both without telling the two apart from
those first hours.
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
    ORACLE_MIN,
    RESTART_S,
    STEPS,
    TRUTHS,
    case_config,
)
from bench.firstepoch import Bounds, bounds_of  # noqa: E402
from bench.traces import generate as traces  # noqa: E402
from specd.io.tables import read_table  # noqa: E402
from specd.tools.replay import DEFAULT_START_STEPS, load_trace  # noqa: E402

RESULTS = REPO / "bench" / "results" / "coldstart.md"
# Traces that show alike before their first window opens: three quiet hours of one to a few
# requests (weekly's nights are 1-4 concurrent, steady_low's 1-3).
ALIKE = (("weekly", "steady_low"),)


def case(truth: tuple[str, Path, Path], trace_name: str, trace_path: Path) -> Bounds:
    """One bench case, with the model policy's config of ``python -m bench replay`` (its
    windows, step counts and restart)."""
    _, truth_path, calibration = truth
    config = case_config(calibration, trace_name, "model")
    return bounds_of(load_trace(trace_path), read_table(truth_path), config)


def _reaching(bounds: Bounds) -> list[int]:
    return bounds.reaching(BEST_STATIC_MIN, ORACLE_MIN)


def _ks(ks: Sequence[int]) -> str:
    return ", ".join(map(str, ks)) if ks else "none"


def markdown(results: dict[tuple[str, str], Bounds], names: Sequence[str], days: float) -> str:
    truths = list(dict.fromkeys(t for t, _ in results))
    lines = [
        "# The first epoch's bet: what any static policy can still reach after it",
        "",
        f"{days:g}-day bench traces, the truths, windows, step counts {STEPS[0]}–{STEPS[1]}, "
        f"start K {DEFAULT_START_STEPS} and {RESTART_S:g} s restart of `python -m bench "
        "replay`. For each step count K1 run through the first epoch (the first window's "
        "opening to the next one's), an upper bound on the tokens of any policy choosing "
        "among the static step counts: the start K before the first window (as everyone), "
        "every window's open stretch at the best K second by second, K1 for the rest of the "
        "first epoch, the best fixed K in hindsight for the rest of every later epoch, and no "
        "restart charged. Divided by the replay's own denominators (the best static step "
        "count from the first window on, the per-epoch oracle), it is the most any policy "
        f"that ran K1 there can reach of issue 12's figures (×best static ≥ "
        f"{BEST_STATIC_MIN:g}, ×oracle ≥ {ORACLE_MIN:g}).",
        "",
        "Reproduce: `.venv/bin/python -m bench coldstart` (`--days N`).",
        "",
        "## Traces that look alike at their first window",
        "",
    ]
    for a, b in ALIKE:
        if a not in names or b not in names:
            continue
        first = results[(truths[0], a)]
        second = results[(truths[0], b)]
        lines += [
            f"Before the first window, `{a}` showed {first.seen_min}–{first.seen_max} "
            f"concurrent (mean {first.seen_mean:.1f}) and `{b}` {second.seen_min}–"
            f"{second.seen_max} (mean {second.seen_mean:.1f}). A K1 that reaches both "
            "figures on one and not the other makes a policy bet the first day on telling "
            "them apart from those hours.",
            "",
            f"| truth | K1 reaching both figures on {a} | on {b} | on both |",
            "|---|---|---|---|",
        ]
        for truth in truths:
            on_a, on_b = _reaching(results[(truth, a)]), _reaching(results[(truth, b)])
            both = [k for k in on_a if k in on_b]
            lines.append(
                f"| {truth} | {_ks(on_a)} | {_ks(on_b)} | "
                f"{_ks(both) if both else '**none**: no K1 reaches both figures on both traces'} |"
            )
        lines.append("")
    lines += [
        "## Every case: the bound per first-epoch K1, ×best static / ×oracle",
        "",
        "| truth | trace | seen before the first window | "
        + " | ".join(f"K1 = {k}" for k in range(STEPS[0], STEPS[1] + 1))
        + " | K1 reaching both |",
        "|---|---|---|" + "--:|" * (STEPS[1] - STEPS[0] + 1) + "---|",
    ]
    for (truth, name), bounds in results.items():
        cells = " | ".join(
            f"{bounds.to_best_static(k):.4f} / {bounds.to_oracle(k):.4f}"
            for k in sorted(bounds.upper)
        )
        lines.append(
            f"| {truth} | {name} | {bounds.seen_min}–{bounds.seen_max} "
            f"(mean {bounds.seen_mean:.1f}) | {cells} | {_ks(_reaching(bounds))} |"
        )
    return "\n".join(lines) + "\n"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench coldstart", description=__doc__)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    names = list(traces.PATTERNS)
    results: dict[tuple[str, str], Bounds] = {}
    with tempfile.TemporaryDirectory(prefix="specd-traces-") as tmp:
        paths = {n: traces.write(n, Path(tmp) / f"{n}.csv", args.days) for n in names}
        for entry in TRUTHS:
            truth = entry[0]
            for name in names:
                bounds = results[(truth, name)] = case(entry, name, paths[name])
                print(f"{truth:>13} {name:>13}: K1 reaching both {_ks(_reaching(bounds))}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(results, names, args.days), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
