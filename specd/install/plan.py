"""What install would change: every file (as a diff), directory, move and command, worked out
without touching anything; ``--dry-run`` prints it and ``execute`` carries it out."""

from __future__ import annotations

import difflib
import os
import pwd
import shlex
import stat
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

import tomli_w
from pydantic import ValidationError

from specd.core.setting import static
from specd.core.settings import FleetSettings, GatewaySettings
from specd.core.text import redact_command
from specd.install.execline import expand_argv
from specd.install.layout import (
    ARCHIVE_ROOT,
    CONFIG_FILE,
    DROPIN_NAME,
    ENV_FILE,
    POLKIT_FILE,
    SPECD_UNIT,
    SPECD_USER,
    STATE_DIR,
    SYSTEMCTL_TIMEOUT_S,
    SYSUSERS_FILE,
    UNITS_DIR,
    InstallError,
    Layout,
    stamp,
)
from specd.install.manifest import sha256
from specd.install.network import elsewhere, reach
from specd.install.render import (
    SpecdFiles,
    configured_files,
    render_config,
    render_dropin,
    render_polkit,
    render_specd_service,
    specd_owned,
    template,
)
from specd.install.sandbox import Sandbox, needs_read_write, refusal, user_cannot_write
from specd.install.sglang_args import (
    LEGACY_ENV_STEPS,
    LEGACY_NAMES,
    SPECD_VARIABLES,
    Speculation,
    analyse,
    find_flags,
    sglang_url,
)
from specd.install.unit import (
    UnitView,
    cat_sections,
    dropin_extras,
    live_command,
    service_assignments,
    unit_environment,
)
from specd.io.apply import ENV_ARGS, ENV_STEPS, parse_env, render_setting_env
from specd.io.config import ConfigError, load_config
from specd.io.files import ParseError, parse_toml
from specd.io.gateway import MAX_API_KEY_FILE_BYTES, key_file_unreadable_by
from specd.io.runner import Runner
from specd.io.writable import written_dirs_at

# The variables specd's drop-in sets (and older forms of it did): install rewrites them.
DROPIN_VARIABLES = frozenset({ENV_ARGS, *SPECD_VARIABLES})


@dataclass(frozen=True)
class FileChange:
    path: Path
    old: bytes | None
    new: bytes
    mode: int = 0o644
    # An existing file's owner, kept by the rewrite (a 0640 root:specd config stays readable
    # by specd); None: a new file, root's.
    owner: tuple[int, int] | None = None
    # The symlink that was at the path, which the rewrite replaces; uninstall puts it back.
    link: str | None = None
    # Where the file as it is now is kept before install replaces it whole: it holds what
    # install did not write (an operator's, or edited since install).
    backup: Path | None = None

    def diff(self) -> str:
        kept = (
            ""
            if self.backup is None
            else f"# {self.path} holds what specd install did not write: kept as {self.backup}\n"
        )
        old = (self.old or b"").decode("utf-8", "replace").splitlines(keepends=True)
        new = self.new.decode("utf-8", "replace").splitlines(keepends=True)
        label_old = f"{self.path} (absent)" if self.old is None else str(self.path)
        label_new = f"{self.path} (new, {self.mode:04o})" if self.old is None else str(self.path)
        lines = list(difflib.unified_diff(old, new, label_old, label_new))
        # Shown, never with a key: the drop-in repeats a command line's --api-key values.
        shown = [redact_command(line) for line in lines]
        return kept + "".join(line if line.endswith("\n") else line + "\n" for line in shown)


@dataclass(frozen=True)
class DirChange:
    path: Path
    mode: int
    owner: str


@dataclass(frozen=True)
class MoveAside:
    """A file from an earlier installation that this one must not act on."""

    path: Path
    to: Path
    why: str


@dataclass
class Plan:
    unit: str
    spec: Speculation
    url: str
    files: list[FileChange] = field(default_factory=list)
    dirs: list[DirChange] = field(default_factory=list)
    moves: list[MoveAside] = field(default_factory=list)
    commands: list[tuple[str, ...]] = field(default_factory=list)
    create_user: bool = False
    notes: list[str] = field(default_factory=list)
    # Said before the plan, with install's probe of the endpoints.
    warnings: list[str] = field(default_factory=list)
    # The [gateway] and [fleet] keys given on the command line, for install's probe.
    gateway: dict[str, str | list[str]] | None = None
    # [sglang] server_api_key_file as the config will say it (given, or kept), for the probe.
    server_api_key_file: str | None = None
    fleet: dict[str, str | int | float | list[str]] | None = None
    # Files this user may not read (a --dry-run without root): path → why.
    unreadable: dict[Path, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.files or self.dirs or self.moves or self.commands or self.create_user)

    def render(self) -> str:
        out: list[str] = []
        for move in self.moves:
            out.append(f"# {move.why}\n$ mv {move.path} {move.to}\n")
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
    specd_needs_reload: bool = False


def _configured_url(layout: Layout, key: str = "url") -> str | None:
    """[sglang] url (or ``key``) of the specd.toml in place, or None (none, unreadable, not
    TOML, no such key: the unit's --host/--port then say it)."""
    try:
        raw = layout.read(CONFIG_FILE)
        data = None if raw is None else parse_toml(raw.decode("utf-8"))
    except (OSError, ValueError):
        return None
    sglang = data.get("sglang") if isinstance(data, dict) else None
    url = sglang.get(key) if isinstance(sglang, dict) else None
    return url if isinstance(url, str) else None


def check_url(url: str, flag: str = "--url") -> str:
    """An operator's ``--url`` (or ``flag``): http(s)://HOST[:PORT], nothing else."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InstallError(f"{flag} {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InstallError(f"{flag} {url!r}: not an http:// or https:// URL with a host")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise InstallError(f"{flag} {url!r}: only scheme, host and port (a base URL)")
    if port == 0:
        raise InstallError(f"{flag} {url!r}: port 0 is not a TCP port")
    return url.rstrip("/")


# An admin API key is a line; a bigger file is the wrong file.
MAX_KEY_FILE_BYTES = MAX_API_KEY_FILE_BYTES


def key_file_problem(host: Path, *, others_ok: bool = False) -> str | None:
    """Why the gateway admin key file at ``host`` is unfit (one line), or None. Checked
    without opening it: a FIFO there would block whoever reads it. ``others_ok``: a file
    readable by others passes (specd can use it; install alone insists on 0640)."""
    try:
        # Followed, as the daemon reads it: secret mounts are symlinks to a regular file.
        info = host.stat()
    except OSError as exc:
        return f"not a regular file ({exc.strerror})"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_mode & 0o007 and not others_ok:
        return "readable by others; chmod o-rwx it (0600, owned by user specd)"
    if info.st_size == 0 or info.st_size > MAX_KEY_FILE_BYTES:
        return (
            f"{info.st_size} bytes; an API key file holds one key (1 to {MAX_KEY_FILE_BYTES} bytes)"
        )
    return None


def key_file_value(given: str, flag: str, layout: Layout, user: str = SPECD_USER) -> str:
    """A key file given on install's command line (the gateway's admin key, SGLang's
    --api-key), as specd will find it: an absolute path to a regular file (or a link to
    one) of 1 to MAX_KEY_FILE_BYTES bytes, not readable by others, and readable by ``user``
    (the daemon's) once that user exists: root reads any file. InstallError otherwise."""
    path = Path(given)
    shown = f"{flag} {given!r}"
    if not path.is_absolute():
        raise InstallError(f"{shown}: not an absolute path")
    problem = key_file_problem(layout.host(path))
    if problem is None and _user_exists(user):
        unreadable = key_file_unreadable_by(layout.host(path), user)
        if unreadable is not None:
            why, advice = unreadable
            problem = f"user {user} {why}: {advice}"
    if problem is not None:
        raise InstallError(f"{shown}: {problem}")
    return str(path)


SERVER_KEY_FLAG = "--sglang-api-key-file"


def server_key_file(
    given: str | None, kept: str | None, words: Sequence[str], unit: str, layout: Layout
) -> str | None:
    """[sglang] server_api_key_file for the config: the one given (checked), else the one
    the config in place has. A unit whose command line has --api-key and no key file
    either is refused: SGLang would refuse specd's every /server_info, and specd would
    decide nothing (an install that looks done, and a specd that never acts)."""
    if given is not None:
        return key_file_value(given, SERVER_KEY_FLAG, layout)
    if kept is not None or "--api-key" not in find_flags(words):
        return kept
    raise InstallError(
        f"{unit} runs with --api-key, and specd must send that key to SGLang: pass "
        f"{SERVER_KEY_FLAG} FILE, a file holding it (0600 {SPECD_USER}:{SPECD_USER}, e.g. "
        "/etc/specd/sglang.key)"
    )


@dataclass(frozen=True)
class GatewayOptions:
    """`specd install --gateway-url ... [--gateway-api-key-file F] [--gateway-worker-url U]`."""

    urls: Sequence[str]
    api_key_file: str | None = None
    worker_url: str | None = None


def gateway_keys(
    options: GatewayOptions, layout: Layout, user: str = SPECD_USER
) -> dict[str, str | list[str]]:
    """The ``[gateway]`` keys for the config, checked as specd will read them, and the key
    file as specd will find it (a regular file, not readable by others, and readable by
    ``user`` — the daemon's — once that user exists: root reads any file)."""
    urls = [check_url(u, "--gateway-url") for u in options.urls]
    if len(set(urls)) != len(urls):
        raise InstallError("--gateway-url: each gateway replica may be listed once")
    keys: dict[str, str | list[str]] = {"urls": urls}
    if options.worker_url is not None:
        keys["worker_url"] = check_url(options.worker_url, "--gateway-worker-url")
    if options.api_key_file is not None:
        keys["api_key_file"] = key_file_value(
            options.api_key_file, "--gateway-api-key-file", layout, user
        )
    try:
        GatewaySettings.model_validate(keys)
    except ValidationError as exc:
        raise _problems("gateway", exc) from None
    return keys


def _problems(section: str, exc: ValidationError) -> InstallError:
    """One line per problem, each naming the setting as specd.toml spells it."""
    lines = [
        f"[{section}] {'.'.join(map(str, e['loc'])) or section}: "
        + str(e["msg"]).removeprefix("Value error, ")
        for e in exc.errors()
    ]
    return InstallError("\n".join(lines))


@dataclass(frozen=True)
class FleetOptions:
    """`specd install --etcd-endpoint URL ... --fleet-group G [--fleet-slots N]
    [--fleet-lease-ttl-s S] [--fleet-holder-name NAME]`: what an operator sets per box; the
    other [fleet] keys keep their defaults (or the operator's file)."""

    etcd_endpoints: Sequence[str]
    group: str
    slots: int | None = None
    lease_ttl_s: float | None = None
    holder_name: str | None = None


def fleet_keys(options: FleetOptions) -> dict[str, str | int | float | list[str]]:
    """The ``[fleet]`` keys for the config, checked by FleetSettings itself (every problem
    reported, one per line)."""
    keys: dict[str, str | int | float | list[str]] = {
        "etcd_endpoints": [u.rstrip("/") for u in options.etcd_endpoints],
        "group": options.group,
    }
    if options.slots is not None:
        keys["slots"] = options.slots
    if options.lease_ttl_s is not None:
        keys["lease_ttl_s"] = options.lease_ttl_s
    if options.holder_name is not None:
        keys["holder_name"] = options.holder_name
    # The flag's own check first, as for --gateway-url: its line names the flag, and then
    # stands in for FleetSettings' line about the same endpoints.
    lines = []
    for endpoint in options.etcd_endpoints:
        try:
            check_url(endpoint, "--etcd-endpoint")
        except InstallError as exc:
            lines.append(str(exc))
    try:
        FleetSettings.model_validate(keys)
    except ValidationError as exc:
        settings_lines = str(_problems("fleet", exc)).splitlines()
        if lines:
            settings_lines = [
                line for line in settings_lines if not line.startswith("[fleet] etcd_endpoints:")
            ]
        lines += settings_lines
    if lines:
        raise InstallError("\n".join(lines))
    return keys


def config_problems(path: Path) -> list[str]:
    """What `specd check-config` says about the config file at ``path``, one line per
    problem (none: specd would start with it)."""
    try:
        load_config(path)
    except ConfigError as exc:
        return exc.problems
    return []


def file_change(layout: Layout, path: Path, old: bytes | None, new: bytes) -> FileChange:
    """``path`` rewritten to ``new``, keeping the mode and owner it has (a link: its
    target's), and recording a symlink that was there."""
    host = layout.host(path)
    link = os.readlink(host) if host.is_symlink() else None
    try:
        info = host.stat()
    except FileNotFoundError:
        return FileChange(path, old, new, link=link)
    return FileChange(
        path, old, new, stat.S_IMODE(info.st_mode), owner=(info.st_uid, info.st_gid), link=link
    )


def _changed_keys(old: bytes | None, new: str) -> str:
    """The keys that differ between two configs, as ``[table] key = value`` (TOML's own
    spelling of the value), for an operator to copy."""
    before = parse_toml((old or b"").decode("utf-8"))
    after = parse_toml(new)
    found = []
    for table, values in after.items():
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            was = before.get(table)
            if not isinstance(was, dict) or was.get(key) != value:
                found.append(f"[{table}] {tomli_w.dumps({key: value}).strip()}")
    return ", ".join(found)


def _is_toml(raw: bytes) -> bool:
    try:
        parse_toml(raw.decode("utf-8"))
    except (UnicodeDecodeError, ParseError):
        return False
    return True


def _config_refusal(lines: list[str]) -> InstallError:
    return InstallError(
        "\n".join(lines) + f"\n{CONFIG_FILE}: install writes only a config specd accepts: fix "
        f"the above (`specd check-config {CONFIG_FILE}` checks it) and run install again"
    )


def config_text_problems(text: str) -> list[str]:
    """`config_problems` of a config not written yet, read from a private scratch file."""
    with tempfile.TemporaryDirectory(prefix="specd-install-") as scratch:
        path = Path(scratch) / "specd.toml"
        path.write_text(text, encoding="utf-8")
        return config_problems(path)


def _migrated_env(old: bytes, spec: Speculation) -> bytes | None:
    """The env file of the step-variable form (today's or the old SPECD_SPEC_* names) as the
    same setting in the $SPECD_SPECULATIVE_ARGS form; None when it already has that form or
    names no step count it could carry over (the drop-in's default then applies, as the
    file's unreadable value did not)."""
    values = parse_env(old.decode("utf-8", "replace"))
    if ENV_ARGS in values:
        return None
    steps = values.get(ENV_STEPS, values.get(LEGACY_ENV_STEPS, ""))
    if not steps.isdigit() or int(steps) < 1:
        return None
    try:
        setting = static(int(steps))
    except ValueError:
        return None
    # The file lives beside the adaptive configs; a static setting names none of them.
    text = render_setting_env(setting, algorithm=spec.algorithm, config_dir=STATE_DIR)
    return text.encode()


def writable_dirs(
    layout: Layout, files: SpecdFiles, sandbox: Sandbox
) -> tuple[list[Path], list[DirChange]]:
    """The directories specd.toml has specd write in that specd.service must allow
    (ReadWritePaths=), and those to create for user specd; InstallError, naming the fix, for
    one the unit would hide from specd or one that exists but user specd cannot write (it
    is not install's to hand over: /etc/specd, a directory SGLang's own files live in)."""
    read_write: list[Path] = []
    prepared: dict[Path, DirChange] = {}
    for written in written_dirs_at(files.state_dir, files.env_file):
        directory = written.directory
        hidden = sandbox.hides(directory)
        if hidden is not None:
            raise InstallError(refusal(written, hidden))
        if needs_read_write(directory):
            read_write.append(directory)
        if directory == STATE_DIR:
            continue  # StateDirectory= makes it specd's at every start
        if layout.host(directory).exists():
            # Under /var/lib/specd systemd hands a tree it finds root's to specd at start.
            why = user_cannot_write(layout, directory, SPECD_USER)
            if why is not None and needs_read_write(directory):
                raise InstallError(refusal(written, why))
            continue
        missing = [directory] + [p for p in directory.parents if not layout.host(p).exists()]
        for path in reversed(missing):
            # Beside specd's own state (and the leaf itself) specd's, 0751 as StateDirectory=
            # (SGLang's user reads the adaptive configs); anything above it root's.
            ours = path == directory or not needs_read_write(path)
            prepared.setdefault(
                path, DirChange(path, 0o751, SPECD_USER) if ours else DirChange(path, 0o755, "root")
            )
    return read_write, [d for p, d in prepared.items() if p != STATE_DIR]


def build_plan(
    view: UnitView,
    layout: Layout,
    system: SystemState,
    *,
    add_metrics: bool,
    specd_argv: Sequence[str],
    url: str | None = None,
    fresh: bool = False,
    now_s: float = 0.0,
    gateway: GatewayOptions | None = None,
    fleet: FleetOptions | None = None,
    installed: Mapping[str, str] | None = None,
    specd_user: str = SPECD_USER,
    server_api_key_file: str | None = None,
) -> Plan:
    """Everything install would write and run; raises InstallError for a unit it refuses.
    ``fresh``: no installation of specd is recorded here, so an override file left from an
    earlier one is moved aside (``now_s`` names where). ``installed``: the sha256 of what
    install last wrote, by path (its manifest); a file it would replace whole that holds
    anything else is kept in the archive first."""
    unit = view.unit
    if view.unit_id and view.unit_id != unit:
        # systemd asks polkit about the unit's own name, not an alias: the rule for the alias
        # denied every restart specd issued, while install and doctor said all was well.
        raise InstallError(
            f"{unit} is an alias of {view.unit_id}: run install with --unit {view.unit_id}"
        )
    # A URL an earlier run was given (--url: a port published under another number) or the
    # operator set: kept by a run without --url, which rebuilt it from the unit's
    # --host/--port and so pointed specd at a port where SGLang does not answer.
    configured = _configured_url(layout) if url is None else None
    command = live_command(view)
    if ":" in command.prefix:
        # The drop-in repeats the command with $SPECD_SPECULATIVE_ARGS, which ":" leaves
        # unexpanded: SGLang would refuse the literal word at its next start, and so would
        # the rollback's, frozen with SGLang down.
        raise InstallError(
            f"{unit}: its ExecStart= starts with ':', which turns off variable expansion, and "
            "specd's drop-in passes the speculative arguments as $SPECD_SPECULATIVE_ARGS: "
            "remove the ':' (write a literal '$' in the command as '$$') and run install again"
        )
    environment = unit_environment(view, layout)
    spec = analyse(
        command,
        environment,
        unit,
        defaults=view.environment,
        read_url=url is None and configured is None,
    )
    server_key = server_key_file(
        server_api_key_file,
        _configured_url(layout, "server_api_key_file"),
        [arg.text for arg in expand_argv(command.words, environment)],
        unit,
        layout,
    )
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
    # --dry-run works without root: a file this user cannot read is left out of the plan,
    # and said (Debian's /etc/polkit-1/rules.d is root's alone).
    unreadable: dict[Path, str] = {}

    def read(path: Path) -> bytes | None:
        try:
            return layout.read(path)
        except PermissionError as exc:
            unreadable[path] = exc.strerror or "permission denied"
            return None

    existing_config = read(CONFIG_FILE)
    if existing_config is not None and _user_exists(specd_user):
        # Checked as root, a 0600 root:root specd.toml passed, and specd.service (user
        # specd) then failed to start on it. Install keeps the file's mode and owner.
        cannot_read = key_file_unreadable_by(layout.host(CONFIG_FILE), specd_user)
        if cannot_read is not None:
            why, advice = cannot_read
            raise InstallError(f"{CONFIG_FILE}: user {specd_user} {why}: {advice}")
    problems_now = [] if existing_config is None else config_problems(layout.host(CONFIG_FILE))
    if existing_config is not None and not _is_toml(existing_config):
        # Nothing to edit: refused before anything is written, as check-config says it.
        raise _config_refusal([f"{CONFIG_FILE}: {p}" for p in problems_now])
    derived = None if spec.port is None else sglang_url(spec.host, spec.port)
    given, kept = url is not None, url is None and configured is not None
    if url is None:
        url = configured if configured is not None else derived
        assert url is not None
    if given or kept:
        flag = f"{CONFIG_FILE} [sglang] url" if kept else "--url"
        url = check_url(url, flag)
        away = elsewhere(url)
        if away is not None:
            # specd would watch that server and restart this unit: every change would fail
            # its verification, restart the unit again to roll back, and freeze.
            raise InstallError(
                f"{flag} {url}: {away}, and specd restarts {unit} on this one: give the URL "
                f"this machine's {unit} answers at (its --host/--port) with --url"
            )
    gateway_values = None if gateway is None else gateway_keys(gateway, layout)
    fleet_values = None if fleet is None else fleet_keys(fleet)
    config_text = render_config(
        None if existing_config is None else existing_config.decode("utf-8"),
        url,
        unit,
        spec.algorithm,
        gateway_values,
        fleet_values,
        server_key if server_api_key_file is not None else None,
    )
    # Checked as specd will read it, before anything is written: a config specd refuses
    # would leave specd.service enabled and failing. A problem of the file as it is now is
    # named as check-config names it; one that install's edit would fix is no reason to stop.
    problems = config_text_problems(config_text)
    if problems:
        raise _config_refusal(
            [
                f"{CONFIG_FILE}: {p}"
                if p in problems_now
                else f"{CONFIG_FILE} as install would write it: {p}"
                for p in problems
            ]
        )
    reachable = reach(config_text, layout)
    # The env file specd writes, as the config names it: the drop-in reads that one.
    files, _ = configured_files(config_text)
    service_template = template("specd.service")
    read_write, prepared = writable_dirs(layout, files, Sandbox.from_unit_text(service_template))
    wanted = {
        dropin: render_dropin(unit, command, spec, add_metrics, files.env_file),
        UNITS_DIR / SPECD_UNIT: render_specd_service(
            service_template, unit, list(specd_argv), reachable.addresses, read_write
        ),
        POLKIT_FILE: render_polkit(template("polkit"), unit),
        SYSUSERS_FILE: template("sysusers"),
        CONFIG_FILE: config_text,
    }
    plan = Plan(
        unit=unit,
        spec=spec,
        url=url,
        gateway=gateway_values,
        fleet=fleet_values,
        server_api_key_file=server_key,
        unreadable=unreadable,
    )
    plan.notes += reachable.notes
    plan.warnings += reachable.warnings
    if kept and derived is not None and url != derived:
        plan.notes.append(
            f"kept [sglang] url = {url} from {CONFIG_FILE}; {unit}'s --host/--port say "
            f"{derived}: run install with --url to change it"
        )
    old_dropin = read(dropin)
    extras = (
        []
        if old_dropin is None
        else dropin_extras(
            old_dropin.decode("utf-8", "replace"),
            DROPIN_VARIABLES,
            frozenset({str(ENV_FILE), str(files.env_file)}),
        )
    )
    if extras:
        # Replaced whole, they would be gone at SGLang's next restart, which specd makes.
        raise InstallError(
            f"{dropin} has settings of its own, which specd's drop-in (it replaces that file "
            f"whole) would drop: {'; '.join(extras)}. Move them to a drop-in of your own "
            f"(`systemctl edit {unit}`), then run install again"
        )
    archive = ARCHIVE_ROOT / f"install-{stamp(now_s)}"
    if fresh and layout.host(files.override_file).is_file():
        to = archive / files.override_file.relative_to("/")
        plan.moves.append(
            MoveAside(
                files.override_file,
                to,
                "an override left by an earlier installation: this one starts in auto mode",
            )
        )
    env_host = layout.host(files.env_file)
    if (
        fresh
        and (env_host.exists() or env_host.is_symlink())
        and str(files.env_file) not in view.environment_files
    ):
        plan.moves.append(
            MoveAside(
                files.env_file,
                archive / files.env_file.relative_to("/"),
                f"an env file left by an earlier installation, which {unit} does not read now: "
                "SGLang would start with its setting at its next restart, not with today's",
            )
        )
    if fresh and str(files.env_file) not in view.environment_files and not system.specd_active:
        # No specd runs on them, and no unit reads what one wrote: an earlier installation's,
        # whose restart journal the new specd would finish, restarting the unit at install.
        for path in specd_owned(layout, files):
            if path.parent == files.state_dir and path != files.env_file:
                plan.moves.append(
                    MoveAside(
                        path,
                        archive / path.relative_to("/"),
                        "left by an earlier installation: this one starts from none of its "
                        "state (its restart journal, freeze, what it learned)",
                    )
                )
    config_host = layout.host(CONFIG_FILE)
    if (
        config_host.is_symlink()
        and CONFIG_FILE not in unreadable
        and existing_config != config_text.encode()
    ):
        # Whatever manages the link (configuration management) owns its target: an edit
        # there would be undone by it, or land in its source unseen.
        keys = _changed_keys(existing_config, config_text)
        raise InstallError(
            f"{CONFIG_FILE} is a symlink to {os.readlink(config_host)}: install does not edit "
            f"through it; set {keys} where that file comes from, then run install again"
        )
    written = installed or {}
    for path, text in wanted.items():
        old = read(path)
        if path not in unreadable and old != text.encode():
            change = file_change(layout, path, old, text.encode())
            if path != CONFIG_FILE and old is not None and sha256(old) != written.get(str(path)):
                # Replaced whole (specd.toml is edited in place): what is there now is kept.
                change = replace(change, backup=archive / path.relative_to("/"))
            plan.files.append(change)
    if spec.step_variables:
        old_names = ", ".join(LEGACY_NAMES if spec.legacy else LEGACY_NAMES.values())
        plan.notes.append(
            f"{unit} was wired with the step variables ({old_names}); the drop-in now carries "
            f"the whole speculative setting in ${ENV_ARGS}, and specd's env file says the "
            "same setting in that form"
        )
        env_old = read(files.env_file)
        env_new = None if env_old is None else _migrated_env(env_old, spec)
        if env_old is not None and env_new is not None:
            # Recorded like install's other files: the drop-in uninstall restores reads the
            # step variables from this file, so it gets back what it said before.
            plan.files.append(file_change(layout, files.env_file, env_old, env_new))
    if not system.user_exists:
        plan.create_user = True
        plan.commands.append(("systemd-sysusers", str(SYSUSERS_FILE)))
    if not layout.host(STATE_DIR).is_dir():
        # Traversable by SGLang's user, which reads the adaptive config specd writes there.
        plan.dirs.append(DirChange(STATE_DIR, 0o751, SPECD_USER))
    plan.dirs += prepared
    units_changed = any(c.path.is_relative_to(UNITS_DIR) for c in plan.files)
    # A run that stopped after writing a unit file left systemd without it: this one reloads.
    unread = layout.host(dropin).is_file() and str(dropin) not in view.dropin_paths
    if units_changed or unread or view.need_reload or system.specd_needs_reload:
        plan.commands.append(("systemctl", "daemon-reload"))
    if not (system.specd_enabled and system.specd_active):
        plan.commands.append(("systemctl", "enable", "--now", SPECD_UNIT))
    elif units_changed or plan.moves or any(c.path == CONFIG_FILE for c in plan.files):
        plan.commands.append(("systemctl", "restart", SPECD_UNIT))
    if any(c.path == dropin for c in plan.files) and not spec.metrics:
        # Without /metrics specd decides no_data on every tick: it never restarts SGLang.
        plan.notes.append(
            f"SGLang is not restarted: --enable-metrics is live only from {unit}'s next "
            "restart, and specd cannot decide anything (nor restart it) without SGLang's "
            f"metrics: run `systemctl restart {unit}` now to start tuning."
        )
    elif any(c.path == dropin for c in plan.files):
        plan.notes.append(
            f"SGLang is not restarted: the drop-in takes effect at {unit}'s next restart "
            f"(specd restarts it in its next maintenance window when it changes the step count, "
            f"or run `systemctl restart {unit}`)."
        )
    return plan


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def system_state(runner: Runner) -> SystemState:
    enabled = runner(["systemctl", "is-enabled", SPECD_UNIT], timeout_s=SYSTEMCTL_TIMEOUT_S)
    active = runner(["systemctl", "is-active", SPECD_UNIT], timeout_s=SYSTEMCTL_TIMEOUT_S)
    reload = runner(
        ["systemctl", "show", "--property=NeedDaemonReload", "--value", SPECD_UNIT],
        timeout_s=SYSTEMCTL_TIMEOUT_S,
    )
    return SystemState(
        user_exists=_user_exists(SPECD_USER),
        specd_enabled=enabled.stdout.strip() == "enabled",
        specd_active=active.stdout.strip() == "active",
        specd_needs_reload=reload.stdout.strip() == "yes",
    )
