"""The files install writes: the SGLang drop-in, specd.service, the polkit rule, the sysusers
entry and /etc/specd/specd.toml, from the templates shipped with specd."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specd.install.execline import Command, format_exec, quote_word
from specd.install.layout import CONFIG_FILE, ENV_FILE, OVERRIDE_FILE, STATE_DIR, InstallError
from specd.install.sglang_args import Speculation, wired_command
from specd.io.apply import ENV_ARGS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

# Templates, as package data first (an installed specd), then the source tree.
TEMPLATES = {
    "specd.service": "systemd/specd.service",
    "polkit": "etc/polkit-1/rules.d/50-specd.rules",
    "sysusers": "etc/sysusers.d/specd.conf",
    "config": "etc/specd/specd.toml",
}
_PACKAGE_DATA = Path(__file__).resolve().parents[1] / "data" / "install"
_SOURCE_TREE = Path(__file__).resolve().parents[2]

# Every specd.toml key install writes or reads, in one place: a path of (table, key), or
# (key,) for a top-level key.
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "url": ("sglang", "url"),
    "unit": ("sglang", "unit"),
    "state_dir": ("files", "state_dir"),
    "env_file": ("sglang", "env_file"),
    "override_file": ("files", "override_file"),
    "speculative_algorithm": ("sglang", "speculative_algorithm"),
}


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


def render_dropin(
    unit: str, command: Command, spec: Speculation, add_metrics: bool, env_file: Path = ENV_FILE
) -> str:
    wired = wired_command(command, spec, add_metrics)
    return (
        f"# Written by `specd install` from {unit}'s own ExecStart=; `specd uninstall` removes\n"
        "# it. specd writes the speculative setting to the EnvironmentFile below and restarts\n"
        "# the unit in a maintenance window; systemd reads that file afresh at every start.\n"
        f"# ${ENV_ARGS} is unbraced: systemd splits it into words (empty: no speculation).\n"
        "[Service]\n"
        "# Today's setting, used until specd has written its file.\n"
        f'Environment="{ENV_ARGS}={spec.default_args}"\n'
        f"EnvironmentFile=-{env_file}\n"
        "# The empty assignment drops the unit's own command; the next line replaces it.\n"
        "ExecStart=\n"
        f"ExecStart={format_exec(wired)}\n"
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


# -- specd.toml ------------------------------------------------------------------------------

_TABLE_HEADER = re.compile(r"^[ \t]*\[", re.MULTILINE)


def _set_key(text: str, path: tuple[str, ...], value: str | int | float | list[str]) -> str:
    """``text`` with the key at ``path`` set to ``value`` (JSON's spelling is TOML's for
    strings, numbers and lists of strings);
    everything else kept."""
    *table, key = path
    line = f"{key} = {json.dumps(value)}"
    pattern = re.compile(rf"^[ \t]*{re.escape(key)}[ \t]*=.*$", re.MULTILINE)
    if not table:
        # Top-level keys live before the first table header.
        first = _TABLE_HEADER.search(text)
        start, end = 0, first.start() if first is not None else len(text)
    else:
        header = re.compile(rf"^[ \t]*\[[ \t]*{re.escape(table[0])}[ \t]*\][ \t]*$", re.M)
        found = header.search(text)
        if found is None:
            sep = (
                ""
                if not text or text.endswith("\n\n")
                else ("\n" if text.endswith("\n") else "\n\n")
            )
            return f"{text}{sep}[{table[0]}]\n{line}\n"
        start = found.end() + 1
        following = _TABLE_HEADER.search(text, start)
        end = following.start() if following is not None else len(text)
    section = text[start:end]
    match = pattern.search(section)
    if match is not None:
        section = section[: match.start()] + line + section[match.end() :]
    else:
        section = f"{line}\n{section}"
    return text[:start] + section + text[end:]


def render_config(
    existing: str | None,
    url: str,
    unit: str,
    algorithm: str,
    gateway: Mapping[str, str | list[str]] | None = None,
    fleet: Mapping[str, str | int | float | list[str]] | None = None,
) -> str:
    """/etc/specd/specd.toml: the shipped example, or the operator's file, with SGLang's URL,
    unit and speculative algorithm (the applier writes it with each setting) set, and the
    ``[gateway]`` and ``[fleet]`` keys given (checked: `gateway_keys`, `fleet_keys`);
    everything else kept as written."""
    text = existing if existing is not None else template("config")
    for name, value in (("url", url), ("unit", unit), ("speculative_algorithm", algorithm)):
        text = _set_key(text, CONFIG_KEYS[name], value)
    for key, gateway_value in (gateway or {}).items():
        text = _set_key(text, ("gateway", key), gateway_value)
    for key, fleet_value in (fleet or {}).items():
        text = _set_key(text, ("fleet", key), fleet_value)
    return text


@dataclass(frozen=True)
class SpecdFiles:
    """The files a config names that belong to specd alone."""

    state_dir: Path
    env_file: Path
    override_file: Path


DEFAULT_FILES = SpecdFiles(STATE_DIR, ENV_FILE, OVERRIDE_FILE)


def _lookup(data: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = data
    for part in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def configured_files(text: str | None) -> tuple[SpecdFiles, str | None]:
    """specd's own files as the config ``text`` names them (defaults for what it leaves out),
    and a problem with the text, if any (then the defaults)."""
    if text is None:
        return DEFAULT_FILES, None
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        return DEFAULT_FILES, f"not valid TOML ({exc})"
    values: dict[str, Path] = {}
    for name in ("state_dir", "env_file", "override_file"):
        value = _lookup(data, CONFIG_KEYS[name])
        if isinstance(value, str) and value.startswith("/"):
            values[name] = Path(value)
        else:
            values[name] = getattr(DEFAULT_FILES, name)
    return SpecdFiles(**values), None
