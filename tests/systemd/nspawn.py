"""A real systemd (PID 1 of a throw-away systemd-nspawn container) for tests.

The container boots this machine's own /usr (`-D / --volatile=yes`: the root is a tmpfs,
/usr is the host's, /etc and /var start empty and are populated by systemd at boot), has
only `lo`, and sees:

    host tmp dir         -> /etc/systemd/system      (rw: units the tests install)
    host tmp dir         -> /var/lib/specd           (rw: specd's StateDirectory)
    host tmp dir         -> /etc/specd               (rw: config, override)
    repo, venv, Python   -> same paths, read-only    (the code the units run)
    etc/sysusers.d/specd.conf, etc/polkit-1/rules.d/50-specd.rules from the repo, read-only

so the repo's own user definition and polkit rule are the ones in force. Commands run
inside through `nsenter` into PID 1's namespaces; HTTP to the container's loopback goes out
of the test process itself, on a socket made in the container's network namespace.

See /work/shared/testing.md for the recipe this follows.
"""

from __future__ import annotations

import compileall
import contextlib
import ctypes
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
VENV_PYTHON = VENV / "bin" / "python"
VENV_SPECD = VENV / "bin" / "specd"
INSIDE_SCRIPT = Path(__file__).resolve().parent / "inside.py"

SGLANG_UNIT = "sglang.service"
SPECD_UNIT = "specd.service"
TWIN_PORT = 30000
TWIN_URL = f"http://127.0.0.1:{TWIN_PORT}"
# Defaults written in systemd/sglang.service.d/50-specd.conf.
DROPIN_DEFAULT_STEPS = 3

CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Set-up, not a property under test: a booted container returns at once; a loaded 2-core
# machine has taken over 30 s to get the container's systemd to answer.
BOOT_TIMEOUT_S = 90.0
HALT_TIMEOUT_S = 15.0
# The twin's 503 period after its port opens (its own default is 1 s): specd's restart
# waits probe /health_generate every 2 s, so a start that fits in one period saves a
# round. Nothing here is about the warm-up's length.
TWIN_WARMUP_S = 0.2

GENERATORS = Path("/usr/lib/systemd/system-generators")
CLONE_NEWNET = 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True)


class ContainerError(RuntimeError):
    """The container could not be booted, or a command inside it failed."""


# What ProtectHome= hides from a service.
HOME_DIRS = ("/home", "/root", "/run/user")
# What PrivateTmp= replaces with an empty directory.
TMP_DIRS = ("/tmp", "/var/tmp")


def _under_home(path: Path) -> bool:
    return any(path == top or top in path.parents for top in map(Path, HOME_DIRS))


def code_paths() -> list[Path]:
    """The host paths the units' commands need: repo, venv and the interpreter the venv
    symlinks to (pyenv and the like put it outside /usr, e.g. under /root)."""
    paths: list[Path] = []
    for path in (REPO, VENV, Path(sys.base_prefix).resolve()):
        if path == Path("/usr") or Path("/usr") in path.parents:
            continue  # the container has the host's /usr already
        if not any(p == path or p in path.parents for p in paths):
            paths.append(path)
    return paths


def nspawn_unavailable_reason() -> str | None:
    """Why no container can be booted here, or None if it should work."""
    if shutil.which("systemd-nspawn") is None:
        return "systemd-nspawn not found (install systemd-container: scripts/install-system-deps)"
    for tool in ("nsenter", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} not found (util-linux)"
    if os.geteuid() != 0:
        return "systemd-nspawn needs root"
    return None


@dataclass
class Container:
    """A booted container. `sh` runs argv inside; unit helpers edit the bound units dir."""

    root: Path
    machine: str
    nspawn: subprocess.Popen[bytes] | None = None
    pid1: int = 0
    units_dir: Path = field(init=False)
    state_dir: Path = field(init=False)
    config_dir: Path = field(init=False)
    console_log: Path = field(init=False)
    _written: list[Path] = field(default_factory=list, init=False)
    _gids: dict[str, str] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.units_dir = self.root / "units"
        self.state_dir = self.root / "state"
        self.config_dir = self.root / "etc-specd"
        self.console_log = self.root / "console.log"

    # -- lifecycle ---------------------------------------------------------------------

    def boot(self, timeout_s: float = BOOT_TIMEOUT_S) -> None:
        """Boot; once more where the first boot never came up. A full run here once saw a
        container neither running nor failed after 90 s, with nothing on its console: the
        host's doing (nspawn on a loaded 2-core machine), not what any test is about."""
        stuck = self._boot_once(timeout_s)
        if stuck is None:
            return
        self.halt()
        again = self._boot_once(timeout_s)
        if again is not None:
            raise ContainerError(f"{stuck}\n--- booted again ---\n{again}")

    def _boot_once(self, timeout_s: float) -> str | None:
        """Boot the container: None once it runs; what was seen where it did not come up in
        ``timeout_s``. nspawn exiting, or a boot that ends degraded, raise at once."""
        for directory in (self.units_dir, self.state_dir, self.config_dir):
            directory.mkdir(parents=True, exist_ok=True)
        # The repo is read-only inside: every `specd` process there compiled the modules
        # the test process never imported (install, commands, twin, daemon) again, each run.
        compileall.compile_dir(REPO / "specd", quiet=1)
        # An empty /etc makes systemd-firstboot prompt on the console and the system
        # report "degraded"; the tests need neither.
        firstboot = self.units_dir / "systemd-firstboot.service"
        if not firstboot.is_symlink():  # booted before: a reboot on the same directories
            firstboot.symlink_to("/dev/null")
        # /etc is empty, so this is a "first boot" and systemd would apply the presets of
        # every package on the host (prometheus, postgresql, networkd, ...) into the units
        # dir and start them. The container runs only what the tests start. The first
        # matching preset line wins, and 00- sorts before the packages' 90-*.preset.
        preset = self.root / "00-specd-tests.preset"
        preset.write_text("disable *\n")
        # The host's generators (fstab, getty, sysv, cryptsetup, postgresql, ...) find
        # nothing to do in this empty /etc, yet systemd runs all of them at boot and at each
        # daemon-reload (the tests make hundreds): masked, a reload costs 0.04 CPU-s, not 0.1.
        generators = self.root / "generators"
        generators.mkdir(exist_ok=True)
        for generator in sorted(GENERATORS.iterdir()) if GENERATORS.is_dir() else []:
            masked = generators / generator.name
            if not masked.is_symlink():
                masked.symlink_to("/dev/null")
        argv = [
            # If pytest is killed outright (no finalizer, no atexit), nspawn still gets
            # SIGTERM, and halts its container instead of leaving a systemd running.
            "setpriv",
            "--pdeathsig=TERM",
            "systemd-nspawn",
            "-D",
            "/",
            "--volatile=yes",
            "--register=no",
            "--keep-unit",
            "--private-network",
            "-b",
            "-q",
            "--console=pipe",
            f"--machine={self.machine}",
            f"--bind={self.units_dir}:/etc/systemd/system",
            f"--bind-ro={preset}:/etc/systemd/system-preset/00-specd-tests.preset",
            f"--bind-ro={generators}:/etc/systemd/system-generators",
            f"--bind={self.state_dir}:/var/lib/specd",
            f"--bind={self.config_dir}:/etc/specd",
            f"--bind-ro={REPO / 'etc/sysusers.d/specd.conf'}:/etc/sysusers.d/specd.conf",
            f"--bind-ro={REPO / 'etc/polkit-1/rules.d/50-specd.rules'}"
            ":/etc/polkit-1/rules.d/50-specd.rules",
            *(f"--bind-ro={path}" for path in code_paths()),
        ]
        with self.console_log.open("wb") as console:
            self.nspawn = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            if self.nspawn.poll() is not None:
                raise ContainerError(
                    f"systemd-nspawn exited with {self.nspawn.returncode} while booting:\n"
                    + self.console_tail()
                )
            if not self.pid1:
                self.pid1 = self._find_pid1()
            if self.pid1:
                state = self.sh("systemctl", "is-system-running", check=False, timeout=5).stdout
                state = state.strip()
                if state == "running":
                    return
                if state == "degraded":
                    failed = self.sh("systemctl", "--failed", "--no-legend", check=False).stdout
                    raise ContainerError(f"container booted degraded; failed units:\n{failed}")
            time.sleep(0.1)
        return (
            f"container not running after {timeout_s:.0f} s (state {state!r}; "
            f"{self._process_states()}):\n{self.console_tail()}"
        )

    def _process_states(self) -> str:
        """nspawn's and the container's pid 1's state and where each waits in the kernel."""
        shown = []
        for name, pid in (("nspawn", self.nspawn.pid if self.nspawn else 0), ("pid 1", self.pid1)):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
            except (OSError, IndexError):
                shown.append(f"{name}: none" if not pid else f"{name} {pid}: gone")
                continue
            shown.append(f"{name} {pid}: state {stat}, waits in {wchan}")
        return "; ".join(shown)

    def _find_pid1(self) -> int:
        """The container's systemd: nspawn's only child (like `pgrep -P`; kernels without
        CONFIG_PROC_CHILDREN have no /proc/PID/task/TID/children)."""
        assert self.nspawn is not None
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.nspawn.pid:
                    return int(entry.name)
        return 0

    def halt(self) -> None:
        """Orderly halt (SIGTERM to nspawn = poweroff inside), then harder; idempotent."""
        proc, self.nspawn = self.nspawn, None
        if proc is not None and proc.poll() is None:
            # First SIGTERM: orderly halt; second: immediate termination; then SIGKILL.
            for sig, wait_s in (
                (signal.SIGTERM, HALT_TIMEOUT_S),
                (signal.SIGTERM, 5.0),
                (signal.SIGKILL, 5.0),
            ):
                proc.send_signal(sig)
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.pid1 = 0
        self._gids.clear()
        remove_nspawn_leftovers(self.machine)

    def console_tail(self, lines: int = 40) -> str:
        try:
            text = self.console_log.read_text(errors="replace")
        except OSError:
            return "(no console log)"
        return "\n".join(text.splitlines()[-lines:])

    # -- commands ----------------------------------------------------------------------

    def sh(
        self,
        *argv: str,
        check: bool = True,
        timeout: float = 30.0,
        user: str | None = None,
        input_text: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside the container (as root, or as `user` via setpriv)."""
        if not self.pid1:
            raise ContainerError("container is not running")
        prefix = ["nsenter", "-t", str(self.pid1), "-m", "-p", "-u", "-i", "-n", "--"]
        if user is not None:
            gid = self._primary_gid(user)
            prefix += ["setpriv", f"--reuid={user}", f"--regid={gid}", "--init-groups"]
        env = {"PATH": CONTAINER_PATH, "LC_ALL": "C", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}
        try:
            result = subprocess.run(
                [*prefix, *argv],
                input=input_text,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ContainerError(f"timed out after {timeout} s: {' '.join(argv)}") from exc
        if check and result.returncode != 0:
            raise ContainerError(
                f"exit {result.returncode}: {' '.join(argv)}\n"
                f"stdout: {result.stdout.strip()}\nstderr: {result.stderr.strip()}"
            )
        return result

    def _primary_gid(self, user: str) -> str:
        if user not in self._gids:
            self._gids[user] = self.sh("id", "-g", "--", user).stdout.strip()
        return self._gids[user]

    def systemctl(self, *args: str, check: bool = True, timeout: float = 30.0) -> str:
        try:
            return self.sh(
                "systemctl", "--no-ask-password", *args, check=check, timeout=timeout
            ).stdout
        except ContainerError as exc:
            # A unit that failed to start says why only in its journal: put it in the error.
            units = [a for a in args if a.endswith((".service", ".socket", ".timer"))]
            if not units or args[0] not in ("start", "restart", "reload", "enable"):
                raise
            journal = self.journal(units[-1], lines=40)
            raise ContainerError(f"{exc}\n--- journal of {units[-1]} ---\n{journal}") from exc

    def show(self, unit: str, prop: str) -> str:
        return self.systemctl("show", "--value", "-p", prop, unit).strip()

    def main_pid(self, unit: str) -> int:
        return int(self.show(unit, "MainPID") or 0)

    def active_state(self, unit: str) -> str:
        return self.show(unit, "ActiveState")

    def journal(self, unit: str, lines: int = 60) -> str:
        return self.sh(
            "journalctl",
            "-u",
            unit,
            "--no-pager",
            "-n",
            str(lines),
            "-o",
            "short-monotonic",
            check=False,
        ).stdout

    def python(
        self, *args: str, check: bool = True, timeout: float = 30.0, user: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The repo's venv interpreter, inside."""
        return self.sh(str(VENV_PYTHON), *args, check=check, timeout=timeout, user=user)

    def connect(self, host: str, port: int, timeout: float) -> socket.socket:
        """A TCP connection from inside the container's network namespace (it has only
        `lo`). setns() moves only the calling thread: a short-lived thread enters the
        namespace and connects, and the socket stays in that namespace whichever thread
        uses it. No process inside, so a probe costs no interpreter start."""
        if not self.pid1:
            raise ContainerError("container is not running")
        made: dict[str, Any] = {}

        def enter_and_connect() -> None:
            try:
                fd = os.open(f"/proc/{self.pid1}/ns/net", os.O_RDONLY)
                try:
                    if _LIBC.setns(fd, CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns: {os.strerror(err)}")
                finally:
                    os.close(fd)
                made["sock"] = socket.create_connection((host, port), timeout=timeout)
            except OSError as exc:
                made["error"] = exc

        thread = threading.Thread(target=enter_and_connect, name="netns-connect")
        thread.start()
        thread.join()
        if "error" in made:
            raise made["error"]
        sock: socket.socket = made["sock"]
        return sock

    def http_get(self, path: str, base: str = TWIN_URL, timeout: float = 10.0) -> dict[str, Any]:
        """GET on the container's loopback: {"status", "body", "error", "elapsed_s"};
        status None (and why in error) when nothing answered."""
        url = urlsplit(base + path)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        target = url.path + (f"?{url.query}" if url.query else "")
        started = time.monotonic()
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        result: dict[str, Any]
        try:
            conn.sock = self.connect(host, port, timeout)
            conn.request("GET", target or "/")
            response = conn.getresponse()
            body = response.read().decode("utf-8", "replace")
            result = {"status": response.status, "body": body, "error": None}
        except (OSError, http.client.HTTPException, ValueError) as exc:
            result = {"status": None, "body": "", "error": f"{type(exc).__name__}: {exc}"}
        finally:
            conn.close()
        result["elapsed_s"] = round(time.monotonic() - started, 3)
        return result

    def http_json(self, path: str, base: str = TWIN_URL) -> Any:
        result = self.http_get(path, base=base)
        if result["status"] != 200:
            raise ContainerError(f"GET {path}: {result}")
        return json.loads(result["body"])

    def wait_http(
        self, path: str, status: int = 200, base: str = TWIN_URL, timeout: float = 20.0
    ) -> dict[str, Any]:
        """Poll until `path` answers `status`; raise with the journal if not."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            left = deadline - time.monotonic()
            result = self.http_get(path, base=base, timeout=max(0.1, min(left, 5.0)))
            if result["status"] == status:
                result["elapsed_s"] = round(time.monotonic() - started, 3)
                return result
            if time.monotonic() >= deadline:
                raise ContainerError(
                    f"GET {path} never answered {status} within {timeout} s: {result}"
                    f"\n{self.journal(SGLANG_UNIT)}"
                )
            time.sleep(0.1)

    def wait_for(
        self,
        predicate: Callable[[], T],
        timeout: float = 10.0,
        interval: float = 0.1,
        what: str = "condition",
    ) -> T:
        """Poll `predicate` until it returns something truthy; return that value."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while True:
            try:
                value = predicate()
                if value:
                    return value
            except (ContainerError, ValueError) as exc:
                last_error = exc
            if time.monotonic() >= deadline:
                raise ContainerError(
                    f"timed out after {timeout} s waiting for {what}"
                    + (f" (last error: {last_error})" if last_error else "")
                )
            time.sleep(interval)

    # -- units -------------------------------------------------------------------------

    def write_unit(self, name: str, text: str) -> Path:
        """Write /etc/systemd/system/NAME (NAME may be "x.service.d/60-y.conf"); call
        daemon_reload() after the last one."""
        path = self.units_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self._written.append(path)
        return path

    def install_file(self, name: str, source: Path) -> Path:
        """Install a repo file, byte for byte, as /etc/systemd/system/NAME."""
        return self.write_unit(name, source.read_text())

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload")

    def reset(self) -> None:
        """Stop and remove everything a test installed; empty the state and config dirs."""
        units = sorted({self._unit_of(p) for p in self._written})
        if units:
            self.systemctl("stop", *units, check=False, timeout=60)
            self.systemctl("reset-failed", *units, check=False)
        for path in self._written:
            path.unlink(missing_ok=True)
            parent = path.parent
            if parent != self.units_dir and parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
        self._written.clear()
        for directory in (self.state_dir, self.config_dir):
            for child in directory.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        if self.pid1:
            self.daemon_reload()

    def _unit_of(self, path: Path) -> str:
        rel = path.relative_to(self.units_dir)
        top = rel.parts[0]
        return top[: -len(".d")] if top.endswith(".d") else top

    # -- the SGLang twin as sglang.service --------------------------------------------

    def write_env_file(self, steps: int, draft_tokens: int | None = None) -> Path:
        """What specd's apply writes for a static setting: /var/lib/specd/sglang.env."""
        draft = steps + 1 if draft_tokens is None else draft_tokens
        words = " ".join(static_args(str(steps), str(draft)))
        path = self.state_dir / "sglang.env"
        path.write_text(
            f"SPECD_SPECULATIVE_ARGS={words}\n"
            f"SPECULATIVE_NUM_STEPS={steps}\nSPECULATIVE_NUM_DRAFT_TOKENS={draft}\n"
        )
        return path

    def install_twin_sglang(
        self,
        load_time_s: float = 0.5,
        extra_args: Sequence[str] = (),
        unit: str = SGLANG_UNIT,
        port: int = TWIN_PORT,
        env_file: str | None = None,
        health_generates: bool = False,
    ) -> None:
        """sglang.service = the twin, with the repo's drop-in 50-specd.conf installed unchanged.

        The drop-in's ExecStart names the real SGLang launcher; a 60-twin.conf drop-in (read
        after it) swaps only that command for the twin, with the same unbraced
        $SPECD_SPECULATIVE_ARGS, so Environment= defaults and EnvironmentFile= are the repo's
        own. Several servers in one container: another `unit` name and `port`, and its own
        `env_file` (replacing the drop-in's /var/lib/specd/sglang.env, as an operator with
        several SGLang units on one box sets [sglang] env_file). /health answers at once
        (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false, as tests/conftest.py has it) unless
        `health_generates`: SGLang's default, a generation each probe.
        """
        self.write_unit(
            unit,
            "[Unit]\nDescription=SGLang twin (stands in for the GPU server)\n"
            # Tests start it many times within seconds; systemd's default limit (5 starts in
            # 10 s) would refuse a rollback's restart. A real SGLang loads for minutes.
            "StartLimitIntervalSec=0\n\n"
            "[Service]\nType=simple\n"
            # The operator's original command line, with a fixed step count: the
            # drop-in must replace it.
            f"ExecStart={twin_command(static_args('1', '2'), load_time_s=load_time_s, port=port)}\n"
            "TimeoutStopSec=30s\n",
        )
        self.install_file(
            f"{unit}.d/50-specd.conf", REPO / "systemd/sglang.service.d/50-specd.conf"
        )
        command = twin_command(
            [SPLIT_ARGS],
            load_time_s=load_time_s,
            extra_args=extra_args,
            port=port,
        )
        # The empty assignment drops the drop-in's env file from the list.
        env_lines = f"EnvironmentFile=\nEnvironmentFile=-{env_file}\n" if env_file else ""
        if not health_generates:
            env_lines += "Environment=SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false\n"
        self.write_unit(
            f"{unit}.d/60-twin.conf",
            f"[Service]\n{env_lines}ExecStart=\nExecStart={command}\n",
        )
        self.daemon_reload()

    def twin_server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.http_json("/server_info")
        return info

    # -- specd.service ----------------------------------------------------------------

    def install_specd(
        self,
        config_toml: str | None = None,
        exec_start: Sequence[str] | None = None,
        watchdog_sec: float | None = 2.0,
        service_overrides: Iterable[str] = (),
    ) -> None:
        """Install the repo's systemd/specd.service unchanged, plus a 60-test.conf drop-in.

        The drop-in points ExecStart at the repo venv (`specd run --config
        /etc/specd/specd.toml` unless `exec_start` says otherwise), shortens WatchdogSec=,
        and exposes the code paths that ProtectHome= would hide (only those). All other
        hardening stays as shipped. `config_toml` is written to /etc/specd/specd.toml;
        `service_overrides` are extra [Service] lines (e.g. "Type=oneshot").
        """
        if config_toml is not None:
            (self.config_dir / "specd.toml").write_text(config_toml)
        self.install_file(SPECD_UNIT, REPO / "systemd/specd.service")
        argv = (
            list(exec_start)
            if exec_start is not None
            else [str(VENV_SPECD), "run", "--config", "/etc/specd/specd.toml"]
        )
        lines = ["[Service]", "ExecStart=", "ExecStart=" + exec_line(argv)]
        if watchdog_sec is not None:
            lines.append(f"WatchdogSec={watchdog_sec}s")
        lines += specd_exposure_lines()
        lines += list(service_overrides)
        self.write_unit(f"{SPECD_UNIT}.d/60-test.conf", "\n".join(lines) + "\n")
        self.daemon_reload()


def _under_tmp(path: Path) -> bool:
    return any(path == top or top in path.parents for top in map(Path, TMP_DIRS))


def specd_exposure_lines() -> list[str]:
    """[Service] lines that let the hardened specd.service run the repo's code: the venv's
    interpreter may live under /root or /home, which ProtectHome=yes hides, and a CI clone
    may live under /tmp, which PrivateTmp=yes replaces."""
    home = [p for p in code_paths() if _under_home(p)]
    tmp = [p for p in code_paths() if _under_tmp(p)]
    lines = ["ProtectHome=tmpfs"] if home else []
    if home or tmp:
        lines.append("BindReadOnlyPaths=" + " ".join(map(str, home + tmp)))
    return lines


def static_args(steps: str, draft_tokens: str) -> list[str]:
    """A static setting's speculative words, as the operator's own command line has them."""
    return [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        steps,
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        draft_tokens,
    ]


def twin_command(
    speculative: Sequence[str],
    load_time_s: float = 0.5,
    extra_args: Sequence[str] = (),
    port: int = TWIN_PORT,
) -> str:
    """An ExecStart= command line running the twin as SGLang would be launched, with these
    speculative words (["$SPECD_SPECULATIVE_ARGS"] as specd's drop-in has them)."""
    argv = [
        str(VENV_SPECD),
        "twin",
        *speculative,
        "--enable-metrics",
        # SGLang sets sglang:spec_num_steps at its first decode log; one per decode batch,
        # so the warm-up's set it (the tests read it right after a start).
        "--decode-log-interval",
        "1",
        "--port",
        str(port),
        "--load-time-s",
        f"{load_time_s:g}",
        "--warmup-s",
        f"{TWIN_WARMUP_S:g}",
        *extra_args,
    ]
    return exec_line(argv)


_PLAIN_ARG = re.compile(r"[A-Za-z0-9_@+=:,./-]+")
_VARIABLE_ARG = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
SPLIT_ARGS = "$SPECD_SPECULATIVE_ARGS"  # unbraced: systemd splits its value into words


def exec_line(argv: Sequence[str]) -> str:
    """argv as an ExecStart= value: each argument arrives verbatim, except an argument that
    is exactly ${VAR}, which systemd expands from the unit's environment, and specd's
    $SPECD_SPECULATIVE_ARGS, which it expands and splits into words."""
    words = []
    for arg in argv:
        if _VARIABLE_ARG.fullmatch(arg) or arg == SPLIT_ARGS:
            words.append(arg)
            continue
        # % is a specifier and $ a variable to systemd, even inside quotes.
        escaped = arg.replace("%", "%%").replace("$", "$$")
        if not _PLAIN_ARG.fullmatch(arg):
            escaped = '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'
            escaped = escaped.replace("\n", "\\n")
        words.append(escaped)
    return " ".join(words)


_NSPAWN_RUN_DIRS = (
    "/run/systemd/nspawn/propagate",
    "/run/systemd/nspawn",
    "/run/systemd/nspawn-root",
)


_OUR_MACHINE_RE = re.compile(r"specd-[a-z0-9-]+-(\d+)")


def remove_nspawn_leftovers(machine: str) -> None:
    """nspawn leaves empty directories in /run; remove ours, those of our sessions that were
    killed outright (their pid is gone), and the shared ones once empty (rmdir refuses
    non-empty dirs and mount points, so a colleague's running container is safe)."""
    propagate = Path(_NSPAWN_RUN_DIRS[0])
    ours = [propagate / machine]
    with contextlib.suppress(OSError):
        for entry in propagate.iterdir():
            match = _OUR_MACHINE_RE.fullmatch(entry.name)
            if match and not Path(f"/proc/{match.group(1)}").exists():
                ours.append(entry)
    for directory in (*ours, *map(Path, _NSPAWN_RUN_DIRS)):
        with contextlib.suppress(OSError):
            directory.rmdir()


_MACHINE_RE = re.compile(r"[^a-z0-9-]")


def machine_name(tag: str) -> str:
    """A hostname-safe, per-process machine name (parallel sessions must not collide)."""
    return _MACHINE_RE.sub("-", f"specd-{tag}-{os.getpid()}".lower())[:60]
