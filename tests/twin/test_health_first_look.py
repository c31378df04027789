"""The twin's /health_generate waits SGLang's second before it answers, or the time a test
gives it (``--health-first-look-s``): the apply and fault tests restart twins that load in a
tenth of a second, and each restart's health probe then waited a whole second."""

from __future__ import annotations

import time

import httpx
import pytest
from factories import SPEC4_ARGS
from twin_thread import INSTANT, TwinThread

from specd.io.tls import verifying_context
from specd.twin.process import TwinProcess


@pytest.mark.parametrize(
    ("flag", "at_least_s", "under_s"),
    [
        ((), 1.0, None),  # SGLang's own: never sooner than a second
        (("--health-first-look-s", "0.2"), 0.2, 1.0),
        (("--health-first-look-s", "0"), 0.0, 1.0),
    ],
)
def test_health_generate_answers_after_its_first_look(
    flag: tuple[str, ...], at_least_s: float, under_s: float | None
) -> None:
    # What is timed is the twin's answer over HTTP: it runs in this process, up at once.
    with TwinThread([*SPEC4_ARGS, *INSTANT, *flag]) as twin:
        twin.wait_healthy(20)
        with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as client:
            took = []
            for _ in range(2):  # the same each time, not only at the first probe
                started = time.monotonic()
                assert client.get("/health_generate").status_code == 200
                took.append(time.monotonic() - started)
            # The flag is the twin's own: SGLang's /server_info does not show it.
            info = client.get("/server_info").json()
    assert all(t >= at_least_s for t in took), took
    if under_s is not None:
        assert all(t < under_s for t in took), took
    assert "health_first_look_s" not in info


def test_a_negative_first_look_is_refused() -> None:
    twin = TwinProcess([*SPEC4_ARGS, "--health-first-look-s", "-1"])
    try:
        assert twin.wait(20) == 2
        said = twin.log()  # before stop(), which removes the log
    finally:
        twin.stop()
    assert "argument --health-first-look-s: must be 0..3600 s, got '-1'" in said
