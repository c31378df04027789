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

import tomlkit
import tomlkit.exceptions
import tomlkit.items

from specd.install.execline import Command, format_exec, quote_word
from specd.install.layout import (
    CONFIG_FILE,
    ENV_FILE,
    OVERRIDE_FILE,
    STATE_DIR,
    InstallError,
    Layout,
)
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
    "server_api_key_file": ("sglang", "server_api_key_file"),
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


def render_specd_service(
    text: str,
    unit: str,
    command: Sequence[str],
    allow: Sequence[str] = (),
    writable: Sequence[Path] = (),
) -> str:
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
        # Quoted as ReadWritePaths= below: a space splits an unquoted path in two.
        extra += f"BindReadOnlyPaths={' '.join(quote_word(str(p)) for p in hidden)}\n"
        out = out.rstrip("\n") + "\n" + extra
    if writable:
        # "-": a directory removed since install leaves specd to say so itself (it cannot
        # write there), rather than the unit failing to start with status 226/NAMESPACE.
        paths = " ".join(quote_word(f"-{path}") for path in writable)
        out = out.rstrip("\n") + (
            f"\n\n[Service]\n# What {CONFIG_FILE} has specd write outside {STATE_DIR} "
            "([files] state_dir,\n# [sglang] env_file's directory): ProtectSystem=strict "
            "leaves everything else read-only.\n"
            f"ReadWritePaths={paths}\n"
        )
    if allow:
        # The shipped unit reaches loopback only (IPAddressDeny=any).
        out = out.rstrip("\n") + (
            f"\n\n[Service]\n# What {CONFIG_FILE} names beyond loopback (SGLang, gateway "
            "replicas, etcd\n# endpoints); host names as resolved by `specd install`: run it "
            "again if they move.\n"
            f"IPAddressAllow={' '.join(allow)}\n"
        )
    return out


# -- specd.toml ------------------------------------------------------------------------------

ConfigValue = str | int | float | list[str]


def config_values(
    url: str,
    unit: str,
    algorithm: str,
    gateway: Mapping[str, str | list[str]] | None = None,
    fleet: Mapping[str, str | int | float | list[str]] | None = None,
    server_api_key_file: str | None = None,
) -> list[tuple[tuple[str, ...], ConfigValue]]:
    """Every (key path, value) install sets in specd.toml, in the order it sets them."""
    values: list[tuple[tuple[str, ...], ConfigValue]] = [
        (CONFIG_KEYS["url"], url),
        (CONFIG_KEYS["unit"], unit),
        (CONFIG_KEYS["speculative_algorithm"], algorithm),
    ]
    if server_api_key_file is not None:
        values.append((CONFIG_KEYS["server_api_key_file"], server_api_key_file))
    values += [(("gateway", key), value) for key, value in (gateway or {}).items()]
    values += [(("fleet", key), value) for key, value in (fleet or {}).items()]
    return values


def _set_value(doc: tomlkit.TOMLDocument, path: tuple[str, ...], value: ConfigValue) -> None:
    """Set one key with tomlkit, which keeps every comment and the layout around it and
    knows each way TOML spells a table (headers, dotted keys, inline tables). A key that
    already holds the value is left as written (quotes, spacing, comment)."""
    *tables, key = path
    node: Any = doc
    for name in tables:
        if name not in node:
            node[name] = tomlkit.table()
        node = node[name]
    old = node.get(key)
    if old is not None and _plain(old) == value:
        return
    item: Any = value
    if isinstance(value, list) and isinstance(old, tomlkit.items.Array):
        # An array the operator wrote one item a line stays one item a line.
        item = tomlkit.array()
        item.extend(value)
        item.multiline("\n" in old.as_string())
    if old is None and _is_header_table(node):
        _append_before_trailing_comments(node.value, key, item)
    else:
        node[key] = item


def _is_header_table(node: Any) -> bool:
    """A table written under its own ``[name]`` header (not dotted keys, not inline)."""
    return (
        isinstance(node, tomlkit.items.Table)
        and not node.is_super_table()
        and node.value.body is not None
    )


def _append_before_trailing_comments(container: Any, key: str, item: Any) -> None:
    """Add a key after the table's last one: the comments and blank lines that end a
    table introduce whatever follows it (the shipped file's ``# --- specd's own files``)."""
    body = container.body
    end = len(body)
    while end and body[end - 1][0] is None and isinstance(body[end - 1][1], _TRIVIA):
        end -= 1
    trailing = body[end:]
    del body[end:]
    container.append(key, item)
    body.extend(trailing)


_TRIVIA = (tomlkit.items.Comment, tomlkit.items.Whitespace)


def _plain(item: Any) -> Any:
    return item.unwrap() if hasattr(item, "unwrap") else item


def render_config(
    existing: str | None,
    url: str,
    unit: str,
    algorithm: str,
    gateway: Mapping[str, str | list[str]] | None = None,
    fleet: Mapping[str, str | int | float | list[str]] | None = None,
    server_api_key_file: str | None = None,
) -> str:
    """/etc/specd/specd.toml: the shipped example, or the operator's file, with SGLang's URL,
    unit and speculative algorithm (the applier writes it with each setting) set, and the
    ``[gateway]`` and ``[fleet]`` keys given (checked: `gateway_keys`, `fleet_keys`) and
    ``[sglang] server_api_key_file`` where one is given (`key_file_value`);
    everything else kept as written. ``existing`` must be TOML (install checks it first).
    An empty file (or one of whitespace only), which specd refuses, gets the shipped example
    as a fresh box does: it holds nothing of the operator's to keep."""
    text = existing if existing is not None and existing.strip() else template("config")
    try:
        doc = tomlkit.parse(text)
    except tomlkit.exceptions.ParseError as exc:
        raise InstallError(f"{CONFIG_FILE}: not valid TOML ({exc})") from None
    for path, value in config_values(url, unit, algorithm, gateway, fleet, server_api_key_file):
        _set_value(doc, path, value)
    out = tomlkit.dumps(doc)
    if "\r\n" in text and text.count("\n") == text.count("\r\n"):
        # tomlkit ends the lines it adds with "\n": a file written with CRLF stays CRLF.
        out = out.replace("\r\n", "\n").replace("\n", "\r\n")
    return out


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


def _exists(layout: Layout, path: Path) -> bool:
    host = layout.host(path)
    return host.exists() or host.is_symlink()


def specd_owned(layout: Layout, files: SpecdFiles) -> list[Path]:
    """specd's own files that are there now: the override, the env file, and everything in
    the state directory."""
    found: list[Path] = []
    for path in (files.override_file, files.env_file):
        if _exists(layout, path):
            found.append(path)
    state = layout.host(files.state_dir)
    if state.is_dir() and not state.is_symlink():
        for child in sorted(state.iterdir()):
            path = files.state_dir / child.name
            if path not in found:
                found.append(path)
    return found
