"""A rolling change across three servers: wall time vs single restarts, requests served.

Real processes on loopback: one etcd, three twin servers each behind the stand-in
``systemctl`` (specd/twin/standin.py) and under its own ``specd run`` with [gateway] and
[fleet] slots=1, one ``smg`` gateway in front of them (retries off, so a request routed to a
restarting server reaches the client as an error), and streaming load through the gateway
all along. First each server alone takes a pin (apply = "now"), one after the other: the
sum of those single restarts. Then all three take another pin at once and queue for the
one slot: the rolling change. Each restart's time is its slot held (``fleet_slot_taken`` →
``fleet_slot_released`` in specd's log: drain, restart, verify, re-add, ready). Then the
same length of time with no change. It prints and writes (bench/results/fleet.md) the
rolling/sum ratio, the complete requests served during the rolling change against the
quiet period, the errors (must be 0) and the most servers out at once (must be 1).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` and `specd` importable
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import tomli_w  # noqa: E402

from specd.commands.args import Int, Seconds  # noqa: E402
from specd.core.settings import TABLE_OF_KEY  # noqa: E402
from specd.io.gateway import GatewayClient  # noqa: E402
from specd.io.tls import verifying_context  # noqa: E402
from specd.tools.loopback import (  # noqa: E402
    HEALTH_PROBE_TIMEOUT_S,
    EtcdProcess,
    SmgGateway,
    StreamingLoad,
    servers_out,
)
from specd.twin.process import free_port, stop_process  # noqa: E402
from specd.twin.standin import UNIT, StandIn, make_standin  # noqa: E402

RESULTS = REPO / "bench" / "results" / "fleet.md"
NAMES = ("a", "b", "c")
ADMIN_KEY = "bench-fleet-admin-key"
GROUP = "bench"


@dataclass(frozen=True)
class Span:
    """One server's slot held: from taking it to giving it back (wall clock, s)."""

    server: str
    taken: float
    released: float

    @property
    def seconds(self) -> float:
        return self.released - self.taken


@dataclass(frozen=True)
class Report:
    load_time_s: float
    clients: int
    singles: tuple[Span, ...]
    rolling: tuple[Span, ...]
    served_rolling: int
    served_quiet: int
    errors: int
    most_out: int
    first_errors: tuple[str, ...] = ()

    @property
    def singles_sum_s(self) -> float:
        return sum(s.seconds for s in self.singles)

    @property
    def rolling_s(self) -> float:
        return max(s.released for s in self.rolling) - min(s.taken for s in self.rolling)

    @property
    def time_ratio(self) -> float:
        return self.rolling_s / self.singles_sum_s

    @property
    def served_ratio(self) -> float:
        return self.served_rolling / self.served_quiet

    @property
    def overlap(self) -> bool:
        """Did two slot spans of the rolling change ever overlap (two servers out at once)?"""
        spans = sorted(self.rolling, key=lambda s: s.taken)
        return any(b.taken < a.released for a, b in itertools.pairwise(spans))


class Server:
    """One twin server: its stand-in unit, its specd config and, while running, its specd."""

    def __init__(self, home: Path, name: str, twin_flags: Sequence[str]) -> None:
        self.name = name
        self.home = home
        (home / "state").mkdir(parents=True)
        self.standin: StandIn = make_standin(home, free_port(), extra=twin_flags)
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start_unit(self) -> None:
        done = self.standin.systemctl("--no-ask-password", "restart", UNIT)
        if done.returncode != 0:
            raise RuntimeError(f"stand-in {self.name}: {done.stderr}")

    def configure(self, etcd_url: str, gateway_url: str, key_file: Path) -> None:
        values: dict[str, Any] = {
            "url": self.standin.url(),
            "state_dir": str(self.home / "state"),
            "env_file": str(self.standin.env_file),
            "override_file": str(self.home / "override.toml"),
            "metrics_port": free_port(),
            "scrape_interval_s": 0.5,
            "health_probe_timeout_s": 25,
            "startup_timeout_s": 60,
            "log_format": "json",
            "urls": [gateway_url],
            "api_key_file": str(key_file),
            "drain_timeout_s": 30.0,
            "etcd_endpoints": [etcd_url],
            "group": GROUP,
            "slots": 1,
            "lease_ttl_s": 10,
            "holder_name": f"box-{self.name}",
            "slot_poll_interval_s": 0.2,
        }
        data: dict[str, Any] = {}
        for key, value in values.items():
            data.setdefault(TABLE_OF_KEY[key], {})[key] = value
        (self.home / "specd.toml").write_text(tomli_w.dumps(data))

    def pin(self, steps: int) -> None:
        (self.home / "override.toml").write_text(
            f'mode = "pin"\nsteps = {steps}\nexpires_at = 2099-01-01T00:00:00Z\n'
            f'reason = "bench fleet"\napply = "now"\n'
        )

    @property
    def log(self) -> Path:
        return self.home / f"specd-{self.runs}.log"

    def start_specd(self) -> None:
        self.runs += 1
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECD_", "NOTIFY_"))}
        env["PATH"] = f"{self.standin.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "specd.cli",
                    "run",
                    "--config",
                    str(self.home / "specd.toml"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )

    def stop_specd(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 40)
            self.proc = None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"specd {self.name} exited: {self.log.read_text()[-3000:]}")

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return found

    def span(self) -> Span | None:
        """This run's slot span, once the slot is given back."""
        taken = released = None
        for e in self.events():
            if e.get("event") == "fleet_slot_taken" and taken is None:
                taken = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            if e.get("event") == "fleet_slot_released" and taken is not None:
                released = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00"))
                return Span(self.name, taken, released.timestamp())
        return None


def healthy(url: str) -> bool:
    try:
        return (
            httpx.get(
                url + "/health", timeout=HEALTH_PROBE_TIMEOUT_S, verify=verifying_context()
            ).status_code
            == 200
        )
    except httpx.HTTPError:
        return False


class Watch:
    """Samples, every ``interval_s``: the load's complete answers (wall clock) and how many
    servers are out (SGLang not healthy, or not ``ready`` in the gateway)."""

    def __init__(self, servers: Sequence[Server], gateway: SmgGateway, load: StreamingLoad) -> None:
        self.servers = servers
        self.load = load
        self.clients = {
            s.standin.url(): GatewayClient(
                [gateway.url], s.standin.url(), api_key=ADMIN_KEY, timeout_s=1.0
            )
            for s in servers
        }
        self.times: list[float] = []
        self.served: list[int] = []
        self.most_out = 0
        # One client for all the polling: a new one per probe loads the CA bundle each time.
        self.http = httpx.Client()

    def out(self) -> int:
        return len(servers_out(self.http, self.clients))

    def sample(self) -> int:
        self.times.append(time.time())
        self.served.append(self.load.ok)
        out = self.out()
        self.most_out = max(self.most_out, out)
        return out

    def served_between(self, start: float, end: float) -> int:
        """Complete answers between two wall-clock moments (nearest samples at or inside)."""
        i = bisect.bisect_left(self.times, start)
        j = bisect.bisect_right(self.times, end) - 1
        return self.served[j] - self.served[i]

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.http.close()


def until(predicate: Any, timeout_s: float, what: str, tick: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if tick is not None:
            tick()
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def fleet(
    root: Path, twin_flags: Sequence[str]
) -> Iterator[tuple[list[Server], SmgGateway, EtcdProcess]]:
    servers: list[Server] = []
    gateway: SmgGateway | None = None
    etcd = EtcdProcess(root / "etcd")
    try:
        etcd.start()
        for name in NAMES:
            servers.append(Server(root / name, name, twin_flags))
            servers[-1].start_unit()
        for s in servers:
            until(lambda s=s: healthy(s.standin.url()), 60, f"twin {s.name}")
        gateway = SmgGateway([s.standin.url() for s in servers], admin_key=ADMIN_KEY, retries=False)
        gateway.wait_ready(60)
        key_file = root / "admin.key"
        key_file.write_text(ADMIN_KEY + "\n")
        key_file.chmod(0o600)
        for s in servers:
            s.configure(etcd.url, gateway.url, key_file)
        yield servers, gateway, etcd
    finally:
        for s in servers:
            s.stop_specd()
        if gateway is not None:
            gateway.stop()
        for s in servers:
            s.standin.stop()
        etcd.stop()


def measure(root: Path, load_time_s: float, clients: int, max_tokens: int) -> Report:
    twin_flags = ("--load-time-s", f"{load_time_s:g}", "--warmup-s", "0.5")
    timeout_s = 60 + 10 * load_time_s
    with fleet(root, twin_flags) as (servers, gateway, _etcd):
        with StreamingLoad(gateway.url, clients, max_tokens=max_tokens) as load:
            watch = Watch(servers, gateway, load)
            try:
                load.wait_for(clients * 2, timeout_s=30)
                singles = []
                # Each server alone: 3 → 4 steps.
                for s in servers:
                    s.pin(4)
                    s.start_specd()

                    def tick(s: Server = s) -> None:
                        s.check_alive()
                        watch.sample()

                    until(lambda s=s: s.span() is not None, timeout_s, f"{s.name}'s restart", tick)
                    until(lambda: watch.sample() == 0, timeout_s, "all servers back")
                    span = s.span()
                    assert span is not None
                    singles.append(span)
                    s.stop_specd()
                single_most_out = watch.most_out
                # All three at once: 4 → 5 steps, queued for the one slot.
                watch.most_out = 0
                for s in servers:
                    s.pin(5)
                for s in servers:
                    s.start_specd()

                def rolling_done() -> bool:
                    for s in servers:
                        s.check_alive()
                    return all(s.span() is not None for s in servers)

                until(rolling_done, 3 * timeout_s, "the rolling change", tick=watch.sample)
                until(lambda: watch.sample() == 0, timeout_s, "all servers back")
                rolling = tuple(s.span() for s in servers)
                assert all(r is not None for r in rolling)
                spans = tuple(r for r in rolling if r is not None)
                most_out = watch.most_out
                # The same length of time with no change, right after.
                length = max(r.released for r in spans) - min(r.taken for r in spans)
                quiet_start = time.time()
                while time.time() < quiet_start + length + 0.2:
                    watch.sample()
                    time.sleep(0.1)
                served_rolling = watch.served_between(
                    min(r.taken for r in spans), max(r.released for r in spans)
                )
                served_quiet = watch.served_between(quiet_start, quiet_start + length)
            finally:
                watch.close()
        for s in servers:
            steps = s.standin.restarts
            if steps != [3, 4, 5]:
                raise RuntimeError(f"server {s.name} restarted as {steps}, not [3, 4, 5]")
        return Report(
            load_time_s=load_time_s,
            clients=clients,
            singles=tuple(singles),
            rolling=spans,
            served_rolling=served_rolling,
            served_quiet=served_quiet,
            errors=len(load.failures),
            most_out=max(most_out, single_most_out),
            first_errors=tuple(load.failures[:3]),
        )


def render(report: Report, argv: Sequence[str]) -> str:
    rerun = " ".join([".venv/bin/python -m bench fleet", *argv])
    lines = [
        "# A rolling change across three servers behind one gateway",
        "",
        f"Three twin servers (model load {report.load_time_s:g} s), each under its own `specd run` "
        "with [gateway] and [fleet] slots=1, one `smg` gateway (retries off), one etcd, "
        f"{report.clients} streaming clients through the gateway throughout; all real processes "
        "on loopback. A restart's time is its slot held (drain, restart, verify, re-add, ready). "
        f"Reproduce: `{rerun}`.",
        "",
        "| measure | value |",
        "|---|--:|",
        f"| rolling change / sum of the 3 single restarts (wall time) | ×{report.time_ratio:.2f} |",
        f"| complete requests during the rolling change / same length with no change "
        f"| ×{report.served_ratio:.2f} |",
        f"| failed requests (must be 0) | {report.errors} |",
        f"| most servers out at once (must be 1) | {report.most_out} |",
        "",
        "| restart | seconds |",
        "|---|--:|",
        *(f"| single {s.server} | {s.seconds:.1f} |" for s in report.singles),
        f"| sum of singles | {report.singles_sum_s:.1f} |",
        f"| rolling change, all three | {report.rolling_s:.1f} |",
        "",
        f"Requests: {report.served_rolling} complete during the rolling change, "
        f"{report.served_quiet} in the same length of time with no change.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, "
        "shared with other work: the seconds vary from run to run, the ratios far less.",
    ]
    return "\n".join(lines) + "\n"


LOAD_TIME_S = Seconds(0, 600)
CLIENTS = Int(1, 256)
MAX_TOKENS = Int(1, 100_000)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench fleet", description=__doc__)
    parser.add_argument(
        "--load-time-s",
        type=LOAD_TIME_S,
        default=4.0,
        help=f"twin model load time ({LOAD_TIME_S.spec})",
    )
    parser.add_argument(
        "--clients", type=CLIENTS, default=6, help=f"streaming clients ({CLIENTS.spec})"
    )
    parser.add_argument(
        "--max-tokens", type=MAX_TOKENS, default=40, help=f"tokens per request ({MAX_TOKENS.spec})"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the report")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        report = measure(Path(tmp), args.load_time_s, args.clients, args.max_tokens)
    flags = [a for i, a in enumerate(argv) if "--out" not in (a, argv[i - 1] if i else "")]
    text = render(report, [a for a in flags if not a.startswith("--out=")])
    args.out.write_text(text)
    print(text, end="")
    ok = report.errors == 0 and report.most_out == 1 and not report.overlap
    if not ok:
        print(f"FAILED: {report.first_errors}", file=sys.stderr)
    return 0 if ok else 1
