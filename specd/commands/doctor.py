"""`specd doctor`: is every part of the setup in place? One ✓/✗ line per check, each ✗ with
one line of advice; exit 0 only when all pass; ``--json`` for automation.

HTTP to SGLang goes through observe's SGLangClient; systemctl through the runner.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import ipaddress
import json
import math
import os
import pwd
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from specd.commands.override import pin_unrunnable, pinned_setting, unsupported_pin_text
from specd.commands.status import override_info, override_text, read_override_as_daemon
from specd.core import sglang_features as features
from specd.core import windows
from specd.core.choices import CHOOSES_KINDS
from specd.core.observation import ScrapeError
from specd.core.setting import KINDS, describe_args, describe_server, traits_from_server_info
from specd.core.sglang_features import FEATURES, parse_version
from specd.core.text import duration_text, redact_options
from specd.install.execline import expand_argv
from specd.install.layout import (
    DROPIN_NAME,
    MANIFEST_FILE,
    SPECD_UNIT,
    SPECD_USER,
    UNITS_DIR,
    InstallError,
    Layout,
)
from specd.install.manifest import load_manifest
from specd.install.network import elsewhere
from specd.install.plan import key_file_problem
from specd.install.render import template
from specd.install.sandbox import SANDBOX_PROPERTIES, Sandbox, user_cannot_write
from specd.install.sglang_args import ARGS_WORD, DEFAULT_PORT, LEGACY_NAMES, find_flags
from specd.install.unit import UnitView, live_command, read_unit
from specd.io import systemd
from specd.io.apply import (
    ENV_ARGS,
    MAX_ENV_BYTES,
    env_setting_words,
    out_of_service_bound_s,
    parse_env,
    static_only_wiring,
)
from specd.io.calibration import configured_offer
from specd.io.config import (
    DEFAULT_CONFIG_PATH,
    Config,
    ConfigError,
    check_calibration,
    load_config,
)
from specd.io.files import (
    MIB,
    FileReadError,
    KeyFileError,
    MissingFileError,
    read_key_file,
    read_regular_file,
    size_text,
)
from specd.io.fleet import Busy, EtcdClient, Fleet, FleetUnavailable, out_text
from specd.io.gateway import READY, GatewayClient, GatewayUnavailable, key_file_unreadable_by
from specd.io.promtext import sample_names
from specd.io.runner import Runner, SubprocessRunner
from specd.io.sglang import (
    ACCEPT_LENGTH,
    QUEUED,
    RUNNING,
    SERVER_KEY_SETTING,
    SPEC_STEPS,
    VERIFY_CALLS,
    SGLangClient,
    parse_metrics,
)
from specd.io.timespan import timespan_s
from specd.io.tls import context_for
from specd.io.writable import STATE_DIRECTORY, WrittenDir, fix_for, written_dirs

TIMEOUT_S = 10.0
# The check of [sglang] server_api_key_file, and where its advice suggests keeping the key.
SERVER_KEY_CHECK = "sglang api key"
SGLANG_KEY_EXAMPLE = "/etc/specd/sglang.key"
# What doctor reads at most of each EnvironmentFile= of SGLang's unit (specd's own env
# file: the daemon's MAX_ENV_BYTES).
MAX_UNIT_ENV_BYTES = MIB
POLKIT_ACTION = "org.freedesktop.systemd1.manage-units"
# A unit name specd must NOT be allowed to touch; it need not exist for the check.
PROBE_OTHER_UNIT = "specd-doctor-probe.service"
# A next window further away than this is probably a mistake in the cron line.
MAX_WINDOW_GAP_S = 31 * 86400.0
NEEDED_METRICS = (RUNNING, QUEUED, ACCEPT_LENGTH)
USEFUL_METRICS = (SPEC_STEPS, VERIFY_CALLS)
# The checks that read what to check from the config, and the part they read: with an
# invalid config they are skipped, as probing the built-in defaults instead (another URL,
# unit or port) would pass or fail for a setup that is not the operator's.
NEEDS_CONFIG = (
    ("sglang", "[sglang] url"),
    ("metrics", "[sglang] url"),
    ("version", "[sglang] url"),
    ("gateway", "[gateway]"),
    ("choices", "[choose]"),
    ("drop-in", "[sglang] unit"),
    ("command", "[sglang] unit"),
    ("setting", "[sglang] env_file"),
    ("polkit", "[sglang] unit"),
    ("windows", "[[windows]]"),
    ("override", "[files] override_file"),
    ("fleet", "[fleet]"),
    ("writable", "[files] state_dir and [sglang] env_file"),
    ("specd-metrics", "[report] metrics_port"),
)


# specd's own exit after the sequence a stop finishes (the shipped unit's margin).
STOP_EXIT_MARGIN_S = 60.0


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    advice: str = ""
    # What the operator should know either way (e.g. what specd cannot see on this SGLang).
    notes: tuple[str, ...] = ()
    # Not run (``ok`` is False): what it would check is not known.
    skipped: bool = False


def restart_policy_note(view: UnitView, poll_s: float) -> str | None:
    """What an operator should know of the unit's ``Restart=``, or None: systemd starting a
    failed SGLang again within two of specd's looks while a restart runs (``poll_s``) leaves
    specd no time to read why its start failed (systemd resets ExecMainStatus= at the next
    start), so a start systemd itself could not set up reads as SGLang's own death."""
    if view.restart in ("", "no") or view.restart_sec_s is None:
        return None
    if view.restart_sec_s >= 2 * poll_s:
        return None
    return (
        f"{view.unit} starts again {view.restart_sec_s:g} s after it fails "
        f"(Restart={view.restart}): sooner than specd looks while a restart runs (every "
        f"{poll_s:g} s), so a start systemd could not set up (status 200-246: cgroup, user, "
        "working directory) reads as SGLang's death, rolled back and frozen instead of "
        "aborted; RestartSec=30s (as systemd/examples/sglang.service) leaves time"
    )


class Doctor:
    def __init__(
        self,
        config_path: Path | None,
        runner: Runner,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        daemon_user: str = SPECD_USER,
        layout: Layout | None = None,
    ) -> None:
        self.config_path = config_path
        self.runner = runner
        # Whom the files the daemon reads are judged for: doctor runs as root, specd not.
        self.daemon_user = daemon_user
        # Where install's manifest is (a directory in tests), and the unit it names.
        self.layout = layout or Layout()
        self.installed_unit: str | None = None
        self.clock = clock
        self.monotonic = monotonic
        self.config = Config()
        # The config file was read (its calibration may still have failed the check): the
        # other checks can use it.
        self.config_loaded = False
        self.info: dict[str, Any] | None = None
        # The endpoint that answered for /server_info (/get_server_info before SGLang 0.5.6).
        self.info_path: str | None = None
        # Why SGLang refused /server_info for its --api-key, and what to do (None: it did
        # not): said by the sglang check, and by the setting check that needs what it lacks.
        self.refused: tuple[str, str] | None = None
        self.unit_env_files: list[Path] = []
        # Why the unit takes static step counts only (its drop-in's wiring), or None.
        self.static_only: str | None = None
        # The arguments systemd would start SGLang with now (None: the unit was not read).
        self.unit_args: list[str] | None = None

    def systemctl_show(self, unit: str, *props: str) -> dict[str, str]:
        try:
            return systemd.last_values(systemd.show(self.runner, unit, props, TIMEOUT_S))
        except systemd.SystemctlError as exc:
            raise InstallError(str(exc)) from None

    # -- the checks ---------------------------------------------------------------------

    def check_config(self) -> Check:
        shown = self.config_path or DEFAULT_CONFIG_PATH
        defaults = self.config_path is None and not DEFAULT_CONFIG_PATH.exists()
        try:
            # The calibration on its own: a broken table fails this check, not every other.
            self.config = load_config(self.config_path, calibration=False)
            self.config_loaded = True
        except ConfigError as exc:
            more = f" (+{len(exc.problems) - 1} more)" if len(exc.problems) > 1 else ""
            return Check(
                "config",
                False,
                f"{shown}: {exc.problems[0]}{more}",
                f"see every problem with `specd check-config {shown}`",
            )
        table = check_calibration(self.config)
        if table:
            more = f" (+{len(table) - 1} more)" if len(table) > 1 else ""
            return Check(
                "config",
                False,
                f"{shown}: {table[0]}{more}",
                "a running specd keeps the last good table it read; a start refuses this "
                f"one: fix it (`specd check-config {shown}`)",
            )
        if defaults:
            # Nothing was checked: say what specd runs on instead of calling it valid.
            return Check(
                "config",
                True,
                f"no {shown}: specd uses its built-in defaults"
                f" (SGLang at {self.config.sglang.url}, unit {self.config.sglang.unit})",
            )
        return Check("config", True, f"{shown} is valid")

    def check_installed_unit(self) -> Check | None:
        """A ✗ when [sglang] unit is not the unit install set specd up for (its manifest),
        else None (no manifest: installed by hand, nothing to compare)."""
        try:
            # A bounded read of a regular file (`Layout.read`): a FIFO there hung doctor.
            manifest = load_manifest(self.layout)
        except InstallError as exc:
            return Check(
                "unit",
                False,
                str(exc),
                f"{MANIFEST_FILE} is install's record of what it changed, which `specd "
                "uninstall` undoes: put back the file install wrote (a regular file)",
            )
        except OSError:
            return None  # 0600 root: doctor not run as root cannot tell
        installed = None if manifest is None else manifest.get("unit")
        self.installed_unit = installed if isinstance(installed, str) else None
        unit = self.config.sglang.unit
        if installed is None or installed == unit:
            return None
        shown = self.config_path or DEFAULT_CONFIG_PATH
        return Check(
            "unit",
            False,
            f"[sglang] unit is {unit}, but specd was installed for {installed} ({MANIFEST_FILE})",
            f'set unit = "{installed}" under [sglang] in {shown}; to move specd to {unit}: '
            f"`specd uninstall`, then `specd install --unit {unit}`",
        )

    def check_sglang(self, client: SGLangClient) -> Check:
        info = client.server_info()
        if isinstance(info, ScrapeError) and info.kind == "api_key":
            # SGLang refused specd's key, or the key file could not be read: its --api-key,
            # not its unit, is the matter.
            unusable = self._server_key_unusable()
            self.refused = (
                "SGLang's /server_info was not asked: [sglang] server_api_key_file is unusable"
                if unusable
                else "SGLang refused /server_info for its --api-key",
                self._server_key_advice(unusable),
            )
            return Check("sglang", False, info.reason, self.refused[1])
        if isinstance(info, ScrapeError):
            return Check(
                "sglang",
                False,
                info.reason,
                f"is {self.config.sglang.unit} running? `systemctl status "
                f"{self.config.sglang.unit}`; [sglang] url is {self.config.sglang.url} (an "
                "SGLang in a container that publishes its port under another number, "
                "`docker run -p 8000:30000`, answers at the published one)",
            )
        self.info = info
        self.info_path = client.info_path or "/server_info"
        other = self._another_server(info)
        if other is not None:
            unit = self.config.sglang.unit
            return Check(
                "sglang",
                False,
                f"{client.base_url} answers {self.info_path}, but {other}: specd would watch "
                f"that server and restart {unit} (every change fails its verification)",
                f"set [sglang] url to the URL {unit} answers at (its --host/--port)",
            )
        return Check("sglang", True, f"{client.base_url} answers {self.info_path}")

    def _server_key_unusable(self) -> bool:
        key = self.config.sglang.server_api_key_file
        if key is None:
            return False
        try:
            read_key_file(key, SERVER_KEY_SETTING)
        except KeyFileError:
            return True
        return False

    def _server_key_advice(self, unusable: bool) -> str:
        """What to do about an SGLang that refused specd's key (or its lack of one);
        ``unusable``: the key file could not be read."""
        key = self.config.sglang.server_api_key_file
        shown = self.config_path or DEFAULT_CONFIG_PATH
        if key is not None and unusable:
            return (
                f"make {key} a file holding the --api-key {self.config.sglang.unit} runs with "
                "(one line; see the sglang api key check)"
            )
        if key is None:
            return (
                f"{self.config.sglang.unit} runs with --api-key: put that key in a file "
                f"(e.g. {SGLANG_KEY_EXAMPLE}, 0600 specd:specd) and set server_api_key_file = "
                f'"FILE" under [sglang] in {shown}'
            )
        return (
            f"put the --api-key {self.config.sglang.unit} runs with in {key} (one line), or "
            f"point [sglang] server_api_key_file in {shown} at the file holding it"
        )

    def check_server_key(self) -> list[Check]:
        """With [sglang] server_api_key_file: the file is fit to read, by the daemon's user
        too, as the gateway's key file is judged (the same checks)."""
        key = self.config.sglang.server_api_key_file
        if key is None:
            return []
        problem = key_file_problem(key, others_ok=True)
        if problem is not None:
            return [
                Check(
                    SERVER_KEY_CHECK,
                    False,
                    f"{key}: {problem}",
                    "[sglang] server_api_key_file must be a file holding SGLang's --api-key",
                )
            ]
        return [self.check_key_reader(key, SERVER_KEY_CHECK)]

    def _another_server(self, info: dict[str, Any]) -> str | None:
        """Why the SGLang at [sglang] url is not the unit's (as install judges a --url):
        its host is no address of this machine, or it runs another --port than the unit's
        command line (read by check_dropin). None when it is, or cannot be told."""
        away = elsewhere(self.config.sglang.url)
        if away is not None:
            return away
        answered = info.get("port")
        if self.unit_args is None or not isinstance(answered, int) or isinstance(answered, bool):
            return None
        try:
            flag = find_flags(self.unit_args).get("--port")
        except InstallError:
            return None  # an ambiguous option: the drop-in check says so
        wanted = str(DEFAULT_PORT) if flag is None else flag.value or ""
        if not wanted.isdigit() or int(wanted) == answered:
            return None
        return f"it runs --port {answered}, {self.config.sglang.unit} --port {wanted}"

    def check_choices(self) -> Check:
        """Which kinds of setting specd may choose on this server, and why not the others
        (from the config, the calibration's rows, /server_info and the drop-in's wiring, as
        the brain offers them)."""
        traits = None if self.info is None else traits_from_server_info(self.info)
        choose = self.config.choose
        got, lines = configured_offer(
            choose, traits, self.static_only, self.config.sglang.speculative_algorithm
        )
        if got is None:
            return Check(
                "choices", False, lines[0], "fix the calibration file (the config check says how)"
            )
        notes = tuple(lines)
        # The default kinds are every kind, each where it can be: only kinds the operator
        # listed are a problem when they cannot be chosen.
        # Under a policy that picks static K only, every other kind is a note: the shipped
        # config lists them all, for the model policy a calibration_file selects.
        listed = (
            choose.kinds
            if "kinds" in choose.model_fields_set and choose.policy in CHOOSES_KINDS
            else ()
        )
        refused = [k for k in listed if not got.allows(k)]
        if refused:
            kind = refused[0]
            return Check(
                "choices",
                False,
                f"[choose] kinds has {kind}, which this server cannot run: {got.kinds[kind]}",
                f"take {kind} out of [choose] kinds, or run SGLang where it is supported",
                notes,
            )
        offered = ", ".join(k for k in KINDS if got.allows(k))
        if not offered:
            return Check(
                "choices",
                False,
                "specd can choose no setting on this server (each kind's reason below)",
                "set [sglang] speculative_algorithm to the one SGLang runs with, or run "
                "SGLang with speculative decoding",
                notes,
            )
        return Check("choices", True, f"specd may choose {offered}", notes=notes)

    def check_metrics(self, client: SGLangClient) -> list[Check]:
        text = client.metrics_text()
        if isinstance(text, ScrapeError):
            unit = self.config.sglang.unit
            if "404" not in text.reason:
                advice = "check that SGLang is up and [sglang] url points at it"
            elif self._unit_enables_metrics():
                # Added (by install) since SGLang started: only a restart turns it on, and
                # specd, deciding no_data without /metrics, never makes one.
                advice = (
                    f"{unit}'s command line has --enable-metrics, SGLang started without it: "
                    f"`systemctl restart {unit}` now (specd cannot: it needs /metrics to act)"
                )
            else:
                advice = (
                    f"add --enable-metrics to {unit}'s command line "
                    f"(`specd install --unit {unit} --add-enable-metrics`) and restart it"
                )
            return [Check("metrics", False, text.reason, advice)]
        parsed = parse_metrics(text)
        if isinstance(parsed, ScrapeError):
            return [Check("metrics", False, parsed.reason, "SGLang's /metrics is not parseable")]
        names = sample_names(text)
        missing = [m for m in NEEDED_METRICS if m not in names]
        return [
            Check(
                "metrics",
                not missing,
                f"/metrics parses ({len(names)} series names)"
                + (f"; missing {', '.join(missing)}" if missing else ""),
                "" if not missing else "specd needs these gauges; is speculation on?",
            ),
            self.check_version(names, missing),
        ]

    def check_version(self, names: set[str], missing: list[str]) -> Check:
        """Which SGLang runs, and what specd cannot see on it: from the page and the
        endpoint that answered where they show it, from the version's features otherwise."""
        shown = (self.info or {}).get("version")
        version = parse_version(shown)
        offered = [m.removeprefix("sglang:") for m in (*NEEDED_METRICS, *USEFUL_METRICS)]
        offered = [m for m in offered if "sglang:" + m in names]
        notes: list[str] = []
        for feature in FEATURES:
            older = version is not None and not features.has(version, feature)
            since = f"SGLang < {features.version_text(feature.since)}"
            if feature.metric is not None:
                # The page is the witness: a family it has is there, whatever the version.
                if feature.metric in names:
                    continue
                why = since
                if not older:
                    why = (
                        "no request finished since the start, or speculation is off"
                        if feature is features.VERIFY_CALLS
                        else "not emitted by this server"
                    )
                notes.append(f"{feature.what} on this page ({why}): {feature.without}")
            elif feature is features.SERVER_INFO:
                if self.info_path == "/get_server_info":
                    notes.append(
                        f"{feature.what} (only /get_server_info answers): {feature.without}"
                    )
            elif feature is features.EFFECTIVE_CAPACITY:
                if self.info is not None and not _reports_effective_capacity(self.info):
                    notes.append(f"{feature.what} in {self.info_path}: {feature.without}")
            elif older:
                notes.append(f"{feature.what} ({since}): {feature.without}")
        if version is not None and version > features.NEWEST_KNOWN:
            notes.append(
                f"SGLang {features.version_text(version)} is newer than any specd was checked "
                f"against (up to {features.version_text(features.NEWEST_KNOWN)}): taken to "
                "have every feature above, its metrics and arguments as before; `specd "
                "observe` shows what it serves"
            )
        elif version is not None and version < features.OLDEST_KNOWN:
            notes.append(
                f"SGLang {features.version_text(version)} is older than any specd was checked "
                f"against (from {features.version_text(features.OLDEST_KNOWN)}): it may lack "
                "more than the above"
            )
        if version is None:
            notes.append(
                f"version {shown!r} unknown: what it lacks beyond the above cannot be told"
                if shown is not None
                else "no version in /server_info: what it lacks beyond the above cannot be told"
            )
        name = features.version_text(version) if version is not None else str(shown or "unknown")
        return Check(
            "version",
            not missing,
            f"SGLang {name}; offers {', '.join(offered) or 'none of specd’s metrics'}"
            + (f"; {len(notes)} limit(s) for specd, below" if notes else ""),
            "" if not missing else "upgrade SGLang to 0.5.13 or newer",
            tuple(notes),
        )

    def check_dropin(self) -> tuple[Check, list[str] | None, dict[str, str]]:
        unit = self.config.sglang.unit
        dropin = str(UNITS_DIR / f"{unit}.d" / DROPIN_NAME)
        advice = f"run `specd install --unit {unit}`"
        try:
            view = read_unit(self.runner, unit)
            command = live_command(view)
        except InstallError as exc:
            return Check("drop-in", False, str(exc), advice), None, {}
        self.unit_env_files = [Path(p) for p in view.environment_files]
        self.static_only = static_only_wiring(unit, [e.argv_text for e in view.exec_start])
        expanded = expand_argv(command.words, self._expected_values(view.environment))
        self.unit_args = [arg.text for arg in expanded]
        if dropin not in view.dropin_paths:
            return (
                Check("drop-in", False, f"{dropin} is not among {unit}'s drop-ins", advice),
                None,
                view.environment,
            )
        env_file = Path(self.config.sglang.env_file)
        if env_file not in self.unit_env_files:
            # Every change specd makes would restart SGLang into what it ran before, fail
            # its verification, roll back (a second restart) and freeze.
            reads = ", ".join(map(str, self.unit_env_files)) or "no EnvironmentFile="
            return (
                Check(
                    "drop-in",
                    False,
                    f"{unit} does not read [sglang] env_file {env_file} (it reads {reads}): "
                    "no setting specd writes would reach SGLang",
                    f"{advice} (its drop-in reads the configured env_file), or set [sglang] "
                    "env_file to the file the unit reads",
                ),
                None,
                view.environment,
            )
        joined = " ".join(command.words)
        step_variables = [
            name for name in (*LEGACY_NAMES, *LEGACY_NAMES.values()) if f"${{{name}}}" in joined
        ]
        if ARGS_WORD not in command.words and step_variables:
            # Static step counts still apply; off and adaptive settings cannot.
            return (
                Check(
                    "drop-in",
                    False,
                    f"{dropin} uses the step variable {step_variables[0]}: only static step "
                    "counts can be applied",
                    f"{advice} to rewrite it with {ARGS_WORD} "
                    f"(it shows the diff; {unit} is not restarted)",
                ),
                None,
                view.environment,
            )
        if ARGS_WORD not in command.words:
            return (
                Check("drop-in", False, f"{unit}'s ExecStart= has no {ARGS_WORD}", advice),
                None,
                view.environment,
            )
        note = restart_policy_note(view, self.config.restart.health_poll_interval_s)
        return (
            Check("drop-in", True, f"{dropin} is live", notes=() if note is None else (note,)),
            list(command.words),
            view.environment,
        )

    def _unit_enables_metrics(self) -> bool:
        return self.unit_args is not None and "--enable-metrics" in find_flags(self.unit_args)

    def _expected_values(self, defaults: dict[str, str]) -> dict[str, str]:
        """The variables SGLang's next start would see: Environment=, then the unit's
        EnvironmentFile= files and specd's env file (the files win, as in systemd)."""
        values = dict(defaults)
        for path in [*self.unit_env_files, Path(self.config.sglang.env_file)]:
            # Bounded, never blocking: a FIFO there hung doctor. Followed, as systemd reads
            # them; one that cannot be read adds nothing (`check_setting` names specd's).
            with contextlib.suppress(FileReadError):
                data = read_regular_file(path, MAX_UNIT_ENV_BYTES, follow_symlinks=True)
                values.update(parse_env(data.decode("utf-8", errors="replace")))
        return values

    def check_command(self, words: list[str] | None, defaults: dict[str, str]) -> Check:
        unit = self.config.sglang.unit
        if words is None:
            return Check("command", False, "no drop-in to compare with", "fix the drop-in first")
        running = (self.info or {}).get("launch_command")
        if not isinstance(running, str):
            return Check(
                "command", False, "SGLang's /server_info has no launch_command", "upgrade SGLang"
            )
        # What systemd would hand SGLang now: $$, ${VAR} and $VAR expanded from its
        # environment (%% and specifiers were resolved when the words were read).
        expected = [arg.text for arg in expand_argv(words, self._expected_values(defaults))]
        # The program part differs (python -m vs the script path): compare the options.
        want = _options(redact_options(expected))
        try:
            have = _options(redact_options(shlex.split(running)))
        except ValueError:
            have = redact_options(running.split())
        if want == have:
            return Check("command", True, "SGLang runs the drop-in's command line")
        diff = sorted(set(want) ^ set(have))[:4]
        # Without --enable-metrics SGLang serves no /metrics, and specd, deciding no_data
        # on every tick, never restarts it: the next window would not help.
        metrics_off = "--enable-metrics" in want and "--enable-metrics" not in have
        return Check(
            "command",
            False,
            f"SGLang's running command differs from the drop-in ({' '.join(diff)})",
            f"restart it to pick up the drop-in: `systemctl restart {unit}` "
            + (
                "now (specd cannot: it needs the /metrics that --enable-metrics turns on)"
                if metrics_off
                else "(or let specd do it in the next window)"
            ),
        )

    def check_setting(self, defaults: dict[str, str]) -> Check:
        """The setting specd's env file asks for (else the drop-in's default) against the
        one SGLang runs."""
        env_file = self.config.sglang.env_file
        unit = self.config.sglang.unit
        try:
            # As the daemon reads it (`specd.io.apply`): no link followed, a regular file of
            # at most MAX_ENV_BYTES, never blocking (a FIFO there hung doctor).
            data: bytes | None = read_regular_file(env_file, MAX_ENV_BYTES)
        except MissingFileError:
            data = None
        except FileReadError as exc:
            return Check("setting", False, f"[sglang] env_file {exc}", _env_file_advice(exc, unit))
        asked = None if data is None else env_setting_words(data)
        source = str(env_file)
        if asked is None:
            default = defaults.get(ENV_ARGS)
            asked = None if default is None else default.split()
            source = "the drop-in's default (no env file yet)"
        if asked is None:
            return Check(
                "setting",
                False,
                f"no setting to compare: no {ENV_ARGS} in {env_file} nor a default in {unit}",
                f"run `specd install --unit {unit}`",
            )
        want = describe_args(asked)
        info = self.info
        if info is None and self.refused is not None:
            why, advice = self.refused
            return Check("setting", False, f"{why} (expected {want})", advice)
        if info is None:
            return Check(
                "setting", False, f"SGLang's /server_info is unreadable (expected {want})",
                "is SGLang up?",
            )  # fmt: skip
        have = describe_server(info)
        if have == want:
            return Check("setting", True, f"SGLang runs {have}, as {source} says")
        return Check(
            "setting",
            False,
            f"{source} says {want}, SGLang runs {have}",
            f"restart {unit}, or see `specd status` for a failed change",
        )

    def check_key_reader(self, key: Path, name: str = "gateway api key") -> Check:
        """The daemon's user can read the key file (doctor, as root, always can): the
        gateway's admin key, or SGLang's (``name``)."""
        user = self.daemon_user
        try:
            unreadable = key_file_unreadable_by(key, user)
        except KeyError:
            return Check(
                name,
                False,
                f"{key}: no user {user} ({SPECD_UNIT} runs as it) to judge the file for",
                f"create the user: `specd install --unit {self.config.sglang.unit}`",
            )
        except OSError as exc:
            return Check(name, False, f"{key}: {exc.strerror}", "")
        if unreadable is not None:
            why, fix = unreadable
            detail = f"{key}: {SPECD_UNIT} runs as user {user}, which {why}"
            return Check(name, False, detail, fix)
        return Check(name, True, f"{key}: readable by user {user} ({SPECD_UNIT})")

    def check_gateway(self) -> list[Check]:
        """With a [gateway]: the admin key file is fit to read, by the daemon's user too, and
        each replica answers its admin API with that key and routes this server."""
        settings = self.config.gateway
        if settings is None:
            return []
        key = settings.api_key_file
        problem = None if key is None else key_file_problem(key, others_ok=True)
        if key is not None and problem is not None:
            # Not asked with it: reading a FIFO or a huge file there would hang or flood.
            return [
                Check(
                    "gateway api key",
                    False,
                    f"{key}: {problem}",
                    "[gateway] api_key_file must be a file holding one of the gateway's "
                    "--control-plane-api-keys; no replica was asked",
                )
            ]
        # The replicas are asked even when the daemon cannot read the key: doctor can.
        checks = [] if key is None else [self.check_key_reader(key)]
        client = GatewayClient.from_settings(settings, self.config.sglang.url)
        try:
            for gateway in client.gateways:
                name = f"gateway {gateway}"
                try:
                    worker = client.find(gateway)
                except GatewayUnavailable as exc:
                    advice = (
                        "check [gateway] api_key_file (smg --control-plane-api-keys)"
                        if exc.kind in ("http_status", "api_key")
                        else "is the gateway running, and is its URL in [gateway] urls?"
                    )
                    checks.append(Check(name, False, str(exc), advice))
                    continue
                if worker is None:
                    checks.append(
                        Check(
                            name,
                            False,
                            f"routes no worker with url {client.worker_url}",
                            "add it there (POST /workers), or set [gateway] worker_url to the "
                            "URL the gateway knows this server by",
                        )
                    )
                elif worker.status != READY:
                    checks.append(
                        Check(
                            name,
                            False,
                            f"worker {worker.worker_id} ({worker.url}) is {worker.status}",
                            "the gateway does not route to it: is SGLang healthy?",
                        )
                    )
                else:
                    checks.append(
                        Check(name, True, f"routes worker {worker.worker_id} ({worker.url}), ready")
                    )
        finally:
            client.close()
        return checks

    def check_polkit(self) -> Check:
        unit = self.config.sglang.unit
        shown = self.runner(
            ["systemctl", "show", "--property=Id", "--value", unit], timeout_s=TIMEOUT_S
        )
        real = shown.stdout.strip() if shown.returncode == 0 else ""
        if real and real != unit:
            # systemd asks polkit about the unit's own name: pkcheck for the alias said yes
            # while every restart specd issued was denied.
            return Check(
                "polkit",
                False,
                f"{unit} is an alias of {real}: systemd asks polkit about {real}, which a "
                f"rule for {unit} does not allow",
                f'set [sglang] unit = "{real}" and run `specd install --unit {real}`',
            )
        try:
            uid = pwd.getpwnam(SPECD_USER).pw_uid
        except KeyError:
            return Check(
                "polkit",
                False,
                f"no user {SPECD_USER}",
                f"create it with `specd install --unit {unit}` (systemd-sysusers)",
            )
        # pkcheck's "pid,start-time,uid" subject asks as user specd, whether or not the
        # daemon runs (only root may ask for another user and pass details).
        subject = f"{os.getpid()},0,{uid}"
        # reset-failed: a rollback clears the start limit a failed change used up.
        cases = (
            (unit, "restart", True),
            (unit, "reset-failed", True),
            (unit, "stop", False),
            (PROBE_OTHER_UNIT, "restart", False),
            (PROBE_OTHER_UNIT, "reset-failed", False),
        )
        wrong = []
        for target, verb, allowed in cases:
            result = self.runner(
                [
                    "pkcheck",
                    "--action-id",
                    POLKIT_ACTION,
                    "--process",
                    subject,
                    "--detail",
                    "unit",
                    target,
                    "--detail",
                    "verb",
                    verb,
                ],
                timeout_s=TIMEOUT_S,
            )
            if result.returncode == 127:
                return Check("polkit", False, "pkcheck not found", "install polkit (pkcheck)")
            if result.returncode not in (0, 1, 2):
                # 0 yes, 1 no, 2 only with a password; anything else is pkcheck failing.
                return Check(
                    "polkit", False, result.summary(), "run doctor as root; is polkit running?"
                )
            if (result.returncode == 0) != allowed:
                wrong.append(
                    f"{verb} {target}: {'allowed' if result.returncode == 0 else 'denied'}"
                )
        if wrong:
            return Check(
                "polkit",
                False,
                f"user {SPECD_USER}: " + "; ".join(wrong),
                f"install the rule scoped to {unit}: `specd install --unit {unit}`",
            )
        return Check(
            "polkit", True, f"user {SPECD_USER} may restart and reset-failed {unit}, nothing else"
        )

    def check_windows(self) -> Check:
        now = datetime.fromtimestamp(self.clock(), tz=timezone.utc)
        try:
            opens = windows.next_open(self.config.windows, now)
        except ValueError as exc:
            return Check("windows", False, str(exc), "fix [[windows]] in the config")
        gap = (opens - now).total_seconds()
        current = windows.current_window(self.config.windows, now)
        state = "open now; " if current is not None else ""
        if current is not None:
            left = (current[1] - now).total_seconds()
            needs = self._restart_needs()[0]
            if left < needs:
                # The daemon says window_ending there: no restart starts in it.
                state = (
                    f"open now but closing in {duration_text(left)}, too soon for one restart "
                    f"({needs:g} s); "
                )
        # On the window's own clock, with its offset: as the operator wrote the cron.
        shown = windows.local_time(self.config.windows, opens).isoformat(timespec="seconds")
        detail = f"{state}next opens {shown} (in {duration_text(gap)})"
        short = self._windows_too_short()
        if short is not None:
            return Check("windows", False, f"{detail}; {short[0]}", short[1])
        if gap > MAX_WINDOW_GAP_S:
            return Check("windows", False, detail, "a window this rare means specd rarely acts")
        return Check("windows", True, detail)

    def _restart_needs(self) -> tuple[float, float, str]:
        """(how long one restart may take, the stop timeout in it, where that came from),
        as the applier counts it."""
        unit = self.config.sglang.unit
        stop_s: float | None = None
        with contextlib.suppress(InstallError):
            shown = self.systemctl_show(unit, "TimeoutStopUSec")
            stop_s = timespan_s(shown.get("TimeoutStopUSec", ""))
        source = f"{unit}'s TimeoutStopSec="
        if stop_s is None:
            stop_s = systemd.DEFAULT_STOP_TIMEOUT_S
            source = "systemd's default stop timeout (the unit's not read)"
        # As the applier counts it: an infinite stop timeout is bounded by its own command's.
        stop_s = min(stop_s, self.config.restart.restart_command_timeout_s)
        return stop_s + self.config.choose.restart_cost_s, stop_s, source

    def _windows_too_short(self) -> tuple[str, str] | None:
        """(what, advice) when a window is shorter than one restart needs: specd starts a
        restart only with that much of the open window left (with the windows it touches or
        overlaps), so in such a window it never changes anything (each decision says
        window_ending), and says so nowhere else."""
        unit = self.config.sglang.unit
        needs, stop_s, source = self._restart_needs()
        cost_s = self.config.choose.restart_cost_s
        now = datetime.fromtimestamp(self.clock(), tz=timezone.utc)
        configured = self.config.windows
        short = [configured[i] for i, _ in windows.too_short(configured, needs, now)]
        if not short:
            return None
        names = ", ".join(f"{w.cron!r} ({w.duration_s:g} s)" for w in short[:3])
        return (
            f"{names} shorter than one restart needs, {needs:g} s ({source} {stop_s:g} s + "
            f"restart_cost_s {cost_s:g} s): specd never restarts there",
            f"make duration_s at least {needs:g} s, or lower {unit}'s TimeoutStopSec=",
        )

    def check_override(self) -> Check:
        """The override line as `specd status` says it (expired, invalid, or unreadable by
        user specd: judged as the daemon reads the file), and a pin in force that this
        server or its unit cannot run as `specd override show` judges it."""
        at = datetime.fromtimestamp(self.clock(), tz=timezone.utc)
        status = read_override_as_daemon(self.config, at)
        if not status.present:
            return Check("override", True, "none")
        line = override_text(override_info(self.config, status, at), self.clock())
        if not status.valid:
            return Check("override", False, line, "fix it or `specd override clear`")
        held = status.override
        if held is not None and held.mode == "pin" and held.active(at):
            info: dict[str, Any] | str = "SGLang did not answer" if self.info is None else self.info
            cannot, _ = pin_unrunnable(self.config, pinned_setting(held), info, self.static_only)
            if cannot is not None:
                return Check(
                    "override",
                    False,
                    f"{line}; BUT {unsupported_pin_text(cannot)}",
                    "clear it (`specd override clear`) or pin a setting listed under choices",
                )
        return Check("override", True, line)

    def check_writable(self) -> Check:
        """specd.service lets specd write, and user specd can write, each directory the
        config has specd write in: elsewhere every change failed ("Read-only file system")
        or specd did not start."""
        props = self.systemctl_show(SPECD_UNIT, "LoadState", *SANDBOX_PROPERTIES)
        notes: tuple[str, ...] = ()
        if props.get("LoadState") == "loaded":
            sandbox = Sandbox.from_properties(props)
        else:
            sandbox = Sandbox.from_unit_text(template("specd.service"))
            notes = (f"{SPECD_UNIT} is not loaded: judged as the shipped unit would run",)
        problems: list[tuple[WrittenDir, str, str]] = []
        for written in written_dirs(self.config):
            why = sandbox.read_only(written.directory)
            fix = fix_for(written, self.config.sglang.unit)
            if why is None:
                why, fix = self._user_cannot_write(written, sandbox, fix)
            if why is not None:
                problems.append((written, why, fix))
        if problems:
            detail = "; ".join(
                f"{w.key} {w.configured}: specd cannot write {w.directory}: {why}"
                for w, why, _ in problems
            )
            return Check("writable", False, detail, problems[0][2], notes=notes)
        shown = ", ".join(f"{w.directory} ({w.keys})" for w in written_dirs(self.config))
        return Check("writable", True, f"{SPECD_UNIT} may write {shown}", notes=notes)

    def _user_cannot_write(
        self, written: WrittenDir, sandbox: Sandbox, fix: str
    ) -> tuple[str | None, str]:
        """Why user specd cannot create files there (owner, group, mode), and the fix."""
        directory = written.directory
        # systemd creates and chowns a StateDirectory= at every start, and specd creates its
        # state directory inside one itself.
        managed = directory in sandbox.state_dirs or (
            written.key == "files.state_dir"
            and any(top in directory.parents for top in sandbox.state_dirs)
        )
        if not directory.exists():
            return (None, fix) if managed else ("it does not exist", fix)
        if directory in sandbox.state_dirs:
            return None, fix
        why = user_cannot_write(Layout(), directory, self.daemon_user)
        if why is None:
            return None, fix
        shown = shlex.quote(str(directory))
        return why, (
            f"`chown {self.daemon_user}:{self.daemon_user} {shown}` if it is specd's alone, "
            f"or keep {written.key} under {STATE_DIRECTORY}"
        )

    def check_service(self) -> Check:
        props = self.systemctl_show(
            SPECD_UNIT,
            "ActiveState",
            "SubState",
            "UnitFileState",
            "WatchdogUSec",
            "WatchdogTimestampMonotonic",
            "TimeoutStopUSec",
        )
        state = f"{props.get('ActiveState', '?')}/{props.get('SubState', '?')}"
        if props.get("ActiveState") != "active":
            return Check(
                "service",
                False,
                f"{SPECD_UNIT} is {state}",
                f"`systemctl start {SPECD_UNIT}`; why it stopped: `journalctl -u {SPECD_UNIT}`",
            )
        period_us = _usec(props.get("WatchdogUSec", ""))
        last_us = props.get("WatchdogTimestampMonotonic", "0")
        if not period_us or not last_us.isdigit() or last_us == "0":
            return Check(
                "service", False, f"{SPECD_UNIT} is {state} without a watchdog", "keep WatchdogSec="
            )
        age_s = self.monotonic() - int(last_us) / 1e6
        enabled = props.get("UnitFileState", "")
        if enabled != "enabled":
            # Running now, but not started at boot: the next reboot ends the tuning unseen.
            return Check(
                "service",
                False,
                f"{SPECD_UNIT} is {state} but {enabled or 'not enabled'}: it does not start at "
                "boot",
                f"`systemctl enable {SPECD_UNIT}`",
            )
        if age_s > period_us / 1e6:
            return Check(
                "service",
                False,
                f"last watchdog ping {age_s:.0f} s ago (limit {period_us / 1e6:g} s)",
                f"specd is stuck: `journalctl -u {SPECD_UNIT}`",
            )
        short = self._stop_timeout_short(props.get("TimeoutStopUSec", ""))
        if short is not None:
            return Check("service", False, *short)
        return Check("service", True, f"{SPECD_UNIT} {state}, watchdog fed {age_s:.0f} s ago")

    def _stop_timeout_short(self, shown: str) -> tuple[str, str] | None:
        """(why, advice) where specd.service's TimeoutStopSec= is shorter than a whole
        restart sequence with this config's timeouts: a stop finishes the one in flight,
        and a `systemctl daemon-reload` meanwhile (which forgets the extensions specd's
        beats make) kills specd mid-restart once the stop is older than it."""
        timeout_us = _usec(shown)
        if not timeout_us:  # infinity, or not said
            return None
        restart = self.config.restart
        worst_s = restart.quiet_deadline_s + out_of_service_bound_s(restart, self.config.gateway)
        needed_s = math.ceil(worst_s + STOP_EXIT_MARGIN_S)
        if timeout_us / 1e6 >= needed_s:
            return None
        return (
            f"{SPECD_UNIT}'s TimeoutStopSec= ({shown}) is shorter than a whole restart "
            f"sequence with these [restart] timeouts ({duration_text(worst_s)}): a "
            "`systemctl daemon-reload` while specd stops mid-restart kills it",
            f"`systemctl edit {SPECD_UNIT}`: [Service] TimeoutStopSec={needed_s}s",
        )

    def check_own_metrics(self) -> Check:
        host = self.config.report.metrics_listen_address
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # noqa: S104
        url = (
            f"http://{'[' + host + ']' if ':' in host else host}:{self.config.report.metrics_port}"
        )
        try:
            response = httpx.get(
                url + "/metrics",
                timeout=TIMEOUT_S,
                trust_env=False,
                verify=context_for(url, trust_env=False),
            )
        except httpx.HTTPError as exc:
            return Check("specd-metrics", False, f"{url}/metrics: {exc}", "is specd running?")
        if response.status_code != 200 or "specd_" not in response.text:
            return Check(
                "specd-metrics",
                False,
                f"{url}/metrics: HTTP {response.status_code}, no specd_ metrics",
                "another process holds metrics_port?",
            )
        return self._scraped_from_elsewhere(f"{url}/metrics answers")

    def _scraped_from_elsewhere(self, answers: str) -> Check:
        """specd listening beyond loopback is for a Prometheus elsewhere, which specd.service
        (IPAddressAllow=localhost, IPAddressDeny=any) lets in only from what it allows: from
        loopback only, every scrape was dropped and SpecdDown fired however the address was
        set."""
        host = self.config.report.metrics_listen_address
        try:
            if ipaddress.ip_address(host).is_loopback:
                return Check("specd-metrics", True, answers)
        except ValueError:
            if host == "localhost":
                return Check("specd-metrics", True, answers)
        try:
            props = self.systemctl_show(SPECD_UNIT, "IPAddressAllow", "IPAddressDeny")
        except InstallError as exc:
            return Check("specd-metrics", True, answers, notes=(f"{SPECD_UNIT}: {exc}",))
        try:
            denied = [
                ipaddress.ip_network(p, strict=False)
                for p in props.get("IPAddressDeny", "").split()
            ]
            allowed = [
                ipaddress.ip_network(p, strict=False)
                for p in props.get("IPAddressAllow", "").split()
            ]
        except ValueError:
            return Check("specd-metrics", True, answers)
        if not any(net.prefixlen == 0 for net in denied):
            return Check("specd-metrics", True, answers)
        beyond = [str(net) for net in allowed if not net.is_loopback]
        listening = f"specd listens on {host}:{self.config.report.metrics_port}"
        if not beyond:
            return Check(
                "specd-metrics",
                False,
                f"{answers} here, but {listening} and {SPECD_UNIT} lets only loopback connect "
                "(IPAddressAllow=localhost, IPAddressDeny=any): a Prometheus elsewhere cannot "
                "scrape it",
                f"`systemctl edit {SPECD_UNIT}`: [Service] IPAddressAllow=PROMETHEUS_ADDRESS "
                "(a drop-in: `specd install` keeps it)",
            )
        return Check(
            "specd-metrics",
            True,
            answers,
            notes=(
                f"{listening}; {SPECD_UNIT} lets connect loopback and {', '.join(beyond)} only "
                "(IPAddressAllow=): Prometheus must scrape from one of them",
            ),
        )

    def check_fleet(self) -> Check:
        """Every etcd endpoint answers, and the group's slots can be read."""
        settings = self.config.fleet
        if settings is None:
            return Check("fleet", True, "no [fleet]: this server restarts on its own")
        answered, failed = [], []
        for endpoint in settings.etcd_endpoints:
            client = EtcdClient([endpoint], settings.etcd_timeout_s)
            try:
                answered.append(f"{endpoint} (etcd {client.version()})")
            except FleetUnavailable as exc:
                failed.append(str(exc))
            finally:
                client.close()
        fleet = Fleet.from_settings(settings, self.config.sglang.unit)
        clash = None
        try:
            busy = fleet.busy()
            clash = fleet.clash(busy)
        except FleetUnavailable as exc:
            failed.append(f"reading the slots of group {settings.group}: {exc}")
            busy = Busy([], [])
        finally:
            fleet.close()
        if failed:
            return Check(
                "fleet",
                False,
                "; ".join(failed),
                "start etcd or fix [fleet] etcd_endpoints: without an answer specd never "
                "restarts SGLang (reason fleet_unavailable)",
            )
        if clash is not None:
            return Check(
                "fleet",
                False,
                clash,
                "set [fleet] holder_name to a name no other specd of the group uses (or omit "
                "it for the host name and unit): until then this specd restarts nothing "
                "(reason fleet_unavailable)",
            )
        held = (
            ", ".join(
                [f"slot {h.slot} held by {h.name}" for h in busy.holders]
                + [out_text(o, o.name in {h.name for h in busy.holders}) for o in busy.out]
            )
            or "all free"
        )
        return Check(
            "fleet",
            True,
            f"{', '.join(answered)} answer; group {settings.group}, {settings.slots} "
            f"slot(s): {held}; this specd is {fleet.holder!r}",
        )

    def run(self) -> list[Check]:
        checks = [self.check_config()]
        if not checks[0].ok and not self.config_loaded:
            skipped = [
                Check(
                    name,
                    False,
                    f"skipped: it needs {what} from the config, which is invalid",
                    skipped=True,
                )
                for name, what in NEEDS_CONFIG
            ]
            # specd.service is named by specd, not by the config: still worth knowing.
            return [*checks, *skipped, self._guarded(self.check_service)]
        other_unit = self.check_installed_unit()
        if other_unit is not None:
            checks.append(other_unit)
        # Not run for a unit specd was not installed for: each would advise an install
        # for it, which refuses.
        elsewhere = self.installed_unit not in (None, self.config.sglang.unit)

        def skip(name: str) -> Check:
            return Check(
                name,
                False,
                f"skipped: specd is not installed for [sglang] unit {self.config.sglang.unit}",
                skipped=True,
            )

        # The unit first (listed later): its command line says what a metrics 404 needs.
        dropin, words, defaults = (skip("drop-in"), None, {}) if elsewhere else self.check_dropin()
        checks += self.check_server_key()
        with SGLangClient(
            self.config.sglang.url,
            timeout_s=TIMEOUT_S,
            api_key=self.config.sglang.server_api_key_file,
        ) as client:
            checks.append(self.check_sglang(client))
            checks += self.check_metrics(client)
        checks += self.check_gateway()
        checks.append(self.check_choices())
        checks.append(dropin)
        if elsewhere:
            checks += [skip("command"), skip("setting"), skip("polkit")]
        else:
            checks += [
                self.check_command(words, defaults),
                self.check_setting(defaults),
                self._guarded(self.check_polkit),
            ]
        for check in (
            self.check_windows,
            self.check_override,
            self.check_fleet,
            self.check_writable,
            self.check_service,
            self.check_own_metrics,
        ):
            checks.append(self._guarded(check))
        return checks

    @staticmethod
    def _guarded(check: Callable[[], Check]) -> Check:
        try:
            return check()
        except (InstallError, OSError, ValueError) as exc:
            return Check(check.__name__.removeprefix("check_"), False, str(exc), "")


def _env_file_advice(exc: FileReadError, unit: str) -> str:
    """What to do about an env file `Doctor.check_setting` could not read (``exc``)."""
    if exc.os_errno in (errno.EACCES, errno.EPERM) and os.geteuid() != 0:
        return "run `specd doctor` as root, as it reads what specd's user reads"
    if exc.os_errno is not None:
        return "check the file and its disk: specd backs it up before each change"
    return (
        f"make it a regular file of at most {size_text(MAX_ENV_BYTES)}, not a link (specd "
        f"reads it so before each change), or remove it: `specd install --unit {unit}` "
        "writes one"
    )


def _reports_effective_capacity(info: dict[str, Any]) -> bool:
    states = info.get("internal_states")
    return (
        isinstance(states, list)
        and bool(states)
        and all(
            isinstance(st, dict) and "effective_max_running_requests_per_dp" in st for st in states
        )
    )


def _options(words: list[str]) -> list[str]:
    """The options part of a command line, ``--name=value`` as ``--name value`` (argparse
    reads both the same; install writes the setting's options apart)."""
    for i, word in enumerate(words):
        if word.startswith("--"):
            out: list[str] = []
            for option in words[i:]:
                name, eq, value = option.partition("=")
                out += [name, value] if option.startswith("--") and eq else [option]
            return out
    return []


def _usec(text: str) -> int:
    """systemctl prints WatchdogUSec as '1min', '2s', '500ms' or a number of microseconds."""
    if text.isdigit():
        return int(text)
    units = {"us": 1, "ms": 1000, "s": 1_000_000, "min": 60_000_000, "h": 3_600_000_000}
    total = 0
    for part in text.split():
        number = part.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = part[len(number) :]
        if not number or unit not in units:
            return 0
        total += int(float(number) * units[unit])
    return total


def render(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for check in checks:
        mark = "-" if check.skipped else "✓" if check.ok else "✗"
        lines.append(f"{mark} {check.name:<{width}}  {check.detail}")
        if not check.ok and check.advice:
            lines.append(f"  {'':<{width}}  → {check.advice}")
        lines += [f"  {'':<{width}}  · {note}" for note in check.notes]
    return "\n".join(lines) + "\n"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Check every part of specd's setup; ✓/✗ per check with advice. Exit 0 only if all pass."
    )
    parser.add_argument(
        "--config", type=Path, default=None, help=f"config file (default {DEFAULT_CONFIG_PATH})"
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def run(args: argparse.Namespace) -> int:
    checks = Doctor(args.config, SubprocessRunner()).run()
    ok = all(c.ok for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        sys.stdout.write(render(checks))
    return 0 if ok else 1
