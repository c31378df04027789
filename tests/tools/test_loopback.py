"""specd.tools.loopback's load against a real smg in front of a twin: what the fleet tests
and the fleet bench count as a lost request must be one."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from factories import SmgGateway, StreamingLoad

from specd.tools.loopback import _stream_problem
from specd.twin.process import TwinProcess

SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "4",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5",
        "--enable-metrics", "--load-time-s", "0", "--warmup-s", "0"]  # fmt: skip


def test_a_stream_cut_by_a_dead_worker_is_a_lost_request() -> None:
    """smg ends a stream whose worker died with an error event, then `data: [DONE]`: the
    load counted it complete (it looked only for [DONE]), so "no client lost a request"
    in tests/test_fleet_e2e.py and the fleet bench could not fail on a cut stream."""
    twin = TwinProcess(SPEC)
    twin.wait_healthy()
    gateway = SmgGateway([twin.url], retries=False)
    try:
        gateway.wait_ready()
        load = StreamingLoad(gateway.url, 0, max_tokens=20)
        ended: list[str | None] = []
        with httpx.Client(timeout=30) as http:
            model = http.get(gateway.url + "/v1/models").json()["data"][0]["id"]
            assert load._one(http, model) is None  # a whole stream is complete
            long = StreamingLoad(gateway.url, 0, max_tokens=20000)
            cut = threading.Thread(target=lambda: ended.append(long._one(http, model)))
            cut.start()
            time.sleep(1.0)
            twin.kill()  # SGLang dies mid-stream (an OOM kill, a restart without a drain)
            cut.join(30)
        [problem] = ended
        assert problem is not None
        assert problem.startswith(("stream error: ", "stream cut after ")), problem
    finally:
        gateway.stop()
        twin.stop()


FINISH = 'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}'
TOKEN = 'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}'
USAGE = 'data: {"choices": [], "usage": {"completion_tokens": 2}}'


@pytest.mark.parametrize(
    ("lines", "problem"),
    [
        ([TOKEN, FINISH, "data: [DONE]"], None),
        # include_usage: SGLang's usage-only event follows the finish (it was read as a
        # stream that never finished).
        ([TOKEN, FINISH, USAGE, "data: [DONE]"], None),
        ([TOKEN, FINISH, "", USAGE, "", "data: [DONE]"], None),
        ([TOKEN, USAGE, "data: [DONE]"], "no finish_reason"),
        ([TOKEN, "data: [DONE]"], "no finish_reason"),
        ([TOKEN, FINISH], "stream cut"),
        ([TOKEN, 'data: {"error": {"message": "worker died"}}', "data: [DONE]"], "worker died"),
        ([TOKEN, "data: {nope", "data: [DONE]"], "not a JSON event"),
        ([TOKEN, "data: [1]", "data: [DONE]"], "not an event object"),
    ],
)
def test_stream_problem(lines: list[str], problem: str | None) -> None:
    found = _stream_problem(lines)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found
