"""The gateway client against a real smg gateway in front of a real twin on loopback."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from factories import (
    SMG_ADMIN_KEY,
    LoopbackHTTP,
    QueuedRemovalGateway,
    QuietHandler,
    SmgGateway,
    gzip_bomb,
)
from twin_thread import INSTANT, TwinThread

from specd.io.gateway import (
    IDLE_PROBE_S,
    GatewayClient,
    GatewayUnavailable,
    GatewayWatch,
    WorkerNotListed,
    read_api_key,
)
from specd.twin.process import free_port

# The gateway's worker: a twin served in this process (tests/twin_thread.py), up at once.
FAST = [*INSTANT, "--report-interval-s", "0.2"]
SPEC4 = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "4",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5"]  # fmt: skip


@pytest.fixture
def twin() -> Iterator[TwinThread]:
    with TwinThread([*SPEC4, "--enable-metrics", *FAST]) as t:
        t.wait_healthy()
        yield t


@pytest.fixture
def gateway(twin: TwinThread) -> Iterator[str]:
    with SmgGateway([twin.url]) as smg:
        yield smg.url


def test_drain_readd_ready(twin: TwinThread, gateway: str) -> None:
    client = GatewayClient([gateway], twin.url, timeout_s=2.0, poll_s=0.1)
    found = client.find(gateway)
    assert found is not None
    assert found.status == "ready"
    removed = client.drain()
    assert [w.worker_id for w in removed] == [found.worker_id]
    after = client.find(gateway)
    assert after is None or after.status == "draining"
    assert not client.wait_ready(0.3)
    assert client.readd(removed, 15.0) == []
    assert client.wait_ready(15.0)
    client.close()


def answering(smg: SmgGateway, headers: dict[str, str]) -> None:
    """Wait until a gateway started with no worker answers its admin API (`wait_ready`
    waits for workers, and there are none yet)."""
    end = time.monotonic() + 20
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(smg.url + "/workers", headers=headers).status_code == 200:
                return
        assert time.monotonic() < end, smg.log()[-2000:]
        time.sleep(0.1)


def test_a_worker_already_draining_is_not_removed_again(twin: TwinThread) -> None:
    """smg takes a second DELETE of a draining entry (202) and drops it at once, but the
    first removal stays armed: at the end of its settle time it removed, by URL, the worker
    specd had added back since (a sequence after one whose re-add gave up while the entry
    still drained). A draining entry is left to its own removal."""
    settle_s = 3
    with SmgGateway([], admin_key=SMG_ADMIN_KEY) as smg:
        headers = {"Authorization": f"Bearer {SMG_ADMIN_KEY}"}
        answering(smg, headers)
        body = {"url": twin.url, "health": {"drain_settle_secs": settle_s}}
        assert httpx.post(smg.url + "/workers", headers=headers, json=body).status_code == 202
        client = GatewayClient([smg.url], twin.url, api_key=SMG_ADMIN_KEY, poll_s=0.1)
        assert client.wait_ready(20)
        [first] = client.drain()
        draining = client.find(smg.url)
        assert draining is not None
        assert draining.status == "draining"
        started = time.monotonic()
        client.remove(draining)  # the next sequence's drain, finding it draining
        still = client.find(smg.url)
        assert still is not None  # not dropped at once: its own removal goes on
        assert still.status == "draining"
        assert client.readd([first], settle_s + 10.0) == []  # once the entry is gone
        assert time.monotonic() - started > 1.0
        time.sleep(settle_s + 1)  # past any removal armed before
        back = client.find(smg.url)
        assert back is not None
        assert back.status == "ready"
        client.close()


@pytest.mark.parametrize("applies_after_s", [0.5, None])
def test_a_drain_lasts_until_the_queued_removal_is_done(applies_after_s: float | None) -> None:
    """smg answers a DELETE with 202 and removes the worker later: a drain that returned at
    the 202 would let a restart cut the requests the replica still routes."""
    worker_url = "http://127.0.0.1:1"
    errors: list[str] = []
    with QueuedRemovalGateway(worker_url, applies_after_s) as gate:
        client = GatewayClient(
            [gate.url], worker_url, timeout_s=1.5, poll_s=0.05, on_error=errors.append
        )
        started = time.monotonic()
        if applies_after_s is not None:
            removed = client.drain()
            assert [w.worker_id for w in removed] == ["w-1"]
            assert time.monotonic() - started >= applies_after_s
            found = client.find(gate.url)
            assert found is not None
            assert found.status == "draining"
            assert errors == []
        else:
            with pytest.raises(GatewayUnavailable) as err:
                client.drain()
            message = str(err.value)
            assert err.value.kind == "timeout"
            assert message == (
                f"gateway {gate.url}: worker still routed 1.5 s after its removal was accepted"
            )
            assert time.monotonic() - started >= 1.5
            assert errors == ["timeout"]
        assert gate.deletes == 1
        client.close()


def test_a_readd_counts_a_removal_that_never_ran_as_routed_after_one_call_timeout() -> None:
    """The removed entry still ready (a drain given up on its queued removal): waited for
    one call's timeout, then left routed — no POST (this gateway would answer it 501)."""
    worker_url = "http://127.0.0.1:1"
    with QueuedRemovalGateway(worker_url, None) as gate:
        client = GatewayClient([gate.url], worker_url, timeout_s=1.0, poll_s=0.05)
        found = client.find(gate.url)
        assert found is not None
        client.remove(found)
        started = time.monotonic()
        assert client.readd([found], 30.0) == []
        waited = time.monotonic() - started
        assert 1.0 <= waited < 10.0
        assert client.wait_ready(0.1)
        client.close()


def test_a_gateway_that_knows_this_server_by_another_url_is_no_drain(twin: TwinThread) -> None:
    """smg routes SGLang by its LAN address, specd's worker URL defaults to loopback: a drain
    that found no worker by that URL removed nothing, and the restart after it cut the
    requests the gateway still routed. Here the gateway knows the twin as localhost."""
    listed = twin.url.replace("127.0.0.1", "localhost")
    errors: list[str] = []
    with SmgGateway([listed]) as smg:
        client = GatewayClient([smg.url], twin.url, timeout_s=2.0, on_error=errors.append)
        want = (
            f"gateway {smg.url} lists this server as {listed}, not as {twin.url}: "
            f'set [gateway] worker_url = "{listed}"'
        )
        # Not "NOT READY on 1": the gateway routes this server, under another name.
        assert client.probe() == (want, None)
        with pytest.raises(WorkerNotListed) as err:
            client.drain()
        assert str(err.value) == want
        assert errors == []  # every call answered: not a gateway error
        # Nothing was removed: the worker is still routed.
        found = GatewayClient([smg.url], listed).find(smg.url)
        assert found is not None
        assert found.status == "ready"
        client.close()


def test_a_worker_no_replica_lists_is_no_drain_and_counts_as_left_out(twin: TwinThread) -> None:
    """A worker URL no replica lists, and none that is this server under another URL: left
    out (never added, or a re-add that failed) or named in a way specd cannot recognise.
    specd cannot drain it either way, and the alert on a worker left out still counts it."""
    away = "http://127.0.0.1:1"
    with SmgGateway([twin.url]) as one, SmgGateway([twin.url]) as two:
        client = GatewayClient([one.url, two.url], away, timeout_s=2.0)
        problem, not_ready = client.probe()
        assert problem == (
            f"no gateway replica lists worker {away} (they list {twin.url}): add this server "
            "to the gateway, or set [gateway] worker_url to the URL the gateway routes it by"
        )
        assert not_ready == 2
        with pytest.raises(WorkerNotListed):
            client.drain()
        # Listed on one replica and not on the other: left out there, drained where it is.
        present = GatewayClient([one.url, two.url], twin.url, timeout_s=2.0, poll_s=0.1)
        assert present.probe() == (None, 0)
        two.stop()
        with SmgGateway([]) as empty:
            present = GatewayClient([one.url, empty.url], twin.url, timeout_s=2.0, poll_s=0.1)
            # With no worker to wait for, SmgGateway returns before smg listens.
            end = time.monotonic() + 20.0
            while "ConnectError" in str(present.probe()[0]) and time.monotonic() < end:
                time.sleep(0.1)
            assert present.probe() == (None, 1)
            removed = present.drain()
            assert [w.gateway_url for w in removed] == [one.url]
            present.close()
        client.close()


def test_unreachable_gateway_is_one_line() -> None:
    client = GatewayClient([f"http://127.0.0.1:{free_port()}"], "http://127.0.0.1:1", timeout_s=0.5)
    with pytest.raises(GatewayUnavailable) as err:
        client.drain()
    assert "\n" not in str(err.value)
    assert "ConnectError" in str(err.value)
    client.close()


def test_api_key_file_errors_name_the_file(tmp_path: Path) -> None:
    assert read_api_key(None) is None
    (tmp_path / "k").write_text("secret\n")
    assert read_api_key(tmp_path / "k") == "secret"
    (tmp_path / "e").write_text("\n")
    (tmp_path / "huge").write_text("k" * 5000)
    os.mkfifo(tmp_path / "fifo")  # nobody writes it: a plain read would block forever
    (tmp_path / "dir").mkdir()
    (tmp_path / "bad").write_bytes(b"\xff\xfe")
    cases = {
        "e": "empty",
        "missing": "cannot read",
        "huge": "larger than the 4 KiB allowed",
        "fifo": "is not a regular file",
        "dir": "is not a regular file",
        "bad": "is not UTF-8",
    }
    for name, problem in cases.items():
        with pytest.raises(GatewayUnavailable) as err:
            read_api_key(tmp_path / name)
        assert str(tmp_path / name) in str(err.value)
        assert problem in str(err.value)
        assert "\n" not in str(err.value)
    assert httpx  # the client's transport


def test_the_admin_key_is_sent_and_needed(twin: TwinThread, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(SMG_ADMIN_KEY + "\n")
    with SmgGateway([twin.url], admin_key=SMG_ADMIN_KEY) as smg:
        keyed = GatewayClient([smg.url], twin.url, api_key=key_file, timeout_s=2.0, poll_s=0.1)
        removed = keyed.drain()
        assert len(removed) == 1
        for key in (None, "wrong-key"):
            errors: list[str] = []
            client = GatewayClient(
                [smg.url], twin.url, api_key=key, timeout_s=2.0, on_error=errors.append
            )
            # A re-add reports each replica that refused, rather than raise at the first.
            [(worker, why)] = client.readd(removed, 15.0)
            assert worker == removed[0]
            assert errors == ["http_status"]
            assert "HTTP 401" in why
            assert "wrong-key" not in why
            client.close()
        assert keyed.readd(removed, 15.0) == []
        assert keyed.wait_ready(15.0)
        keyed.close()


def test_a_proxy_in_the_environment_never_sees_the_admin_api(
    twin: TwinThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An HTTP(S)_PROXY meant for the internet (an operator's shell running `specd doctor`,
    a DefaultEnvironment= of systemd) must not carry the drain: the proxy cannot reach the
    gateway (every drain refused, doctor calling a healthy gateway down), and would be
    handed the admin key. etcd and SGLang are asked directly already."""
    seen: list[tuple[str, str | None]] = []

    class Proxy(QuietHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_body(502, b"proxy: no route")

    key_file = tmp_path / "key"
    key_file.write_text(SMG_ADMIN_KEY + "\n")
    with LoopbackHTTP(Proxy) as proxy, SmgGateway([twin.url], admin_key=SMG_ADMIN_KEY) as smg:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
            monkeypatch.setenv(name, proxy.url)
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        client = GatewayClient([smg.url], twin.url, api_key=key_file, timeout_s=2.0)
        try:
            found = client.find(smg.url)
        finally:
            client.close()
    assert seen == []
    assert found is not None
    assert found.status == "ready"


class Trickling(QuietHandler):
    """A replica that answers GET /workers a byte at a time (a hung proxy in front of it):
    httpx's read timeout restarts with each byte, so no single read ever times out."""

    def do_GET(self) -> None:
        body = b'{"workers": []}' + b" " * 200
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # specd hung up
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.1)


def test_a_replica_that_trickles_its_answer_is_cut_at_the_call_timeout() -> None:
    """One call to a replica ends by request_timeout_s, whole answer included: else the
    daemon's tick (and a drain, a re-add) hung for as long as the replica kept sending, and
    systemd's watchdog killed specd over and over, a worker drained or not."""
    beats: list[float] = []
    errors: list[str] = []
    with LoopbackHTTP(Trickling) as replica:
        client = GatewayClient(
            [replica.url],
            "http://127.0.0.1:30000",
            timeout_s=1.0,
            on_error=errors.append,
            beat=lambda: beats.append(time.monotonic()),
        )
        started = time.monotonic()
        problem, _ = client.probe()
        took = time.monotonic() - started
        client.close()
    assert took < 2.5, took
    assert problem == f"gateway {replica.url}: GET /workers: no answer within 1 s"
    assert errors == ["timeout"]
    assert beats  # the loop is shown alive while it waits


def test_the_watch_asks_every_tick_when_needed_else_once_a_minute() -> None:
    errors: list[str] = []
    client = GatewayClient(
        [f"http://127.0.0.1:{free_port()}"], "http://127.0.0.1:1", timeout_s=0.5,
        on_error=errors.append,
    )  # fmt: skip
    watch = GatewayWatch(client)
    asked = []
    late = 30.0 + IDLE_PROBE_S
    ticks = [(0.0, False), (10.0, False), (20.0, True), (30.0, True), (late - 1, False),
             (late, False)]  # fmt: skip
    for now, needed in ticks:
        before = len(errors)
        problem = watch.check(now, needed)
        assert problem is not None
        assert "ConnectError" in problem
        asked.append(len(errors) > before)
    assert asked == [True, False, True, True, False, True]
    assert errors == ["connect"] * 4
    assert watch.last is not None
    assert (watch.last["t"], watch.last["replicas"]) == (late, 1)
    watch.close()


WORKER = "http://127.0.0.1:30000"


class Listing(QuietHandler):
    """A replica listing this server's worker with one hostile field (``body``), counting
    every call that would change routing."""

    body = b""
    changes: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.send_body(200, self.body, "application/json")

    def do_DELETE(self) -> None:
        self.changes.append(f"DELETE {self.path}")
        self.send_body(202, b"{}", "application/json")

    def do_POST(self) -> None:
        self.changes.append(f"POST {self.path}")
        self.send_body(202, b"{}", "application/json")


def _listing(field: str) -> bytes:
    return (
        b'{"workers": [{"id": "w1", "url": "'
        + WORKER.encode()
        + b'", "status": "ready", '
        + field.encode()
        + b"}]}"
    )


@pytest.mark.parametrize(
    ("field", "said"),
    [
        # Python's json reads NaN: saved in the restart journal, it failed every save after
        # the drain, and the re-add's body raised out of the restart (the worker stranded).
        ('"priority": NaN', "NaN is not a JSON number"),
        ('"cost": -Infinity', "-Infinity is not a JSON number"),
        # A lone surrogate: httpx raised encoding the re-add's body.
        ('"labels": {"zone": "\\ud800"}', "a string that is not Unicode text"),
        ('"priority": ' + "9" * 5000, "Exceeds the limit"),
    ],
    ids=["nan", "infinity", "lone-surrogate", "5000-digit-number"],
)
def test_a_listing_no_json_encoder_could_send_back_is_no_drain(field: str, said: str) -> None:
    """Refused before anything leaves routing: a worker drained on such a listing could
    never be put back as it was."""
    errors: list[str] = []

    class Replica(Listing):
        body = _listing(field)
        changes: ClassVar[list[str]] = []

    with LoopbackHTTP(Replica) as replica:
        client = GatewayClient([replica.url], WORKER, timeout_s=2.0, on_error=errors.append)
        try:
            with pytest.raises(GatewayUnavailable) as info:
                client.drain()
        finally:
            client.close()
    assert said in str(info.value)
    assert str(info.value).startswith(f"gateway {replica.url}: GET /workers: invalid JSON")
    assert "\n" not in str(info.value)
    assert errors == ["malformed"]
    assert Replica.changes == []


def test_a_readd_whose_body_cannot_be_json_is_one_line_not_an_exception() -> None:
    """What reaches a re-add was read by this client, but a worker built by other code (a
    journal from an older specd) may hold anything: said, never raised through the restart."""

    class Replica(Listing):
        body = _listing('"priority": 5')
        changes: ClassVar[list[str]] = []

    with LoopbackHTTP(Replica) as replica:
        client = GatewayClient([replica.url], WORKER, timeout_s=2.0)
        try:
            worker = client.find(replica.url)
            assert worker is not None
            hostile = dataclasses.replace(worker, settings={"priority": float("nan")})
            with pytest.raises(GatewayUnavailable) as info:
                client._call("POST", replica.url, "/workers", {"url": WORKER, **hostile.settings})
        finally:
            client.close()
    assert "cannot send as JSON" in str(info.value)
    assert Replica.changes == []


def test_a_compressed_gateway_answer_is_refused_undecoded() -> None:
    bomb = gzip_bomb(256 << 20, layers=2)

    class Replica(QuietHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(bomb)))
            self.send_header("Content-Encoding", "gzip, gzip")
            self.end_headers()
            self.wfile.write(bomb)

    with LoopbackHTTP(Replica) as replica:
        client = GatewayClient([replica.url], WORKER, timeout_s=2.0)
        try:
            with pytest.raises(GatewayUnavailable) as info:
                client.drain()
        finally:
            client.close()
    assert "Content-Encoding gzip, gzip" in str(info.value)


def test_a_readd_keeps_the_workers_own_settings(twin: TwinThread) -> None:
    """The re-add sent back url, labels, type, priority and cost: an operator's per-worker
    health timeouts and drain settle time, connection pool and retries were smg's defaults
    after specd's first restart."""
    with SmgGateway([], admin_key=SMG_ADMIN_KEY) as smg:
        headers = {"Authorization": f"Bearer {SMG_ADMIN_KEY}"}
        answering(smg, headers)
        own = {
            "labels": {"zone": "a"},
            "priority": 7,
            "cost": 2.5,
            "max_connection_attempts": 3,
            "health": {"timeout_secs": 9, "drain_settle_secs": 1},
            "http_pool": {"connect_timeout_secs": 3},
            "resilience": {"max_retries": 1},
        }
        body = {"url": twin.url, **own}
        assert httpx.post(smg.url + "/workers", headers=headers, json=body).status_code == 202
        client = GatewayClient([smg.url], twin.url, api_key=SMG_ADMIN_KEY, poll_s=0.1)
        assert client.wait_ready(20)

        def listed() -> dict[str, object]:
            workers = httpx.get(smg.url + "/workers", headers=headers).json()["workers"]
            [entry] = [w for w in workers if w["url"] == twin.url]
            return {k: entry.get(k) for k in own}

        before = listed()
        assert before["health"] == own["health"]
        removed = client.drain()
        assert client.readd(removed, 20.0) == []
        assert client.wait_ready(20.0)
        assert listed() == before
        client.close()
