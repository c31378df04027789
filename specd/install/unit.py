"""Reading the SGLang unit as systemd sees it: ``systemctl show`` (what is in force, specifiers
resolved), ``systemctl cat`` (each word exactly as written), and its environment."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specd.install.execline import (
    Command,
    resolve_specifiers,
    split_words,
    unit_specifiers,
)
from specd.install.layout import InstallError, Layout, run_checked
from specd.io.apply import parse_env
from specd.io.runner import Runner
from specd.io.timespan import timespan_s

SHOW_PROPERTIES = (
    "Id",
    "LoadState",
    "ExecStart",
    "Environment",
    "EnvironmentFiles",
    "FragmentPath",
    "DropInPaths",
    "NeedDaemonReload",
    "Restart",
    "RestartUSec",
)


@dataclass(frozen=True)
class ShowExec:
    """One command of ``systemctl show -p ExecStart``: argv is space-joined, unquoted."""

    path: str
    argv_text: str
    ignore_errors: bool


@dataclass(frozen=True)
class UnitView:
    """The unit as systemd sees it now."""

    unit: str
    load_state: str
    exec_start: tuple[ShowExec, ...]
    environment: dict[str, str]
    fragment_path: str
    dropin_paths: tuple[str, ...]
    cat: str
    environment_files: tuple[str, ...] = ()
    # Its files changed on disk since systemd loaded them (an install that stopped midway).
    need_reload: bool = False
    # Restart= ("no", "on-failure", …; "" not shown) and RestartSec= in seconds (None: not
    # shown or not a time span).
    restart: str = ""
    restart_sec_s: float | None = None
    # Its name as systemd knows it (Id=): another than ``unit`` where ``unit`` is an alias.
    unit_id: str = ""


def parse_exec_property(value: str) -> ShowExec:
    """``{ path=/x ; argv[]=/x a b ; ignore_errors=no ; ... }`` → ShowExec."""
    body = value.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise InstallError(f"unexpected ExecStart format from systemctl show: {value[:80]!r}")
    body = body[1:-1].strip()
    match = re.match(r"path=(.*?) ; argv\[\]=(.*) ; ignore_errors=(yes|no)\b", body)
    if match is None:
        raise InstallError(f"unexpected ExecStart format from systemctl show: {value[:80]!r}")
    return ShowExec(match.group(1), match.group(2), match.group(3) == "yes")


def parse_environment(value: str) -> dict[str, str]:
    """``Environment=A=1 B="x y"`` as systemctl show prints it."""
    try:
        words = shlex.split(value)
    except ValueError:
        words = value.split()
    env: dict[str, str] = {}
    for word in words:
        key, sep, val = word.partition("=")
        if sep:
            env[key] = val
    return env


def parse_show(unit: str, show_text: str, cat_text: str) -> UnitView:
    """The output of ``systemctl show -p ...`` (KEY=VALUE lines) and ``systemctl cat``."""
    props: dict[str, list[str]] = {}
    for line in show_text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props.setdefault(key, []).append(value)
    execs = tuple(parse_exec_property(v) for v in props.get("ExecStart", []) if v.strip())
    env: dict[str, str] = {}
    for value in props.get("Environment", []):
        env.update(parse_environment(value))
    # "EnvironmentFiles=/var/lib/specd/sglang.env (ignore_errors=yes)", one line per file.
    env_files = tuple(
        v.rsplit(" (ignore_errors=", 1)[0] for v in props.get("EnvironmentFiles", []) if v
    )
    dropins = tuple(p for v in props.get("DropInPaths", []) for p in v.split() if p)
    return UnitView(
        unit=unit,
        load_state=(props.get("LoadState") or [""])[-1],
        exec_start=execs,
        environment=env,
        fragment_path=(props.get("FragmentPath") or [""])[-1],
        dropin_paths=dropins,
        cat=cat_text,
        environment_files=env_files,
        need_reload=(props.get("NeedDaemonReload") or [""])[-1] == "yes",
        restart=(props.get("Restart") or [""])[-1],
        restart_sec_s=timespan_s((props.get("RestartUSec") or [""])[-1]),
        unit_id=(props.get("Id") or [""])[-1],
    )


def cat_sections(view: UnitView) -> list[tuple[str, str]]:
    """``systemctl cat`` split into (file path, text), recognising only the headers systemd
    prints for the unit's own files (a comment like ``# /etc/x`` inside a file stays)."""
    known = {view.fragment_path, *view.dropin_paths} - {""}
    sections: list[tuple[str, str]] = []
    current: str | None = None
    lines: list[str] = []
    for line in view.cat.splitlines():
        if line.startswith("# ") and line[2:] in known:
            if current is not None:
                sections.append((current, "\n".join(lines)))
            current, lines = line[2:], []
        elif current is not None:
            lines.append(line)
    if current is not None:
        sections.append((current, "\n".join(lines)))
    return sections


def _logical_lines(text: str) -> Iterable[str]:
    """Unit-file lines with backslash continuations joined (the backslash becomes a space;
    comment lines inside a continuation are skipped), as systemd reads them."""
    pending: str | None = None
    for raw in text.splitlines():
        stripped = raw.strip()
        if pending is not None and stripped.startswith(("#", ";")):
            continue
        if raw.endswith("\\") and not raw.endswith("\\\\"):
            pending = (pending or "") + raw[:-1] + " "
            continue
        line = (pending or "") + raw
        pending = None
        yield line
    if pending is not None:
        yield pending


def _settings(text: str) -> Iterator[tuple[str, str]]:
    """(section, logical line stripped) of each setting line of one unit file: no blank
    line, comment or section header."""
    section = ""
    for line in _logical_lines(text):
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if stripped.startswith("[") and stripped.endswith("]"):
            section = stripped[1:-1]
            continue
        yield section, stripped


def service_assignments(text: str, key: str) -> list[str]:
    """Values of ``KEY=`` in the [Service] section of one unit file, in order."""
    values: list[str] = []
    for section, stripped in _settings(text):
        name, sep, value = stripped.partition("=")
        if sep and section == "Service" and name.strip() == key:
            values.append(value.strip())
    return values


def dropin_extras(text: str, variables: frozenset[str], env_files: frozenset[str]) -> list[str]:
    """The settings of the file at specd's drop-in path that specd's own drop-in would not
    keep, one logical line each as written: anything but ``ExecStart=`` (install carries
    the command over), ``Environment=`` of specd's ``variables`` only, and
    ``EnvironmentFile=`` of one of ``env_files``."""
    extras: list[str] = []
    for section, stripped in _settings(text):
        name, sep, value = (part.strip() for part in stripped.partition("="))
        if section == "Service" and sep:
            if name == "ExecStart":
                continue
            if name == "EnvironmentFile" and value.removeprefix("-") in env_files:
                continue
            if name == "Environment" and _only_variables(value, variables):
                continue
        extras.append(stripped if section == "Service" else f"[{section}] {stripped}")
    return extras


def _only_variables(value: str, variables: frozenset[str]) -> bool:
    try:
        words = shlex.split(value)
    except ValueError:
        return False
    return bool(words) and all(word.partition("=")[0] in variables for word in words)


def _effective_exec_lines(view: UnitView) -> list[str]:
    """The ExecStart= values in force, after drop-ins (an empty assignment resets)."""
    current: list[str] = []
    for _, text in cat_sections(view):
        for value in service_assignments(text, "ExecStart"):
            if value == "":
                current = []
            else:
                current.append(value)
    return current


def live_command(view: UnitView) -> Command:
    """The one ExecStart= systemd runs, each word exact and its specifiers resolved as systemd
    resolves them (``systemctl cat`` keeps quoting that ``systemctl show`` loses; ``show`` is
    the authority on what is in force)."""
    if view.load_state != "loaded":
        raise InstallError(f"{view.unit}: no such unit (LoadState={view.load_state or 'unknown'})")
    if not view.exec_start:
        raise InstallError(f"{view.unit}: has no ExecStart=; nothing to wire")
    if len(view.exec_start) > 1:
        raise InstallError(
            f"{view.unit}: has {len(view.exec_start)} ExecStart= commands; specd wires a unit "
            "that runs SGLang as its one command"
        )
    shown = view.exec_start[0]
    lines = _effective_exec_lines(view)
    if len(lines) == 1:
        prefix, raw = split_words(lines[0])
        # With "@" the second word is argv[0]; show's argv[] starts there.
        head = 1 if "@" in prefix else 0
        specifiers = unit_specifiers(view.unit, view.fragment_path)
        resolved = [resolve_specifiers(w, specifiers) for w in raw]
        if all(w is not None for w in resolved):
            words = [w for w in resolved if w is not None]
            if " ".join(words[head:]) == shown.argv_text:
                return Command(prefix, tuple(words))
        shown_words = shown.argv_text.split(" ")
        if len(shown_words) == len(raw) - head:
            # The same words after host specifiers (%H, %m, ...) systemd alone knows.
            first = [raw[0]] if head else []
            return Command(prefix, tuple(first + shown_words))
    raise InstallError(
        f"{view.unit}: cannot read its ExecStart= unambiguously from `systemctl cat` "
        f"(systemd runs: {shown.argv_text[:120]}); write the command on one ExecStart= line"
    )


def unit_environment(view: UnitView, layout: Layout) -> dict[str, str]:
    """The variables the command is run with: Environment=, then EnvironmentFile= (whose
    settings win, as in systemd). A file that cannot be read adds nothing."""
    env = dict(view.environment)
    for name in view.environment_files:
        try:
            data = layout.read(Path(name))
        except OSError:
            data = None
        if data is not None:
            env.update(parse_env(data.decode("utf-8", "replace")))
    return env


def read_unit(runner: Runner, unit: str) -> UnitView:
    show = run_checked(
        runner, ["systemctl", "show", *(f"--property={p}" for p in SHOW_PROPERTIES), unit]
    ).stdout
    view = parse_show(unit, show, "")
    if view.load_state != "loaded":
        raise InstallError(f"{unit}: no such unit (LoadState={view.load_state or 'unknown'})")
    cat = run_checked(runner, ["systemctl", "cat", "--no-pager", unit]).stdout
    return parse_show(unit, show, cat)
