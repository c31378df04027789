"""The directories specd.toml has specd write in ([files] state_dir, [sglang] env_file's
directory) against the hardened specd.service (ProtectSystem=strict, StateDirectory=specd,
PrivateTmp=yes, ProtectHome=yes): what install prepares or refuses, what check-config warns
of, how a unit's sandbox is judged. Under a real systemd: tests/systemd/test_writable_systemd.py.

Before: install wrote the unit unchanged, so specd could write only /var/lib/specd; an env
file elsewhere failed every change with "Read-only file system" (and froze specd), a state
directory elsewhere stopped its start; check-config and install said nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from install_views import BASE, FRESH, SPEC, SPECD, view_of

from specd import cli
from specd.commands.check_config import path_warnings
from specd.install.layout import CONFIG_FILE, SPECD_UNIT, UNITS_DIR, InstallError, Layout
from specd.install.plan import Plan, build_plan
from specd.install.render import template
from specd.install.sandbox import SHIPPED, Sandbox
from specd.io.config import Config
from specd.io.files import parse_toml


def plan_for(tmp_path: Path, files: str, make: tuple[str, ...] = ()) -> Plan:
    """install's plan on a scratch root whose specd.toml has ``files`` (TOML), with the
    directories ``make`` there already (root's, 0755)."""
    tmp_path.chmod(0o755)  # the root of the scratch "system", as / is
    layout = Layout(tmp_path)
    config = layout.host(CONFIG_FILE)
    config.parent.mkdir(parents=True)
    config.write_text(files)
    for directory in make:
        layout.host(Path(directory)).mkdir(mode=0o755, parents=True, exist_ok=True)
    return build_plan(view_of(f"{BASE} {SPEC}"), layout, FRESH, add_metrics=False, specd_argv=SPECD)


def unit_text(plan: Plan) -> str:
    return next(c for c in plan.files if c.path == UNITS_DIR / SPECD_UNIT).new.decode()


@pytest.mark.parametrize(
    ("files", "make", "read_write", "made"),
    [
        # The defaults: StateDirectory= covers both; nothing to add.
        ("", (), None, []),
        # An env file for SGLang under /srv: allowed, and its directory made specd's.
        (
            '[sglang]\nenv_file = "/srv/llm/specd.env"\n',
            ("/srv",),
            "-/srv/llm",
            ["mkdir -m 0751 /srv/llm", "chown specd:specd /srv/llm"],
        ),
        # A state directory on another disk, none of its path there yet: made, the way to
        # it root's.
        (
            '[files]\nstate_dir = "/data/specd/state"\n',
            (),
            "-/data/specd/state",
            [
                "mkdir -m 0755 /data",
                "chown root:root /data",
                "mkdir -m 0755 /data/specd",
                "chown root:root /data/specd",
                "mkdir -m 0751 /data/specd/state",
                "chown specd:specd /data/specd/state",
            ],
        ),
        # Both elsewhere: one line names both.
        (
            '[sglang]\nenv_file = "/srv/llm/specd.env"\n[files]\nstate_dir = "/srv/specd"\n',
            ("/srv",),
            "-/srv/specd -/srv/llm",
            [
                "mkdir -m 0751 /srv/specd",
                "chown specd:specd /srv/specd",
                "mkdir -m 0751 /srv/llm",
                "chown specd:specd /srv/llm",
            ],
        ),
        # Under /var/lib/specd: writable already; a directory below it is made specd's.
        (
            '[sglang]\nenv_file = "/var/lib/specd/llm/sglang.env"\n',
            ("/var/lib/specd",),
            None,
            ["mkdir -m 0751 /var/lib/specd/llm", "chown specd:specd /var/lib/specd/llm"],
        ),
    ],
    ids=["defaults", "env-file-in-srv", "state-dir-new-disk", "both", "under-state-directory"],
)
def test_install_allows_and_prepares_the_configured_directories(
    tmp_path: Path, files: str, make: tuple[str, ...], read_write: str | None, made: list[str]
) -> None:
    plan = plan_for(tmp_path, files, make)
    unit = unit_text(plan)
    lines = [line for line in unit.splitlines() if line.startswith("ReadWritePaths=")]
    assert lines == ([] if read_write is None else [f"ReadWritePaths={read_write}"]), unit
    # As systemd reads the unit: every configured directory is writable to specd.
    sandbox = Sandbox.from_unit_text(unit)
    config = Config(**parse_toml(files)) if files else Config()
    for directory in (Path(config.files.state_dir), Path(config.sglang.env_file).parent):
        assert sandbox.read_only(directory) is None, directory
    commands = [line.removeprefix("$ ") for line in plan.render().splitlines()]
    prepared = [
        c
        for c in commands
        if c.startswith(("mkdir", "chown")) and not c.endswith(" /var/lib/specd")
    ]
    assert prepared == made


@pytest.mark.parametrize(
    ("files", "make", "said"),
    [
        (
            '[sglang]\nenv_file = "/tmp/sglang.env"\n',
            ("/tmp",),
            "sglang.env_file /tmp/sglang.env: specd writes SGLang's env file in /tmp, but "
            "PrivateTmp=yes gives specd.service a /tmp and /var/tmp of its own",
        ),
        (
            '[files]\nstate_dir = "/home/ops/specd"\n',
            ("/home/ops",),
            "files.state_dir /home/ops/specd: specd writes its state, lock and adaptive configs "
            "in /home/ops/specd, but ProtectHome=yes hides /home, /root and /run/user",
        ),
        # specd's config directory is root's: install does not hand it to the daemon (which
        # could then edit install's manifest, and so what root deletes at uninstall).
        (
            '[sglang]\nenv_file = "/etc/specd/sglang.env"\n',
            (),
            "sglang.env_file /etc/specd/sglang.env: specd writes SGLang's env file in "
            "/etc/specd, but user specd cannot write /etc/specd (0755 root:root)",
        ),
        (
            '[files]\nstate_dir = "/srv/shared"\n',
            ("/srv/shared",),
            "files.state_dir /srv/shared: specd writes its state, lock and adaptive configs in "
            "/srv/shared, but user specd cannot write /srv/shared (0755 root:root)",
        ),
    ],
    ids=["private-tmp", "home", "etc-specd", "root-owned"],
)
def test_install_refuses_a_directory_it_cannot_prepare_in_one_line(
    tmp_path: Path, files: str, make: tuple[str, ...], said: str
) -> None:
    if os.geteuid() != 0:
        pytest.skip("the scratch root's directories must be root's, as on a real system")
    with pytest.raises(InstallError) as refused:
        plan_for(tmp_path, files, make)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(said), message
    assert message.endswith(": keep it under /var/lib/specd (the default)"), message


def test_the_shipped_unit_is_the_sandbox_check_config_judges_by() -> None:
    assert Sandbox.from_unit_text(template("specd.service")) == SHIPPED


@pytest.mark.parametrize(
    ("props", "directory", "said"),
    [
        ({"ProtectSystem": "strict", "StateDirectory": "specd"}, "/var/lib/specd", None),
        ({"ProtectSystem": "strict", "StateDirectory": "specd"}, "/var/lib/specd/a", None),
        (
            {"ProtectSystem": "strict", "StateDirectory": "specd"},
            "/srv/llm",
            "ProtectSystem=strict makes it read-only to specd (it may write /var/lib/specd: "
            "StateDirectory= and ReadWritePaths=)",
        ),
        (
            {"ProtectSystem": "strict", "StateDirectory": "specd", "ReadWritePaths": "-/srv/llm"},
            "/srv/llm",
            None,
        ),
        ({"ProtectSystem": "strict", "ReadWritePaths": "/srv"}, "/srv/llm", None),
        ({"ProtectSystem": "full"}, "/etc/sglang", "ProtectSystem=full makes it read-only"),
        ({"ProtectSystem": "yes"}, "/etc/sglang", None),
        ({"ProtectSystem": "no"}, "/usr/local/x", None),
        (
            {"ProtectSystem": "strict", "PrivateTmp": "yes", "ReadWritePaths": "/tmp"},
            "/tmp",
            "PrivateTmp=yes gives specd.service a /tmp",
        ),
        ({"PrivateTmp": "no"}, "/tmp/x", None),
    ],
)
def test_a_units_sandbox_judges_a_directory(
    props: dict[str, str], directory: str, said: str | None
) -> None:
    why = Sandbox.from_properties(props).read_only(Path(directory))
    if said is None:
        assert why is None
    else:
        assert why is not None
        assert why.startswith(said), why


@pytest.mark.parametrize(
    ("files", "said"),
    [
        ("", []),
        ('[sglang]\nenv_file = "/var/lib/specd/llm/sglang.env"\n', []),
        (
            '[sglang]\nenv_file = "/srv/llm/specd.env"\n',
            [
                "sglang.env_file: warning: specd writes SGLang's env file in /srv/llm, outside "
                "/var/lib/specd: specd.service (ProtectSystem=strict) may write there only once "
                "its ReadWritePaths= names it, which `specd install` adds"
            ],
        ),
        (
            '[files]\nstate_dir = "/var/tmp/specd"\n',
            [
                "files.state_dir: warning: specd writes its state, lock and adaptive configs in "
                "/var/tmp/specd, but PrivateTmp=yes gives specd.service a /tmp and /var/tmp of "
                "its own"
            ],
        ),
    ],
)
def test_check_config_warns_of_a_directory_the_shipped_unit_cannot_write(
    tmp_path: Path, files: str, said: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "specd.toml"
    path.write_text(files or "# defaults\n")
    lines = path_warnings(Config(**parse_toml(files)))
    assert len(lines) == len(said), lines
    for line, start in zip(lines, said, strict=True):
        assert line.startswith(start), line
    # Valid all the same (specd may run without that unit): exit 0, each warning on stderr.
    assert cli.main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [*(f"{path}: {line}" for line in lines), f"{path}: OK"]
