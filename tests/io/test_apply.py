"""apply with real parts: a real env file, real twin processes restarted like a unit, real HTTP.

``TwinUnit`` stands in for systemd only: on ``systemctl --no-ask-password restart UNIT`` it
stops the running twin and starts a new one with the steps from the env file, as systemd does
with ``EnvironmentFile=-`` and the drop-in's ``Environment=`` defaults. Everything else (the
SGLang client, HTTP, files, processes, signals) is the real thing.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
import structlog.testing
from factories import (
    SMG_ADMIN_KEY,
    Killed,
    QueuedRemovalGateway,
    QuickStopSmg,
    SmgGateway,
    StreamingLoad,
    mounted_tmpfs,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from twin_zygote import ForkedTwin, ForkedUnit

from specd.core.setting import SpecSetting, adaptive_config_name
from specd.core.setting import off as setting_off
from specd.core.setting import parse as setting_parse
from specd.core.setting import static as setting_static
from specd.core.settings import TABLE_OF_KEY, Settings
from specd.io import files
from specd.io.apply import (
    ENV_ARGS,
    ENV_DRAFT_TOKENS,
    ENV_STEPS,
    IDLE_READS,
    MAX_ATTEMPTS,
    PHASES,
    START_LIMIT_MARGIN_S,
    Applier,
    ApplyOutcome,
    Journal,
    JournalError,
    encode_env,
    env_file_unread,
    parse_env,
    read_env_steps,
    render_env,
    render_setting_env,
    reset_failed_argv,
    restart_argv,
    static_only_wiring,
    write_adaptive_config,
)
from specd.io.config import Config
from specd.io.gateway import GatewayClient, Worker
from specd.io.runner import RunResult, SubprocessRunner
from specd.io.sglang import SGLangClient
from specd.io.state import StateStore
from specd.io.systemd import parse_show
from specd.io.tls import verifying_context
from specd.twin.process import TwinProcess, free_port
from specd.twin.standin import make_standin

UNIT = "sglang.service"
# The drop-in's Environment= line: what the unit runs when the env file is absent.
DROPIN_DEFAULT_STEPS = 3
# An operator-written file, with a comment and odd spacing, to prove restores are exact.
ORIGINAL_ENV = b"# hand-written\nSPECULATIVE_NUM_STEPS=3\nSPECULATIVE_NUM_DRAFT_TOKENS=4\n\n"
TWIN_TIMING = [
    "--load-time-s",
    "0.1",
    "--warmup-s",
    "0.05",
    "--report-interval-s",
    "0.1",
    # SGLang's /health_generate answers after a second; this twin's loads in a tenth, and
    # no test here is about that second (tests/twin/ are): each restart waited it.
    "--health-first-look-s",
    "0.1",
]
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 1.0


# -- the stand-in for systemd -------------------------------------------------------------


class TwinUnit(ForkedUnit):
    """The product's twin unit (specd/twin/unit.py), with the test's timings and probes; its
    twins forked from the twin zygote (tests/twin_zygote.py): a start costs a few hundredths
    of a second of CPU, not the ~0.3 s of a fresh interpreter's imports."""

    def __init__(self, env_file: Path, extra_args: Callable[[int], list[str]] | None = None):
        more = extra_args or (lambda steps: [])
        super().__init__(
            UNIT,
            env_file,
            port=free_port(),
            extra_args=lambda steps: [*TWIN_TIMING, *more(steps)],
            stop_timeout_s=STOP_TIMEOUT_S,
        )

    @property
    def restarts(self) -> list[int]:
        return self.restarted_to

    def start_healthy(self) -> None:
        self.start().wait_healthy(START_TIMEOUT_S)

    def running_steps(self) -> int | None:
        """What the live process runs, read straight off /server_info or /metrics."""
        try:
            tls = verifying_context()
            info = httpx.get(f"{self.url}/server_info", timeout=5, verify=tls).json()
            if "speculative_num_steps" in info:
                return int(info["speculative_num_steps"])
            metrics = httpx.get(f"{self.url}/metrics", timeout=5, verify=tls).text
        except httpx.HTTPError:
            return None
        for line in metrics.splitlines():
            if line.startswith("sglang:spec_num_steps{"):
                return int(float(line.rsplit(" ", 1)[1]))
        return None

    def close(self) -> None:
        self.stop()


class Recorder:
    """The daemon's persist callback: keeps what a state.json would hold, in a real file."""

    def __init__(self, path: Path, kill_at: int | None = None, store_first: bool = False):
        self.path = path
        self.calls: list[dict[str, Any] | None] = []
        self.kill_at = kill_at
        self.store_first = store_first

    def __call__(self, journal: dict[str, Any] | None) -> None:
        index = len(self.calls)
        if index == self.kill_at and not self.store_first:
            raise Killed(f"before persisting #{index}")
        self.calls.append(journal)
        # Through JSON, as the daemon's state file does.
        files.write_atomic(self.path, json.dumps(journal).encode(), mode=0o600)
        if index == self.kill_at:
            raise Killed(f"after persisting #{index}")

    def stored(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        data: dict[str, Any] | None = json.loads(self.path.read_text())
        return data

    def phases(self) -> list[str]:
        return [c["phase"] for c in self.calls if c is not None]


PACING_KEYS = ("quiet_poll_interval_s", "health_poll_interval_s", "verify_attempts")


def settings_for(env_file: Path, **overrides: Any) -> Settings:
    """The config's tables for a fast twin; ``overrides`` by key name, each into its table."""
    tables: dict[str, dict[str, Any]] = {
        "sglang": {"unit": UNIT, "env_file": env_file},
        "choose": {"min_steps": 1, "max_steps": 6},
        "restart": {
            "quiet_concurrency_max": 2,
            "quiet_deadline_s": 5.0,
            "startup_timeout_s": 10.0,
            "health_probe_timeout_s": 25.0,
            "restart_command_timeout_s": 30.0,
        },
    }
    for key, value in overrides.items():
        if key not in PACING_KEYS:
            tables.setdefault(TABLE_OF_KEY[key], {})[key] = value
    return Settings.model_validate(tables)


def make_applier(
    settings: Settings,
    client: SGLangClient,
    runner: Callable[..., RunResult],
    persist: Callable[[dict[str, Any] | None], None],
    stop: threading.Event,
    **overrides: Any,
) -> Applier:
    pacing = {"quiet_poll_interval_s": 0.05, "health_poll_interval_s": 0.05, "verify_attempts": 3}
    pacing.update({k: v for k, v in overrides.items() if k in PACING_KEYS})
    return Applier(
        settings.sglang,
        settings.choose,
        settings.restart,
        client,
        runner,
        persist,
        stop,
        gateway=settings.gateway,
        **pacing,
    )


@pytest.fixture
def make_unit(tmp_path: Path) -> Iterator[Callable[..., TwinUnit]]:
    units: list[TwinUnit] = []

    def make(
        env: bytes | None = ORIGINAL_ENV,
        extra_args: Callable[[int], list[str]] | None = None,
        start: bool = True,
    ) -> TwinUnit:
        env_file = tmp_path / "sglang.env"
        if env is not None:
            env_file.write_bytes(env)
        unit = TwinUnit(env_file, extra_args)
        units.append(unit)
        if start:
            unit.start_healthy()
        return unit

    yield make
    for unit in units:
        unit.close()


def applier_for(
    unit: TwinUnit,
    persist: Callable[[dict[str, Any] | None], None],
    runner: Callable[..., RunResult] | None = None,
    stop: threading.Event | None = None,
    **overrides: Any,
) -> Applier:
    return make_applier(
        settings_for(unit.env_file, **overrides),
        SGLangClient(unit.url, timeout_s=3.0),
        runner or unit,
        persist,
        stop or threading.Event(),
        **overrides,
    )


def always_open() -> bool:
    return True


# -- the unit's wiring --------------------------------------------------------------------


def _exec(argv: str) -> str:
    return f"{{ path=/usr/bin/python3 ; argv[]={argv} ; ignore_errors=no ; pid=0 }}"


@pytest.mark.parametrize(
    ("exec_start", "variable"),
    [
        # (ExecStart= values as `systemctl show` prints them, the step variable named or None)
        ([_exec("/usr/bin/python3 -m sglang.launch_server --x 1 $SPECD_SPECULATIVE_ARGS")], None),
        ([_exec("/usr/bin/python3 -m sglang.launch_server --speculative-num-steps "
                "${SPECULATIVE_NUM_STEPS} --speculative-num-draft-tokens "
                "${SPECULATIVE_NUM_DRAFT_TOKENS}")], "SPECULATIVE_NUM_STEPS"),
        ([_exec("/x --speculative-num-draft-tokens=${SPECULATIVE_NUM_DRAFT_TOKENS}")],
         "SPECULATIVE_NUM_DRAFT_TOKENS"),
        ([_exec("/x --speculative-num-steps $SPECULATIVE_NUM_STEPS")], "SPECULATIVE_NUM_STEPS"),
        # Both: the setting's variable carries off and adaptive sets.
        ([_exec("/x $SPECD_SPECULATIVE_ARGS ${SPECULATIVE_NUM_STEPS}")], None),
        # A second command (ExecStartPre= is another property; two ExecStart= lines a oneshot).
        ([_exec("/bin/true"), _exec("/x $SPECD_SPECULATIVE_ARGS")], None),
        # Neither, or a look-alike: nothing to limit (verification catches what never arrives).
        ([_exec("/x --speculative-num-steps 3")], None),
        ([_exec("/x ${SPECD_SPECULATIVE_ARGS}")], None),
        ([_exec("/x $SPECULATIVE_NUM_STEPSX")], None),
        ([], None),
        (["garbage"], None),
    ],
)  # fmt: skip
def test_a_unit_reading_the_step_variables_takes_static_step_counts_only(
    exec_start: list[str], variable: str | None
) -> None:
    why = static_only_wiring(UNIT, exec_start)
    if variable is None:
        assert why is None
    else:
        assert why == (
            f"{UNIT}'s ExecStart= reads ${{{variable}}}, not $SPECD_SPECULATIVE_ARGS: static "
            "step counts only (`specd install` rewrites it)"
        )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=300), max_size=4))
def test_any_execstart_text_gives_a_reason_or_none_and_never_raises(lines: list[str]) -> None:
    # Whatever systemctl (or something in its place) prints: one line naming the unit, or
    # None; never an exception out of the daemon's start or reload.
    why = static_only_wiring(UNIT, lines)
    assert why is None or (why.startswith(f"{UNIT}'s ExecStart= reads ${{") and "\n" not in why)
    # With the setting's variable as a word of any line, always None.
    assert static_only_wiring(UNIT, [*lines, "/x $SPECD_SPECULATIVE_ARGS"]) is None


def test_off_on_a_unit_of_the_step_variables_is_refused_before_any_restart(
    tmp_path: Path, make_unit: Callable[..., TwinUnit]
) -> None:
    # The stand-in systemctl of the fault tests: a real process, a unit of the old form.
    (tmp_path / "standin").mkdir()
    standin = make_standin(tmp_path / "standin", free_port())
    standin.env_file.write_bytes(ORIGINAL_ENV)
    runner = SubprocessRunner({"PATH": f"{standin.bin_dir}:{os.environ['PATH']}"})
    recorder = Recorder(tmp_path / "journal.json")
    applier = make_applier(
        settings_for(standin.env_file),
        SGLangClient(standin.url(), timeout_s=1.0),
        runner,
        recorder,
        threading.Event(),
    )
    assert applier.read_wiring() is not None
    for target in (setting_off(), setting_parse("adaptive:1,3")):
        got = applier.apply_setting(target, setting_static(3), window_open=always_open)
        assert got.result == "aborted", got
        assert "reads ${SPECULATIVE_NUM_STEPS}, not $SPECD_SPECULATIVE_ARGS" in got.message
    assert standin.restarts == []
    assert standin.env_file.read_bytes() == ORIGINAL_ENV
    # The twin unit of the demo and sweep reads the setting's variable: anything goes.
    assert applier_for(make_unit(start=False), recorder).read_wiring() is None


@pytest.mark.parametrize(
    ("show", "unread"),
    [
        # As systemd 252 prints them: specd's drop-in in place (also named by another path
        # to the same directory), or one more file beside it.
        ("EnvironmentFiles=/var/lib/specd/sglang.env (ignore_errors=yes)\nLoadState=loaded", False),
        (
            "EnvironmentFiles=/var/lib/specd/./sglang.env (ignore_errors=yes)\nLoadState=loaded",
            False,
        ),
        (
            "EnvironmentFiles=/etc/default/sglang (ignore_errors=no)\n"
            "EnvironmentFiles=/var/lib/specd/sglang.env (ignore_errors=yes)\nLoadState=loaded",
            False,
        ),
        # The drop-in gone: another file, or none (systemd then prints no line at all).
        ("EnvironmentFiles=/etc/default/sglang (ignore_errors=no)\nLoadState=loaded", True),
        ("LoadState=loaded", True),
        # Cannot tell: systemd does not say the unit is loaded (not found: the restart
        # command fails and changes nothing), or something in its place says nothing of it.
        ("LoadState=not-found", False),
        ("ExecStart={ path=twin ; argv[]=twin $SPECD_SPECULATIVE_ARGS }", False),
        ("", False),
    ],
)
def test_a_unit_that_does_not_read_the_env_file_is_named(show: str, unread: bool) -> None:
    why = env_file_unread(UNIT, "/var/lib/specd/sglang.env", parse_show(show))
    if not unread:
        assert why is None
        return
    assert why is not None
    assert why.startswith(f"{UNIT} does not read /var/lib/specd/sglang.env (its EnvironmentFile=")
    assert "no restart" in why
    assert "\n" not in why


# -- env file -----------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 3, 4, 16])
def test_render_env_sets_steps_and_draft_tokens_and_says_who_writes_it(steps: int) -> None:
    text = render_env(steps)
    assert text.startswith("# Written by specd")
    assert parse_env(text) == {ENV_STEPS: str(steps), ENV_DRAFT_TOKENS: str(steps + 1)}
    assert text.endswith("\n")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, None),
        (b"", None),
        (b"SPECULATIVE_NUM_STEPS=4\n", 4),
        (b"# c\n; c\n  SPECULATIVE_NUM_STEPS = 2 \nSPECULATIVE_NUM_DRAFT_TOKENS=3\n", 2),
        (b'SPECULATIVE_NUM_STEPS="5"\n', 5),
        (b"SPECULATIVE_NUM_STEPS='1'\n", 1),
        (b"SPECULATIVE_NUM_STEPS=four\n", None),
        (b"SPECULATIVE_NUM_STEPS=-1\n", None),
        (b"SPECULATIVE_NUM_STEPS=\n", None),
        (b"OTHER=1\n", None),
        (b"\xff\xfe\x00garbage", None),
        # Digits to isdigit(), no count: int() raised on the first, read the second as 3.
        ("SPECULATIVE_NUM_STEPS=²\n".encode(), None),
        ("SPECULATIVE_NUM_STEPS=٣\n".encode(), None),
        (b"SPECULATIVE_NUM_STEPS=" + b"9" * 5000 + b"\n", None),
        (
            b"SPECULATIVE_NUM_STEPS=2\nSPECULATIVE_NUM_STEPS=6\n",
            6,
        ),  # the last one wins, as in systemd
    ],
)
def test_read_env_steps(tmp_path: Path, content: bytes | None, expected: int | None) -> None:
    path = tmp_path / "sglang.env"
    if content is not None:
        path.write_bytes(content)
    assert read_env_steps(path) == expected


def test_read_env_steps_of_a_directory_is_none(tmp_path: Path) -> None:
    assert read_env_steps(tmp_path) is None


# -- settings and journal -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("health_poll", "expected_s"),
    [
        (None, 2.0),  # the default: a look every 2 s while SGLang loads (minutes, on a GPU)
        # Configured: how often the daemon's restarts look at SGLang and at the gateway was
        # the Applier's fixed 2 s, which no config reached (a twin loads in a blink).
        (0.25, 0.25),
    ],
)
def test_from_settings_takes_the_tables_and_paces_quiet_by_the_scrape(
    tmp_path: Path, health_poll: float | None, expected_s: float
) -> None:
    restart: dict[str, Any] = {
        "quiet_concurrency_max": 1,
        "quiet_deadline_s": 0,
        "startup_timeout_s": 300,
        "health_probe_timeout_s": 25,
        "restart_command_timeout_s": 60,
    }
    if health_poll is not None:
        restart["health_poll_interval_s"] = health_poll
    config = Config.model_validate(
        {
            "sglang": {"unit": "sglang-122b.service", "env_file": str(tmp_path / "x.env")},
            "choose": {"min_steps": 2, "max_steps": 5},
            "observe": {"scrape_interval_s": 2},
            "restart": restart,
            "gateway": {"urls": ["http://127.0.0.1:9"]},
        }
    )
    client = SGLangClient("http://127.0.0.1:9", timeout_s=1.0)
    applier = Applier.from_settings(
        config, client, lambda *a, **k: None, lambda j: None, threading.Event()
    )
    assert (applier.sglang, applier.choose, applier.restart) == (
        config.sglang,
        config.choose,
        config.restart,
    )
    assert applier.quiet_poll_interval_s == 2
    assert (applier.health_poll_interval_s, applier.verify_attempts) == (expected_s, 3)
    # The re-add's and the ready wait's reads of the gateway keep the same pace.
    assert applier.gateway is not None
    assert applier.gateway._poll_s == expected_s
    applier.gateway.close()
    client.close()


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"unit": "--now"}, "not a systemd service name"),
        ({"unit": "a b.service"}, "not a systemd service name"),
        ({"unit": ""}, "not a systemd service name"),
        ({"min_steps": 5, "max_steps": 2}, r"min_steps \(5\) > max_steps \(2\)"),
        ({"startup_timeout_s": 0}, "startup_timeout_s"),
        ({"restart_command_timeout_s": 1e300}, "restart_command_timeout_s"),
        ({"quiet_deadline_s": -1}, "quiet_deadline_s"),
    ],
)
def test_bad_settings_are_refused_by_the_tables(
    tmp_path: Path, overrides: dict[str, Any], problem: str
) -> None:
    with pytest.raises(pydantic.ValidationError, match=problem):
        settings_for(tmp_path / "x.env", **overrides)


@pytest.mark.parametrize(
    "pacing",
    [{"quiet_poll_interval_s": 0}, {"health_poll_interval_s": -1}, {"verify_attempts": 0}],
)
def test_bad_pacing_is_a_one_line_error(tmp_path: Path, pacing: dict[str, Any]) -> None:
    settings = settings_for(tmp_path / "x.env")
    client = SGLangClient("http://127.0.0.1:9", timeout_s=1.0)
    with pytest.raises(ValueError, match="must be > 0") as info:
        make_applier(
            settings, client, lambda *a, **k: None, lambda j: None, threading.Event(), **pacing
        )
    assert "\n" not in str(info.value)
    client.close()


DRAINED = {
    "gateway_url": "http://127.0.0.1:30080",
    "worker_id": "w1",
    "url": "http://127.0.0.1:30000",
    "status": "ready",
    "labels": {"pool": "a"},
    "settings": {"priority": 50},
}


def test_journal_keeps_drained_workers_and_drops_unknown_settings() -> None:
    extra = {**DRAINED, "settings": {"priority": 50, "api_key": "leak"}}
    journal = Journal.from_dict(_journal(drained=[extra], readded="yes"))
    assert journal.drained == [DRAINED]
    assert journal.readded is False  # only a literal true says the re-add happened


def _journal(**changes: Any) -> dict[str, Any]:
    data = Journal(
        phase="restart_issued",
        from_steps=3,
        to_steps=4,
        unit=UNIT,
        env_file="/var/lib/specd/sglang.env",
        previous_env="SPECULATIVE_NUM_STEPS=3\n",
        previous_env_encoding="utf-8",
        started_at=1_700_000_000.0,
    ).to_dict()
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"phase": "exploded"}, "phase"),
        ({"version": 99}, "version"),
        ({"to_steps": "4"}, "to_steps"),
        ({"to_steps": True}, "to_steps"),
        ({"started_at": None}, "started_at"),
        ({"previous_env": 3}, "previous_env"),
        ({"previous_env_encoding": "rot13"}, "encoding"),
        ({"previous_env": "%%%", "previous_env_encoding": "base64"}, "undecodable"),
        ({"messages": "x"}, "messages"),
        ({"unit": None}, "unit"),
        ({"drained": {"url": "x"}}, "drained is not a list"),
        ({"drained": ["x"]}, "drained worker 'x' is not an object"),
        ({"drained": [{**DRAINED, "worker_id": 7}]}, "drained worker worker_id 7 is not a string"),
        ({"drained": [{**DRAINED, "labels": []}]}, "labels/settings are not objects"),
        # Hand-edited numbers no sequence writes: a finished restart to 99 steps was taken
        # as verified (what runs, per the state), -1e308/1e308 made a duration of infinity
        # (no later save of the state could write it), a negative attempt count never
        # reached the give-up after repeated interruptions.
        ({"phase": "done", "to_steps": 99}, "to_steps 99 is not in 0..64"),
        ({"from_steps": -1}, "from_steps -1 is not in 0..64"),
        ({"phase": "done", "restart_issued_at": -1e308, "finished_at": 1e308}, "is no time"),
        ({"started_at": float("inf")}, "started_at inf is no time"),
        ({"attempt": -100}, "attempt -100 is not in"),
        ({"restarts_issued": -1}, "restarts_issued -1 is not in"),
        ({"phase": "failed", "capacity": -5}, "capacity -5 is not in 1.."),
        # More restarts that started nothing than were issued: a budget made up.
        ({"restarts_issued": 1, "not_started": 2}, "not_started 2 is more than its 1"),
        ({"refused_until": 1e308}, "refused_until 1e\\+308 is no time"),
    ],
)
def test_journal_from_dict_rejects_bad_shapes(changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(JournalError, match=problem):
        Journal.from_dict(_journal(**changes))


@pytest.mark.parametrize("content", [None, b"", ORIGINAL_ENV, b"\xff\xfeSPECD=1\n"])
def test_journal_round_trips_through_json_and_keeps_env_bytes(content: bytes | None) -> None:
    text, encoding = encode_env(content)
    data = _journal(previous_env=text, previous_env_encoding=encoding, messages=["a", "b"])
    back = Journal.from_dict(json.loads(json.dumps(data)))
    assert back.previous_bytes() == content
    assert back.to_dict() == data


# -- the sequence against a twin ----------------------------------------------------------


@pytest.mark.parametrize(
    ("twin_args", "evidence", "algorithm"),
    [
        # The algorithm SGLang reports (no [sglang] speculative_algorithm, no env file of
        # the setting form): the env file is written in the setting form. SGLang sets
        # sglang:spec_num_steps at its first decode log: one per batch here, so the
        # warm-up's set it (at the default 40, only /server_info shows the steps then).
        (
            ["--decode-log-interval", "1"],
            "/server_info steps=4, /server_info draft_tokens=5, metrics steps=4",
            "EAGLE",
        ),
        # Fields missing from /server_info: the sglang:spec_num_steps gauge suffices.
        (
            [
                "--server-info-missing",
                "speculative_num_steps,speculative_num_draft_tokens",
                "--decode-log-interval",
                "1",
            ],
            "metrics steps=4",
            "EAGLE",
        ),
        # /metrics disabled: /server_info suffices. (Offered concurrency is unknown then, so
        # the quiet-moment wait would run to its deadline; the test sets that to 0.) No
        # observation read /server_info before the restart: the algorithm is unknown, and
        # the step-variable form is what a drop-in of that form reads.
        (["--metrics-404"], "/server_info steps=4", None),
    ],
)
def test_success_writes_env_restarts_once_and_verifies(
    make_unit: Any, tmp_path: Path, twin_args: list[str], evidence: str, algorithm: str | None
) -> None:
    unit = make_unit(ORIGINAL_ENV, lambda steps: twin_args)
    rec = Recorder(tmp_path / "journal.json")
    quiet_deadline_s = 0.0 if "--metrics-404" in twin_args else 5.0
    outcome = applier_for(unit, rec, quiet_deadline_s=quiet_deadline_s).apply(
        4, 3, window_open=always_open
    )
    assert outcome.result == "success", outcome.message
    assert evidence in outcome.message
    assert (outcome.from_steps, outcome.to_steps, outcome.restarts_issued) == (3, 4, 1)
    assert unit.restarts == [4]
    assert unit.running_steps() == 4
    assert read_env_steps(unit.env_file) == 4
    assert unit.env_file.read_text() == (
        render_env(4)
        if algorithm is None
        else render_setting_env(setting_static(4), algorithm=algorithm, config_dir=tmp_path)
    )
    # The twin's capacity model: about 78 / (steps + 2) → 13 at 4 steps.
    assert outcome.capacity is not None
    assert 10 <= outcome.capacity <= 16
    assert outcome.duration_s > 0
    assert rec.phases() == ["planned", "env_written", "restart_issued", "verifying", "done"]
    stored = rec.stored()
    assert stored is not None
    assert stored["phase"] == "done"  # the caller records the outcome, then clears it


@pytest.mark.parametrize(
    ("env", "fail_at", "expect_env"),
    [
        (ORIGINAL_ENV, "4", ORIGINAL_ENV),
        # No env file before: the unit ran the drop-in default; rollback removes the file.
        (None, "4", None),
    ],
)
def test_target_that_fails_to_start_is_rolled_back_and_verified(
    make_unit: Any, tmp_path: Path, env: bytes | None, fail_at: str, expect_env: bytes | None
) -> None:
    unit = make_unit(env, lambda steps: ["--fail-start-at-steps", fail_at])
    rec = Recorder(tmp_path / "journal.json")
    started = time.monotonic()
    outcome = applier_for(unit, rec, startup_timeout_s=60.0).apply(
        4, DROPIN_DEFAULT_STEPS, window_open=always_open
    )
    assert outcome.result == "rolled_back", outcome.message
    assert "verified 3 steps" in outcome.message
    # systemd reported the crash: no waiting out the startup timeout.
    assert "sglang.service failed while starting" in outcome.message
    assert time.monotonic() - started < 30
    assert unit.restarts == [4, 3]
    assert unit.running_steps() == 3
    if expect_env is None:
        assert not unit.env_file.exists()
    else:
        assert unit.env_file.read_bytes() == expect_env
    assert rec.phases()[-1] == "rolled_back"
    assert "rolling_back" in rec.phases()


def test_rollback_that_also_fails_ends_failed_with_env_at_previous(
    make_unit: Any, tmp_path: Path
) -> None:
    broken = threading.Event()
    # Started healthy at 3; from then on the "GPU" fails at both 3 and 4.
    unit = make_unit(
        ORIGINAL_ENV,
        lambda steps: ["--fail-start-at-steps", "3,4"] if broken.is_set() else [],
    )
    broken.set()
    rec = Recorder(tmp_path / "journal.json")
    outcome = applier_for(unit, rec).apply(4, 3, window_open=always_open)
    assert outcome.result == "failed", outcome.message
    assert unit.restarts == [4, 3]  # one rollback restart, no loop
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert rec.phases()[-1] == "failed"


def test_never_healthy_is_a_bounded_wait_then_rollback(make_unit: Any, tmp_path: Path) -> None:
    unit = make_unit(ORIGINAL_ENV, lambda steps: ["--never-healthy"] if steps == 4 else [])
    rec = Recorder(tmp_path / "journal.json")
    # The same bound holds the rollback's start: room for a loaded machine to start the
    # twin and its warm-up request, as SGLang's own warm-up precedes healthy.
    bound_s = 3.0
    started = time.monotonic()
    outcome = applier_for(unit, rec, startup_timeout_s=bound_s).apply(4, 3, window_open=always_open)
    elapsed = time.monotonic() - started
    assert outcome.result == "rolled_back", outcome.message
    assert f"not healthy within {bound_s:g} s" in outcome.message
    assert unit.restarts == [4, 3]
    assert unit.running_steps() == 3
    assert bound_s <= elapsed < bound_s + START_TIMEOUT_S


def test_failed_restart_command_with_sglang_untouched_needs_no_restart(
    make_unit: Any, tmp_path: Path
) -> None:
    unit = make_unit()

    def denied(argv: Sequence[str], *, timeout_s: float) -> RunResult:
        # What a missing polkit rule gives: nothing restarted.
        return RunResult(
            tuple(argv), 1, "", "Failed to restart sglang.service: Access denied\n", False, 0.01
        )

    rec = Recorder(tmp_path / "journal.json")
    outcome = applier_for(unit, rec, runner=denied).apply(4, 3, window_open=always_open)
    assert outcome.result == "rolled_back", outcome.message
    assert "Access denied" in outcome.message
    assert "no restart" in outcome.message
    assert unit.restarts == []
    # Nothing for the daily budget: the command reached nothing.
    assert (outcome.restarts_issued, outcome.sglang_restarts) == (1, 0)
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert unit.running_steps() == 3


class CountingEvent(threading.Event):
    """The daemon's stop event also beats its watchdog on every wait(): count those."""

    def __init__(self) -> None:
        super().__init__()
        self.waits_after_set = 0

    def wait(self, timeout: float | None = None) -> bool:
        if self.is_set():
            self.waits_after_set += 1
        return super().wait(timeout)


# What `systemctl restart` prints when the unit's start failed (systemd 252).
JOB_FAILED = f"Job for {UNIT} failed because the control process exited with error code.\n"


def answered(argv: Sequence[str], code: int, out: str = "", err: str = "") -> RunResult:
    """What a systemctl stand-in returns: ``argv`` ran, exited ``code``, printed these."""
    return RunResult(tuple(argv), code, out, err, False, 0.01)


class StartLimited:
    """The twin unit behind systemd's start limit, as systemd 252 keeps it: a start past
    ``burst`` within ``interval_s`` is refused (`systemctl restart` exits 1, and the unit is
    left failed, its process stopped), Restart='s crash result kept (no start-limit-hit to
    read), else Result=start-limit-hit (a running unit the restart stopped cleanly);
    `systemctl reset-failed UNIT` forgets the starts and the failed state, unless
    polkit refuses it (``may_reset``: a rule from before specd did it). ``starts`` are the
    times of the starts it counts; ``calls`` every command it was given."""

    def __init__(
        self, unit: TwinUnit, burst: int, interval_s: float, *, may_reset: bool = True
    ) -> None:
        self.unit = unit
        self.burst = burst
        self.interval_s = interval_s
        self.may_reset = may_reset
        self.starts = [time.monotonic()]  # SGLang's own start
        self.failed = False
        self.result = "success"
        self.calls: list[list[str]] = []

    def state(self) -> str:
        return "failed" if self.failed else self.unit.is_active()

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        args = list(argv)
        self.calls.append(args)
        verbs = [a for a in args[1:] if not a.startswith("-")]
        if verbs == ["reset-failed", UNIT]:
            if not self.may_reset:
                denied = f"Failed to reset failed state of unit {UNIT}: Access denied\n"
                return answered(argv, 1, err=denied)
            self.starts, self.failed, self.result = [], False, "success"
            return answered(argv, 0)
        if verbs == ["show", UNIT] and "--property=ActiveState" in args:
            state = self.state()
            return answered(
                argv,
                0,
                f"ActiveState={state}\nSubState={state}\nNRestarts=0\nResult={self.result}\n",
            )
        if verbs == ["show", UNIT] and "--property=StartLimitIntervalUSec" in args:
            return answered(
                argv,
                0,
                f"StartLimitIntervalUSec={self.interval_s:g}s\nStartLimitBurst={self.burst}\n",
            )
        if verbs == ["restart", UNIT]:
            now = time.monotonic()
            self.starts = [t for t in self.starts if now - t <= self.interval_s]
            if len(self.starts) >= self.burst:
                if self.unit.is_active() == "failed":
                    self.result = "exit-code"  # the crash's, kept
                elif self.result == "success":
                    self.result = "start-limit-hit"
                self.unit.stop()
                self.failed = True
                return answered(
                    argv,
                    1,
                    err=f'{JOB_FAILED}See "systemctl status {UNIT}" for details.\n',
                )
            self.starts.append(now)
            self.failed, self.result = False, "success"
        return self.unit(argv, timeout_s=timeout_s)

    def reset_failed_calls(self) -> int:
        return sum(1 for argv in self.calls if "reset-failed" in argv)


def test_a_target_that_used_up_the_start_limit_is_rolled_back_after_reset_failed(
    make_unit: Any, tmp_path: Path
) -> None:
    """SGLang's start and the change's use up a limit of 2 starts: systemd refused the
    rollback's restart, and SGLang stayed down. The rollback clears the unit's failed state
    and start count first."""
    unit = make_unit(ORIGINAL_ENV, lambda steps: ["--fail-start-at-steps", "4"])
    systemd = StartLimited(unit, burst=2, interval_s=3600.0)
    rec = Recorder(tmp_path / "journal.json")
    outcome = applier_for(unit, rec, runner=systemd, startup_timeout_s=60.0).apply(
        4, 3, window_open=always_open
    )
    assert outcome.result == "rolled_back", outcome.message
    assert "rolled back, verified 3 steps" in outcome.message
    assert unit.restarts == [4, 3]
    assert unit.running_steps() == 3
    assert outcome.restarts_issued == 2
    # Once, right before the rollback's restart; never before the change's (not failed).
    assert systemd.reset_failed_calls() == 1
    restarts = [i for i, argv in enumerate(systemd.calls) if argv == restart_argv(UNIT)]
    assert systemd.calls[restarts[1] - 1] == reset_failed_argv(UNIT)
    stored = rec.stored()
    assert stored is not None
    assert any("cleared its failed state and start count" in m for m in stored["messages"])


def test_a_change_to_a_unit_left_failed_by_its_start_limit_clears_it_first(
    make_unit: Any, tmp_path: Path
) -> None:
    """SGLang crash-looped on its own until systemd gave up on it; an on-call pin now
    restarts it: its restart was refused, and so was the rollback's. The change clears
    the failed state first."""
    unit = make_unit(ORIGINAL_ENV)
    systemd = StartLimited(unit, burst=1, interval_s=3600.0)
    unit.stop()
    systemd.failed = True
    rec = Recorder(tmp_path / "journal.json")
    outcome = applier_for(unit, rec, runner=systemd, quiet_deadline_s=0.0).apply(
        4, 3, window_open=always_open, force=True
    )
    assert outcome.result == "success", outcome.message
    assert unit.restarts == [4]
    assert unit.running_steps() == 4
    assert systemd.reset_failed_calls() == 1


def test_a_rollback_that_may_not_reset_failed_waits_out_the_start_limit(
    make_unit: Any, tmp_path: Path
) -> None:
    """A polkit rule from before specd cleared the start limit refuses `reset-failed`: the
    rollback's restart is refused, and it restarts again once the limit's interval has
    passed, rather than leaving SGLang down."""
    unit = make_unit(ORIGINAL_ENV, lambda steps: ["--fail-start-at-steps", "4"])
    interval_s = 1.5
    systemd = StartLimited(unit, burst=2, interval_s=interval_s, may_reset=False)
    rec = Recorder(tmp_path / "journal.json")
    stop = CountingEvent()
    applier = applier_for(unit, rec, runner=systemd, stop=stop, startup_timeout_s=10.0)
    with structlog.testing.capture_logs() as logs:
        started = time.monotonic()
        outcome = applier.apply(4, 3, window_open=always_open)
        took = time.monotonic() - started
    assert outcome.result == "rolled_back", outcome.message
    assert "rolled back, verified 3 steps" in outcome.message
    assert unit.restarts == [4, 3]
    assert unit.running_steps() == 3
    assert took >= interval_s + START_LIMIT_MARGIN_S
    waited = [e for e in logs if e["event"] == "restart_waits_for_start_limit"]
    assert [e["wait_s"] for e in waited] == [interval_s + START_LIMIT_MARGIN_S]
    assert [e["event"] for e in logs].count("unit_reset_failed_refused") == 1
    stored = rec.stored()
    assert stored is not None
    assert any("Access denied" in m for m in stored["messages"])
    assert outcome.restarts_issued == 2  # a refused start restarted nothing


def test_a_start_limit_longer_than_the_startup_timeout_is_not_waited_out_but_named(
    make_unit: Any, tmp_path: Path
) -> None:
    unit = make_unit(ORIGINAL_ENV, lambda steps: ["--fail-start-at-steps", "4"])
    systemd = StartLimited(unit, burst=2, interval_s=3600.0, may_reset=False)
    rec = Recorder(tmp_path / "journal.json")
    started = time.monotonic()
    outcome = applier_for(unit, rec, runner=systemd, startup_timeout_s=10.0).apply(
        4, 3, window_open=always_open
    )
    assert time.monotonic() - started < 10.0
    assert outcome.result == "failed", outcome.message
    assert "rollback restart" in outcome.message
    assert (
        f"systemd may refuse to start {UNIT} until its start limit (StartLimitBurst=2 in "
        "StartLimitIntervalSec=3600 s) has passed, and specd may not clear it: run "
        f"`specd install --unit {UNIT}`"
    ) in outcome.message
    assert unit.restarts == [4]


def test_a_change_refused_for_a_start_limit_used_up_before_it_clears_it_and_goes_ahead(
    make_unit: Any, tmp_path: Path
) -> None:
    """SGLang runs 3, healthy, but earlier starts (a crash loop that recovered, an
    operator's restarts) used up its unit's start limit: systemd stopped it for the change's
    restart and refused the start (Result=start-limit-hit). The rollback brought 3 back and
    specd froze as if 4 had failed, 4 never having run. Now the count is cleared and the
    restart made again: the change goes ahead, one SGLang restart."""
    unit = make_unit(ORIGINAL_ENV)
    systemd = StartLimited(unit, burst=1, interval_s=3600.0)  # SGLang's own start used it
    rec = Recorder(tmp_path / "journal.json")
    with structlog.testing.capture_logs() as logs:
        outcome = applier_for(unit, rec, runner=systemd).apply(4, 3, window_open=always_open)
    assert outcome.result == "success", outcome.message
    assert unit.restarts == [4]
    assert unit.running_steps() == 4
    assert systemd.reset_failed_calls() == 1
    assert (outcome.restarts_issued, outcome.sglang_restarts) == (1, 1)
    refused = [e for e in logs if e["event"] == "restart_refused_by_start_limit"]
    assert len(refused) == 1, logs
    assert "not the fault of 4 steps, which never ran" in refused[0]["message"]
    assert "StartLimitBurst=1 in StartLimitIntervalSec=3600 s" in refused[0]["message"]
    stored = rec.stored()
    assert stored is not None
    assert any("refused its start" in m for m in stored["messages"]), stored["messages"]


@pytest.mark.parametrize(
    ("interval_s", "result", "restarted_to", "says"),
    [
        # The limit passes within startup_timeout_s: back on 3 once it has, nothing blamed
        # on 4 (aborted, not rolled back: the daemon does not freeze).
        (3.0, "aborted", [3], "rolled back, verified 3 steps"),
        # It does not: SGLang stays down (systemd stopped it), which needs an operator.
        (3600.0, "failed", [], "run `specd install --unit sglang.service`"),
    ],
)
def test_a_change_refused_for_the_start_limit_specd_may_not_clear_is_backed_out_unblamed(
    make_unit: Any,
    tmp_path: Path,
    interval_s: float,
    result: str,
    restarted_to: list[int],
    says: str,
) -> None:
    """As above, with a polkit rule that refuses `reset-failed`: the change is given up
    (4 was never tried) and SGLang started again on 3 once the limit has passed."""
    unit = make_unit(ORIGINAL_ENV)
    systemd = StartLimited(unit, burst=1, interval_s=interval_s, may_reset=False)
    systemd.starts = [time.monotonic()]  # SGLang's own start, just now on a loaded machine
    rec = Recorder(tmp_path / "journal.json")
    with structlog.testing.capture_logs() as logs:
        outcome = applier_for(unit, rec, runner=systemd, startup_timeout_s=10.0).apply(
            4, 3, window_open=always_open
        )
    assert outcome.result == result, outcome.message
    assert (
        "the unit's start limit, used up before this change, refused its start; 4 steps was "
        "never tried"
    ) in outcome.message
    assert says in outcome.message
    assert unit.restarts == restarted_to
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert [e["event"] for e in logs].count("restart_refused_by_start_limit") == 1
    if result == "aborted":
        assert unit.running_steps() == 3
        # SGLang was stopped once and started once, on 3: one restart for the budget.
        assert (outcome.restarts_issued, outcome.sglang_restarts) == (2, 1)


class SetupFailing:
    """The twin unit behind a systemd whose setup of the process fails ``times`` starts in a
    row (its cgroup, its working directory, the exec): `systemctl restart` stops the twin and
    starts nothing, and `systemctl show` says how the main process ended (ExecMainCode=
    ``code``, ExecMainStatus= ``status``; 1/219 is "status=219/CGROUP", 2/9 SIGKILL). The
    unit is then "activating (auto-restart)" under Restart= (``restart``) or "failed";
    ``type_exec``: the restart command itself fails, as for a Type=exec or notify unit."""

    def __init__(
        self,
        unit: TwinUnit,
        code: int,
        status: int,
        *,
        times: int = 1,
        restart: bool = True,
        type_exec: bool = False,
    ) -> None:
        self.unit = unit
        self.code, self.status = code, status
        self.times = times
        self.restart = restart
        self.type_exec = type_exec
        self.dead = False

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        args = list(argv)
        verbs = [a for a in args[1:] if not a.startswith("-")]
        if verbs == ["reset-failed", UNIT]:
            return answered(argv, 0)
        if verbs == ["show", UNIT] and "--property=ActiveState" in args:
            if self.dead:
                active, sub = ("activating", "auto-restart") if self.restart else ("failed",) * 2
                return answered(
                    argv,
                    0,
                    f"ActiveState={active}\nSubState={sub}\nNRestarts=0\nResult=exit-code\n"
                    f"ExecMainCode={self.code}\nExecMainStatus={self.status}\n",
                )
            running = self.unit.is_active() == "active"
            state = "ActiveState=active\nSubState=running\n" if running else ""
            return answered(
                argv, 0, f"{state}NRestarts=0\nResult=success\nExecMainCode=0\nExecMainStatus=0\n"
            )
        if verbs == ["restart", UNIT] and self.times > 0:
            self.times -= 1
            self.unit.stop()
            self.dead = True
            if self.type_exec:
                return answered(
                    argv,
                    1,
                    err=JOB_FAILED,
                )
            return answered(argv, 0)
        if verbs == ["restart", UNIT]:
            self.dead = False
        return self.unit(argv, timeout_s=timeout_s)


@pytest.mark.parametrize(
    ("systemd", "result", "says", "restarted_to", "sglang_restarts"),
    [
        # systemd could not put the process into its cgroup (the symptom: 3 a.m., Restart=
        # about to start it again): 4 never ran, so back on 3, verified, and aborted.
        (
            {"code": 1, "status": 219},
            "aborted",
            [
                f"systemd could not start {UNIT}'s process (status 219/CGROUP: its own setup, "
                "before SGLang ran); 4 steps was never tried",
                "rolled back, verified 3 steps",
            ],
            [3],
            1,
        ),
        # No Restart=: the unit is left failed, the same verdict.
        (
            {"code": 1, "status": 200, "restart": False},
            "aborted",
            ["status 200/CHDIR", "4 steps was never tried", "rolled back, verified 3 steps"],
            [3],
            1,
        ),
        # A Type=exec (or notify) unit: the restart command fails on it.
        (
            {"code": 1, "status": 203, "type_exec": True},
            "aborted",
            ["status 203/EXEC", "4 steps was never tried", "rolled back, verified 3 steps"],
            [3],
            1,
        ),
        # The rollback's start fails the same way: SGLang is down, which needs an operator.
        (
            {"code": 1, "status": 217, "times": 2},
            "failed",
            [
                "status 217/USER",
                f"after rollback systemd could not start {UNIT}'s process (status 217/USER",
            ],
            [],
            1,
        ),
        # SGLang itself exited (1) or was killed (SIGKILL 9: 2/9; SIGABRT dumped: 3/6), or
        # exited with 223 or 255, which systemd does not use for its setup: as before.
        ({"code": 1, "status": 1}, "rolled_back", [f"{UNIT} failed while starting"], [3], 2),
        ({"code": 2, "status": 9}, "rolled_back", [f"{UNIT} failed while starting"], [3], 2),
        ({"code": 3, "status": 6}, "rolled_back", [f"{UNIT} failed while starting"], [3], 2),
        ({"code": 1, "status": 223}, "rolled_back", [f"{UNIT} failed while starting"], [3], 2),
        ({"code": 1, "status": 255}, "rolled_back", [f"{UNIT} failed while starting"], [3], 2),
    ],
)
def test_a_start_systemd_could_not_set_up_is_backed_out_unblamed(
    make_unit: Any,
    tmp_path: Path,
    systemd: dict[str, Any],
    result: str,
    says: list[str],
    restarted_to: list[int],
    sglang_restarts: int,
) -> None:
    """The change's start died in systemd's own setup of the process (status 219/CGROUP),
    before SGLang ran: specd blamed SGLang ("failed while starting"), rolled back and froze
    (rolled_back), holding 3 though 4 was never tried. Now it says what systemd said, and
    the change ends aborted once 3 is back, verified; one SGLang restart for the budget."""
    unit = make_unit(ORIGINAL_ENV)
    runner = SetupFailing(unit, **systemd)
    rec = Recorder(tmp_path / "journal.json")
    with structlog.testing.capture_logs() as logs:
        outcome = applier_for(unit, rec, runner=runner, startup_timeout_s=10.0).apply(
            4, 3, window_open=always_open
        )
    assert outcome.result == result, outcome.message
    for text in says:
        assert text in outcome.message, outcome.message
    assert unit.restarts == restarted_to
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert (outcome.restarts_issued, outcome.sglang_restarts) == (2, sglang_restarts)
    setup_failed = [e for e in logs if e["event"] == "restart_setup_failed"]
    if result == "rolled_back":
        assert setup_failed == []
    else:
        assert len(setup_failed) == 1, logs
        assert f"status {setup_failed[0]['status']}:" in outcome.message
    if result == "aborted":
        assert unit.running_steps() == 3
        stored = rec.stored()
        assert stored is not None
        assert stored["setup_failed"] == setup_failed[0]["status"]


class KilledWhileWaiting(Recorder):
    """specd killed (SIGKILL, a reboot of specd alone) once its journal says it waits out
    the unit's start limit before the rollback's restart."""

    def __call__(self, journal: dict[str, Any] | None) -> None:
        waiting = journal is not None and any(
            "for the limit to pass" in m for m in journal["messages"][-1:]
        )
        if waiting and self.kill_at is None:
            self.kill_at = len(self.calls)
            self.store_first = True
        super().__call__(journal)


@pytest.mark.parametrize(
    ("may_reset_after", "waits"),
    [
        # Still refused: the resumed specd waits what is left of the limit, then restarts.
        (False, True),
        # `specd install` run meanwhile: it clears the limit and restarts at once.
        (True, False),
    ],
)
def test_a_specd_killed_while_waiting_out_the_start_limit_finishes_the_rollback(
    make_unit: Any, tmp_path: Path, may_reset_after: bool, waits: bool
) -> None:
    """specd was killed while its rollback waited out the unit's start limit (the polkit
    rule refusing `reset-failed`). Its next start ended the sequence failed at once, SGLang
    down. It now clears the limit if it may, else waits what is left of it, restarts on
    the previous setting and verifies it."""
    unit = make_unit(ORIGINAL_ENV, lambda steps: ["--fail-start-at-steps", "4"])
    # Long enough that the change's start and its crash fit in it on a loaded machine.
    interval_s = 5.0
    systemd = StartLimited(unit, burst=1, interval_s=interval_s, may_reset=False)
    systemd.starts = []  # the change's start uses the limit up
    rec = KilledWhileWaiting(tmp_path / "journal.json")
    with pytest.raises(Killed):
        applier_for(unit, rec, runner=systemd, startup_timeout_s=10.0).apply(
            4, 3, window_open=always_open
        )
    killed_at, killed_wall = time.monotonic(), time.time()
    journal = rec.stored()
    assert journal is not None
    assert (journal["phase"], journal["restarts_issued"]) == ("rolling_back", 2)
    assert unit.restarts == [4]
    assert unit.is_active() != "active"  # SGLang down, its rollback restart refused
    time.sleep(1.0)  # specd starts again a while later
    systemd.may_reset = may_reset_after
    resumed = Recorder(tmp_path / "state.json")
    with structlog.testing.capture_logs() as logs:
        outcome = applier_for(unit, resumed, runner=systemd, startup_timeout_s=10.0).reconcile(
            journal
        )
    took = time.monotonic() - killed_at
    assert outcome is not None
    assert outcome.result == "rolled_back", outcome.message
    assert "rolled back, verified 3 steps" in outcome.message
    assert unit.restarts == [4, 3]
    assert unit.running_steps() == 3
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert (outcome.restarts_issued, outcome.sglang_restarts) == (2, 2)
    waited = [e["wait_s"] for e in logs if e["event"] == "restart_waits_for_start_limit"]
    if waits:
        # What was left of the limit's interval (+ margin), not the whole of it again.
        assert len(waited) == 1, logs
        left = journal["refused_until"] - killed_wall
        assert 0 < waited[0] < left < interval_s + START_LIMIT_MARGIN_S
        assert took >= left
    else:
        assert waited == []
    final = resumed.stored()
    assert final is not None
    assert final["refused_until"] is None


def test_stop_after_restart_issued_still_finishes_verified(make_unit: Any, tmp_path: Path) -> None:
    unit = make_unit()
    stop = CountingEvent()

    def restart_then_sigterm(argv: Sequence[str], *, timeout_s: float) -> RunResult:
        result = unit(argv, timeout_s=timeout_s)
        if list(argv) == restart_argv(UNIT):
            stop.set()  # SIGTERM reached specd while SGLang loads
        return result

    rec = Recorder(tmp_path / "journal.json")
    outcome = applier_for(unit, rec, runner=restart_then_sigterm, stop=stop).apply(
        4, 3, window_open=always_open
    )
    assert outcome.result == "success", outcome.message
    assert unit.running_steps() == 4
    assert rec.phases()[-1] == "done"
    # It kept waiting for the load, and kept calling wait() so a watchdog sees it alive.
    assert stop.waits_after_set > 0


DESTRUCTIVE = (
    "Failed to restart sglang.service: Transaction for sglang.service/restart is destructive "
    "(poweroff.target has 'start' job queued, but 'stop' is included in transaction).\n"
)


class ShuttingDownSystemd:
    """The unit's systemd, and the system shutting down at the ``at``-th restart command
    (1: once the change's restart went out, SGLang loading; 2: refusing the rollback's):
    specd's SIGTERM comes (``stop``), and from then on ``mode`` says what systemctl does.
    "stopping": systemd answers, says so, and refuses a restart as the shutdown's jobs
    would be undone (root's specd, or the bus not yet stopped). "bus": dbus.service has
    stopped, as at a real shutdown (seen under systemd 252 in nspawn): every systemctl of a
    non-root specd fails to reach systemd. ``stop_too`` False: the bus goes with no stop."""

    def __init__(
        self, unit: TwinUnit, stop: threading.Event, mode: str, at: int, stop_too: bool = True
    ) -> None:
        self.unit, self.stop, self.mode, self.at, self.stop_too = unit, stop, mode, at, stop_too
        self.down = threading.Event()
        self.restarts = 0

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        args = list(argv)
        if args == restart_argv(UNIT):
            self.restarts += 1
            if self.restarts == self.at and self.at > 1:
                self._go_down()
            if self.down.is_set():
                if self.mode == "bus":
                    return answered(args, 1, "", "Failed to connect to bus: Broken pipe\n")
                return answered(args, 1, "", DESTRUCTIVE)
            result = self.unit(argv, timeout_s=timeout_s)
            if self.restarts == self.at:
                self._go_down()
            return result
        if args == ["systemctl", "is-system-running"]:
            if not self.down.is_set():
                return answered(args, 0, "running\n")
            if self.mode == "bus":
                return answered(
                    args, 1, "unknown\n",
                    "Failed to query system state: Transport endpoint is not connected\n",
                )  # fmt: skip
            return answered(args, 1, "stopping\n", "")
        if self.down.is_set() and self.mode == "bus" and args[0] == "systemctl":
            return answered(args, 1, "", "Failed to connect to bus: Broken pipe\n")
        return self.unit(argv, timeout_s=timeout_s)

    def _go_down(self) -> None:
        self.down.set()
        if self.stop_too:
            self.stop.set()


def boot(unit: TwinUnit) -> None:
    """The reboot: SGLang stopped at shutdown, started at boot from its env file."""
    unit.stop()
    unit.start_healthy()


@pytest.mark.parametrize(
    ("mode", "at", "phase", "after_boot", "said"),
    [
        pytest.param(
            "stopping",
            1,
            "restart_issued",
            "aborted",
            "`systemctl is-system-running`: stopping",
            id="SIGTERM while the target loads, systemd says stopping",
        ),
        pytest.param(
            "bus",
            1,
            "restart_issued",
            "aborted",
            "systemd gone from the system bus: Failed to query system state",
            id="SIGTERM while the target loads, the system bus gone",
        ),
        pytest.param(
            "stopping",
            2,
            "rolling_back",
            "rolled_back",
            "`systemctl is-system-running`: stopping): `systemctl --no-ask-password restart "
            "sglang.service` exit 1: Failed to restart sglang.service: Transaction for "
            "sglang.service/restart is destructive",
            id="the target failed before the shutdown, its rollback's restart refused",
        ),
        pytest.param(
            "bus",
            2,
            "rolling_back",
            "rolled_back",
            "systemd gone from the system bus: Failed to query system state: Transport "
            "endpoint is not connected): `systemctl --no-ask-password restart sglang.service` "
            "exit 1: Failed to connect to bus: Broken pipe",
            id="the target failed before the shutdown, the bus gone at its rollback",
        ),
    ],
)
def test_a_shutdown_mid_restart_leaves_the_previous_setting_for_the_boot_to_verify(
    make_unit: Any, tmp_path: Path, mode: str, at: int, phase: str, after_boot: str, said: str
) -> None:
    """A reboot while SGLang loaded a change: SGLang's stop waits for specd's, specd waited
    for the load (or, the load failing, for a rollback restart systemd refuses while it
    shuts down) and ended "failed", frozen after the reboot though SGLang booted on its old
    setting. Now specd leaves at once: env file back on the previous setting, the journal
    kept for its next start, which verifies what SGLang booted on. A load cut short is no
    verdict on the target (aborted, nothing frozen); a target that had failed before the
    shutdown is still rolled back (frozen, as without a reboot)."""
    # The target loads for 30 s, then fails (at 15 s): nothing below waits for either. A
    # decode log per batch: the warm-up sets sglang:spec_num_steps, the boot's verification
    # reads it beside /server_info.
    each_batch = ["--decode-log-interval", "1"]
    unit = make_unit(
        ORIGINAL_ENV,
        lambda steps: (
            ["--load-time-s", "30", "--fail-start-at-steps", "4"] if steps == 4 else each_batch
        ),
    )
    if at == 2:  # fails at once: the verdict comes before the shutdown
        unit.extra_args = lambda steps: [*TWIN_TIMING, "--fail-start-at-steps", "4", *each_batch]
    stop = threading.Event()
    systemd = ShuttingDownSystemd(unit, stop, mode, at)
    rec = Recorder(tmp_path / "state.json")
    started = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        outcome = applier_for(unit, rec, runner=systemd, stop=stop, startup_timeout_s=60.0).apply(
            4, 3, window_open=always_open
        )
    took = time.monotonic() - started
    assert outcome.result == "aborted", outcome.message  # not "failed": nothing to freeze for
    assert outcome.message.startswith("the system is shutting down ("), outcome.message
    assert said in outcome.message, outcome.message
    assert outcome.message.endswith(
        f"{unit.env_file} back on 3 steps, which sglang.service starts on at boot; specd's "
        "next start verifies it"
    ), outcome.message
    assert took < 12, "it waited for the load"
    assert outcome.pending, outcome  # the daemon keeps the journal for its next start
    assert unit.restarts == [4]  # no rollback restart went out (or none was let through)
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    left = rec.stored()
    assert left is not None
    assert (left["phase"], left["no_verdict"], left["refused_until"]) == (
        phase,
        after_boot == "aborted",
        None,
    )
    assert left["shutdown"] is not None
    assert [e["event"] for e in logs if e["event"].startswith("restart_")][-1] == (
        "restart_left_for_next_start"
    )

    # The reboot: SGLang starts on the env file; specd's next start finishes the journal.
    boot(unit)
    resumed = Recorder(tmp_path / "state-after-boot.json")
    final = applier_for(unit, resumed, startup_timeout_s=20.0).reconcile(left)
    assert final is not None
    assert not final.pending
    assert final.result == after_boot, final.message
    assert final.message.endswith("; since then, verified 3 steps (/server_info steps=3, "
                                  "/server_info draft_tokens=4, metrics steps=3, metrics "
                                  "draft_tokens=4)"), final.message  # fmt: skip
    assert unit.restarts == [4]  # the boot started SGLang: specd restarted nothing
    assert unit.running_steps() == 3
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    # The change's restart was one; a rollback restart refused by the shutdown none.
    assert final.sglang_restarts == 1
    assert resumed.phases()[-1] == after_boot


@pytest.mark.parametrize(
    ("case", "stop_specd_too"),
    [("change", False), ("change", True), ("rollback", False), ("rollback", True)],
)
def test_sglang_stopped_by_the_on_call_mid_restart_is_left_stopped(
    make_unit: Any, tmp_path: Path, case: str, stop_specd_too: bool
) -> None:
    """The on-call stops SGLang (`systemctl stop`: GPU trouble, say) while it loads the
    change, or the rollback after the change failed, and maybe specd too. specd waited out
    the whole startup_timeout_s, then started SGLang again to roll back, and froze on "not
    healthy" blaming the target. Now a unit found stopped (twice, STOPPED_RECHECK_S apart)
    ends the wait: never started again, the env file back on the previous setting, the
    change aborted (no freeze: the target was never judged), or a rollback left stopped."""
    loads = ["--load-time-s", "30"]
    if case == "change":
        unit = make_unit(ORIGINAL_ENV, lambda steps: loads if steps == 4 else [])
        issued = [4]
    else:  # the target dies at once; the rollback's load is where the stop comes
        unit = make_unit(
            ORIGINAL_ENV,
            lambda steps: ["--fail-start-at-steps", "4"] if steps == 4 else [],
        )
        unit.extra_args = lambda steps: (
            ["--fail-start-at-steps", "4"] if steps == 4 else [*TWIN_TIMING, *loads]
        )
        issued = [4, 3]
    stop = threading.Event()

    def on_call() -> None:
        while unit.restarts != issued:
            time.sleep(0.05)
        time.sleep(1.0)
        unit.stop()
        if stop_specd_too:
            stop.set()

    helper = threading.Thread(target=on_call, daemon=True)
    helper.start()
    rec = Recorder(tmp_path / "state.json")
    started = time.monotonic()
    outcome = applier_for(unit, rec, stop=stop, startup_timeout_s=60.0).apply(
        4, 3, window_open=always_open
    )
    took = time.monotonic() - started
    helper.join(5)
    assert took < 20, f"it waited out the startup timeout ({took:.0f} s)"
    assert unit.is_active() == "inactive", "specd started the SGLang the on-call stopped"
    assert unit.restarts == issued
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert not outcome.pending
    stopped = "sglang.service was stopped outside specd (inactive, no start queued; last "
    if case == "change":
        assert outcome.result == "aborted", outcome.message
        assert outcome.message.startswith(stopped), outcome.message
        assert outcome.message.endswith(
            f": left stopped, not started again; {unit.env_file} holds 3 steps again "
            "(`systemctl start sglang.service` starts 3 steps)"
        ), outcome.message
    else:
        assert outcome.result == "rolled_back", outcome.message  # the target did fail
        assert f"; after rollback {stopped}" in outcome.message, outcome.message
        assert outcome.message.endswith(": left stopped, not started again"), outcome.message


def test_no_change_starts_a_stopped_sglang(make_unit: Any, tmp_path: Path) -> None:
    """A pin applied now needs no reading of SGLang: with SGLang stopped by the on-call it
    went to `systemctl restart`, which started it. Refused now, nothing written."""
    unit = make_unit()
    unit.stop()
    rec = Recorder(tmp_path / "journal.json")
    outcome = applier_for(unit, rec).apply(4, 3, window_open=always_open, force=True)
    assert outcome.result == "aborted", outcome.message
    assert outcome.message.endswith(
        "sglang.service is stopped (inactive, no start queued): specd starts no server "
        "someone stopped; `systemctl start sglang.service` first"
    ), outcome.message
    assert outcome.sglang_restarts == 0
    assert unit.restarts == []
    assert unit.is_active() == "inactive"
    assert unit.env_file.read_bytes() == ORIGINAL_ENV


def test_sglang_not_started_at_boot_is_left_stopped(make_unit: Any, tmp_path: Path) -> None:
    """A reboot mid-change, and SGLang not started at boot (not enabled: the on-call starts
    it by hand). specd's next start waited startup_timeout_s for it, then started it."""
    unit = make_unit(ORIGINAL_ENV, lambda steps: ["--load-time-s", "30"] if steps == 4 else [])
    stop = threading.Event()
    systemd = ShuttingDownSystemd(unit, stop, "stopping", 1)
    left_by = Recorder(tmp_path / "state.json")
    outcome = applier_for(unit, left_by, runner=systemd, stop=stop, startup_timeout_s=60.0).apply(
        4, 3, window_open=always_open
    )
    assert outcome.pending, outcome.message
    left = left_by.stored()
    assert left is not None
    unit.stop()  # the reboot: SGLang stopped at shutdown, not started at boot
    started = time.monotonic()
    final = applier_for(unit, Recorder(tmp_path / "after.json"), startup_timeout_s=60.0).reconcile(
        left
    )
    assert final is not None
    assert time.monotonic() - started < 20
    assert final.result == "aborted", final.message
    assert "; since then, sglang.service was stopped outside specd" in final.message
    assert final.message.endswith(
        f": left stopped, not started again; {unit.env_file} holds 3 steps"
    ), final.message
    assert unit.is_active() == "inactive"
    assert unit.restarts == [4]
    assert unit.env_file.read_bytes() == ORIGINAL_ENV


def test_three_reboots_mid_restart_are_no_crash_loop(make_unit: Any, tmp_path: Path) -> None:
    """Each start after a shutdown counted as an interrupted attempt: after a third reboot
    while SGLang loaded, the next start gave up ("failed after 3 interrupted attempts") and
    froze specd, though SGLang booted healthy on the previous setting every time. A start
    that leaves for a shutdown leaves cleanly: only kills count toward MAX_ATTEMPTS."""
    unit = make_unit(ORIGINAL_ENV)
    unit.extra_args = lambda steps: [*TWIN_TIMING, "--load-time-s", "30"]  # loads take 30 s
    stop = threading.Event()
    systemd = ShuttingDownSystemd(unit, stop, "stopping", 1)  # down while the target loads
    rec = Recorder(tmp_path / "state.json")
    outcome = applier_for(unit, rec, runner=systemd, stop=stop, startup_timeout_s=60.0).apply(
        4, 3, window_open=always_open
    )
    assert outcome.pending, outcome.message
    journal = rec.stored()
    for boot_n in range(2, 2 + MAX_ATTEMPTS):
        # Each boot starts SGLang (slow to load), and the box goes down again meanwhile.
        unit.stop()
        unit.start()
        stop = threading.Event()
        systemd = ShuttingDownSystemd(unit, stop, "stopping", 99)
        systemd.down.set()
        stop.set()
        rec = Recorder(tmp_path / f"state-{boot_n}.json")
        again = applier_for(unit, rec, runner=systemd, stop=stop, startup_timeout_s=60.0)
        outcome = again.reconcile(journal)
        assert outcome is not None
        assert outcome.pending, outcome.message
        journal = rec.stored()
        assert journal is not None
        assert journal["attempt"] == 0
    unit.extra_args = lambda steps: list(TWIN_TIMING)
    unit.stop()
    unit.start_healthy()  # the last boot: nothing interrupts it
    final = applier_for(unit, Recorder(tmp_path / "state-last.json")).reconcile(journal)
    assert final is not None
    assert final.result == "aborted", final.message  # no verdict on the target: no freeze
    assert "interrupted attempts" not in final.message
    assert unit.restarts == [4]
    assert unit.running_steps() == 3
    assert unit.env_file.read_bytes() == ORIGINAL_ENV


def test_a_bus_gone_without_a_stop_is_no_shutdown(make_unit: Any, tmp_path: Path) -> None:
    """systemd off the bus while specd was not asked to stop (dbus restarted on a running
    system): no shutdown is assumed, the load is waited for and verified as ever."""
    unit = make_unit()
    stop = threading.Event()
    systemd = ShuttingDownSystemd(unit, stop, "bus", 1, stop_too=False)
    rec = Recorder(tmp_path / "state.json")
    outcome = applier_for(unit, rec, runner=systemd, stop=stop).apply(4, 3, window_open=always_open)
    assert systemd.down.is_set()
    assert (outcome.result, outcome.pending) == ("success", False), outcome.message
    assert unit.running_steps() == 4


@pytest.mark.parametrize(
    ("make_env", "expect"),
    [
        (lambda tmp: tmp / "no-such-dir" / "sglang.env", "writing"),
        (lambda tmp: tmp, "cannot back up env file"),  # a directory
        (lambda tmp: _big_file(tmp / "big.env"), "larger than"),
        # A link is never read through (its target may be a secret) nor written through.
        (lambda tmp: _secret_link(tmp / "linked.env"), "is a symbolic link"),
        (lambda tmp: _fifo(tmp / "fifo.env"), "not a regular file (a FIFO)"),
    ],
)
def test_env_file_problems_abort_before_any_restart(
    make_unit: Any, tmp_path: Path, make_env: Callable[[Path], Path], expect: str
) -> None:
    # SGLang running: a stopped one is refused before its env file is read (below).
    unit = make_unit()
    env_file = make_env(tmp_path)
    before = env_file.read_bytes() if env_file.is_file() else None
    rec = Recorder(tmp_path / "journal.json")
    applier = make_applier(
        settings_for(env_file, quiet_deadline_s=0),
        SGLangClient(unit.url),
        unit,
        rec,
        threading.Event(),
    )
    outcome = applier.apply(4, 3, window_open=always_open)
    assert outcome.result == "aborted", outcome.message
    assert expect in outcome.message
    assert unit.restarts == []
    assert (env_file.read_bytes() if env_file.is_file() else None) == before
    assert not (tmp_path / "no-such-dir").exists()


def _big_file(path: Path) -> Path:
    path.write_bytes(b"# x\n" * 20_000)
    return path


SECRET = b"SPECD_SPEC_STEPS=6\nAPI_KEY=hunter2\n"


def _secret_link(path: Path) -> Path:
    secret = path.with_name("secret.env")
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    path.symlink_to(secret)
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_a_symlinked_env_file_is_refused_and_its_target_untouched(
    make_unit: Any, tmp_path: Path
) -> None:
    unit = make_unit()  # running: a stopped SGLang is refused before its env file is read
    env_file = _secret_link(tmp_path / "linked.env")
    rec = Recorder(tmp_path / "journal.json")
    applier = make_applier(
        settings_for(env_file, quiet_deadline_s=0),
        SGLangClient(unit.url),
        unit,
        rec,
        threading.Event(),
    )
    outcome = applier.apply(4, 3, window_open=always_open)
    assert outcome.result == "aborted", outcome.message
    assert f"{env_file}: is a symbolic link" in outcome.message
    assert env_file.is_symlink()
    secret = tmp_path / "secret.env"
    assert secret.read_bytes() == SECRET
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    # Nothing of the target reached the journal (state.json).
    assert rec.calls == []


class LinkPlantingRunner:
    """After the first restart went out, someone swaps the env file for a symlink."""

    def __init__(self, unit: TwinUnit, target: Path) -> None:
        self.unit = unit
        self.target = target
        self.calls = 0

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        result = self.unit(argv, timeout_s=timeout_s)
        if list(argv) != restart_argv(UNIT):
            return result
        self.calls += 1
        if self.calls == 1:
            self.unit.env_file.unlink()
            self.unit.env_file.symlink_to(self.target)
        return result


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_rollback_replaces_a_planted_symlink_with_the_previous_bytes(
    make_unit: Any, tmp_path: Path, umask: int
) -> None:
    unit = make_unit(ORIGINAL_ENV, lambda steps: ["--fail-start-at-steps", "4"])
    secret = tmp_path / "secret.env"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    rec = Recorder(tmp_path / "journal.json")
    old = os.umask(umask)
    try:
        outcome = applier_for(unit, rec, runner=LinkPlantingRunner(unit, secret)).apply(
            4, 3, window_open=always_open
        )
    finally:
        os.umask(old)
    assert outcome.result == "rolled_back", outcome.message
    assert unit.restarts == [4, 3]
    # The link itself was replaced: a regular file with the previous bytes, mode 0644.
    assert not unit.env_file.is_symlink()
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert stat.S_IMODE(os.lstat(unit.env_file).st_mode) == 0o644
    assert secret.read_bytes() == SECRET
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert unit.running_steps() == 3


# -- with a gateway: drain, restart, re-add ------------------------------------------------


@pytest.fixture(scope="module")
def other_twin() -> Iterator[TwinProcess]:
    """The second worker behind the gateway, one for the file: no test restarts, stops or
    inspects it (each has its own unit and smg); it only serves what is routed to it."""
    with ForkedTwin(TWIN_TIMING) as other:
        other.wait_healthy(START_TIMEOUT_S)
        yield other


@pytest.fixture
def second_worker(other_twin: TwinProcess) -> TwinProcess:
    if other_twin.poll() is not None:
        raise RuntimeError(f"the shared second twin exited: {other_twin.log()[-2000:]}")
    return other_twin


@pytest.fixture
def fleet(
    make_unit: Any, second_worker: TwinProcess
) -> Iterator[tuple[TwinUnit, TwinProcess, SmgGateway]]:
    """The unit specd restarts and a second twin behind one real smg (admin key set): the
    second serves what the gateway stops routing to the first while it is drained. smg does
    not retry, so a restart of a worker still routed to would reach the clients."""
    unit = make_unit()
    other = second_worker
    with QuickStopSmg([unit.url, other.url], admin_key=SMG_ADMIN_KEY, retries=False) as gateway:
        yield unit, other, gateway


def gateway_applier(
    unit: TwinUnit,
    gateway: SmgGateway | QueuedRemovalGateway,
    tmp_path: Path,
    rec: Recorder,
    runner: Callable[..., RunResult] | None = None,
    **overrides: Any,
) -> Applier:
    key_file = tmp_path / "gateway.key"
    key_file.write_text(SMG_ADMIN_KEY + "\n")
    return applier_for(
        unit,
        rec,
        runner,
        urls=[gateway.url],
        worker_url=unit.url,
        api_key_file=key_file,
        **{"drain_timeout_s": 20.0, "ready_timeout_s": 30.0, **overrides},
    )


def routed(gateway: SmgGateway, unit: TwinUnit) -> Worker | None:
    client = GatewayClient([gateway.url], unit.url, api_key=SMG_ADMIN_KEY)
    try:
        return client.find(gateway.url)
    finally:
        client.close()


def test_drain_restart_readd_under_streaming_load_every_request_completes(
    fleet: tuple[TwinUnit, TwinProcess, SmgGateway], tmp_path: Path
) -> None:
    unit, _, gateway = fleet
    before = routed(gateway, unit)
    assert before is not None
    assert before.status == "ready"
    rec = Recorder(tmp_path / "journal.json")
    applier = gateway_applier(unit, gateway, tmp_path, rec)
    # Requests long enough that a restart without a drain would cut some. The load runs
    # before, through and after the sequence; what a missing drain or re-add breaks shows
    # in the requests across the restart, so a round of the clients before (6, not 30)
    # and two after the re-add (12, not 30: round robin reaches the re-added worker) do.
    with StreamingLoad(gateway.url, 6, max_tokens=200) as load:
        load.wait_for(6)
        outcome = applier.apply(4, 3, window_open=always_open)
        served = load.ok
        load.wait_for(served + 12)
    assert outcome.result == "success", outcome.message
    assert load.failures == []
    assert unit.restarts == [4]
    assert unit.running_steps() == 4
    # The second "verifying" is the re-add, persisted before the sequence ends.
    assert rec.phases() == [
        "planned", "draining", "env_written", "restart_issued", "verifying", "verifying", "done"
    ]  # fmt: skip
    assert outcome.drain is not None
    assert (outcome.drain["result"], outcome.drain["in_flight_at_restart"]) == ("idle", 0)
    assert outcome.drain["replicas"] == 1
    assert outcome.drain["readd_problem"] is None
    after = routed(gateway, unit)
    assert after is not None
    assert after.status == "ready"
    assert (after.labels, after.settings) == (before.labels, before.settings)
    stored = rec.stored()
    assert stored is not None
    assert stored["readded"] is True
    assert [w["url"] for w in stored["drained"]] == [unit.url]


def test_an_env_file_edit_during_the_drain_is_what_the_rollback_puts_back(
    fleet: tuple[TwinUnit, TwinProcess, SmgGateway], tmp_path: Path
) -> None:
    """The env file was backed up before the drain (up to drain_timeout_s) and written after
    it: the on-call's edit meanwhile was overwritten unsaid, and a rollback put back the
    bytes from before it. Now the file is read again after the drain: the edit is backed
    up (env_file_edited), and the rollback of a target that fails puts it back."""
    unit, _, gateway = fleet
    unit.extra_args = lambda steps: [*TWIN_TIMING, *(["--fail-start-at-steps", "4"] * (steps == 4))]
    edit = ORIGINAL_ENV + b"# on-call, 03:12: GPU 3 swapped, see TICKET-1\nSGLANG_NOTE=swap\n"

    class EditsWhileDraining(Recorder):
        def __call__(self, journal: dict[str, Any] | None) -> None:
            super().__call__(journal)
            if journal is not None and journal["phase"] == "draining":
                unit.env_file.write_bytes(edit)

    rec = EditsWhileDraining(tmp_path / "journal.json")
    with structlog.testing.capture_logs() as logs:
        outcome = gateway_applier(unit, gateway, tmp_path, rec).apply(4, 3, window_open=always_open)
    assert outcome.result == "rolled_back", outcome.message
    assert unit.restarts == [4, 3]
    assert unit.env_file.read_bytes() == edit
    assert unit.running_steps() == 3
    said = [e for e in logs if e["event"] == "env_file_edited"]
    assert len(said) == 1, said
    assert "edited while the worker drained: backed up again" in said[0]["message"]
    stored = rec.stored()
    assert stored is not None
    assert any("edited while the worker drained" in m for m in stored["messages"])


def test_gateway_stopped_means_no_restart(
    fleet: tuple[TwinUnit, TwinProcess, SmgGateway], tmp_path: Path
) -> None:
    unit, _, gateway = fleet
    gateway.stop()
    rec = Recorder(tmp_path / "journal.json")
    outcome = gateway_applier(unit, gateway, tmp_path, rec).apply(4, 3, window_open=always_open)
    assert outcome.result == "aborted", outcome.message
    assert "cannot drain" in outcome.message
    assert "ConnectError" in outcome.message
    assert unit.restarts == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert outcome.drain is not None
    assert outcome.drain["result"] == "error"


def test_a_removal_the_gateway_queued_and_never_ran_means_no_restart(
    make_unit: Any, tmp_path: Path
) -> None:
    """smg queues a removal (DELETE: 202): while its entry is still ready the replica routes
    here, so a gateway that never runs the job is a drain that failed."""
    unit = make_unit()
    rec = Recorder(tmp_path / "journal.json")
    with QueuedRemovalGateway(unit.url, None) as gateway:
        applier = gateway_applier(unit, gateway, tmp_path, rec, request_timeout_s=1.0)
        outcome = applier.apply(4, 3, window_open=always_open)
    assert outcome.result == "aborted", outcome.message
    assert "drain failed" in outcome.message
    assert "worker still routed 1 s after its removal was accepted" in outcome.message
    assert "nothing was restarted" in outcome.message
    assert gateway.deletes == 1
    assert unit.restarts == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert outcome.drain is not None
    assert outcome.drain["result"] == "error"


def test_a_worker_the_gateway_knows_by_another_url_is_not_restarted(
    make_unit: Any, second_worker: TwinProcess, tmp_path: Path
) -> None:
    """The applier asks again before draining (the daemon's probe may be a tick old): a
    gateway that routes this server under another URL than specd's would keep routing to
    it through the restart."""
    unit = make_unit()
    listed = unit.url.replace("127.0.0.1", "localhost")
    with QuickStopSmg([listed, second_worker.url], admin_key=SMG_ADMIN_KEY) as gateway:
        rec = Recorder(tmp_path / "journal.json")
        outcome = gateway_applier(unit, gateway, tmp_path, rec).apply(4, 3, window_open=always_open)
        client = GatewayClient([gateway.url], listed, api_key=SMG_ADMIN_KEY)
        still = client.find(gateway.url)
        client.close()
    assert outcome.result == "aborted", outcome.message
    assert outcome.message == (
        f"cannot drain: gateway {gateway.url} lists this server as {listed}, not as "
        f'{unit.url}: set [gateway] worker_url = "{listed}"; nothing was restarted'
    )
    assert unit.restarts == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert still is not None
    assert still.status == "ready"


@pytest.mark.parametrize(
    ("case", "result", "why"),
    [
        ("timeout", "timeout", "not idle 1 s after the drain"),
        ("window_closes", "aborted", "window closed while draining"),
    ],
)
def test_not_idle_in_time_is_no_restart_and_readded(
    fleet: tuple[TwinUnit, TwinProcess, SmgGateway],
    tmp_path: Path,
    case: str,
    result: str,
    why: str,
) -> None:
    unit, _, gateway = fleet
    rec = Recorder(tmp_path / "journal.json")
    drain_timeout_s = 1.0 if case == "timeout" else 30.0
    applier = gateway_applier(unit, gateway, tmp_path, rec, drain_timeout_s=drain_timeout_s)
    closes = time.monotonic() + 1.0

    def window_open() -> bool:
        return case != "window_closes" or time.monotonic() < closes

    # Clients that bypass the gateway keep SGLang busy whatever the gateway routes.
    with Traffic(unit.url, 3, 60.0):
        wait_for_offered(SGLangClient(unit.url), 2)
        closes = time.monotonic() + 1.0
        outcome = applier.apply(4, 3, window_open=window_open)
    assert outcome.result == "aborted", outcome.message
    assert why in outcome.message
    assert "running" in outcome.message
    assert "nothing was restarted" in outcome.message
    assert unit.restarts == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert outcome.drain is not None
    assert outcome.drain["result"] == result
    assert outcome.drain["readd_problem"] is None
    after = routed(gateway, unit)
    assert after is not None
    assert after.status == "ready"


def test_failed_restart_rolls_back_and_readds(
    make_unit: Any, second_worker: TwinProcess, tmp_path: Path
) -> None:
    unit = make_unit(ORIGINAL_ENV, lambda steps: ["--fail-start-at-steps", "4"])
    other = second_worker
    with QuickStopSmg([unit.url, other.url], admin_key=SMG_ADMIN_KEY, retries=False) as gateway:
        rec = Recorder(tmp_path / "journal.json")
        applier = gateway_applier(unit, gateway, tmp_path, rec, startup_timeout_s=3.0)
        with StreamingLoad(gateway.url, 4) as load:
            load.wait_for(10)
            outcome = applier.apply(4, 3, window_open=always_open)
            load.wait_for(load.ok + 10)
        after = routed(gateway, unit)
    assert outcome.result == "rolled_back", outcome.message
    assert load.failures == []
    assert unit.restarts == [4, 3]
    assert unit.running_steps() == 3
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert outcome.drain is not None
    assert outcome.drain["readd_problem"] is None
    assert after is not None
    assert after.status == "ready"


class StopsAReplicaOnRestart:
    """The unit's runner; a gateway replica goes away as SGLang restarts (its host rebooted,
    a network blip) and is still away at the re-add."""

    def __init__(self, unit: TwinUnit, replica: SmgGateway) -> None:
        self.unit, self.replica = unit, replica

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        if list(argv) == restart_argv(UNIT):
            self.replica.stop()
        return self.unit(argv, timeout_s=timeout_s)


@contextlib.contextmanager
def one_replica_away_at_the_readd(
    unit: TwinUnit, second_worker: TwinProcess, tmp_path: Path, rec: Recorder
) -> Iterator[tuple[Applier, SmgGateway, SmgGateway]]:
    """An applier draining ``unit`` from two real smg replicas (``second_worker`` serves
    beside it) and (away, there): the first goes away as SGLang restarts and is still away
    at the re-add."""
    workers = [unit.url, second_worker.url]
    with (
        QuickStopSmg(workers, admin_key=SMG_ADMIN_KEY) as away,
        QuickStopSmg(workers, admin_key=SMG_ADMIN_KEY) as there,
    ):
        applier = gateway_applier(
            unit, there, tmp_path, rec, StopsAReplicaOnRestart(unit, away), ready_timeout_s=20.0
        )
        assert applier.gateway is not None
        applier.gateway.gateways = [away.url, there.url]  # the first one goes away
        yield applier, away, there


def test_a_replica_away_at_the_readd_leaves_the_worker_out_of_that_one_only(
    make_unit: Any, second_worker: TwinProcess, tmp_path: Path
) -> None:
    """Each replica is re-added on its own: the first one away must not keep the worker out
    of the others, which answer (the fleet would serve a server short until someone adds it
    back by hand)."""
    unit = make_unit()
    rec = Recorder(tmp_path / "journal.json")
    with one_replica_away_at_the_readd(unit, second_worker, tmp_path, rec) as (
        applier,
        away,
        there,
    ):
        outcome = applier.apply(4, 3, window_open=always_open)
        after = routed(there, unit)
    assert outcome.result == "success", outcome.message
    assert unit.restarts == [4]
    assert after is not None
    assert after.status == "ready"
    assert outcome.drain is not None
    problem = outcome.drain["readd_problem"]
    assert problem is not None
    assert problem.startswith(f"re-adding the worker failed on 1 of 2 replicas: gateway {away.url}")
    assert there.url not in problem


@pytest.mark.parametrize(
    ("kill_at", "kill_on_restart", "expect_result", "expect_restarts"),
    [
        # Killed once drained and the env file written (persist #2), before any restart.
        (2, None, "aborted", []),
        # Killed right after `systemctl restart` returned.
        (None, 1, "success", [4]),
    ],
)
def test_a_specd_killed_while_drained_readds_the_worker_on_its_next_start(
    fleet: tuple[TwinUnit, TwinProcess, SmgGateway],
    tmp_path: Path,
    kill_at: int | None,
    kill_on_restart: int | None,
    expect_result: str,
    expect_restarts: list[int],
) -> None:
    unit, _, gateway = fleet
    rec = Recorder(tmp_path / "journal.json", kill_at=kill_at, store_first=True)
    runner = KillingRunner(unit, kill_on_restart or 0)
    with pytest.raises(Killed):
        gateway_applier(unit, gateway, tmp_path, rec, runner=runner).apply(
            4, 3, window_open=always_open
        )
    drained = routed(gateway, unit)
    assert drained is None or drained.status == "draining"
    stored = rec.stored()
    assert stored is not None
    assert stored["drained"]
    assert stored["readded"] is False
    # The next specd: a new applier with nothing but the stored journal.
    after_rec = Recorder(tmp_path / "journal2.json")
    outcome = gateway_applier(unit, gateway, tmp_path, after_rec).reconcile(stored)
    assert outcome is not None
    assert outcome.result == expect_result, outcome.message
    assert unit.restarts == expect_restarts
    after = routed(gateway, unit)
    assert after is not None
    assert after.status == "ready"
    final = after_rec.stored()
    assert final is not None
    assert final["readded"] is True


# -- before anything changes: quiet moment, window, stop ----------------------------------


@pytest.mark.parametrize(
    ("target", "current", "why"),
    [(4, 4, "already runs 4"), (0, 3, "outside 1..6"), (7, 3, "outside 1..6")],
)
def test_pointless_or_out_of_range_targets_abort(
    make_unit: Any, tmp_path: Path, target: int, current: int, why: str
) -> None:
    unit = make_unit(start=False)
    rec = Recorder(tmp_path / "journal.json")
    outcome = applier_for(unit, rec).apply(target, current, window_open=always_open)
    assert (outcome.result, outcome.restarts_issued) == ("aborted", 0)
    assert why in outcome.message
    assert rec.calls == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV


@pytest.mark.parametrize(
    ("target", "outside"),
    [
        # Listed in adaptive_candidate_sets (the default list): SGLang's own set goes to 7,
        # past max_steps 6; the policy chooses it and a pin may hold it, yet every restart
        # into it was aborted here before anything was done.
        ("adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0", False),
        ("adaptive:3,7", True),
        ("adaptive:3,4", False),
    ],
)
def test_a_listed_set_past_the_step_range_is_no_target_out_of_range(
    make_unit: Any, tmp_path: Path, target: str, outside: bool
) -> None:
    unit = make_unit(start=False)
    rec = Recorder(tmp_path / "journal.json")
    outcome = applier_for(unit, rec).apply_setting(
        setting_parse(target), setting_static(3), window_open=always_open
    )
    # Stopped here, so aborted either way; out of range only where no rule allows it.
    assert outcome.result == "aborted"
    assert ("outside 1..6" in outcome.message) is outside, outcome.message
    assert unit.env_file.read_bytes() == ORIGINAL_ENV


class Traffic:
    """``n`` concurrent streaming completions against the twin, for ``seconds``."""

    def __init__(self, url: str, n: int, seconds: float, max_tokens: int = 1000) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.deadline = time.monotonic() + seconds
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(n)]

    def _client(self) -> None:
        while time.monotonic() < self.deadline:
            try:
                with httpx.stream(
                    "POST",
                    f"{self.url}/v1/completions",
                    json={
                        "model": "m",
                        "prompt": "x",
                        "max_tokens": self.max_tokens,
                        "stream": True,
                    },
                    timeout=10,
                    verify=verifying_context(),
                ) as resp:
                    for _ in resp.iter_bytes():
                        if time.monotonic() >= self.deadline:
                            break
            except httpx.HTTPError:
                return

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        """Each client ends its request at its next chunk and sends no more."""
        self.deadline = 0.0

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for t in self.threads:
            t.join(timeout=10)


def wait_for_offered(client: SGLangClient, at_least: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        obs = client.observe()
        if not isinstance(obs, Exception) and getattr(obs, "offered", 0) >= at_least:
            return
        time.sleep(0.05)
    pytest.fail(f"the twin never showed {at_least} offered requests")


@pytest.mark.parametrize(
    ("case", "expect_result", "expect_restarts"),
    [
        # The window closes while traffic stays heavy: nothing may change.
        ("window_closes", "aborted", []),
        # Heavy traffic past the quiet deadline, window still open: restart anyway.
        ("deadline_passes", "success", [4]),
        # Traffic stops before the deadline: restart at the quiet moment.
        ("traffic_ends", "success", [4]),
    ],
)
def test_quiet_moment_wait(
    make_unit: Any, tmp_path: Path, case: str, expect_result: str, expect_restarts: list[int]
) -> None:
    unit = make_unit()
    rec = Recorder(tmp_path / "journal.json")
    opened = time.monotonic()
    window_s = 0.6 if case == "window_closes" else 60.0
    deadline_s = 0.6 if case == "deadline_passes" else 30.0

    def window_open() -> bool:
        return time.monotonic() - opened < window_s

    applier = applier_for(unit, rec, quiet_concurrency_max=1, quiet_deadline_s=deadline_s)
    max_tokens = 150 if case == "traffic_ends" else 1000
    with Traffic(unit.url, 4, 60.0, max_tokens=max_tokens) as traffic:
        wait_for_offered(SGLangClient(unit.url), 3)
        if case == "traffic_ends":
            # The traffic ends a second after the twin showed it, however long a loaded
            # machine took to get there (a fixed second from the start could end first).
            ender = threading.Timer(1.0, traffic.stop)
            ender.start()
        opened = time.monotonic()
        outcome = applier.apply(4, 3, window_open=window_open)
        waited = time.monotonic() - opened
    assert outcome.result == expect_result, outcome.message
    assert unit.restarts == expect_restarts
    if case == "window_closes":
        assert "window closed" in outcome.message
        assert "offered concurrency" in outcome.message
        assert rec.calls == []
        assert unit.env_file.read_bytes() == ORIGINAL_ENV
    elif case == "deadline_passes":
        assert waited >= 0.6
    else:
        assert 0.5 <= waited < deadline_s  # it waited for the traffic to end, not the deadline


@pytest.mark.parametrize("stop_after_s", [0.0, 0.3])
def test_stop_during_quiet_wait_aborts_with_nothing_changed(
    make_unit: Any, tmp_path: Path, stop_after_s: float
) -> None:
    unit = make_unit()
    stop = threading.Event()
    timer = threading.Timer(stop_after_s, stop.set)
    rec = Recorder(tmp_path / "journal.json")
    applier = applier_for(unit, rec, stop=stop, quiet_concurrency_max=0, quiet_deadline_s=30)
    with Traffic(unit.url, 3, 60.0):
        wait_for_offered(SGLangClient(unit.url), 1)
        timer.start()
        started = time.monotonic()
        outcome = applier.apply(4, 3, window_open=always_open, force=True)
        elapsed = time.monotonic() - started
    timer.cancel()
    assert outcome.result == "aborted"
    assert "stop requested" in outcome.message
    assert elapsed < 5
    assert (rec.calls, unit.restarts) == ([], [])
    assert unit.env_file.read_bytes() == ORIGINAL_ENV


class StopsWhenQuiet(SGLangClient):
    """The SGLang reader; the stop (SIGTERM) arrives right after its ``nth`` read of a quiet
    SGLang: the end of the quiet-moment wait (1st) or of the drain (IDLE_READS-th). Quiet is
    what the applier takes for it: offered at most ``quiet_max`` (the quiet-moment wait's
    [restart] quiet_concurrency_max; the drain's idle is 0). A read of 1 (the twin's gauge
    still showing its warm-up request) ended the quiet-moment wait uncounted here, and the
    restart went out with no stop (seen once in a full run)."""

    def __init__(self, url: str, stop: threading.Event, nth: int, quiet_max: int = 0) -> None:
        super().__init__(url, timeout_s=3.0)
        self.stop, self.nth, self.quiet_max, self.quiet = stop, nth, quiet_max, 0

    def observe(self) -> Any:
        obs = super().observe()
        quiet = not isinstance(obs, Exception) and obs.offered <= self.quiet_max
        if quiet and not self.stop.is_set():
            self.quiet += 1
            if self.quiet == self.nth:
                self.stop.set()
        return obs


class StopsAtPhase(Recorder):
    """The state file; the stop arrives as the journal is saved in ``phase``."""

    def __init__(self, path: Path, stop: threading.Event, phase: str) -> None:
        super().__init__(path)
        self.stop, self.phase = stop, phase

    def __call__(self, journal: dict[str, Any] | None) -> None:
        super().__call__(journal)
        if journal is not None and journal["phase"] == self.phase:
            self.stop.set()


@pytest.mark.parametrize(
    ("gap", "gateway"),
    [
        pytest.param("quiet", False, id="the quiet moment found"),
        pytest.param("env_written", False, id="the env file written"),
        pytest.param("idle", True, id="the drain found SGLang idle"),
        pytest.param("planned", True, id="the change planned, before the drain"),
        # Not a stop: the on-call's freeze, read at the same last look.
        pytest.param("freeze", False, id="a freeze written as the env file is written"),
    ],
)
def test_a_stop_after_the_waits_ends_the_change_before_its_restart(
    make_unit: Any, second_worker: TwinProcess, tmp_path: Path, gap: str, gateway: bool
) -> None:
    """`systemctl stop specd` right after the last wait before the restart (the quiet moment,
    the drain) was not looked at: the restart went out all the same, and the stop then
    waited for SGLang's load. No new restart begins once a stop is asked for: the change
    ends aborted, the env file as it was, the worker back in routing."""
    unit = make_unit()
    stop = threading.Event()
    rec: Recorder = Recorder(tmp_path / "journal.json")
    frozen = threading.Event()
    if gap in ("env_written", "planned"):
        rec = StopsAtPhase(tmp_path / "journal.json", stop, gap)
    elif gap == "freeze":
        rec = StopsAtPhase(tmp_path / "journal.json", frozen, "env_written")
    nth = {"quiet": 1, "idle": IDLE_READS}.get(gap, 0)
    quiet_max = settings_for(unit.env_file).restart.quiet_concurrency_max if gap == "quiet" else 0
    client = StopsWhenQuiet(unit.url, stop, nth, quiet_max)
    with contextlib.ExitStack() as stack:
        overrides: dict[str, Any] = {}
        if gateway:
            smg = stack.enter_context(
                QuickStopSmg([unit.url, second_worker.url], admin_key=SMG_ADMIN_KEY)
            )
            key_file = tmp_path / "gateway.key"
            key_file.write_text(SMG_ADMIN_KEY + "\n")
            overrides = {"urls": [smg.url], "worker_url": unit.url, "api_key_file": key_file}
        settings = settings_for(unit.env_file, **overrides)
        applier = make_applier(settings, client, unit, rec, stop)
        started = time.monotonic()
        outcome = applier.apply(
            4,
            3,
            window_open=always_open,
            cancelled=lambda: "an override freezes specd now (t)" if frozen.is_set() else None,
        )
        took = time.monotonic() - started
        after = routed(smg, unit) if gateway else None
    assert stop.is_set() or frozen.is_set()
    assert outcome.result == "aborted", outcome.message
    when = "before the drain" if gap == "planned" else "before the restart went out"
    why = "an override freezes specd now (t)" if gap == "freeze" else "stop requested"
    assert outcome.message.startswith(f"{why} {when}"), outcome.message
    assert outcome.message.endswith("nothing was restarted"), outcome.message
    assert (unit.restarts, outcome.sglang_restarts) == ([], 0)
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert unit.running_steps() == 3
    assert rec.phases()[-1] == "aborted"
    assert took < 10  # ended at once, no load waited for
    if gateway:
        assert after is not None
        assert after.status == "ready"
        assert rec.phases()[:2] == (
            ["planned", "aborted"] if gap == "planned" else ["planned", "draining"]
        )


# -- reconcile: specd killed at every step ------------------------------------------------


class KillingRunner:
    """Runs the unit's restart, then dies (SIGKILL right after `systemctl` returned)."""

    def __init__(self, unit: TwinUnit, kill_on_restart: int) -> None:
        self.unit = unit
        self.kill_on_restart = kill_on_restart
        self.count = 0

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        result = self.unit(argv, timeout_s=timeout_s)
        if list(argv) != restart_argv(UNIT):
            return result
        self.count += 1
        if self.count == self.kill_on_restart:
            raise Killed(f"after restart #{self.count}")
        return result


# Persist order of the success path: planned 0, env_written 1, restart_issued 2,
# verifying 3, done 4. Of a target that fails to start: planned 0, env_written 1,
# restart_issued 2, rolling_back 3 (reason), 4 (env restored), 5 (rollback restart), rolled_back 6.
RECONCILE_CASES = [
    # id, target fails?, kill_at persist #, store_first, kill on restart #,
    #   stored phase, result, restarts in total, env steps after, running steps after
    ("before-planned", False, 0, False, None, None, None, [], 3, 3),
    ("planned", False, 0, True, None, "planned", "aborted", [], 3, 3),
    ("env-written-unjournalled", False, 1, False, None, "planned", "aborted", [], 3, 3),
    ("env-written", False, 1, True, None, "env_written", "aborted", [], 3, 3),
    (
        "restart-journalled-not-issued",
        False,
        2,
        True,
        None,
        "restart_issued",
        "rolled_back",
        [],
        3,
        3,
    ),
    ("restart-issued-loading", False, None, False, 1, "restart_issued", "success", [4], 4, 4),
    ("verifying", False, 3, True, None, "verifying", "success", [4], 4, 4),
    ("done-unjournalled", False, 4, False, None, "verifying", "success", [4], 4, 4),
    ("done", False, 4, True, None, "done", "success", [4], 4, 4),
    ("failing-target-loading", True, None, False, 1, "restart_issued", "rolled_back", [4, 3], 3, 3),
    ("rolling-back", True, 3, True, None, "rolling_back", "rolled_back", [4, 3], 3, 3),
    ("rollback-restart-loading", True, None, False, 2, "rolling_back", "rolled_back", [4, 3], 3, 3),
    # Journalled as issued but killed before `systemctl` ran: no second restart is risked,
    # so the bounded wait ends in "failed" (freeze) with the env file at the previous value.
    ("rollback-journalled-not-issued", True, 5, True, None, "rolling_back", "failed", [4], 3, None),
    ("rolled-back-unjournalled", True, 6, False, None, "rolling_back", "rolled_back", [4, 3], 3, 3),
]


class WithInvocations:
    """The twin unit, answering the `systemctl show` of its state as systemd does: its
    ActiveState, no job, and an InvocationID new at each start (kept once it ended)."""

    def __init__(self, unit: TwinUnit) -> None:
        self.unit = unit

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        args = list(argv)
        if args[:2] == ["systemctl", "show"] and "--property=InvocationID" in args:
            state = self.unit.is_active()
            lines = [
                f"ActiveState={state}",
                f"SubState={'running' if state == 'active' else 'dead'}",
            ]
            if self.unit.process is not None:
                lines.append(f"InvocationID={self.unit.process.pid:032x}")
            return answered(args, 0, "\n".join(lines) + "\n")
        return self.unit(argv, timeout_s=timeout_s)


@pytest.mark.parametrize(
    ("target_fails", "kill_at", "result", "restarts", "says"),
    [
        # The change's restart journalled, never issued: SGLang untouched, 4 never ran.
        (False, 2, "aborted", [], "specd was killed after journalling the restart, before it "
         "went out; nothing was restarted"),
        # The rollback's restart journalled, never issued: SGLang down on the failed 4.
        (True, 5, "rolled_back", [4, 3], "rolled back, verified 3 steps"),
    ],
)  # fmt: skip
def test_a_restart_journalled_but_never_issued_is_told_by_the_units_invocation(
    make_unit: Any,
    tmp_path: Path,
    target_fails: bool,
    kill_at: int,
    result: str,
    restarts: list[int],
    says: str,
) -> None:
    """Killed between journalling a restart as issued and `systemctl restart`: the next
    start took the change's for made (the target "rolled back" and frozen, though it never
    ran) and the rollback's too (waited for a start that never came: "failed", frozen, with
    SGLang left down on the failed target, two restarts counted for one). The journal keeps
    the unit's InvocationID from when it was written: still the unit's, with no job, the
    restart never went out."""
    unit = make_unit(
        ORIGINAL_ENV, lambda steps: ["--fail-start-at-steps", "4"] if target_fails else []
    )
    rec = Recorder(tmp_path / "state.json", kill_at=kill_at, store_first=True)
    with pytest.raises(Killed):
        applier_for(unit, rec, runner=WithInvocations(unit)).apply(4, 3, window_open=always_open)
    journal = rec.stored()
    assert journal is not None
    assert journal["issued_from"] is not None
    outcome = applier_for(
        unit,
        Recorder(tmp_path / "after.json"),
        runner=WithInvocations(unit),
        startup_timeout_s=10.0,
    ).reconcile(journal)
    assert outcome is not None
    assert outcome.result == result, outcome.message
    assert says in outcome.message, outcome.message
    assert unit.restarts == restarts
    assert unit.running_steps() == 3
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert outcome.sglang_restarts == len(restarts)


@pytest.mark.parametrize(
    (
        "target_fails",
        "kill_at",
        "store_first",
        "kill_on_restart",
        "stored_phase",
        "result",
        "restarts",
        "env_steps",
        "running",
    ),
    [pytest.param(*case[1:], id=case[0]) for case in RECONCILE_CASES],
)
def test_reconcile_after_kill_at_each_step(
    make_unit: Any,
    tmp_path: Path,
    target_fails: bool,
    kill_at: int | None,
    store_first: bool,
    kill_on_restart: int | None,
    stored_phase: str | None,
    result: str | None,
    restarts: list[int],
    env_steps: int,
    running: int | None,
) -> None:
    unit = make_unit(
        ORIGINAL_ENV, lambda steps: ["--fail-start-at-steps", "4"] if target_fails else []
    )
    rec = Recorder(tmp_path / "state.json", kill_at=kill_at, store_first=store_first)
    runner = KillingRunner(unit, kill_on_restart or 0)
    with pytest.raises(Killed):
        applier_for(unit, rec, runner=runner).apply(4, 3, window_open=always_open)
    journal = rec.stored()
    assert (journal or {}).get("phase") == stored_phase

    # specd's next start: a fresh Applier, a fresh client, the journal from "disk".
    after = Recorder(tmp_path / "state2.json")
    outcome = applier_for(unit, after).reconcile(journal)
    if result is None:
        assert outcome is None
    else:
        assert isinstance(outcome, ApplyOutcome)
        assert outcome.result == result, outcome.message
        assert (outcome.from_steps, outcome.to_steps) == (3, 4)
        if stored_phase == "done":
            assert after.calls == []  # a finished journal is only reported
        else:
            assert after.phases()[-1] == {"success": "done"}.get(result, result)
            assert after.phases()[-1] in PHASES
    assert unit.restarts == restarts  # never a second restart of a loading server
    assert read_env_steps(unit.env_file) == env_steps
    if env_steps == 3:
        assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert unit.running_steps() == running


def test_reconcile_gives_up_after_repeated_interruptions(make_unit: Any, tmp_path: Path) -> None:
    unit = make_unit(render_env(4).encode())  # running 4 (as the unit started), env says 4
    journal = _journal(
        phase="restart_issued",
        env_file=str(unit.env_file),
        previous_env=ORIGINAL_ENV.decode(),
        attempt=3,
        restarts_issued=1,
    )
    rec = Recorder(tmp_path / "state.json")
    outcome = applier_for(unit, rec).reconcile(journal)
    assert outcome is not None
    assert outcome.result == "failed"
    assert "gave up after 3 interrupted attempts" in outcome.message
    assert unit.restarts == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV


@pytest.mark.parametrize("phase", ["planned", "env_written", "restart_issued", "rolling_back"])
def test_a_journal_naming_another_env_file_is_reported_and_not_acted_on(
    make_unit: Any, tmp_path: Path, phase: str
) -> None:
    # A crafted state.json: "restore" one file (overwrite it) and "delete" another.
    victim = tmp_path / "victim.conf"
    victim.write_bytes(b"precious\n")
    unit = make_unit(start=False)
    rec = Recorder(tmp_path / "state.json")
    for previous in ("SPECD_SPEC_STEPS=1\n", None):
        journal = _journal(phase=phase, env_file=str(victim), previous_env=previous)
        outcome = applier_for(unit, rec).reconcile(journal)
        assert outcome is not None
        assert outcome.result == "failed"
        assert f"restart journal names env file {str(victim)!r}" in outcome.message
        assert f"not the configured {str(unit.env_file)!r}" in outcome.message
        assert "\n" not in outcome.message
        assert victim.read_bytes() == b"precious\n"
        assert unit.env_file.read_bytes() == ORIGINAL_ENV
        assert (rec.calls, unit.restarts) == ([], [])


@pytest.mark.parametrize(
    ("phase", "restarts_issued"),
    [("env_written", 0), ("restart_issued", 1), ("rolling_back", 1), ("rolling_back", 2)],
)
def test_a_journal_naming_another_unit_is_reported_and_not_acted_on(
    make_unit: Any, tmp_path: Path, phase: str, restarts_issued: int
) -> None:
    """The state (and the env file's path) came along to a specd configured for another
    unit (a reinstall for it, a config edited while specd was down): the journal's restart
    was of a unit this specd does not run. Healing it here put that unit's previous env file
    over this unit's and restarted this one, or verified it as the other's."""
    now_asks = render_env(5).encode()
    unit = make_unit(now_asks)  # this unit runs 5, as its env file says
    journal = _journal(
        phase=phase,
        unit="old-sglang.service",
        env_file=str(unit.env_file),
        previous_env=ORIGINAL_ENV.decode(),
        written_env=render_env(4),
        restarts_issued=restarts_issued,
    )
    rec = Recorder(tmp_path / "state.json")
    outcome = applier_for(unit, rec).reconcile(journal)
    assert outcome is not None
    assert outcome.result == "failed", outcome.message
    assert "restart journal names unit 'old-sglang.service'" in outcome.message
    assert f"not the configured {UNIT!r}" in outcome.message
    assert "\n" not in outcome.message
    assert unit.env_file.read_bytes() == now_asks
    assert (rec.calls, unit.restarts) == ([], [])
    assert unit.running_steps() == 5


def test_a_journal_naming_the_configured_env_file_is_acted_on(
    make_unit: Any, tmp_path: Path
) -> None:
    # The same journal with the configured path is resumed: the check is not a blanket no.
    unit = make_unit(render_env(4).encode(), start=False)
    journal = _journal(
        phase="env_written", env_file=str(unit.env_file), previous_env=ORIGINAL_ENV.decode()
    )
    outcome = applier_for(unit, Recorder(tmp_path / "state.json")).reconcile(journal)
    assert outcome is not None
    assert outcome.result == "aborted", outcome.message
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert unit.restarts == []


@pytest.mark.parametrize(
    "journal",
    [
        {"phase": "restart_issued"},
        {"version": 1, "phase": "x"},
        ["not", "a", "dict"],
        "junk",
        # Read as a verified restart to 99 steps, of an infinite duration, before.
        _journal(phase="done", to_steps=99, restart_issued_at=-1e308, finished_at=1e308),
    ],
)
def test_unreadable_journal_fails_without_touching_anything(
    make_unit: Any, tmp_path: Path, journal: Any
) -> None:
    unit = make_unit(start=False)
    rec = Recorder(tmp_path / "state.json")
    outcome = applier_for(unit, rec).reconcile(journal)
    assert outcome is not None
    assert outcome.result == "failed"
    assert "\n" not in outcome.message
    assert (rec.calls, unit.restarts) == ([], [])
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert outcome.duration_s == 0.0
    assert outcome.to_steps in (None, 4)  # never a step count no server runs


# -- the outcome check on every SGLang version -------------------------------------------


def _live_from_get_server_info(unit: TwinUnit) -> int:
    # /get_server_info answers on every version (the only name before 0.5.6).
    info = httpx.get(f"{unit.url}/get_server_info", timeout=5, verify=verifying_context()).json()
    return int(info["speculative_num_steps"])


@pytest.mark.parametrize(
    ("version", "evidence"),
    [
        # No sglang:spec_num_steps before 0.5.13: /get_server_info (0.5.4) or /server_info,
        # named as the endpoint that answered.
        ("0.5.4", "verified 4 steps (/get_server_info steps=4, /get_server_info draft_tokens=5)"),
        ("0.5.11", "verified 4 steps (/server_info steps=4, /server_info draft_tokens=5)"),
        (
            "0.5.13",
            "verified 4 steps (/server_info steps=4, /server_info draft_tokens=5, "
            "metrics steps=4, metrics draft_tokens=5)",
        ),
        (
            "0.5.23",
            "verified 4 steps (/server_info steps=4, /server_info draft_tokens=5, "
            "metrics steps=4, metrics draft_tokens=5)",
        ),
    ],
)
def test_restart_is_verified_on_every_sglang_version(
    make_unit: Any, tmp_path: Path, version: str, evidence: str
) -> None:
    # A decode log per batch: the warm-up's set sglang:spec_num_steps (0.5.13+).
    version_args = ["--sglang-version", version, "--decode-log-interval", "1"]
    unit = make_unit(ORIGINAL_ENV, lambda steps: version_args)
    rec = Recorder(tmp_path / "journal.json")
    outcome = applier_for(unit, rec).apply(4, 3, window_open=always_open)
    assert outcome.result == "success", outcome.message
    assert evidence in outcome.message
    assert unit.restarts == [4]
    assert _live_from_get_server_info(unit) == 4
    # Capacity after the restart: the scheduler's effective limit where SGLang reports it
    # (0.5.11+), else the max_running_requests argument (48 with speculation).
    assert outcome.capacity == (48 if version == "0.5.4" else 13)


@pytest.mark.parametrize(
    ("version", "endpoint"), [("0.5.4", "/get_server_info"), ("0.5.11", "/server_info")]
)
def test_rollback_is_verified_without_the_steps_gauge(
    make_unit: Any, tmp_path: Path, version: str, endpoint: str
) -> None:
    unit = make_unit(
        ORIGINAL_ENV, lambda steps: ["--sglang-version", version, "--fail-start-at-steps", "4"]
    )
    rec = Recorder(tmp_path / "journal.json")
    outcome = applier_for(unit, rec, startup_timeout_s=60.0).apply(4, 3, window_open=always_open)
    assert outcome.result == "rolled_back", outcome.message
    assert f"verified 3 steps ({endpoint} steps=3, {endpoint} draft_tokens=4)" in outcome.message
    assert unit.restarts == [4, 3]
    assert _live_from_get_server_info(unit) == 3
    assert unit.env_file.read_bytes() == ORIGINAL_ENV


# -- any speculative setting in the env file ------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "args"),
    [
        (setting_off(), ""),
        (
            setting_static(4),
            "--speculative-algorithm EAGLE3 --speculative-num-steps 4 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 5",
        ),
    ],
)
def test_render_setting_env_off_and_static(tmp_path: Path, setting: SpecSetting, args: str) -> None:
    text = render_setting_env(setting, algorithm="EAGLE3", config_dir=tmp_path)
    assert parse_env(text)[ENV_ARGS] == args
    env = tmp_path / "sglang.env"
    env.write_text(text)
    # Static stays readable by today's step reader; off names no step count.
    assert read_env_steps(env) == setting.steps


def test_adaptive_config_is_written_before_the_env_names_it(tmp_path: Path) -> None:
    setting = setting_parse("adaptive:3,4")
    path = write_adaptive_config(setting, tmp_path)
    assert json.loads(path.read_text()) == {"1": {"candidate_steps": [3, 4]}}
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    words = parse_env(render_setting_env(setting, algorithm="EAGLE", config_dir=tmp_path))[
        ENV_ARGS
    ].split()
    assert words[-3:] == ["--speculative-adaptive", "--speculative-adaptive-config", str(path)]
    assert words[words.index("--speculative-num-steps") + 1] == "4"


def test_adaptive_config_replaces_a_symlink_instead_of_writing_through_it(tmp_path: Path) -> None:
    setting = setting_parse("adaptive:1,3")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / adaptive_config_name(setting)).symlink_to(victim)
    path = write_adaptive_config(setting, tmp_path)
    assert victim.read_text() == "keep"
    assert not path.is_symlink()
    assert json.loads(path.read_text()) == {"1": {"candidate_steps": [1, 3]}}


def test_no_restart_without_its_journal_on_disk(make_unit: Any, tmp_path: Path) -> None:
    """The journal finishes or rolls back a restart after a crash and keeps the freeze after
    a failed one: a state directory that cannot take it (full, read-only) means no restart,
    and nothing changed."""
    unit = make_unit()
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    saved: list[dict[str, Any] | None] = []

    def persist(journal: dict[str, Any] | None) -> str | None:
        try:  # a real write that fails: the state "directory" is a regular file
            files.write_atomic(blocker / "state.json", json.dumps(journal).encode(), mode=0o600)
        except OSError as exc:
            return f"cannot write: {exc.strerror}"
        saved.append(journal)
        return None

    before = unit.env_file.read_bytes()
    outcome = applier_for(unit, persist).apply(4, 3, window_open=always_open)
    assert outcome.result == "aborted"
    assert "cannot save the restart journal (cannot write: Not a directory): no restart" in (
        outcome.message
    )
    assert (unit.restarts, saved) == ([], [])
    assert unit.env_file.read_bytes() == before
    assert unit.running_steps() == 3


class FailingStateDir:
    """The daemon's persist callback on a real state directory (a small tmpfs) that stops
    taking writes at the ``fail_at``-th save: the disk fills up, or is remounted read-only."""

    def __init__(self, state_dir: Path, fault: str, fail_at: int) -> None:
        self.store = StateStore(state_dir)
        self.state = self.store.fresh()
        self.fault = fault
        self.fail_at = fail_at
        self.calls = 0

    def __call__(self, journal: dict[str, Any] | None) -> str | None:
        if self.calls == self.fail_at:
            if self.fault == "disk full":
                filler = self.store.state_dir / "filler"
                with contextlib.suppress(OSError), filler.open("wb") as f:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                        os.fsync(f.fileno())
            else:
                subprocess.run(["mount", "-o", "remount,ro", str(self.store.state_dir)], check=True)
        self.calls += 1
        self.state.journal = journal
        return self.store.save(self.state)

    def on_disk(self) -> dict[str, Any] | None:
        state, problem = self.store.load()
        assert problem is None, problem
        return state.journal


@pytest.mark.parametrize("fault", ["disk full", "read-only"])
@pytest.mark.parametrize(
    ("fail_at", "on_disk"), [(1, "planned"), (2, "env_written")], ids=["env_written", "restart"]
)
def test_no_restart_once_the_journal_cannot_be_saved_mid_sequence(
    make_unit: Any, tmp_path: Path, fault: str, fail_at: int, on_disk: str
) -> None:
    """The plan was saved, then the state directory stopped taking writes: the journal on
    disk cannot say that a restart may have gone out, so none goes out. (Issued all the
    same, a specd killed while SGLang loaded found a journal saying none was issued on its
    next start: it put the previous env file back and called the change aborted, with
    SGLang running the new setting, unverified, and nothing frozen.)"""
    unit = make_unit()
    with mounted_tmpfs(tmp_path / "state", "512k") as state_dir:
        persist = FailingStateDir(state_dir, fault, fail_at)
        outcome = applier_for(unit, persist).apply(4, 3, window_open=always_open)
        journal = persist.on_disk()
    assert outcome.result == "aborted", outcome.message
    why = "No space left on device" if fault == "disk full" else "Read-only file system"
    assert f"cannot save the restart journal (cannot write {state_dir}" in outcome.message
    assert why in outcome.message
    assert "nothing was restarted" in outcome.message
    assert (outcome.restarts_issued, outcome.duration_s) == (0, 0.0)
    assert unit.restarts == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert unit.running_steps() == 3
    # What the next start finds on disk agrees with what happened: it changes nothing.
    assert journal is not None
    assert journal["phase"] == on_disk
    again = applier_for(unit, Recorder(tmp_path / "state2.json")).reconcile(journal)
    assert again is not None
    assert again.result == "aborted", again.message
    assert unit.restarts == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert unit.running_steps() == 3


# -- the env file edited by hand between restarts ---------------------------------------------


def test_an_env_file_edited_by_hand_is_reported_before_the_change_overwrites_it(
    make_unit: Any, tmp_path: Path
) -> None:
    """Someone wrote 5 steps into the env file and restarted nothing: SGLang runs 3. The
    change overwrites the file (its header says so; `specd override pin` is the way), and
    now says so first, naming both, in the log and in the journal; the journal keeps the
    file's bytes for a rollback. (It was overwritten silently.)"""
    unit = make_unit()
    edited = b"# tried 5 by hand\nSPECULATIVE_NUM_STEPS=5\nSPECULATIVE_NUM_DRAFT_TOKENS=6\n"
    unit.env_file.write_bytes(edited)
    rec = Recorder(tmp_path / "journal.json")
    applier = applier_for(unit, rec)
    assert not isinstance(applier.client.observe(), Exception)  # the daemon's tick before
    with structlog.testing.capture_logs() as logs:
        outcome = applier.apply(4, 3, window_open=always_open)
    assert outcome.result == "success", outcome.message
    assert unit.restarts == [4]
    said = [e for e in logs if e["event"] == "env_file_edited"]
    assert len(said) == 1, logs
    assert said[0]["log_level"] == "warning"
    assert (said[0]["env_file_asks"], said[0]["sglang_runs"]) == ("5 steps", "3 steps")
    planned = rec.calls[0]
    assert planned is not None
    assert planned["previous_env"] == edited.decode()
    assert any(
        f"{unit.env_file} asks for 5 steps, SGLang runs 3 steps" in m for m in planned["messages"]
    ), planned["messages"]


@pytest.mark.parametrize(
    ("env", "twin_args"),
    [
        (ORIGINAL_ENV, []),  # asks for what runs
        (None, []),  # no file: the drop-in's default runs
        (b"# not specd's\nOTHER=1\n", []),  # names no setting
        # /server_info does not say the step count: unknown, not another one (the file is
        # rewritten to 5 once SGLang runs 3).
        (
            render_env(5).encode(),
            ["--server-info-missing", "speculative_num_steps", "--decode-log-interval", "1"],
        ),
    ],
)
def test_an_env_file_that_asks_for_what_runs_or_nothing_is_not_reported(
    make_unit: Any, tmp_path: Path, env: bytes | None, twin_args: list[str]
) -> None:
    unit = make_unit(ORIGINAL_ENV if twin_args else env, lambda steps: twin_args)
    if twin_args:
        assert env is not None
        unit.env_file.write_bytes(env)
    applier = applier_for(unit, Recorder(tmp_path / "journal.json"))
    assert not isinstance(applier.client.observe(), Exception)
    with structlog.testing.capture_logs() as logs:
        outcome = applier.apply(4, 3, window_open=always_open)
    assert outcome.result == "success", outcome.message
    assert [e for e in logs if e["event"] == "env_file_edited"] == []


def test_a_gateway_replica_routing_the_server_again_after_the_drain_means_no_restart(
    make_unit: Any, tmp_path: Path
) -> None:
    """A replica that lists its workers in --worker-urls, redeployed (or crashed and back)
    while specd waited for SGLang to go idle, routes the server again under a new id. specd
    looked at the gateway once, at the drain, and restarted SGLang under the requests
    routed to it since. It looks again right before the restart."""
    unit = make_unit()
    gateway = QuickStopSmg([unit.url], admin_key=SMG_ADMIN_KEY, retries=False).wait_ready()
    rec = Recorder(tmp_path / "journal.json")
    replica = {"now": gateway, "restarted": False}

    def window_open() -> bool:
        # Asked while the applier waits for SGLang to go idle, once drained.
        if not replica["restarted"] and rec.phases()[-1:] == ["draining"]:
            replica["restarted"] = True
            old = replica["now"]
            old.stop()
            replica["now"] = QuickStopSmg(
                [unit.url], admin_key=SMG_ADMIN_KEY, retries=False, port=old.port
            ).wait_ready()
        return True

    try:
        outcome = gateway_applier(unit, gateway, tmp_path, rec).apply(4, 3, window_open=window_open)
        assert replica["restarted"]
        assert outcome.result == "aborted", outcome.message
        assert f"lists {unit.url} ready since the drain: no restart" in outcome.message
        assert unit.restarts == []
        assert unit.env_file.read_bytes() == ORIGINAL_ENV
        again = routed(replica["now"], unit)
        assert again is not None
        assert again.status == "ready"
    finally:
        replica["now"].stop()
