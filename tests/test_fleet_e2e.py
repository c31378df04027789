"""Issue 14 end to end, plain processes: one real smg (admin key, no retries, so a worker
restarted while still routed shows up as client errors) in front of twin "units", each
under its own real `specd run` with a [gateway] and a [fleet] on one real etcd (slots=1),
restarted by the stand-in systemctl of test_faults.

Nothing is pinned: every server starts at 4 steps, heavy streaming load through the
gateway makes the band policy (1-4 → 4 steps, more → 3) want 3 steps everywhere, and a
maintenance window opening a few seconds after the start lets all of them act in it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import SMG_ADMIN_KEY, EtcdProcess, SmgGateway, StreamingLoad
from test_faults import (
    UNIT,
    StandIn,
    daemon_env,
    healthy,
    log_events,
    make_standin,
    metric,
    start_specd,
    twin_argv,
    wait_for,
    write_config,
)

from specd.core.settings import FleetSettings
from specd.io.apply import render_env
from specd.io.fleet import Fleet
from specd.io.state import State, StateStore
from specd.twin.process import TwinProcess, free_port

pytestmark = pytest.mark.slow

TTL_S = 5
START_STEPS, HEAVY_STEPS = 4, 3
# A twin that loads in a second: a rolling change of three servers takes ~45 s. Deadlines
# are generous (not sleeps): with 2 cores shared, a `specd run` can take 30 s to import.
UNIT_TWIN = ("--load-time-s", "1.0", "--warmup-s", "0.1")
# Per server well above the 4 of the first band, even with all three routed.
CLIENTS_PER_SERVER = 6
# Three restarts of ~14 s each (drain, smg's 5 s settle before the re-add, ready) fit.
WINDOW_S = 58


@dataclass
class Server:
    """One box: the twin unit, its stand-in systemctl, its specd's files and process."""

    name: str
    home: Path
    standin: StandIn
    metrics_port: int
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return self.standin.url()

    @property
    def log(self) -> Path:
        return self.home / f"specd{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        self.proc = start_specd(self.home / "specd.toml", daemon_env(self.standin), self.log)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.proc = None  # dead on purpose: not an exit check_alive should report

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(40)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def state(self) -> State:
        state, problem = StateStore(self.home / "state").load()
        assert problem is None, problem
        return state

    def metric(self, name: str, **labels: str) -> float | None:
        if labels:
            name += "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
        return metric(self.metrics_port, name)

    def logs(self) -> str:
        return "\n".join(
            (self.home / f"specd{i}.log").read_text()[-3000:] for i in range(1, self.starts + 1)
        )


@dataclass
class Fleet3:
    servers: list[Server]
    gateway: SmgGateway
    etcd: EtcdProcess
    key_file: Path
    window_opens_at: float

    def workers(self) -> dict[str, str]:
        """Every worker's status in ONE answer of the gateway (an atomic view)."""
        resp = httpx.get(
            f"{self.gateway.url}/workers",
            headers={"Authorization": f"Bearer {SMG_ADMIN_KEY}"},
            timeout=2,
        )
        resp.raise_for_status()
        data = resp.json()
        items = data.get("workers", data) if isinstance(data, dict) else data
        return {str(w["url"]).rstrip("/"): str(w.get("status")) for w in items}

    def observer(self) -> Fleet:
        return Fleet(FleetSettings(etcd_endpoints=[self.etcd.url], group="g"), "observer")

    def check_alive(self) -> None:
        for s in self.servers:
            if s.proc is not None:
                assert s.alive(), f"specd {s.name} exited: {s.logs()}"


def window(opens_at: float, duration_s: float) -> dict[str, Any]:
    """A window every minute at the second of ``opens_at`` (6-field cron), ``duration_s`` long."""
    second = datetime.fromtimestamp(opens_at, tz=timezone.utc).second
    return {"cron": f"{second} * * * * *", "duration_s": duration_s, "timezone": "UTC"}


@contextlib.contextmanager
def fleet(
    tmp_path: Path,
    etcd: EtcdProcess,
    names: Sequence[str] = ("a", "b", "c"),
    *,
    plain_workers: int = 0,
    extra_by_steps: dict[int, Sequence[str]] | None = None,
    opens_in_s: float = 3.0,
    start: bool = True,
    **config: Any,
) -> Iterator[Fleet3]:
    """``names``: servers under a specd; ``plain_workers``: twins behind the gateway that no
    specd manages (at the heavy-load setting, so they never want a change)."""
    servers: list[Server] = []
    plain: list[TwinProcess] = []
    gateway = None
    key_file = tmp_path / "gateway.key"
    key_file.write_text(SMG_ADMIN_KEY + "\n")
    try:
        for name in names:
            home = tmp_path / name
            (home / "state").mkdir(parents=True)
            standin = make_standin(
                home,
                free_port(),
                extra=UNIT_TWIN,
                extra_by_steps=extra_by_steps,
                stop_timeout_s=3.0,
            )
            standin.env_file.write_text(render_env(START_STEPS))
            assert standin.systemctl("--no-ask-password", "restart", UNIT).returncode == 0
            servers.append(Server(name, home, standin, free_port()))
        for _ in range(plain_workers):
            plain.append(TwinProcess(twin_argv(HEAVY_STEPS)))
        for s in servers:
            wait_for(lambda s=s: healthy(s.url), 20, f"twin {s.name}")
        for twin in plain:
            twin.wait_healthy()
        gateway = SmgGateway(
            [s.url for s in servers] + [t.url for t in plain],
            admin_key=SMG_ADMIN_KEY,
            retries=False,
        ).wait_ready()
        # Rounded up so the 6-field cron's second is the one the window opens at.
        opens_at = float(int(time.time() + opens_in_s) + 1)
        for s in servers:
            keys: dict[str, Any] = dict(
                windows=[window(opens_at, WINDOW_S)],
                min_history_s=2,
                history_half_life_s=30,
                stabilization_window_s=0,
                min_dwell_s=0,
                warmup_exclude_s=1,
                daily_restart_budget=4,
                quiet_deadline_s=1,
                restart_cost_s=3,
                startup_timeout_s=15,
                etcd_endpoints=[etcd.url],
                group="g",
                slots=1,
                lease_ttl_s=TTL_S,
                etcd_timeout_s=1,
                holder_name=f"box-{s.name}",
                slot_poll_interval_s=0.2,
                urls=[gateway.url],
                api_key_file=str(key_file),
                drain_timeout_s=20,
                ready_timeout_s=30,
                request_timeout_s=2,
            )
            keys.update(config)
            write_config(s.home / "specd.toml", s.home, s.standin.port, s.metrics_port, **keys)
            if start:
                s.start()
        yield Fleet3(servers, gateway, etcd, key_file, opens_at)
    finally:
        for s in servers:
            s.stop()
        if gateway is not None:
            gateway.stop()
        for twin in plain:
            twin.stop()
        for s in servers:
            s.standin.stop()


def live_steps(server: Server) -> int | None:
    try:
        info = httpx.get(server.url + "/server_info", timeout=2).json()
    except httpx.HTTPError:
        return None
    steps = info.get("speculative_num_steps")
    return steps if isinstance(steps, int) else None


def assert_ended_well(f: Fleet3, server: Server, results: list[str]) -> None:
    """Routed ready, its slot given back, the journal closed, nothing in flight."""
    state = server.state()
    assert state.journal is None
    assert [r["result"] for r in state.restarts] == results, state.restarts
    assert f.workers()[server.url] == "ready"
    assert server.metric("specd_fleet_slot_held") == 0
    assert f.observer().holders() == []


def test_a_load_triggered_change_rolls_through_three_servers_with_zero_errors(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    with fleet(tmp_path, etcd) as f:
        load = StreamingLoad(f.gateway.url, CLIENTS_PER_SERVER * len(f.servers))
        with load:
            most_routed_out = most_down = 0
            deadline = time.monotonic() + 240
            while True:
                assert time.monotonic() < deadline, [s.standin.restarts for s in f.servers]
                f.check_alive()
                workers = f.workers()
                routed_out = [s.name for s in f.servers if workers.get(s.url) != "ready"]
                down = [s.name for s in f.servers if not healthy(s.url)]
                assert len(routed_out) <= 1, (routed_out, workers)
                assert len(down) <= 1, down
                most_routed_out = max(most_routed_out, len(routed_out))
                most_down = max(most_down, len(down))
                done = all(s.standin.restarts == [START_STEPS, HEAVY_STEPS] for s in f.servers)
                if done and not routed_out and not down:
                    break
                time.sleep(0.05)
            # A few more seconds of load on the new setting: still no error anywhere.
            load.wait_for(load.ok + 30)
        assert load.failures == []
        assert load.ok > 100
        # Each really was out (routed away and down) while it restarted.
        assert (most_routed_out, most_down) == (1, 1)
        for s in f.servers:
            wait_for(lambda s=s: s.state().journal is None, 10, f"{s.name} done")
        wait_for(lambda: f.observer().holders() == [], 10, "every slot released")
        for s in f.servers:
            assert_ended_well(f, s, ["success"])
            assert live_steps(s) == HEAVY_STEPS
            assert f"SPECULATIVE_NUM_STEPS={HEAVY_STEPS}" in s.standin.env_file.read_text()
            assert s.metric("specd_requests_in_flight_at_restart") == 0
            restart = s.state().restarts[0]
            assert (restart["from_steps"], restart["to_steps"]) == (START_STEPS, HEAVY_STEPS)
            # Inside a window (one a minute), on the load, not on a pin: the last in the
            # queue may spill into the next one when this machine restarts slowly.
            began = restart["t"] - restart["duration_s"]
            assert began >= f.window_opens_at
            assert (began - f.window_opens_at) % 60 < WINDOW_S, began
        # They wanted it together: all but the first found the one slot taken, and waited.
        waited = [s.metric("specd_decisions_total", reason="fleet_unavailable") for s in f.servers]
        assert sum(1 for n in waited if n) == len(f.servers) - 1, waited


def reason_count(server: Server, reason: str) -> float:
    return server.metric("specd_decisions_total", reason=reason) or 0.0


@pytest.mark.parametrize("down", ["etcd", "gateway"])
def test_no_restart_while_etcd_or_the_gateway_is_down_and_it_resumes_once_back(
    tmp_path: Path, etcd: EtcdProcess, down: str
) -> None:
    reason = "fleet_unavailable" if down == "etcd" else "drain_unavailable"
    with fleet(tmp_path, etcd, ("a",), plain_workers=1, start=False) as f:
        (s,) = f.servers
        gateway = f.gateway
        if down == "etcd":
            etcd.stop()
        else:
            gateway.stop()
        s.start()
        load = StreamingLoad(gateway.url, 2 * CLIENTS_PER_SERVER)
        # Through the gateway while it is up; straight at the twin while it is not.
        load.url = s.url if down == "gateway" else gateway.url
        with load:
            wait_for(lambda: reason_count(s, reason) >= 3 or not s.alive(), 90, reason)
            f.check_alive()
            assert s.metric("specd_last_decision", reason=reason) == 1
            assert s.standin.restarts == [START_STEPS]
            assert s.state().restarts == []
            if down == "etcd":
                etcd.start()
            else:
                gateway = SmgGateway(
                    gateway.worker_urls, admin_key=SMG_ADMIN_KEY, retries=False, port=gateway.port
                ).wait_ready()
        try:
            wait_for(lambda: s.state().restarts != [] or not s.alive(), 90, "the restart")
            f.check_alive()
            wait_for(lambda: s.state().journal is None, 20, "the restart done")
            wait_for(lambda: f.observer().holders() == [], 10, "the slot released")
            assert s.standin.restarts == [START_STEPS, HEAVY_STEPS]
            assert live_steps(s) == HEAVY_STEPS
            assert_ended_well(f, s, ["success"])
        finally:
            if down == "gateway":
                gateway.stop()


def test_a_setting_sglang_never_starts_at_rolls_back_readds_freezes_and_releases(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    failing = {HEAVY_STEPS: (*UNIT_TWIN, "--fail-start-at-steps", str(HEAVY_STEPS))}
    # The failed start shows at once (the twin exits); startup_timeout_s bounds the rollback's
    # start, which a loaded machine needs more than 5 s for.
    with fleet(tmp_path, etcd, ("a",), plain_workers=1, extra_by_steps=failing) as f:
        (s,) = f.servers
        with StreamingLoad(f.gateway.url, 2 * CLIENTS_PER_SERVER) as load:
            wait_for(lambda: s.state().restarts != [] or not s.alive(), 120, "the restart")
            f.check_alive()
            wait_for(lambda: f.workers().get(s.url) == "ready", 20, "the worker re-added")
            load.wait_for(load.ok + 20)
        assert load.failures == []
        assert s.standin.restarts == [START_STEPS, HEAVY_STEPS, START_STEPS]
        assert live_steps(s) == START_STEPS
        assert s.state().frozen is not None
        assert s.metric("specd_frozen") == 1
        wait_for(lambda: f.observer().holders() == [], 10, "the slot released")
        assert_ended_well(f, s, ["rolled_back"])


def test_a_specd_sigkilled_mid_restart_frees_the_slot_and_heals_its_worker_at_its_next_start(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    # SGLang loads for 2.5 s at the new setting: long enough to kill specd while it waits.
    slow = {HEAVY_STEPS: ("--load-time-s", "2.5", "--warmup-s", "0.1")}
    with fleet(tmp_path, etcd, ("a", "b"), plain_workers=1, extra_by_steps=slow) as f:
        with StreamingLoad(f.gateway.url, 3 * CLIENTS_PER_SERVER) as load:

            def restarting() -> Server | None:
                f.check_alive()
                found = [s for s in f.servers if s.standin.restarts == [START_STEPS, HEAVY_STEPS]]
                return found[0] if found else None

            wait_for(lambda: restarting() is not None, 90, "the first restart")
            killed = restarting()
            assert killed is not None
            other = next(s for s in f.servers if s is not killed)
            assert [h.name for h in f.observer().holders()] == [f"box-{killed.name}"]
            killed.kill()
            journal = killed.state().journal
            assert journal is not None
            assert journal["phase"] == "restart_issued"
            assert [w["url"] for w in journal["drained"]] == [killed.url]

            # Its lease expires: the other server takes the slot and restarts.
            wait_for(
                lambda: other.state().restarts != [] or not other.alive(), 90, "the other restart"
            )
            f.check_alive()
            assert [r["result"] for r in other.state().restarts] == ["success"]
            # Still drained from the gateway: nothing re-added it.
            assert f.workers().get(killed.url) != "ready"

            killed.start()
            wait_for(lambda: killed.state().journal is None or not killed.alive(), 60, "the heal")
            f.check_alive()
            wait_for(lambda: f.workers().get(killed.url) == "ready", 20, "the worker re-added")
            wait_for(lambda: f.observer().holders() == [], 10, "every slot released")
            load.wait_for(load.ok + 20)
        assert load.failures == []
        for s in f.servers:
            assert s.standin.restarts == [START_STEPS, HEAVY_STEPS]  # healed, not restarted again
            assert live_steps(s) == HEAVY_STEPS
            assert_ended_well(f, s, ["success"])
        released = [e for e in log_events(killed.log) if e.get("event") == "fleet_slot_released"]
        assert [e["detail"] for e in released] == ["released fleet slot 0 of group g"]
