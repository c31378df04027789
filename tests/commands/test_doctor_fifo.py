"""`specd doctor` on files it reads that are no files to read: a FIFO at [sglang] env_file
or at /etc/specd/install-manifest.json hung it for ever, a symlink there to /dev/zero was
read until memory ran out. Each is now a failed check with a one-line reason, within
seconds; install and uninstall, which read the manifest the same way, stop with that line.

Real FIFOs, symlinks, directories and sparse files; the checks run in this process in a
thread given a few seconds (a regression fails, it does not hang)."""

from __future__ import annotations

import contextlib
import os
import pwd
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from bounded import bounded, plant_directory, plant_fifo, plant_huge, plant_zero

from specd.commands.doctor import Check, Doctor, render
from specd.install.layout import MANIFEST_FILE, InstallError, Layout
from specd.install.manifest import load_manifest
from specd.io.config import load_config
from specd.io.runner import SubprocessRunner
from specd.twin.process import free_port

DEFAULTS = {
    "SPECD_SPECULATIVE_ARGS": "--speculative-algorithm NEXTN --speculative-num-steps 3 "
    "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
}
INFO_3 = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}
WORDS = ["/opt/sglang/bin/python", "-m", "sglang.launch_server", "$SPECD_SPECULATIVE_ARGS"]


@contextlib.contextmanager
def unable_to_read() -> Iterator[None]:
    """Run as a user who may not read the planted files: this one, when it is not root (the
    file is 0000); as root, with the effective uid of nobody (tmp_path is root's, 0700)."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(pwd.getpwnam("nobody").pw_uid)
    try:
        yield
    finally:
        os.seteuid(0)


def _unreadable(path: Path) -> None:
    path.write_text(f"SPECD_SPECULATIVE_ARGS={DEFAULTS['SPECD_SPECULATIVE_ARGS']}\n")
    path.chmod(0o000)


def doctor(tmp_path: Path) -> Doctor:
    """Doctor on a config in ``tmp_path`` (SGLang down), its install manifest under
    ``tmp_path``/root, as tests/commands/test_doctor.py makes it."""
    (tmp_path / "root").mkdir(exist_ok=True)
    config = tmp_path / "specd.toml"
    config.write_text(
        f'[sglang]\nurl = "http://127.0.0.1:{free_port()}"\nenv_file = "{tmp_path}/sglang.env"\n'
        f'[files]\nstate_dir = "{tmp_path}/state"\noverride_file = "{tmp_path}/override.toml"\n'
    )
    found = Doctor(config, SubprocessRunner(), layout=Layout(tmp_path / "root"))
    found.config = load_config(config)
    return found


# (make it, what the check's one line says after the file's name).
ENV_FILES = [
    pytest.param(plant_fifo, "is not a regular file (a FIFO)", id="fifo"),
    pytest.param(
        plant_zero, "is a symbolic link; specd reads only a regular file here", id="symlink"
    ),
    pytest.param(plant_directory, "is not a regular file (a directory)", id="directory"),
    pytest.param(plant_huge, "is 64 MiB, larger than the 64 KiB allowed", id="huge regular file"),
    pytest.param(_unreadable, "cannot read: Permission denied", id="unreadable"),
]


@pytest.mark.parametrize(("make", "problem"), ENV_FILES)
def test_an_env_file_doctor_cannot_read_fails_the_setting_check(
    tmp_path: Path, make: Callable[[Path], None], problem: str
) -> None:
    env_file = tmp_path / "sglang.env"
    found = doctor(tmp_path)
    make(env_file)
    found.info = INFO_3
    context = unable_to_read() if make is _unreadable else contextlib.nullcontext()

    def check() -> Check:
        with context:
            return found.check_setting(DEFAULTS)

    setting = bounded(check, env_file)
    assert setting.name == "setting"
    assert not setting.ok
    assert setting.detail == f"[sglang] env_file {env_file}: {problem}"
    [advice] = setting.advice.splitlines()
    if make is _unreadable:
        assert advice == "run `specd doctor` as root, as it reads what specd's user reads"
    else:
        assert advice == (
            "make it a regular file of at most 64 KiB, not a link (specd reads it so before "
            "each change), or remove it: `specd install --unit sglang.service` writes one"
        )


# The rows of ENV_FILES it hung on or read without end (a directory, a big file and one
# it may not read it already read as adding nothing, or read whole).
UNBOUNDED = [
    pytest.param(plant_fifo, id="fifo"),
    pytest.param(plant_zero, id="symlink"),
]


@pytest.mark.parametrize("make", UNBOUNDED)
def test_the_command_check_reads_no_env_file_without_bound(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    """The command line systemd would run, expanded from the unit's EnvironmentFile= and
    specd's env file (the drop-in check expands it too): one that cannot be read adds
    nothing (the setting check names specd's)."""
    env_file, unit_env = tmp_path / "sglang.env", tmp_path / "unit.env"
    found = doctor(tmp_path)
    make(env_file)
    make(unit_env)
    found.unit_env_files = [unit_env]
    found.info = {"launch_command": f"/usr/bin/python3 -m x {DEFAULTS['SPECD_SPECULATIVE_ARGS']}"}
    command = bounded(lambda: found.check_command(WORDS, DEFAULTS), env_file, unit_env)
    assert command == Check("command", True, "SGLang runs the drop-in's command line")


# (make it, what the check's one line says after the manifest's name).
MANIFESTS = [
    pytest.param(plant_fifo, "is not a regular file (a FIFO)", id="fifo"),
    # Followed, as install reads the files it manages: what it points to is named.
    pytest.param(plant_zero, "is not a regular file (a character device)", id="symlink"),
    pytest.param(plant_directory, "is not a regular file (a directory)", id="directory"),
    pytest.param(plant_huge, "is 64 MiB, larger than the 16 MiB allowed", id="huge regular file"),
]


def _plant_manifest(tmp_path: Path, make: Callable[[Path], None]) -> Path:
    manifest = Layout(tmp_path / "root").host(MANIFEST_FILE)
    manifest.parent.mkdir(parents=True)
    make(manifest)
    return manifest


@pytest.mark.parametrize(("make", "problem"), MANIFESTS)
def test_a_manifest_doctor_cannot_read_fails_the_unit_check(
    tmp_path: Path, make: Callable[[Path], None], problem: str
) -> None:
    found = doctor(tmp_path)
    manifest = _plant_manifest(tmp_path, make)
    unit = bounded(found.check_installed_unit, manifest)
    assert unit is not None
    assert (unit.name, unit.ok) == ("unit", False)
    assert unit.detail == f"{MANIFEST_FILE} {problem}"
    assert unit.advice == (
        f"{MANIFEST_FILE} is install's record of what it changed, which `specd uninstall` "
        "undoes: put back the file install wrote (a regular file)"
    )


@pytest.mark.parametrize(("make", "problem"), MANIFESTS)
def test_install_and_uninstall_stop_on_a_manifest_they_cannot_read(
    tmp_path: Path, make: Callable[[Path], None], problem: str
) -> None:
    """They read it as doctor does (`load_manifest`): one line, no hang, nothing read
    without bound; an OSError too, for a reader that skips what it cannot read."""
    manifest = _plant_manifest(tmp_path, make)

    def load() -> str:
        with pytest.raises(InstallError) as refused:
            load_manifest(Layout(tmp_path / "root"))
        assert isinstance(refused.value, OSError)
        assert not isinstance(refused.value, PermissionError)
        return str(refused.value)

    assert bounded(load, manifest) == f"{MANIFEST_FILE} {problem}"


def test_a_manifest_doctor_may_not_read_is_not_judged(tmp_path: Path) -> None:
    """0600 root, read by another user: doctor cannot tell which unit specd was installed
    for, and says nothing of it (as before), without hanging."""
    found = doctor(tmp_path)
    manifest = _plant_manifest(tmp_path, _unreadable)

    def check() -> Check | None:
        with unable_to_read():
            return found.check_installed_unit()

    assert bounded(check, manifest) is None


def test_doctor_runs_through_with_a_fifo_at_both_and_says_each_in_one_line(
    tmp_path: Path,
) -> None:
    found = doctor(tmp_path)
    env_file = tmp_path / "sglang.env"
    plant_fifo(env_file)
    manifest = _plant_manifest(tmp_path, plant_fifo)
    checks = bounded(found.run, env_file, manifest)
    by_name = {c.name: c for c in checks}
    assert not by_name["unit"].ok
    assert not by_name["setting"].ok
    text = render(checks)
    assert f"✗ unit           {MANIFEST_FILE} is not a regular file (a FIFO)\n" in text, text
    assert (
        f"✗ setting        [sglang] env_file {env_file}: is not a regular file (a FIFO)\n" in text
    ), text
