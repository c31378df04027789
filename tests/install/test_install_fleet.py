"""Install's [fleet] settings (checked by FleetSettings, written, idempotent) and its probe
of the etcd endpoints and gateway replicas, against a real etcd and a real smg on loopback."""

from __future__ import annotations

import argparse
import io
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from factories import SMG_ADMIN_KEY, EtcdProcess, SmgGateway
from install_views import BASE, FRESH, PYTHON, RUNNING, SPEC, SPECD, installed_view, view_of
from test_plan import config_of, install_files, key_file

from specd.install.command import configure, install
from specd.install.execute import execute
from specd.install.layout import CONFIG_FILE, InstallError, Layout
from specd.install.plan import FleetOptions, GatewayOptions, build_plan
from specd.install.probe import probe_config, probe_etcd
from specd.install.uninstall import uninstall
from specd.io.config import Config
from specd.io.files import parse_toml
from specd.io.runner import RunResult
from specd.twin.process import TwinProcess, free_port

FAST = ["--load-time-s", "0.3", "--warmup-s", "0.3", "--report-interval-s", "0.2"]
SPEC4 = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "4",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "5"]  # fmt: skip
FLEET = FleetOptions(
    ["http://10.0.0.5:2379/", "http://10.0.0.6:2379"], "llama-eu", 2, 45.0, "box-a"
)


def test_fleet_settings_go_into_the_config_and_reinstall_is_a_no_op(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    view = view_of(f"{BASE} {SPEC}")
    plan = build_plan(view, layout, FRESH, add_metrics=False, specd_argv=SPECD, fleet=FLEET)
    text = config_of(plan.files)
    # The plan (and so --dry-run) shows the table as a diff.
    assert '+etcd_endpoints = ["http://10.0.0.5:2379", "http://10.0.0.6:2379"]' in plan.render()
    fleet = Config.model_validate(parse_toml(text)).fleet
    assert fleet is not None
    assert fleet.etcd_endpoints == ["http://10.0.0.5:2379", "http://10.0.0.6:2379"]
    assert (fleet.group, fleet.slots, fleet.lease_ttl_s, fleet.holder_name) == (
        "llama-eu", 2, 45.0, "box-a"
    )  # fmt: skip
    install_files(layout, plan.files)
    layout.host(Path("/var/lib/specd")).mkdir(parents=True)
    view = installed_view(layout)
    again = build_plan(view, layout, RUNNING, add_metrics=False, specd_argv=SPECD, fleet=FLEET)
    assert again.empty, again.render()
    # Only the group given: the defaults stay FleetSettings' own, not written.
    layout.host(CONFIG_FILE).unlink()
    plain = build_plan(
        view,
        layout,
        RUNNING,
        add_metrics=False,
        specd_argv=SPECD,
        fleet=FleetOptions(["http://10.0.0.5:2379"], "g"),
    )
    table = parse_toml(config_of(plain.files))["fleet"]
    assert table == {"etcd_endpoints": ["http://10.0.0.5:2379"], "group": "g"}


def test_a_changed_fleet_setting_edits_the_table_in_place(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    view = view_of(f"{BASE} {SPEC}")
    first = build_plan(view, layout, FRESH, add_metrics=False, specd_argv=SPECD, fleet=FLEET)
    install_files(layout, first.files)
    layout.host(Path("/var/lib/specd")).mkdir(parents=True)
    wider = FleetOptions(FLEET.etcd_endpoints, "llama-eu", 3)
    second = build_plan(view, layout, RUNNING, add_metrics=False, specd_argv=SPECD, fleet=wider)
    text = config_of(second.files)
    assert len(re.findall(r"^\[fleet\]$", text, re.M)) == 1
    assert parse_toml(text)["fleet"]["slots"] == 3
    # Keys not given this time are kept as the earlier install wrote them.
    assert parse_toml(text)["fleet"]["holder_name"] == "box-a"
    assert "-slots = 2\n+slots = 3\n" in second.render()


HOSTILE = [
    (
        FleetOptions(["ftp://10.0.0.5:2379"], "g"),
        # One problem, one line: the flag's, not FleetSettings' too.
        [r"^--etcd-endpoint 'ftp://10.0.0.5:2379': not an http"],
    ),
    (FleetOptions(["http://10.0.0.5:2379/v3"], "g"), [r"^--etcd-endpoint .*only scheme, host"]),
    (FleetOptions(["http://10.0.0.5:0"], "g"), [r"^--etcd-endpoint .*port 0 is not"]),
    (FleetOptions(["http://a:1", "http://a:1/"], "g"), ["listed once"]),
    (FleetOptions([f"http://a:{p}" for p in range(1, 18)], "g"), ["at most 16"]),
    (FleetOptions(["http://a:1"], "other/group"), [r"^\[fleet\] group: .*not a group name"]),
    (FleetOptions(["http://a:1"], ""), [r"^\[fleet\] group"]),
    (FleetOptions(["http://a:1"], "g" * 65), [r"^\[fleet\] group"]),
    (
        FleetOptions(["http://a:1"], "g", slots=0),
        [r"^\[fleet\] slots: .*greater than or equal to 1"],
    ),
    (FleetOptions(["http://a:1"], "g", slots=65), [r"^\[fleet\] slots"]),
    (FleetOptions(["http://a:1"], "g", lease_ttl_s=2), [r"^\[fleet\] lease_ttl_s: .*5"]),
    (FleetOptions(["http://a:1"], "g", lease_ttl_s=float("nan")), [r"^\[fleet\] lease_ttl_s"]),
    (FleetOptions(["http://a:1"], "g", holder_name="x" * 201), [r"^\[fleet\] holder_name"]),
    # Every problem reported, one line each.
    (
        FleetOptions(["ftp://x"], "a/b", slots=0, lease_ttl_s=1),
        ["--etcd-endpoint", "group", "slots", "lease_ttl_s"],
    ),
]


@pytest.mark.parametrize(("options", "lines"), HOSTILE)
def test_hostile_fleet_settings_are_refused_and_nothing_is_written(
    tmp_path: Path, options: FleetOptions, lines: list[str]
) -> None:
    view = view_of(f"{PYTHON} --enable-metrics --port 31000 {SPEC}")
    with pytest.raises(InstallError) as err:
        build_plan(
            view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD, fleet=options
        )
    said = str(err.value).splitlines()
    assert len(said) == len(lines), said
    for line, pattern in zip(said, lines, strict=True):
        assert re.search(pattern, line), (pattern, line)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "not a regular file"),
        (lambda p: os.mkfifo(p, 0o640), "not a regular file"),
        (lambda p: (p.write_bytes(b"k" * 100_000), p.chmod(0o640)), "100000 bytes"),
        (lambda p: (p.write_bytes(b""), p.chmod(0o640)), "0 bytes"),
        (lambda p: (p.symlink_to(p.with_name("real")), key_file(p.parents[2])), "regular"),
    ],
    ids=["missing", "fifo", "huge", "empty", "symlink"],
)
def test_a_bad_gateway_key_file_is_refused(tmp_path: Path, make: object, message: str) -> None:
    host = tmp_path / "etc/specd/admin.key"
    host.parent.mkdir(parents=True)
    make(host)  # type: ignore[operator]
    view = view_of(f"{PYTHON} --enable-metrics --port 31000 {SPEC}")
    with pytest.raises(InstallError, match=message):
        build_plan(
            view,
            Layout(tmp_path),
            FRESH,
            add_metrics=False,
            specd_argv=SPECD,
            gateway=GatewayOptions(["http://127.0.0.1:1"], "/etc/specd/admin.key"),
        )


def test_probe_names_each_etcd_endpoint_that_does_not_answer(etcd: EtcdProcess) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    assert probe_etcd([etcd.url]) == []
    problems = probe_etcd([etcd.url, dead], timeout_s=1.0)
    assert len(problems) == 1
    assert problems[0].startswith(f"etcd {dead} POST /v3/maintenance/status: cannot connect")
    etcd.stop()
    assert len(probe_etcd([etcd.url, dead], timeout_s=1.0)) == 2


@pytest.fixture
def twin() -> Iterator[TwinProcess]:
    with TwinProcess([*SPEC4, "--enable-metrics", *FAST]) as t:
        t.wait_healthy()
        yield t


def test_probe_checks_every_gateway_replica_and_its_admin_key(
    tmp_path: Path, twin: TwinProcess
) -> None:
    layout = Layout(tmp_path)
    path = key_file(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"
    with SmgGateway([twin.url], admin_key=SMG_ADMIN_KEY) as smg:
        layout.host(path).write_text("wrong-key\n")
        gateway = {"urls": [smg.url, dead], "api_key_file": str(path)}
        problems, notes = probe_config(None, gateway, twin.url, layout)
        assert len(problems) == 2, problems
        assert problems[0].startswith(f"gateway {smg.url}: GET /workers: HTTP 401")
        assert "--control-plane-api-keys" in problems[0]
        assert problems[1].startswith(f"gateway {dead}: GET /workers: ConnectError")
        layout.host(path).write_text(SMG_ADMIN_KEY + "\n")
        assert probe_config(None, {**gateway, "urls": [smg.url]}, twin.url, layout) == ([], [])
        # Answers, but does not route this server (yet): a note, not a problem.
        other = {**gateway, "urls": [smg.url], "worker_url": "http://127.0.0.1:1"}
        problems, notes = probe_config(None, other, twin.url, layout)
        assert problems == []
        assert len(notes) == 1
        assert "routes no worker with url http://127.0.0.1:1" in notes[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fleet-group", "g"], "need --etcd-endpoint"),
        (["--fleet-slots", "2"], "need --etcd-endpoint"),
        (["--etcd-endpoint", "http://127.0.0.1:2379"], "needs --fleet-group"),
        (["--gateway-api-key-file", "/k"], "need --gateway-url"),
    ],
)
def test_install_refuses_half_a_table_before_reading_the_unit(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    parser = argparse.ArgumentParser(prog="specd install")
    configure(parser)
    args = parser.parse_args(["--unit", "sglang.service", "--dry-run", *argv])
    # A runner that fails the test if install got as far as asking systemd.
    with pytest.raises(InstallError, match=message):
        install(args, _no_runner, Layout(tmp_path), io.StringIO())


def _no_runner(*args: object, **kwargs: object) -> object:
    pytest.fail(f"install ran {args} before refusing its flags")


def test_uninstall_gives_back_the_operators_config_byte_for_byte(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    view = view_of(f"{BASE} {SPEC}")
    config = layout.host(CONFIG_FILE)
    config.parent.mkdir(parents=True)
    # The operator's own file: comments, odd spacing, a [fleet] table of their own.
    original = b'# ours\n[sglang]\nurl  =  "http://127.0.0.1:1"\n\n[fleet]\ngroup = "old"\n'
    config.write_bytes(original)
    layout.host(Path("/var/lib/specd")).mkdir(parents=True)
    ran: list[tuple[str, ...]] = []

    def systemctl(argv: Sequence[str], *, timeout_s: float) -> RunResult:
        # systemd itself is exercised in tests/systemd/; here only the files matter.
        ran.append(tuple(argv))
        stdout = view.cat if list(argv[:2]) == ["systemctl", "cat"] else ""
        return RunResult(tuple(argv), 0, stdout, "", False, 0.0)

    plan = build_plan(view, layout, RUNNING, add_metrics=False, specd_argv=SPECD, fleet=FLEET)
    table = parse_toml(config_of(plan.files))["fleet"]
    assert table["group"] == "llama-eu"
    assert table["etcd_endpoints"] == ["http://10.0.0.5:2379", "http://10.0.0.6:2379"]
    execute(plan, layout, systemctl, view, io.StringIO())
    assert config.read_bytes() != original
    uninstall(layout, systemctl, False, io.StringIO(), now_s=0.0)
    assert config.read_bytes() == original
    assert ("systemctl", "restart", "specd.service") in ran
