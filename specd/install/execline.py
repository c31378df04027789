"""systemd's own rules for an ``ExecStart=`` line, in the order systemd applies them.

1. When the unit is loaded: the line is split into words (quotes, C escapes such as ``\\t``,
   ``\\x41``, ``\\;``), then each word's specifiers are resolved (``%%`` → ``%``, ``%n`` → the
   unit name, ``%i`` → its instance, ...). ``systemctl show -p ExecStart`` prints these words.
2. When the command runs: ``$$`` → ``$``; ``${VAR}`` anywhere in a word → the variable's value
   (empty if unset), always within that one word; a word that is exactly ``$VAR`` → the value
   split at whitespace, zero or more words. The variables come from ``Environment=`` and
   ``EnvironmentFile=`` (the files win). That is what the program receives as argv.

``split_exec`` and ``resolve_specifiers`` are step 1, ``expand_argv`` is step 2, and
``quote_word`` / ``format_exec`` write words back so that step 1 yields them again.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specd.install.layout import InstallError

_EXEC_PREFIX = re.compile(r"^[-@:+!]*")
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
_SPECIFIER = re.compile(r"%(.)", re.DOTALL)
_VARIABLE_WORD = re.compile(r"\$(?![{$])(.*)", re.DOTALL)


def split_words(value: str) -> tuple[str, list[str]]:
    """An ``ExecStart=`` value → (prefix characters, words), unquoted and C-unescaped as systemd
    does, specifiers (``%``) and variables (``$``) untouched."""
    stripped = value.lstrip()
    prefix = _EXEC_PREFIX.match(stripped)
    assert prefix is not None
    rest = stripped[prefix.end() :]
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


def _unescape_name(text: str) -> str:
    """systemd's unit-name unescaping (%I, %P, %J, %f): ``-`` is ``/``, ``\\xNN`` a byte."""
    out = text.replace("-", "/")
    return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), out)


def unit_specifiers(unit: str, fragment_path: str = "") -> dict[str, str]:
    """The specifiers of a system unit that depend only on its name and the system manager
    (systemd.unit(5), "Specifiers"). Host facts (%H, %m, %b, ...) are left out: the caller
    takes those words from ``systemctl show``."""
    name, _, _suffix = unit.rpartition(".")
    prefix, at, instance = name.partition("@")
    values = {
        "n": unit,
        "N": name,
        "p": prefix,
        "P": _unescape_name(prefix),
        "i": instance if at else "",
        "I": _unescape_name(instance) if at else "",
        "j": prefix.rsplit("-", 1)[-1],
        "J": _unescape_name(prefix.rsplit("-", 1)[-1]),
        "f": "/" + (_unescape_name(instance) if at and instance else _unescape_name(prefix)),
        "E": "/etc",
        "S": "/var/lib",
        "C": "/var/cache",
        "L": "/var/log",
        "t": "/run",
        "T": "/tmp",  # noqa: S108 - the system manager's %T, not a file specd writes
        "V": "/var/tmp",  # noqa: S108 - likewise %V
        "d": f"/run/credentials/{unit}",
        # The system manager runs as root: %u, %U, %g, %G, %h, %s describe root.
        "u": "root",
        "U": "0",
        "g": "root",
        "G": "0",
        "h": "/root",
        "s": "/bin/sh",
        "%": "%",
    }
    if fragment_path:
        values["y"] = fragment_path
        values["Y"] = fragment_path.rsplit("/", 1)[0] or "/"
    return values


def resolve_specifiers(word: str, specifiers: Mapping[str, str]) -> str | None:
    """The word with its specifiers resolved; None if it has one not in ``specifiers``."""
    unknown = False

    def one(match: re.Match[str]) -> str:
        nonlocal unknown
        value = specifiers.get(match.group(1))
        if value is None:
            unknown = True
            return match.group(0)
        return value

    resolved = _SPECIFIER.sub(one, word)
    return None if unknown else resolved


def split_exec(value: str, specifiers: Mapping[str, str] | None = None) -> tuple[str, list[str]]:
    """An ``ExecStart=`` value → (prefix, words) as systemd loads it. Without ``specifiers`` only
    ``%%`` is resolved and any other ``%x`` stays as written."""
    prefix, words = split_words(value)
    known = dict(specifiers) if specifiers is not None else {"%": "%"}
    out = []
    for word in words:
        resolved = resolve_specifiers(word, known)
        if resolved is None:
            resolved = _SPECIFIER.sub(lambda m: "%" if m.group(1) == "%" else m.group(0), word)
        out.append(resolved)
    return prefix, out


def expand_word(word: str, environment: Mapping[str, str]) -> str:
    """``$$`` and ``${VAR}`` inside one word, as systemd does when it runs the command (an
    unset variable is empty; ``${VAR:-x}`` is not ExecStart= syntax and stays as written)."""
    out: list[str] = []
    i = 0
    while i < len(word):
        ch = word[i]
        if ch == "$" and word[i + 1 : i + 2] == "$":
            out.append("$")
            i += 2
            continue
        if ch == "$" and word[i + 1 : i + 2] == "{":
            end = word.find("}", i + 2)
            name = word[i + 2 : end] if end != -1 else ""
            if end != -1 and ":" not in name:
                out.append(environment.get(name, ""))
                i = end + 1
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def whole_word_variable(word: str) -> str | None:
    """The name in a word that is exactly ``$VAR`` (split into words when run), else None."""
    match = _VARIABLE_WORD.fullmatch(word)
    return match.group(1) if match is not None else None


@dataclass(frozen=True)
class Arg:
    """One argument the program receives, and the loaded word it comes from."""

    text: str
    source: int  # index of the loaded word
    split: bool  # from a ``$VAR`` word, split at whitespace


def expand_argv(words: Sequence[str], environment: Mapping[str, str]) -> list[Arg]:
    """The argv the program receives from loaded words."""
    args: list[Arg] = []
    for index, word in enumerate(words):
        name = whole_word_variable(word)
        if name is None:
            args.append(Arg(expand_word(word, environment), index, False))
            continue
        value = environment.get(name, "")
        try:
            parts = shlex.split(value)
        except ValueError:
            parts = value.split()
        args += [Arg(part, index, True) for part in parts]
    return args


_PLAIN_WORD = re.compile(r"[A-Za-z0-9_@+=:,./${}\[\]-]+")


def quote_word(word: str) -> str:
    """A word for an ExecStart= line that systemd loads back as ``word`` (``$`` untouched:
    the words came from a unit, where ``$`` already means what it should)."""
    escaped = word.replace("%", "%%")
    if word == ";":
        return "\\;"
    if _PLAIN_WORD.fullmatch(word):
        return escaped
    escaped = escaped.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


@dataclass(frozen=True)
class Command:
    """A command line as systemd loaded it: exec prefixes and words (specifiers resolved,
    ``$`` as written)."""

    prefix: str
    words: tuple[str, ...]


def format_exec(command: Command) -> str:
    """``ExecStart=`` value, one option (and its values) per continuation line; a whole-word
    variable (systemd splits it into options) has its own line."""
    groups: list[list[str]] = [[]]
    for word in command.words:
        if (word.startswith("--") or whole_word_variable(word)) and groups[-1]:
            groups.append([])
        groups[-1].append(quote_word(word))
    lines = [" ".join(group) for group in groups]
    return command.prefix + " \\\n    ".join(lines)
