"""The twin's SGLang adaptive controller, config reading and launch resolution, without HTTP:
slots and their EMA with hysteresis as each version's adaptive_spec_params.py, the engine
moving tiers with batch size and acceptance under an injected clock, refusals, fallbacks and
the fault knob per kind of setting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from twin_kinds import SPEC, fast_table, parse_twin_args, write_config

from specd.core.sglang_features import ADAPTIVE_SLOT_ZERO, ADAPTIVE_SLOTS, has, parse_version
from specd.twin.adaptive import (
    DEFAULT_SLOTS_0_5_23,
    SLOTS,
    AdaptiveConfigError,
    Controller,
    Slot,
    cuda_graph_batch_sizes,
    load_slots,
)
from specd.twin.engine import Engine, Request
from specd.twin.exposition import MetricState
from specd.twin.faults import ENV_FAIL_SETTINGS, SettingKey, parse_setting
from specd.twin.launch import TwinConfigError, resolve
from specd.twin.table import PerfTable
from specd.twin.versions import PROFILES, VERSIONS


def _slot(version: str, cands: list[int], initial: int, **tuning: float) -> Slot:
    rules = PROFILES[version].adaptive
    assert rules is not None
    return Slot(initial, {"candidate_steps": cands, **tuning}, rules)


def _run(slot: Slot, drafts: float, batches: int) -> int:
    for _ in range(batches):
        slot.update(min(drafts, float(max(slot.current_steps, 0))))
    return slot.current_steps


# (version, candidates, launch steps, tuning, accepted drafts per request, batches, tier):
# EMA alpha 0.2 from (steps - 1), 10 warm-up batches, a decision every 5th batch after.
SLOT_CASES = [
    # 7 -> down past 5 (4.25) and 3 (2.25) at the first decision, not to 1 (0.25).
    ("0.5.23", [1, 3, 5, 7], 7, {}, 2.0, 15, 3),
    ("0.5.23", [1, 3, 5, 7], 7, {}, 2.0, 14, 7),  # no decision before batch 15
    # Hysteresis: the same acceptance holds 5 when coming from above, 3 from below.
    ("0.5.23", [1, 3, 5, 7], 5, {}, 2.3, 200, 5),
    ("0.5.23", [1, 3, 5, 7], 3, {}, 2.3, 200, 3),
    ("0.5.23", [1, 3, 5, 7], 3, {}, 2.9, 15, 5),  # above 3 - 0.5: up
    ("0.5.23", [1, 3, 5, 7], 3, {"up_hysteresis": 0.5}, 2.9, 200, 3),
    # Step 0 (0.5.14+): down to 0 at 0.5 + down_hysteresis, then a probe of 1 every decision.
    ("0.5.23", [0, 1, 3], 3, {"down_hysteresis": 0.0}, 0.1, 15, 0),
    ("0.5.23", [0, 1, 3], 3, {"down_hysteresis": 0.0}, 0.1, 20, 1),
    ("0.5.23", [0, 1, 3], 3, {"down_hysteresis": 0.0}, 0.1, 25, 0),
    # After moving down, 0.5.14+ does not move up in the same decision; 0.5.13 does.
    ("0.5.23", [1, 3, 5], 5, {"down_hysteresis": 0.3}, 2.6, 15, 3),
    ("0.5.13", [1, 3, 5], 5, {"down_hysteresis": 0.3}, 2.6, 15, 5),
    ("0.5.11", [1, 3, 5], 5, {"down_hysteresis": 0.3}, 2.6, 15, 5),
    # Launch steps outside the candidates: 0.5.13+ take the middle one, 0.5.11 the nearest
    # (the deeper on a tie).
    ("0.5.23", [1, 3, 7], 5, {}, 2.0, 0, 3),
    ("0.5.13", [1, 3, 7], 4, {}, 2.0, 0, 3),
    ("0.5.11", [1, 3, 7], 5, {}, 2.0, 0, 7),
    ("0.5.11", [1, 3, 7], 4, {}, 2.0, 0, 3),
    # ceiling_coeff (0.5.13+) caps the step count from the EMA; 0.5.11 has no such knob.
    ("0.5.13", [1, 3, 5, 7], 7, {"ceiling_coeff": 1.0, "down_hysteresis": -5.0}, 2.0, 15, 3),
    ("0.5.11", [1, 3, 5, 7], 7, {"ceiling_coeff": 1.0, "down_hysteresis": -5.0}, 2.0, 15, 7),
    # Faster tuning from the config: no warm-up, a decision every batch.
    ("0.5.23", [1, 3], 3, {"warmup_batches": 0, "update_interval": 1, "ema_alpha": 1.0}, 0.1, 1, 1),
]


@pytest.mark.parametrize(
    ("version", "cands", "initial", "tuning", "drafts", "batches", "tier"), SLOT_CASES
)
def test_slot_moves_as_sglangs_with_hysteresis(
    version: str,
    cands: list[int],
    initial: int,
    tuning: dict[str, float],
    drafts: float,
    batches: int,
    tier: int,
) -> None:
    assert _run(_slot(version, cands, initial, **tuning), drafts, batches) == tier


@pytest.mark.parametrize(
    ("max_bs", "batch", "slot"),
    [
        (48, 1, 1),
        (48, 7, 1),
        (48, 8, 8),
        (48, 9, 8),  # padded to 10
        (48, 30, 8),
        (48, 31, 32),  # padded to 32: the next slot
        (48, 33, 32),
        (48, 63, 32),  # past the largest graph: the batch itself
        (64, 61, 64),  # padded to 64
        (64, 60, 32),
    ],
)
def test_batch_is_padded_to_the_cuda_graph_size_before_the_slot(
    max_bs: int, batch: int, slot: int
) -> None:
    rules = PROFILES["0.5.23"].adaptive
    assert rules is not None
    slots = load_slots(rules, None)
    assert sorted(slots) == [1, 8, 32, 64]
    controller = Controller(7, slots, rules, cuda_graph_batch_sizes(max_bs))
    assert controller.slot_size(batch) == slot
    # Without CUDA graphs there is no padding.
    assert Controller(7, slots, rules, None).slot_size(31) == 8


def test_cuda_graph_sizes_are_sglangs_speculative_list() -> None:
    assert cuda_graph_batch_sizes(13) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13]
    sizes = cuda_graph_batch_sizes(300)
    assert sizes[:12] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    probes = (36, 40, 44, 64, 68, 72, 80, 256, 272, 288, 300)
    assert [s for s in sizes if s in probes] == [40, 44, 64, 72, 80, 256, 272, 288, 300]


@pytest.mark.parametrize(
    ("version", "body", "result"),
    [
        ("0.5.23", None, [0, 1, 3, 5, 7]),  # the default slots
        ("0.5.13", None, [1, 3, 7]),
        ("0.5.11", None, [1, 3, 7]),
        ("0.5.23", {"1": {"candidate_steps": [3, 4]}}, [3, 4]),
        ("0.5.23", {"1": {"candidate_steps": [1, 3]}, "8": {"candidate_steps": [0, 1]}}, [0, 1, 3]),
        ("0.5.11", {"candidate_steps": [3, 4]}, [3, 4]),
        ("0.5.23", {"1": {"candidate_steps": [0, 3]}, "note": "x"}, [0, 3]),
        (
            "0.5.13",
            {"1": {"candidate_steps": [0, 3]}},
            "ValueError: BS 1: candidate_steps must be a list of positive ints, got [0, 3]",
        ),
        (
            "0.5.23",
            {"1": {"candidate_steps": [-1]}},
            "ValueError: BS 1: candidate_steps must be a list of non-negative ints, got [-1]",
        ),
        ("0.5.23", {"1": {"candidate_steps": []}}, "must be a list of non-negative ints, got []"),
        ("0.5.23", {"1": {}}, "must be a list of non-negative ints, got None"),
        (
            "0.5.23",
            {"candidate_steps": [3, 4]},
            "must contain at least one integer-string BS key",
        ),  # the 0.5.11 form
        ("0.5.23", [3, 4], "AttributeError: 'list' object has no attribute 'items'"),
        ("0.5.23", {"1": 5}, "AttributeError: 'int' object has no attribute 'get'"),
        (
            "0.5.11",
            {"candidate_steps": [3]},
            "AssertionError: candidate_steps must have at least 2 distinct values",
        ),
        (
            "0.5.11",
            [3, 4],
            "ValueError: speculative_adaptive_config must be a JSON object, got list",
        ),
    ],
)
def test_config_is_read_as_that_version_reads_it(
    tmp_path: Path, version: str, body: Any, result: list[int] | str
) -> None:
    rules = PROFILES[version].adaptive
    assert rules is not None
    path = None if body is None else write_config(tmp_path, body)
    if isinstance(result, str):
        with pytest.raises(AdaptiveConfigError) as exc:
            load_slots(rules, path)
        assert result in str(exc.value)
    else:
        slots = load_slots(rules, path)
        assert sorted({s for c in slots.values() for s in c["candidate_steps"]}) == result


def test_unreadable_config_files(tmp_path: Path) -> None:
    rules = PROFILES["0.5.23"].adaptive
    assert rules is not None
    with pytest.raises(AdaptiveConfigError, match=r"^FileNotFoundError: .*nope\.json"):
        load_slots(rules, str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(AdaptiveConfigError, match=r"^json\.decoder\.JSONDecodeError: "):
        load_slots(rules, str(bad))


def test_the_default_slots_are_sglang_0_5_23s() -> None:
    assert {k: v["candidate_steps"] for k, v in DEFAULT_SLOTS_0_5_23.items()} == {
        "1": [1, 3, 5, 7],
        "8": [0, 1, 3],
        "32": [0, 1],
        "64": [0],
    }
    assert DEFAULT_SLOTS_0_5_23["1"]["down_hysteresis"] == -0.25
    assert DEFAULT_SLOTS_0_5_23["8"]["down_hysteresis"] == 0.0


# -- the engine under an injected clock ------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _engine(
    version: str, slots_body: dict[str, Any], launch: int, accepts: dict[int, float], tmp_path: Path
) -> tuple[Engine, _Clock]:
    rules = PROFILES[version].adaptive
    assert rules is not None
    slots = load_slots(rules, write_config(tmp_path, slots_body))
    clock = _Clock()
    table = PerfTable.from_csv_text(fast_table(accepts))
    engine = Engine(
        table,
        steps=launch,
        draft_tokens=launch + 1,
        max_running=48,
        state=MetricState(model_name="m", profile=PROFILES[version]),
        accept_length=accepts[launch],
        accept_noise=0.0,
        seed=1,
        clock=clock,
        controller=Controller(launch, slots, rules, cuda_graph_batch_sizes(48)),
        accept_lengths=accepts,
    )
    return engine, clock


def _load(engine: Engine, n: int) -> None:
    for _ in range(n):
        engine.submit(Request(prompt_tokens=1, max_tokens=10**7, streaming=False, arrival=0.0))


def _decode_for(engine: Engine, clock: _Clock, seconds: float, tick_s: float = 0.05) -> None:
    end = clock.t + seconds
    while clock.t < end:
        clock.t = min(end, clock.t + tick_s)
        engine.advance()


@pytest.mark.parametrize(
    ("running", "tier"),
    [(1, 4), (7, 4), (8, 2), (9, 2), (30, 2), (31, 1), (33, 1)],
)
def test_engine_tier_follows_the_batch_sizes_slot(tmp_path: Path, running: int, tier: int) -> None:
    body = {"1": {"candidate_steps": [4]}, "8": {"candidate_steps": [2]},
            "32": {"candidate_steps": [1]}}  # fmt: skip
    engine, clock = _engine("0.5.23", body, 4, {1: 1.8, 2: 2.5, 4: 3.5}, tmp_path)
    _load(engine, running)
    _decode_for(engine, clock, 0.2)
    assert engine.steps == tier
    engine.report()
    assert engine.state.get("sglang:spec_num_steps", 0) == tier
    assert engine.state.get("sglang:spec_num_draft_tokens", 0) == tier + 1


@pytest.mark.parametrize(
    ("launch", "accept_1", "accept_3", "tier"),
    [
        (3, 1.4, 1.1, 1),  # 0.1 drafts at 3: at or below 1 - 0.5 - 0.25, down; 0.4 at 1: held
        # 0.1 drafts at 3 but 0.9 at 1: down, then up again as the shared EMA recovers
        (3, 1.9, 1.1, None),
        (3, 1.9, 1.3, 3),  # 0.3 drafts: below the midpoint but inside the hysteresis, held
        (1, 1.9, 1.3, 3),  # 0.9 drafts at 1: above 1 - 0.5, up; then held at 3
        (1, 1.4, 1.3, 1),  # 0.4 drafts at 1: not above 0.5, held
    ],
)
def test_engine_tier_follows_acceptance_with_hysteresis(
    tmp_path: Path, launch: int, accept_1: float, accept_3: float, tier: int
) -> None:
    body = {"1": {"candidate_steps": [1, 3]}}
    engine, clock = _engine("0.5.23", body, launch, {1: accept_1, 3: accept_3}, tmp_path)
    _load(engine, 1)
    # One verify per 2 ms: 0.5 s is 250 batches, 48 decisions.
    assert engine.controller is not None
    seen = set()
    for _ in range(10):
        _decode_for(engine, clock, 0.05)
        seen.add(engine.steps)
    assert engine.controller.route(1).batch_count >= 200
    if tier is None:
        assert seen == {1, 3}
        assert engine.controller.switches >= 4
    else:
        assert seen == {tier}


def test_engine_throughput_is_the_live_tiers_row(tmp_path: Path) -> None:
    accepts = {1: 1.4, 3: 1.1}
    engine, clock = _engine("0.5.23", {"1": {"candidate_steps": [1, 3]}}, 3, accepts, tmp_path)
    _load(engine, 1)
    _decode_for(engine, clock, 1.0)
    assert engine.steps == 1
    before = engine.running[0].produced
    _decode_for(engine, clock, 1.0)
    # At steps 1 the table's row gives 1.4 tokens per 2 ms verify.
    assert engine.running[0].produced - before == pytest.approx(1.4 / 0.002, rel=1e-6)


def test_accept_rate_under_adaptive_divides_by_the_launch_draft_tokens(tmp_path: Path) -> None:
    # SGLang's gauge uses speculative_num_draft_tokens as resolved at start (4 here) even
    # when the live tier drafts 1: that is why it is wrong under adaptive mode.
    engine, clock = _engine("0.5.23", {"1": {"candidate_steps": [1, 3]}}, 3, {1: 1.4, 3: 1.1},
                            tmp_path)  # fmt: skip
    _load(engine, 1)
    _decode_for(engine, clock, 1.0)
    engine.report()
    _decode_for(engine, clock, 0.5)
    engine.report()
    assert engine.steps == 1
    st = engine.state
    assert st.get("sglang:spec_accept_length", 0) == pytest.approx(1.4)
    assert st.get("sglang:spec_accept_rate", 0) == pytest.approx(0.4 / 3)
    # The lifetime average mixes the tiers run: 1.1 tokens a verify at 3, then 1.4 at 1.
    assert 1.1 < engine.lifetime_accept_length() < 1.4


# -- launch resolution: capacity, startup, refusals, fallbacks, the fault knob ----------


def _table_file(tmp_path: Path, capacity: int = 64) -> str:
    """Steps 0-7 (SGLang's default slots reach 7, the preset stops at 6)."""
    path = tmp_path / "table.csv"
    path.write_text(fast_table({k: 1.0 + 0.6 * k for k in range(8)}, capacity))
    return str(path)


def _adaptive_argv(config: str, steps: int = 4, version: str = "0.5.23") -> list[str]:
    return [*SPEC, "--speculative-num-steps", str(steps), "--speculative-num-draft-tokens",
            str(steps + 1), "--speculative-adaptive", "--speculative-adaptive-config", config,
            "--sglang-version", version]  # fmt: skip


@pytest.mark.parametrize(
    ("cands", "capacity"),
    [([4], 13), ([1, 4], 13), ([1, 2], 19), ([1], 26), ([0, 1], 26)],
)
def test_capacity_is_the_deepest_candidates(
    tmp_path: Path, cands: list[int], capacity: int
) -> None:
    # The preset's capacity is floor(78 / (steps + 2)): 26 at 1, 19 at 2, 13 at 4.
    config = write_config(tmp_path, {"1": {"candidate_steps": cands}})
    cfg = resolve(parse_twin_args(_adaptive_argv(config, steps=max(cands))), argv=[])
    assert cfg.adaptive
    assert cfg.max_running == capacity


@pytest.mark.parametrize(("cands", "sets"), [([4], 1), ([3, 4], 2), ([1, 2, 3, 4], 4)])
def test_startup_grows_by_one_graph_set_per_candidate(
    tmp_path: Path, cands: list[int], sets: int
) -> None:
    config = write_config(tmp_path, {"1": {"candidate_steps": cands}})
    argv = [*_adaptive_argv(config), "--load-time-s", "2", "--graph-set-s", "0.5"]
    cfg = resolve(parse_twin_args(argv), argv=[])
    assert cfg.graph_sets == sets
    assert cfg.load_s == pytest.approx(2 + 0.5 * (sets - 1))
    static_argv = [*SPEC, "--speculative-num-steps", "4", "--load-time-s", "2"]
    static = resolve(parse_twin_args(static_argv), argv=[])
    assert static.load_s == 2.0
    assert static.graph_set_s == 0.5  # a quarter of the load by default


@pytest.mark.parametrize(
    ("version", "argv_tail", "body", "code", "message"),
    [
        ("0.5.4", [], None, 2, "unrecognized arguments: --speculative-adaptive"),
        (
            "0.5.23",
            [],
            {"1": {"candidate_steps": [-1]}},
            1,
            "ValueError: BS 1: candidate_steps must be a list of non-negative ints",
        ),
        (
            "0.5.13",
            [],
            {"1": {"candidate_steps": [0, 4]}},
            1,
            "ValueError: BS 1: candidate_steps must be a list of positive ints",
        ),
        (
            "0.5.23",
            ["--speculative-num-steps", "5"],
            {"1": {"candidate_steps": [3, 4]}},
            1,
            "ValueError: --speculative-num-steps=5 is not in the adaptive config candidate_steps "
            "[3, 4]. Pass one of those values.",
        ),
        (
            "0.5.13",
            ["--speculative-num-steps", "2"],
            {"1": {"candidate_steps": [3, 4]}},
            1,
            "--speculative-num-steps=2 is not in the adaptive config candidate_steps [3, 4]",
        ),
        ("0.5.23", [], {"1": {"candidate_steps": [4, 9]}}, 1, "no data for steps 9"),
        (
            "0.5.23",
            [],
            {"1": {"candidate_steps": [4], "ema_alpha": "fast"}},
            1,
            "ValueError: could not convert string to float: 'fast'",
        ),
    ],
)
def test_refusals_per_version(
    tmp_path: Path,
    version: str,
    argv_tail: list[str],
    body: Any,
    code: int,
    message: str,
) -> None:
    config = write_config(tmp_path, body or {"1": {"candidate_steps": [4]}})
    argv = [*_adaptive_argv(config, version=version), *argv_tail]
    with pytest.raises(TwinConfigError) as exc:
        resolve(parse_twin_args(argv), argv=[])
    assert message in str(exc.value)
    assert exc.value.exit_code == code


def test_a_bad_config_at_0_5_11_fails_while_loading_not_at_start(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"candidate_steps": [4]})
    argv = [*_adaptive_argv(config, version="0.5.11"), "--disable-overlap-schedule"]
    cfg = resolve(parse_twin_args(argv), argv=[])
    assert cfg.load_error == "AssertionError: candidate_steps must have at least 2 distinct values"


@pytest.mark.parametrize(
    ("version", "argv_tail", "reason"),
    [
        (
            "0.5.23",
            ["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"],
            "speculative_eagle_topk=2 (only topk=1 is supported)",
        ),
        (
            "0.5.23",
            ["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"],
            "attention DP is not supported",
        ),
        (
            "0.5.13",
            ["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"],
            "enable_dp_attention=True is not supported",
        ),
        (
            "0.5.23",
            ["--enable-multi-layer-eagle"],
            "enable_multi_layer_eagle=True is not supported (MultiLayerEagleWorkerV2",
        ),
        ("0.5.23", ["--enable-two-batch-overlap"], "enable_two_batch_overlap=True"),
        ("0.5.23", ["--enable-pdmux"], "enable_pdmux=True"),
        (
            "0.5.23",
            ["--speculative-algorithm", "STANDALONE"],
            "speculative_algorithm=STANDALONE (only EAGLE/EAGLE3 are supported)",
        ),
        ("0.5.11", [], "the overlap scheduler (spec v2) is enabled"),
        ("0.5.11", ["--disable-overlap-schedule"], None),
        ("0.5.13", [], None),
        ("0.5.23", ["--speculative-algorithm", "EAGLE3"], None),
    ],
)
def test_quiet_fallback_to_static_where_adaptive_is_unsupported(
    tmp_path: Path, version: str, argv_tail: list[str], reason: str | None
) -> None:
    body: dict[str, Any] = {"1": {"candidate_steps": [1, 4]}}
    if version == "0.5.11":
        body = {"candidate_steps": [1, 4]}
    config = write_config(tmp_path, body)
    cfg = resolve(parse_twin_args([*_adaptive_argv(config, version=version), *argv_tail]), argv=[])
    fallback = [w for w in cfg.warnings if w.startswith("speculative_adaptive disabled: ")]
    if reason is None:
        assert cfg.adaptive
        assert not fallback
        assert cfg.args.speculative_adaptive is True
        assert cfg.candidates == [1, 4]
        return
    assert not cfg.adaptive
    assert cfg.args.speculative_adaptive is False  # /server_info shows it off
    assert cfg.args.speculative_adaptive_config == config  # and the path as given
    assert cfg.steps == 4  # static at the launch steps
    assert len(fallback) == 1
    assert reason in fallback[0]
    assert fallback[0].endswith("Falling back to static speculative params.")


def test_adaptive_without_steps_starts_at_the_middle_candidate_on_0_5_23(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"1": {"candidate_steps": [1, 2, 3, 4]}})
    argv = ["--speculative-algorithm", "EAGLE", "--speculative-adaptive",
            "--speculative-adaptive-config", config]  # fmt: skip
    cfg = resolve(parse_twin_args(argv), argv=[])
    assert (cfg.steps, cfg.topk, cfg.draft_tokens) == (3, 1, 4)
    # Default slots: the middle of 0,1,3,5,7.
    table = _table_file(tmp_path)
    argv = ["--speculative-algorithm", "EAGLE", "--speculative-adaptive", "--table", table]
    cfg = resolve(parse_twin_args(argv), argv=[])
    assert cfg.steps == 3
    assert cfg.candidates == [0, 1, 3, 5, 7]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("off", SettingKey("off")),
        ("OFF ", SettingKey("off")),
        ("4", SettingKey("static", 4)),
        ("static:4", SettingKey("static", 4)),
        ("adaptive:3,4", SettingKey("adaptive", slots=((1, (3, 4)),))),
        ("adaptive:4,3", SettingKey("adaptive", slots=((1, (3, 4)),))),
        ("adaptive:1,3/1=1,3;8=0,1", SettingKey("adaptive", slots=((1, (1, 3)), (8, (0, 1))))),
    ],
)
def test_fault_settings_parse_specds_text_form(text: str, key: SettingKey) -> None:
    assert parse_setting(text) == key


@pytest.mark.parametrize(
    "text",
    ["", "0", "static:", "adaptive:", "adaptive:a", "adaptive:1/x", "fast", "adaptive:1/1=1;"],
)
def test_bad_fault_settings_are_one_line_errors(text: str) -> None:
    with pytest.raises(ValueError, match="setting"):
        parse_setting(text)
    with pytest.raises(SystemExit):
        parse_twin_args(["--fail-setting", text])


def _fails(argv: list[str], env: dict[str, str] | None = None) -> bool:
    return resolve(parse_twin_args(argv), argv=[], env=env or {}).load_error is not None


@pytest.mark.parametrize(
    ("kind", "fail", "fails"),
    [
        ("off", "off", True),
        ("off", "4", False),
        ("static", "4", True),
        ("static", "static:4", True),
        ("static", "3", False),
        ("static", "adaptive:3,4", False),
        ("static", "off", False),
        ("adaptive", "adaptive:3,4", True),
        ("adaptive", "adaptive:3,4/1=3,4", True),
        ("adaptive", "adaptive:3,4/1=3,4;8=3", False),
        ("adaptive", "adaptive:4", False),
        ("adaptive", "4", False),
        ("slots", "adaptive:1,3/1=1,3;8=0,1", True),
        ("slots", "adaptive:1,3", False),
        ("fallback", "adaptive:3,4", True),  # the setting asked for, even when SGLang falls back
    ],
)
def test_fault_knob_fails_exactly_the_named_setting(
    tmp_path: Path, kind: str, fail: str, fails: bool
) -> None:
    three_four = {"1": {"candidate_steps": [3, 4]}}
    two_slots = {"1": {"candidate_steps": [1, 3]}, "8": {"candidate_steps": [0, 1]}}
    static = [*SPEC, "--speculative-num-steps", "4", "--speculative-num-draft-tokens", "5"]
    argv = {
        "off": lambda: [],
        "static": lambda: static,
        "adaptive": lambda: _adaptive_argv(write_config(tmp_path, three_four)),
        "slots": lambda: _adaptive_argv(write_config(tmp_path, two_slots), steps=3),
        "fallback": lambda: [*_adaptive_argv(write_config(tmp_path, three_four)), "--enable-pdmux"],
    }[kind]()
    argv = [*argv, "--table", _table_file(tmp_path)]
    assert _fails([*argv, "--fail-setting", fail]) is fails
    assert _fails(argv, {ENV_FAIL_SETTINGS: f"7 {fail}"}) is fails
    assert not _fails(argv)


def test_fail_start_at_steps_names_static_step_counts_and_off(tmp_path: Path) -> None:
    static = [*SPEC, "--speculative-num-steps", "4", "--speculative-num-draft-tokens", "5"]
    assert _fails([*static, "--fail-start-at-steps", "2,4"])
    assert _fails(["--fail-start-at-steps", "0"])
    adaptive = _adaptive_argv(write_config(tmp_path, {"1": {"candidate_steps": [3, 4]}}))
    assert not _fails([*adaptive, "--fail-start-at-steps", "4"])


def test_a_bad_fail_settings_environment_is_a_one_line_error() -> None:
    with pytest.raises(TwinConfigError, match=f"^{ENV_FAIL_SETTINGS}: setting 'soon'"):
        resolve(parse_twin_args([]), argv=[], env={ENV_FAIL_SETTINGS: "off soon"})


@pytest.mark.parametrize("version", VERSIONS)
def test_adaptive_rules_agree_with_specds_version_table(version: str) -> None:
    parsed = parse_version(version)
    assert parsed is not None
    rules = PROFILES[version].adaptive
    assert (rules is not None) is (parsed >= (0, 5, 11))
    if rules is None:
        return
    assert (rules.config == SLOTS) is has(parsed, ADAPTIVE_SLOTS)
    assert rules.slot_zero is has(parsed, ADAPTIVE_SLOT_ZERO)
    assert rules.needs_no_overlap is (parsed < (0, 5, 13))


@pytest.mark.parametrize("adaptive", [False, True], ids=["static", "adaptive"])
@pytest.mark.parametrize("late_s", [0.01, 1.0, 30.0])
def test_a_late_look_runs_no_batch_past_the_last_request(
    tmp_path: Path, adaptive: bool, late_s: float
) -> None:
    """The engine advances by the time since it last looked; an event loop starved on a busy
    machine looks late. Batches ran for all of that time, after the 8-token warm-up request
    had finished too: a 1 s gap counted ~50 verify batches for 3, and a fresh server showed
    its first decode log (avg_spec_accept_length in /server_info) at --decode-log-interval
    10. A batch runs only while a request needs it, however late the look."""
    accepts = {4: 3.0}
    clock = _Clock()
    engine = Engine(
        PerfTable.from_csv_text(fast_table(accepts)),
        steps=4,
        draft_tokens=5,
        max_running=48,
        state=MetricState(model_name="m", profile=PROFILES["0.5.23"]),
        accept_length=accepts[4],
        accept_noise=0.0,
        seed=1,
        clock=clock,
        controller=(
            Controller(
                4,
                load_slots(
                    PROFILES["0.5.23"].adaptive,  # type: ignore[arg-type]
                    write_config(tmp_path, {"1": {"candidate_steps": [4]}}),
                ),
                PROFILES["0.5.23"].adaptive,  # type: ignore[arg-type]
                cuda_graph_batch_sizes(48),
            )
            if adaptive
            else None
        ),
        accept_lengths=accepts,
        decode_log_interval=10,
    )
    engine.submit(Request(prompt_tokens=1, max_tokens=9, streaming=False, arrival=0.0))
    clock.t += late_s
    engine.advance()
    assert engine.running == []
    batches, _, step_us = engine.decode_moments[0][:3]
    # 9 tokens at 3 a verify: 3 verify batches, 0.002 s each (fast_table's per_token_s).
    assert batches == pytest.approx(3.0)
    assert step_us == pytest.approx(3 * 0.002 * 1e6)
    assert engine.lifetime_accept_length() is None
