"""The gateway client against a real smg gateway in front of a real twin on loopback."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from specd.io.gateway import GatewayClient, GatewayUnavailable, read_api_key
from specd.twin.process import TwinProcess, free_port

FAST = ["--load-time-s", "0.3", "--warmup-s", "0.3", "--report-interval-s", "0.2"]
SPEC4 = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "4",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5"]  # fmt: skip

SMG = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
pytestmark = pytest.mark.skipif(not Path(SMG).exists(), reason="smg not installed")


@pytest.fixture
def twin() -> Iterator[TwinProcess]:
    with TwinProcess([*SPEC4, "--enable-metrics", *FAST]) as t:
        yield t


@pytest.fixture
def gateway(twin: TwinProcess) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            SMG,
            "launch",
            "--worker-urls",
            twin.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        client = GatewayClient([url], twin.url, timeout_s=1.0)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                if client.wait_ready(0.5):
                    break
            except GatewayUnavailable:
                time.sleep(0.2)
        client.close()
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_drain_readd_ready(twin: TwinProcess, gateway: str) -> None:
    client = GatewayClient([gateway], twin.url, timeout_s=2.0, poll_s=0.1)
    found = client.find(gateway)
    assert found is not None
    assert found.status == "ready"
    removed = client.drain()
    assert [w.worker_id for w in removed] == [found.worker_id]
    after = client.find(gateway)
    assert after is None or after.status == "draining"
    assert not client.wait_ready(0.3)
    client.readd(removed, 15.0)
    assert client.wait_ready(15.0)
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
    for name in ("e", "missing"):
        with pytest.raises(GatewayUnavailable, match=name):
            read_api_key(tmp_path / name)
    assert httpx  # the client's transport
