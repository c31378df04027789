"""The stand-in ``systemctl`` that runs a twin "unit" as a plain process: the fault tests
(tests/test_faults.py) and the fleet bench (bench/bench_fleet.py) restart SGLang through it
the way specd restarts a systemd unit, with no systemd on the machine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNIT = "sglang.service"
# A twin that "loads the model" in a blink, so a restart costs ~1-2 s of test time.
FAST_TWIN = ("--load-time-s", "0.2", "--warmup-s", "0.1")

# A `systemctl` for the daemon's PATH: restarts the twin like systemd restarts a unit with
# EnvironmentFile=- (the daemon passes children only PATH and LC_ALL, so everything the
# stand-in needs is written into it).
STANDIN = """#!{python}
import os, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from specd.twin.envfile import read_env_file

UNIT, ENV, PIDFILE, LOG, PORT = {unit!r}, Path({env!r}), Path({pidfile!r}), {log!r}, {port!r}
EXTRA, EXTRA_BY_STEPS, STOP_TIMEOUT_S = {extra!r}, {extra_by_steps!r}, {stop_timeout_s!r}
SPAWN = {spawn!r}


def alive(pid):
    try:
        with open(f"/proc/{{pid}}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def current():
    try:
        return int(PIDFILE.read_text())
    except (OSError, ValueError):
        return None


verbs = [a for a in sys.argv[1:] if not a.startswith("-")]
if verbs == ["is-active", UNIT]:
    pid = current()
    state = "active" if pid is not None and alive(pid) else "failed"
    print(state)
    sys.exit(0 if state == "active" else 3)
if verbs == ["show", UNIT] and "--property=TimeoutStopUSec" in sys.argv:
    print(f"{{STOP_TIMEOUT_S:g}}s")  # as `systemctl show --value` prints TimeoutStopSec=
    sys.exit(0)
if verbs == ["show", UNIT] and "--property=ExecStart" in sys.argv:
    # This unit reads the step variables (the form before `specd install` wrote
    # $SPECD_SPECULATIVE_ARGS): static step counts only.
    words = "{python} -m specd.cli twin --speculative-num-steps ${{SPECULATIVE_NUM_STEPS}} " \
        "--speculative-num-draft-tokens ${{SPECULATIVE_NUM_DRAFT_TOKENS}}"
    print(f"ExecStart={{{{ path={python} ; argv[]={{words}} ; ignore_errors=no ; "
          "start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }}}}")
    sys.exit(0)
if verbs != ["restart", UNIT]:
    print(f"stand-in systemctl: refused {{sys.argv[1:]}}", file=sys.stderr)
    sys.exit(1)
pid = current()
if pid is not None and alive(pid):
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
env = {{"SPECULATIVE_NUM_STEPS": "3", "SPECULATIVE_NUM_DRAFT_TOKENS": "4", **read_env_file(ENV)}}
argv = [{python!r}, "-m", "specd.cli", "twin", "--speculative-algorithm", "NEXTN",
        "--speculative-num-steps", env["SPECULATIVE_NUM_STEPS"], "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", env["SPECULATIVE_NUM_DRAFT_TOKENS"], "--enable-metrics",
        *EXTRA_BY_STEPS.get(env["SPECULATIVE_NUM_STEPS"], EXTRA), "--host", "127.0.0.1",
        "--port", str(PORT)]
if SPAWN is None:
    with open(LOG, "ab") as log:
        child = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd={repo!r})
    pid = child.pid
else:
    # A fork server that imported the twin once starts the same command, in this
    # environment, for a fraction of its CPU (tests/twin_zygote.py): one JSON line each
    # way, the answer the new pid.
    import json, socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.connect(SPAWN)
        request = {{"argv": argv[4:], "log": LOG, "session": True, "cwd": {repo!r},
                    "env": dict(os.environ)}}
        server.sendall(json.dumps(request).encode() + b"\\n")
        pid = int(json.loads(server.makefile("rb").readline())["pid"])
PIDFILE.write_text(str(pid))
with open(PIDFILE.with_suffix(".restarts"), "a") as f:
    f.write(env["SPECULATIVE_NUM_STEPS"] + "\\n")
"""


@dataclass
class StandIn:
    """The fake systemd side: a `systemctl` on PATH that owns one twin "unit"."""

    bin_dir: Path
    pidfile: Path
    env_file: Path
    port: int

    @property
    def restarts(self) -> list[int]:
        path = self.pidfile.with_suffix(".restarts")
        return [int(x) for x in path.read_text().split()] if path.exists() else []

    def systemctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin_dir / "systemctl"), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pidfile.read_text())
            os.kill(pid, signal.SIGKILL)


def make_standin(
    tmp_path: Path,
    port: int,
    extra: Sequence[str] = FAST_TWIN,
    extra_by_steps: dict[int, Sequence[str]] | None = None,
    stop_timeout_s: float = 10.0,
    *,
    spawn: str | None = None,
) -> StandIn:
    """``extra``: twin flags; ``extra_by_steps``: other flags for some step counts;
    ``stop_timeout_s``: the unit's TimeoutStopSec= (SIGKILL after it); ``spawn``: the Unix
    socket of a twin fork server to start each twin through (None: a new interpreter)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pidfile = tmp_path / "twin.pid"
    env_file = tmp_path / "sglang.env"
    script = bin_dir / "systemctl"
    script.write_text(
        STANDIN.format(
            python=sys.executable,
            repo=str(REPO),
            unit=UNIT,
            env=str(env_file),
            pidfile=str(pidfile),
            log=str(tmp_path / "twin.log"),
            port=port,
            extra=list(extra),
            extra_by_steps={str(k): list(v) for k, v in (extra_by_steps or {}).items()},
            stop_timeout_s=stop_timeout_s,
            spawn=spawn,
        )
    )
    script.chmod(0o755)
    return StandIn(bin_dir, pidfile, env_file, port)
