"""specd's benchmarks: ``python -m bench`` runs them all, ``python -m bench NAME`` one.

Each benchmark is a module ``bench/bench_NAME.py`` exposing ``run(argv: list[str]) -> int``;
its docstring's first line is its description. Benchmarks report numbers, they do not
assert them: timings depend on the machine and belong in a report, not in a test.
"""
