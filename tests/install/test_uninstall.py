"""Install then uninstall gives every file back as it was: bytes, mode, owner, and a symlink
as a symlink (real files under a scratch root; systemd itself is exercised in
tests/systemd/, so systemctl here only answers `cat` with the unit as it was)."""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest
from install_views import BASE, FRESH, SPEC, SPECD, view_of
from test_plan import config_of

from specd.install.execute import execute
from specd.install.layout import CONFIG_FILE, POLKIT_FILE, SYSUSERS_FILE, InstallError, Layout
from specd.install.plan import build_plan
from specd.install.uninstall import uninstall
from specd.install.unit import UnitView
from specd.io.files import parse_toml
from specd.io.runner import RunResult

VIEW = view_of(f"{BASE} {SPEC}")
# Some group other than root's: the owner must survive, not only the mode.
GID = 65534


def systemctl(view: UnitView = VIEW):  # type: ignore[no-untyped-def]
    def run(argv: Sequence[str], *, timeout_s: float) -> RunResult:
        stdout = view.cat if list(argv[:2]) == ["systemctl", "cat"] else ""
        return RunResult(tuple(argv), 0, stdout, "", False, 0.0)

    return run


def with_state_dir(layout: Layout) -> Layout:
    # There already: install would create it for user specd, whom this machine lacks.
    layout.host(Path("/var/lib/specd")).mkdir(parents=True, exist_ok=True)
    return layout


def install_and_uninstall(layout: Layout) -> None:
    with_state_dir(layout)
    plan = build_plan(VIEW, layout, FRESH, add_metrics=False, specd_argv=SPECD)
    execute(plan, layout, systemctl(), VIEW, io.StringIO())
    uninstall(layout, systemctl(), False, io.StringIO(), now_s=0.0)


def facts(path: Path) -> tuple[bytes, int, int, int]:
    info = path.lstat()
    return path.read_bytes(), stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid


def test_a_0640_config_keeps_its_mode_and_owner(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    config = layout.host(CONFIG_FILE)
    config.parent.mkdir(parents=True)
    config.write_text("# ours\n[observe]\nmin_history_s = 5.0\n")
    config.chmod(0o640)
    os.chown(config, 0, GID)
    before = facts(config)
    plan = build_plan(VIEW, with_state_dir(layout), FRESH, add_metrics=False, specd_argv=SPECD)
    execute(plan, layout, systemctl(), VIEW, io.StringIO())
    # Edited in place: the group that reads it still can, others still cannot.
    edited = facts(config)
    assert edited[1:] == (0o640, 0, GID)
    assert parse_toml(edited[0].decode())["sglang"]["unit"] == "sglang.service"
    uninstall(layout, systemctl(), False, io.StringIO(), now_s=0.0)
    assert facts(config) == before


def test_bytes_that_are_not_utf8_come_back_exactly(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    rule = layout.host(POLKIT_FILE)
    rule.parent.mkdir(parents=True)
    rule.write_bytes(b"// Gr\xfc\xdfe, an older rule in Latin-1\n")
    rule.chmod(0o600)
    before = facts(rule)
    install_and_uninstall(layout)
    assert facts(rule) == before


def test_a_symlink_install_replaced_comes_back_as_the_symlink(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    users = layout.host(SYSUSERS_FILE)
    users.parent.mkdir(parents=True)
    (users.parent / "shared.conf").write_text('u specd - "from elsewhere"\n')
    users.symlink_to("shared.conf")
    install_and_uninstall(layout)
    assert users.is_symlink()
    assert os.readlink(users) == "shared.conf"


def test_a_symlinked_config_is_not_edited_through(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    config = layout.host(CONFIG_FILE)
    config.parent.mkdir(parents=True)
    managed = tmp_path / "srv/cm/specd.toml"
    managed.parent.mkdir(parents=True)
    managed.write_text('[sglang]\nurl = "http://127.0.0.1:31000"\n')
    config.symlink_to(managed)
    with pytest.raises(InstallError) as err:
        build_plan(VIEW, layout, FRESH, add_metrics=False, specd_argv=SPECD)
    [line] = str(err.value).splitlines()
    assert line == (
        f"{CONFIG_FILE} is a symlink to {managed}: install does not edit through it; set "
        '[sglang] unit = "sglang.service", '
        '[sglang] speculative_algorithm = "NEXTN" where that file comes from, then run '
        "install again"
    )
    assert managed.read_text() == '[sglang]\nurl = "http://127.0.0.1:31000"\n'
    # Set there, install has nothing to change in it, and the link stays a link.
    managed.write_text(
        '[sglang]\nurl = "http://127.0.0.1:30000"\nunit = "sglang.service"\n'
        'speculative_algorithm = "NEXTN"\n'
    )
    plan = build_plan(VIEW, layout, FRESH, add_metrics=False, specd_argv=SPECD)
    with pytest.raises(StopIteration):
        config_of(plan.files)
    install_and_uninstall(layout)
    assert config.is_symlink()
    assert os.readlink(config) == str(managed)
