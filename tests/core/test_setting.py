from __future__ import annotations

import json
import re

import pytest

from specd.core.setting import (
    SpecSetting,
    adaptive,
    adaptive_config,
    adaptive_config_name,
    adaptive_config_text,
    format_setting,
    kinds_available,
    mismatch,
    off,
    outside_steps,
    parse,
    parse_version,
    sglang_args,
    static,
    traits_from_server_info,
    unavailable,
)


@pytest.mark.parametrize(
    ("text", "expected", "canonical"),
    [
        ("off", off(), "off"),
        (" OFF ", off(), "off"),
        ("4", static(4), "4"),
        ("static:7", static(7), "7"),
        ("adaptive:1,3,5", adaptive((1, 3, 5)), "adaptive:1,3,5"),
        ("adaptive:5,1,3", adaptive((1, 3, 5)), "adaptive:1,3,5"),
        (
            "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1",
            adaptive((1, 3, 5, 7), {1: (1, 3, 5, 7), 8: (0, 1, 3), 32: (0, 1)}),
            "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1",
        ),
    ],
)
def test_parse_and_format_round_trip(text: str, expected: SpecSetting, canonical: str) -> None:
    got = parse(text)
    assert got == expected
    assert format_setting(got) == canonical
    assert parse(format_setting(got)) == got


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"is not 'off', a step count"),
        ("fast", r"is not 'off', a step count"),
        ("0", r"static steps must be 1\.\.64, not 0"),
        ("65", r"static steps must be 1\.\.64, not 65"),
        ("-1", r"is not 'off'"),
        ("adaptive:", r"not a comma-separated list"),
        ("adaptive:1,,3", r"not a comma-separated list"),
        ("adaptive:0,1", r"step counts 1\.\.64, not 0"),
        ("adaptive:1,1", r"repeat a step count"),
        ("adaptive:1,2,3,4,5,6,7,8,9", r"at most 8"),
        ("adaptive:1,3/8", r"slot '8' is not BATCH=STEPS"),
        ("adaptive:1,3/8=0,5", r"slot 8 uses steps outside the candidates 1,3"),
        ("adaptive:1,3/8=1;8=3", r"slot 8 is given twice"),
        ("adaptive:1,3/0=1,3", r"batch size must be 1\.\.65536, not 0"),
        ("adaptive:1,3,5/1=1,3;8=0,1", r"candidates 1,3,5 are not the steps its slots use"),
    ],
)
def test_bad_settings_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse(text)
    assert "\n" not in str(info.value)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    ("text", "steps"),
    [
        ("off", {0}),
        ("4", {4}),
        ("adaptive:2,4", {2, 4}),
        ("adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0", {0, 1, 3, 5, 7}),
        ("adaptive:1,3/1=1,3;8=3", {1, 3}),
    ],
)
def test_table_steps_are_every_row_a_prediction_reads(text: str, steps: set[int]) -> None:
    assert parse(text).table_steps == steps


SGLANGS_OWN = "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0"


@pytest.mark.parametrize(
    ("text", "low", "high", "listed", "outside"),
    [
        ("off", 1, 6, (), ()),
        ("4", 1, 6, (), ()),
        ("7", 1, 6, (), (7,)),
        ("1", 2, 6, (), (1,)),
        ("adaptive:3,4", 1, 6, (), ()),
        ("adaptive:3,7", 1, 6, (), (7,)),
        ("adaptive:1,3,5,7", 2, 6, (), (1, 7)),
        # A listed set: the policy chooses it whatever its depth, so a pin and a sweep may.
        (SGLANGS_OWN, 1, 6, (SGLANGS_OWN,), ()),
        (SGLANGS_OWN, 1, 6, ("adaptive:1,3,5,7",), (7,)),  # another set: its slots differ
        ("adaptive:3,7", 1, 6, ("adaptive:3,7",), ()),
    ],
)
def test_the_step_counts_outside_the_range(
    text: str, low: int, high: int, listed: tuple[str, ...], outside: tuple[int, ...]
) -> None:
    assert outside_steps(parse(text), low, high, listed) == outside


def test_equality_and_hash_are_by_value() -> None:
    assert adaptive([3, 4]) == adaptive((4, 3))
    assert len({static(4), static(4), adaptive((3, 4)), off(), off()}) == 3
    assert static(4) != adaptive((4,))


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (off(), ()),
        (
            static(4),
            (
                "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "4",
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5",
            ),
        ),
        (
            adaptive((1, 3)),
            (
                "--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                "--speculative-adaptive", "--speculative-adaptive-config", "/var/lib/specd/a.json",
            ),
        ),
    ],
)  # fmt: skip
def test_sglang_args_per_kind(setting: SpecSetting, expected: tuple[str, ...]) -> None:
    assert sglang_args(setting, algorithm="EAGLE3", config_path="/var/lib/specd/a.json") == expected


@pytest.mark.parametrize(
    ("algorithm", "path", "message"),
    [
        ("eagle; rm", "/x.json", r"not an SGLang algorithm name"),
        ("EAGLE", None, r"must be absolute"),
        ("EAGLE", "rel.json", r"must be absolute"),
        ("EAGLE", "/a b.json", r"without spaces"),
    ],
)
def test_sglang_args_refuse_unsafe_words(algorithm: str, path: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sglang_args(adaptive((2,)), algorithm=algorithm, config_path=path)


def test_adaptive_config_body_matches_sglang_schema() -> None:
    # SGLang's _load_adaptive_config: integer-string batch-size keys, each with candidate_steps.
    one = adaptive((1, 3, 5), {8: (0, 1), 1: (1, 3, 5)})
    assert adaptive_config(one) == {
        "1": {"candidate_steps": [1, 3, 5]},
        "8": {"candidate_steps": [0, 1]},
    }
    assert json.loads(adaptive_config_text(one)) == adaptive_config(one)
    assert adaptive_config(adaptive((2, 4))) == {"1": {"candidate_steps": [2, 4]}}
    assert adaptive_config(adaptive((2, 4)), slots_supported=False) == {"candidate_steps": [2, 4]}
    with pytest.raises(ValueError, match=r"needs per-batch slots"):
        adaptive_config(one, slots_supported=False)
    same = parse(format_setting(one))
    assert adaptive_config_name(same) == adaptive_config_name(one)
    assert adaptive_config_name(one) != adaptive_config_name(adaptive((1, 3, 5)))
    assert re.fullmatch(r"adaptive-[0-9a-f]{16}\.json", adaptive_config_name(one))
    with pytest.raises(ValueError, match=r"setting 4 is not adaptive"):
        adaptive_config(static(4))


GOOD = {
    "speculative_algorithm": "EAGLE3",
    "speculative_eagle_topk": 1,
    "enable_dp_attention": False,
    "version": "0.5.14",
}


@pytest.mark.parametrize(
    ("changes", "setting", "allow_off", "reason"),
    [
        ({}, static(4), False, None),
        ({}, adaptive((1, 3)), False, None),
        ({}, adaptive((1, 3), {1: (1, 3), 8: (0, 1)}), False, None),
        ({}, off(), True, None),
        ({}, off(), False, r"operator does not allow 'off'"),
        ({"speculative_algorithm": "NEXTN"}, adaptive((1, 3)), False, None),
        ({"speculative_algorithm": "eagle"}, adaptive((1, 3)), False, None),
        ({"speculative_algorithm": "STANDALONE"}, static(3), False, None),
        (
            {"speculative_algorithm": "STANDALONE"}, adaptive((1, 3)), False,
            r"EAGLE, EAGLE3 or NEXTN, not STANDALONE",
        ),
        ({"speculative_algorithm": None}, static(3), False, r"no speculative algorithm"),
        ({"speculative_eagle_topk": 4}, static(3), False, r"topk 4"),
        ({"speculative_eagle_topk": 4}, adaptive((3,)), False, r"topk 4"),
        ({"enable_dp_attention": True}, adaptive((1, 3)), False, r"DP attention"),
        ({"enable_dp_attention": True}, static(3), False, None),
        ({"enable_multi_layer_eagle": True}, adaptive((1, 3)), False, r"multi-layer EAGLE"),
        ({"enable_two_batch_overlap": True}, adaptive((1, 3)), False, r"two-batch overlap"),
        ({"enable_pdmux": True}, adaptive((1, 3)), False, r"PD multiplexing"),
        ({"version": "0.5.12"}, adaptive((1, 3)), False, None),
        (
            {"version": "0.5.12"}, adaptive((1, 3), {1: (1, 3)}), False,
            r"per-batch slots need SGLang >= 0\.5\.13; the server runs 0\.5\.12",
        ),
        ({"version": "0.5.13"}, adaptive((1, 3), {1: (1, 3)}), False, None),
        (
            {"version": "0.5.13"}, adaptive((1, 3), {1: (1, 3), 8: (0, 1)}), False,
            r"step 0 in a slot need SGLang >= 0\.5\.14",
        ),
        ({"version": "0.6.0rc1"}, adaptive((1, 3), {1: (1, 3), 8: (0, 1)}), False, None),
        ({"version": None}, adaptive((1, 3), {1: (1, 3)}), False, r"version is unknown"),
    ],
)  # fmt: skip
def test_availability_per_server_info(
    changes: dict[str, object], setting: SpecSetting, allow_off: bool, reason: str | None
) -> None:
    traits = traits_from_server_info({**GOOD, **changes})
    got = unavailable(setting, traits, allow_off=allow_off)
    if reason is None:
        assert got is None
    else:
        assert got is not None
        assert re.search(reason, got), got


def test_kinds_available_names_every_kind() -> None:
    traits = traits_from_server_info({**GOOD, "enable_dp_attention": True})
    got = kinds_available(traits, allow_off=False)
    assert got["static"] is None
    assert got["adaptive"] is not None
    assert "DP attention" in got["adaptive"]
    assert got["off"] is not None
    assert "does not allow" in got["off"]
    assert kinds_available(traits_from_server_info(GOOD), allow_off=True) == {
        "off": None,
        "static": None,
        "adaptive": None,
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.5.14", (0, 5, 14)),
        ("v0.5.13.post1", (0, 5, 13)),
        ("1.0", (1, 0, 0)),
        ("dev", None),
        (None, None),
    ],
)
def test_parse_version(text: object, expected: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == expected


SPEC_INFO = {
    "speculative_algorithm": "EAGLE3",
    "speculative_num_steps": 4,
    "speculative_adaptive": False,
}
ADAPTIVE_INFO = {
    "speculative_algorithm": "EAGLE3",
    "speculative_num_steps": 4,
    "speculative_adaptive": True,
}
OFF_INFO = {"speculative_algorithm": None, "speculative_adaptive": False}


@pytest.mark.parametrize(
    ("setting", "info", "live", "reason"),
    [
        (static(4), SPEC_INFO, 4, None),
        (static(3), SPEC_INFO, 4, r"reports 4 steps"),
        (static(4), ADAPTIVE_INFO, 4, r"runs adaptive mode"),
        (static(4), OFF_INFO, None, r"runs no speculative algorithm"),
        (off(), OFF_INFO, None, None),
        (off(), SPEC_INFO, 4, r"still runs speculative algorithm EAGLE3"),
        (adaptive((3, 4)), ADAPTIVE_INFO, 3, None),
        (adaptive((3, 4)), ADAPTIVE_INFO, None, None),
        (adaptive((3, 4)), ADAPTIVE_INFO, 5, r"runs 5 steps, outside the candidates"),
        (adaptive((3, 4)), ADAPTIVE_INFO, 0, r"outside the candidates"),
        (adaptive((3, 4), {1: (3, 4), 8: (0, 3)}), ADAPTIVE_INFO, 0, None),
        (adaptive((3, 4)), SPEC_INFO, 4, r"adaptive mode off"),
    ],
)  # fmt: skip
def test_mismatch_after_restart(
    setting: SpecSetting, info: dict[str, object], live: int | None, reason: str | None
) -> None:
    got = mismatch(setting, info, live)
    if reason is None:
        assert got is None
    else:
        assert got is not None
        assert re.search(reason, got), got


def test_constructor_refuses_inconsistent_values() -> None:
    with pytest.raises(ValueError, match="no steps or candidates"):
        SpecSetting("off", steps=3)
    with pytest.raises(ValueError, match="has no candidates"):
        SpecSetting("static", steps=3, candidates=(3,))
    with pytest.raises(ValueError, match="candidates, not steps"):
        SpecSetting("adaptive", steps=3, candidates=(3,))
    with pytest.raises(ValueError, match="distinct and ascending"):
        SpecSetting("adaptive", candidates=(4, 3))
    with pytest.raises(ValueError, match="ascending order"):
        SpecSetting("adaptive", candidates=(3,), slots=((8, (3,)), (1, (3,))))
