"""Property-based tests of the /metrics parser (issue 6, bad input).

Valid pages: specd's fast selective parser (`specd.promtext`) reads exactly what
prometheus_client's full parser reads, and `parse_metrics` sums what it should. Garbage:
whatever the bytes, `parse_metrics` returns ParsedMetrics or ScrapeError and never raises.
"""

from __future__ import annotations

import contextlib
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from specd.core.observation import ScrapeError
from specd.io.promtext import PromTextError, select_samples
from specd.io.sglang import FAMILIES, QUEUED, RUNNING, ParsedMetrics, parse_metrics

# Noise names: other SGLang families, and names that merely start like a wanted one (the
# selector must not take `sglang:num_running_reqs_total` for `sglang:num_running_reqs`).
NOISE = (
    "sglang:cache_hit_rate",
    "sglang:num_running_reqs_total",
    "sglang:spec_accept_lengthx",
    "process_cpu_seconds_total",
    "sglang:num_queue_reqs_created",
)
LABEL_NAMES = ("dp_rank", "engine_type", "model_name", "is_streaming", "x", "_y")
# Characters that need escaping, that look like syntax, and some beyond ASCII.
LABEL_TEXT = st.text(alphabet=st.sampled_from('ab0 ,={}"\\\n\tµ✓#'), max_size=8)

settings.register_profile("specd", deadline=None, max_examples=150)
settings.load_profile("specd")


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@st.composite
def value_text(draw: st.DrawFn, non_negative: bool) -> tuple[str, float]:
    """A sample value as an exporter might spell it, and the float it means."""
    if draw(st.booleans()):
        number = float(
            draw(st.integers(min_value=0 if non_negative else -(10**12), max_value=10**12))
        )
        spelling = draw(st.sampled_from(["{:d}", "{:.1f}", "{:e}"]))
        text = spelling.format(int(number)) if spelling == "{:d}" else spelling.format(number)
        return text, float(text)
    # Up to 1e300 (overflowing sums are covered by their own test below).
    number = draw(
        st.floats(
            min_value=0.0 if non_negative else -1e300,
            max_value=1e300,
            allow_nan=False,
            allow_infinity=False,
        )
    )
    return repr(number), number


@st.composite
def exposition(
    draw: st.DrawFn, non_negative: bool = False
) -> tuple[str, dict[str, list[tuple[dict[str, str], float]]]]:
    """A valid page, and the samples of specd's families in it."""
    names = draw(st.lists(st.sampled_from(FAMILIES + NOISE), min_size=1, max_size=8, unique=True))
    lines: list[str] = []
    expected: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name in names:
        if draw(st.booleans()) and not name.endswith(("_total", "_created")):
            lines.append(f"# HELP {name} {escape(draw(LABEL_TEXT))}")
            lines.append(f"# TYPE {name} gauge")
        label_sets = draw(
            st.lists(
                st.dictionaries(st.sampled_from(LABEL_NAMES), LABEL_TEXT, max_size=3),
                min_size=1,
                max_size=4,
                unique_by=lambda d: frozenset(d.items()),
            )
        )
        for labels in label_sets:
            text, number = draw(value_text(non_negative))
            pairs = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
            if draw(st.booleans()) and labels:
                pairs += ","  # a trailing comma is allowed
            braces = bool(labels) or draw(st.booleans())  # `name{} 1` is valid too
            shown = f"{name}{{{pairs}}}" if braces else name
            stamp = f" {draw(st.integers(0, 2**41))}" if draw(st.booleans()) else ""
            lines.append(f"{shown} {text}{stamp}")
            if name in FAMILIES:
                expected.setdefault(name, []).append((labels, number))
        if draw(st.booleans()):
            lines.append("")  # blank lines are allowed between families
    return "\n".join(lines) + "\n", expected


def as_set(
    samples: dict[str, list[tuple[dict[str, str], float]]],
) -> set[tuple[str, frozenset[tuple[str, str]], float]]:
    return {(n, frozenset(labels.items()), v) for n, rows in samples.items() for labels, v in rows}


@given(exposition())
def test_fast_parser_reads_what_prometheus_client_reads(
    page: tuple[str, dict[str, list[tuple[dict[str, str], float]]]],
) -> None:
    text, expected = page
    ours = {
        name: [(dict(s.labels), s.value) for s in samples]
        for name, samples in select_samples(text, FAMILIES).items()
    }
    theirs: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in FAMILIES:
                theirs.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    assert as_set(ours) == as_set(theirs) == as_set(expected)


@st.composite
def sglang_page(draw: st.DrawFn) -> tuple[str, list[tuple[int, int]]]:
    """A page with one scheduler series per DP rank, and (running, queued) per rank."""
    ranks = draw(
        st.lists(st.tuples(st.integers(0, 500), st.integers(0, 500)), min_size=1, max_size=8)
    )
    extra, _ = draw(exposition(non_negative=True))
    # Extra families must not repeat the two this page defines per rank.
    kept = [
        line
        for line in extra.splitlines()
        if not line.startswith((RUNNING + " ", RUNNING + "{", QUEUED + " ", QUEUED + "{"))
    ]
    lines = list(kept)
    for rank, (running, queued) in enumerate(ranks):
        labels = f'dp_rank="{rank}",engine_type="unified",tp_rank="0"'
        lines.append(f"{RUNNING}{{{labels}}} {float(running)}")
        lines.append(f"{QUEUED}{{{labels}}} {queued}")
    return "\n".join(lines) + "\n", ranks


@given(sglang_page())
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_running_and_queued_are_summed_across_dp_ranks(
    page: tuple[str, list[tuple[int, int]]],
) -> None:
    text, ranks = page
    parsed = parse_metrics(text, t=1.0)
    if isinstance(parsed, ScrapeError):
        # Only the extra families can make a valid page unusable: a fractional step count.
        assert parsed.kind == "malformed", parsed
        assert "not whole" in parsed.reason, parsed
        return
    assert parsed.running == sum(r for r, _ in ranks)
    assert parsed.queued == sum(q for _, q in ranks)
    assert parsed.dp_ranks == len(ranks)


def mutate(text: str, edits: list[tuple[int, int, str]]) -> str:
    for position, delete, insert in edits:
        at = position % (len(text) + 1)
        text = text[:at] + insert + text[at + delete :]
    return text


GARBAGE_CHARS = st.text(alphabet=st.sampled_from('{}",=\\\n #\x00 e+-.9Naf_:µ'), max_size=6)


@given(
    exposition(),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 5), GARBAGE_CHARS), max_size=6),
)
def test_a_damaged_page_never_raises(
    page: tuple[str, dict[str, list[tuple[dict[str, str], float]]]],
    edits: list[tuple[int, int, str]],
) -> None:
    text = mutate(page[0], edits)
    result = parse_metrics(text, t=2.0)
    assert isinstance(result, ParsedMetrics | ScrapeError)
    if isinstance(result, ScrapeError):
        assert result.kind in ("malformed", "missing")
        assert "\n" not in result.reason
        assert result.t == 2.0
    else:
        assert result.running >= 0
        assert result.queued >= 0
        assert result.accept_length is None or math.isfinite(result.accept_length)
    with contextlib.suppress(PromTextError):  # the one exception it may raise, by contract
        select_samples(text, FAMILIES)


@given(st.text(max_size=400))
def test_arbitrary_text_never_raises(text: str) -> None:
    result = parse_metrics(text, t=3.0)
    assert isinstance(result, ParsedMetrics | ScrapeError)
    if isinstance(result, ScrapeError):
        assert "\n" not in result.reason


@pytest.mark.parametrize("family", ["sglang:spec_accept_length", "sglang:token_usage"])
def test_values_near_the_float_limit_are_an_error_not_an_exception(family: str) -> None:
    text = (
        f'{family}{{dp_rank="0"}} 1.7e308\n{family}{{dp_rank="1"}} 1.7e308\n'
        'sglang:num_running_reqs{dp_rank="0"} 0\nsglang:num_queue_reqs{dp_rank="0"} 0\n'
    )
    result = parse_metrics(text, t=4.0)
    assert isinstance(result, ScrapeError)
    assert (result.kind, result.t) == ("malformed", 4.0)
