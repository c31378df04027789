"""A policy change's effect on every bench case's tokens: a base revision against this tree.

``python -m bench tokens`` replays every model-policy case of `bench.bench_replay` (its
truths, traces, windows and config; ``model static`` where it runs that) once with a base
revision's code and once with this tree's, uncommitted changes included, each case and tree
in a fresh process of its own. Per case it reports whether specd's tokens moved, their ratio
new/base, and issue 12's token figures (×oracle, ×best static, ×adaptive) before and after;
above them, how many cases meet each figure with either tree. The comparisons' tokens (each
static K, the oracle, SGLang adaptive) do not depend on specd's code, so a figure moves
only with specd's tokens. Token counts do not move with how busy the machine is: cases run
side by side (``--jobs``).

``--base REV`` (default HEAD: the working tree's uncommitted change against its commit),
``--days N`` (7), ``--jobs N`` (2), ``--truth NAME`` and ``--only TRACE`` as in ``python -m
bench replay``, ``--out FILE`` writes the report too. ``--adaptive-loss R`` makes every
adaptive setting serve R less than the truth's best candidate per batch (SGLang's switching
and its extra graphs' memory, which no calibration shows; both trees' replay must know the
option). ``--swept-sets`` gives both trees each truth's calibration with the rows ``specd
sweep --adaptive`` would add for the default adaptive sets in the same sweep
(`swept_calibrations`: on the machine the calibration measured, each set served as its
best candidate per batch less the adaptive loss, with a static row's noise); a tree whose
model does not read them runs as without. Every case on
2 cores: about 8 minutes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.bench_replay import (  # noqa: E402
    ADAPTIVE_MIN,
    BEST_STATIC_MIN,
    DAYS,
    JOBS,
    ORACLE_MIN,
    STATIC_POLICY,
    STATIC_TRUTHS,
    TRUTHS,
    check_days,
)
from bench.child import export_revision, run_json, short_revision  # noqa: E402
from bench.traces import generate as traces  # noqa: E402
from bench.truth.generate import sweep_sets  # noqa: E402
from specd.commands.replay import ADAPTIVE_LOSS  # noqa: E402
from specd.core.settings import DEFAULT_ADAPTIVE_SETS  # noqa: E402
from specd.io.tables import read_table, write_table  # noqa: E402

Case = tuple[str, str, str]  # truth, trace, policy
# The token figures: (name, the result's key, the least that meets it).
FIGURES = (
    ("×oracle", "ratio_to_oracle", ORACLE_MIN),
    ("×best static", "ratio_to_best_static", BEST_STATIC_MIN),
    ("×adaptive", "ratio_to_adaptive", ADAPTIVE_MIN),
)

# The worker: one case, in a fresh interpreter with the tree to measure first on sys.path.
WORKER = r"""
import json, sys
tree, truth_name, trace_name, policy, trace_path, loss, calibration = sys.argv[1:8]
sys.path.insert(0, tree)
from pathlib import Path
from bench import bench_replay as b
assert b.__file__.startswith(tree), (b.__file__, tree)
truth = next((t for t in b.TRUTHS if t[0] == truth_name), None)
if truth is not None and calibration:
    truth = (truth[0], truth[1], Path(calibration))  # the sets swept (--swept-sets)
# An older tree may name its policies otherwise (before "model static": "model+kinds").
static = getattr(b, "STATIC_POLICY", None)
runs = policy == "model" or (policy == static and truth_name in b.STATIC_TRUTHS)
if truth is None or not runs:
    print("null")  # a case this tree's bench does not run
    sys.exit()
# Only a tree whose replay knows the adaptive loss is asked for it (0: the default).
extra = {"adaptive_loss_ratio": float(loss)} if float(loss) else {}
r = b.run_one(truth, trace_name, Path(trace_path), policy, **extra).result
keys = ("specd_tokens", "ratio_to_oracle", "ratio_to_best_static", "ratio_to_adaptive")
print(json.dumps({**{k: r[k] for k in keys}, "steps": b._steps_path(r)}))
"""


def cases(truth: str | None, only: str | None) -> list[Case]:
    names = [only] if only else list(traces.PATTERNS)
    out: list[Case] = []
    for name in names:
        for t, _, _ in TRUTHS:
            if truth in (None, t):
                out.append((t, name, "model"))
                if t in STATIC_TRUTHS:
                    out.append((t, name, STATIC_POLICY))
    return out


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def report(
    base: Mapping[Case, Mapping[str, Any]], new: Mapping[Case, Mapping[str, Any]]
) -> list[str]:
    """The comparison's markdown lines: how many cases meet each figure with either tree,
    then every case whose tokens moved."""
    both = [case for case in base if case in new]
    same = sum(1 for case in both if base[case]["specd_tokens"] == new[case]["specd_tokens"])
    lines = [f"specd's tokens identical in {same} of {len(both)} cases."]
    for side, name in ((base, "base"), (new, "this tree")):
        alone = [c for c in side if c not in both]
        if alone:
            lines.append(f"Only {name} runs: " + "; ".join("/".join(c) for c in alone) + ".")
    lines += [
        "",
        "| figure | cases meeting it, base | this tree |",
        "|---|--:|--:|",
    ]
    for name, key, least in FIGURES:
        counted = [c for c in both if base[c][key] is not None and new[c][key] is not None]
        met = [sum(1 for c in counted if side[c][key] >= least) for side in (base, new)]
        lines.append(
            f"| {name} ≥ {least:g} | {met[0]} of {len(counted)} | {met[1]} of {len(counted)} |"
        )
    moved = [c for c in both if base[c]["specd_tokens"] != new[c]["specd_tokens"]]
    if moved:
        lines += [
            "",
            "| truth | trace | policy | tokens new/base | "
            + " | ".join(f"{name} base → new" for name, _, _ in FIGURES)
            + " | steps base → new |",
            "|---|---|---|--:|" + "---|" * len(FIGURES) + "---|",
        ]
        for c in moved:
            old, now = base[c], new[c]
            cells = " | ".join(f"{_ratio(old[key])} → {_ratio(now[key])}" for _, key, _ in FIGURES)
            lines.append(
                f"| {c[0]} | {c[1]} | {c[2]} "
                f"| ×{now['specd_tokens'] / old['specd_tokens']:.4f} | {cells} "
                f"| {old['steps']} → {now['steps']} |"
            )
    return lines


def _one(
    tree: Path, case: Case, trace: Path, loss: float, calibration: Path | None
) -> dict[str, Any] | None:
    """One case replayed by ``tree`` (with ``calibration`` in place of its truth's); None
    where that tree's bench does not run it."""
    argv = [str(tree), *case, str(trace), repr(loss), str(calibration or "")]
    out: dict[str, Any] | None = run_json(tree, ["-c", WORKER, *argv], f"{tree} {'/'.join(case)}")
    return out


def swept_calibrations(into: Path, names: set[str], loss: float) -> dict[str, Path]:
    """Per truth of ``names``, its calibration with the default adaptive sets swept in the
    same sweep (`bench.truth.generate.sweep_sets`), written under ``into``: on the machine
    the calibration measured, the first truth it is the calibration of (lowaccept's is the
    seed's: a greedy benchmark, which measures its sets as greedily)."""
    swept_on = {calibration: truth for _, truth, calibration in reversed(TRUTHS)}
    out: dict[str, Path] = {}
    for i, (name, _, calibration) in enumerate(TRUTHS):
        if name not in names:
            continue
        table = sweep_sets(
            read_table(swept_on[calibration]),
            read_table(calibration),
            DEFAULT_ADAPTIVE_SETS,
            loss,
            100 + i,
        )
        out[name] = into / f"swept-{i}.csv"
        write_table(out[name], table)
    return out


def compare(
    base_tree: Path,
    new_tree: Path,
    todo: list[Case],
    days: float,
    jobs: int,
    adaptive_loss: float = 0.0,
    swept_sets: bool = False,
) -> tuple[dict[Case, dict[str, Any]], dict[Case, dict[str, Any]]]:
    """Each case of ``todo`` replayed by both trees on ``days``-day traces, ``jobs`` at a
    time, every adaptive setting serving ``adaptive_loss`` less than the truth's best
    candidate per batch (`specd.tools.replay.replay`), with ``swept_sets`` the default
    sets swept into each calibration (`swept_calibrations`): (the base tree's results,
    the new tree's), by case."""
    with tempfile.TemporaryDirectory(prefix="specd-tokens-traces-") as tmp:
        paths = {
            name: traces.write(name, Path(tmp) / f"{name}.csv", days)
            for name in sorted({c[1] for c in todo})
        }
        cals = (
            swept_calibrations(Path(tmp), {c[0] for c in todo}, adaptive_loss) if swept_sets else {}
        )
        # Each case once per tree: a tree compared with itself replays it once, the very
        # result both sides read.
        runs = list(dict.fromkeys((tree, c) for c in todo for tree in (base_tree, new_tree)))

        def one(job: tuple[Path, Case]) -> dict[str, Any] | None:
            tree, case = job
            return _one(tree, case, paths[case[1]], adaptive_loss, cals.get(case[0]))

        with ThreadPoolExecutor(jobs) as pool:
            done = list(pool.map(one, runs))
    results = dict(zip(runs, done, strict=True))

    def ran(tree: Path) -> dict[Case, dict[str, Any]]:
        return {c: r for c in todo if (r := results[(tree, c)]) is not None}

    return ran(base_tree), ran(new_tree)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench tokens", description=__doc__)
    parser.add_argument("--base", default="HEAD", help="git revision to compare with")
    parser.add_argument("--days", type=DAYS, default=7.0, help=f"trace length ({DAYS.spec})")
    parser.add_argument("--jobs", type=JOBS, default=2, help=f"processes ({JOBS.spec})")
    parser.add_argument("--truth", choices=[t[0] for t in TRUTHS], help="one truth only")
    parser.add_argument("--only", choices=sorted(traces.PATTERNS), help="one trace only")
    parser.add_argument("--out", type=Path, help="also write the report here")
    parser.add_argument(
        "--adaptive-loss",
        type=ADAPTIVE_LOSS,
        default=0.0,
        help="share of tokens every adaptive setting serves less than the truth's best "
        f"candidate of each batch's slot ({ADAPTIVE_LOSS.spec}; default 0; both trees' "
        "replay must know it)",
    )
    parser.add_argument(
        "--swept-sets",
        action="store_true",
        help="give both trees each calibration with the default adaptive sets swept in the "
        "same sweep (served less by --adaptive-loss, a static row's noise)",
    )
    args = parser.parse_args(argv)
    check_days(parser, args.days, [args.only] if args.only else list(traces.PATTERNS))
    todo = cases(args.truth, args.only)
    with tempfile.TemporaryDirectory(prefix="specd-tokens-") as tmp:
        base_tree = export_revision(args.base, Path(tmp) / "base")
        base, new = compare(
            base_tree, REPO, todo, args.days, args.jobs, args.adaptive_loss, args.swept_sets
        )
    lines = [
        "# specd's tokens: a base revision against this tree, side by side",
        "",
        f"Base `{args.base}` ({short_revision(args.base)}) against this tree (HEAD "
        f"{short_revision('HEAD')} plus any uncommitted change), {args.days:g}-day bench "
        "traces, bench/bench_replay.py's truths, windows and config, each case and tree in a "
        "fresh process."
        + (
            f" Every adaptive setting (specd's and SGLang's default alike) serves "
            f"{args.adaptive_loss:.1%} less than the truth's best candidate of each batch's "
            "slot, which no calibration says (`--adaptive-loss`)."
            if args.adaptive_loss
            else ""
        )
        + (
            " Each calibration also has the rows `specd sweep --adaptive` would add for the "
            "default adaptive sets, measured on the machine it measured, as they serve "
            "(`--swept-sets`)."
            if args.swept_sets
            else ""
        ),
        "",
        *report(base, new),
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
