"""What specd offers to choose: the kinds the operator allows, on the server's traits."""

from __future__ import annotations

import re
from typing import Any

import pydantic
import pytest
from factories import tables

from specd.core.adaptive import DEFAULT_SLOTS
from specd.core.choices import offer
from specd.core.model import adaptive_slots
from specd.core.setting import (
    adaptive,
    format_setting,
    off,
    outside_steps,
    parse,
    static,
    traits_from_server_info,
)
from specd.core.settings import DEFAULT_ADAPTIVE_SETS, ChooseSettings

GOOD = {
    "speculative_algorithm": "EAGLE3",
    "speculative_eagle_topk": 1,
    "enable_dp_attention": False,
    "version": "0.5.14",
}
ALL = ("off", "static", "adaptive")


def choose(**fields: Any) -> ChooseSettings:
    return ChooseSettings.model_validate(tables(**fields).get("choose", {}))


@pytest.mark.parametrize(
    ("changes", "kinds", "expected"),
    [
        # (server_info changes, [choose] kinds, each kind → None or a reason's pattern)
        ({}, ALL, {"off": None, "static": None, "adaptive": None}),
        ({}, ("static",), {"off": r"not in \[choose\] kinds \(static\)", "static": None,
                           "adaptive": r"not in \[choose\] kinds"}),
        ({"speculative_algorithm": "NEXTN"}, ALL, {"adaptive": None}),
        ({"speculative_algorithm": "EAGLE"}, ALL, {"adaptive": None}),
        ({"speculative_algorithm": "STANDALONE"}, ALL,
         {"static": None, "adaptive": r"EAGLE, EAGLE3 or NEXTN, not STANDALONE"}),
        ({"speculative_algorithm": "NGRAM"}, ALL, {"adaptive": r"not NGRAM"}),
        ({"speculative_eagle_topk": 4}, ALL,
         {"off": None, "static": r"topk 4", "adaptive": r"topk 4"}),
        ({"enable_dp_attention": True}, ALL, {"static": None, "adaptive": r"DP attention"}),
        ({"enable_multi_layer_eagle": True}, ALL, {"adaptive": r"multi-layer EAGLE"}),
        ({"enable_two_batch_overlap": True}, ALL, {"adaptive": r"two-batch overlap"}),
        ({"version": "0.5.12"}, ALL,
         {"static": None, "adaptive": r"needs SGLang >= 0\.5\.13 \(per-batch slots\); the "
                                      r"server runs 0\.5\.12"}),
        ({"version": "0.5.13"}, ALL, {"adaptive": None}),
        ({"version": "0.6.0"}, ALL, {"adaptive": None}),
        ({"version": None}, ALL, {"adaptive": r"version is unknown"}),
        ({"speculative_algorithm": None}, ALL,
         {"off": None, "static": r"no speculative algorithm", "adaptive": r"no speculative"}),
    ],
)  # fmt: skip
def test_each_kind_is_offered_only_where_the_server_runs_it(
    changes: dict[str, object], kinds: tuple[str, ...], expected: dict[str, str | None]
) -> None:
    got = offer(choose(kinds=list(kinds)), traits_from_server_info({**GOOD, **changes}))
    for kind, reason in expected.items():
        why = got.kinds[kind]  # type: ignore[index]
        if reason is None:
            assert why is None, f"{kind}: {why}"
        else:
            assert why is not None, kind
            assert re.search(reason, why), f"{kind}: {why}"
        assert got.allows(kind) == (reason is None)  # type: ignore[arg-type]
        offered = {s.kind for s in got.settings}
        assert (kind in offered) == (reason is None)


def test_step_zero_in_a_slot_is_refused_before_0_5_14_and_said_why() -> None:
    sets = ["adaptive:1,3/1=1,3;8=0,1", "adaptive:3,4"]
    cfg = choose(kinds=["adaptive"], adaptive_candidate_sets=sets)
    at_13 = offer(cfg, traits_from_server_info({**GOOD, "version": "0.5.13"}))
    assert [format_setting(s) for s in at_13.settings] == ["adaptive:3,4"]
    assert at_13.refused[0][0] == sets[0]
    assert "step 0 in a slot need SGLang >= 0.5.14" in at_13.refused[0][1]
    assert "adaptive:1,3/1=1,3;8=0,1: not offered: step 0 in a slot" in "\n".join(at_13.lines())
    at_14 = offer(cfg, traits_from_server_info(GOOD))
    assert [format_setting(s) for s in at_14.settings] == sets
    assert at_14.refused == ()


WIRED = "the unit's ExecStart= reads the step variable ${SPECD_STEPS}"


@pytest.mark.parametrize(
    ("table", "static_only", "settings", "notes"),
    [
        # (the calibration's rows, the unit's wiring, what is offered, the lines that say why not)
        (None, None, ["1", "2", "3", "off", "adaptive:1,3", "adaptive:3,4/1=3,4;8=0,3"], []),
        ({0, 1, 2, 3, 4}, None,
         ["1", "2", "3", "off", "adaptive:1,3", "adaptive:3,4/1=3,4;8=0,3"], []),
        # No steps-0 row: off cannot be predicted, nor a set with a 0 tier.
        ({1, 2, 3, 4}, None, ["1", "2", "3", "adaptive:1,3"],
         ["off: not offered: the calibration has no steps-0 row",
          "adaptive:3,4/1=3,4;8=0,3: not offered: the calibration has no rows for steps 0"]),
        ({1, 3}, None, ["1", "2", "3", "adaptive:1,3"],
         ["off: not offered: the calibration has no steps-0 row",
          "adaptive:3,4/1=3,4;8=0,3: not offered: the calibration has no rows for steps 0,4"]),
        # A unit wired with the step variables takes static K only, whatever the table.
        ({0, 1, 2, 3, 4}, WIRED, ["1", "2", "3"],
         [f"off: not offered: {WIRED}", f"adaptive: not offered: {WIRED}"]),
    ],
)  # fmt: skip
def test_only_what_the_calibration_predicts_and_the_unit_takes_is_offered(
    table: set[int] | None, static_only: str | None, settings: list[str], notes: list[str]
) -> None:
    cfg = choose(
        kinds=list(ALL),
        max_steps=3,
        adaptive_candidate_sets=["adaptive:1,3", "adaptive:3,4/1=3,4;8=0,3"],
    )
    table_steps = None if table is None else frozenset(table)
    got = offer(cfg, traits_from_server_info(GOOD), table_steps, static_only)
    assert [format_setting(s) for s in got.settings] == settings
    lines = got.lines()
    assert [line for line in lines if "not offered" in line] == notes


def test_the_default_offers_every_kind_the_server_is_known_to_run() -> None:
    # Unknown traits (no /server_info yet): static K in range and off; adaptive once read.
    got = offer(ChooseSettings(), None)
    assert got.settings == (*(static(k) for k in range(1, 7)), off())
    assert got.lines() == [
        "off: offered (no speculation)",
        "static: offered (steps 1-6)",
        "adaptive: not offered: the server's /server_info has not been read",
    ]
    read = offer(ChooseSettings(), traits_from_server_info(GOOD))
    assert [format_setting(s) for s in read.settings[7:]] == list(DEFAULT_ADAPTIVE_SETS)
    static_only = offer(choose(kinds=["static"]), traits_from_server_info(GOOD))
    assert static_only.settings == tuple(static(k) for k in range(1, 7))
    assert static_only.lines()[0] == "off: not offered: not in [choose] kinds (static)"


def test_offered_settings_come_in_order_static_off_adaptive() -> None:
    cfg = choose(
        kinds=list(ALL), min_steps=2, max_steps=3, adaptive_candidate_sets=["adaptive:2,3"]
    )
    got = offer(cfg, traits_from_server_info(GOOD))
    assert got.settings == (static(2), static(3), off(), adaptive((2, 3)))
    assert got.lines() == [
        "off: offered (no speculation)",
        "static: offered (steps 2-3)",
        "adaptive: offered (adaptive:2,3)",
    ]


def test_the_defaults_start_with_sglangs_own_config() -> None:
    assert ChooseSettings().kinds == ALL
    assert ChooseSettings().adaptive_candidate_sets == DEFAULT_ADAPTIVE_SETS
    assert adaptive_slots(parse(DEFAULT_ADAPTIVE_SETS[0])) == DEFAULT_SLOTS


def test_a_listed_set_is_matched_whatever_spaces_surround_it() -> None:
    """Written " adaptive:1,3,5,7 ", the policy parsed and chose it, while a pin of it (and
    the applier's range check) looked it up by its text and found it unlisted."""
    listed = ChooseSettings(adaptive_candidate_sets=[" adaptive:1,3,5,7 "]).adaptive_candidate_sets
    assert listed == ("adaptive:1,3,5,7",)
    assert outside_steps(parse("adaptive:1,3,5,7"), 1, 6, listed) == ()


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"kinds": []}, r"at least 1"),
        ({"kinds": ["static", "static"]}, r"name a kind twice"),
        ({"kinds": ["sometimes"]}, r"'off', 'static' or 'adaptive'"),
        ({"adaptive_candidate_sets": []}, r"at least 1"),
        ({"adaptive_candidate_sets": ["adaptive:3,1"]}, r"write it as 'adaptive:1,3'"),
        ({"adaptive_candidate_sets": ["adaptive:1,1"]}, r"repeat"),
        ({"adaptive_candidate_sets": ["adaptive:1,3", "adaptive:1,3"]}, r"listed twice"),
        ({"adaptive_candidate_sets": ["4"]}, r"not an adaptive setting"),
        ({"adaptive_candidate_sets": ["adaptive:1,17"]}, r"at most 16"),
        ({"adaptive_candidate_sets": ["adaptive:one"]}, r"not a comma-separated list"),
        ({"adaptive_candidate_sets": ["adaptive:1,3/8=0,1"]}, r"not the steps its slots use"),
        ({"adaptive_restart_extra_s_per_candidate": -1}, r"greater than or equal to 0"),
        ({"adaptive_restart_extra_s_per_candidate": 7200}, r"less than or equal to 3600"),
    ],
)
def test_bad_choices_are_refused_with_the_reason(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        choose(**fields)
    assert re.search(problem, str(info.value)), str(info.value)
