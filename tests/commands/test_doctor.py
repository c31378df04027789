"""specd doctor's judgements that need no systemd: durations as systemctl prints them, the
command-line comparison, env file vs running steps, windows against an injected clock."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
from factories import (
    FAST_TWIN_VERSION_ARGS,
    SMG_ADMIN_KEY,
    LoopbackHTTP,
    QuietHandler,
    SmgGateway,
    seed_table,
)
from prometheus_client.parser import text_string_to_metric_families
from twin_thread import INSTANT, TwinThread
from version_twins import VersionTwins

import specd.commands.doctor as doctor_module
import specd.io.config as config_module
import specd.io.override as override_io
from specd import cli
from specd.commands.doctor import (
    NEEDED_METRICS,
    Check,
    Doctor,
    _usec,
    render,
    restart_policy_note,
)
from specd.core.adaptive import AdaptiveModel
from specd.core.model import adaptive_slots
from specd.core.perftable import PerfRow, PerfTable
from specd.core.setting import parse
from specd.install.execline import expand_argv
from specd.install.layout import Layout
from specd.install.manifest import new_manifest, save_manifest
from specd.install.unit import UnitView
from specd.io.apply import static_only_wiring
from specd.io.config import load_config
from specd.io.promtext import sample_names
from specd.io.runner import RunResult, SubprocessRunner
from specd.io.sglang import SGLangClient
from specd.io.tables import write_table
from specd.twin.process import TwinProcess, free_port

WORDS = [
    "/opt/sglang/bin/python",
    "-m",
    "sglang.launch_server",
    "--enable-metrics",
    "$SPECD_SPECULATIVE_ARGS",
]


def args_of(steps: int) -> str:
    return (
        f"--speculative-algorithm NEXTN --speculative-num-steps {steps} "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}"
    )


DEFAULTS = {"SPECD_SPECULATIVE_ARGS": args_of(3)}
ENV_4 = f"SPECD_SPECULATIVE_ARGS={args_of(4)}\nSPECULATIVE_NUM_STEPS=4\n"
ENV_OFF = "SPECD_SPECULATIVE_ARGS=\n"
ENV_ADAPTIVE = (
    "SPECD_SPECULATIVE_ARGS=--speculative-algorithm NEXTN --speculative-num-steps 4 "
    "--speculative-eagle-topk 1 --speculative-num-draft-tokens 5 --speculative-adaptive "
    "--speculative-adaptive-config /var/lib/specd/adaptive-34.json\n"
)
INFO_3 = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3}
INFO_4 = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 4}
INFO_OFF = {"speculative_algorithm": None, "speculative_num_steps": None}
INFO_ADAPTIVE = {
    **INFO_4,
    "speculative_adaptive": True,
    "speculative_adaptive_config": "/var/lib/specd/adaptive-34.json",
}
# 2026-12-02 11:00 UTC, a Wednesday.
NOW = datetime(2026, 12, 2, 11, 0, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize(
    ("text", "usec"),
    [
        ("1min", 60_000_000),
        ("2s", 2_000_000),
        ("1min 30s", 90_000_000),
        ("500ms", 500_000),
        ("250000", 250_000),
        ("0", 0),
        ("infinity", 0),
        ("", 0),
    ],
)
def test_usec(text: str, usec: int) -> None:
    assert _usec(text) == usec


def doctor(tmp_path: Path, extra: str = "", daemon_user: str = "specd", sglang: str = "") -> Doctor:
    config = tmp_path / "specd.toml"
    config.write_text(
        f'[sglang]\nenv_file = "{tmp_path}/sglang.env"\n{sglang}'
        f'[files]\noverride_file = "{tmp_path}/override.toml"\n' + extra
    )
    found = Doctor(
        config,
        SubprocessRunner(),
        clock=lambda: NOW,
        daemon_user=daemon_user,
        layout=Layout(tmp_path / "root"),
    )
    found.config = load_config(config)
    return found


@pytest.mark.parametrize(
    ("env_file", "running", "ok", "detail"),
    [
        (None, f"/usr/bin/x --enable-metrics {args_of(3)}", True, "runs the drop-in's"),
        (ENV_4, f"/x --enable-metrics {args_of(4)}", True, "runs the drop-in's"),
        (ENV_4, f"/x --enable-metrics {args_of(3)}", False, "differs"),
        (ENV_OFF, "/x --enable-metrics", True, "runs the drop-in's"),
        (ENV_OFF, f"/x --enable-metrics {args_of(3)}", False, "differs"),
        (None, f"/x {args_of(3)}", False, "differs"),
    ],
)
def test_command_check(
    tmp_path: Path, env_file: str | None, running: str, ok: bool, detail: str
) -> None:
    found = doctor(tmp_path)
    if env_file is not None:
        (tmp_path / "sglang.env").write_text(env_file)
    found.info = {"launch_command": running}
    check = found.check_command(WORDS, DEFAULTS)
    assert check.ok is ok
    assert detail in check.detail
    assert ok or "systemctl restart sglang.service" in check.advice


@pytest.mark.parametrize(
    ("env_file", "defaults", "info", "ok", "detail"),
    [
        (None, DEFAULTS, INFO_3, True, "runs 3 steps, as the drop-in's default"),
        (ENV_4, DEFAULTS, INFO_4, True, "SGLang runs 4 steps, as"),
        (ENV_4, DEFAULTS, INFO_3, False, "says 4 steps, SGLang runs 3 steps"),
        (ENV_OFF, DEFAULTS, INFO_OFF, True, "SGLang runs no speculation, as"),
        (ENV_OFF, DEFAULTS, INFO_3, False, "says no speculation, SGLang runs 3 steps"),
        (ENV_ADAPTIVE, DEFAULTS, INFO_ADAPTIVE, True, "runs adaptive (adaptive-34.json)"),
        (ENV_ADAPTIVE, DEFAULTS, INFO_4, False, "SGLang runs 4 steps"),
        (ENV_4, DEFAULTS, INFO_ADAPTIVE, False, "says 4 steps, SGLang runs adaptive"),
        # The step-variable form an older specd wrote still names a step count.
        ("SPECULATIVE_NUM_STEPS=4\nSPECULATIVE_NUM_DRAFT_TOKENS=5\n", DEFAULTS, INFO_4, True, "4"),
        (None, {}, INFO_3, False, "no setting to compare"),
        (ENV_4, DEFAULTS, None, False, "unreadable (expected 4 steps)"),
    ],
)
def test_setting_check(
    tmp_path: Path,
    env_file: str | None,
    defaults: dict[str, str],
    info: dict[str, object] | None,
    ok: bool,
    detail: str,
) -> None:
    found = doctor(tmp_path)
    if env_file is not None:
        (tmp_path / "sglang.env").write_text(env_file)
    found.info = info
    check = found.check_setting(defaults)
    assert (check.ok, detail in check.detail) == (ok, True), check


def utc(year: int, month: int, day: int, hour: int) -> float:
    return datetime(year, month, day, hour, tzinfo=timezone.utc).timestamp()


@pytest.mark.parametrize(
    ("cron", "zone", "now", "ok", "detail"),
    [
        ("0 3 * * mon-sun", "UTC", NOW, True, "next opens 2026-12-03T03:00:00+00:00 (in 16.0 h)"),
        # Within two hours in minutes, as `specd status` and every message write a span.
        (
            "0 12 * * mon-sun",
            "UTC",
            NOW,
            True,
            "next opens 2026-12-02T12:00:00+00:00 (in 60.0 min)",
        ),
        ("30 10 * * wed", "UTC", NOW, True, "open now; next opens 2026-12-09T10:30:00+00:00"),
        # Its last two minutes hold no restart (systemd's default 90 s stop + 100 s start):
        # the daemon says window_ending there, doctor said "open now".
        (
            "2 10 * * wed",
            "UTC",
            NOW,
            True,
            "open now but closing in 2.0 min, too soon for one restart (190 s); next opens "
            "2026-12-09T10:02:00+00:00",
        ),
        ("0 3 1 mar *", "UTC", NOW, False, "next opens 2027-03-01T03:00:00+00:00"),
        # On the window's own clock, with its offset: 03:00 CET is 02:00Z.
        (
            "0 3 * * mon-sun",
            "Europe/Berlin",
            NOW,
            True,
            "next opens 2026-12-03T03:00:00+01:00 (in 15.0 h)",
        ),
        (
            "0 3 * * mon-sun",
            "Europe/Berlin",
            utc(2026, 7, 1, 12),
            True,
            "next opens 2026-07-02T03:00:00+02:00 (in 13.0 h)",
        ),
        # Spring forward: 02:30 does not exist that night; it opens at the jump, 03:00 CEST.
        (
            "30 2 * * mon-sun",
            "Europe/Berlin",
            utc(2026, 3, 28, 12),
            True,
            "next opens 2026-03-29T03:00:00+02:00 (in 13.0 h)",
        ),
        # Fall back: 02:30 happens twice; it opens at the first, still summer time.
        (
            "30 2 * * mon-sun",
            "Europe/Berlin",
            utc(2026, 10, 24, 12),
            True,
            "next opens 2026-10-25T02:30:00+02:00 (in 12.5 h)",
        ),
    ],
)
def test_windows_check(
    tmp_path: Path, cron: str, zone: str, now: float, ok: bool, detail: str
) -> None:
    found = doctor(
        tmp_path, f'[[windows]]\ncron = "{cron}"\nduration_s = 3600.0\ntimezone = "{zone}"\n'
    )
    found.clock = lambda: now
    check = found.check_windows()
    assert check.ok is ok
    assert detail in check.detail


@pytest.mark.parametrize(
    ("duration_s", "restart_cost_s", "ok"),
    [
        # No systemd here to read sglang.service: its stop timeout is systemd's default 90 s.
        (3600.0, 100.0, True),
        (190.0, 100.0, True),  # exactly one restart's worth
        (189.0, 100.0, False),
        (60.0, 100.0, False),
        (60.0, 1.0, False),
    ],
)
def test_a_window_too_short_for_one_restart_is_said(
    tmp_path: Path, duration_s: float, restart_cost_s: float, ok: bool
) -> None:
    # specd starts a restart only with its stop timeout + restart_cost_s of the window left:
    # in a shorter one it never changes anything, and every decision says window_ending.
    found = doctor(
        tmp_path,
        f"[choose]\nrestart_cost_s = {restart_cost_s}\n"
        f'[[windows]]\ncron = "0 3 * * mon-sun"\nduration_s = {duration_s}\n',
    )
    check = found.check_windows()
    assert check.ok is ok, check
    if not ok:
        needs = 90 + restart_cost_s
        assert "shorter than one restart needs" in check.detail
        assert "systemd's default stop timeout (the unit's not read) 90 s" in check.detail
        assert "specd never restarts there" in check.detail
        assert f"make duration_s at least {needs:g} s" in check.advice


@pytest.mark.parametrize(
    "windows",
    [
        # Back to back windows of a minute are open all the time: any restart fits.
        [("* * * * *", 60.0)],
        # A minute that runs into an hour: one open period of 3660 s.
        [("0 1 * * *", 60.0), ("1 1 * * *", 3600.0)],
    ],
)
def test_a_short_window_in_a_longer_open_period_holds_a_restart(
    tmp_path: Path, windows: list[tuple[str, float]]
) -> None:
    # specd restarts when the open period has one restart's time left, whichever windows
    # make it up (a minute apart from the hour, the first is too short: tests/core).
    found = doctor(
        tmp_path,
        "".join(f'[[windows]]\ncron = "{cron}"\nduration_s = {d}\n' for cron, d in windows),
    )
    check = found.check_windows()
    assert check.ok, check


def test_override_check(tmp_path: Path) -> None:
    found = doctor(tmp_path)
    assert found.check_override() == Check("override", True, "none")
    (tmp_path / "override.toml").write_text('mode = "sideways"\n')
    (tmp_path / "override.toml").chmod(0o644)
    check = found.check_override()
    assert not check.ok
    assert "sideways" in check.detail


STEP_VARIABLES_EXEC = (
    "/opt/sglang/bin/python -m sglang.launch_server --speculative-num-steps "
    "${SPECULATIVE_NUM_STEPS} --speculative-num-draft-tokens ${SPECULATIVE_NUM_DRAFT_TOKENS}"
)


@pytest.mark.parametrize(
    ("override", "static_only", "ok", "detail"),
    [
        # NOW is 2026-12-02T11:00:00Z.
        (
            'mode = "pin"\nsteps = 4\nexpires_at = 2026-12-02T09:00:00Z\nreason = "night"\n',
            False,
            True,
            "pin 4 steps EXPIRED 2.0 h ago (2026-12-02T09:00:00+00:00): night; specd decides "
            "by itself: delete the file or `specd override clear`",
        ),
        (
            'mode = "freeze"\nexpires_at = 2026-12-02T10:00:00Z\nreason = "incident"\n',
            False,
            True,
            "freeze EXPIRED 60.0 min ago (2026-12-02T10:00:00+00:00): incident; specd decides "
            "by itself: delete the file or `specd override clear`",
        ),
        (
            'mode = "pin"\nsteps = 3\nexpires_at = 2026-12-03T03:00:00Z\nreason = "eval"\n',
            True,
            True,
            "pin 3 steps until 2026-12-03T03:00:00+00:00 (in 16.0 h): eval",
        ),
        # A drop-in of the step-variable form takes static K only: specd holds this pin
        # `unsupported`, restarting nothing and making no automatic change until it expires.
        (
            'mode = "pin"\nsetting = "off"\nexpires_at = 2026-12-03T03:00:00Z\nreason = "r"\n',
            True,
            False,
            "pin off until 2026-12-03T03:00:00+00:00 (in 16.0 h): r; BUT this server cannot "
            "run it: sglang.service's ExecStart= reads ${SPECULATIVE_NUM_STEPS}, not "
            "$SPECD_SPECULATIVE_ARGS: static step counts only",
        ),
        (
            'mode = "pin"\nsetting = "off"\nexpires_at = 2026-12-03T03:00:00Z\nreason = "r"\n',
            False,
            True,
            "pin off until 2026-12-03T03:00:00+00:00 (in 16.0 h): r",
        ),
    ],
)
def test_override_check_says_what_status_and_override_show_say(
    tmp_path: Path, override: str, static_only: bool, ok: bool, detail: str
) -> None:
    """Doctor said `pin (night)` for a pin that had expired, or that the unit cannot run."""
    found = doctor(tmp_path)
    (tmp_path / "override.toml").write_text(override)
    (tmp_path / "override.toml").chmod(0o644)
    found.static_only = (
        static_only_wiring("sglang.service", [STEP_VARIABLES_EXEC]) if static_only else None
    )
    check = found.check_override()
    assert (check.ok, check.detail[: len(detail)]) == (ok, detail), check
    assert ok or check.advice.startswith("clear it (`specd override clear`)")


@pytest.mark.skipif(os.geteuid() != 0, reason="judging another user's access needs root")
def test_override_check_calls_a_file_the_daemon_cannot_read_invalid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A freeze written with root's umask 077: doctor (as root) said `freeze (r)`; specd,
    as its own user, cannot read it and ignores it."""
    monkeypatch.setattr(override_io, "DAEMON_USER", "nobody")
    top = Path(tempfile.mkdtemp(dir="/tmp", prefix="specd-doctor-"))
    try:
        top.chmod(0o755)
        found = doctor(top)
        override = top / "override.toml"
        override.write_text('mode = "freeze"\nexpires_at = 2999-01-01T00:00:00Z\nreason = "r"\n')
        override.chmod(0o600)
        check = found.check_override()
        assert not check.ok
        assert check.detail.startswith(
            "INVALID, ignored (specd keeps its last good state): user nobody cannot read "
            f"{override} (0600 root:root)"
        ), check.detail
        override.chmod(0o644)
        assert found.check_override().ok
    finally:
        shutil.rmtree(top)


def test_render_gives_advice_only_for_failures() -> None:
    text = render([Check("config", True, "valid", "unused"), Check("polkit", False, "no", "fix")])
    assert text == "✓ config  valid\n✗ polkit  no\n          → fix\n"


def test_command_check_expands_the_line_as_systemd_does(tmp_path: Path) -> None:
    """`$$`, `%%` (already `%` in the loaded words), `${VAR}` from Environment= and from an
    EnvironmentFile=, and a split `$VAR`: a correct install is not called different, and no
    restart is advised."""
    found = doctor(tmp_path)
    (tmp_path / "sglang.env").write_text(ENV_4)
    unit_env = tmp_path / "unit.env"
    unit_env.write_text("PORT=31000\nEXTRA='--tp-size 4'\n")
    found.unit_env_files = [unit_env]
    words = [
        *WORDS[:3],
        "--port",
        "${PORT}",
        "--chat-template",
        "cost: $$5 100%",
        "--served-model-name",
        "${MODEL}",
        "$EXTRA",
        *WORDS[3:],
    ]
    found.info = {
        "launch_command": "/usr/bin/python3 -m sglang.launch_server --port 31000 "
        "--chat-template 'cost: $5 100%' --served-model-name qwen --tp-size 4 --enable-metrics "
        f"{args_of(4)}"
    }
    check = found.check_command(words, {**DEFAULTS, "MODEL": "qwen", "PORT": "1"})
    assert check == Check("command", True, "SGLang runs the drop-in's command line")
    found.info = {"launch_command": found.info["launch_command"].replace("31000", "30000")}
    changed = found.check_command(words, {**DEFAULTS, "MODEL": "qwen"})
    assert not changed.ok
    assert "30000 31000" in changed.detail
    assert "systemctl restart sglang.service" in changed.advice


def test_config_check_without_a_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = tmp_path / "specd.toml"
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", absent)
    monkeypatch.setattr(doctor_module, "DEFAULT_CONFIG_PATH", absent)
    check = Doctor(None, SubprocessRunner()).check_config()
    assert check.ok
    assert check.detail.startswith(f"no {absent}: specd uses its built-in defaults")
    assert "valid" not in check.detail
    named = Doctor(absent, SubprocessRunner()).check_config()
    assert not named.ok  # a file named on the command line must exist
    absent.write_text("[choose]\nmin_steps = 2\n")
    assert Doctor(None, SubprocessRunner()).check_config().detail == f"{absent} is valid"


def test_an_invalid_config_skips_the_checks_that_read_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The URL is right, a typo makes the config invalid: the checks must not fall back
    # to the built-in defaults (SGLang at :30000, /var/lib/specd, specd's port 9464).
    config = tmp_path / "specd.toml"
    config.write_text(f'[sglang]\nurl = "http://127.0.0.1:{free_port()}"\nunti = "x.service"\n')
    assert cli.main(["doctor", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    for default in ("127.0.0.1:30000", "sglang.service", "/var/lib/specd", "9464"):
        assert default not in out, out
    lines = {line.split()[1]: line for line in out.splitlines() if not line.startswith(" ")}
    assert lines["config"].startswith("✗ config ")
    assert "sglang.unti: unknown key" in lines["config"]
    for name in ("sglang", "metrics", "choices", "drop-in", "polkit", "specd-metrics"):
        assert lines[name].startswith(f"- {name} "), out
        assert "skipped: it needs [" in lines[name]
        assert "from the config, which is invalid" in lines[name]
    assert "service" in lines  # named by specd, not by the config: still checked
    assert cli.main(["doctor", "--config", str(config), "--json"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert (checks["sglang"]["ok"], checks["sglang"]["skipped"]) == (False, True)
    assert checks["config"]["skipped"] is False


@pytest.mark.parametrize("check", ["sglang", "metrics"])
def test_advice_names_the_url_key_as_the_config_spells_it(tmp_path: Path, check: str) -> None:
    found = doctor(tmp_path)
    with SGLangClient(f"http://127.0.0.1:{free_port()}", timeout_s=5) as client:
        got = found.check_sglang(client) if check == "sglang" else found.check_metrics(client)[0]
    assert not got.ok
    # `sglang_url` is the old flat key, which check-config refuses.
    assert "[sglang] url" in got.advice
    assert "sglang_url" not in got.advice
    if check == "sglang":
        # The URL install read from the unit's --port is wrong for a container that
        # publishes its port under another number: the advice says where to look.
        assert "publishes its port under another number" in got.advice


# What specd cannot see, per SGLang version: the start of each note, in the table's order.
NO_SERVER_INFO = "no /server_info (only /get_server_info answers)"
NO_CAPACITY = "no effective capacity (internal_states[].effective_max_running_requests_per_dp) in"
OLD_ACCEPT_RATE = "sglang:spec_accept_rate is accept length / draft tokens"
NO_STEPS_OLD = "no sglang:spec_num_steps gauge on this page (SGLang < 0.5.13): the live setting"
NO_VERIFY_OLD = "no sglang:spec_verify_calls_total on this page (SGLang < 0.5.13): the accept"
NO_SLOTS = "no per-batch-size slots in --speculative-adaptive-config (SGLang < 0.5.13)"
NO_SLOT_ZERO = "no step 0 (no drafting) in an adaptive slot (SGLang < 0.5.14)"
NO_PHASES_OLD = "no sglang:startup_time_seconds{phase} on this page (SGLang < 0.5.18)"
NO_READY = "no /ready (SGLang < 0.5.20)"


@pytest.mark.parametrize(
    ("version", "extra", "answers", "shown", "notes"),
    [
        (
            "0.5.4",
            [],
            "/get_server_info",
            "SGLang 0.5.4",
            [
                NO_SERVER_INFO,
                NO_CAPACITY + " /get_server_info",
                OLD_ACCEPT_RATE,
                NO_STEPS_OLD,
                NO_VERIFY_OLD,
                NO_SLOTS,
                NO_SLOT_ZERO,
                NO_PHASES_OLD,
                NO_READY,
            ],
        ),
        (
            "0.5.11",
            [],
            "/server_info",
            "SGLang 0.5.11",
            [NO_STEPS_OLD, NO_VERIFY_OLD, NO_SLOTS, NO_SLOT_ZERO, NO_PHASES_OLD, NO_READY],
        ),
        ("0.5.13", [], "/server_info", "SGLang 0.5.13", [NO_SLOT_ZERO, NO_PHASES_OLD, NO_READY]),
        ("0.5.23", [], "/server_info", "SGLang 0.5.23", []),
        # No warm-up, no request yet: the page lacks the counter although 0.5.23 has it.
        (
            "0.5.23",
            ["--skip-server-warmup"],
            "/server_info",
            "SGLang 0.5.23",
            [
                "no sglang:spec_verify_calls_total on this page (no request finished since the "
                "start, or speculation is off): the accept length comes from the gauge only"
            ],
        ),
        # No version in /server_info: only what the page and the answers show.
        (
            "0.5.11",
            ["--server-info-missing", "version"],
            "/server_info",
            "SGLang unknown",
            [
                "no sglang:spec_num_steps gauge on this page (not emitted by this server)",
                "no sglang:spec_verify_calls_total on this page (no request finished",
                "no sglang:startup_time_seconds{phase} on this page (not emitted by this server)",
                "no version in /server_info: what it lacks beyond the above cannot be told",
            ],
        ),
    ],
)
def test_version_check_names_what_specd_cannot_see(
    tmp_path: Path,
    version_twins: VersionTwins,
    version: str,
    extra: list[str],
    answers: str,
    shown: str,
    notes: list[str],
) -> None:
    found = doctor(tmp_path)
    twin = version_twins(version, *extra)
    with SGLangClient(twin.url, timeout_s=5) as client:
        sglang = found.check_sglang(client)
        metrics, check = found.check_metrics(client)
    assert sglang == Check("sglang", True, f"{twin.url} answers {answers}")
    assert metrics.ok
    assert check.ok  # an older SGLang is a limit, not a fault
    assert check.detail.startswith(shown + "; offers num_running_reqs"), check.detail
    assert len(check.notes) == len(notes), check.notes
    for note, start in zip(check.notes, notes, strict=True):
        assert note.startswith(start), (note, start)
    assert (f"{len(notes)} limit(s) for specd, below" in check.detail) is bool(notes)
    rendered = render([check])
    assert all(f"· {note}\n" in rendered for note in check.notes)


@pytest.mark.parametrize(
    ("version", "note"),
    [
        ("0.6.0", "SGLang 0.6.0 is newer than any specd was checked against (up to 0.5.23)"),
        ("1.0.0rc1", "SGLang 1.0.0 is newer than any specd was checked against"),
        ("0.4.9", "SGLang 0.4.9 is older than any specd was checked against (from 0.5.4)"),
        ("0.5.23", None),
        ("0.5.4", None),
    ],
)
def test_version_check_says_a_version_outside_those_specd_knows(
    tmp_path: Path, version: str, note: str | None
) -> None:
    """An SGLang newer than any specd was checked against was taken to have every feature,
    an older one to lack them all, and doctor said nothing of it."""
    found = doctor(tmp_path)
    found.info = {"version": version}
    names = set(NEEDED_METRICS)
    check = found.check_version(names, [])
    assert check.ok
    said = [n for n in check.notes if "than any specd was checked against" in n]
    if note is None:
        assert said == [], check.notes
    else:
        assert len(said) == 1, check.notes
        assert said[0].startswith(note), said


def test_command_check_reads_name_equals_value_as_name_value(tmp_path: Path) -> None:
    """An install rewrites --speculative-num-steps=3 into the variable's words
    (--speculative-num-steps 3): SGLang running the unit's own line still runs the drop-in's."""
    found = doctor(tmp_path)
    found.info = {
        "launch_command": "/x --enable-metrics --speculative-algorithm=NEXTN "
        "--speculative-num-steps=3 --speculative-eagle-topk 1 --speculative-num-draft-tokens=4"
    }
    assert found.check_command(WORDS, DEFAULTS).ok
    found.info = {"launch_command": found.info["launch_command"].replace("steps=3", "steps=4")}
    assert not found.check_command(WORDS, DEFAULTS).ok


def test_gateway_checks_each_replica_answers_and_routes_this_server(tmp_path: Path) -> None:
    key = tmp_path / "gateway.key"
    key.write_text(SMG_ADMIN_KEY + "\n")
    dead = f"http://127.0.0.1:{free_port()}"
    with TwinProcess(FAST_TWIN_VERSION_ARGS) as twin, TwinProcess(FAST_TWIN_VERSION_ARGS) as other:
        twin.wait_healthy()
        other.wait_healthy()
        with (
            SmgGateway([twin.url], admin_key=SMG_ADMIN_KEY) as routes,
            SmgGateway([other.url], admin_key=SMG_ADMIN_KEY) as elsewhere,
        ):
            urls = [routes.url, elsewhere.url, dead]
            found = doctor(
                tmp_path,
                f'[gateway]\nurls = {json.dumps(urls)}\nworker_url = "{twin.url}"\n'
                f'api_key_file = "{key}"\nrequest_timeout_s = 2.0\n',
                # Here the daemon's user is ours: the key check passes, the replicas are asked.
                daemon_user=pwd.getpwuid(os.geteuid()).pw_name,
            )
            key_check, *checks = found.check_gateway()
            # The wrong key: every replica that answers says so.
            key.write_text("wrong\n")
            refused = found.check_gateway()[1]
    assert key_check.ok, key_check
    assert [c.name for c in checks] == [f"gateway {u}" for u in urls]
    assert [c.ok for c in checks] == [True, False, False]
    assert "ready" in checks[0].detail
    assert f"routes no worker with url {twin.url}" in checks[1].detail
    assert "ConnectError" in checks[2].detail
    assert "is the gateway running" in checks[2].advice
    assert not refused.ok
    assert "HTTP 401" in refused.detail
    assert "api_key_file" in refused.advice
    # Without a [gateway], no check at all.
    assert doctor(tmp_path).check_gateway() == []


@pytest.mark.parametrize(
    ("version", "kinds", "ok", "detail", "notes"),
    [
        (
            "0.5.23", '["static"]', True, "specd may choose static",
            ["off: not offered: not in [choose] kinds (static)", "static: offered (steps 1-6)",
             "adaptive: not offered: not in [choose] kinds (static)"],
        ),
        (
            "0.5.23", '["off", "static", "adaptive"]', True,
            "specd may choose off, static, adaptive",
            ["off: offered (no speculation)", "static: offered (steps 1-6)",
             "adaptive: offered (adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0 adaptive:1,3 "
             "adaptive:2,4 adaptive:3,4 adaptive:1,2,3)"],
        ),
        (
            "0.5.13", '["static", "adaptive"]', True, "specd may choose static, adaptive",
            ["off: not offered: not in [choose] kinds (static, adaptive)",
             "static: offered (steps 1-6)",
             "adaptive: offered (adaptive:1,3 adaptive:2,4 adaptive:3,4 adaptive:1,2,3)",
             "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0: not offered: step 0 in a slot "
             "need SGLang >= 0.5.14; the server runs 0.5.13"],
        ),
        (
            "0.5.11", '["static", "adaptive"]', False,
            "[choose] kinds has adaptive, which this server cannot run: needs SGLang >= 0.5.13 "
            "(per-batch slots); the server runs 0.5.11",
            ["off: not offered: not in [choose] kinds (static, adaptive)",
             "static: offered (steps 1-6)",
             "adaptive: not offered: needs SGLang >= 0.5.13 (per-batch slots); the server runs "
             "0.5.11"],
        ),
    ],
)  # fmt: skip
def test_choices_check_says_what_specd_may_choose_on_this_server(
    tmp_path: Path,
    version_twins: VersionTwins,
    version: str,
    kinds: str,
    ok: bool,
    detail: str,
    notes: list[str],
) -> None:
    # The model policy: the one that chooses among kinds (without a calibration it starts
    # from the bands).
    found = doctor(tmp_path, f'[choose]\npolicy = "model"\nkinds = {kinds}\n')
    twin = version_twins(version)
    with SGLangClient(twin.url, timeout_s=5) as client:
        assert found.check_sglang(client).ok
    check = found.check_choices()
    assert (check.ok, check.detail) == (ok, detail)
    assert list(check.notes) == notes
    assert ("take adaptive out of [choose] kinds" in check.advice) == (not ok)


def test_a_default_kind_that_cannot_be_chosen_is_a_note_not_a_failure(
    tmp_path: Path, version_twins: VersionTwins
) -> None:
    found = doctor(tmp_path, '[choose]\npolicy = "model"\n')  # kinds left at every kind
    twin = version_twins("0.5.11")
    with SGLangClient(twin.url, timeout_s=5) as client:
        assert found.check_sglang(client).ok
    check = found.check_choices()
    assert (check.ok, check.detail) == (True, "specd may choose off, static")
    assert "adaptive: not offered: needs SGLang >= 0.5.13 (per-batch slots); the server runs "\
        "0.5.11" in check.notes  # fmt: skip
    # A drop-in of the step-variable form (as check_dropin reads it) takes static K only.
    found.static_only = "sglang.service's ExecStart= reads ${SPECULATIVE_NUM_STEPS}"
    check = found.check_choices()
    assert (check.ok, check.detail) == (True, "specd may choose static")
    assert f"off: not offered: {found.static_only}" in check.notes


@pytest.mark.parametrize(
    ("choose", "detail"),
    [
        # No calibration, so the bands policy, which picks static K.
        ("", "specd may choose static"),
        # The shipped config lists every kind: under the bands policy, notes, no failure.
        ('[choose]\nkinds = ["off", "static", "adaptive"]\n', "specd may choose static"),
        ('[choose]\nkinds = ["static"]\n', "specd may choose static"),
    ],
)  # fmt: skip
def test_choices_check_under_the_bands_policy_offers_static_only(
    tmp_path: Path, version_twins: VersionTwins, choose: str, detail: str
) -> None:
    """The bands policy never reads the offer: doctor must not say it may turn speculation
    off or run an adaptive set on a server that could run them."""
    found = doctor(tmp_path, choose)
    twin = version_twins("0.5.23")
    with SGLangClient(twin.url, timeout_s=5) as client:
        assert found.check_sglang(client).ok
    check = found.check_choices()
    assert (check.ok, check.detail) == (True, detail)
    if "adaptive" in choose or "kinds" not in choose:
        why = (
            'the bands policy picks a static step count only (policy "model", which a '
            "calibration_file selects, chooses among every kind)"
        )
        assert list(check.notes) == [
            f"off: not offered: {why}",
            "static: offered (steps 1-6)",
            f"adaptive: not offered: {why}",
        ]


def test_choices_check_says_how_a_swept_set_is_predicted(
    tmp_path: Path, version_twins: VersionTwins
) -> None:
    # The seed's rows, and adaptive:3,4 swept at 90 % of what its candidates' rows say.
    table = seed_table()
    set_34 = parse("adaptive:3,4")
    composed = AdaptiveModel.of(adaptive_slots(set_34), table)
    # Its 8-request row written with SGLang's slots spelled out: the same set, one config.
    swept = [
        PerfRow(4, float(c), composed.throughput(c) * 0.9, None, None, text)
        for c, text in ((1, "adaptive:3,4"), (8, "adaptive:3,4/1=3,4"))
    ]
    # A set not among [choose] adaptive_candidate_sets, swept too.
    swept.append(PerfRow(5, 1.0, 100.0, None, None, "adaptive:2,5"))
    write_table(tmp_path / "cal.csv", PerfTable([*table.rows, *swept], source="swept"))
    found = doctor(
        tmp_path,
        f'[choose]\nkinds = ["static", "adaptive"]\ncalibration_file = "{tmp_path}/cal.csv"\n',
    )
    twin = version_twins("0.5.23")
    with SGLangClient(twin.url, timeout_s=5) as client:
        assert found.check_sglang(client).ok
    check = found.check_choices()
    assert check.ok
    said = "adaptive:3,4: swept: predicted at 0.900 × its candidates' rows until it has served here"
    assert said in check.notes
    assert (
        "adaptive:2,5: swept, but not offered: specd does not choose it (not in [choose] "
        "adaptive_candidate_sets, or not offered on this server)"
    ) in check.notes
    # Only the sets swept are said so.
    assert sum(1 for note in check.notes if "swept" in note) == 2


def test_choices_check_without_server_info_offers_no_adaptive(tmp_path: Path) -> None:
    found = doctor(tmp_path, '[choose]\npolicy = "model"\nkinds = ["off", "static", "adaptive"]\n')
    check = found.check_choices()  # SGLang never answered
    assert not check.ok
    assert check.detail.endswith("adaptive, which this server cannot run: the server's "
                                 "/server_info has not been read")  # fmt: skip
    assert "off: offered (no speculation)" in check.notes


# Key files doctor refuses without reading them (both keys: the gateway's and SGLang's).
UNFIT_KEY_FILES = pytest.mark.parametrize(
    ("make", "detail"),
    [
        (lambda p: None, "not a regular file (No such file or directory)"),
        (os.mkfifo, "not a regular file"),
        (lambda p: p.mkdir(), "not a regular file"),
        (lambda p: p.write_bytes(b"k" * 1_000_000), "1000000 bytes"),
        (lambda p: p.write_bytes(b""), "0 bytes"),
    ],
    ids=["missing", "fifo", "directory", "huge", "empty"],
)


@UNFIT_KEY_FILES
def test_gateway_check_refuses_an_unfit_key_file_without_reading_it(
    tmp_path: Path, make: Callable[[Path], object], detail: str
) -> None:
    key = tmp_path / "gateway.key"
    make(key)
    # No gateway listens there: had doctor asked a replica, the detail would say so.
    dead = f"http://127.0.0.1:{free_port()}"
    found = doctor(
        tmp_path,
        f'[gateway]\nurls = ["{dead}"]\napi_key_file = "{key}"\nrequest_timeout_s = 1.0\n',
    )
    checks = found.check_gateway()
    assert [(c.name, c.ok) for c in checks] == [("gateway api key", False)]
    assert checks[0].detail.startswith(f"{key}: {detail}")
    assert "--control-plane-api-keys" in checks[0].advice


# A real unprivileged user stands in for specd (no specd user on a build machine).
READER = "nobody"


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory any user may enter: pytest's tmp_path is under a 0700 one."""
    with tempfile.TemporaryDirectory() as name:
        os.chmod(name, 0o755)
        yield Path(name)


def reads_as(user: str, path: Path) -> bool:
    """Whether a process of ``user`` (its groups too) can read ``path``: the kernel's say."""
    entry = pwd.getpwnam(user)
    result = subprocess.run(
        ["cat", str(path)],
        user=entry.pw_uid,
        group=entry.pw_gid,
        extra_groups=os.getgrouplist(user, entry.pw_gid),
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files owned by another user")
@pytest.mark.parametrize(
    ("owner", "group", "mode", "fix"),
    [
        ("root", "root", 0o640, "chgrp nogroup {key} && chmod 0640 {key}"),
        ("root", "root", 0o600, "chgrp nogroup {key} && chmod 0640 {key}"),
        ("root", "nogroup", 0o600, "chmod g+r {key}"),
        ("nobody", "root", 0o200, "chmod u+r {key}"),
        ("root", "nogroup", 0o640, None),
        ("nobody", "root", 0o400, None),
        ("root", "root", 0o644, None),
    ],
)
def test_gateway_key_check_reads_the_file_as_the_daemons_user(
    tmp_path: Path, open_dir: Path, owner: str, group: str, mode: int, fix: str | None
) -> None:
    """doctor runs as root, which reads any file; specd runs as its own user. A 0640
    root:root key passed doctor and the daemon then never drained (nor restarted)."""
    key = open_dir / "gateway.key"
    key.write_text(SMG_ADMIN_KEY + "\n")
    os.chown(key, pwd.getpwnam(owner).pw_uid, grp.getgrnam(group).gr_gid)
    os.chmod(key, mode)
    dead = f"http://127.0.0.1:{free_port()}"
    found = doctor(
        tmp_path,
        f'[gateway]\nurls = ["{dead}"]\napi_key_file = "{key}"\nrequest_timeout_s = 1.0\n',
        daemon_user=READER,
    )
    checks = found.check_gateway()
    # The replica is asked all the same: doctor can read the key.
    assert [c.name for c in checks] == ["gateway api key", f"gateway {dead}"]
    check = checks[0]
    assert check.ok is (fix is None)
    assert reads_as(READER, key) is check.ok
    if fix is None:
        assert check.detail == f"{key}: readable by user {READER} (specd.service)"
        return
    assert check.detail == (
        f"{key}: specd.service runs as user {READER}, which cannot read it "
        f"({mode:04o} {owner}:{group})"
    )
    assert check.advice == f"run `{fix.format(key=key)}`"
    # The advice, run as given, is the whole fix.
    subprocess.run(["sh", "-c", fix.format(key=key)], check=True)
    assert found.check_gateway()[0].ok
    assert reads_as(READER, key)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files owned by another user")
def test_gateway_key_check_follows_the_way_to_the_file(tmp_path: Path, open_dir: Path) -> None:
    """A key the daemon's user could read in a directory it cannot enter (or behind a link
    in one) is unreadable all the same."""
    closed = open_dir / "closed"
    closed.mkdir(mode=0o700)
    key = closed / "gateway.key"
    key.write_text(SMG_ADMIN_KEY + "\n")
    os.chmod(key, 0o644)
    link = open_dir / "gateway.key"
    link.symlink_to(key)
    for path in (key, link):
        found = doctor(
            tmp_path, f'[gateway]\nurls = ["http://127.0.0.1:1"]\napi_key_file = "{path}"\n',
            daemon_user=READER,
        )  # fmt: skip
        check = found.check_key_reader(path)
        assert not check.ok
        assert not reads_as(READER, path)
        assert check.detail == (
            f"{path}: specd.service runs as user {READER}, which cannot enter {closed} "
            "(0700 root:root)"
        )
        assert "/etc/specd/gateway.key (0600 nobody:nogroup)" in check.advice
    os.chmod(closed, 0o755)
    assert found.check_key_reader(link).ok
    assert reads_as(READER, link)


# --- SGLang started with --api-key ([sglang] server_api_key_file) ---------------------------

SGLANG_KEY = "sk-doctor-test-77a1"


def sglang_key_doctor(tmp_path: Path, url: str, key: Path | None, user: str = "specd") -> Doctor:
    line = "" if key is None else f'server_api_key_file = "{key}"\n'
    return doctor(tmp_path, sglang=f'url = "{url}"\n{line}', daemon_user=user)


@pytest.mark.parametrize("key", [None, "wrong", "right"])
def test_an_sglang_refusing_specd_is_advised_the_key_setting(
    tmp_path: Path, key: str | None
) -> None:
    """Before: "GET /server_info: 401" with the advice "is sglang.service running?"."""
    path = None if key is None else tmp_path / "sglang.key"
    if path is not None:
        path.write_text((SGLANG_KEY if key == "right" else "old-" + SGLANG_KEY) + "\n")
    with TwinThread([*INSTANT, "--enable-metrics", "--api-key", SGLANG_KEY]) as twin:
        twin.wait_healthy()
        found = sglang_key_doctor(tmp_path, twin.url, path)
        with SGLangClient(
            twin.url, timeout_s=5, api_key=found.config.sglang.server_api_key_file
        ) as client:
            check = found.check_sglang(client)
    setting = found.check_setting({"SPECD_SPECULATIVE_ARGS": ""})
    assert SGLANG_KEY not in check.detail + check.advice + setting.detail + setting.advice
    if key == "right":
        assert check.ok, check
        assert setting.ok, setting
        return
    assert not check.ok
    assert "401" in check.detail
    assert "running?" not in check.advice
    assert "is SGLang up?" not in setting.advice
    assert setting.advice == check.advice
    if key is None:
        assert "sglang.service runs with --api-key" in check.advice
        assert 'set server_api_key_file = "FILE" under [sglang]' in check.advice
    else:
        assert f"the key in {path} is not SGLang's --api-key" in check.detail
        assert f"in {path} (one line), or point [sglang] server_api_key_file" in check.advice


@UNFIT_KEY_FILES
def test_sglang_key_check_refuses_an_unfit_key_file_as_the_gateways(
    tmp_path: Path, make: Callable[[Path], object], detail: str
) -> None:
    key = tmp_path / "sglang.key"
    make(key)
    found = sglang_key_doctor(tmp_path, f"http://127.0.0.1:{free_port()}", key)
    checks = found.check_server_key()
    assert [(c.name, c.ok) for c in checks] == [("sglang api key", False)]
    assert checks[0].detail.startswith(f"{key}: {detail}")
    assert "[sglang] server_api_key_file" in checks[0].advice


def test_sglang_key_check_is_absent_without_the_setting(tmp_path: Path) -> None:
    assert sglang_key_doctor(tmp_path, "http://127.0.0.1:1", None).check_server_key() == []


def test_sglang_key_check_follows_a_link_to_a_regular_file(tmp_path: Path, open_dir: Path) -> None:
    key = open_dir / "real.key"
    key.write_text(SGLANG_KEY + "\n")
    os.chmod(key, 0o644)
    link = open_dir / "sglang.key"
    link.symlink_to(key)
    found = sglang_key_doctor(tmp_path, "http://127.0.0.1:1", link, user=READER)
    assert [(c.name, c.ok) for c in found.check_server_key()] == [("sglang api key", True)]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files owned by another user")
def test_sglang_key_check_reads_the_file_as_the_daemons_user(
    tmp_path: Path, open_dir: Path
) -> None:
    key = open_dir / "sglang.key"
    key.write_text(SGLANG_KEY + "\n")
    os.chmod(key, 0o640)  # root:root: doctor (root) reads it, specd's user does not
    found = sglang_key_doctor(tmp_path, "http://127.0.0.1:1", key, user=READER)
    [check] = found.check_server_key()
    assert (check.name, check.ok) == ("sglang api key", False)
    assert check.detail == (
        f"{key}: specd.service runs as user {READER}, which cannot read it (0640 root:root)"
    )
    assert check.advice == f"run `chgrp nogroup {key} && chmod 0640 {key}`"
    subprocess.run(["sh", "-c", f"chgrp nogroup {key} && chmod 0640 {key}"], check=True)
    assert found.check_server_key()[0].ok
    assert reads_as(READER, key)


def test_metrics_off_with_the_flag_in_the_unit_already_advises_a_restart_now(
    tmp_path: Path,
) -> None:
    """After `specd install --add-enable-metrics` the unit's command line has the flag but
    SGLang, not restarted since, serves no /metrics: specd decides no_data on every tick and
    never restarts it. Neither install again nor "the next window" is the way out."""
    found = doctor(tmp_path)
    with TwinProcess(FAST_TWIN_VERSION_ARGS) as twin:
        twin.wait_healthy()
        with SGLangClient(twin.url, timeout_s=5) as client:
            without = found.check_metrics(client)[0]
            # What check_dropin reads of the unit once install added the flag.
            found.unit_args = [arg.text for arg in expand_argv(WORDS, DEFAULTS)]
            added = found.check_metrics(client)[0]
    assert not without.ok
    assert "404" in without.detail
    assert without.advice == (
        "add --enable-metrics to sglang.service's command line "
        "(`specd install --unit sglang.service --add-enable-metrics`) and restart it"
    )
    assert not added.ok
    assert added.advice == (
        "sglang.service's command line has --enable-metrics, SGLang started without it: "
        "`systemctl restart sglang.service` now (specd cannot: it needs /metrics to act)"
    )
    found.info = {"launch_command": f"/x {args_of(3)}"}
    command = found.check_command(WORDS, DEFAULTS)
    assert not command.ok
    assert command.detail == "SGLang's running command differs from the drop-in (--enable-metrics)"
    assert command.advice == (
        "restart it to pick up the drop-in: `systemctl restart sglang.service` now (specd "
        "cannot: it needs the /metrics that --enable-metrics turns on)"
    )


def test_a_config_for_another_unit_than_installed_says_so_once(tmp_path: Path) -> None:
    """[sglang] unit names a unit specd was not installed for: the checks of the unit's
    wiring would each advise `specd install --unit` for it, which refuses ("installed for
    sglang.service"). One check says what differs and what to fix; those are skipped."""
    save_manifest(Layout(tmp_path / "root"), new_manifest("sglang.service", ""))
    dead = f"http://127.0.0.1:{free_port()}"
    found = doctor(tmp_path, sglang=f'unit = "dbus.service"\nurl = "{dead}"\n')
    checks = {c.name: c for c in found.run()}
    unit = checks["unit"]
    assert not unit.ok
    assert unit.detail == (
        "[sglang] unit is dbus.service, but specd was installed for sglang.service "
        "(/etc/specd/install-manifest.json)"
    )
    assert unit.advice == (
        f'set unit = "sglang.service" under [sglang] in {tmp_path / "specd.toml"}; to move '
        "specd to dbus.service: `specd uninstall`, then `specd install --unit dbus.service`"
    )
    for name in ("drop-in", "command", "setting", "polkit"):
        assert checks[name].skipped, checks[name]
        assert checks[name].detail == (
            "skipped: specd is not installed for [sglang] unit dbus.service"
        )
    advising = [c.name for c in checks.values() if "install --unit dbus.service" in c.advice]
    assert advising == ["unit"]
    # The unit it was installed for: no such line (and the checks run).
    found = doctor(tmp_path, sglang=f'unit = "sglang.service"\nurl = "{dead}"\n')
    names = [c.name for c in found.run()]
    assert "unit" not in names
    assert found.installed_unit == "sglang.service"
    assert not any(c.skipped for c in found.run())


@pytest.mark.parametrize(
    ("restart", "restart_sec_s", "poll_s", "noted"),
    [
        pytest.param("on-failure", 30.0, 2.0, False, id="the example unit's 30 s"),
        pytest.param("on-failure", 0.1, 2.0, True, id="systemd's default 100 ms"),
        pytest.param("always", 3.9, 2.0, True, id="within two looks"),
        pytest.param("always", 4.0, 2.0, False, id="two looks"),
        pytest.param("always", 10.0, 10.0, True, id="slower looks need more"),
        pytest.param("no", 0.1, 2.0, False, id="no Restart="),
        pytest.param("", 0.1, 2.0, False, id="Restart= not shown"),
        pytest.param("on-failure", None, 2.0, False, id="RestartSec= unreadable"),
    ],
)
def test_a_unit_that_restarts_before_specd_can_look_is_noted(
    restart: str, restart_sec_s: float | None, poll_s: float, noted: bool
) -> None:
    """systemd resets ExecMainStatus= at the next start: a start it could not set up then
    reads as SGLang's death (rolled back, frozen) instead of being aborted."""
    view = UnitView(
        "sglang.service", "loaded", (), {}, "", (), "", (), False, restart, restart_sec_s
    )
    note = restart_policy_note(view, poll_s)
    assert (note is not None) is noted
    if note is not None:
        assert note.startswith(f"{view.unit} starts again {restart_sec_s:g} s after it fails ")
        assert f"(Restart={restart}): sooner than specd looks" in note
        assert note.endswith("RestartSec=30s (as systemd/examples/sglang.service) leaves time")


def _families_parse(page: Path) -> bool:
    try:
        list(text_string_to_metric_families(page.read_text()))
    except ValueError:
        return False
    return True


FIXTURE_PAGES = sorted((Path(__file__).parent.parent / "fixtures" / "metrics").glob("*.prom"))
# The pages prometheus_client reads whole; on the others it raises, sample_names does not.
PARSED_PAGES = [p for p in FIXTURE_PAGES if _families_parse(p)]


@pytest.mark.parametrize("page", PARSED_PAGES, ids=lambda p: p.name)
def test_sample_names_are_prometheus_clients_on_every_page_it_parses(page: Path) -> None:
    text = page.read_text()
    expected = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert sample_names(text) == expected


@pytest.mark.parametrize(
    "extra",
    [
        # A family specd does not read: prometheus_client's parser raised on the whole page.
        "other_metric this is garbage\n",
        # A rank label isdigit() takes and int() refuses.
        'sglang:num_running_reqs{tp_rank="²"} 1\n',
        'sglang:num_running_reqs{tp_rank="' + "1" * 5000 + '"} 1\n',
    ],
    ids=["garbage-elsewhere", "superscript-rank", "5000-digit-rank"],
)
def test_the_metrics_check_reports_a_hostile_page_never_raises(tmp_path: Path, extra: str) -> None:
    page = Path(__file__).parent.parent / "fixtures" / "metrics" / "sglang-0.5.23-loaded.prom"
    text = page.read_text() + extra

    class Page(QuietHandler):
        def do_GET(self) -> None:
            self.send_body(200, text.encode(), "text/plain; version=0.0.4")

    found = doctor(tmp_path)
    with LoopbackHTTP(Page) as server, SGLangClient(server.url, timeout_s=5) as client:
        metrics, version = found.check_metrics(client)
    assert metrics.ok, metrics
    assert metrics.detail.startswith("/metrics parses (")
    assert version.name == "version"


class SpecdShown:
    """systemd answering `systemctl show specd.service` for the service check: running, fed,
    enabled, with ``timeout`` as TimeoutStopUSec (as systemctl prints it)."""

    def __init__(self, timeout: str) -> None:
        self.timeout = timeout

    def __call__(self, argv: list[str], *, timeout_s: float) -> RunResult:
        lines = [
            "ActiveState=active",
            "SubState=running",
            "UnitFileState=enabled",
            "WatchdogUSec=1min",
            "WatchdogTimestampMonotonic=1000000",
            f"TimeoutStopUSec={self.timeout}",
        ]
        return RunResult(tuple(argv), 0, "\n".join(lines) + "\n", "", False, 0.0)


@pytest.mark.parametrize(
    ("restart", "timeout", "advice"),
    [
        ("", "1h 20min", None),  # the shipped unit at the default timeouts
        ("", "infinity", None),
        ("", "1min 30s", "TimeoutStopSec=4632s"),  # the unit before this session
        ("[restart]\nstartup_timeout_s = 3600\n", "1h 20min", "TimeoutStopSec=13632s"),
    ],
)
def test_a_stop_timeout_shorter_than_a_whole_restart_sequence_fails_the_service_check(
    tmp_path: Path, restart: str, timeout: str, advice: str | None
) -> None:
    """A stop finishes the restart in flight, and a daemon-reload meanwhile forgets the
    extensions specd's beats make: a TimeoutStopSec= shorter than the sequence (longer
    [restart] timeouts than the defaults, or an old unit) gets specd SIGKILLed mid-restart."""
    found = doctor(tmp_path, extra=restart)
    found.runner = SpecdShown(timeout)
    found.monotonic = lambda: 2.0
    check = found.check_service()
    if advice is None:
        assert check.ok, check
        return
    assert not check.ok
    assert "is shorter than a whole restart sequence with these [restart] timeouts" in check.detail
    assert f"TimeoutStopSec= ({timeout})" in check.detail
    assert check.advice is not None
    assert check.advice.endswith(advice)
