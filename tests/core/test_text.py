from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specd.core import text
from specd.core.text import (
    ascii_count,
    check_http_url,
    check_service_name,
    duration_text,
    is_service_name,
    iso_time,
    one_line,
)


@pytest.mark.parametrize(
    "name",
    ["sglang.service", "sglang-122b.service", "sglang@1.service", "a:b_c.d\\x2d.service"],
)
def test_service_names_systemd_accepts(name: str) -> None:
    assert is_service_name(name)
    assert check_service_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "sglang",  # not a service
        "sglang.socket",
        "-sglang.service",  # systemctl would read an option
        "--now",
        "a b.service",
        "sglang@.service",  # a template: nothing to restart
        "x/../y.service",
        "s" * 248 + ".service",  # 256 characters: longer than systemd allows
    ],
)
def test_anything_else_is_one_line(name: str) -> None:
    assert not is_service_name(name)
    with pytest.raises(ValueError, match=r"is not a systemd service name such as sglang\.service"):
        check_service_name(name)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
        ("http://127.0.0.1:30000/", "http://127.0.0.1:30000"),
        ("https://sglang.internal", "https://sglang.internal"),
        ("http://[::1]:8000", "http://[::1]:8000"),
    ],
)
def test_http_urls(url: str, expected: str) -> None:
    assert check_http_url(url) == expected


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("not a url", "is not an http(s) URL"),
        ("ftp://host", "is not an http(s) URL"),
        ("http://", "is not an http(s) URL"),
        ("127.0.0.1:30000", "is not an http(s) URL"),
        ("http://host:99999", "has an invalid port"),
        ("http://host:port", "has an invalid port"),
        ("http://[::1", "is not an http(s) URL"),
    ],
)
def test_bad_urls_are_one_line(url: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        check_http_url(url)
    assert str(info.value).startswith(f"{url!r} {problem}")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
        ("http://127.0.0.1:30000/", "http://127.0.0.1:30000"),
        ("https://user:pw@sglang.internal", "https://user:pw@sglang.internal"),
        ("http://[::1]:8000/", "http://[::1]:8000"),
        # Under the root, specd would read /v1/metrics: one line naming the root to give.
        ("http://127.0.0.1:30000/v1", "http://127.0.0.1:30000 (it reads /metrics and "),
        ("http://127.0.0.1:30000/v1/", "http://127.0.0.1:30000 (it reads /metrics and "),
        (
            "http://h:1/v1/chat/completions",
            "http://h:1 (it reads /metrics and /server_info there: drop /v1/chat/completions)",
        ),
        ("http://h:1/metrics", "http://h:1 (it reads /metrics and /server_info there: drop "),
        ("http://h:1?x=1", "http://h:1 (it reads /metrics and /server_info there: drop ?x=1)"),
        ("http://h:1/#top", "http://h:1 (it reads /metrics and /server_info there: drop #top)"),
        ("http://h:1/" + "a" * 5000, "http://h:1 (it reads /metrics and /server_info there: "),
    ],
)
def test_only_a_root_url_is_a_servers_url(url: str, expected: str) -> None:
    if "(it reads" not in expected:
        assert text.check_root_url(url) == expected
        return
    with pytest.raises(ValueError) as info:
        text.check_root_url(url)
    message = str(info.value)
    assert "is not the server's root URL: specd wants " + expected in message
    assert "\n" not in message
    assert len(message) < 300


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0 s"),
        (119, "119 s"),
        (120, "2.0 min"),
        (3600, "60.0 min"),
        (7200, "2.0 h"),
        (86400, "24.0 h"),
        (math.inf, "∞"),
        (math.nan, "?"),
    ],
)
def test_duration_text(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text


@given(
    st.datetimes(
        min_value=datetime(1970, 1, 2),
        max_value=datetime(9998, 12, 31),
        timezones=st.just(timezone.utc),
    ),
    st.sampled_from([timezone.utc, timezone(timedelta(hours=-5)), ZoneInfo("Europe/Berlin")]),
)
def test_an_instant_is_written_to_the_second_with_its_offset(
    instant: datetime, clock: timezone | ZoneInfo
) -> None:
    at = instant.astimezone(clock)  # as specd has its times: an instant, on some clock
    text = iso_time(at)
    back = datetime.fromisoformat(text)
    # The same instant, compared as one: Python never finds an instant of a repeated hour
    # (02:00 in Berlin on a fall-back night) equal to one on another tzinfo (PEP 495).
    assert back.timestamp() == at.replace(microsecond=0).timestamp()
    assert back.utcoffset() == at.utcoffset()
    assert len(text) == len("2026-12-07T03:00:00+01:00")


def test_an_instant_without_a_clock_is_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        iso_time(datetime(2026, 12, 7, 3))


@pytest.mark.parametrize(
    ("value", "limit", "said"),
    [
        ("plain", 10, "plain"),
        ("two\nlines\t and  runs", 40, "two lines and runs"),
        ("x" * 50, 10, "x" * 9 + "…"),
        ("x" * 10, 10, "x" * 10),
        (ValueError("bad\nvalue"), 40, "bad value"),
    ],
)
def test_one_line_flattens_and_cuts(value: object, limit: int, said: str) -> None:
    assert one_line(value, limit) == said
    assert len(one_line(value, limit)) <= limit


@pytest.mark.parametrize(
    ("value", "most", "count"),
    [
        ("0", 9, 0),
        ("42", 9, 42),
        ("123456789", 9, 123456789),
        ("1234567890", 9, None),  # too many digits
        ("9" * 5000, 20, None),  # int() would refuse it
        ("²", 9, None),  # a digit to str.isdigit(), not to int()
        ("٣", 9, None),  # int() reads it as 3
        ("-1", 9, None),
        (" 4", 9, None),
        ("", 9, None),
    ],
)
def test_ascii_count_reads_only_short_ascii_digits(
    value: str, most: int, count: int | None
) -> None:
    assert ascii_count(value, most) == count


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("python -m sglang.launch_server --api-key s3cr3t --port 30000",
         "python -m sglang.launch_server --api-key *** --port 30000"),
        ("x --admin-api-key=adm1n --api-key=k --api-keyish 1",
         "x --admin-api-key=*** --api-key=*** --api-keyish 1"),
        ("x --api-key", "x --api-key"),  # no value to hide
        ("x --model-path /m --speculative-num-steps 3",
         "x --model-path /m --speculative-num-steps 3"),
    ],
)  # fmt: skip
def test_secret_options_are_redacted(command: str, shown: str) -> None:
    # SGLang's /server_info launch_command carries --api-key as given.
    assert text.redact_command(command) == shown


@given(st.lists(st.text(min_size=1, max_size=8).filter(lambda w: " " not in w), max_size=8))
def test_redaction_never_shows_a_value_after_a_secret_option(words: list[str]) -> None:
    shown = text.redact_options(["--api-key", "SECRET", *words, "--admin-api-key=SECRET2"])
    assert shown[:2] == ["--api-key", "***"]
    assert shown[-1] == "--admin-api-key=***"
    assert len(shown) == len(words) + 3
