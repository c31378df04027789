"""`specd observe` against an SGLang started with --api-key (the twin refuses as SGLang
does: 401 on /server_info without `Authorization: Bearer KEY`; /metrics is open)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from in_process import specd_main
from twin_thread import INSTANT, TwinThread

from specd.twin.process import free_port

KEY = "sk-observe-test-9f2e"


@pytest.fixture(scope="module")
def twin() -> Iterator[TwinThread]:
    with TwinThread([*INSTANT, "--enable-metrics", "--api-key", KEY]) as running:
        running.wait_healthy()
        yield running


def key_file(tmp_path: Path, key: str = KEY, name: str = "sglang.key") -> Path:
    path = tmp_path / name
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


def config_file(tmp_path: Path, url: str, key: Path) -> Path:
    path = tmp_path / "specd.toml"
    path.write_text(f'[sglang]\nurl = "{url}"\nserver_api_key_file = "{key}"\n')
    return path


def test_without_the_key_it_fails_saying_how_to_pass_it(twin: TwinThread) -> None:
    # Before: exit 0 and a table of '-' where /server_info's fields go, no hint.
    done = specd_main("observe", "--url", twin.url)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"SGLang at {twin.url} runs with --api-key" in lines[0]
    assert "401" in lines[0]
    assert "pass --api-key-file FILE" in lines[0]


def test_with_api_key_file_it_reads_what_sglang_says(twin: TwinThread, tmp_path: Path) -> None:
    done = specd_main("observe", "--url", twin.url, "--api-key-file", str(key_file(tmp_path)))
    assert done.returncode == 0, done.stderr
    assert KEY not in done.stdout + done.stderr  # launch_command carries it: shown as ***
    rows = dict(line.split(None, 1) for line in done.stdout.splitlines() if " " in line)
    assert rows["version"].strip() != "-"
    assert "--api-key ***" in rows["launch_command"]
    as_json = specd_main(
        "observe", "--url", twin.url, "--api-key-file", str(key_file(tmp_path)), "--json"
    )
    assert json.loads(as_json.stdout)["max_running_requests"] is not None


def test_the_wrong_key_is_named_by_its_file(twin: TwinThread, tmp_path: Path) -> None:
    wrong = key_file(tmp_path, "not-" + KEY)
    done = specd_main("observe", "--url", twin.url, "--api-key-file", str(wrong))
    assert done.returncode == 1
    assert f"the key in {wrong} is not SGLang's --api-key" in done.stderr
    assert KEY not in done.stderr


@pytest.mark.parametrize(("content", "says"), [(None, "cannot read"), ("", "empty")])
def test_an_unusable_key_file_is_refused_in_one_line(
    tmp_path: Path, content: str | None, says: str
) -> None:
    path = tmp_path / "sglang.key"
    if content is not None:
        path.write_text(content)
    url = f"http://127.0.0.1:{free_port()}"
    done = specd_main("observe", "--url", url, "--api-key-file", str(path))
    assert done.returncode == 2
    assert done.stderr.startswith(f"specd observe: --api-key-file {path}: ")
    assert says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_config_key_is_used_for_the_config_url_only(twin: TwinThread, tmp_path: Path) -> None:
    config = config_file(tmp_path, twin.url + "/", key_file(tmp_path))
    done = specd_main("observe", "--url", twin.url, "--config", str(config))
    assert done.returncode == 0, done.stderr
    # Another server's key is not sent to this one.
    other = config_file(tmp_path, f"http://127.0.0.1:{free_port()}", key_file(tmp_path))
    elsewhere = specd_main("observe", "--url", twin.url, "--config", str(other))
    assert elsewhere.returncode == 1
    assert "pass --api-key-file FILE" in elsewhere.stderr


def test_the_config_key_refused_names_the_setting(twin: TwinThread, tmp_path: Path) -> None:
    config = config_file(tmp_path, twin.url, key_file(tmp_path, "old-" + KEY))
    done = specd_main("observe", "--url", twin.url, "--config", str(config))
    assert done.returncode == 1
    assert "is not SGLang's --api-key" in done.stderr
    assert f"[sglang] server_api_key_file of {config}" in done.stderr


def test_a_config_that_cannot_be_read_is_refused(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = specd_main("observe", "--url", url, "--config", str(tmp_path / "absent.toml"))
    assert done.returncode == 2
    assert str(tmp_path / "absent.toml") in done.stderr
