"""`specd install` for an SGLang started with --api-key: --sglang-api-key-file written as
[sglang] server_api_key_file, checked as specd reads it, a unit with --api-key and no key
file refused, and the probe of the server asking with the key (the twin refuses as SGLang
does: 401 on /server_info without `Authorization: Bearer KEY`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import SPEC4_ARGS
from install_views import BASE, FRESH, SPEC, SPECD, view_of
from twin_thread import INSTANT, TwinThread

from specd.install.layout import CONFIG_FILE, DROPIN_NAME, InstallError, Layout
from specd.install.plan import build_plan
from specd.install.probe import check_sglang
from specd.install.sglang_args import find_flags
from specd.io.config import Config
from specd.io.files import parse_toml

UNIT = "sglang.service"
KEY = "sk-install-test-51b0"
KEY_PATH = Path("/etc/specd/sglang.key")


def key_file(root: Path, mode: int = 0o640, key: str = KEY) -> Path:
    """/etc/specd/sglang.key under ``root``; its path as specd sees it."""
    host = root / "etc/specd/sglang.key"
    host.parent.mkdir(parents=True, exist_ok=True)
    host.write_text(key + "\n")
    host.chmod(mode)
    return KEY_PATH


def config_of(plan_files: list) -> str:  # type: ignore[type-arg]
    return next(c for c in plan_files if c.path == CONFIG_FILE).new.decode()


@pytest.mark.parametrize(
    ("written", "name"),
    [
        (f"--api-key {KEY}", "--api-key"),
        (f"--api-key={KEY}", "--api-key"),
        (f"--api-k {KEY}", "--api-key"),  # argparse takes an unambiguous prefix
        (f"--admin-api-key {KEY}", "--admin-api-key"),
    ],
)
def test_the_key_options_are_known_and_take_a_value(written: str, name: str) -> None:
    flags = find_flags(f"{BASE} {written} {SPEC}".split())
    assert flags[name].value == KEY
    assert flags["--port"].value == "30000"


def test_the_key_file_goes_into_the_config(tmp_path: Path) -> None:
    view = view_of(f"{BASE} --api-key {KEY} {SPEC}")
    plan = build_plan(
        view,
        Layout(tmp_path),
        FRESH,
        add_metrics=False,
        specd_argv=SPECD,
        server_api_key_file=str(key_file(tmp_path)),
    )
    text = config_of(plan.files)
    assert KEY not in text
    assert Config.model_validate(parse_toml(text)).sglang.server_api_key_file == KEY_PATH
    assert plan.server_api_key_file == str(KEY_PATH)
    # The drop-in repeats the command line (the key as the unit has it); what install
    # shows of it (--dry-run, the plan before "Proceed?") never has the key.
    dropin = next(c for c in plan.files if c.path.name == DROPIN_NAME)
    assert f"--api-key {KEY}" in dropin.new.decode()
    assert KEY not in plan.render()
    assert "--api-key ***" in plan.render()


@pytest.mark.parametrize(
    "command", [f"{BASE} --api-key {KEY} {SPEC}", f"{BASE} --api-key={KEY} {SPEC}"]
)
def test_a_unit_with_api_key_and_no_key_file_is_refused(tmp_path: Path, command: str) -> None:
    with pytest.raises(InstallError) as refused:
        build_plan(view_of(command), Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    message = str(refused.value)
    assert "\n" not in message
    assert "runs with --api-key" in message
    assert "pass --sglang-api-key-file FILE" in message
    assert KEY not in message


def test_a_key_file_the_config_already_names_is_kept(tmp_path: Path) -> None:
    key_file(tmp_path)
    config = tmp_path / "etc/specd/specd.toml"
    config.write_text(f'[sglang]\nserver_api_key_file = "{KEY_PATH}"\n')
    view = view_of(f"{BASE} --api-key {KEY} {SPEC}")
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    assert parse_toml(config_of(plan.files))["sglang"]["server_api_key_file"] == str(KEY_PATH)
    assert plan.server_api_key_file == str(KEY_PATH)


@pytest.mark.parametrize(
    ("given", "mode", "message"),
    [
        ("relative.key", 0o640, "not an absolute path"),
        ("/etc/specd/missing.key", 0o640, "not a regular file"),
        (str(KEY_PATH), 0o644, "readable by others"),
    ],
)
def test_the_key_file_is_checked_as_the_gateways(
    tmp_path: Path, given: str, mode: int, message: str
) -> None:
    key_file(tmp_path, mode)
    with pytest.raises(InstallError, match=f"--sglang-api-key-file '{given}': {message}"):
        build_plan(
            view_of(f"{BASE} --api-key {KEY} {SPEC}"),
            Layout(tmp_path),
            FRESH,
            add_metrics=False,
            specd_argv=SPECD,
            server_api_key_file=given,
        )


@pytest.fixture(scope="module")
def twin() -> Iterator[TwinThread]:
    with TwinThread([*SPEC4_ARGS, "--enable-metrics", *INSTANT, "--api-key", KEY]) as running:
        running.wait_healthy()
        yield running


def test_the_probe_asks_with_the_key(twin: TwinThread, tmp_path: Path) -> None:
    key = tmp_path / "sglang.key"
    key.write_text(KEY + "\n")
    assert check_sglang(twin.url, UNIT, twin.port, True, api_key=key) == (None, None)


@pytest.mark.parametrize("given", [True, False])
def test_the_probe_refused_for_the_key_says_what_to_do(twin: TwinThread, given: bool) -> None:
    # Before: "does not answer now (GET /server_info: 401 ...): ... check --url", a warning.
    refusal, warning = check_sglang(twin.url, UNIT, twin.port, given)
    assert warning is None
    assert refusal is not None
    assert "401" in refusal
    assert "check --url" not in refusal
    assert refusal.endswith(
        "SGLang runs with --api-key: pass --sglang-api-key-file FILE, a file holding that key"
    )


def test_the_probe_with_the_wrong_key_names_it(twin: TwinThread, tmp_path: Path) -> None:
    key = tmp_path / "sglang.key"
    key.write_text("old-" + KEY + "\n")
    refusal, warning = check_sglang(twin.url, UNIT, twin.port, True, api_key=key)
    assert warning is None
    assert refusal is not None
    assert f"the key in {key} is not SGLang's --api-key" in refusal
    assert "check the key in --sglang-api-key-file" in refusal
    assert KEY not in refusal
