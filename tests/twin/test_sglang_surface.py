"""What the twin answers where SGLang 0.5.23's HTTP server (FastAPI under uvicorn) answers
something particular: default limits, /generate's refusals and meta_info, the bytes and
headers of its JSON, validation errors, the routes (a model's card, the /metrics mount,
CORS), request ids and batches, routing keys, and the order of the HTTP metrics' series."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from factories import SPEC4_ARGS
from twin_thread import INSTANT, TwinThread

from specd.io.tls import verifying_context

FAST = (*INSTANT, "--report-interval-s", "0.05", "--enable-metrics")
CONTEXT = 40  # --context-length: a chat completion without a limit ends inside it
CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
MESSAGES = [{"role": "user", "content": "x"}]
META_KEYS = ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
             "reasoning_tokens", "completion_tokens", "cached_tokens"]  # fmt: skip
SPEC_KEYS = ["spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts",
             "spec_num_proposed_drafts", "spec_verify_ct"]  # fmt: skip
SGLANG_FILE = "/sgl-workspace/sglang/python/sglang/srt/entrypoints/http_server.py"


@pytest.fixture(scope="module")
def twin() -> Iterator[TwinThread]:
    with TwinThread([*SPEC4_ARGS, *FAST, "--context-length", str(CONTEXT)]) as started:
        started.wait_healthy(20)
        yield started


@pytest.fixture(scope="module")
def plain_twin() -> Iterator[TwinThread]:
    """No speculation."""
    with TwinThread([*FAST]) as started:
        started.wait_healthy(20)
        yield started


@pytest.fixture
def http(twin: TwinThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=twin.url, timeout=20, verify=verifying_context()) as client:
        yield client


def _completion_tokens(path: str, out: Any) -> int:
    if path == GENERATE:
        return int(out["meta_info"]["completion_tokens"])
    return int(out["usage"]["completion_tokens"])


# (endpoint, body, tokens generated): protocol.CompletionRequest's 16, SamplingParams' 128,
# a chat completion's max_completion_tokens over its max_tokens.
DEFAULTS: list[Any] = [
    pytest.param(COMPLETIONS, {"prompt": "x"}, 16, id="completions-16"),
    pytest.param(GENERATE, {"text": "x"}, 128, id="generate-128"),
    pytest.param(
        GENERATE, {"text": "x", "sampling_params": {"max_new_tokens": 0}}, 0, id="generate-0"
    ),
    pytest.param(
        CHAT,
        {"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 7},
        7,
        id="chat-max-completion-tokens",
    ),
    pytest.param(CHAT, {"messages": MESSAGES, "max_tokens": 5}, 5, id="chat-max-tokens"),
]


@pytest.mark.parametrize(("path", "body", "tokens"), DEFAULTS)
def test_default_limits(
    path: str, body: dict[str, Any], tokens: int, plain_twin: TwinThread
) -> None:
    resp = httpx.post(plain_twin.url + path, json=body, timeout=20)
    assert resp.status_code == 200, resp.text
    assert _completion_tokens(path, resp.json()) == tokens


def test_chat_without_a_limit_ends_at_the_context(http: httpx.Client) -> None:
    """Scheduler.init_req_max_new_tokens: no limit is 2^30, cut to max_req_len (the
    context's, /server_info's max_req_input_len + 5) minus the prompt and one."""
    info = http.get("/server_info").json()
    out = http.post(CHAT, json={"messages": MESSAGES}).json()
    prompt = out["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == info["max_req_input_len"] + 5 - prompt - 1
    assert out["usage"]["completion_tokens"] == CONTEXT - 1 - prompt - 1


# (body, status, answer): TokenizerManager's refusals as {"error": {"message"}}, the API
# contract's as {"error": text}.
GENERATE_REFUSALS: list[Any] = [
    pytest.param(
        {},
        {"error": {"message": "Either text, input_ids or input_embeds should be provided."}},
        id="no-input",
    ),
    pytest.param(
        {"text": "x", "sampling_params": {"max_new_tokens": -1}},
        {"error": {"message": "max_new_tokens must be at least 0, got -1."}},
        id="negative",
    ),
    pytest.param(
        {"text": "x", "sampling_params": {"max_new_tokens": "abc"}},
        {"error": 'invalid type: string "abc", expected i64'},
        id="contract",
    ),
    pytest.param(
        {"text": ["a", "b"], "rid": ["r"]},
        {
            "error": {
                "message": "The specified rids length mismatch with the batch_size "
                "for batch processing."
            }
        },
        id="rids",
    ),
]


@pytest.mark.parametrize(("body", "answer"), GENERATE_REFUSALS)
def test_generate_refusals(body: dict[str, Any], answer: Any, http: httpx.Client) -> None:
    resp = http.post(GENERATE, json=body)
    assert resp.status_code == 400
    assert resp.content == json.dumps(answer, separators=(",", ":")).encode()
    assert resp.headers["content-type"] == "application/json"


def test_a_streamed_generate_refusal_is_an_event(http: httpx.Client) -> None:
    resp = http.post(GENERATE, json={"stream": True})
    assert resp.status_code == 200
    error = {"message": "Either text, input_ids or input_embeds should be provided.",
             "type": "invalid_request_error", "code": 400, "retryable": False}  # fmt: skip
    assert resp.text == f"data: {json.dumps({'error': error}, separators=(',', ':'))}\n\n" + (
        "data: [DONE]\n\n"
    )


def _events(text: str) -> list[dict[str, Any]]:
    lines = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_generate_meta_info_with_speculation(http: httpx.Client) -> None:
    out = http.post(GENERATE, json={"text": "x", "sampling_params": {"max_new_tokens": 20}})
    answer = out.json()
    assert list(answer) == ["text", "output_ids", "meta_info"]
    meta = answer["meta_info"]
    assert list(meta) == [*META_KEYS, "e2e_latency", *SPEC_KEYS]
    assert meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] == pytest.approx(20 / meta["spec_verify_ct"])
    assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * 4  # 5 draft tokens
    assert len(answer["output_ids"]) == 20
    events = _events(
        http.post(
            GENERATE, json={"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 20}}
        ).text
    )
    assert len(events) > 1
    for event in events[:-1]:  # not finished: no latency, no draft figures
        assert list(event["meta_info"]) == META_KEYS
    assert list(events[-1]["meta_info"]) == [*META_KEYS, "e2e_latency", *SPEC_KEYS]


def test_generate_meta_info_without_speculation(plain_twin: TwinThread) -> None:
    body = {"text": "x", "sampling_params": {"max_new_tokens": 5}}
    meta = httpx.post(plain_twin.url + GENERATE, json=body, timeout=20).json()["meta_info"]
    assert list(meta) == [*META_KEYS, "e2e_latency"]


def test_generate_takes_the_rid_and_batches(http: httpx.Client) -> None:
    params = {"max_new_tokens": 3}
    one = http.post(GENERATE, json={"text": "x", "rid": "mine", "sampling_params": params})
    assert one.json()["meta_info"]["id"] == "mine"
    batch = http.post(GENERATE, json={"text": ["x", "y z"], "rid": "r", "sampling_params": params})
    answers = batch.json()
    assert [a["meta_info"]["id"] for a in answers] == ["r_0", "r_1"]
    assert [a["meta_info"]["prompt_tokens"] for a in answers] == [1, 2]
    body = {"text": ["x", "y"], "rid": ["a", "b"], "stream": True, "sampling_params": params}
    events = _events(http.post(GENERATE, json=body).text)
    assert {(e["index"], e["meta_info"]["id"]) for e in events} == {(0, "a"), (1, "b")}
    assert all(list(e)[-1] == "index" for e in events)
    by_ids = http.post(GENERATE, json={"input_ids": [1, 2, 3], "sampling_params": params})
    assert by_ids.json()["meta_info"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    "path",
    [
        "/model_info",
        "/get_model_info",
        "/server_info",
        "/get_server_info",
        "/v1/models",
        "/v1/loads",
        "/v1/models/Qwen/Qwen3.5-122B-A10B",
        "/no_such_route",
    ],
)
def test_json_is_compact_and_served_by_uvicorn(path: str, http: httpx.Client) -> None:
    resp = http.get(path)
    assert resp.headers["content-type"] == "application/json"
    assert resp.headers["server"] == "uvicorn"
    compact = json.dumps(resp.json(), separators=(",", ":"), ensure_ascii=False).encode()
    assert resp.content == compact


def test_generate_json_is_compact(http: httpx.Client) -> None:
    body = {"text": "x", "sampling_params": {"max_new_tokens": 3}}
    resp = http.post(GENERATE, json=body)
    assert resp.content == json.dumps(resp.json(), separators=(",", ":")).encode()
    stream = http.post(GENERATE, json={**body, "stream": True}).text
    for event in _events(stream):
        assert f"data: {json.dumps(event, separators=(',', ':'))}\n\n" in stream


def test_freeze_gc_has_no_media_type(http: httpx.Client) -> None:
    resp = http.get("/freeze_gc")
    assert resp.text == "Garbage collection frozen.\n"
    assert "content-type" not in resp.headers


# (path, raw body, the start of the message): FastAPI's RequestValidationError, worded by
# http_server.validation_exception_handler.
INVALID: list[Any] = [
    pytest.param(COMPLETIONS, b"{", "{'type': 'json_invalid', 'loc': ('body', 1)", id="json"),
    pytest.param(
        COMPLETIONS,
        b"[1]",
        "{'type': 'model_attributes_type', 'loc': ('body',)",
        id="not-an-object",
    ),
    pytest.param(
        COMPLETIONS, b"{}", "{'type': 'missing', 'loc': ('body', 'prompt')", id="no-prompt"
    ),
    pytest.param(
        COMPLETIONS,
        b'{"prompt": "x", "max_tokens": 0}',
        "{'type': 'value_error', 'loc': ('body', 'max_tokens'), 'msg': 'Value error, "
        "max_tokens must be positive'",
        id="max-tokens-0",
    ),
    pytest.param(
        COMPLETIONS,
        b'{"prompt": "x", "max_tokens": "abc"}',
        "{'type': 'int_parsing', 'loc': ('body', 'max_tokens')",
        id="max-tokens-abc",
    ),
    pytest.param(
        CHAT,
        b"{}",
        "{'type': 'missing', 'loc': ('body', 'messages'), "
        "'msg': 'Field required', 'input': {'tool_choice': 'none'}}",
        id="no-messages",
    ),
    pytest.param(
        GENERATE, b"[1]", "{'type': 'dataclass_type', 'loc': ('body',)", id="generate-not-an-object"
    ),
]
LINES = {COMPLETIONS: "line 1861, in openai_v1_completions",
         CHAT: "line 1871, in openai_v1_chat_completions",
         GENERATE: "line 933, in generate_request"}  # fmt: skip


@pytest.mark.parametrize(("path", "raw", "first"), INVALID)
def test_validation_errors(path: str, raw: bytes, first: str, http: httpx.Client) -> None:
    resp = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    answer = resp.json()
    assert (answer["object"], answer["type"], answer["code"]) == ("error", "Bad Request", 400)
    message = answer["message"]
    assert message.startswith("1 validation error:\n  " + first)
    assert f'\n\n  File "{SGLANG_FILE}", {LINES[path]}\n    POST {path} [' in message


def test_a_model_card_by_name(twin: TwinThread, http: httpx.Client) -> None:
    name = twin.config.model_name
    card = http.get(f"/v1/models/{name}").json()
    listed = http.get("/v1/models").json()["data"][0]
    assert isinstance(card.pop("created"), int)
    listed.pop("created")
    assert card == listed
    missing = http.get("/v1/models/other/model")
    assert missing.status_code == 404
    assert missing.json() == {"error": {"message": "The model 'other/model' does not exist",
                                        "type": "invalid_request_error", "param": "model",
                                        "code": "model_not_found"}}  # fmt: skip


def _count(page: str, family: str, **labels: str) -> float:
    total = 0.0
    for line in page.splitlines():
        match = re.match(rf"{re.escape(family)}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/metrics/"), ("GET", "/metricsX"), ("POST", "/metrics/anything")]
)
def test_metrics_is_a_mount(method: str, path: str, http: httpx.Client) -> None:
    before = _count(http.get("/metrics").text, "sglang:http_requests_total", endpoint="/metrics")
    resp = http.request(method, path)
    assert resp.status_code == 200
    assert "# TYPE sglang:http_requests_total counter" in resp.text
    after = _count(http.get("/metrics").text, "sglang:http_requests_total", endpoint="/metrics")
    assert after == before + 2  # labelled as the mount's path


def test_cors(http: httpx.Client) -> None:
    origin = "http://ui.example"
    asked = {"Origin": origin, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "X-Custom, Authorization"}  # fmt: skip
    preflight = http.options(CHAT, headers=asked)
    assert (preflight.status_code, preflight.text) == (200, "OK")
    assert preflight.headers["access-control-allow-origin"] == origin
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert preflight.headers["access-control-allow-headers"] == "X-Custom, Authorization"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    simple = http.get("/v1/models", headers={"Origin": origin})
    assert simple.headers["access-control-allow-origin"] == origin
    assert simple.headers["access-control-allow-credentials"] == "true"
    assert simple.headers["vary"] == "Origin"
    # Without a preflight's headers an OPTIONS is routed: no route takes it.
    assert http.options("/v1/models").status_code == 405


def test_routing_keys_are_counted_while_active(http: httpx.Client) -> None:
    body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 10**5}}
    key = {"x-smg-routing-key": "tenant-a"}
    stop = threading.Event()

    def hold() -> None:
        with http.stream("POST", GENERATE, json=body, headers=key) as stream:
            for _ in stream.iter_lines():
                if stop.is_set():
                    return

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for holder in holders:
        holder.start()
    try:
        deadline = time.monotonic() + 10
        active = 0.0
        while time.monotonic() < deadline:
            page = http.get("/metrics").text
            active = _count(page, "sglang:http_requests_active", endpoint=GENERATE)
            if active == 2:
                break
            time.sleep(0.05)
        assert active == 2
        assert _count(page, "sglang:routing_keys_active") == 1  # two requests, one key
    finally:
        stop.set()
        for holder in holders:
            holder.join(20)
    time.sleep(0.2)
    assert _count(http.get("/metrics").text, "sglang:routing_keys_active") == 0


def test_http_series_in_first_use_order(plain_twin: TwinThread) -> None:
    with httpx.Client(base_url=plain_twin.url, timeout=20) as client:
        client.get("/v1/models")
        client.get("/health_generate")
        page = client.get("/metrics").text
    endpoints = re.findall(r'^sglang:http_requests_total\{endpoint="([^"]+)"', page, re.M)
    assert endpoints.index("/v1/models") < endpoints.index("/health_generate")
    # The warm-up's first request comes first of all but the fixture's /health polls,
    # which wait_healthy sends from outside while it runs (on a loaded machine, one came
    # before it).
    assert next(e for e in endpoints if e != "/health") == "/model_info"
