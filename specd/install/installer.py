"""`specd install` and `specd uninstall`: wire an existing SGLang unit to specd, reversibly.

install reads the unit as systemd sees it (``systemctl show`` + ``systemctl cat``), finds the
speculative flags in the live ``ExecStart=``, and writes a drop-in that repeats that command
with ``${SPECD_SPEC_STEPS}`` / ``${SPECD_SPEC_DRAFT_TOKENS}`` in their place. It also installs
the specd user (sysusers), its state directory, ``specd.service``, the polkit rule scoped to
the unit and ``/etc/specd/specd.toml``, then reloads systemd and starts specd. It never
restarts SGLang. Every file it writes or changes is recorded, with the original content, in
a manifest that uninstall follows to undo exactly that.

The pure parts (parsing ``systemctl`` output, finding flags, rendering files, planning) take
a ``Layout`` whose root is ``/`` in production and a temporary directory in tests.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import json
import os
import pwd
import re
import shlex
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specd.io.apply import ENV_DRAFT_TOKENS, ENV_STEPS
from specd.io.files import write_atomic
from specd.io.runner import Runner, RunResult

DROPIN_NAME = "50-specd.conf"
SPECD_UNIT = "specd.service"
SPECD_USER = "specd"
UNITS_DIR = Path("/etc/systemd/system")
STATE_DIR = Path("/var/lib/specd")
ENV_FILE = STATE_DIR / "sglang.env"
CONFIG_DIR = Path("/etc/specd")
CONFIG_FILE = CONFIG_DIR / "specd.toml"
# In /etc/specd rather than specd's state dir: the daemon can write /var/lib/specd, and a
# manifest it could edit would let it steer what root deletes at uninstall.
MANIFEST_FILE = CONFIG_DIR / "install-manifest.json"
POLKIT_FILE = Path("/etc/polkit-1/rules.d/50-specd.rules")
SYSUSERS_FILE = Path("/etc/sysusers.d/specd.conf")
MANIFEST_VERSION = 1
SYSTEMCTL_TIMEOUT_S = 30.0
START_TIMEOUT_S = 120.0

# Templates, as package data first (an installed specd), then the source tree.
TEMPLATES = {
    "specd.service": "systemd/specd.service",
    "polkit": "etc/polkit-1/rules.d/50-specd.rules",
    "sysusers": "etc/sysusers.d/specd.conf",
    "config": "etc/specd/specd.toml",
}
_PACKAGE_DATA = Path(__file__).resolve().parents[1] / "data" / "install"
_SOURCE_TREE = Path(__file__).resolve().parents[2]

SHOW_PROPERTIES = ("Id", "LoadState", "ExecStart", "Environment", "FragmentPath", "DropInPaths")

# SGLang's options that matter here. argparse (allow_abbrev) also accepts any unambiguous
# prefix; as these are a subset of SGLang's options, a prefix SGLang accepted and that
# matches one of them can only mean that one.
VALUE_OPTIONS = frozenset(
    {
        "--speculative-algorithm",
        "--speculative-draft-model-path",
        "--speculative-draft-model-revision",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
        "--speculative-accept-threshold-single",
        "--speculative-accept-threshold-acc",
        "--speculative-token-map",
        "--speculative-attention-mode",
        "--speculative-adaptive-config",
        "--host",
        "--port",
    }
)
SWITCH_OPTIONS = frozenset(
    {"--enable-metrics", "--enable-metrics-for-all-schedulers", "--speculative-adaptive"}
)
ALIASES = {"--speculative-draft-model": "--speculative-draft-model-path"}
_ALL_OPTIONS = VALUE_OPTIONS | SWITCH_OPTIONS | frozenset(ALIASES)
# Draft-model algorithms whose depth is --speculative-num-steps.
TUNABLE_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE"})

_UNIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:_.\\@-]*\.service$")
_EXEC_PREFIX = re.compile(r"^[-@:+!]*")


class InstallError(Exception):
    """install/uninstall cannot go on; the message is one line for the operator."""


# -- reading the unit as systemd sees it -----------------------------------------------------


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
    dropins = tuple(p for v in props.get("DropInPaths", []) for p in v.split() if p)
    return UnitView(
        unit=unit,
        load_state=(props.get("LoadState") or [""])[-1],
        exec_start=execs,
        environment=env,
        fragment_path=(props.get("FragmentPath") or [""])[-1],
        dropin_paths=dropins,
        cat=cat_text,
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


def service_assignments(text: str, key: str) -> list[str]:
    """Values of ``KEY=`` in the [Service] section of one unit file, in order."""
    section = ""
    values: list[str] = []
    for line in _logical_lines(text):
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if stripped.startswith("[") and stripped.endswith("]"):
            section = stripped[1:-1]
            continue
        name, sep, value = stripped.partition("=")
        if sep and section == "Service" and name.strip() == key:
            values.append(value.strip())
    return values


_C_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "s": " ",
    "\\": "\\",
    '"': '"',
    "'": "'",
    ";": ";",
}


def split_exec(value: str) -> tuple[str, list[str]]:
    """An ``ExecStart=`` value → (prefix characters, words), unquoted as systemd does (``%%``
    becomes ``%``; ``$`` is kept: systemd expands variables only when it runs the command)."""
    prefix = _EXEC_PREFIX.match(value.lstrip())
    assert prefix is not None
    rest = value.lstrip()[prefix.end() :]
    words: list[str] = []
    word: list[str] | None = None
    quote = ""
    i = 0
    while i < len(rest):
        ch = rest[i]
        if ch == "\\" and i + 1 < len(rest):
            nxt = rest[i + 1]
            if nxt == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", rest[i + 2 : i + 4]):
                char, i = chr(int(rest[i + 2 : i + 4], 16)), i + 4
            else:
                char, i = _C_ESCAPES.get(nxt, nxt), i + 2
            word = (word or []) + [char]
            continue
        if ch == "%" and rest[i + 1 : i + 2] == "%":
            word, i = (word or []) + ["%"], i + 2
            continue
        if quote:
            if ch == quote:
                quote = ""
            else:
                word = (word or []) + [ch]
        elif ch in "\"'":
            quote, word = ch, word or []
        elif ch.isspace():
            if word is not None:
                words.append("".join(word))
            word = None
        else:
            word = (word or []) + [ch]
        i += 1
    if quote:
        raise InstallError(f"unterminated quote in ExecStart={value[:80]}")
    if word is not None:
        words.append("".join(word))
    return prefix.group(0), words


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


@dataclass(frozen=True)
class Command:
    """The SGLang command line: systemd exec prefixes and words as written in a unit."""

    prefix: str
    words: tuple[str, ...]


def live_command(view: UnitView) -> Command:
    """The one ExecStart= systemd runs, with each argument exact (``systemctl cat`` keeps
    quoting that ``systemctl show`` loses; ``show`` is the authority on what is in force)."""
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
        prefix, words = split_exec(lines[0])
        argv = words[1:] if "@" in prefix else words
        if " ".join(argv) == shown.argv_text:
            return Command(prefix, tuple(words))
        shown_words = shown.argv_text.split(" ")
        if len(shown_words) == len(argv):
            # The same words after specifier expansion (%i, %h, ...): take systemd's values.
            head = words[:1] if "@" in prefix else []
            return Command(prefix, tuple(head + shown_words))
    raise InstallError(
        f"{view.unit}: cannot read its ExecStart= unambiguously from `systemctl cat` "
        f"(systemd runs: {shown.argv_text[:120]}); write the command on one ExecStart= line"
    )


# -- the speculative flags ---------------------------------------------------------------------


@dataclass(frozen=True)
class Flag:
    """One option on the command line: where, how written, and its value."""

    name: str  # canonical (aliases and abbreviations resolved)
    index: int  # word index of the option
    inline: bool  # --flag=value
    value: str | None

    @property
    def value_index(self) -> int:
        return self.index if self.inline else self.index + 1


def _canonical(option: str) -> str | None:
    if option in _ALL_OPTIONS:
        return ALIASES.get(option, option)
    matches = {ALIASES.get(o, o) for o in _ALL_OPTIONS if o.startswith(option)}
    if len(matches) > 1:
        raise InstallError(
            f"{option} is an ambiguous abbreviation ({', '.join(sorted(matches))}); "
            "SGLang itself would refuse it"
        )
    return matches.pop() if matches else None


def find_flags(words: Sequence[str]) -> dict[str, Flag]:
    """The known options among the words (first-to-last; argparse keeps the last)."""
    flags: dict[str, Flag] = {}
    for i, word in enumerate(words):
        if not word.startswith("--") or word == "--":
            continue
        option, eq, value = word.partition("=")
        name = _canonical(option)
        if name is None:
            continue
        if name in SWITCH_OPTIONS:
            flags[name] = Flag(name, i, bool(eq), value if eq else None)
        elif eq:
            flags[name] = Flag(name, i, True, value)
        else:
            following = words[i + 1] if i + 1 < len(words) else None
            flags[name] = Flag(name, i, False, following)
    return flags


@dataclass(frozen=True)
class Speculation:
    """What install found in the live command line."""

    algorithm: str
    steps: int
    draft_tokens: int
    steps_flag: Flag
    draft_flag: Flag
    metrics: bool
    host: str
    port: int


def _int_value(flag: Flag, environment: dict[str, str], variable: str) -> int:
    raw = flag.value or ""
    if raw == "${" + variable + "}":
        # Already wired (a second install): today's value is the drop-in's default.
        raw = environment.get(variable, "")
        if not raw.isdigit():
            raise InstallError(
                f"{flag.name} is ${{{variable}}} but the unit sets no default for it in "
                "Environment="
            )
    if not raw.isdigit():
        raise InstallError(
            f"{flag.name} has the value {flag.value!r}: write the number itself in ExecStart="
        )
    return int(raw)


def analyse(command: Command, environment: dict[str, str], unit: str) -> Speculation:
    """The speculative setup of the command, or InstallError saying why specd cannot tune it.
    A missing --enable-metrics is reported in ``metrics`` (install can add it)."""
    flags = find_flags(command.words)
    algorithm = flags.get("--speculative-algorithm")
    if algorithm is None or not algorithm.value:
        raise InstallError(
            f"{unit} runs without speculative decoding (no --speculative-algorithm in "
            "ExecStart=): specd has nothing to tune"
        )
    name = algorithm.value.upper()
    if name not in TUNABLE_ALGORITHMS:
        raise InstallError(
            f"{unit} uses --speculative-algorithm {algorithm.value}: specd tunes the step count "
            f"of {', '.join(sorted(TUNABLE_ALGORITHMS))} only"
        )
    adaptive = flags.get("--speculative-adaptive")
    if adaptive is not None and (adaptive.value or "true").lower() not in ("false", "0", "no"):
        raise InstallError(
            f"{unit} runs with --speculative-adaptive: SGLang already switches step counts "
            "itself and would fight specd; remove it (and --speculative-adaptive-config) first"
        )
    missing = [
        f
        for f in (
            "--speculative-num-steps",
            "--speculative-eagle-topk",
            "--speculative-num-draft-tokens",
        )
        if f not in flags
    ]
    if missing:
        raise InstallError(
            f"{unit}: ExecStart= lacks {', '.join(missing)}; specd needs all three written out "
            "(--speculative-num-steps K --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens K+1)"
        )
    topk = flags["--speculative-eagle-topk"]
    if (topk.value or "").strip() != "1":
        raise InstallError(
            f"{unit} runs with --speculative-eagle-topk {topk.value}: specd applies chain "
            "drafting only (topk 1, draft tokens = steps + 1)"
        )
    steps_flag = flags["--speculative-num-steps"]
    draft_flag = flags["--speculative-num-draft-tokens"]
    steps = _int_value(steps_flag, environment, ENV_STEPS)
    draft = _int_value(draft_flag, environment, ENV_DRAFT_TOKENS)
    if steps < 1:
        raise InstallError(f"{unit} runs with --speculative-num-steps {steps}: must be >= 1")
    port_flag = flags.get("--port")
    port_text = port_flag.value if port_flag is not None and port_flag.value else "30000"
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InstallError(f"{unit} runs with --port {port_text!r}: not a TCP port")
    host_flag = flags.get("--host")
    host = host_flag.value if host_flag is not None and host_flag.value else "127.0.0.1"
    return Speculation(
        algorithm=algorithm.value,
        steps=steps,
        draft_tokens=draft,
        steps_flag=steps_flag,
        draft_flag=draft_flag,
        metrics="--enable-metrics" in flags,
        host=host,
        port=int(port_text),
    )


def sglang_url(host: str, port: int) -> str:
    """Where specd reaches SGLang: a wildcard listen address means loopback."""
    if host in ("0.0.0.0", "", "*"):  # noqa: S104 - mapping a bind-all address to loopback
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


# -- rendering ---------------------------------------------------------------------------------


_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@+=:,./${}\[\]-]+")


def quote_word(word: str) -> str:
    """A word for an ExecStart= line that systemd reads back as ``word`` (``$`` untouched:
    the words came from a unit, where ``$`` already means what it should)."""
    escaped = word.replace("%", "%%")
    if word == ";":
        return "\\;"
    if _PLAIN_WORD.fullmatch(word):
        return escaped
    escaped = escaped.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


def format_exec(command: Command) -> str:
    """``ExecStart=`` value, one option (and its values) per continuation line."""
    groups: list[list[str]] = [[]]
    for word in command.words:
        if word.startswith("--") and groups[-1]:
            groups.append([])
        groups[-1].append(quote_word(word))
    lines = [" ".join(group) for group in groups]
    return command.prefix + " \\\n    ".join(lines)


def wired_command(command: Command, spec: Speculation, add_metrics: bool) -> Command:
    words = list(command.words)
    for flag, variable in ((spec.steps_flag, ENV_STEPS), (spec.draft_flag, ENV_DRAFT_TOKENS)):
        expansion = "${" + variable + "}"
        if flag.inline:
            words[flag.index] = words[flag.index].split("=", 1)[0] + "=" + expansion
        else:
            words[flag.index + 1] = expansion
    if add_metrics and not spec.metrics:
        words.append("--enable-metrics")
    return Command(command.prefix, tuple(words))


def render_dropin(
    unit: str, command: Command, spec: Speculation, add_metrics: bool, env_file: Path = ENV_FILE
) -> str:
    wired = wired_command(command, spec, add_metrics)
    return (
        f"# Written by `specd install` from {unit}'s own ExecStart=; `specd uninstall` removes\n"
        "# it. specd writes the step count to the EnvironmentFile below and restarts the unit\n"
        "# in a maintenance window; systemd reads that file afresh at every start.\n"
        "[Service]\n"
        "# Today's values, used until specd has written its file.\n"
        f"Environment={ENV_STEPS}={spec.steps} {ENV_DRAFT_TOKENS}={spec.draft_tokens}\n"
        f"EnvironmentFile=-{env_file}\n"
        "# The empty assignment drops the unit's own command; the next line replaces it.\n"
        "ExecStart=\n"
        f"ExecStart={format_exec(wired)}\n"
    )


def template(name: str) -> str:
    relative = TEMPLATES[name]
    for base in (_PACKAGE_DATA, _SOURCE_TREE):
        path = base / relative
        if path.is_file():
            return path.read_text(encoding="utf-8")
    raise InstallError(
        f"template {relative} not found in {_PACKAGE_DATA} nor {_SOURCE_TREE}: "
        "this specd was installed without its data files; reinstall it"
    )


def render_polkit(text: str, unit: str) -> str:
    pattern = re.compile(r'^(\s*var SGLANG_UNIT = )"[^"]*";', re.MULTILINE)
    if not pattern.search(text):
        raise InstallError('polkit template has no `var SGLANG_UNIT = "...";` line')
    return pattern.sub(lambda m: f"{m.group(1)}{json.dumps(unit)};", text, count=1)


HIDDEN_BY_PROTECT_HOME = (Path("/home"), Path("/root"), Path("/run/user"))
# Paths, not temp files: what PrivateTmp=yes replaces inside the service.
HIDDEN_BY_PRIVATE_TMP = (Path("/tmp"), Path("/var/tmp"))  # noqa: S108


def specd_command() -> list[str]:
    """How systemd should start this very specd: its script, else its interpreter."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.name == "specd" and argv0.is_file():
        return [str(argv0.resolve())]
    beside = Path(sys.executable).parent / "specd"
    if beside.is_file():
        return [str(beside)]
    return [sys.executable, "-m", "specd.cli"]


def _under(path: Path, tops: Sequence[Path]) -> bool:
    return any(path == h or h in path.parents for h in tops)


def _under_home(path: Path) -> bool:
    return _under(path, HIDDEN_BY_PROTECT_HOME)


def hidden_code_paths(command: Sequence[str]) -> list[Path]:
    """What specd.service must see that ProtectHome=yes or PrivateTmp=yes hides: the
    program's directory tree (a venv), the interpreter's installation (pyenv puts it under
    /root; a throw-away checkout may live under /tmp)."""
    program = Path(command[0])
    candidates = [
        program.parent.parent if program.parent.name == "bin" else program.parent,
        Path(sys.prefix),
        Path(sys.base_prefix).resolve(),
        Path(sys.executable).resolve().parent.parent,
        # specd's own package: inside the venv normally, but an editable install (a
        # checkout) imports it from the source tree.
        Path(__file__).resolve().parents[2],
    ]
    hidden: list[Path] = []
    for path in candidates:
        hidden_here = _under(path, HIDDEN_BY_PROTECT_HOME + HIDDEN_BY_PRIVATE_TMP)
        if hidden_here and not any(p == path or p in path.parents for p in hidden):
            hidden = [p for p in hidden if path not in p.parents] + [path]
    return sorted(hidden)


def render_specd_service(text: str, unit: str, command: Sequence[str]) -> str:
    exec_line = " ".join(quote_word(w) for w in [*command, "run", "--config", str(CONFIG_FILE)])
    out, count = re.subn(r"^ExecStart=.*$", lambda _: f"ExecStart={exec_line}", text, flags=re.M)
    if count != 1:
        raise InstallError("specd.service template: expected exactly one ExecStart= line")
    out = re.sub(
        r"^(After=.*?)\bsglang\.service\b",
        lambda m: m.group(1) + unit,
        out,
        count=1,
        flags=re.MULTILINE,
    )
    hidden = hidden_code_paths(command)
    if hidden:
        # ProtectHome=yes / PrivateTmp=yes would hide specd's own code or interpreter:
        # show exactly those, read-only.
        extra = "\n[Service]\n# specd's code lives where ProtectHome=/PrivateTmp= hide it.\n"
        if any(_under_home(p) for p in hidden):
            extra += "ProtectHome=tmpfs\n"
        extra += f"BindReadOnlyPaths={' '.join(map(str, hidden))}\n"
        out = out.rstrip("\n") + "\n" + extra
    return out


def render_config(existing: str | None, url: str, unit: str) -> str:
    """/etc/specd/specd.toml: the shipped example, or the operator's file, with sglang_url
    and sglang_unit set; everything else kept as written."""
    text = existing if existing is not None else template("config")
    for key, value in (("sglang_url", url), ("sglang_unit", unit)):
        line = f"{key} = {json.dumps(value)}"
        head, tail = _split_top_level(text)
        pattern = re.compile(rf"^[ \t]*{key}[ \t]*=.*$", re.MULTILINE)
        found = pattern.search(head)
        if found is not None:
            head = head[: found.start()] + line + head[found.end() :]
        else:
            head = f"{line}\n{head}"
        text = head + tail
    return text


def _split_top_level(text: str) -> tuple[str, str]:
    """(top-level part, rest from the first table header): top-level keys live in the first."""
    match = re.search(r"^[ \t]*\[", text, re.MULTILINE)
    if match is None:
        return text, ""
    return text[: match.start()], text[match.start() :]


# -- the plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where the system's files are: ``/`` in production, a directory in tests."""

    root: Path = Path("/")

    def host(self, path: Path) -> Path:
        return self.root / path.relative_to("/")

    def read(self, path: Path) -> bytes | None:
        try:
            return self.host(path).read_bytes()
        except FileNotFoundError:
            return None


@dataclass(frozen=True)
class FileChange:
    path: Path
    old: bytes | None
    new: bytes
    mode: int = 0o644

    def diff(self) -> str:
        old = (self.old or b"").decode("utf-8", "replace").splitlines(keepends=True)
        new = self.new.decode("utf-8", "replace").splitlines(keepends=True)
        label_old = f"{self.path} (absent)" if self.old is None else str(self.path)
        label_new = f"{self.path} (new, {self.mode:04o})" if self.old is None else str(self.path)
        lines = list(difflib.unified_diff(old, new, label_old, label_new))
        return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


@dataclass(frozen=True)
class DirChange:
    path: Path
    mode: int
    owner: str


@dataclass
class Plan:
    unit: str
    spec: Speculation
    files: list[FileChange] = field(default_factory=list)
    dirs: list[DirChange] = field(default_factory=list)
    commands: list[tuple[str, ...]] = field(default_factory=list)
    create_user: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.files or self.dirs or self.commands or self.create_user)

    def render(self) -> str:
        out: list[str] = []
        for change in self.files:
            out.append(change.diff())
        users = [c for c in self.commands if c[0] == "systemd-sysusers"]
        for argv in users:
            out.append("$ " + shlex.join(argv) + "\n")
        for directory in self.dirs:
            out.append(f"$ mkdir -m {directory.mode:04o} {directory.path}\n")
            out.append(f"$ chown {directory.owner}:{directory.owner} {directory.path}\n")
        for argv in self.commands:
            if argv not in users:
                out.append("$ " + shlex.join(argv) + "\n")
        return "".join(out)


@dataclass(frozen=True)
class SystemState:
    """What install needs to know about the machine besides files."""

    user_exists: bool
    specd_enabled: bool
    specd_active: bool


def build_plan(
    view: UnitView,
    layout: Layout,
    system: SystemState,
    *,
    add_metrics: bool,
    specd_argv: Sequence[str],
) -> Plan:
    """Everything install would write and run; raises InstallError for a unit it refuses."""
    unit = view.unit
    command = live_command(view)
    spec = analyse(command, view.environment, unit)
    if not spec.metrics and not add_metrics:
        raise InstallError(
            f"{unit} runs without --enable-metrics, and specd reads SGLang's /metrics: re-run "
            "with --add-enable-metrics to add it in the drop-in (live at SGLang's next restart)"
        )
    dropin = UNITS_DIR / f"{unit}.d" / DROPIN_NAME
    later = [p for p in view.dropin_paths if Path(p).name > DROPIN_NAME and Path(p) != dropin]
    for later_path in later:
        text = next((t for p, t in cat_sections(view) if p == later_path), "")
        if service_assignments(text, "ExecStart"):
            raise InstallError(
                f"{later_path} sets ExecStart= and is read after {DROPIN_NAME}, so specd's drop-in "
                "would have no effect; fold it into the unit or remove it"
            )
    existing_config = layout.read(CONFIG_FILE)
    url = sglang_url(spec.host, spec.port)
    wanted = {
        dropin: render_dropin(unit, command, spec, add_metrics),
        UNITS_DIR / SPECD_UNIT: render_specd_service(
            template("specd.service"), unit, list(specd_argv)
        ),
        POLKIT_FILE: render_polkit(template("polkit"), unit),
        SYSUSERS_FILE: template("sysusers"),
        CONFIG_FILE: render_config(
            None if existing_config is None else existing_config.decode("utf-8", "replace"),
            url,
            unit,
        ),
    }
    plan = Plan(unit=unit, spec=spec)
    for path, text in wanted.items():
        old = layout.read(path)
        if old != text.encode():
            plan.files.append(FileChange(path, old, text.encode()))
    if not system.user_exists:
        plan.create_user = True
        plan.commands.append(("systemd-sysusers", str(SYSUSERS_FILE)))
    if not layout.host(STATE_DIR).is_dir():
        plan.dirs.append(DirChange(STATE_DIR, 0o750, SPECD_USER))
    units_changed = any(c.path.is_relative_to(UNITS_DIR) for c in plan.files)
    if units_changed:
        plan.commands.append(("systemctl", "daemon-reload"))
    if not (system.specd_enabled and system.specd_active):
        plan.commands.append(("systemctl", "enable", "--now", SPECD_UNIT))
    elif units_changed or any(c.path == CONFIG_FILE for c in plan.files):
        plan.commands.append(("systemctl", "restart", SPECD_UNIT))
    if any(c.path == dropin for c in plan.files):
        plan.notes.append(
            f"SGLang is not restarted: the drop-in takes effect at {unit}'s next restart "
            f"(specd restarts it in its next maintenance window when it changes the step count, "
            f"or run `systemctl restart {unit}`)."
        )
    return plan


# -- running it ------------------------------------------------------------------------------


def _check_unit_name(unit: str) -> str:
    if not _UNIT_NAME.match(unit):
        raise InstallError(f"{unit!r} is not a systemd service name such as sglang.service")
    return unit


def _run(runner: Runner, argv: Sequence[str], timeout_s: float = SYSTEMCTL_TIMEOUT_S) -> RunResult:
    result = runner(list(argv), timeout_s=timeout_s)
    if not result.ok:
        raise InstallError(result.summary())
    return result


def read_unit(runner: Runner, unit: str) -> UnitView:
    show = _run(
        runner, ["systemctl", "show", *(f"--property={p}" for p in SHOW_PROPERTIES), unit]
    ).stdout
    view = parse_show(unit, show, "")
    if view.load_state != "loaded":
        raise InstallError(f"{unit}: no such unit (LoadState={view.load_state or 'unknown'})")
    cat = _run(runner, ["systemctl", "cat", "--no-pager", unit]).stdout
    return parse_show(unit, show, cat)


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def system_state(runner: Runner) -> SystemState:
    enabled = runner(["systemctl", "is-enabled", SPECD_UNIT], timeout_s=SYSTEMCTL_TIMEOUT_S)
    active = runner(["systemctl", "is-active", SPECD_UNIT], timeout_s=SYSTEMCTL_TIMEOUT_S)
    return SystemState(
        user_exists=_user_exists(SPECD_USER),
        specd_enabled=enabled.stdout.strip() == "enabled",
        specd_active=active.stdout.strip() == "active",
    )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_manifest(layout: Layout) -> dict[str, Any] | None:
    raw = layout.read(MANIFEST_FILE)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InstallError(f"{MANIFEST_FILE}: not JSON ({exc}); remove by hand") from None
    if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
        raise InstallError(f"{MANIFEST_FILE}: not a specd install manifest (version 1)")
    return data


def _save_manifest(layout: Layout, manifest: dict[str, Any]) -> None:
    path = layout.host(MANIFEST_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(manifest, indent=2) + "\n").encode(), mode=0o600)


def execute(plan: Plan, layout: Layout, runner: Runner, view: UnitView, out: Any) -> None:
    """Carry the plan out, recording every change in the manifest before making it."""
    manifest = load_manifest(layout) or {
        "version": MANIFEST_VERSION,
        "unit": plan.unit,
        "cat_before": view.cat,
        "files": {},
        "dirs": [],
        "user_created": False,
        "enabled_specd": False,
    }
    if manifest["unit"] != plan.unit:
        raise InstallError(
            f"specd is installed for {manifest['unit']}; run `specd uninstall` before "
            f"installing it for {plan.unit}"
        )
    config_dir = layout.host(CONFIG_DIR)
    if not config_dir.is_dir():
        config_dir.mkdir(mode=0o755, parents=True)
        manifest["dirs"].append(str(CONFIG_DIR))
    for change in plan.files:
        record = manifest["files"].setdefault(
            str(change.path),
            {"original": None if change.old is None else change.old.decode("utf-8", "replace")},
        )
        record["sha256"] = _sha256(change.new)
        target = layout.host(change.path)
        if not target.parent.is_dir():
            target.parent.mkdir(parents=True, mode=0o755)
            manifest["dirs"].append(str(change.path.parent))
        _save_manifest(layout, manifest)
        write_atomic(target, change.new, mode=change.mode)
        print(f"wrote {change.path}", file=out)
    if plan.create_user:
        manifest["user_created"] = True
        _save_manifest(layout, manifest)
    users = [c for c in plan.commands if c[0] == "systemd-sysusers"]
    for argv in users:
        _run(runner, argv)
        print("ran " + shlex.join(argv), file=out)
    for directory in plan.dirs:
        target = layout.host(directory.path)
        manifest["dirs"].append(str(directory.path))
        _save_manifest(layout, manifest)
        target.mkdir(mode=directory.mode, parents=True, exist_ok=True)
        owner = pwd.getpwnam(directory.owner)
        os.chown(target, owner.pw_uid, owner.pw_gid)
        print(f"created {directory.path}", file=out)
    for argv in plan.commands:
        if argv in users:
            continue
        if argv[:2] == ("systemctl", "enable"):
            manifest["enabled_specd"] = True
            _save_manifest(layout, manifest)
        _run(runner, argv, START_TIMEOUT_S)
        print("ran " + shlex.join(argv), file=out)
    _save_manifest(layout, manifest)


def uninstall(layout: Layout, runner: Runner, restart_sglang: bool, out: Any) -> int:
    manifest = load_manifest(layout)
    if manifest is None:
        raise InstallError(f"nothing to uninstall: no {MANIFEST_FILE} (specd install never ran)")
    unit = _check_unit_name(str(manifest["unit"]))
    if manifest.get("enabled_specd"):
        result = runner(["systemctl", "disable", "--now", SPECD_UNIT], timeout_s=START_TIMEOUT_S)
        print(("ran " if result.ok else "failed: ") + result.summary(), file=out)
    files: dict[str, dict[str, Any]] = manifest["files"]
    for name, record in sorted(files.items()):
        path = Path(name)
        target = layout.host(path)
        current = layout.read(path)
        if current is not None and _sha256(current) != record.get("sha256"):
            print(f"note: {path} changed since install; undoing it anyway", file=out)
        original = record.get("original")
        if original is None:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            print(f"removed {path}", file=out)
        else:
            write_atomic(target, str(original).encode(), mode=0o644)
            print(f"restored {path}", file=out)
    for name in reversed(manifest["dirs"]):
        target = layout.host(Path(name))
        if Path(name) == STATE_DIR:
            # Only specd's own files are in a state dir install created.
            shutil.rmtree(target, ignore_errors=True)
        elif Path(name) != CONFIG_DIR:
            with contextlib.suppress(OSError):
                target.rmdir()
        print(f"removed {name}/", file=out)
    if manifest.get("user_created"):
        result = runner(["userdel", SPECD_USER], timeout_s=SYSTEMCTL_TIMEOUT_S)
        print(("ran " if result.ok else "failed: ") + result.summary(), file=out)
    _run(runner, ["systemctl", "daemon-reload"])
    print("ran systemctl daemon-reload", file=out)
    layout.host(MANIFEST_FILE).unlink()
    if str(CONFIG_DIR) in manifest["dirs"]:
        with contextlib.suppress(OSError):
            layout.host(CONFIG_DIR).rmdir()
    cat_now = _run(runner, ["systemctl", "cat", "--no-pager", unit]).stdout
    if cat_now == manifest.get("cat_before"):
        print(f"✓ `systemctl cat {unit}` is byte-for-byte what it was before install", file=out)
    else:
        print(f"✗ `systemctl cat {unit}` differs from before install:", file=out)
        before = str(manifest.get("cat_before", "")).splitlines(keepends=True)
        out.writelines(difflib.unified_diff(before, cat_now.splitlines(keepends=True)))
    if restart_sglang:
        _run(runner, ["systemctl", "restart", unit], START_TIMEOUT_S)
        print(f"ran systemctl restart {unit}", file=out)
    else:
        print(
            f"{unit} keeps its current process until its next restart "
            f"(`specd uninstall --restart-sglang` or `systemctl restart {unit}`).",
            file=out,
        )
    return 0


def _ask(question: str) -> bool:
    try:
        answer = input(f"{question} [y/N] ")
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def install(args: argparse.Namespace, runner: Runner, layout: Layout, out: Any) -> int:
    unit = _check_unit_name(args.unit)
    manifest = load_manifest(layout)
    if manifest is not None and manifest.get("unit") != unit:
        raise InstallError(
            f"specd is installed for {manifest.get('unit')}; run `specd uninstall` before "
            f"installing it for {unit}"
        )
    view = read_unit(runner, unit)
    system = system_state(runner)
    interactive = sys.stdin.isatty() and not args.yes and not args.dry_run
    add_metrics = args.add_enable_metrics
    try:
        plan = build_plan(view, layout, system, add_metrics=add_metrics, specd_argv=args.specd)
    except InstallError as exc:
        if add_metrics or not interactive or "--enable-metrics" not in str(exc):
            raise
        print(str(exc), file=out)
        if not _ask(f"Add --enable-metrics to {unit}'s command line in specd's drop-in?"):
            return 1
        plan = build_plan(view, layout, system, add_metrics=True, specd_argv=args.specd)
    spec = plan.spec
    print(
        f"{unit}: {spec.algorithm}, --speculative-num-steps {spec.steps}, "
        f"--speculative-num-draft-tokens {spec.draft_tokens}, "
        f"metrics {'on' if spec.metrics else 'added by the drop-in'}, "
        f"SGLang at {sglang_url(spec.host, spec.port)}",
        file=out,
    )
    if plan.empty:
        print("nothing to do: specd is installed and running for this unit", file=out)
        return 0
    if args.dry_run:
        print("dry run: these files would be written and these commands run\n", file=out)
        out.write(plan.render())
        for note in plan.notes:
            print("\n" + note, file=out)
        return 0
    if os.geteuid() != 0 and layout.root == Path("/"):
        raise InstallError("must run as root (writes /etc, runs systemctl); see --dry-run")
    if not args.yes:
        if not interactive:
            raise InstallError(
                "stdin is not a terminal: pass --yes to install without asking "
                "(--dry-run shows the plan)"
            )
        out.write(plan.render())
        if not _ask("Proceed?"):
            return 1
    execute(plan, layout, runner, view, out)
    for note in plan.notes:
        print(note, file=out)
    print("installed; check it with `specd doctor` (undo with `specd uninstall`)", file=out)
    return 0
