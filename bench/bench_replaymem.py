"""Peak memory of ``specd replay`` per million trace rows: a base revision against this tree.

``python -m bench replaymem`` writes, for each row count, the worst trace for replay's
memory — 1-second rows whose concurrency changes at every row (1-48, seeded), so every row
is a run of its own — and replays it with bench truth k5to2 and its calibration, ``--steps
1-6`` and a daily window, once with a base revision's code and once with this tree's
(uncommitted changes included), one child process at a time. Each child's peak resident
memory is its own ``ru_maxrss`` (`os.wait4`). The two trees' JSON must agree on every
figure but the decision timings: a memory cut may not move a token or a decision.

``--rows M,M,...`` (millions of rows, default 0.6,2.4), ``--base REV`` (default HEAD),
``--out FILE`` writes the report too. A row count the base refuses (over its cap) shows as
refused. Each replay takes ~15 s a million rows; a base from before replay kept the trace
in arrays (c3207aa) takes ~0.7 GB a million rows: 10 million need 7 GB free.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.child import export_revision, short_revision  # noqa: E402
from specd.commands.args import quoted  # noqa: E402

TRUTH = REPO / "bench" / "truth" / "k5to2.csv"
CALIBRATION = REPO / "bench" / "truth" / "k5to2-calibration.csv"
WINDOW = "0 7 * * mon-sun;3600;UTC"
# Figures that measure the machine, not the replay: they may differ between trees.
TIMINGS = frozenset(
    f"decision_{clock}ms_{stat}" for clock in ("", "cpu_") for stat in ("mean", "p99", "max")
)
SEED = 48
MAX_MILLIONS = 20.0
# The child: the tree to measure first on the path, `specd replay` as the command runs it.
CHILD = "import sys; from specd.cli import main; sys.exit(main(sys.argv[1:]))"


def write_churn(path: Path, rows: int) -> Path:
    """``rows`` 1-second rows of concurrency 1-48 changing at every row."""
    rng = random.Random(SEED)
    level = 0
    with path.open("w", encoding="utf-8") as out:
        out.write("t_s,concurrency\n")
        chunk: list[str] = []
        for t in range(rows):
            nxt = rng.randint(1, 47)
            level = nxt if nxt < level else nxt + 1  # never the previous level
            chunk.append(f"{t},{level}\n")
            if len(chunk) >= 65536:
                out.writelines(chunk)
                chunk.clear()
        out.writelines(chunk)
    return path


def measure(tree: Path, trace: Path) -> tuple[int, float, dict[str, Any] | str]:
    """(peak RSS bytes, wall seconds, the JSON or the first error line) of one replay."""
    argv = [
        sys.executable,
        "-c",
        CHILD,
        "replay",
        "--trace",
        str(trace),
        "--truth",
        str(TRUTH),
        "--calibration",
        str(CALIBRATION),
        "--steps",
        "1-6",
        "--window",
        WINDOW,
        "--json",
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        began = time.monotonic()
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - began
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    peak = usage.ru_maxrss * 1024  # KiB on Linux
    if proc.returncode != 0:
        lines = stderr.strip().splitlines()
        return peak, wall, lines[-1] if lines else f"exit {proc.returncode}"
    data: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return peak, wall, data


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def _differs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in TIMINGS and a.get(k) != b.get(k))


def millions(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{quoted(text)}: expected millions of rows, e.g. 0.6,2.4"
        ) from None
    if not values or any(not 0 < v <= MAX_MILLIONS for v in values):
        raise argparse.ArgumentTypeError(
            f"{quoted(text)}: each count in (0, {MAX_MILLIONS:g}] millions"
        )
    return values


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench replaymem", description=__doc__)
    parser.add_argument("--rows", type=millions, default=[0.6, 2.4], help="millions, e.g. 0.6,10")
    parser.add_argument("--base", default="HEAD", help="git revision to compare with")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    lines = [
        f"Peak RSS of `specd replay`, base `{args.base}` ({short_revision(args.base)}) against "
        f"this tree (HEAD {short_revision('HEAD')} plus any uncommitted change): worst-case "
        "traces (1-second rows, concurrency changing every row), truth k5to2 with its "
        f"calibration, --steps 1-6, window '{WINDOW}'; one child at a time.",
        "",
        "| rows | trace MiB | base peak MiB | tree peak MiB | base MiB / M rows "
        "| tree MiB / M rows | base s | tree s | same figures |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    failed = False
    with tempfile.TemporaryDirectory(prefix="specd-replaymem-") as tmp:
        base_tree = export_revision(args.base, Path(tmp) / "base")
        for m in args.rows:
            rows = round(m * 1_000_000)
            trace = write_churn(Path(tmp) / f"churn-{rows}.csv", rows)
            size = trace.stat().st_size
            cells: list[str] = []
            results: list[dict[str, Any] | str] = []
            for tree in (base_tree, REPO):
                peak, wall, result = measure(tree, trace)
                results.append(result)
                cells.append(f"refused ({_mib(peak)})" if isinstance(result, str) else _mib(peak))
                cells.append(f"{peak / 2**20 / m:,.0f}" if not isinstance(result, str) else "—")
                cells.append(f"{wall:.0f}")
                print(f"{rows} rows, {tree}: {_mib(peak)} MiB, {wall:.0f} s", file=sys.stderr)
                if isinstance(result, str):
                    print(f"  {result}", file=sys.stderr)
            base, new = results
            if isinstance(new, str):
                same = "tree failed: " + new[:80]
                failed = True
            elif isinstance(base, str):
                same = "—"
            else:
                diff = _differs(base, new)
                same = "yes" if not diff else "NO: " + ", ".join(diff)
                failed = failed or bool(diff)
            lines.append(
                f"| {rows:,} | {_mib(size)} | {cells[0]} | {cells[3]} | {cells[1]} | {cells[4]} "
                f"| {cells[2]} | {cells[5]} | {same} |"
            )
            trace.unlink()
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if args.out is not None:
        args.out.write_text(report, encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
