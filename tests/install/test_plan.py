"""What install would change, worked out without touching anything: the dry-run diff, an empty
plan once installed, an edited config, the migration of an older installation, and an
override left by an earlier installation."""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from install_views import BASE, FRESH, PYTHON, RUNNING, SPEC, SPECD, UNIT, installed_view, view_of

from specd.core.setting import static
from specd.install.layout import (
    CONFIG_FILE,
    DROPIN_NAME,
    ENV_FILE,
    OVERRIDE_FILE,
    POLKIT_FILE,
    SPECD_UNIT,
    UNITS_DIR,
    InstallError,
    Layout,
)
from specd.install.plan import GatewayOptions, build_plan, check_url, gateway_keys
from specd.io.apply import render_setting_env
from specd.io.config import Config
from specd.io.files import parse_toml

# 2026-12-02 11:00:00 UTC
NOW = 1796209200.0


def with_config(tmp_path: Path, content: str | bytes) -> tuple[Layout, Path]:
    """A scratch root whose /etc/specd/specd.toml holds ``content``, and that file."""
    layout = Layout(tmp_path)
    config = layout.host(CONFIG_FILE)
    config.parent.mkdir(parents=True)
    config.write_bytes(content.encode() if isinstance(content, str) else content)
    return layout, config


def test_refuses_a_unit_without_metrics_unless_asked(tmp_path: Path) -> None:
    view = view_of(f"{PYTHON} {SPEC}")
    with pytest.raises(InstallError, match=r"runs without --enable-metrics.*--add-enable-metrics"):
        build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=True, specd_argv=SPECD)
    dropin = next(c for c in plan.files if c.path.name == DROPIN_NAME).new.decode()
    assert dropin.rstrip().endswith("--enable-metrics")
    # specd sees no metrics until SGLang restarts, so it would never restart it itself.
    [note] = [n for n in plan.notes if "SGLang is not restarted" in n]
    assert f"run `systemctl restart {UNIT}` now" in note
    assert "maintenance window" not in note


def test_refuses_when_a_later_dropin_sets_execstart(tmp_path: Path) -> None:
    later = "/etc/systemd/system/sglang.service.d/90-local.conf"
    view = view_of(
        f"{BASE} {SPEC}", dropins={later: f"[Service]\nExecStart=\nExecStart={BASE} {SPEC}\n"}
    )
    with pytest.raises(InstallError, match=r"90-local\.conf sets ExecStart= and is read after"):
        build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)


@pytest.mark.parametrize("prefix", [":", "-:", ":+"])
def test_refuses_a_command_that_does_not_expand_variables(tmp_path: Path, prefix: str) -> None:
    """With ":" systemd passes "$SPECD_SPECULATIVE_ARGS" to SGLang as it is: the drop-in was
    written, and SGLang's next start failed on the word, and so did the rollback's."""
    view = view_of(f"{prefix}{BASE} {SPEC}")
    with pytest.raises(InstallError, match=r"starts with ':', which turns off variable expansion"):
        build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    # Other prefixes expand variables: wired as before.
    plan = build_plan(
        view_of(f"-{BASE} {SPEC}"), Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD
    )
    assert any(c.path.name == DROPIN_NAME for c in plan.files)


def config_of(plan_files: list, path: Path = CONFIG_FILE) -> str:  # type: ignore[type-arg]
    return next(c for c in plan_files if c.path == path).new.decode()


def test_url_comes_from_the_units_host_and_port(tmp_path: Path) -> None:
    view = view_of(f"{PYTHON} --enable-metrics --host=0.0.0.0 --port 31000 {SPEC}")
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    assert parse_toml(config_of(plan.files))["sglang"]["url"] == "http://127.0.0.1:31000"


def test_port_from_an_environment_file(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/sglang.env").write_text("PORT=31005\n")
    view = view_of(
        f"{PYTHON} --enable-metrics --port ${{PORT}} {SPEC}",
        environment="PORT=1",
        environment_files=("/etc/sglang.env",),
    )
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    assert plan.url == "http://127.0.0.1:31005"
    assert "--port ${PORT}" in config_of(plan.files, UNITS_DIR / f"{UNIT}.d" / DROPIN_NAME)


def test_url_given_for_a_port_install_cannot_read(tmp_path: Path) -> None:
    view = view_of(f"{PYTHON} --enable-metrics --port ${{PORT}} {SPEC}", environment="")
    with pytest.raises(InstallError, match="pass --url"):
        build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    plan = build_plan(
        view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD, url="http://gpu:31000/"
    )
    assert parse_toml(config_of(plan.files))["sglang"]["url"] == "http://gpu:31000"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("gpu:31000", "not an http:// or https:// URL"),
        ("ftp://gpu:31000", "not an http:// or https:// URL"),
        ("http://gpu:99999", "out of range"),
        ("http://gpu:31000/v1", "only scheme, host and port"),
        ("http://:31000", "with a host"),
    ],
)
def test_check_url_refusals(url: str, message: str) -> None:
    with pytest.raises(InstallError, match=message):
        check_url(url)


def test_dry_run_diff(tmp_path: Path) -> None:
    view = view_of(f"{BASE} {SPEC}")
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    text = plan.render()
    dropin = UNITS_DIR / f"{UNIT}.d" / DROPIN_NAME
    assert f"--- {dropin} (absent)\n+++ {dropin} (new, 0644)\n" in text
    assert "+ExecStart=\n" in text
    # The whole speculative setting moves into one unbraced variable, at the place of its
    # first option; today's setting is its default.
    assert "+    --enable-metrics \\\n+    $SPECD_SPECULATIVE_ARGS\n" in text
    assert "--speculative-num-steps 4 \\\n" not in text
    assert (
        '+Environment="SPECD_SPECULATIVE_ARGS=--speculative-algorithm NEXTN '
        "--speculative-num-steps 4 --speculative-eagle-topk 1 "
        '--speculative-num-draft-tokens 5"\n'
    ) in text
    assert '+speculative_algorithm = "NEXTN"\n' in text
    assert "+EnvironmentFile=-/var/lib/specd/sglang.env\n" in text
    assert f"+ExecStart={SPECD[0]} run --config /etc/specd/specd.toml\n" in text
    assert f"+++ {POLKIT_FILE} (new, 0644)" in text
    commands = [line for line in text.splitlines() if line.startswith("$ ")]
    assert commands == [
        "$ systemd-sysusers /etc/sysusers.d/specd.conf",
        "$ mkdir -m 0751 /var/lib/specd",
        "$ chown specd:specd /var/lib/specd",
        "$ systemctl daemon-reload",
        f"$ systemctl enable --now {SPECD_UNIT}",
    ]
    assert "restart" not in " ".join(commands)  # never SGLang
    assert any("SGLang is not restarted" in note for note in plan.notes)
    assert not any(tmp_path.rglob("*"))  # planning wrote nothing


def install_files(layout: Layout, plan_files: list) -> None:  # type: ignore[type-arg]
    for change in plan_files:
        target = layout.host(change.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(change.new)


def test_plan_is_empty_once_installed(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    view = view_of(f"{BASE} {SPEC}")
    first = build_plan(view, layout, FRESH, add_metrics=False, specd_argv=SPECD)
    install_files(layout, first.files)
    layout.host(Path("/var/lib/specd")).mkdir(parents=True)
    again = build_plan(installed_view(layout), layout, RUNNING, add_metrics=False, specd_argv=SPECD)
    assert again.empty, again.render()
    # Until systemd has read the drop-in (a run that stopped before daemon-reload), the
    # files are right but the plan still reloads.
    unread = build_plan(view, layout, RUNNING, add_metrics=False, specd_argv=SPECD)
    assert unread.commands == [("systemctl", "daemon-reload")], unread.render()


def test_an_edited_config_is_updated_in_place_and_restarts_specd(tmp_path: Path) -> None:
    """Only the keys install sets change. The URL specd.toml has stays (an earlier run's
    --url: SGLang in a container publishing its port under another number): a run without
    --url rebuilt it from the unit's --host/--port and pointed specd where nothing answers.
    Where the unit says another, install says so."""
    layout, config = with_config(
        tmp_path,
        '[sglang]\nurl = "http://127.0.0.1:30000"\n[observe]\nmin_history_s = 5.0\n',
    )
    view = view_of(f"{PYTHON} --enable-metrics --port 31000 {SPEC}")
    plan = build_plan(view, layout, RUNNING, add_metrics=False, specd_argv=SPECD)
    change = next(c for c in plan.files if c.path == CONFIG_FILE)
    assert change.old == config.read_bytes()
    assert b"min_history_s = 5.0" in change.new
    diff = change.diff().splitlines()
    assert ' url = "http://127.0.0.1:30000"' in diff  # kept
    assert '+unit = "sglang.service"' in diff
    assert plan.url == "http://127.0.0.1:30000"
    assert (
        f"kept [sglang] url = http://127.0.0.1:30000 from {CONFIG_FILE}; sglang.service's "
        "--host/--port say http://127.0.0.1:31000: run install with --url to change it"
    ) in plan.notes
    assert ("systemctl", "restart", SPECD_UNIT) in plan.commands
    # --url changes it.
    given = build_plan(
        view, layout, RUNNING, add_metrics=False, specd_argv=SPECD, url="http://127.0.0.1:31000"
    )
    diff = next(c for c in given.files if c.path == CONFIG_FILE).diff().splitlines()
    assert '-url = "http://127.0.0.1:30000"' in diff
    assert '+url = "http://127.0.0.1:31000"' in diff


def test_a_second_run_without_url_keeps_the_url_the_first_was_given(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    view = view_of(f"{BASE} {SPEC}")
    first = build_plan(
        view, layout, FRESH, add_metrics=False, specd_argv=SPECD, url="http://127.0.0.1:8000"
    )
    install_files(layout, first.files)
    layout.host(Path("/var/lib/specd")).mkdir(parents=True)
    again = build_plan(installed_view(layout), layout, RUNNING, add_metrics=False, specd_argv=SPECD)
    assert again.url == "http://127.0.0.1:8000"
    assert all(c.path != CONFIG_FILE for c in again.files), again.render()


def step_variable_dropin(steps: str, draft: str) -> str:
    """What `specd install` wrote before the setting moved into one variable."""
    return (
        "# Written by `specd install` from sglang.service's own ExecStart=; `specd uninstall` "
        "removes\n"
        "[Service]\n"
        f"Environment={steps}=3 {draft}=4\n"
        "EnvironmentFile=-/var/lib/specd/sglang.env\n"
        "ExecStart=\n"
        f"ExecStart={BASE} \\\n    --speculative-algorithm NEXTN \\\n"
        f"    --speculative-num-steps ${{{steps}}} \\\n    --speculative-eagle-topk 1 \\\n"
        f"    --speculative-num-draft-tokens ${{{draft}}}\n"
    )


@pytest.mark.parametrize(
    ("steps_var", "draft_var", "legacy"),
    [
        ("SPECD_SPEC_STEPS", "SPECD_SPEC_DRAFT_TOKENS", True),  # before the rename
        ("SPECULATIVE_NUM_STEPS", "SPECULATIVE_NUM_DRAFT_TOKENS", False),  # the step form
    ],
)
def test_an_installation_with_step_variables_is_migrated_to_the_setting_variable(
    tmp_path: Path, steps_var: str, draft_var: str, legacy: bool
) -> None:
    layout = Layout(tmp_path)
    dropin = UNITS_DIR / f"{UNIT}.d" / DROPIN_NAME
    old_dropin = step_variable_dropin(steps_var, draft_var)
    env = layout.host(ENV_FILE)
    env.parent.mkdir(parents=True)
    env.write_text(f"# Written by specd\n{steps_var}=4\n{draft_var}=5\n")
    layout.host(dropin).parent.mkdir(parents=True)
    layout.host(dropin).write_text(old_dropin)
    view = view_of(
        "/bin/false",
        dropins={str(dropin): old_dropin},
        environment=f"{steps_var}=3 {draft_var}=4",
        shown_argv=f"{BASE} --speculative-algorithm NEXTN --speculative-num-steps "
        f"${{{steps_var}}} --speculative-eagle-topk 1 --speculative-num-draft-tokens "
        f"${{{draft_var}}}",
        environment_files=(str(ENV_FILE),),
    )
    plan = build_plan(view, layout, RUNNING, add_metrics=False, specd_argv=SPECD)
    assert plan.spec.legacy is legacy
    assert (plan.spec.steps, plan.spec.draft_tokens) == (3, 4)  # the drop-in's defaults
    text = plan.render()
    assert f"-    --speculative-num-steps ${{{steps_var}}} \\\n" in text
    assert "+    $SPECD_SPECULATIVE_ARGS\n" in text
    assert f"-Environment={steps_var}=3 {draft_var}=4\n" in text
    assert (
        '+Environment="SPECD_SPECULATIVE_ARGS=--speculative-algorithm NEXTN '
        "--speculative-num-steps 3 --speculative-eagle-topk 1 "
        '--speculative-num-draft-tokens 4"\n'
    ) in text
    # The value specd chose survives: the env file says 4 steps in the setting form.
    env_change = next(c for c in plan.files if c.path == ENV_FILE)
    assert (
        env_change.new
        == render_setting_env(static(4), algorithm="NEXTN", config_dir="/var/lib/specd").encode()
    )
    assert b"SPECD_SPECULATIVE_ARGS=--speculative-algorithm NEXTN --speculative-num-steps 4 " in (
        env_change.new
    )
    assert any("step variables" in note for note in plan.notes)
    assert ("systemctl", "daemon-reload") in plan.commands
    assert not any("restart" in c and UNIT in c for c in plan.commands)
    # Installed in the new form, a second install finds nothing to do.
    install_files(layout, plan.files)
    new_dropin = layout.host(dropin).read_text()
    migrated = view_of(
        "/bin/false",
        dropins={str(dropin): new_dropin},
        # As systemctl show prints a value with spaces: the assignment quoted whole.
        environment='"SPECD_SPECULATIVE_ARGS=--speculative-algorithm NEXTN '
        "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens "
        '4"',
        shown_argv=f"{BASE} $SPECD_SPECULATIVE_ARGS",
        environment_files=(str(ENV_FILE),),
    )
    layout.host(Path("/var/lib/specd")).mkdir(parents=True, exist_ok=True)
    again = build_plan(migrated, layout, RUNNING, add_metrics=False, specd_argv=SPECD)
    assert again.empty, again.render()
    assert (again.spec.steps, again.spec.draft_tokens) == (3, 4)


def test_a_fresh_install_moves_an_old_override_aside(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    override = layout.host(OVERRIDE_FILE)
    override.parent.mkdir(parents=True)
    override.write_text('mode = "pin"\nsteps = 4\napply = "now"\n')
    view = view_of(f"{BASE} {SPEC}")
    plan = build_plan(
        view, layout, FRESH, add_metrics=False, specd_argv=SPECD, fresh=True, now_s=NOW
    )
    [move] = plan.moves
    assert move.path == OVERRIDE_FILE
    assert move.to == Path("/var/backups/specd/install-20261202T110000Z/etc/specd/override.toml")
    assert f"$ mv {OVERRIDE_FILE} {move.to}\n" in plan.render()
    assert override.exists()  # planning moves nothing
    # Installed already (a manifest): the override was written for this installation.
    again = build_plan(view, layout, FRESH, add_metrics=False, specd_argv=SPECD, fresh=False)
    assert again.moves == []


def test_an_override_the_config_names_elsewhere_is_moved_too(tmp_path: Path) -> None:
    layout, _ = with_config(
        tmp_path,
        '[files]\noverride_file = "/srv/oncall/override.toml"\n',
    )
    layout.host(Path("/srv/oncall")).mkdir(parents=True)
    layout.host(Path("/srv/oncall/override.toml")).write_text('mode = "freeze"\n')
    plan = build_plan(
        view_of(f"{BASE} {SPEC}"), layout, FRESH, add_metrics=False, specd_argv=SPECD, fresh=True
    )
    assert [m.path for m in plan.moves] == [Path("/srv/oncall/override.toml")]


def key_file(tmp_path: Path, mode: int = 0o640) -> Path:
    """/etc/specd/gateway.key under the test's root; its path as specd sees it."""
    host = tmp_path / "etc/specd/gateway.key"
    host.parent.mkdir(parents=True, exist_ok=True)
    host.write_text("admin-key\n")
    host.chmod(mode)
    return Path("/etc/specd/gateway.key")


def test_gateway_settings_go_into_the_config_as_specd_reads_them(tmp_path: Path) -> None:
    view = view_of(f"{PYTHON} --enable-metrics --port 31000 {SPEC}")
    gateway = GatewayOptions(
        ["http://10.0.0.2:30080/", "http://10.0.0.3:30080"],
        str(key_file(tmp_path)),
        "http://10.0.0.9:31000",
    )
    plan = build_plan(
        view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD, gateway=gateway
    )
    text = config_of(plan.files)
    config = Config.model_validate(parse_toml(text))
    assert config.gateway is not None
    assert config.gateway.urls == ["http://10.0.0.2:30080", "http://10.0.0.3:30080"]
    assert config.gateway.api_key_file == Path("/etc/specd/gateway.key")
    assert config.gateway.worker_url == "http://10.0.0.9:31000"
    # Without gateway options the config has none: drains stay off.
    plain = build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    assert Config.model_validate(parse_toml(config_of(plain.files))).gateway is None


@pytest.mark.parametrize(
    ("urls", "key", "mode", "message"),
    [
        (["ftp://10.0.0.2"], None, 0o640, "--gateway-url 'ftp://10.0.0.2': not an http"),
        (["http://a:1", "http://a:1/"], None, 0o640, "listed once"),
        (["http://a:1"], "relative.key", 0o640, "not an absolute path"),
        (["http://a:1"], "/etc/specd/missing.key", 0o640, "not a regular file"),
        (["http://a:1"], "/etc/specd/gateway.key", 0o644, "readable by others"),
        ([f"http://a:{p}" for p in range(1, 18)], None, 0o640, "at most 16"),
    ],
)
def test_gateway_settings_are_checked(
    tmp_path: Path, urls: list[str], key: str | None, mode: int, message: str
) -> None:
    key_file(tmp_path, mode)
    view = view_of(f"{PYTHON} --enable-metrics --port 31000 {SPEC}")
    with pytest.raises(InstallError, match=message):
        build_plan(
            view,
            Layout(tmp_path),
            FRESH,
            add_metrics=False,
            specd_argv=SPECD,
            gateway=GatewayOptions(urls, key),
        )


@pytest.fixture
def open_root() -> Iterator[Path]:
    """A scratch root any user may enter: pytest's tmp_path is under a 0700 directory."""
    with tempfile.TemporaryDirectory() as name:
        os.chmod(name, 0o755)
        yield Path(name)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a key owned by root:nogroup")
@pytest.mark.parametrize(
    ("group", "mode", "link", "problem"),
    [
        # root reads any file; the daemon's user does not (a real user stands in for specd).
        ("root", 0o640, False, "user nobody cannot read it (0640 root:root): run `chgrp"),
        ("root", 0o600, False, "user nobody cannot read it (0600 root:root)"),
        ("nogroup", 0o640, False, None),
        # A secret mount is a symlink to the key: followed, as the daemon reads it.
        ("nogroup", 0o640, True, None),
    ],
)
def test_the_key_file_is_checked_as_the_daemons_user_reads_it(
    open_root: Path, group: str, mode: int, link: bool, problem: str | None
) -> None:
    key = open_root / "etc/specd/gateway.key"
    key.parent.mkdir(parents=True)
    for part in (open_root / "etc", key.parent):
        part.chmod(0o755)
    target = open_root / "run/secrets/gateway-key" if link else key
    target.parent.mkdir(parents=True, exist_ok=True)
    target.parent.chmod(0o755)
    target.parent.parent.chmod(0o755)
    target.write_text("admin-key\n")
    os.chown(target, 0, grp.getgrnam(group).gr_gid)
    target.chmod(mode)
    if link:
        key.symlink_to("../../run/secrets/gateway-key")
    options = GatewayOptions(["http://10.0.0.2:30080"], "/etc/specd/gateway.key")
    if problem is None:
        keys = gateway_keys(options, Layout(open_root), user="nobody")
        assert keys["api_key_file"] == "/etc/specd/gateway.key"
    else:
        with pytest.raises(InstallError, match=re.escape(problem)):
            gateway_keys(options, Layout(open_root), user="nobody")


@pytest.mark.parametrize(
    ("raw", "lines"),
    [
        # The flat form from before the tables: what check-config says, one line each.
        (
            b'sglang_url = "http://127.0.0.1:30000"\nunit = "sglang.service"\n',
            ["`sglang_url` is now `url` in [sglang]", "`unit` belongs in [sglang]"],
        ),
        (b"[sglang]\nurl = [\n", ["invalid TOML: Invalid value (at end of document)"]),
        (b"[sglang]\n# caf\xe9\n", ["not UTF-8 text (byte 14)"]),
    ],
    ids=["flat", "not-toml", "not-utf8"],
)
def test_an_invalid_config_is_refused_before_anything_is_written(
    tmp_path: Path, raw: bytes, lines: list[str]
) -> None:
    layout, config = with_config(
        tmp_path,
        raw,
    )
    before = sorted(tmp_path.rglob("*"))
    view = view_of(f"{BASE} {SPEC}")
    with pytest.raises(InstallError) as err:
        build_plan(view, layout, FRESH, add_metrics=False, specd_argv=SPECD)
    said = str(err.value).splitlines()
    assert said[:-1] == [f"{CONFIG_FILE}: {line}" for line in lines]
    assert "specd check-config" in said[-1]
    assert sorted(tmp_path.rglob("*")) == before
    assert config.read_bytes() == raw


@pytest.mark.parametrize("raw", [b"", b"\n \t\n"], ids=["empty", "whitespace"])
def test_an_empty_config_is_written_as_on_a_fresh_box(tmp_path: Path, raw: bytes) -> None:
    """specd refuses an empty specd.toml (a half-written copy would run on defaults); install
    writes the shipped example with the unit's values into it, not three keys alone."""
    layout, config = with_config(tmp_path / "edited", raw)
    view = view_of(f"{BASE} {SPEC}")
    plan = build_plan(view, layout, FRESH, add_metrics=False, specd_argv=SPECD)
    (tmp_path / "fresh").mkdir()
    fresh = build_plan(view, Layout(tmp_path / "fresh"), FRESH, add_metrics=False, specd_argv=SPECD)
    assert config_of(plan.files) == config_of(fresh.files)
    assert next(c for c in plan.files if c.path == CONFIG_FILE).old == raw
    assert config.read_bytes() == raw  # planned, not written


def test_what_install_would_write_is_checked_too(tmp_path: Path) -> None:
    layout, config = with_config(
        tmp_path,
        "[observe]\nmin_history_s = 5.0\n",
    )
    # A unit install reads fine, whose algorithm as written is not what specd.toml takes.
    view = view_of(f"{BASE} {SPEC.replace('NEXTN', 'nextn')}")
    with pytest.raises(InstallError) as err:
        build_plan(view, layout, FRESH, add_metrics=False, specd_argv=SPECD)
    line, hint = str(err.value).splitlines()
    assert line.startswith(f"{CONFIG_FILE} as install would write it: sglang.speculative_algorithm")
    assert "specd check-config" in hint
    assert config.read_text() == "[observe]\nmin_history_s = 5.0\n"


def test_a_problem_install_itself_fixes_is_no_reason_to_refuse(tmp_path: Path) -> None:
    layout, _ = with_config(
        tmp_path,
        '[sglang]  # box 3\nunit = "sglang"  # not a service name; install sets it\n',
    )
    plan = build_plan(view_of(f"{BASE} {SPEC}"), layout, FRESH, add_metrics=False, specd_argv=SPECD)
    text = config_of(plan.files)
    assert Config.model_validate(parse_toml(text)).sglang.unit == UNIT
    assert "# not a service name; install sets it" in text


def test_refuses_an_alias_and_names_the_unit_it_stands_for(tmp_path: Path) -> None:
    """systemd asks polkit about a unit by its own name: a rule for the alias (and
    [sglang] unit = the alias) denied every restart specd issued, while install and doctor
    said all was well."""
    view = dataclasses.replace(view_of(f"{BASE} {SPEC}"), unit_id="sglang-real.service")
    with pytest.raises(InstallError) as err:
        build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    assert str(err.value) == (
        "sglang.service is an alias of sglang-real.service: run install with --unit "
        "sglang-real.service"
    )


def test_refuses_a_config_the_specd_user_cannot_read(tmp_path: Path) -> None:
    """Checked as root, a 0600 root:root specd.toml passed; install kept its mode, and
    specd.service, which runs as user specd, failed at `enable --now`, install stopped
    midway with specd enabled and failing."""
    # A root the user can enter (pytest's own is 0700): the file itself is the problem.
    root = Path(tempfile.mkdtemp(prefix="specd-install-"))
    root.chmod(0o755)
    layout, config = with_config(root, '[sglang]\nurl = "http://127.0.0.1:30000"\n')
    config.chmod(0o600)
    view = view_of(f"{BASE} {SPEC}")
    with pytest.raises(InstallError) as err:
        build_plan(view, layout, FRESH, add_metrics=False, specd_argv=SPECD, specd_user="nobody")
    group = grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name
    assert str(err.value) == (
        f"{CONFIG_FILE}: user nobody cannot read it (0600 root:root): run `chgrp {group} "
        f"{config} && chmod 0640 {config}`"
    )
    config.chmod(0o644)
    try:
        build_plan(view, layout, FRESH, add_metrics=False, specd_argv=SPECD, specd_user="nobody")
    finally:
        shutil.rmtree(root)
