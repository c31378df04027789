"""Decision cost, this tree against a base revision, side by side; write bench/results/decision.md.

``python -m bench decision`` exports the base revision (``--base``; default: where HEAD
forked from ``main``) into a temporary directory (``git archive``) and replays the same bench
cases (`bench.bench_replay`'s truths, traces, windows and config) with both trees' code, base
then this tree case by case, each case in a fresh process of its own, one at a time (no
``--jobs``: the two never compete for a core). Per case and tree it reports the decision
cost per tick in the deciding thread's CPU time (`time.thread_time` around `step`, measured
here the same way for both trees) and in wall time, the ratios new/base, and whether every
decision (time, target, reason) and the setting timeline are identical. ``--days N``
(default 2), ``--case TRUTH/TRACE/POLICY`` (repeatable; default: `CASES`).

``--instructions`` also runs each case's two replays under valgrind's callgrind, counting
only the instructions executed inside `step` (each call goes through `functools.reduce`,
whose C function callgrind toggles collection on): instructions per tick do not move with
how busy the machine is, as the timings do, so a change's ratio holds on a shared machine.
Valgrind runs the replay some 50 times slower: use it with ``--days 0.5`` and a case or two.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.bench_replay import DAYS, STATIC_POLICY, TRUTHS, check_days  # noqa: E402
from bench.child import export_revision, run_json, short_revision  # noqa: E402
from bench.traces import generate as traces  # noqa: E402
from specd.commands.args import quoted  # noqa: E402

RESULTS = REPO / "bench" / "results" / "decision.md"
# (truth, trace, policy): the costliest rows of bench/results/replay.md (choosing among
# kinds, a regression taken back, weekly rhythms) and plain ones.
CASES = (
    ("heavyoff", "day_night", "model"),
    ("heavyoff", "steady_heavy", "model"),
    ("heavyoff", "weekly", "model"),
    ("near cal 5+8%", "day_night", "model"),
    ("k5to2", "weekly", "model"),
    ("seed (twin)", "weekly", "model"),
    ("k6to1", "day_night", "model"),
    ("lowaccept", "steady_heavy", "model"),
)
POLICIES = ("model", "bands", STATIC_POLICY)
BUDGET_MS = 2.0

# The worker: run in a fresh interpreter with the tree to measure first on sys.path.
WORKER = r"""
import functools, gc, json, sys, time
tree, truth_name, trace_name, policy, trace_path = sys.argv[1:6]
sys.path.insert(0, tree)
from bench import bench_replay as b
import specd.tools.replay as R
assert R.__file__.startswith(tree), (R.__file__, tree)
original = R.step
cpu, wall = [], []
# Garbage collections that run inside a tick, and their CPU time: counted, they do not
# move with how busy this machine is, as the timings do.
inside, gc_runs, gc_cpu, gc_began = [False], [0], [0.0], [0.0]

def on_gc(phase, info):
    if not inside[0]:
        return
    if phase == "start":
        gc_began[0] = time.thread_time()
    else:
        gc_runs[0] += 1
        gc_cpu[0] += (time.thread_time() - gc_began[0]) * 1000

gc.callbacks.append(on_gc)

def measured(*args):
    began, began_cpu = time.perf_counter(), time.thread_time()
    inside[0] = True
    try:
        # Through a C function callgrind can toggle on (``--instructions``): one call.
        out = functools.reduce(lambda _a, _b: original(*args), (0,), None)
    finally:
        inside[0] = False
    cpu.append((time.thread_time() - began_cpu) * 1000)
    wall.append((time.perf_counter() - began) * 1000)
    return out

R.step = measured
results = []
replay = b.replay

def kept(*args, **kwargs):
    results.append(replay(*args, **kwargs))
    return results[-1]

b.replay = kept
truth = next(t for t in b.TRUTHS if t[0] == truth_name)
from pathlib import Path
b.run_one(truth, trace_name, Path(trace_path), policy)
result = results[-1]
print(json.dumps({
    "cpu": cpu, "wall": wall, "gc_runs": gc_runs[0], "gc_cpu_ms": gc_cpu[0],
    "decisions": result.decisions,
    "setting_timeline": result.setting_timeline,
    "specd_tokens": result.specd_tokens,
}))
"""


def _instructions(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Instructions per tick, base → new and their ratio; – when not counted."""
    if "instructions" not in old or not old["cpu"] or not new["cpu"]:
        return "–"
    per_old = old["instructions"] / len(old["cpu"])
    per_new = new["instructions"] / len(new["cpu"])
    return f"{per_old / 1000:.0f} k → {per_new / 1000:.0f} k, ×{per_new / per_old:.3f}"


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)
    return {
        "mean": sum(ordered) / n if n else 0.0,
        "p50": ordered[n // 2] if n else 0.0,
        "p99": ordered[int(0.99 * (n - 1))] if n else 0.0,
        "max": ordered[-1] if n else 0.0,
    }


# callgrind counting only inside `step` (the WORKER calls it through `functools.reduce`).
CALLGRIND = ("valgrind", "--tool=callgrind", "--collect-atstart=no")
TOGGLE = "--toggle-collect=functools_reduce*"


def _measure(
    tree: Path, case: tuple[str, str, str], trace: Path, counts: Path | None = None
) -> dict[str, Any]:
    """One tree's replay of ``case``; with ``counts`` (a callgrind output file to write),
    run under callgrind, and the instructions executed inside `step` as ``instructions``."""
    prefix = () if counts is None else (*CALLGRIND, TOGGLE, f"--callgrind-out-file={counts}")
    out: dict[str, Any] = run_json(
        tree, ["-c", WORKER, str(tree), *case, str(trace)], f"{tree} {case}", prefix
    )
    if counts is not None:
        out["instructions"] = callgrind_total(counts)
        if not out["instructions"]:
            raise RuntimeError(
                f"{tree} {case}: callgrind counted nothing inside functools_reduce "
                "(an interpreter without symbols?)"
            )
    return out


def callgrind_total(path: Path) -> int:
    """The instructions a callgrind output file counted (its ``summary:`` line)."""
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"{path}: no summary line (not a callgrind output file?)")


def _case(text: str) -> tuple[str, str, str]:
    """``TRUTH/TRACE/POLICY`` of a bench replay case (a truth may hold no slash)."""
    parts = tuple(text.split("/"))
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected TRUTH/TRACE/POLICY, got {quoted(text)}")
    truth, trace, policy = parts
    if truth not in {t[0] for t in TRUTHS}:
        raise argparse.ArgumentTypeError(f"no truth {quoted(truth)}")
    if trace not in traces.PATTERNS:
        raise argparse.ArgumentTypeError(
            f"no trace {quoted(trace)} (have: {', '.join(traces.PATTERNS)})"
        )
    if policy not in POLICIES:
        raise argparse.ArgumentTypeError(
            f"no policy {quoted(policy)} (have: {', '.join(POLICIES)})"
        )
    return truth, trace, policy


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench decision", description=__doc__)
    parser.add_argument(
        "--base", help="git revision to compare with (default: where HEAD forked from main)"
    )
    parser.add_argument("--days", type=DAYS, default=2.0, help=f"trace length ({DAYS.spec})")
    parser.add_argument(
        "--case", type=_case, action="append", help="TRUTH/TRACE/POLICY (repeatable)"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count the instructions inside each tick with valgrind (slow)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind on PATH")
    cases = args.case or list(CASES)
    check_days(parser, args.days, sorted({trace for _, trace, _ in cases}))
    if args.base is None:
        args.base = subprocess.run(
            ["git", "-C", str(REPO), "merge-base", "HEAD", "main"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    base_rev, head_rev = short_revision(args.base), short_revision("HEAD")
    rows: list[str] = []
    same_everywhere = True
    with tempfile.TemporaryDirectory(prefix="specd-decision-") as tmp:
        base = export_revision(args.base, Path(tmp) / "base")
        for case in cases:
            truth, trace_name, policy = case
            trace = traces.write(trace_name, Path(tmp) / f"{trace_name}.csv", args.days)
            counts = (Path(tmp) / "base.cg", Path(tmp) / "new.cg")
            old = _measure(base, case, trace, counts[0] if args.instructions else None)
            new = _measure(REPO, case, trace, counts[1] if args.instructions else None)
            same = all(old[k] == new[k] for k in ("decisions", "setting_timeline"))
            same_everywhere &= same
            oc, nc = _stats(old["cpu"]), _stats(new["cpu"])
            ow, nw = _stats(old["wall"]), _stats(new["wall"])
            # Under valgrind the timings are its own: no budget to judge them by.
            budget = (
                "– (valgrind)"
                if args.instructions
                else "PASS"
                if nc["p99"] <= BUDGET_MS
                else "FAIL"
            )
            line = (
                f"| {truth} | {trace_name} | {policy} | {len(new['cpu'])} "
                f"| {oc['mean']:.2f}/{oc['p99']:.2f} | {nc['mean']:.2f}/{nc['p99']:.2f} "
                f"| {nc['mean'] / oc['mean']:.2f} | {nc['p99'] / oc['p99']:.2f} "
                f"| {ow['p99']:.2f} | {nw['p99']:.2f} "
                f"| {old['gc_runs']} → {new['gc_runs']} "
                f"| {old['gc_cpu_ms']:.0f} → {new['gc_cpu_ms']:.0f} "
                f"| {_instructions(old, new)} "
                f"| {'yes' if same else 'NO'} "
                f"| {budget} |"
            )
            print(line, flush=True)
            rows.append(line)
    text = "\n".join(
        [
            "# specd decision cost: this tree against a base revision, side by side",
            "",
            f"Base `{args.base}` ({base_rev}) against HEAD {head_rev} (plus any uncommitted "
            f"change), {args.days:g}-day bench traces, each case replayed by both trees in "
            "fresh processes one after the other (base first), with bench/bench_replay.py's "
            "config. Decision cost per tick: `step` timed in the deciding thread's CPU time "
            "(`time.thread_time`) and in wall time, by the same code for both trees; ms "
            f"mean/p99. Budget: p99 CPU ≤ {BUDGET_MS:g} ms (issue 12). Garbage collections: "
            "the collector's runs inside ticks and their CPU ms in all (base → new); counts, "
            "they do not move with how busy the machine is, as the timings do. Same "
            "decisions: every decision (time, target, reason) and the setting timeline "
            "identical. Instructions per tick (`--instructions`): executed inside `step`, "
            "counted by valgrind's callgrind (under it the timings are valgrind's, not the "
            "machine's).",
            "",
            "Reproduce: `.venv/bin/python -m bench decision` (`--base REV`, `--days N`, "
            "`--case TRUTH/TRACE/POLICY`, `--instructions`).",
            "",
            "| truth | trace | policy | ticks | base CPU ms | new CPU ms | ×mean | ×p99 "
            "| base wall p99 | new wall p99 | gc runs in ticks | gc CPU ms in ticks "
            "| instructions per tick (base → new, ×) | same decisions | p99 CPU ≤ 2 ms |",
            "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|",
            *rows,
            "",
        ]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
