"""The twin's OpenAI answers, chunk by chunk, against SGLang 0.5.23's own code (read from
python/sglang/srt/entrypoints/openai/): serving_chat._generate_chat_stream writes its
chunks with sse_utils.build_sse_content (msgspec structs that leave out what is at its
default, except the delta's reasoning_content), serving_completions its with pydantic's
model_dump_json; utils.should_include_usage decides where usage goes; the requests
serving_*._validate_request and http_server.validate_json_request refuse are HTTP 400s
with an ErrorResponse body.

Each test talks HTTP to a twin started in this process (tests/twin_thread.py)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from factories import SPEC4_ARGS
from twin_thread import INSTANT, TwinThread

from specd.io.tls import verifying_context
from specd.twin.server import WORDS

FAST = (*INSTANT, "--report-interval-s", "0.05")
MAX_TOKENS = 23  # several chunks at 4 speculative steps (up to 5 tokens a verify)
PROMPT_WORDS = "a b c"  # 3 prompt tokens, as the twin counts them
RID = re.compile(r"[0-9a-f]{32}")  # uuid.uuid4().hex: GenerateReqInput's rid
SSE = re.compile(r"(?:data: [^\n]+\n\n)+")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ROLE_DELTA = {"reasoning_content": None, "role": "assistant", "content": ""}
FINISH_DELTA = {"reasoning_content": None}


@pytest.fixture(scope="module")
def twin() -> Iterator[TwinThread]:
    with TwinThread([*SPEC4_ARGS, *FAST]) as started:
        started.wait_healthy(20)
        yield started


@pytest.fixture(scope="module")
def reporting_twin() -> Iterator[TwinThread]:
    """Usage in every stream's last chunk by default, cached tokens reported."""
    flags = ["--stream-response-default-include-usage", "--enable-cache-report"]
    with TwinThread([*SPEC4_ARGS, *FAST, *flags]) as started:
        started.wait_healthy(20)
        yield started


def _body(path: str, stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "stream": stream, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": PROMPT_WORDS}]
    else:
        body["prompt"] = PROMPT_WORDS
    return body


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=20, verify=verifying_context())


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    """The stream's chunks: ``data: {json}\\n\\n`` each, then ``data: [DONE]\\n\\n``."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    text = response.text
    assert SSE.fullmatch(text), text[:500]
    assert text.endswith("data: [DONE]\n\n")
    events = text.removesuffix("\n\n").split("\n\n")
    assert events.count("data: [DONE]") == 1
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    # Written as orjson, msgspec and pydantic write JSON: compact.
    for event, chunk in zip(events[:-1], chunks, strict=True):
        assert event == "data: " + json.dumps(chunk, separators=(",", ":")), event
    return chunks


def _tokens(text: str) -> int:
    """How many of the twin's tokens ``text`` is (its output is WORDS over and over)."""
    n, out = 0, ""
    while len(out) < len(text):
        out += WORDS[n % len(WORDS)]
        n += 1
    assert out == text, (out, text)
    return n


def _usage(completion: int, *, cached: bool = False) -> dict[str, Any]:
    """UsageInfo.model_dump(): 3 prompt tokens, no reasoning, nothing cached."""
    return {
        "prompt_tokens": 3,
        "total_tokens": 3 + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": 0} if cached else None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def _head(chunks: list[dict[str, Any]], obj: str, model: str, rid: str | None) -> dict[str, Any]:
    """The id, object, created and model every chunk of one stream shares."""
    first = chunks[0]
    head = {"id": first["id"], "object": obj, "created": first["created"], "model": model}
    if rid is None:
        assert RID.fullmatch(first["id"]), first["id"]
    else:
        assert first["id"] == rid
    assert isinstance(first["created"], int)
    assert abs(first["created"] - time.time()) < 30
    return head


# (stream_options, per-chunk usage, a final usage chunk): utils.should_include_usage.
STREAM_OPTIONS: list[Any] = [
    pytest.param(None, False, False, id="absent"),
    pytest.param({}, False, False, id="empty"),
    pytest.param({"include_usage": False}, False, False, id="include-false"),
    pytest.param({"include_usage": True}, False, True, id="include"),
    pytest.param({"continuous_usage_stats": True}, True, False, id="continuous-alone"),
    pytest.param({"include_usage": True, "continuous_usage_stats": True}, True, True, id="both"),
]
# (extra request fields, the model the answer names, the id it has; None: a fresh rid).
NAMING: list[Any] = [
    pytest.param({}, "default", None, id="no-model"),
    pytest.param({"model": "qwen-test", "rid": "my-request-7"}, "qwen-test", "my-request-7",
                 id="model-and-rid"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "model", "rid"), NAMING)
@pytest.mark.parametrize(("options", "per_chunk", "final"), STREAM_OPTIONS)
def test_chat_stream_is_role_then_content_then_finish_then_usage(
    twin: TwinThread,
    options: dict[str, bool] | None,
    per_chunk: bool,
    final: bool,
    extra: dict[str, Any],
    model: str,
    rid: str | None,
) -> None:
    if options is not None:
        extra = {**extra, "stream_options": options}
    chunks = _events(_post(twin.url, CHAT, _body(CHAT, True, **extra)))
    head = _head(chunks, "chat.completion.chunk", model, rid)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                  "matched_stop": None}  # fmt: skip
        return {**head, "choices": [choice]}

    tail = [{**head, "choices": [], "usage": _usage(MAX_TOKENS)}] if final else []
    assert chunks[0] == chunk(ROLE_DELTA)  # the role alone, no usage even when continuous
    content, ending = chunks[1 : len(chunks) - 1 - len(tail)], chunks[len(chunks) - 1 - len(tail) :]
    assert ending == [chunk(FINISH_DELTA, "length"), *tail]
    assert len(content) >= 2
    text = ""
    for got in content:
        piece = got["choices"][0]["delta"]["content"]
        assert isinstance(piece, str)
        assert piece
        text += piece
        expected = chunk({"reasoning_content": None, "content": piece})
        if per_chunk:
            expected["usage"] = _usage(_tokens(text))  # the count so far
        assert got == expected
    assert _tokens(text) == MAX_TOKENS


@pytest.mark.parametrize(("extra", "model", "rid"), NAMING)
@pytest.mark.parametrize(("options", "per_chunk", "final"), STREAM_OPTIONS)
def test_completion_stream_finishes_on_its_last_text_then_usage(
    twin: TwinThread,
    options: dict[str, bool] | None,
    per_chunk: bool,
    final: bool,
    extra: dict[str, Any],
    model: str,
    rid: str | None,
) -> None:
    if options is not None:
        extra = {**extra, "stream_options": options}
    chunks = _events(_post(twin.url, COMPLETIONS, _body(COMPLETIONS, True, **extra)))
    head = _head(chunks, "text_completion", model, rid)
    if final:
        # model_dump_json(exclude_none=True): no null details.
        usage = {"prompt_tokens": 3, "total_tokens": 3 + MAX_TOKENS,
                 "completion_tokens": MAX_TOKENS, "reasoning_tokens": 0}  # fmt: skip
        assert chunks.pop() == {**head, "choices": [], "usage": usage}
    assert len(chunks) >= 2
    text = ""
    for i, got in enumerate(chunks):
        piece = got["choices"][0]["text"]
        assert isinstance(piece, str)
        assert piece
        text += piece
        last = i == len(chunks) - 1
        choice = {"index": 0, "text": piece, "logprobs": None,
                  "finish_reason": "length" if last else None, "matched_stop": None}  # fmt: skip
        # usage is there, null, unless continuous_usage_stats.
        usage = _usage(_tokens(text)) if per_chunk else None
        assert got == {**head, "choices": [choice], "usage": usage}
    assert _tokens(text) == MAX_TOKENS


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("extra", "model", "rid"), NAMING)
@pytest.mark.parametrize(
    "options", [None, {"include_usage": True, "continuous_usage_stats": True}]
)  # stream_options do nothing without a stream
def test_answers_without_a_stream(
    twin: TwinThread,
    path: str,
    extra: dict[str, Any],
    model: str,
    rid: str | None,
    options: dict[str, bool] | None,
) -> None:
    if options is not None:
        extra = {**extra, "stream_options": options}
    before = int(time.time())
    response = _post(twin.url, path, _body(path, False, **extra))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    answer = response.json()
    assert response.text == json.dumps(answer, separators=(",", ":"))
    assert before <= answer["created"] <= time.time()
    if rid is None:
        assert RID.fullmatch(answer["id"]), answer["id"]
    text = "".join(WORDS[i % len(WORDS)] for i in range(MAX_TOKENS))
    if path == CHAT:
        obj = "chat.completion"
        choice = {"index": 0,
                  "message": {"role": "assistant", "content": text, "reasoning_content": None},
                  "logprobs": None, "finish_reason": "length", "matched_stop": None}  # fmt: skip
    else:
        obj = "text_completion"
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                  "matched_stop": None}  # fmt: skip
    assert answer == {
        "id": rid or answer["id"],
        "object": obj,
        "created": answer["created"],
        "model": model,
        "choices": [choice],
        "usage": _usage(MAX_TOKENS),
        "metadata": {"weight_version": "default"},
    }


@pytest.mark.parametrize(
    "options", [None, {"include_usage": False}, {"continuous_usage_stats": True}]
)
def test_server_default_usage_and_cache_report(
    reporting_twin: TwinThread, options: dict[str, bool] | None
) -> None:
    """--stream-response-default-include-usage: the final usage chunk whatever the request
    says; --enable-cache-report: cached tokens in usage (the per-chunk usage of chat only,
    and the non-streamed answer's)."""
    extra = {} if options is None else {"stream_options": options}
    continuous = options is not None and "continuous_usage_stats" in options
    chat = _events(_post(reporting_twin.url, CHAT, _body(CHAT, True, **extra)))
    assert chat[-1]["choices"] == []
    assert chat[-1]["usage"] == _usage(MAX_TOKENS, cached=True)
    assert chat[-2]["choices"][0]["finish_reason"] == "length"
    for got in chat[1:-2]:
        assert ("usage" in got) is continuous
        if continuous:
            assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    completions = _events(_post(reporting_twin.url, COMPLETIONS, _body(COMPLETIONS, True, **extra)))
    assert completions[-1]["choices"] == []
    assert completions[-1]["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 3 + MAX_TOKENS,
        "completion_tokens": MAX_TOKENS,
        "prompt_tokens_details": {"cached_tokens": 0},
        "reasoning_tokens": 0,
    }
    for got in completions[:-1]:
        if continuous:
            assert got["usage"]["prompt_tokens_details"] is None
        else:
            assert got["usage"] is None
    for path in (CHAT, COMPLETIONS):
        answer = _post(reporting_twin.url, path, _body(path, False)).json()
        assert answer["usage"] == _usage(MAX_TOKENS, cached=True)


def _error(message: str, kind: str) -> dict[str, Any]:
    """ErrorResponse.model_dump() as ORJSONResponse writes it."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": 400}


_MEDIA = (
    "1 validation error:\n  {'loc': ['header', 'content-type'], 'msg': \"Unsupported Media "
    "Type: Only 'application/json' is allowed\", 'type': 'value_error'} [{'loc': ['header', "
    "'content-type'], 'msg': \"Unsupported Media Type: Only 'application/json' is allowed\", "
    "'type': 'value_error'}]"
)
EMPTY_CHAT = _error("Messages cannot be empty.", "BadRequestError")
EMPTY_PROMPT = _error("Prompt cannot be empty", "BadRequestError")
NOT_JSON = _error(_MEDIA, "Bad Request")
# (path, body, Content-Type, the answer); a Content-Type of None: none sent.
REFUSED: list[Any] = [
    pytest.param(CHAT, {"messages": []}, "application/json", EMPTY_CHAT, id="chat-empty"),
    pytest.param(CHAT, {"messages": [], "stream": True}, "application/json", EMPTY_CHAT,
                 id="chat-empty-stream"),
    pytest.param(COMPLETIONS, {"prompt": ""}, "application/json", EMPTY_PROMPT, id="prompt-empty"),
    pytest.param(COMPLETIONS, {"prompt": "", "stream": True}, "application/json", EMPTY_PROMPT,
                 id="prompt-empty-stream"),
    pytest.param(COMPLETIONS, {"prompt": []}, "application/json", EMPTY_PROMPT,
                 id="prompt-no-list"),
    pytest.param(COMPLETIONS, {"prompt": ["", ""]}, "application/json", EMPTY_PROMPT,
                 id="prompt-empty-strings"),
    pytest.param(COMPLETIONS, {"prompt": [[], []]}, "application/json", EMPTY_PROMPT,
                 id="prompt-empty-token-lists"),
    pytest.param(CHAT, {"messages": [{"role": "user", "content": "hi"}]}, "text/plain", NOT_JSON,
                 id="chat-text-plain"),
    pytest.param(COMPLETIONS, {"prompt": "hi"}, "text/plain", NOT_JSON,
                 id="completions-text-plain"),
    pytest.param(COMPLETIONS, {"prompt": "hi"}, None, NOT_JSON, id="completions-no-content-type"),
    pytest.param(COMPLETIONS, {"prompt": "hi"}, "application/jsonl", NOT_JSON,
                 id="completions-jsonl"),
    pytest.param(CHAT, {"messages": []}, "application/x-www-form-urlencoded", NOT_JSON,
                 id="media-type-checked-first"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "content_type", "answer"), REFUSED)
def test_requests_sglang_refuses_are_400_with_its_error_body(
    twin: TwinThread,
    path: str,
    body: dict[str, Any],
    content_type: str | None,
    answer: dict[str, Any],
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = httpx.post(
        twin.url + path,
        content=json.dumps({"max_tokens": 5, **body}).encode(),
        headers=headers,
        timeout=20,
        verify=verifying_context(),
    )
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json() == answer
    assert response.text == json.dumps(answer, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_json_by_any_spelling_of_its_media_type_is_taken(
    twin: TwinThread, path: str, content_type: str
) -> None:
    response = httpx.post(
        twin.url + path,
        content=json.dumps(_body(path, False)).encode(),
        headers={"Content-Type": content_type},
        timeout=20,
        verify=verifying_context(),
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_refused_requests_never_reach_the_scheduler() -> None:
    with TwinThread([*SPEC4_ARGS, *FAST, "--enable-metrics"]) as started:
        started.wait_healthy(20)
        with httpx.Client(base_url=started.url, timeout=20, verify=verifying_context()) as c:
            assert c.post(CHAT, json={"messages": [], "stream": True}).status_code == 400
            assert c.post(COMPLETIONS, json={"prompt": ""}).status_code == 400
            plain = {"Content-Type": "text/plain"}
            assert c.post(COMPLETIONS, content=b'{"prompt": "x"}', headers=plain).status_code == 400
            time.sleep(0.2)  # the scheduler's next reports
            page = c.get("/metrics").text
    # Only the warm-up's /generate.
    counts = re.findall(r"^sglang:num_requests_total\{[^}]*\} (\S+)$", page, re.MULTILINE)
    assert counts
    assert sum(float(v) for v in counts) == 1
