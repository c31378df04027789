"""--api-key and --admin-api-key as each SGLang version the twin models enforces them.

What SGLang does, read from its wheels: 0.5.4's srt/utils/common.py add_api_key_middleware
(the header exactly ``Bearer KEY``; /health*, /metrics* and OPTIONS pass; no admin key);
0.5.11-0.5.23's srt/utils/auth.py decide_request_auth (the scheme in any case; /freeze_gc
is ADMIN_OPTIONAL, every other route NORMAL; 0.5.23 also lets /ready* pass). Neither reads
an x-api-key header. Refused: 401 {"error":"Unauthorized"} before routing, so a path no
route has is 401 too, not 404. Over real HTTP on 127.0.0.1, every route specd and its
clients use against every kind of header.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from twin_thread import INSTANT, TwinThread

from specd.twin.versions import PROFILES, VERSIONS

API, ADMIN, WRONG = "api-s3cret", "admin-s3cret", "not-the-key"
UNAUTHORIZED = b'{"error":"Unauthorized"}'
BASE = [*INSTANT, "--health-first-look-s", "0", "--enable-metrics"]
# The path prefixes each version lets through without a key.
EXEMPT = {
    "0.5.4": ("/health", "/metrics"),
    "0.5.11": ("/health", "/metrics"),
    "0.5.13": ("/health", "/metrics"),
    "0.5.23": ("/health", "/ready", "/metrics"),
}
# Which keys the server is started with.
CONFIGS = {
    "none": {},
    "api": {"api": API},
    "admin": {"admin": ADMIN},
    "both": {"api": API, "admin": ADMIN},
}
# What a client sends: header name and value (None: nothing).
HEADERS: dict[str, tuple[str, str] | None] = {
    "none": None,
    "Bearer api": ("Authorization", f"Bearer {API}"),
    "bearer api": ("Authorization", f"bearer {API}"),
    "x-api-key": ("x-api-key", API),
    "Bearer admin": ("Authorization", f"Bearer {ADMIN}"),
    "Bearer wrong": ("Authorization", f"Bearer {WRONG}"),
}
COMPLETION = {"model": "default", "prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


def _routes(version: str) -> list[tuple[str, str, Any, int]]:
    """(method, path, JSON body, the status SGLang gives once past the key check)."""
    profile = PROFILES[version]
    return [
        ("GET", "/metrics", None, 200),
        ("GET", "/health", None, 200),
        ("GET", "/health_generate", None, 200),
        ("GET", "/ready", None, 200 if profile.ready else 404),
        ("GET", "/server_info", None, 200 if profile.server_info else 404),
        ("GET", "/get_server_info", None, 200),
        ("GET", "/model_info", None, 200 if profile.model_info else 404),
        ("GET", "/get_model_info", None, 200),
        ("GET", "/v1/models", None, 200),
        ("POST", "/v1/completions", COMPLETION, 200),
        ("POST", "/v1/chat/completions", CHAT, 200),
        ("POST", "/generate", GENERATE, 200),
        ("POST", "/freeze_gc", None, 200),
        ("GET", "/freeze_gc", None, 200),
        ("GET", "/no_such_route", None, 404),
    ]


def _sglang_allows(version: str, config: dict[str, str], path: str, header: str) -> bool:
    """Whether that SGLang lets the request past its key middleware."""
    if path.startswith(EXEMPT[version]):
        return True
    api, admin = config.get("api"), config.get("admin")
    if version == "0.5.4":
        need = api  # one key for every route
    elif path == "/freeze_gc":
        need = admin or api  # ADMIN_OPTIONAL
    else:
        need = api  # NORMAL: the admin key never opens it
    if need is None:
        return True
    sent = HEADERS[header]
    if sent is None or sent[0] != "Authorization":
        return False
    scheme, _, token = sent[1].partition(" ")
    exact_scheme = scheme == "Bearer" if version == "0.5.4" else scheme.lower() == "bearer"
    return exact_scheme and token == need


def _argv(version: str, config: dict[str, str]) -> list[str]:
    argv = [*BASE, "--sglang-version", version]
    if "api" in config:
        argv += ["--api-key", config["api"]]
    if "admin" in config:
        argv += ["--admin-api-key", config["admin"]]
    return argv


CASES = [
    pytest.param(version, name, id=f"{version}-{name}")
    for version in VERSIONS
    for name in CONFIGS
    # 0.5.4 has no --admin-api-key (below: argparse refuses it).
    if not (version == "0.5.4" and "admin" in CONFIGS[name])
]


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10.0) as client:
        yield client


@pytest.mark.parametrize(("version", "config_name"), CASES)
def test_every_route_answers_every_header_as_sglang(
    version: str, config_name: str, http: httpx.Client
) -> None:
    """The whole matrix for one version and one set of keys; also the warm-up, which
    sends the keys as SGLang's does, lets the twin become healthy."""
    config = CONFIGS[config_name]
    wrong: list[str] = []
    with TwinThread(_argv(version, config)) as twin:
        twin.wait_healthy()
        for method, path, body, status in _routes(version):
            for header, sent in HEADERS.items():
                headers = dict([sent]) if sent is not None else {}
                resp = http.request(method, twin.url + path, json=body, headers=headers)
                ok = _sglang_allows(version, config, path, header)
                want = status if ok else 401
                where = f"{method} {path} [{header}]"
                if resp.status_code != want:
                    wrong.append(f"{where}: {resp.status_code}, SGLang {want}")
                elif not ok and (
                    resp.content != UNAUTHORIZED
                    or resp.headers.get("content-type") != "application/json"
                ):
                    wrong.append(f"{where}: 401 body {resp.content!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("config_name", "method", "path", "header", "status"),
    [
        # Written out by hand: the cases the rules turn on.
        ("api", "GET", "/no_such_route", "none", 401),  # before routing, not 404
        ("api", "GET", "/v1/models", "x-api-key", 401),  # SGLang reads no x-api-key
        ("api", "GET", "/v1/models", "bearer api", 200),
        ("both", "GET", "/v1/models", "Bearer admin", 401),  # NORMAL: the api key only
        ("both", "POST", "/freeze_gc", "Bearer api", 401),  # ADMIN_OPTIONAL: admin only
        ("both", "POST", "/freeze_gc", "Bearer admin", 200),
        ("admin", "GET", "/v1/models", "none", 200),  # only an admin key: NORMAL is open
        ("admin", "GET", "/no_such_route", "none", 404),
        ("admin", "POST", "/freeze_gc", "none", 401),
        ("admin", "POST", "/freeze_gc", "Bearer api", 401),
        ("api", "POST", "/freeze_gc", "Bearer api", 200),  # no admin key: the api key
        ("api", "GET", "/ready", "none", 200),  # 0.5.20+: exempt
        ("api", "GET", "/metrics", "Bearer wrong", 200),
    ],
)
def test_sglang_0_5_23_key_cases(
    config_name: str, method: str, path: str, header: str, status: int, http: httpx.Client
) -> None:
    with TwinThread(_argv("0.5.23", CONFIGS[config_name])) as twin:
        twin.wait_healthy()
        sent = HEADERS[header]
        headers = dict([sent]) if sent is not None else {}
        resp = http.request(method, twin.url + path, headers=headers)
        assert resp.status_code == status
        if status == 401:
            assert resp.content == UNAUTHORIZED


@pytest.mark.parametrize(
    ("header", "status"),
    [
        ("Bearer api", 200),
        ("bearer api", 401),  # 0.5.4 compares the header to "Bearer KEY" as a string
        ("x-api-key", 401),
        ("none", 401),
    ],
)
def test_sglang_0_5_4_wants_the_exact_header(header: str, status: int, http: httpx.Client) -> None:
    with TwinThread(_argv("0.5.4", CONFIGS["api"])) as twin:
        twin.wait_healthy()
        sent = HEADERS[header]
        resp = http.get(twin.url + "/no_such_route", headers=dict([sent]) if sent else {})
        assert resp.status_code == (404 if status == 200 else 401)
        resp = http.get(twin.url + "/v1/models", headers=dict([sent]) if sent else {})
        assert resp.status_code == status


def test_sglang_0_5_4_has_no_admin_api_key() -> None:
    with pytest.raises(SystemExit) as exc:
        TwinThread([*BASE, "--sglang-version", "0.5.4", "--admin-api-key", ADMIN])
    assert exc.value.code == 2


def _count(page: str, family: str, **labels: str) -> float:
    """The value of one series of ``family`` with these labels (0 if there is none)."""
    total = 0.0
    for line in page.splitlines():
        match = re.match(rf"{re.escape(family)}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


@pytest.mark.parametrize("config_name", ["api", "admin", "both"])
def test_warm_up_sends_the_keys(config_name: str, http: httpx.Client) -> None:
    """0.5.23's warm-up: /model_info and (the model understands images) a chat completion
    with the api key, then /freeze_gc with the admin key (else the api key): all three pass
    and the twin becomes healthy. A refused request is counted in no HTTP metric (the key
    middleware is the outermost)."""
    with TwinThread(_argv("0.5.23", CONFIGS[config_name])) as twin:
        twin.wait_healthy()
        http.get(twin.url + "/v1/models", headers={"Authorization": f"Bearer {WRONG}"})
        page = http.get(twin.url + "/metrics").text
    responses = "sglang:http_responses_total"
    warm_up = (("GET", "/model_info"), ("POST", "/v1/chat/completions"), ("POST", "/freeze_gc"))
    for method, path in warm_up:
        assert _count(page, responses, endpoint=path, method=method, status_code="200") == 1
        assert _count(page, responses, endpoint=path, status_code="401") == 0
    refused = _count(page, "sglang:http_requests_total", endpoint="/v1/models")
    assert refused == (0 if "api" in CONFIGS[config_name] else 1)


def test_server_info_shows_the_key_as_given(http: httpx.Client) -> None:
    """argparse reads --api-key as text: a key of digits stays text, its zeros kept."""
    with TwinThread([*BASE, "--api-key", "0123"]) as twin:
        twin.wait_healthy()
        info = http.get(twin.url + "/server_info", headers={"Authorization": "Bearer 0123"})
    assert info.status_code == 200
    assert info.json()["api_key"] == "0123"
