"""The on-call's commands (`specd status`, `override`, `unfreeze`) on a config file with
problems.

An operator's edit that left /etc/specd/specd.toml invalid is rejected by the reload, and a
running specd goes on with its last good config: the file no longer says what it runs on.
The on-call's commands must work then (`specd unfreeze` is SpecdFrozen's runbook), so they
take what they need from the file's valid parts, with one warning line that says so, instead
of refusing on a typo in a table they do not read. ``load_for_oncall`` finds those parts
with `specd.io.config`'s own loader: the keys its problems name are left out of the file's
data, table by table, until the rest loads, so each part is checked exactly as a start of
specd checks it (environment, types, bounds, the checks across tables), and a key left out
takes its default, which the warning names.

What they cannot do without is [files] (the state directory, the override file): a problem
in that table, or a key of it written elsewhere, is refused as a start of specd refuses it,
one line per problem, since a default path would read another state and write an override
no specd reads. So is a file that cannot be read as TOML at all (absent, empty, not TOML),
and a problem of this shell's ``SPECD_*`` environment. A file that is not UTF-8 is read
with its bad bytes set apart: a key or value holding one is a problem of that key (refused
in [files]), bad bytes in a comment are none of the file's settings.
"""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from specd.core.settings import ARRAYS, TABLES
from specd.core.text import printable
from specd.io import config as io_config
from specd.io import files
from specd.io.config import (
    ENV_PREFIX,
    MAX_CONFIG_BYTES,
    Config,
    ConfigError,
    load_config,
    read_config_file,
)

# The table every on-call command takes from the file: where the state and the override are.
NEEDED = "files"
_NEEDED_KEYS = tuple(TABLES[NEEDED].model_fields)
# Each round leaves out every key its problems name; the next finds what those hid (a check
# across tables runs once every table loads), so a few rounds do.
MAX_ROUNDS = 64
# The keys whose default would change what a pin or an override is checked against.
_RANGE = ("choose.min_steps", "choose.max_steps")
_NOT_UTF8 = "not UTF-8 text"

KeyPath = tuple[str | int, ...]


@dataclass(frozen=True)
class OncallConfig:
    """The config an on-call command runs with: the file's, whole, or its valid parts."""

    config: Config
    path: Path  # the file named (it may be absent: built-in defaults)
    problems: tuple[str, ...] = ()  # the file's problems, one line each; () when valid
    defaults_for: tuple[str, ...] = ()  # settings of the file left out, at their default

    @property
    def valid(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """For `specd status --json` ("config")."""
        return {
            "file": str(self.path),
            "valid": self.valid,
            "problems": list(self.problems),
            "defaults_for": list(self.defaults_for),
        }

    def warning(self, command: str) -> str | None:
        """The one stderr line saying the file has problems and what ``command`` used."""
        if self.valid:
            return None
        n = len(self.problems)
        first = printable(self.problems[0])
        more = f"; {n - 1} more: `specd check-config {self.path}`" if n > 1 else ""
        choose = self.config.choose
        steps = f"steps {choose.min_steps}..{choose.max_steps}"
        ranged = [
            key for key in _RANGE if key in self.defaults_for or "choose" in self.defaults_for
        ]
        if ranged:
            names = " and ".join(key.split(".")[1] for key in ranged)
            steps += f" ({names} at the default: left out)"
        others = [key for key in self.defaults_for if key not in _RANGE]
        defaults = f"; defaults for {', '.join(others)}" if others else ""
        return (
            f"{command}: warning: {self.path} has {n} problem{'s' if n > 1 else ''} "
            f"({first}{more}); a running specd keeps its last good config, its next start "
            f"refuses this file; used the valid parts: state_dir "
            f"{self.config.files.state_dir}, override_file {self.config.files.override_file}, "
            f"{steps}{defaults}"
        )


def load_for_oncall(command: str, path: Path | None) -> OncallConfig | None:
    """The config for ``command`` (``"specd status"``), from ``path`` (None: the default
    file) without the calibration (`load_config`). A file with problems: its valid parts,
    with the warning line printed on stderr. None, with one stderr line per problem, where
    what the command needs cannot be taken from it."""
    shown = path if path is not None else io_config.DEFAULT_CONFIG_PATH
    try:
        return OncallConfig(load_config(path, calibration=False), shown)
    except ConfigError as exc:
        problems = list(exc.problems)
    found = _valid_parts(shown, problems)
    blocking = found.unresolved + [
        p for p in found.problems if _about_needed(p) and p not in found.unresolved
    ]
    if found.config is None or blocking:
        for problem in blocking or found.problems:
            print(_refusal(command, shown, problem), file=sys.stderr)
        return None
    loaded = OncallConfig(found.config, shown, tuple(found.problems), found.defaults_for)
    warning = loaded.warning(command)
    if warning is not None:
        print(warning, file=sys.stderr)
    return loaded


def _refusal(command: str, path: Path, problem: str) -> str:
    if problem.startswith(ENV_PREFIX):
        return (
            f"{command}: {printable(problem)} (this shell's environment, not {path}: unset it "
            "or correct it); nothing done"
        )
    return (
        f"{command}: {path}: {printable(problem)}; refused: {command} takes [{NEEDED}] "
        "(state_dir, override_file) from this file (a running specd keeps its last good "
        f"config meanwhile; fix the file, `specd check-config {path}`); nothing done"
    )


def _about_needed(problem: str) -> bool:
    """Whether ``problem`` is about [files]: a key in it, the table itself, one of its keys
    written elsewhere (which the operator meant as that path)."""
    where = problem.split(": ", 1)[0]
    moved = re.match(r"`([^`]+)`", problem)
    if moved is not None:
        where = moved.group(1)
    head = re.split(r"[.\[]", where, maxsplit=1)[0]
    tail = re.split(r"[.\]\[]", where)[-1] if where else ""
    return (
        head == NEEDED
        or tail in _NEEDED_KEYS
        or re.search(rf"\b{NEEDED}\.({'|'.join(_NEEDED_KEYS)})\b|\[{NEEDED}\]", problem) is not None
    )


@dataclass
class _Found:
    config: Config | None
    problems: list[str]
    unresolved: list[str]  # problems no key of the file's can be left out for
    defaults_for: tuple[str, ...] = ()


def _valid_parts(path: Path, problems: list[str]) -> _Found:
    """The config from the file's data without the keys its problems name. ``problems``:
    load_config's on the file, the file's own as `specd check-config` and a reload name
    them (one not UTF-8 is decoded here first, and its own are those of the first round).
    A later round may name more (the checks across tables run once each table loads; a
    default may not fit a key the file sets): those are left out too, and added to
    ``problems`` only where they are about [files], which refuses."""
    left_out: list[KeyPath] = []
    own = False  # whether the next round's problems are the file's own
    try:
        data = read_config_file(path)
    except ConfigError:
        recovered = _undecoded(path)
        if recovered is None:
            return _Found(None, problems, list(problems))
        data, located = recovered
        if located:
            problems = [p for p in problems if not p.startswith(_NOT_UTF8)]
        else:
            problems = [f"{p}, in a comment" if p.startswith(_NOT_UTF8) else p for p in problems]
        for where, problem in located:
            _prune(data, where)
            left_out.append(where)
            problems.append(problem)
        own = True
    with tempfile.TemporaryDirectory(prefix="specd-oncall-") as tmp:
        file = Path(tmp) / "specd.toml"
        for _ in range(MAX_ROUNDS):
            try:
                file.write_text("# its valid parts\n" + tomli_w.dumps(data), encoding="utf-8")
                config = load_config(file, calibration=False)
            except ConfigError as exc:
                unresolved: list[str] = []
                for problem in exc.problems:
                    if problem not in problems and (own or _about_needed(problem)):
                        problems.append(problem)
                    named = _locate(data, problem)
                    if named is None:
                        unresolved.append(problem)
                    else:
                        _prune(data, named)
                        left_out.append(named)
                if len(unresolved) == len(exc.problems):
                    return _Found(None, problems, unresolved)
                own = False
            except (TypeError, ValueError, UnicodeError) as exc:  # not writable as TOML
                return _Found(None, problems, [str(exc)])
            else:
                return _Found(config, problems, [], tuple(_names(left_out)))
    return _Found(None, problems, list(problems))


def _names(left_out: list[KeyPath]) -> Iterator[str]:
    """The settings left out, as `table.key`, a table or an array (not unknown keys)."""
    seen: set[str] = set()
    for where in left_out:
        head = str(where[0])
        name: str | None = None
        if head in ARRAYS or (head in TABLES and len(where) == 1):
            name = head
        elif head in TABLES and str(where[1]) in TABLES[head].model_fields:
            name = f"{head}.{where[1]}"
        if name is not None and name not in seen:
            seen.add(name)
            yield name


def _locate(data: dict[str, Any], problem: str) -> KeyPath | None:
    """What to leave out of ``data`` for ``problem``: the key it names, the whole array
    for an item of one, the keys a problem of a table names (else the table), the table of a
    key the file does not set (a required one missing). None: nothing of the file's."""
    moved = re.match(r"`([^`]+)`", problem)
    where = moved.group(1) if moved is not None else problem.split(": ", 1)[0]
    path, rest = _resolve(data, where)
    if not path:
        # A problem named by what it mentions (a range across tables): the keys it names.
        for table, key in re.findall(r"\b(\w+)\.(\w+)\b", problem):
            if isinstance(data.get(table), dict) and key in data[table]:
                return (table, key)
        return None
    head = str(path[0])  # a key of the top level
    if not isinstance(data[head], dict) or head not in TABLES:
        return path[:1]  # an array, a table written as a value, a key of no table
    if len(path) >= 2:
        return path[:2]
    if not rest:
        # The table's own check ("min_steps (7) > max_steps (5)"): the keys it names.
        named = [k for k in data[head] if re.search(rf"\b{re.escape(k)}\b", problem)]
        if named:
            return (head, named[0])
    return path[:1]


def _resolve(data: dict[str, Any], where: str) -> tuple[KeyPath, str]:
    """The longest path of ``data`` that ``where`` (``windows[0].cron``) names, and what is
    left of ``where`` past it. Keys are matched whole, so a key holding a dot is found."""
    path: list[str | int] = []
    node: Any = data
    rest = where
    while rest:
        if isinstance(node, dict):
            keys = [
                k
                for k in node
                if isinstance(k, str) and (rest == k or rest.startswith((k + ".", k + "[")))
            ]
            if not keys:
                break
            key = max(keys, key=len)
            path.append(key)
            node, rest = node[key], rest[len(key) :].removeprefix(".")
        elif isinstance(node, list):
            index = re.match(r"\[(\d+)\]\.?", rest)
            if index is None or int(index.group(1)) >= len(node):
                break
            path.append(int(index.group(1)))
            node, rest = node[int(index.group(1))], rest[index.end() :]
        else:
            break
    return tuple(path), rest


def _prune(data: dict[str, Any], where: KeyPath) -> None:
    """Leave ``where`` out of ``data`` (an item of an array: the whole array)."""
    if len(where) >= 2 and isinstance(data.get(str(where[0])), dict):
        data[str(where[0])].pop(where[1], None)
    else:
        data.pop(str(where[0]), None)


def _undecoded(path: Path) -> tuple[dict[str, Any], list[tuple[KeyPath, str]]] | None:
    """The file's data where it is TOML but not UTF-8 (or starts with a BOM), its bad bytes
    set apart, and each key holding one with its problem; None when it is not TOML (absent,
    empty, unreadable, not TOML once decoded): then what it says is not known."""
    try:
        raw = files.read_regular_file(path, MAX_CONFIG_BYTES, follow_symlinks=True)
    except files.FileReadError:
        return None
    text = raw.removeprefix(files.UTF8_BOM).decode("utf-8", "surrogateescape")
    # A character the text does not hold stands for each bad byte, so a string holding one
    # is found (a lone surrogate is no text to parse).
    marker = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in text)
    text = re.sub("[\udc80-\udcff]", marker, text)
    if not text.strip():
        return None
    try:
        data = files.parse_toml(text)
    except files.ParseError:
        return None
    located: list[tuple[KeyPath, str]] = []
    for where, shown in _holding(data, marker):
        top = where if isinstance(data.get(str(where[0])), dict) else where[:1]
        located.append((top[:2], f"{shown.replace(marker, '?')}: {_NOT_UTF8}"))
    return data, located


def _holding(
    value: Any, marker: str, where: KeyPath = (), shown: str = ""
) -> Iterator[tuple[KeyPath, str]]:
    """Each key or string in ``value`` holding ``marker``: its path and its name."""
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{shown}.{key}" if shown else str(key)
            if marker in str(key):
                yield (*where, key), name
            else:
                yield from _holding(item, marker, (*where, key), name)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _holding(item, marker, (*where, i), f"{shown}[{i}]")
    elif isinstance(value, str) and marker in value:
        yield where, shown
