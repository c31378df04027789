"""The on-call's commands (`specd status`, `override`, `unfreeze`) on a config file with
problems.

An operator's edit that left /etc/specd/specd.toml invalid is rejected by the reload, and a
running specd goes on with its last good config: the file no longer says what it runs on.
The on-call's commands must work then (`specd unfreeze` is SpecdFrozen's runbook), so they
take what they need from the file's valid parts, with one warning line that says so, instead
of refusing on a typo in a table they do not read. ``load_for_oncall`` finds those parts
with `specd.io.config`'s own loader (`load_config_data`, on the file's data): the keys its
problems are about (``ConfigError.located``: each problem's key paths, not its wording) are
left out of the data, round by round, until the rest loads, so each part is checked exactly
as a start of specd checks it (environment, types, bounds, the checks across tables), and a
key left out takes its default, which the warning names. What a problem leaves out: the key
it names; for an item of an array, the whole array; for a check across keys, the first of
its keys the file sets; for a required key missing, its table.

What they cannot do without is [files] (the state directory, the override file): a problem
in that table, or a key of it written elsewhere, is refused as a start of specd refuses it,
one line per problem, since a default path would read another state and write an override
no specd reads. So is a file that cannot be read as TOML at all (absent, empty, not TOML),
a problem of this shell's ``SPECD_*`` environment, and any problem no key of the file can be
left out for. A file that is not UTF-8 is read with its bad bytes set apart: a key or value
holding one is a problem of that key (refused in [files]), bad bytes in a comment are none
of the file's settings.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specd.core.settings import ARRAYS, TABLES
from specd.core.text import printable
from specd.io import config as io_config
from specd.io import files
from specd.io.config import (
    MAX_CONFIG_BYTES,
    Config,
    ConfigError,
    KeyPath,
    Problem,
    load_config,
    load_config_data,
    read_config_file,
)

# The table every on-call command takes from the file: where the state and the override are.
NEEDED = "files"
# Each round leaves out every key its problems name; the next finds what those hid (a check
# across tables runs once every table loads), so a few rounds do.
MAX_ROUNDS = 64
# The keys whose default would change what a pin or an override is checked against.
_RANGE = ("choose.min_steps", "choose.max_steps")
_NOT_UTF8 = "not UTF-8 text"


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
        # The window times said below are this file's: the running specd may wait for
        # others (a pin judged against them was written, then never applied).
        windows = (
            ""
            if "windows" in self.defaults_for
            else ", windows as this file writes them (a running specd may use others)"
        )
        return (
            f"{command}: warning: {self.path} has {n} problem{'s' if n > 1 else ''} "
            f"({first}{more}); a running specd keeps its last good config, its next start "
            f"refuses this file; used the valid parts: state_dir "
            f"{self.config.files.state_dir}, override_file {self.config.files.override_file}, "
            f"{steps}{windows}{defaults}"
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
        located = exc.located
    found = _valid_parts(shown, located)
    blocking = found.unresolved + [
        p for p in found.problems if _about_needed(p) and p not in found.unresolved
    ]
    if found.config is None or blocking:
        for problem in blocking or found.problems:
            print(_refusal(command, shown, problem), file=sys.stderr)
        return None
    problems = tuple(p.text for p in found.problems)
    loaded = OncallConfig(found.config, shown, problems, found.defaults_for)
    warning = loaded.warning(command)
    if warning is not None:
        print(warning, file=sys.stderr)
    return loaded


def _refusal(command: str, path: Path, problem: Problem) -> str:
    if problem.env and not problem.keys:  # a variable itself: unknown, or not JSON
        return (
            f"{command}: {printable(problem.text)} (this shell's environment, not {path}: "
            "unset it or correct it); nothing done"
        )
    return (
        f"{command}: {path}: {printable(problem.text)}; refused: {command} takes [{NEEDED}] "
        "(state_dir, override_file) from this file (a running specd keeps its last good "
        f"config meanwhile; fix the file, `specd check-config {path}`); nothing done"
    )


def _about_needed(problem: Problem) -> bool:
    """Whether ``problem`` is about [files]: a key in it, the table itself, one of its keys
    written elsewhere (which the operator meant as that setting)."""
    meant = problem.meant_as
    return any(key[:1] == (NEEDED,) for key in problem.keys) or (
        meant is not None and meant.split(".", 1)[0] == NEEDED
    )


@dataclass
class _Found:
    config: Config | None
    problems: list[Problem]
    unresolved: list[Problem]  # problems no key of the file's can be left out for
    defaults_for: tuple[str, ...] = ()


def _valid_parts(path: Path, first: Sequence[Problem]) -> _Found:
    """The config from the file's data without the keys its problems are about. ``first``:
    load_config's on the file, the file's own as `specd check-config` and a reload name them
    (one not UTF-8 is decoded here first, and its own are those of the first round). A later
    round may find more (the checks across tables run once each table loads; a default may
    not fit a key the file sets): those are left out too, and added to the problems only
    where they are about [files], which refuses."""
    problems = list(first)
    left_out: list[KeyPath] = []
    own = False  # whether the next round's problems are the file's own
    try:
        data = read_config_file(path)
    except ConfigError:
        recovered = _undecoded(path)
        if recovered is None:
            return _Found(None, problems, list(problems))
        data, located, bom = recovered
        if not bom:
            # ``first`` is the file's one problem, its bytes not UTF-8 (`read_config_file`;
            # one with a BOM is named as such, and stays): said key by key, or, where no key
            # holds a bad byte, as in a comment.
            problems = (
                []
                if located
                else [Problem(f"{p.text}, in a comment", p.keys, p.env, p.meant_as) for p in first]
            )
        for problem in located:
            left_out.append(_prune(data, problem.keys[0]))
            problems.append(problem)
        own = True
    for _ in range(MAX_ROUNDS):
        try:
            config = load_config_data(data, path_shown=path, calibration=False)
        except ConfigError as exc:
            unresolved: list[Problem] = []
            said = {p.text for p in problems}
            for problem in exc.located:
                if problem.text not in said and (own or _about_needed(problem)):
                    problems.append(problem)
                    said.add(problem.text)
                named = None if problem.env else _locate(data, problem)
                if named is None:
                    unresolved.append(problem)
                else:
                    left_out.append(_prune(data, named))
            if len(unresolved) == len(exc.located):
                return _Found(None, problems, unresolved)
            own = False
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


def _locate(data: dict[str, Any], problem: Problem) -> KeyPath | None:
    """What to leave out of ``data`` for ``problem``: the first of its keys the file sets
    (for an item of an array or of a key of no table: the whole top-level key), or for a
    problem about one key the file does not set (a required one missing), its table. None:
    nothing of the file's."""
    for where in problem.keys:
        head = where[0] if where else None
        if not isinstance(head, str) or head not in data:
            continue
        if head not in TABLES or not isinstance(data[head], dict) or len(where) == 1:
            return (head,)  # an array, a table written as a value, a key of no table
        if where[1] in data[head]:
            return (head, where[1])
        if len(problem.keys) == 1:
            return (head,)
    return None


def _prune(data: dict[str, Any], where: KeyPath) -> KeyPath:
    """Leave ``where`` out of ``data``: a key of a table, else the whole top-level key (an
    item of an array: the whole array). What was left out."""
    head = str(where[0])
    if len(where) >= 2 and isinstance(data.get(head), dict):
        data[head].pop(where[1], None)
        return (head, where[1])
    data.pop(head, None)
    return (head,)


def _undecoded(path: Path) -> tuple[dict[str, Any], list[Problem], bool] | None:
    """The file's data where it is TOML but not UTF-8 (or starts with a BOM), its bad bytes
    set apart; each key holding one, as a problem of that key; and whether the file starts
    with a BOM. None when it is not TOML (absent, empty, unreadable, not TOML once decoded):
    then what it says is not known."""
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
    located = [
        Problem(f"{shown.replace(marker, '?')}: {_NOT_UTF8}", (where,))
        for where, shown in _holding(data, marker)
    ]
    return data, located, raw.startswith(files.UTF8_BOM)


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
