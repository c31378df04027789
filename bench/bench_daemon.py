"""Daemon overhead: CPU ms per tick and RSS, for one and eight DP ranks, side by side.

Each case runs in a fresh child process (so RSS is that configuration's alone): a real
``Daemon`` scraping a real twin over loopback HTTP, ticking back to back after a few
warm-up ticks. CPU is the daemon process's own (``time.process_time``: the twin is another
process); wall is the tick as the loop sees it. Nothing is restarted: the history is too
young for a decision, which is the steady state between windows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.child import export_revision, run_json  # noqa: E402
from specd.commands.args import Int  # noqa: E402

CASES: tuple[tuple[str, int, int], ...] = (
    # (label, DP ranks, /metrics padding bytes)
    ("1 DP rank", 1, 0),
    ("8 DP ranks", 8, 0),
    ("8 DP ranks + 5 MB page", 8, 5_000_000),
)
WARMUP_TICKS = 5


@dataclass(frozen=True)
class Row:
    case: str
    dp_ranks: int
    page_kbytes: float
    ticks: int
    cpu_ms_per_tick: float  # median
    wall_ms_per_tick: float  # median
    rss_mib: float  # after the ticks
    peak_rss_mib: float


def _status_kib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    return float("nan")


def measure_one(label: str, dp: int, pad: int, ticks: int) -> Row:
    """One case, in this process: a twin child process and an in-process Daemon."""
    # Imported here: the parent process only orchestrates and must stay small.
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from specd.daemon import Daemon  # noqa: PLC0415
    from specd.io import logs  # noqa: PLC0415
    from specd.io.config import Config  # noqa: PLC0415
    from specd.io.notify import Notifier  # noqa: PLC0415
    from specd.io.runner import RunResult  # noqa: PLC0415
    from specd.io.sglang import SGLangClient  # noqa: PLC0415
    from specd.twin.process import TwinProcess  # noqa: PLC0415

    def refuse(argv: Sequence[str], *, timeout_s: float) -> RunResult:
        return RunResult(tuple(argv), 1, "", "benchmark: no restarts", False, 0.0)

    twin_args = [
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
        "--enable-metrics", "--load-time-s", "0.2", "--warmup-s", "0.1",
        "--dp-size", str(dp), "--metrics-pad-bytes", str(pad),
    ]  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="specd-bench-") as tmp,
        open(os.devnull, "w") as devnull,
        TwinProcess(twin_args) as twin,
    ):
        twin.wait_healthy()
        logs.configure("json", stream=devnull)
        config = Config(
            sglang={"url": twin.url, "env_file": Path(tmp) / "sglang.env"},
            files={"state_dir": Path(tmp), "override_file": Path(tmp) / "override.toml"},
            report={"metrics_port": 0},
        )
        daemon = Daemon(
            config,
            None,
            registry=CollectorRegistry(),
            runner=refuse,
            notifier=Notifier(environ={}),
        )
        for _ in range(WARMUP_TICKS):
            daemon.tick()
        cpu: list[float] = []
        wall: list[float] = []
        for _ in range(ticks):
            c0, w0 = time.process_time(), time.perf_counter()
            daemon.tick()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        assert isinstance(daemon.client, SGLangClient)
        page = daemon.client.metrics_text()
        obs = daemon.last_obs
        if obs is None or obs.dp_ranks != dp or not isinstance(page, str):
            raise RuntimeError(f"{label}: the daemon did not observe the twin ({obs})")
        daemon.client.close()
    return Row(
        case=label,
        dp_ranks=dp,
        page_kbytes=round(len(page) / 1024, 1),
        ticks=ticks,
        cpu_ms_per_tick=round(statistics.median(cpu) * 1000, 2),
        wall_ms_per_tick=round(statistics.median(wall) * 1000, 2),
        rss_mib=round(_status_kib("VmRSS") / 1024, 1),
        peak_rss_mib=round(_status_kib("VmHWM") / 1024, 1),
    )


def measure_in(tree: Path, label: str, ticks: int) -> Row:
    """One case in a child process running ``tree``'s own code (its bench and its specd)."""
    argv = ["-m", "bench", "daemon", "--one", label, "--ticks", str(ticks)]
    return Row(**run_json(tree, argv, f"{tree.name}: {label}"))


def measure(ticks: int) -> list[Row]:
    return [measure_in(REPO, label, ticks) for label, _dp, _pad in CASES]


def compare(rev: str, ticks: int, rounds: int) -> str:
    """This tree against ``rev`` side by side: cases interleaved, ``rounds`` times each,
    medians; the ratio is this tree's CPU per tick over ``rev``'s."""
    with tempfile.TemporaryDirectory(prefix="specd-bench-rev-") as tmp:
        old_tree = export_revision(rev, Path(tmp))
        new: dict[str, list[float]] = {label: [] for label, _, _ in CASES}
        old: dict[str, list[float]] = {label: [] for label, _, _ in CASES}
        for _ in range(rounds):
            for label, _dp, _pad in CASES:
                new[label].append(measure_in(REPO, label, ticks).cpu_ms_per_tick)
                old[label].append(measure_in(old_tree, label, ticks).cpu_ms_per_tick)
    head = f"{'case':<24} {rev[:12]:>14} {'this tree':>12} {'ratio':>7}"
    lines = [head, "-" * len(head)]
    for label, _dp, _pad in CASES:
        a, b = statistics.median(old[label]), statistics.median(new[label])
        lines.append(f"{label:<24} {a:>11.2f} ms {b:>9.2f} ms {b / a:>7.2f}")
    lines.append(
        f"(CPU ms per tick, median of {rounds} interleaved runs of {ticks} ticks each; "
        "ratio < 1: this tree is cheaper)"
    )
    return "\n".join(lines)


def report(rows: list[Row]) -> str:
    base = rows[0]
    head = (
        f"{'case':<24} {'page KB':>8} {'CPU ms/tick':>12} {'× 1 rank':>9} "
        f"{'wall ms/tick':>13} {'RSS MiB':>8} {'× 1 rank':>9} {'peak MiB':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.case:<24} {r.page_kbytes:>8.0f} {r.cpu_ms_per_tick:>12.2f} "
            f"{r.cpu_ms_per_tick / base.cpu_ms_per_tick:>9.2f} {r.wall_ms_per_tick:>13.2f} "
            f"{r.rss_mib:>8.1f} {r.rss_mib / base.rss_mib:>9.2f} {r.peak_rss_mib:>9.1f}"
        )
    lines.append(f"(median of {rows[0].ticks} ticks after {WARMUP_TICKS} warm-up ticks)")
    return "\n".join(lines)


TICKS = Int(1, 100_000)
ROUNDS = Int(1, 100)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench daemon", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--ticks", type=TICKS, default=40, help=f"measured ticks per case ({TICKS.spec})"
    )
    parser.add_argument("--quick", action="store_true", help="10 ticks per case")
    parser.add_argument("--one", choices=[c[0] for c in CASES], help=argparse.SUPPRESS)
    parser.add_argument(
        "--against",
        metavar="REV",
        help="also run git revision REV's own code in the same run; print CPU ratios",
    )
    parser.add_argument(
        "--rounds", type=ROUNDS, default=3, help=f"interleaved rounds (--against; {ROUNDS.spec})"
    )
    args = parser.parse_args(argv)
    ticks = 10 if args.quick else args.ticks
    if args.one is not None:
        label, dp, pad = next(c for c in CASES if c[0] == args.one)
        print(json.dumps(asdict(measure_one(label, dp, pad, ticks))))
        return 0
    try:
        if args.against:
            print(compare(args.against, ticks, args.rounds))
            return 0
        rows = measure(ticks)
    except RuntimeError as exc:
        print(f"python -m bench daemon: {exc}", file=sys.stderr)
        return 1
    print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else report(rows))
    return 0
