"""The files in systemd/ and etc/ (units, drop-in, sysusers, polkit) checked offline with
systemd's own tools: `systemd-analyze verify` (unknown keys and bad values only print to
stderr with exit 0, so stderr must be empty), `systemd-analyze security`, and
`systemd-sysusers --root`. Their behaviour under a running systemd is in tests/systemd/.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPECD_SERVICE = REPO / "systemd/specd.service"
DROPIN = REPO / "systemd/sglang.service.d/50-specd.conf"
EXAMPLE_SGLANG = REPO / "systemd/examples/sglang.service"
SYSUSERS = REPO / "etc/sysusers.d/specd.conf"
POLKIT_RULE = REPO / "etc/polkit-1/rules.d/50-specd.rules"

MAX_EXPOSURE = 2.5
# Executables the units name that exist only on an installed host.
INSTALLED_BINARIES = ("opt/specd/bin/specd", "opt/sglang/bin/python", "bin/kill")


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    if shutil.which(argv[0]) is None:
        pytest.fail(f"{argv[0]} not found: install systemd (scripts/install-system-deps)")
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=30, check=False, env={"LC_ALL": "C"}
    )


# -- a minimal unit-file reader (systemd allows repeated keys, so no configparser) ------


@dataclass(frozen=True)
class Entry:
    section: str
    key: str
    value: str


def read_unit(path: Path) -> list[Entry]:
    entries: list[Entry] = []
    section = ""
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        entries.append(Entry(section, key.strip(), " ".join(value.split())))
    return entries


def values(entries: list[Entry], section: str, key: str) -> list[str]:
    return [e.value for e in entries if e.section == section and e.key == key]


def single(entries: list[Entry], section: str, key: str) -> str:
    found = values(entries, section, key)
    assert len(found) == 1, f"{section}.{key}: {found}"
    return found[0]


def seconds(span: str) -> float:
    """A systemd time span ("20min", "5min 30s", "90") in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "hr": 3600, "ms": 0.001}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span):
        total += float(number) * units[unit]
    return total


@pytest.mark.parametrize(
    ("span", "expected"), [("20min", 1200), ("5min 30s", 330), ("90", 90), ("1h", 3600)]
)
def test_seconds(span: str, expected: float) -> None:
    assert seconds(span) == expected


# -- systemd-analyze verify ----------------------------------------------------------


def install_root(root: Path, with_dropin: bool = True) -> Path:
    """A --root tree holding the units as installed, and the executables they name."""
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    shutil.copy(SPECD_SERVICE, units / "specd.service")
    shutil.copy(EXAMPLE_SGLANG, units / "sglang.service")
    if with_dropin:
        (units / "sglang.service.d").mkdir()
        shutil.copy(DROPIN, units / "sglang.service.d/50-specd.conf")
    for binary in INSTALLED_BINARIES:
        path = root / binary
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    return units


def verify(root: Path, *units: str) -> subprocess.CompletedProcess[str]:
    return run(
        "systemd-analyze", "verify", f"--root={root}", "--recursive-errors=no", "--man=no", *units
    )


@pytest.mark.parametrize(
    ("units", "with_dropin"),
    [
        (("specd.service",), True),
        (("sglang.service",), True),  # the example unit with the drop-in on top
        (("sglang.service",), False),  # the example unit on its own
        (("specd.service", "sglang.service"), True),
    ],
)
def test_verify_passes_with_empty_stderr(
    tmp_path: Path, units: tuple[str, ...], with_dropin: bool
) -> None:
    install_root(tmp_path, with_dropin=with_dropin)
    result = verify(tmp_path, *units)
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "")


# The checks above could pass vacuously if verify ignored the files; each mutation here
# must be reported.
@pytest.mark.parametrize(
    ("target", "mutation", "complaint"),
    [
        ("specd.service", "WatchdogSecs=10s\n", "Unknown key"),
        ("specd.service", "ProtectSystem=stricter\n", "protect system value"),
        ("sglang.service.d/50-specd.conf", "EnvironmentFiles=/x\n", "Unknown key"),
        ("sglang.service", "TimeoutStartSec=soon\n", "TimeoutStartSec"),
    ],
)
def test_verify_reports_a_broken_unit(
    tmp_path: Path, target: str, mutation: str, complaint: str
) -> None:
    units = install_root(tmp_path)
    with (units / target).open("a") as unit:
        unit.write("[Service]\n" + mutation)
    unit_name = target.split(".d/", maxsplit=1)[0]
    result = verify(tmp_path, unit_name)
    assert complaint in result.stderr


def test_verify_reports_a_missing_executable(tmp_path: Path) -> None:
    install_root(tmp_path)
    (tmp_path / "opt/specd/bin/specd").unlink()
    result = verify(tmp_path, "specd.service")
    assert result.returncode != 0
    assert "/opt/specd/bin/specd" in result.stderr


# -- systemd-analyze security ---------------------------------------------------------


def test_security_exposure_at_most_2_5() -> None:
    result = run("systemd-analyze", "security", "--offline=true", "--no-pager", str(SPECD_SERVICE))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    match = re.search(r"Overall exposure level for specd\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout
    # systemd's own gate agrees (threshold is in tenths).
    gate = run(
        "systemd-analyze",
        "security",
        "--offline=true",
        f"--threshold={int(MAX_EXPOSURE * 10)}",
        str(SPECD_SERVICE),
    )
    assert gate.returncode == 0, gate.stdout


def test_security_gate_rejects_an_unhardened_unit(tmp_path: Path) -> None:
    bare = tmp_path / "specd.service"
    bare.write_text("[Service]\nExecStart=/bin/true\n")
    gate = run(
        "systemd-analyze",
        "security",
        "--offline=true",
        f"--threshold={int(MAX_EXPOSURE * 10)}",
        str(bare),
    )
    assert gate.returncode != 0


# -- what the units must say ----------------------------------------------------------


@pytest.fixture(scope="module")
def specd_unit() -> list[Entry]:
    return read_unit(SPECD_SERVICE)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("Type", "notify"),
        ("NotifyAccess", "main"),
        ("User", "specd"),
        ("Group", "specd"),
        ("StateDirectory", "specd"),
        ("StateDirectoryMode", "0751"),
        ("ConfigurationDirectory", "specd"),
        ("Restart", "on-failure"),
        ("ExecReload", "/bin/kill -HUP $MAINPID"),
        ("ExecStart", "/opt/specd/bin/specd run --config /etc/specd/specd.toml"),
        ("ProtectSystem", "strict"),
        ("NoNewPrivileges", "yes"),
        ("CapabilityBoundingSet", ""),
        ("IPAddressAllow", "localhost"),
    ],
)
def test_specd_service_settings(specd_unit: list[Entry], key: str, expected: str) -> None:
    assert single(specd_unit, "Service", key) == expected


def test_specd_service_watchdog_is_set(specd_unit: list[Entry]) -> None:
    assert seconds(single(specd_unit, "Service", "WatchdogSec")) > 0


def test_specd_service_is_ordered_after_sglang_but_never_bound_to_it(
    specd_unit: list[Entry],
) -> None:
    after = " ".join(values(specd_unit, "Unit", "After")).split()
    assert "sglang.service" in after
    for strong in ("Requires", "Requisite", "BindsTo", "PartOf", "Upholds", "PropagatesStopTo"):
        for section in ("Unit", "Service"):
            assert not any("sglang" in v for v in values(specd_unit, section, strong)), strong
    assert not values(specd_unit, "Service", "DynamicUser")


def test_specd_stop_timeout_lasts_until_the_first_extension(specd_unit: list[Entry]) -> None:
    """On SIGTERM specd finishes a restart it has begun, within a TimeoutStopSec= as long as
    a whole sequence (a daemon-reload forgets the extensions its heartbeat makes; tests/
    test_daemon_lifecycle.py derives the value), and at least a WatchdogSec=, which the
    first extension after SIGTERM takes beyond with timeouts longer than the defaults."""
    timeout_s = seconds(single(specd_unit, "Service", "TimeoutStopSec"))
    assert timeout_s >= seconds(single(specd_unit, "Service", "WatchdogSec"))


@pytest.mark.parametrize("path", [DROPIN, EXAMPLE_SGLANG])
def test_sglang_reads_its_speculative_setting_from_specd(path: Path) -> None:
    unit = read_unit(path)
    env = dict(
        shlex.split(line)[0].split("=", 1)
        for line in values(unit, "Service", "Environment")
        if "SPECD_SPECULATIVE_ARGS=" in line
    )
    words = env["SPECD_SPECULATIVE_ARGS"].split()
    # The default is a static setting specd can read back: topk 1, draft = steps + 1.
    options = dict(zip(words[::2], words[1::2], strict=True))
    steps = int(options["--speculative-num-steps"])
    assert options["--speculative-eagle-topk"] == "1"
    assert int(options["--speculative-num-draft-tokens"]) == steps + 1
    assert options["--speculative-algorithm"] == "NEXTN"
    assert values(unit, "Service", "EnvironmentFile") == ["-/var/lib/specd/sglang.env"]
    command = [v for v in values(unit, "Service", "ExecStart") if v]
    assert len(command) == 1
    # Unbraced, so systemd splits it into words (and an empty value adds none); no other
    # speculative setting option on the line (argparse would keep the last one).
    assert re.search(r"(^|\s)\$SPECD_SPECULATIVE_ARGS(\s|$)", command[0]), command[0]
    assert "${SPECD_SPECULATIVE_ARGS}" not in command[0]
    for option in ("--speculative-algorithm", "--speculative-num-", "--speculative-eagle"):
        assert option not in command[0], option


def test_dropin_resets_execstart_and_matches_the_example() -> None:
    dropin = values(read_unit(DROPIN), "Service", "ExecStart")
    assert dropin[0] == "", "the drop-in must clear the unit's own ExecStart first"
    assert dropin[1:] == values(read_unit(EXAMPLE_SGLANG), "Service", "ExecStart")


# -- sysusers and polkit ---------------------------------------------------------------


def test_sysusers_creates_the_user_the_unit_runs_as(
    tmp_path: Path, specd_unit: list[Entry]
) -> None:
    (tmp_path / "etc/sysusers.d").mkdir(parents=True)
    shutil.copy(SYSUSERS, tmp_path / "etc/sysusers.d/specd.conf")
    result = run("systemd-sysusers", f"--root={tmp_path}")
    assert result.returncode == 0, result.stderr
    # Parse problems only print; creation lines are all that may appear.
    assert all(line.startswith("Creating ") for line in result.stderr.splitlines()), result.stderr
    passwd = {
        fields[0]: fields
        for fields in (
            line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()
        )
    }
    user = single(specd_unit, "Service", "User")
    assert user in passwd
    assert passwd[user][6] == "/usr/sbin/nologin"
    assert 0 < int(passwd[user][2]) < 1000  # a system user
    group_names = [line.split(":")[0] for line in (tmp_path / "etc/group").read_text().splitlines()]
    assert single(specd_unit, "Service", "Group") in group_names


def test_polkit_rule_names_the_user_the_unit_and_the_verbs(specd_unit: list[Entry]) -> None:
    """Its behaviour is tested under a real polkitd in tests/systemd; this keeps the names in
    the rule in step with the unit."""
    rule = POLKIT_RULE.read_text()
    assert f'subject.user !== "{single(specd_unit, "Service", "User")}"' in rule
    assert 'var SGLANG_UNIT = "sglang.service";' in rule
    assert re.findall(r'verb === "([a-z-]+)"', rule) == ["restart", "try-restart", "reset-failed"]
    assert '"org.freedesktop.systemd1.manage-units"' in rule


def test_a_specd_installed_under_a_path_with_spaces_verifies(tmp_path: Path) -> None:
    """A venv at /home/ops/my tools/venv: install shows its tree to specd.service, which
    ProtectHome= hides, with BindReadOnlyPaths=; unquoted, systemd split the path in two
    ("tools/venv/...: not an absolute path") and the unit failed with 226/NAMESPACE."""
    from specd.install.render import render_specd_service  # noqa: PLC0415

    units = install_root(tmp_path)
    program = "/home/ops/my tools/venv/bin/specd"
    binary = tmp_path / program.lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    text = render_specd_service(SPECD_SERVICE.read_text(), "sglang.service", [program])
    assert "BindReadOnlyPaths=" in text
    (units / "specd.service").write_text(text)
    result = verify(tmp_path, "specd.service")
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "")
