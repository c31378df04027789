"""The first epoch's bet: what any policy can still reach after it (bench/results/coldstart.md).

At the first window of a bench trace specd has seen only the hours before it, and the
setting it picks there runs until the next window opens: for the daily windows, Monday
03:00 to Tuesday 03:00, after three hours of traffic. ``python -m bench coldstart`` asks,
for each truth, trace and step count K1 that could run through that first epoch, how much
of issue 12's two token figures *any* policy choosing among the static step counts can
still reach, by an upper bound on its tokens (`upper_bound`), counted by the replay's own
`specd.tools.replay.Tokens` and window code on the same traces, truths and windows as
``python -m bench replay``:

* before the first window: the start K, as for everyone (nobody can choose there);
* every window's open hour: the best step count second by second (a policy may restart
  inside a window; no restart is charged anywhere);
* the rest of the first epoch: K1;
* the rest of every later epoch: the best fixed step count of that stretch in hindsight.

The denominators are the replay's exactly: the best static step count run from the first
window on (a restart charged if it differs from the start K) and the per-epoch oracle.
A policy that ran K1 through the first epoch serves at most the bound, so where the bound
is below a figure no policy reaches it with that K1. Where two traces looked alike before
their first window (`ALIKE`) and no K1 reaches a figure on both, no policy reaches it on
both without telling the two apart from those first hours.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
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
    WINDOWS,
)
from bench.traces import generate as traces  # noqa: E402
from specd.commands.replay import build_config  # noqa: E402
from specd.core.perftable import PerfTable  # noqa: E402
from specd.io.config import Config, Window  # noqa: E402
from specd.io.tables import read_table  # noqa: E402
from specd.tools.replay import DEFAULT_START, Tokens, Trace, load_trace, open_intervals  # noqa: E402

RESULTS = REPO / "bench" / "results" / "coldstart.md"
START_STEPS = 3  # the replay's start value
# Traces that show alike before their first window opens: three quiet hours of one to a few
# requests (weekly's nights are 1-4 concurrent, steady_low's 1-3).
ALIKE = (("weekly", "steady_low"),)


@dataclass(frozen=True)
class Bounds:
    """One truth and trace: the replay's denominators and each first-epoch K's bound."""

    static_tokens: dict[int, float]  # each K from the first window on, as the replay counts it
    oracle_tokens: float
    upper: dict[int, float]  # K1 → the most any static policy running it can serve
    seen_min: int  # offered concurrency seen before the first window
    seen_max: int
    seen_mean: float

    @property
    def best_static_tokens(self) -> float:
        return max(self.static_tokens.values())

    def to_best_static(self, k: int) -> float:
        return self.upper[k] / self.best_static_tokens

    def to_oracle(self, k: int) -> float:
        return self.upper[k] / self.oracle_tokens

    def reaching(self) -> list[int]:
        """The first-epoch step counts with which both figures stay within reach."""
        return [
            k
            for k in sorted(self.upper)
            if self.to_best_static(k) >= BEST_STATIC_MIN and self.to_oracle(k) >= ORACLE_MIN
        ]


def _best_each_second(tokens: Tokens, keys: Sequence[int], a: float, b: float) -> float:
    """Tokens of the best of ``keys`` in every run of the trace between ``a`` and ``b``."""
    t = tokens.trace.t
    if b <= a:
        return 0.0
    total = 0.0
    i = max(bisect.bisect_right(t, a) - 1, 0)
    while i < len(t) - 1 and t[i] < b:
        span = min(t[i + 1], b) - max(t[i], a)
        if span > 0:
            total += span * max(tokens.rate[k][i] for k in keys)
        i += 1
    return total


def upper_bound(
    trace: Trace,
    truth: PerfTable,
    opens: Sequence[tuple[float, float]],
    steps: Sequence[int],
    start_steps: int = START_STEPS,
    restart_s: float = RESTART_S,
) -> Bounds:
    """`Bounds` of ``trace`` (seconds from its start) under ``truth``, with the maintenance
    windows ``opens`` ((opened, closes) in trace seconds, in order, as
    `specd.tools.replay.open_intervals` gives them less the trace's start)."""
    tokens = Tokens(trace, truth, steps)
    first, last = trace.t[0], trace.t[-1]
    inside = [(max(a, first), min(b, last)) for a, b in opens if first < a < last]
    if not inside:
        raise ValueError("no window opens inside the trace: nothing to choose")
    o1 = inside[0][0]
    pre = tokens.between(start_steps, first, o1)
    # The replay's denominators (specd.tools.replay.replay): each static K from the first
    # opening on, restarting into it there unless it is the start K; the oracle's best
    # fixed K per epoch, charged no restart.
    static = {
        k: pre + tokens.between(k, o1 + (0.0 if k == start_steps else restart_s), last)
        for k in steps
    }
    edges = [a for a, _ in inside] + [last]
    epochs = list(itertools.pairwise(edges))
    oracle = pre + sum(max(tokens.between(k, a, b) for k in steps) for a, b in epochs)
    # Every epoch: its window's open stretch at the best K second by second, then (the
    # first epoch) K1 or (later ones) the best fixed K in hindsight.
    closes = [min(b, end) for (_, b), (_, end) in zip(inside, epochs, strict=True)]
    window_part = sum(
        _best_each_second(tokens, steps, a, c) for (a, _), c in zip(epochs, closes, strict=True)
    )
    later = sum(
        max(tokens.between(k, c, end) for k in steps)
        for (_, end), c in zip(epochs[1:], closes[1:], strict=True)
    )
    first_end = epochs[0][1]
    upper = {
        k1: pre + window_part + tokens.between(k1, closes[0], first_end) + later for k1 in steps
    }
    seen = [
        (lvl, min(t1, o1) - t0)
        for (t0, t1), lvl in zip(itertools.pairwise(trace.t), trace.level, strict=True)
        if t0 < o1
    ]
    seen_s = sum(s for _, s in seen)
    return Bounds(
        static_tokens=static,
        oracle_tokens=oracle,
        upper=upper,
        seen_min=min(lvl for lvl, _ in seen),
        seen_max=max(lvl for lvl, _ in seen),
        seen_mean=sum(lvl * s for lvl, s in seen) / seen_s if seen_s > 0 else 0.0,
    )


def case(truth_path: Path, trace_name: str, trace_path: Path) -> Bounds:
    """One bench case, with bench/bench_replay.py's windows, step counts and restart."""
    windows = [Window(cron=c, duration_s=d, timezone=z) for c, d, z in WINDOWS[trace_name]]
    config = build_config(Config(), window_list=windows, steps=STEPS, restart_s=RESTART_S)
    trace = load_trace(trace_path)
    t0 = DEFAULT_START.timestamp()
    opens = [(a - t0, b - t0) for a, b in open_intervals(config, t0 + trace.t[0], t0 + trace.t[-1])]
    steps = list(range(STEPS[0], STEPS[1] + 1))
    return upper_bound(trace, read_table(truth_path), opens, steps)


def _ks(ks: Sequence[int]) -> str:
    return ", ".join(map(str, ks)) if ks else "none"


def markdown(results: dict[tuple[str, str], Bounds], names: Sequence[str], days: float) -> str:
    truths = list(dict.fromkeys(t for t, _ in results))
    lines = [
        "# The first epoch's bet: what any static policy can still reach after it",
        "",
        f"{days:g}-day bench traces, the truths, windows, step counts {STEPS[0]}–{STEPS[1]}, "
        f"start K {START_STEPS} and {RESTART_S:g} s restart of `python -m bench replay`. For "
        "each step count K1 run through the first epoch (the first window's opening to the "
        "next one's), an upper bound on the tokens of any policy choosing among the static "
        "step counts: the start K before the first window (as everyone), every window's open "
        "stretch at the best K second by second, K1 for the rest of the first epoch, the best "
        "fixed K in hindsight for the rest of every later epoch, and no restart charged. "
        "Divided by the replay's own denominators (the best static step count from the first "
        "window on, the per-epoch oracle), it is the most any policy that ran K1 there can "
        f"reach of issue 12's figures (×best static ≥ {BEST_STATIC_MIN:g}, ×oracle ≥ "
        f"{ORACLE_MIN:g}).",
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
            on_a, on_b = results[(truth, a)].reaching(), results[(truth, b)].reaching()
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
            f"(mean {bounds.seen_mean:.1f}) | {cells} | {_ks(bounds.reaching())} |"
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
        for truth, truth_path, _ in TRUTHS:
            for name in names:
                bounds = results[(truth, name)] = case(truth_path, name, paths[name])
                print(f"{truth:>13} {name:>13}: K1 reaching both {_ks(bounds.reaching())}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(results, names, args.days), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
