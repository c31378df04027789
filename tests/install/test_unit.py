"""Reading the unit: `systemctl show` and `systemctl cat` as systemd 252 prints them, the one
ExecStart= in force, and the environment the command runs with."""

from __future__ import annotations

from pathlib import Path

import pytest
from install_views import BASE, FRAGMENT, PYTHON, SPEC, UNIT, show_line, view_of

from specd.install.layout import InstallError, Layout
from specd.install.unit import live_command, parse_exec_property, parse_show, unit_environment


@pytest.mark.parametrize(
    ("value", "path", "argv", "ignore"),
    [
        (show_line(f"{BASE} {SPEC}"), "/opt/sglang/bin/python", f"{BASE} {SPEC}", False),
        (show_line("/bin/x a ; b", path="/bin/x", ignore="yes"), "/bin/x", "/bin/x a ; b", True),
    ],
)
def test_parse_exec_property(value: str, path: str, argv: str, ignore: bool) -> None:
    parsed = parse_exec_property(value.removeprefix("ExecStart="))
    assert (parsed.path, parsed.argv_text, parsed.ignore_errors) == (path, argv, ignore)


@pytest.mark.parametrize("value", ["/bin/x a b", "{ path=/bin/x }", "{ argv[]=x ; path=y }"])
def test_parse_exec_property_refuses_other_formats(value: str) -> None:
    with pytest.raises(InstallError, match="unexpected ExecStart format"):
        parse_exec_property(value)


def test_live_command_keeps_quoted_words_that_show_loses() -> None:
    view = view_of(f'{BASE} --chat-template "two words" {SPEC}')
    assert "two words" in live_command(view).words


def test_live_command_follows_dropins_and_continuations() -> None:
    dropin = "/etc/systemd/system/sglang.service.d/10-local.conf"
    override = f"[Service]\nExecStart=\nExecStart={PYTHON} \\\n  --port 31000 \\\n  {SPEC}\n"
    shown = f"{PYTHON} --port 31000 {SPEC}"
    view = parse_show(
        UNIT,
        "\n".join(
            [
                "LoadState=loaded",
                show_line(shown),
                f"FragmentPath={FRAGMENT}",
                f"DropInPaths={dropin}",
            ]
        ),
        f"# {FRAGMENT}\n[Service]\nExecStart=/bin/false\n\n# {dropin}\n{override}",
    )
    assert " ".join(live_command(view).words) == shown


def test_live_command_resolves_specifiers_in_quoted_words() -> None:
    """A word with a space and %i: only resolving it ourselves can match show's words."""
    unit = "sglang@31000.service"
    view = view_of(
        f'{PYTHON} --served-model-name "model %i" --port %i {SPEC}',
        unit=unit,
        shown_argv=f"{PYTHON} --served-model-name model 31000 --port 31000 {SPEC}",
    )
    words = live_command(view).words
    assert "model 31000" in words
    assert words[words.index("--port") + 1] == "31000"


def test_live_command_takes_host_specifiers_from_show() -> None:
    view = view_of(
        f"{BASE} --served-model-name %H {SPEC}",
        shown_argv=f"{BASE} --served-model-name gpu-01 {SPEC}",
    )
    assert "gpu-01" in live_command(view).words


@pytest.mark.parametrize(
    ("show", "message"),
    [
        ("LoadState=not-found\n", "no such unit"),
        ("LoadState=loaded\nExecStart=\n", "has no ExecStart="),
        (
            f"LoadState=loaded\n{show_line('/bin/a')}\n{show_line('/bin/b')}\n",
            "has 2 ExecStart= commands",
        ),
    ],
)
def test_live_command_refusals(show: str, message: str) -> None:
    with pytest.raises(InstallError, match=message):
        live_command(parse_show(UNIT, show, ""))


def test_live_command_refuses_a_command_it_cannot_read_exactly() -> None:
    view = view_of(f"{BASE} {SPEC}", shown_argv=f"{BASE} --extra word {SPEC}")
    with pytest.raises(InstallError, match="cannot read its ExecStart= unambiguously"):
        live_command(view)


def test_environment_files_win_over_environment(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/sglang.env").write_text("# comment\nPORT=31001\nEXTRA='a b'\n")
    view = view_of(
        f"{BASE} {SPEC}",
        environment="PORT=31000 KEEP=1",
        environment_files=("/etc/sglang.env", "/etc/missing.env"),
    )
    assert view.environment_files == ("/etc/sglang.env", "/etc/missing.env")
    assert unit_environment(view, layout) == {"PORT": "31001", "KEEP": "1", "EXTRA": "a b"}


@pytest.mark.parametrize(
    ("lines", "restart", "restart_sec_s"),
    [
        pytest.param(["Restart=on-failure", "RestartUSec=30s"], "on-failure", 30.0, id="30s"),
        pytest.param(
            ["Restart=always", "RestartUSec=100ms"], "always", 0.1, id="systemd's default"
        ),
        pytest.param(["Restart=no", "RestartUSec=1min 30s"], "no", 90.0, id="no restart"),
        pytest.param(["Restart=on-abnormal", "RestartUSec=0"], "on-abnormal", 0.0, id="at once"),
        pytest.param(["RestartUSec=soon"], "", None, id="not a time span, nor shown"),
        pytest.param([], "", None, id="an older systemd shows neither"),
    ],
)
def test_restart_policy_as_systemctl_show_prints_it(
    lines: list[str], restart: str, restart_sec_s: float | None
) -> None:
    view = parse_show(
        UNIT, "\n".join(["LoadState=loaded", show_line(f"{BASE} {SPEC}"), *lines]), ""
    )
    assert (view.restart, view.restart_sec_s) == (restart, restart_sec_s)
