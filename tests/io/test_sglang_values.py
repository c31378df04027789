"""Values SGLang cannot produce, served over real HTTP: rejected field by field, never learned.

A negative capacity or step count in /server_info, an accept length past steps + 1, a
throughput of 1e300: each becomes unknown in the Observation and is named in ``rejected``;
the rest of the scrape stands, and the history never sees the value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import make_fixtures_module, make_observation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pages import PageServer, page_server

from specd.core.history import History, HistorySettings, Recorded
from specd.core.observation import (
    MAX_STEPS,
    Observation,
    ScrapeError,
    accept_length_possible,
    impossible_fields,
    without_impossible,
)
from specd.io.sglang import SGLangClient

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


mf = make_fixtures_module()
BASE = mf.base_page()  # 0.5.23 under load: 13 running, 4 steps, accept length 3.61
OLD = (FIXTURES / "pre-0.5.13.prom").read_text()  # no spec_num_steps gauge
LOADED: dict[str, Any] = json.loads((FIXTURES / "server_info-loaded.json").read_text())


def info(**changes: Any) -> dict[str, Any]:
    return {**LOADED, **changes}


def page(text: str = BASE, **values: float) -> str:
    return mf.set_values(text, {f"sglang:{name}": value for name, value in values.items()})


NO_STATES = {"internal_states": []}  # capacity from max_running_requests alone


def one_series(text: str, prefix: str, value: str) -> str:
    """``text`` with the value of the one sample line starting with ``prefix`` replaced."""
    lines = text.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    lines[at] = f"{lines[at].rsplit(' ', 1)[0]} {value}"
    return "\n".join(lines) + "\n"


REALTIME = 'sglang:realtime_tokens_total{engine_type="unified",'
DP2 = (FIXTURES / "dp2.prom").read_text()  # two replicas, 18 running
DP2_INFO: dict[str, Any] = json.loads((FIXTURES / "server_info-dp2.json").read_text())
# SGLang < 0.5.8: the argument only. Each of two DP replicas takes all 12 of it; with DP
# attention the two ranks split 24 (each scheduler gets max_running_requests // dp_size).
BEFORE_PER_DP = {**DP2_INFO, "version": "0.5.7", "internal_states": [{}, {}]}
ARGUMENT_12 = {**BEFORE_PER_DP, "enable_dp_attention": False, "max_running_requests": 12}
ARGUMENT_24_SHARED = {**BEFORE_PER_DP, "enable_dp_attention": True, "max_running_requests": 24}

# (what, page, /server_info, expected fields, rejected fields)
CASES: list[Any] = [
    pytest.param(
        page(),
        info(),
        {"steps": 4, "max_running_requests": 13, "accept_length": 3.61},
        (),
        id="all-sane",
    ),
    pytest.param(
        page(),
        info(max_running_requests=-5, **NO_STATES),
        {"max_running_requests": None, "steps": 4, "running": 13},
        ("max_running_requests",),
        id="negative-capacity",
    ),
    pytest.param(
        page(),
        info(internal_states=[{"effective_max_running_requests_per_dp": -5}]),
        {"max_running_requests": 48},  # the per-DP value is unusable: the server-wide one
        (),
        id="negative-per-dp-capacity-falls-back",
    ),
    pytest.param(
        page(),
        info(max_running_requests=10**9, **NO_STATES),
        {"max_running_requests": None},
        ("max_running_requests",),
        id="capacity-1e9",
    ),
    # SGLang < 0.5.8 with two DP replicas: each runs up to the whole argument, so the
    # server twice it (the argument alone read as the server's halved its capacity);
    # with DP attention the argument is the server's. The dp_size /server_info gives.
    pytest.param(
        DP2,
        ARGUMENT_12,
        {"max_running_requests": 24, "dp_ranks": 2, "running": 18},
        (),
        id="before-0.5.8-two-replicas",
    ),
    pytest.param(
        DP2,
        ARGUMENT_24_SHARED,
        {"max_running_requests": 24, "dp_ranks": 2, "running": 18},
        (),
        id="before-0.5.8-dp-attention",
    ),
    pytest.param(
        DP2,
        {**ARGUMENT_12, "dp_size": 4},
        {"max_running_requests": 48},
        (),
        id="before-0.5.8-dp-size-over-the-page",
    ),
    pytest.param(
        DP2,
        {k: v for k, v in ARGUMENT_12.items() if k != "dp_size"},
        {"max_running_requests": 24},  # no dp_size: the replicas the page shows
        (),
        id="before-0.5.8-replicas-from-the-page",
    ),
    pytest.param(
        DP2,
        {**ARGUMENT_12, "dp_size": 10**6},
        {"max_running_requests": None},
        ("max_running_requests",),
        id="before-0.5.8-a-million-replicas",
    ),
    # The page's own gauge stands: only /server_info's lie is counted.
    pytest.param(
        page(),
        info(speculative_num_steps=-3),
        {"steps": 4, "accept_length": 3.61},
        ("steps",),
        id="negative-steps-beside-the-gauge",
    ),
    # Before 0.5.13 /server_info is all there is: the live step count becomes unknown.
    pytest.param(
        OLD,
        info(speculative_num_steps=-3, speculative_num_draft_tokens=-2),
        {"steps": None, "draft_tokens": None},
        ("steps", "draft_tokens"),
        id="negative-steps-before-0.5.13",
    ),
    pytest.param(
        page(spec_num_steps=10**6),
        info(),
        {"steps": 4},  # the gauge is impossible: /server_info says what runs
        ("steps",),
        id="gauge-steps-1e6",
    ),
    pytest.param(
        page(spec_num_steps=3, spec_accept_length=50),
        info(speculative_num_steps=3),
        {"steps": 3, "accept_length": None},
        ("accept_length",),
        id="accept-length-50-at-3-steps",
    ),
    pytest.param(
        page(spec_accept_length=1e300),
        info(),
        {"accept_length": None, "steps": 4},
        ("accept_length",),
        id="accept-length-1e300",
    ),
    pytest.param(
        page(spec_accept_length=0.5),
        info(),
        {"accept_length": None},
        ("accept_length",),
        id="accept-length-below-1",
    ),
    pytest.param(
        page(spec_accept_length=5.0),
        info(),
        {"accept_length": 5.0},  # 4 steps + the bonus token: the best case, possible
        (),
        id="accept-length-steps-plus-1",
    ),
    pytest.param(
        page(gen_throughput=1e300),
        info(),
        {"gen_throughput": None, "steps": 4},
        ("gen_throughput",),
        id="throughput-1e300",
    ),
    pytest.param(
        page(generation_tokens_total=1e300),
        info(),
        {"generation_tokens_total": None},
        ("generation_tokens_total",),
        id="counter-1e300",
    ),
    pytest.param(
        page(),
        info(speculative_eagle_topk=0),
        {"topk": None, "steps": 4},
        ("topk",),
        id="topk-0",
    ),
    # What no gauge or counter can hold (NaN, ±Inf, negative) costs its field, as 1e300
    # does: a 0/0 accept length is not SGLang down.
    pytest.param(
        page(spec_accept_length=math.nan),
        info(),
        {"accept_length": None, "steps": 4, "running": 13, "gen_throughput": 1510.0},
        ("accept_length",),
        id="accept-length-nan",
    ),
    pytest.param(
        page(spec_accept_length=-1.0),
        info(),
        {"accept_length": None},
        ("accept_length",),
        id="accept-length-negative",
    ),
    pytest.param(
        (FIXTURES / "garbage-nan-usage.prom").read_text(),
        info(),
        {"token_usage": None, "accept_length": 3.61},
        ("token_usage",),
        id="token-usage-nan",
    ),
    pytest.param(
        (FIXTURES / "garbage-inf.prom").read_text(),
        info(),
        {"gen_throughput": None, "steps": 4},
        ("gen_throughput",),
        id="throughput-inf",
    ),
    pytest.param(
        page(generation_tokens_total=-5.0, spec_verify_calls_total=math.nan),
        info(),
        {"generation_tokens_total": None, "spec_verify_calls_total": None},
        ("generation_tokens_total", "spec_verify_calls_total"),
        id="counters-negative-and-nan",
    ),
    pytest.param(
        one_series(BASE, REALTIME + 'mode="decode"', "NaN"),
        info(),
        {"decode_tokens_total": None},
        ("decode_tokens_total",),
        id="decode-counter-nan",
    ),
    # Only the decode series is read: a bad prefill one costs nothing.
    pytest.param(
        one_series(BASE, REALTIME + 'mode="prefill_cache"', "-1"),
        info(),
        {"decode_tokens_total": 43990.0},
        (),
        id="prefill-counter-negative-unread",
    ),
    pytest.param(
        page(spec_num_steps=math.nan, spec_num_draft_tokens=-math.inf),
        info(),
        {"steps": 4, "draft_tokens": 5},  # the gauges are impossible: /server_info says
        ("steps", "draft_tokens"),
        id="steps-gauges-nan-and-minus-inf",
    ),
    pytest.param(
        page(spec_num_steps=3.5),
        info(),
        {"steps": 4, "accept_length": 3.61},
        ("steps",),
        id="steps-gauge-not-whole",
    ),
    # One replica's NaN: the server's accept length is unknown, its load stands.
    pytest.param(
        one_series(DP2, 'sglang:spec_accept_length{dp_rank="1"', "NaN"),
        DP2_INFO,
        {"accept_length": None, "running": 18, "dp_ranks": 2},
        ("accept_length",),
        id="dp2-one-replica-nan",
    ),
]


@pytest.fixture(scope="module")
def server() -> Iterator[PageServer]:
    with page_server() as state:
        yield state


def observe(server: PageServer, metrics: str, server_info: dict[str, Any]) -> Any:
    server.serve_sglang(metrics, server_info)
    with SGLangClient(server.url, timeout_s=2.0) as client:
        return client.observe()


@pytest.mark.parametrize(("metrics", "server_info", "expected", "rejected"), CASES)
def test_impossible_values_cost_their_field_only(
    server: PageServer,
    metrics: str,
    server_info: dict[str, Any],
    expected: dict[str, Any],
    rejected: tuple[str, ...],
) -> None:
    obs = observe(server, metrics, server_info)
    assert isinstance(obs, Observation), obs
    assert obs.rejected == rejected
    assert len(obs.rejected_values) == len(rejected)
    for name, value in expected.items():
        assert getattr(obs, name) == value, name
    # What is left is possible: nothing the history would have to refuse.
    assert impossible_fields(obs) == ()


def test_a_rejected_value_is_named_as_the_page_spells_it(server: PageServer) -> None:
    obs = observe(server, page(spec_accept_length=math.nan, gen_throughput=-math.inf), info())
    assert isinstance(obs, Observation), obs
    assert dict(zip(obs.rejected, obs.rejected_values, strict=True)) == {
        "accept_length": "NaN",
        "gen_throughput": "-Inf",
    }


@pytest.mark.parametrize(
    ("running", "queued"),
    [(10**12, 0), (0, 10**15)],
    ids=["running-1e12", "queued-1e15"],
)
def test_an_impossible_load_is_no_observation(
    server: PageServer, running: int, queued: int
) -> None:
    obs = observe(server, page(num_running_reqs=running, num_queue_reqs=queued), info())
    assert isinstance(obs, ScrapeError)
    assert obs.kind == "malformed"
    assert "more than any SGLang server holds" in obs.reason
    assert "\n" not in obs.reason


def dp2(running: tuple[int, int]) -> str:
    text = DP2
    for rank, value in enumerate(running):
        text = one_series(text, f'sglang:num_running_reqs{{dp_rank="{rank}"', f"{value}.0")
    return text


PER_DP_13 = {"internal_states": [{"effective_max_running_requests_per_dp": 13}]}
PER_DP_12_12 = {"internal_states": [{"effective_max_running_requests_per_dp": 12}] * 2}

# (page, /server_info, None when an observation, else what the error says)
CAPACITY: list[Any] = [
    pytest.param(page(num_running_reqs=13), info(**PER_DP_13), None, id="at-capacity"),
    pytest.param(
        page(num_running_reqs=14),
        info(**PER_DP_13),
        "sglang:num_running_reqs 14 is more than the 13 requests",
        id="one-past-capacity",
    ),
    pytest.param(
        page(num_running_reqs=5000),
        info(max_running_requests=48, **NO_STATES),
        "sglang:num_running_reqs 5000 is more than the 48 requests",
        id="past-the-argument",
    ),
    pytest.param(dp2((12, 12)), info(**PER_DP_12_12), None, id="dp2-full"),
    pytest.param(
        dp2((13, 12)),
        info(**PER_DP_12_12),
        "sglang:num_running_reqs 25 is more than the 24 requests",
        id="dp2-past-the-sum",
    ),
    pytest.param(dp2((12, 12)), ARGUMENT_12, None, id="dp2-argument-per-replica"),
    pytest.param(
        dp2((13, 12)),
        ARGUMENT_12,
        "sglang:num_running_reqs 25 is more than the 24 requests",
        id="dp2-past-the-argument-per-replica",
    ),
    pytest.param(dp2((12, 12)), ARGUMENT_24_SHARED, None, id="dp2-argument-shared"),
    # Counted once per rank, DP attention's 24 let 48 run.
    pytest.param(
        dp2((13, 12)),
        ARGUMENT_24_SHARED,
        "sglang:num_running_reqs 25 is more than the 24 requests",
        id="dp2-past-the-argument-shared",
    ),
    # Capacity unknown, or itself impossible: no bound to hold the load to.
    pytest.param(
        page(num_running_reqs=5000),
        {k: v for k, v in info(**NO_STATES).items() if k != "max_running_requests"},
        None,
        id="capacity-unknown",
    ),
    pytest.param(
        page(num_running_reqs=5000),
        info(max_running_requests=-5, **NO_STATES),
        None,
        id="capacity-rejected",
    ),
    pytest.param(page(num_running_reqs=5000), None, None, id="no-server-info"),
]


@pytest.mark.parametrize(("metrics", "server_info", "problem"), CAPACITY)
def test_running_past_the_capacity_is_no_observation(
    server: PageServer, metrics: str, server_info: dict[str, Any] | None, problem: str | None
) -> None:
    server.routes.clear()
    obs = observe(server, metrics, server_info)
    if problem is None:
        assert isinstance(obs, Observation), obs
        return
    assert isinstance(obs, ScrapeError)
    assert obs.kind == "malformed"
    assert problem in obs.reason
    assert "\n" not in obs.reason


def test_a_capacity_from_before_a_restart_costs_one_scrape(server: PageServer) -> None:
    """SGLang restarted with room for more, and the page does not show a new start: the
    scrape that finds the old capacity too small fails, and reads /server_info again."""
    server.serve_sglang(page(num_running_reqs=13), info(**PER_DP_13))
    with SGLangClient(server.url, timeout_s=2.0) as client:
        assert isinstance(client.observe(), Observation)
        server.serve_sglang(
            page(num_running_reqs=40),
            info(internal_states=[{"effective_max_running_requests_per_dp": 48}]),
        )
        failed = client.observe()
        assert isinstance(failed, ScrapeError), failed
        assert "40 is more than the 13 requests" in failed.reason
        obs = client.observe()
    assert isinstance(obs, Observation), obs
    assert (obs.running, obs.max_running_requests) == (40, 48)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    accept=st.floats(min_value=0.0, max_value=1e308, allow_nan=False),
    steps=st.integers(min_value=0, max_value=2**40),
    capacity=st.one_of(
        st.integers(min_value=-(2**63), max_value=2**63), st.integers(min_value=0, max_value=20)
    ),
    throughput=st.floats(min_value=0.0, max_value=1e308, allow_nan=False),
)
def test_any_number_from_sglang_is_kept_only_when_possible(
    server: PageServer, accept: float, steps: int, capacity: int, throughput: float
) -> None:
    obs = observe(
        server,
        page(spec_num_steps=steps, spec_accept_length=accept, gen_throughput=throughput),
        info(max_running_requests=capacity, **NO_STATES),
    )
    if 1 <= capacity < 13:
        # Fewer than the 13 running: the load is impossible, not the capacity.
        assert isinstance(obs, ScrapeError)
        assert "is more than the" in obs.reason
        return
    assert isinstance(obs, Observation), obs
    assert impossible_fields(obs) == ()
    assert obs.running == 13  # whatever else lies, the load stands
    if obs.steps is not None:
        assert 0 <= obs.steps <= MAX_STEPS
    if obs.accept_length is not None:
        assert accept_length_possible(obs.accept_length, obs.steps)
    if 1 <= capacity <= 10**6:
        assert obs.max_running_requests == capacity
    else:
        assert obs.max_running_requests is None
        assert "max_running_requests" in obs.rejected
    # And the history learns nothing a real SGLang could not have said.
    history = History(HistorySettings(warmup_exclude_s=0))
    assert history.record(obs) is Recorded.COUNTED
    assert history.to_dict() == History.from_dict(history.to_dict(), dropped=[]).to_dict()


# ---- the history defends itself: replay and tools build observations too ------------
def test_the_history_strips_what_the_reader_would_reject() -> None:
    history = History(HistorySettings(warmup_exclude_s=0))
    for i in range(10):
        history.record(
            make_observation(
                1000.0 + 5 * i,
                running=4,
                steps=3,
                accept_length=50.0,
                max_running_requests=-5,
                gen_throughput=1e300,
            )
        )
    assert history.accept_length(3) is None
    assert history.capacity(3) is None
    assert history.throughput(3, 4) is None
    assert history.busy_seconds > 0  # the load itself was possible, and is learned


def test_the_history_ignores_an_impossible_load() -> None:
    history = History(HistorySettings(warmup_exclude_s=0))
    assert history.record(make_observation(1000.0, running=10**12)) is Recorded.IMPOSSIBLE
    assert history.observed_seconds == 0
    assert history.last_t is None


def test_a_counter_that_leaps_is_no_throughput() -> None:
    history = History(HistorySettings(warmup_exclude_s=0))
    for i, decoded in enumerate([1000.0, 2000.0, 2.0**52, 2.0**52 + 1000.0]):
        history.record(make_observation(1000.0 + 5 * i, running=4, decode_tokens_total=decoded))
    rate = history.throughput(4, 4)
    assert rate is not None
    assert rate == pytest.approx(200.0)  # the two sane intervals only


@pytest.mark.parametrize(
    ("fields", "rejected"),
    [
        ({"steps": -1}, ("steps",)),
        ({"steps": 3, "accept_length": 4.0 + 1e-9}, ()),  # float noise at the bound
        ({"steps": 3, "accept_length": 4.01}, ("accept_length",)),
        ({"steps": None, "accept_length": 30.0}, ()),  # steps unknown: the widest bound
        ({"accept_length": math.inf}, ("accept_length",)),
        ({"draft_tokens": 10**6}, ("draft_tokens",)),
        ({"spec_verify_calls_total": -1.0}, ("spec_verify_calls_total",)),
    ],
)
def test_without_impossible(fields: dict[str, Any], rejected: tuple[str, ...]) -> None:
    obs = without_impossible(make_observation(0.0, **fields))
    assert obs.rejected == rejected
    for name in rejected:
        assert getattr(obs, name) is None
