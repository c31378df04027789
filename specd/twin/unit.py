"""The twin run as systemd would run an SGLang unit, for `specd demo` (and tests without
a systemd).

`TwinUnitRunner` is a `specd.runner.Runner`: it answers the one command apply issues,
``systemctl --no-ask-password restart UNIT`` (and the read-only ``systemctl is-active
UNIT``), the way systemd does for a unit with ``EnvironmentFile=-ENV`` and specd's drop-in:
``ExecStart=... $SPECD_SPECULATIVE_ARGS`` (the whole speculative argument set, split into
words; empty: none) when that variable is set, else the step-variable form
``--speculative-num-steps ${SPECULATIVE_NUM_STEPS}``. It stops the running process (SIGTERM,
then SIGKILL after a timeout), re-reads the env file, starts a new process with the values
expanded. Any other command is refused with exit
status 1, so a bug that tries to do more than restart the unit shows up.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from specd.io.config import Config
from specd.io.runner import RunResult
from specd.twin.envfile import read_env_file
from specd.twin.process import TwinProcess

DEFAULT_STEPS = 3
UNIT_NAME = "sglang-twin.service"
# specd.io.apply.ENV_ARGS, spelled out: the twin does not import specd's layers.
ENV_ARGS = "SPECD_SPECULATIVE_ARGS"


def twin_unit_config(workdir: Path, twin_port: int, **overrides: object) -> Config:
    """A specd config for the twin run as a unit: files under ``workdir``, no real unit.

    The demo, `specd sweep --twin` and tests start from it. ``overrides`` are tables merged
    key by key into these (``choose={"max_steps": 6}``) or the arrays (``windows=[...]``).
    """
    data: dict[str, object] = {
        "sglang": {
            "url": f"http://127.0.0.1:{twin_port}",
            "unit": UNIT_NAME,
            "env_file": str(workdir / "sglang.env"),
        },
        "files": {
            "state_dir": str(workdir / "state"),
            "override_file": str(workdir / "override.toml"),
        },
        "observe": {"scrape_timeout_s": 2.0},
        # The twin serves a load generator that never pauses: don't wait long for quiet.
        "restart": {
            "quiet_concurrency_max": 64,
            "quiet_deadline_s": 5.0,
            "startup_timeout_s": 60.0,
        },
        # The twin loads in seconds, not SGLang's minutes: one restart fits short windows.
        "choose": {"restart_cost_s": 5.0},
        "report": {"metrics_listen_address": "127.0.0.1", "metrics_port": 0},
    }
    for key, value in overrides.items():
        base = data.get(key)
        if isinstance(base, Mapping) and isinstance(value, Mapping):
            data[key] = {**base, **value}
        else:
            data[key] = value
    return Config.model_validate(data)


class TwinUnitRunner:
    """A `Runner` that restarts a twin process like `systemctl restart` restarts a unit."""

    def __init__(
        self,
        unit: str,
        env_file: Path,
        *,
        port: int,
        defaults: Mapping[str, str] | None = None,
        extra_args: Sequence[str] | Callable[[int], Sequence[str]] = (),
        stop_timeout_s: float = 10.0,
    ) -> None:
        self.unit = unit
        self.env_file = env_file
        self.port = port
        # Like the drop-in's Environment= line: used when the env file lacks a value.
        self.defaults = dict(
            defaults
            or {
                "SPECULATIVE_NUM_STEPS": str(DEFAULT_STEPS),
                "SPECULATIVE_NUM_DRAFT_TOKENS": str(DEFAULT_STEPS + 1),
            }
        )
        # Extra twin flags, or a function of the step count (to fail at one step count).
        self.extra_args = extra_args
        self.stop_timeout_s = stop_timeout_s
        self.process: TwinProcess | None = None
        # The step count of each restart, in order: 0 without speculation, the deepest
        # candidate under --speculative-adaptive.
        self.restarted_to: list[int] = []
        self.restarted_args: list[tuple[str, ...]] = []  # the speculative words of each
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        """Environment= defaults overlaid by EnvironmentFile=- (missing file: defaults)."""
        return {**self.defaults, **read_env_file(self.env_file)}

    def speculative_args(self) -> list[str]:
        """The speculative words the unit's ExecStart= expands to now."""
        env = self.environment()
        if ENV_ARGS in env:
            return env[ENV_ARGS].split()  # unbraced $NAME: split at whitespace
        return [
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-num-steps",
            env["SPECULATIVE_NUM_STEPS"],
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            env["SPECULATIVE_NUM_DRAFT_TOKENS"],
        ]

    def steps(self) -> int:
        """The step count the speculative words ask for (0: none)."""
        words = self.speculative_args()
        for word, following in itertools.pairwise(words):
            if word == "--speculative-num-steps" and following.isdigit():
                return int(following)
        return 0

    def argv(self) -> list[str]:
        steps = self.steps()
        extra = self.extra_args(steps) if callable(self.extra_args) else self.extra_args
        return [*self.speculative_args(), "--enable-metrics", *extra]

    def start(self) -> TwinProcess:
        with self._lock:
            self.process = TwinProcess(self.argv(), port=self.port)
            return self.process

    def stop(self) -> None:
        with self._lock:
            if self.process is not None:
                self.process.stop(timeout_s=self.stop_timeout_s)
                self.process = None

    def is_active(self) -> str:
        """What `systemctl is-active` would print: a crashed process is "failed"."""
        code = None if self.process is None else self.process.poll()
        if self.process is None:
            return "inactive"
        return "active" if code is None else ("inactive" if code == 0 else "failed")

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        started = time.monotonic()
        args = list(argv)
        verbs = [a for a in args[1:] if not a.startswith("-")]
        is_systemctl = bool(args) and Path(args[0]).name == "systemctl"
        if is_systemctl and verbs == ["is-active", self.unit]:
            state = self.is_active()
            return RunResult(
                argv=tuple(args),
                returncode=0 if state == "active" else 3,
                stdout=state + "\n",
                stderr="",
                timed_out=False,
                duration_s=time.monotonic() - started,
            )
        if is_systemctl and verbs == ["show", self.unit] and "--property=TimeoutStopUSec" in args:
            # Like systemd's `--value` output of TimeoutStopSec=, e.g. "10s".
            return RunResult(
                argv=tuple(args),
                returncode=0,
                stdout=f"{self.stop_timeout_s:g}s\n",
                stderr="",
                timed_out=False,
                duration_s=time.monotonic() - started,
            )
        if is_systemctl and verbs == ["show", self.unit] and "--property=ExecStart" in args:
            # As systemd prints it for specd's drop-in: the setting comes in $ENV_ARGS.
            words = f"twin --enable-metrics ${ENV_ARGS}"
            return RunResult(
                argv=tuple(args),
                returncode=0,
                stdout=f"ExecStart={{ path=twin ; argv[]={words} ; ignore_errors=no ; "
                "start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }\n",
                stderr="",
                timed_out=False,
                duration_s=time.monotonic() - started,
            )
        if not is_systemctl or verbs != ["restart", self.unit]:
            return RunResult(
                argv=tuple(args),
                returncode=1,
                stdout="",
                stderr=f"twin unit: only `systemctl restart|is-active|show {self.unit}` works",
                timed_out=False,
                duration_s=time.monotonic() - started,
            )
        # Like systemd: SIGTERM (SGLang drains), SIGKILL after the stop timeout; and like a
        # Type=simple unit, the command returns once the new process started, not loaded.
        self.stop()
        steps, args_now = self.steps(), tuple(self.speculative_args())
        self.start()
        # Counted once the new process exists, as systemd's restart job ends: a watcher
        # that acts on the count (an on-call's stop) finds that process, not the gap.
        self.restarted_to.append(steps)
        self.restarted_args.append(args_now)
        return RunResult(
            argv=tuple(args),
            returncode=0,
            stdout="",
            stderr="",
            timed_out=False,
            duration_s=time.monotonic() - started,
        )
