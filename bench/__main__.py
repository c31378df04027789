"""Run specd's benchmarks: ``python -m bench [NAME [ARGS...]]``."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Sequence
from pathlib import Path

PREFIX = "bench_"


def available() -> list[str]:
    here = str(Path(__file__).resolve().parent)
    return sorted(
        info.name[len(PREFIX) :]
        for info in pkgutil.iter_modules([here])
        if info.name.startswith(PREFIX)
    )


def main(argv: Sequence[str]) -> int:
    names = available()
    if argv and argv[0] in ("-h", "--help"):
        print("usage: python -m bench [NAME [ARGS...]]\n\nbenchmarks:")
        for name in names:
            doc = importlib.import_module(f"bench.{PREFIX}{name}").__doc__ or ""
            print(f"  {name:<12} {doc.strip().splitlines()[0] if doc.strip() else ''}")
        return 0
    if argv:
        if argv[0] not in names:
            print(
                f"python -m bench: no benchmark {argv[0]!r} (have: {', '.join(names)})",
                file=sys.stderr,
            )
            return 2
        module = importlib.import_module(f"bench.{PREFIX}{argv[0]}")
        return int(module.run(list(argv[1:])))
    worst = 0
    for name in names:
        print(f"== {name}", flush=True)
        worst = max(worst, int(importlib.import_module(f"bench.{PREFIX}{name}").run([])))
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
