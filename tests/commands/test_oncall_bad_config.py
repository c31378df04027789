"""The on-call's commands on a config file an operator's edit left invalid.

A reload rejects such a file and the daemon runs on with its last good config, so `specd
status`, `specd override` and `specd unfreeze` (SpecdFrozen's runbook) must not lock the
on-call out: they exited 2 on a typo in a table they do not read. They use the file's valid
parts, with one warning line on stderr saying so, and refuse, one line per problem, only
where what they need is broken: [files] (a default state directory or override file would
be another specd's) or a file that cannot be read as TOML at all.

Real files throughout, the commands through specd.cli.main (tests/in_process.py), the
reproducer (`scrape_intervall_s`) also as real `python -m specd.cli` processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from factories import run_specd
from in_process import specd_main

from specd.io.state import UNFREEZE_REQUEST, State, StateStore
from specd.twin.process import free_port

REPO = Path(__file__).resolve().parents[2]
TYPO = b"[observe]\nscrape_intervall_s = 10\n"  # the audit's reproducer
TYPO_PROBLEM = "observe.scrape_intervall_s: unknown key (check the spelling"
KEPT = "a running specd keeps its last good config"


@dataclass
class Box:
    """A specd's files: a frozen state, no override yet, and its config file."""

    tmp: Path

    @property
    def state(self) -> Path:
        return self.tmp / "state"

    @property
    def override(self) -> Path:
        return self.tmp / "override.toml"

    @property
    def config(self) -> Path:
        return self.tmp / "specd.toml"

    def good(self) -> bytes:
        return (
            f'[sglang]\nurl = "http://127.0.0.1:{free_port()}"\n'
            f'env_file = "{self.tmp}/sglang.env"\n'
            f'[files]\nstate_dir = "{self.state}"\noverride_file = "{self.override}"\n'
        ).encode()


@pytest.fixture
def box(tmp_path: Path) -> Box:
    found = Box(tmp_path)
    found.state.mkdir()
    frozen = {"since": time.time() - 60, "reason": "restart to 6 rolled_back: never healthy"}
    assert StateStore(found.state).save(State(frozen=frozen)) is None
    return found


def environment() -> dict[str, str]:
    """This one without SPECD_* (the config under test is the file's alone)."""
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("SPECD_")}


COMMANDS: dict[str, tuple[str, ...]] = {
    "specd status": ("status", "--json"),
    "specd override": ("override", "freeze", "--for", "2h", "--reason", "incident 7"),
    "specd unfreeze": ("unfreeze", "--reason", "checked SGLang's log"),
}


def run(box: Box, command: str, process: bool = False) -> subprocess.CompletedProcess[str]:
    argv = (*COMMANDS[command], "--config", str(box.config))
    if process:
        return run_specd(*argv, env=environment(), cwd=REPO)
    return specd_main(*argv, env=environment())


def check_worked(box: Box, command: str, done: subprocess.CompletedProcess[str]) -> None:
    """What ``command`` does on a valid file, done."""
    assert done.returncode == 0, done.stderr
    if command == "specd status":
        shown: dict[str, Any] = json.loads(done.stdout)  # stdout stays JSON alone
        assert shown["frozen"]["reason"] == "restart to 6 rolled_back: never healthy"
        assert shown["state_file"] == str(box.state / "state.json")
    elif command == "specd override":
        assert 'mode = "freeze"' in box.override.read_text()
    else:
        assert json.loads((box.state / UNFREEZE_REQUEST).read_text())["reason"]


# A file with problems in what the commands do not need: (the file, from the good one; how
# many problems, the first, which the warning names; the keys taken at their default).
WORKS: dict[str, tuple[Callable[[bytes], bytes], int, str, list[str]]] = {
    "unknown key": (lambda good: good + TYPO, 1, TYPO_PROBLEM, []),
    "bad value in another table": (
        lambda good: good + b"[report]\nmetrics_port = 99999\n",
        1,
        "report.metrics_port: Input should be less than or equal to 65535 (got 99999)",
        ["report.metrics_port"],
    ),
    "both": (
        lambda good: good + TYPO + b"[report]\nmetrics_port = 99999\n",
        2,
        f"{TYPO_PROBLEM}; see etc/specd/specd.toml); 1 more: `specd check-config ",
        ["report.metrics_port"],
    ),
    "bad window": (
        lambda good: good + b'[[windows]]\ncron = "0 3 * * 1"\nduration_s = 3600\n',
        1,
        "windows[0].cron: weekday '1': use names mon..sun",
        ["windows"],
    ),
    "not UTF-8 in a comment": (
        lambda good: b"# r\xe9glages de nuit\n" + good,
        1,
        "not UTF-8 text (byte 3), in a comment",
        [],
    ),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", WORKS)
def test_the_oncall_commands_use_the_valid_parts_of_a_file_with_problems(
    box: Box, kind: str, command: str
) -> None:
    edit, count, problem, defaults = WORKS[kind]
    box.config.write_bytes(edit(box.good()))
    done = run(box, command)
    check_worked(box, command, done)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    warning = lines[0]
    problems = "1 problem" if count == 1 else f"{count} problems"
    assert warning.startswith(f"{command}: warning: {box.config} has {problems} ({problem}")
    assert KEPT in warning
    # What it used: the file's [files], and the step range, whence.
    assert f"state_dir {box.state}, override_file {box.override}, steps 1..6" in warning
    if defaults:
        assert warning.endswith(f"defaults for {', '.join(defaults)}"), warning
    else:
        assert "defaults for" not in warning
    if command == "specd status":
        config = json.loads(done.stdout)["config"]
        assert config["file"] == str(box.config)
        assert config["valid"] is False
        assert len(config["problems"]) == count
        assert config["problems"][0].startswith(problem.split("; see")[0])
        assert config["defaults_for"] == defaults


@pytest.mark.parametrize("command", COMMANDS)
def test_the_reproducer_as_real_processes(box: Box, command: str) -> None:
    box.config.write_bytes(box.good() + TYPO)
    done = run(box, command, process=True)
    check_worked(box, command, done)
    assert done.stderr.startswith(f"{command}: warning: {box.config} has 1 problem ({TYPO_PROBLEM}")
    assert done.stderr.count("\n") == 1, done.stderr
    # A valid file: not a word on stderr, and status says so in its JSON.
    box.config.write_bytes(box.good())
    again = run(box, command, process=True)
    assert again.returncode == 0
    assert again.stderr == ""
    if command == "specd status":
        assert json.loads(again.stdout)["config"]["valid"] is True


# [files] broken, or a file that is no TOML at all: (the file, None for none; the problems
# the refusal names, one line each). The reproducer's typo beside it is no line of it.
REFUSED: dict[str, tuple[Callable[[bytes], bytes] | None, list[str]]] = {
    "bad [files] value": (
        lambda good: good.replace(b'state_dir = "/', b'state_dir = "') + TYPO,
        ["files.state_dir: "],
    ),
    "typo in [files]": (
        lambda good: good.replace(b"override_file =", b"overide_file =") + TYPO,
        ["files.overide_file: unknown key"],
    ),
    "[files] key in another table": (
        lambda good: good.replace(b"\noverride_file =", b"\n[observe]\noverride_file ="),
        ["observe.override_file: `override_file` belongs in [files]"],
    ),
    "not UTF-8 in [files]": (
        lambda good: good.replace(b"/state", b"/\xe9tat") + TYPO,
        ["files.state_dir: not UTF-8 text"],
    ),
    "not TOML": (lambda good: good + b"[observe\n", ["invalid TOML: "]),
    "missing file": (None, ["cannot read: No such file or directory"]),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", REFUSED)
def test_the_oncall_commands_refuse_where_the_files_table_is_broken(
    box: Box, kind: str, command: str
) -> None:
    edit, problems = REFUSED[kind]
    if edit is not None:
        box.config.write_bytes(edit(box.good()))
    done = run(box, command)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == len(problems), done.stderr
    for line, problem in zip(lines, problems, strict=True):
        assert line.startswith(f"{command}: {box.config}: {problem}"), line
        assert f"refused: {command} takes [files]" in line, line
        assert KEPT in line, line
        assert line.endswith("nothing done"), line
    # Nothing written, and no default path tried.
    assert not box.override.exists()
    assert not (box.state / UNFREEZE_REQUEST).exists()


# The step range a pin is checked against: the file's where valid, else the default, and
# the warning says which.
RANGES = {
    "the file's": (b"[choose]\nmax_steps = 8\n" + TYPO, "steps 1..8", 0),
    "the default": (
        b"[choose]\nmax_steps = 99\n",
        "steps 1..6 (max_steps at the default: left out)",
        2,
    ),
}


@pytest.mark.parametrize("source", RANGES)
def test_a_pin_is_checked_against_the_step_range_the_warning_names(box: Box, source: str) -> None:
    added, said, code = RANGES[source]
    box.config.write_bytes(box.good() + added)
    done = specd_main(
        "override",
        *("pin", "8", "--now", "--for", "2h", "--reason", "batch tonight"),
        *("--config", str(box.config)),
        env=environment(),
    )
    assert done.returncode == code, done.stdout + done.stderr
    warning = done.stderr.splitlines()[0]
    assert warning.startswith("specd override: warning: "), done.stderr
    assert f"override_file {box.override}, {said}" in warning, warning
    if code:
        assert done.stderr.splitlines()[1] == (
            "specd override: 8 steps is outside the configured range 1..6"
        )
        assert not box.override.exists()
    else:
        assert "steps = 8" in box.override.read_text()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_check_across_tables_leaves_out_the_key_the_file_sets(box: Box, command: str) -> None:
    # max_steps = 3 against the default bands (4 and 3 steps): the file sets only max_steps,
    # so that is what is left out, whatever the problem's line says.
    box.config.write_bytes(box.good() + b"[choose]\nmax_steps = 3\n")
    done = run(box, command)
    check_worked(box, command, done)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        f"{command}: warning: {box.config} has 1 problem "
        "(bands[0].steps: 4 is outside choose.min_steps..max_steps (1..3))"
    ), lines[0]
    # The windows it says are this file's: the running specd may wait for others.
    assert lines[0].endswith(
        "steps 1..6 (max_steps at the default: left out), windows as this file writes them "
        "(a running specd may use others)"
    ), lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_problem_of_the_environment_is_refused_as_the_shells(box: Box, command: str) -> None:
    box.config.write_bytes(box.good() + TYPO)
    env = {**environment(), "SPECD_STATE_DIR": "/elsewhere"}
    done = specd_main(*COMMANDS[command], "--config", str(box.config), env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        f"{command}: SPECD_STATE_DIR: unknown setting in the environment; `state_dir` belongs "
        "in [files]: use SPECD_FILES__STATE_DIR (this shell's environment, not "
        f"{box.config}: unset it or correct it); nothing done"
    ]
    assert not box.override.exists()
    assert not (box.state / UNFREEZE_REQUEST).exists()
