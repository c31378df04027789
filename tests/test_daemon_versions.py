"""The daemon's observe-decide path on every SGLang version specd supports: through the real
reader over HTTP, against the twin at that version and against that version's own pages."""

from __future__ import annotations

from pathlib import Path

import pytest
from factories import OLD_VERSIONS as OLD
from factories import StaticSGLang
from test_daemon import IN_WINDOW, Applier, config, daemon
from twin_thread import INSTANT, TwinThread

from specd.core.decide import Reason
from specd.io.sglang import SGLangClient
from specd.twin.versions import VERSIONS

# The twin's HTTP surface is what the daemon reads: it runs in this process
# (tests/twin_thread.py), up at once.
FAST = [*INSTANT, "--report-interval-s", "0.2"]


def spec(steps: int) -> list[str]:
    return [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(steps + 1),
    ]


@pytest.mark.parametrize("version", VERSIONS)
def test_daemon_on_the_twin_sees_the_live_steps_and_decides(tmp_path: Path, version: str) -> None:
    # The history says one client: the bands policy wants 4 steps; the twin runs 3.
    cfg = config(tmp_path)
    clock = [IN_WINDOW]
    applier = Applier()
    args = [*spec(3), "--enable-metrics", "--sglang-version", version, *FAST]
    with (
        TwinThread(args) as twin,
        SGLangClient(twin.url, timeout_s=5, clock=lambda: clock[0]) as client,
    ):
        twin.wait_healthy(20)
        d = daemon(cfg, client, applier, clock)  # type: ignore[arg-type]
        decision = d.tick()
    # Before 0.5.13 the live 3 can only come from /get_server_info or /server_info.
    assert decision.reason is Reason.CHANGE, decision.message
    assert applier.calls == [("4", "3")]


@pytest.mark.parametrize(
    ("version", "with_info", "live"),
    [(v, True, 4) for v in VERSIONS] + [(v, False, None if v in OLD else 4) for v in VERSIONS],
)
def test_daemon_on_each_versions_own_pages(
    tmp_path: Path, version: str, with_info: bool, live: int | None
) -> None:
    cfg = config(tmp_path)
    clock = [IN_WINDOW]
    applier = Applier()
    server = StaticSGLang(version, with_info=with_info)
    try:
        with SGLangClient(server.url, timeout_s=5, clock=lambda: clock[0]) as client:
            d = daemon(cfg, client, applier, clock)  # type: ignore[arg-type]
            decision = d.tick()
            assert d.live_steps == live
    finally:
        server.close()
    if live == 4:
        # The pages show 4 steps, what the bands policy wants: nothing to change.
        assert decision.reason is Reason.WITHIN_TOLERANCE, decision.message
    else:
        # No gauge (before 0.5.13) and no /server_info: the live setting is unknown, and
        # specd changes nothing rather than guess.
        assert decision.reason is Reason.NO_DATA, decision.message
        assert "unknown" in decision.message
    assert applier.calls == []
