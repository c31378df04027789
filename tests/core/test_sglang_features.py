"""The table of SGLang version features against what each version's own collector code
wrote (tests/fixtures/metrics/versions/) and the twin's separate profiles."""

from __future__ import annotations

import pytest
from factories import version_page, version_server_info
from prometheus_client.parser import text_string_to_metric_families

from specd.core import setting
from specd.core import sglang_features as features
from specd.core.sglang_features import FEATURES, has, lacking, parse_version
from specd.twin.versions import PROFILES, VERSIONS


def _sample_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.parametrize("version", VERSIONS)
def test_a_feature_with_a_metric_is_on_that_versions_own_page_exactly_when_it_has_it(
    version: str,
) -> None:
    parsed = parse_version(version)
    assert parsed is not None
    names = _sample_names(version_page(version, "loaded"))
    for feature in FEATURES:
        if feature.metric is not None:
            assert (feature.metric in names) is has(parsed, feature), (version, feature.name)


@pytest.mark.parametrize("version", VERSIONS)
def test_effective_capacity_is_in_that_versions_server_info_exactly_when_it_has_it(
    version: str,
) -> None:
    parsed = parse_version(version)
    assert parsed is not None
    states = version_server_info(version)["internal_states"]
    shown = all("effective_max_running_requests_per_dp" in st for st in states)
    assert shown is has(parsed, features.EFFECTIVE_CAPACITY)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_twins_profiles_agree_with_the_table(version: str) -> None:
    parsed = parse_version(version)
    assert parsed is not None
    profile = PROFILES[version]
    assert profile.server_info is has(parsed, features.SERVER_INFO)
    assert profile.effective_capacity is has(parsed, features.EFFECTIVE_CAPACITY)
    assert profile.accept_rate_of_drafts is has(parsed, features.ACCEPT_RATE_OF_DRAFTS)
    assert profile.ready is has(parsed, features.READY)
    for feature in FEATURES:
        if feature.metric is not None:
            assert (feature.metric in profile.names) is has(parsed, feature), feature.name


@pytest.mark.parametrize(
    ("version", "lacks"),
    [
        ((0, 5, 4), [f.name for f in FEATURES]),
        ((0, 5, 6), [f.name for f in FEATURES][1:]),
        ((0, 5, 13), ["adaptive_slot_zero", "startup_phases", "ready"]),
        ((0, 5, 20), []),
        ((0, 6, 0), []),
    ],
)
def test_lacking(version: tuple[int, int, int], lacks: list[str]) -> None:
    assert [f.name for f in lacking(version)] == lacks


def test_the_adaptive_versions_are_the_tables() -> None:
    assert features.ADAPTIVE_SLOTS.since == setting.SLOTS_VERSION
    assert features.ADAPTIVE_SLOT_ZERO.since == setting.SLOT_ZERO_VERSION
    assert setting.parse_version is features.parse_version


def test_features_are_in_version_order_with_unique_names() -> None:
    assert [f.since for f in FEATURES] == sorted(f.since for f in FEATURES)
    assert len({f.name for f in FEATURES}) == len(FEATURES)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("0.5.13", (0, 5, 13)),
        ("v0.5.4", (0, 5, 4)),
        ("0.5.23rc1", (0, 5, 23)),
        ("0.5", (0, 5, 0)),
        (" 0.5.6.post1 ", (0, 5, 6)),
        # /server_info is SGLang's to send: what is not a version is an unknown one.
        ("0.5." + "9" * 5000, None),  # int() refuses more than 4300 digits
        ("9" * 5000 + ".5.1", None),
        ("0.5.1234567890", None),
        ("٠.٥.١٣", None),  # digits, but not ASCII ones
        ("0.x.1", None),
        ("", None),
        (None, None),
        (13, None),
    ],
)
def test_parse_version_reads_a_version_or_says_none(text: object, parsed: object) -> None:
    assert parse_version(text) == parsed


def test_the_known_range_is_the_twins_versions() -> None:
    """Doctor names an SGLang outside the versions this table was read from: the range is
    the versions the twin models."""
    known = sorted(features.parse_version(v) for v in VERSIONS)
    assert (known[0], known[-1]) == (features.OLDEST_KNOWN, features.NEWEST_KNOWN)
