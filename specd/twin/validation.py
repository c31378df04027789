"""SGLang's request validation errors, as its FastAPI app words them.

SGLang declares its OpenAI bodies as pydantic models (entrypoints/openai/protocol.py) and
/generate's as a dataclass (io_struct.GenerateReqInput); FastAPI turns what does not
validate into a RequestValidationError, which http_server.validation_exception_handler
answers with 400 and an ErrorResponse of type "Bad Request" whose message is FastAPI's
str() of the exception, then its errors. The twin validates the fields it reads with the
same pydantic, so the errors are pydantic's own.
"""

from __future__ import annotations

import json
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

# protocol.DEFAULT_MODEL_NAME: the model an OpenAI request names when it names none.
DEFAULT_MODEL_NAME = "default"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # protocol.CompletionRequest.max_tokens

# FastAPI 0.124+ ends the message with where the endpoint is defined: SGLang 0.5.23's
# http_server.py in the official image (an editable install under /sgl-workspace), the
# line of each handler's `def` there.
HTTP_SERVER_PY = "/sgl-workspace/sglang/python/sglang/srt/entrypoints/http_server.py"
ENDPOINTS_0_5_23 = {
    "/v1/completions": (1861, "openai_v1_completions"),
    "/v1/chat/completions": (1871, "openai_v1_chat_completions"),
    "/generate": (933, "generate_request"),
}

Errors = list[dict[str, Any]]


class CompletionBody(BaseModel):
    """protocol.CompletionRequest's fields the twin reads, in its order."""

    model_config = ConfigDict(extra="ignore")

    model: str = DEFAULT_MODEL_NAME
    prompt: Union[list[int], list[list[int]], str, list[str]]  # noqa: UP007  (pydantic's union order)
    max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS
    stream: bool = False
    rid: Union[list[str], str, None] = None  # noqa: UP007

    @field_validator("max_tokens")
    @classmethod
    def validate_max_tokens_positive(cls, v: int) -> int:
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be positive")
        return v


class ChatBody(BaseModel):
    """protocol.ChatCompletionRequest's fields the twin reads, in its order. Its messages are
    a union of message types there; here any objects."""

    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]]
    model: str = DEFAULT_MODEL_NAME
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    rid: Union[list[str], str, None] = None  # noqa: UP007

    @model_validator(mode="before")
    @classmethod
    def set_tool_choice_default(cls, values: Any) -> Any:
        # As protocol.ChatCompletionRequest's: it runs before the fields are validated, so
        # a missing-field error shows the body with tool_choice added.
        if isinstance(values, dict) and values.get("tool_choice") is None:
            tools = values.get("tools") is not None or _has_message_level_tools(
                values.get("messages")
            )
            values["tool_choice"] = "auto" if tools else "none"
        return values


def _has_message_level_tools(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    return any(
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and m["role"].lower() in ("root", "system", "developer")
        and bool(m.get("tools"))
        for m in messages
    )


def read_body(raw: bytes) -> tuple[Any, Errors]:
    """The JSON body, or FastAPI's errors for it: none at all reads as missing, text that is
    not JSON as a decode error (SGLang parses with orjson, whose wording of the fault
    differs from the json module's the twin has; the rest is FastAPI's)."""
    if not raw:
        return None, [{"type": "missing", "loc": ("body",), "msg": "Field required",
                       "input": None}]  # fmt: skip
    try:
        return json.loads(raw), []
    except UnicodeDecodeError as exc:
        return None, [_json_error(exc.start, "invalid UTF-8")]
    except json.JSONDecodeError as exc:
        return None, [_json_error(exc.pos, exc.msg)]


def _json_error(pos: int, message: str) -> dict[str, Any]:
    return {"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error",
            "input": {}, "ctx": {"error": message}}  # fmt: skip


def body_errors(model: type[BaseModel], body: Any) -> tuple[BaseModel | None, Errors]:
    """The body as ``model`` reads it, or FastAPI's errors for it (loc under "body")."""
    try:
        # FastAPI validates a body model from attributes too: a non-object is
        # model_attributes_type.
        return model.model_validate(body, from_attributes=True), []
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    return None, [{**e, "loc": ("body", *e["loc"])} for e in errors]


def generate_body_errors(body: Any) -> Errors:
    """FastAPI's errors for a /generate body that is no object (a GenerateReqInput dataclass
    takes only a dictionary)."""
    if isinstance(body, dict):
        return []
    return [{"type": "dataclass_type", "loc": ("body",),
             "msg": "Input should be a dictionary or an instance of GenerateReqInput",
             "input": body, "ctx": {"class_name": "GenerateReqInput"}}]  # fmt: skip


def validation_message(errors: Errors, method: str, path: str, version: str) -> str:
    """http_server.validation_exception_handler's message: FastAPI's str() of the
    RequestValidationError (0.124+: with the endpoint's definition), then its errors."""
    count = len(errors)
    text = f"{count} validation error{'s' if count != 1 else ''}:\n"
    text += "".join(f"  {err}\n" for err in errors)
    where = ENDPOINTS_0_5_23.get(path) if version == "0.5.23" else None
    if where is not None:
        line, function = where
        text += f'\n  File "{HTTP_SERVER_PY}", line {line}, in {function}\n    {method} {path}'
    return f"{text.rstrip()} {errors}"
