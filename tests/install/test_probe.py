"""Install's look at the SGLang it is about to wire specd to (`check_sglang`): a server
that runs another --port than the unit is refused, none answering is warned of, each said
for a URL given with --url and one read from the unit's --host/--port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from factories import SPEC4_ARGS
from twin_thread import INSTANT, TwinThread

from specd.install.probe import check_sglang
from specd.twin.process import free_port

UNIT = "sglang.service"


@pytest.fixture(scope="module")
def twin() -> Iterator[TwinThread]:
    with TwinThread([*SPEC4_ARGS, "--enable-metrics", *INSTANT]) as running:
        running.wait_healthy()
        yield running


@pytest.mark.parametrize("given", [True, False])
def test_the_units_own_server_passes(twin: TwinThread, given: bool) -> None:
    assert check_sglang(twin.url, UNIT, twin.port, given) == (None, None)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (True, "--url {url}: the SGLang there runs --port {port}, but sglang.service runs "
         "--port 30000: that is another server; give the URL sglang.service answers at"),
        (False, "SGLang at {url} (from sglang.service's --host/--port): the SGLang there runs "
         "--port {port}, but sglang.service runs --port 30000: that is another server (a "
         "container that publishes its port under another number?); give the URL "
         "sglang.service answers at with --url"),
    ],
)  # fmt: skip
def test_a_server_that_runs_another_port_is_refused(
    twin: TwinThread, given: bool, says: str
) -> None:
    # What a container publishing 30000 under another number looks like from the host: the
    # unit's command line says --port 30000, the server at the URL says its own port.
    refusal, warning = check_sglang(twin.url, UNIT, 30000, given)
    assert refusal == says.format(url=twin.url, port=twin.port)
    assert warning is None


@pytest.mark.parametrize(
    ("given", "hint"),
    [
        (True, "if sglang.service is running, check --url"),
        (False, "if sglang.service is running, it serves elsewhere (a container that "
         "publishes its port under another number, e.g. `docker run -p 8000:30000`): install "
         "again with --url"),
    ],
)  # fmt: skip
def test_nothing_answering_is_a_warning_not_a_refusal(given: bool, hint: str) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    refusal, warning = check_sglang(url, UNIT, 30000, given)
    assert refusal is None
    assert warning is not None
    assert "does not answer now (" in warning
    assert warning.endswith(f"specd waits for it to come up; {hint}")


def test_a_port_install_cannot_read_is_checked_for_an_answer_only(twin: TwinThread) -> None:
    assert check_sglang(twin.url, UNIT, None, given=True) == (None, None)
