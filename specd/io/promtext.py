"""A fast, selective reader of the Prometheus text exposition format.

Parsing a whole SGLang page with prometheus_client takes tens of milliseconds, but
specd reads about ten of its ~90 families. This module picks out the sample lines
of the wanted metric names by prefix and parses only those, with the same value
and label semantics as ``prometheus_client.parser`` (the tests compare the two on
every fixture). It is stricter where the format allows no doubt: a duplicated
series, a missing final newline or a selected line that does not parse is an
error, never a guess. Sample lines must start in the first column, as every
exporter writes them (prometheus_client's parser would also accept indented ones).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

# name="value" with the format's three escapes (\\, \", \n) inside the value.
_LABEL_PAIR = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*')
_NAME_END = re.compile(r"[{ \t]")
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_ESCAPE = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}
_MAX_SHOWN = 80


class PromTextError(ValueError):
    """A page, or one of the selected lines in it, breaks the exposition format."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def _shown(line: str) -> str:
    return line if len(line) <= _MAX_SHOWN else line[: _MAX_SHOWN - 1] + "…"


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: _UNESCAPED[m.group(0)], value)


def _parse_value(token: str, line: str) -> float:
    # float() also takes "1_000"; the exposition format (and prometheus_client) do not.
    if "_" in token:
        raise PromTextError(f"bad value in line {_shown(line)!r}")
    try:
        return float(token)
    except ValueError:
        raise PromTextError(f"bad value in line {_shown(line)!r}") from None


def parse_sample_line(line: str, name: str) -> Sample:
    """Parse one sample line already known to start with ``name``."""
    pos = len(name)
    labels: dict[str, str] = {}
    if pos < len(line) and line[pos] == "{":
        pos += 1
        while True:
            while pos < len(line) and line[pos] in " \t":
                pos += 1
            if pos < len(line) and line[pos] == "}":
                pos += 1
                break
            match = _LABEL_PAIR.match(line, pos)
            if match is None:
                raise PromTextError(f"bad labels in line {_shown(line)!r}")
            key, raw = match.group(1), match.group(2)
            if key in labels:
                raise PromTextError(f"label {key!r} twice in line {_shown(line)!r}")
            labels[key] = _unescape(raw) if "\\" in raw else raw
            pos = match.end()
            if pos < len(line) and line[pos] == ",":
                pos += 1
            elif pos >= len(line) or line[pos] != "}":
                raise PromTextError(f"bad labels in line {_shown(line)!r}")
    tokens = line[pos:].split()
    # A value and at most a timestamp; the timestamp is checked but not used.
    if not tokens or len(tokens) > 2 or (pos < len(line) and line[pos] not in " \t"):
        raise PromTextError(f"bad sample line {_shown(line)!r}")
    value = _parse_value(tokens[0], line)
    if len(tokens) == 2:
        _parse_value(tokens[1], line)
    return Sample(name, labels, value)


def select_samples(
    text: str, names: Collection[str], *, max_samples: int | None = None
) -> dict[str, list[Sample]]:
    """Samples of the metric names in ``names`` (exact sample names, e.g. ``x_total``).

    Names absent from the page are absent from the result. Raises PromTextError on
    a page without its final newline (a truncated transfer), a selected line that
    does not parse, the same series twice, or more than ``max_samples`` selected
    samples (checked before the line past the bound is parsed, so a page of millions
    costs what the bound costs, not what the page does).
    """
    if text and not text.endswith("\n"):
        raise PromTextError("page does not end with a newline (truncated?)")
    prefixes = tuple(names)
    wanted = frozenset(names)
    found: dict[str, list[Sample]] = {}
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    for raw_line in text.split("\n"):
        if not raw_line.startswith(prefixes):
            continue
        line = raw_line.rstrip()
        # The name ends at the first '{' or blank; "foo_total" must not match "foo".
        name_end = _NAME_END.search(line)
        name = line if name_end is None else line[: name_end.start()]
        if name not in wanted:
            continue
        if max_samples is not None and len(seen) >= max_samples:
            raise PromTextError(f"more than {max_samples} series of the metrics read")
        sample = parse_sample_line(line, name)
        key = (name, frozenset(sample.labels.items()))
        if key in seen:
            raise PromTextError(f"duplicated series in line {_shown(line)!r}")
        seen.add(key)
        found.setdefault(name, []).append(sample)
    return found


def sample_names(text: str) -> set[str]:
    """The sample names a page shows (``x_total``, ``x_bucket``, ...), read from each
    sample line's first token only: a line of a family specd does not read may be anything
    (prometheus_client's parser raises on the whole page for one)."""
    names = set()
    for raw_line in text.split("\n"):
        if not raw_line or raw_line.startswith("#"):
            continue
        name_end = _NAME_END.search(raw_line)
        name = raw_line if name_end is None else raw_line[: name_end.start()]
        if _METRIC_NAME.fullmatch(name):
            names.add(name)
    return names
