"""The daemon with a [fleet]: etcd is asked when a tick would restart; no slot (etcd down,
or every slot held) means reason fleet_unavailable and no restart, until one is free.
A real etcd on loopback; SGLang and the restart scripted as in test_daemon."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from factories import EtcdProcess, tables
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs
from test_daemon import IN_WINDOW, Applier, Reader, config, daemon, obs

from specd.core.decide import Reason
from specd.core.observation import Observation, ScrapeError
from specd.core.settings import FleetSettings
from specd.daemon import Daemon
from specd.io.apply import Applier as RealApplier
from specd.io.fleet import Fleet, OutMarker, Slot
from specd.io.notify import Notifier
from specd.twin.process import free_port


def sample(d: Daemon, name: str, **labels: str) -> float | None:
    value: float | None = d.metrics.registry.get_sample_value(name, labels)
    return value


def test_no_slot_no_restart_and_it_resumes_when_etcd_is_back(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    cfg = config(tmp_path, etcd_endpoints=[etcd.url], group="g", etcd_timeout_s=1)
    clock = [IN_WINDOW]
    applier = Applier()
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), applier, clock)
    fleet = d._make_fleet(cfg)
    assert isinstance(fleet, Fleet)
    applier.fleet = fleet  # type: ignore[attr-defined]
    assert d.fleet is fleet

    etcd.stop()
    decision = d.tick()
    assert decision.reason is Reason.FLEET_UNAVAILABLE, decision.message
    assert f"no fleet slot can be taken (etcd {etcd.url} POST /v3/kv/range" in decision.message
    assert applier.calls == []
    assert sample(d, "specd_decisions_total", reason="fleet_unavailable") == 1
    assert sample(d, "specd_fleet_etcd_errors_total", kind="connect") == 1
    assert d.state.last_decision is not None
    assert d.state.last_decision["reason"] == "fleet_unavailable"

    # Back, but another server holds the only slot: still no restart, the message says who.
    etcd.start()
    assert cfg.fleet is not None
    other = Fleet(cfg.fleet, "box-b")
    slot = other.try_acquire()
    assert slot is not None
    clock[0] += 5
    decision = d.tick()
    assert decision.reason is Reason.FLEET_UNAVAILABLE
    assert "slot 0 held by box-b" in decision.message
    assert applier.calls == []

    assert other.release(slot) is None
    clock[0] += 5
    decision = d.tick()
    assert decision.reason is Reason.CHANGE, decision.message
    assert applier.calls == [("4", "3")]


def test_etcd_is_not_asked_when_no_restart_is_due(tmp_path: Path, etcd: EtcdProcess) -> None:
    cfg = config(tmp_path, etcd_endpoints=[etcd.url], group="g", etcd_timeout_s=1)
    clock = [IN_WINDOW]
    applier = Applier()
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=4)]), applier, clock)  # 4 already runs
    applier.fleet = d._make_fleet(cfg)  # type: ignore[attr-defined]
    etcd.stop()
    decision = d.tick()
    assert decision.reason is Reason.WITHIN_TOLERANCE, decision.message
    assert sample(d, "specd_fleet_etcd_errors_total", kind="connect") == 0


def test_the_slot_held_says_since_when_also_after_a_restart_of_specd(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    """SpecdFleetSlotHeldTooLong counts the hour from specd_fleet_slot_taken_timestamp_seconds:
    its `for: 1h` over specd_fleet_slot_held started over at every failed scrape, and at the
    restart of specd that a stuck sequence often gets."""
    cfg = config(tmp_path, etcd_endpoints=[etcd.url], group="g", etcd_timeout_s=1)
    clock = [IN_WINDOW]
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=4)]), Applier(), clock)
    taken = sample(d, "specd_fleet_slot_taken_timestamp_seconds")
    assert taken is not None
    assert math.isnan(taken)
    fleet = d._make_fleet(cfg)
    assert fleet is not None
    try:
        slot = fleet.try_acquire()
        assert slot is not None
        assert sample(d, "specd_fleet_slot_held") == 1
        assert sample(d, "specd_fleet_slot_taken_timestamp_seconds") == IN_WINDOW
    finally:
        fleet.close()

    # specd killed mid-sequence and started again 20 minutes later: the slot its journal
    # names is still held and kept, with the time it was taken.
    clock[0] += 1200
    again = daemon(cfg, Reader([obs(clock[0], steps=4)]), Applier(), clock)
    fleet = again._make_fleet(cfg)
    assert fleet is not None
    try:
        journaled = Slot.from_dict(json.loads(json.dumps(slot.to_dict())))
        assert fleet.holds(journaled) is None
        keeper = fleet.keep_alive(journaled)
        try:
            assert sample(again, "specd_fleet_slot_held") == 1
            assert sample(again, "specd_fleet_slot_taken_timestamp_seconds") == IN_WINDOW
        finally:
            keeper.stop()
        assert fleet.release(journaled) is None
    finally:
        fleet.close()
    assert sample(again, "specd_fleet_slot_held") == 0
    released = sample(again, "specd_fleet_slot_taken_timestamp_seconds")
    assert released is not None
    assert math.isnan(released)


def test_the_marker_gauge_follows_the_marker_in_etcd(tmp_path: Path, etcd: EtcdProcess) -> None:
    """specd_fleet_marked_out (SpecdFleetMarkerLeftBehind): 1 from the put to the removal."""
    cfg = config(tmp_path, etcd_endpoints=[etcd.url], group="g", etcd_timeout_s=1)
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=4)]), Applier(), [IN_WINDOW])
    assert sample(d, "specd_fleet_marked_out") == 0
    fleet = d._make_fleet(cfg)
    assert fleet is not None
    try:
        marker = fleet.out_marker(IN_WINDOW, 600)
        assert sample(d, "specd_fleet_marked_out") == 0  # a lease only: nothing counts yet
        fleet.mark_out(marker)
        assert sample(d, "specd_fleet_marked_out") == 1
        assert fleet.mark_in(marker) is None
        assert sample(d, "specd_fleet_marked_out") == 0
    finally:
        fleet.close()


class UnremovedMarker(Applier):
    """An applier whose last sequence's end could not remove its out-of-service marker:
    `retry_mark_in` fails ``failures`` times, then succeeds; each try's tick time kept."""

    def __init__(self, clock: list[float], failures: int) -> None:
        super().__init__()
        self.clock = clock
        self.failures = failures
        self.tries: list[float] = []
        self.serving: list[bool] = []

    def retry_mark_in(self, *, serving: bool = False) -> str | None:
        self.tries.append(self.clock[0])
        self.serving.append(serving)
        if len(self.tries) <= self.failures:
            return "removing the out-of-service marker failed (etcd away)"
        return None


@pytest.mark.parametrize(
    ("fleet", "ticks_s", "tries_s"),
    [
        pytest.param(True, [0, 5, 30, 59, 60, 61, 119, 125], [0, 60, 125], id="once a minute"),
        pytest.param(False, [0, 60, 120], [], id="no fleet: nothing to remove"),
    ],
)
def test_a_marker_left_in_etcd_is_tried_again_once_a_minute(
    tmp_path: Path, etcd: EtcdProcess, fleet: bool, ticks_s: list[float], tries_s: list[float]
) -> None:
    """Not at every tick (each try waits up to etcd_timeout_s while etcd is away), nor only at
    the next restart (the group's other servers wait for the marker meanwhile)."""
    cfg = config(tmp_path, etcd_endpoints=[etcd.url], group="g", etcd_timeout_s=1)
    clock = [IN_WINDOW]
    applier = UnremovedMarker(clock, failures=5)
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=4)]), applier, clock)
    if fleet:
        applier.fleet = d._make_fleet(cfg)  # type: ignore[attr-defined]
    for t in ticks_s:
        clock[0] = IN_WINDOW + t
        d.tick()
    assert [t - IN_WINDOW for t in applier.tries] == tries_s


def test_a_marker_an_earlier_run_left_is_looked_for_only_while_sglang_serves(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    """Not while SGLang does not answer (it may be out for a restart of someone else's) nor
    while a restart of specd's is pending (its marker is that sequence's)."""
    cfg = config(tmp_path, etcd_endpoints=[etcd.url], group="g", etcd_timeout_s=1)
    clock = [IN_WINDOW]
    applier = UnremovedMarker(clock, failures=5)
    results: list[Observation | ScrapeError] = [
        ScrapeError("refused", "connection refused", IN_WINDOW),
        obs(IN_WINDOW + 60, steps=4),
        obs(IN_WINDOW + 120, steps=4),
        obs(IN_WINDOW + 180, steps=4),
    ]
    d = daemon(cfg, Reader(results), applier, clock)
    applier.fleet = d._make_fleet(cfg)  # type: ignore[attr-defined]
    for t in (0, 60, 120, 180):
        clock[0] = IN_WINDOW + t
        # A sequence left for the next boot: its journal is kept in the state.
        d.state.journal = {"phase": "restarting", "from": 3, "to": 4} if t == 120 else None
        d.tick()
    assert applier.serving == [False, True, False, True]


@pytest.mark.parametrize(
    ("gateway", "serving"),
    [
        pytest.param(True, [False, True], id="a-replica-leaves-the-worker-out-then-routes-it"),
        # A reload removed the gateway: no replica left to leave the worker out.
        pytest.param(False, [True, True], id="no-gateway-configured"),
    ],
)
def test_a_marker_kept_while_a_replica_leaves_the_worker_out_waits_for_it(
    tmp_path: Path, etcd: EtcdProcess, gateway: bool, serving: list[bool]
) -> None:
    fields: dict[str, Any] = {"etcd_endpoints": [etcd.url], "group": "g", "etcd_timeout_s": 1}
    if gateway:  # nothing listens there: the worker stays left out as far as specd knows
        fields |= {"urls": [f"http://127.0.0.1:{free_port()}"], "request_timeout_s": 1.0}
    cfg = config(tmp_path, **fields)
    clock = [IN_WINDOW]
    applier = UnremovedMarker(clock, failures=0)
    results: list[Observation | ScrapeError] = [obs(IN_WINDOW, 4), obs(IN_WINDOW + 60, 4)]
    d = daemon(cfg, Reader(results), applier, clock)
    applier.fleet = d._make_fleet(cfg)  # type: ignore[attr-defined]
    worker = {"gateway_url": "http://127.0.0.1:1", "worker_id": "w", "url": "http://x"}
    for t in (0, 60):
        clock[0] = IN_WINDOW + t
        left_out = {"t": IN_WINDOW, "workers": [worker], "tried_at": IN_WINDOW, "problem": "away"}
        d.state.gateway = {"left_out": left_out} if t == 0 else {}
        d.tick()
    assert applier.serving == serving


@pytest.mark.parametrize("keeps_fleet", [False, True], ids=["fleet-removed", "fleet-rebuilt"])
def test_a_reload_that_rebuilds_the_fleet_resets_its_gauges(
    tmp_path: Path, etcd: EtcdProcess, keeps_fleet: bool
) -> None:
    """A marker etcd refused to remove kept specd_fleet_marked_out at 1: the fleet a reload
    builds forgets it, and nothing set the gauge again, so SpecdFleetMarkerLeftBehind fired
    until specd restarted (for good when the reload removed [fleet])."""
    fields: dict[str, Any] = {"etcd_endpoints": [etcd.url], "group": "g", "etcd_timeout_s": 1}
    cfg = config(tmp_path, **fields)
    d = Daemon(
        cfg,
        registry=CollectorRegistry(),
        clock=lambda: IN_WINDOW,
        notifier=Notifier({}),
    )  # its own reader and applier: a reload builds the fleet anew only for those
    assert d.fleet is not None
    d.metrics.fleet_marked_out.set(1)  # its hook, when etcd refused the removal
    d.config_path = tmp_path / "specd.toml"
    new = {
        "state_dir": str(tmp_path / "state"),
        "override_file": str(tmp_path / "override.toml"),
        "env_file": str(tmp_path / "sglang.env"),
        "group": "h",  # another group: its marker is not this one's to find
    }
    if keeps_fleet:
        new |= {"etcd_endpoints": [etcd.url], "etcd_timeout_s": 1}
    else:
        del new["group"]
    d.config_path.write_text(tomli_w.dumps(tables(**new)))
    d.reload()
    assert sample(d, "specd_config_reload_success") == 1
    marked = sample(d, "specd_fleet_marked_out")
    assert marked is not None
    if keeps_fleet:
        assert d.fleet is not None
        assert marked == 0
    else:
        assert d.fleet is None
        assert math.isnan(marked)
    assert sample(d, "specd_fleet_slot_held") == 0


def fleet_daemon(tmp_path: Path, etcd: EtcdProcess) -> Daemon:
    cfg = config(tmp_path, etcd_endpoints=[etcd.url], group="g", etcd_timeout_s=1)
    d = Daemon(cfg, registry=CollectorRegistry(), clock=time.time, notifier=Notifier({}))
    d.config_path = tmp_path / "specd.toml"
    return d


def reload_with(d: Daemon, tmp_path: Path, **fields: Any) -> list[dict[str, Any]]:
    base = {
        "state_dir": str(tmp_path / "state"),
        "override_file": str(tmp_path / "override.toml"),
        "env_file": str(tmp_path / "sglang.env"),
    }
    assert d.config_path is not None
    d.config_path.write_text(tomli_w.dumps(tables(**{**base, **fields})))
    with capture_logs() as logged:
        d.reload()
    assert sample(d, "specd_config_reload_success") == 1
    return logged


def left_marker(d: Daemon) -> OutMarker:
    """A marker of this server in etcd that a sequence's end could not remove, as the
    applier keeps it (etcd away then)."""
    assert d.fleet is not None
    assert isinstance(d.applier, RealApplier)
    marker = d.fleet.out_marker(time.time(), 600)
    assert d.fleet.mark_out(marker) is None
    d.applier.unremoved_out = marker
    return marker


def test_a_reload_keeping_the_fleet_goes_on_with_a_marker_etcd_did_not_remove(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    """Every reload builds a new applier; it forgot the marker the old one retried, and
    set specd_fleet_marked_out to 0, while the group still counted this server out (up to
    the marker's bound, ~66 min): SpecdFleetMarkerLeftBehind went quiet, nothing retried."""
    d = fleet_daemon(tmp_path, etcd)
    old = d.applier
    marker = left_marker(d)
    logged = reload_with(d, tmp_path, etcd_endpoints=[etcd.url], group="g", max_steps=5)
    assert d.applier is not old  # rebuilt, as every reload does
    assert isinstance(d.applier, RealApplier)
    assert d.applier.unremoved_out == marker
    assert sample(d, "specd_fleet_marked_out") == 1
    assert not [e for e in logged if e["event"] == "fleet_marker_left"]
    assert d.fleet is not None
    assert [o.name for o in d.fleet.busy().out] == [d.fleet.holder]
    assert d.applier.retry_mark_in() is None  # the new applier removes it
    assert d.fleet.busy().out == []


def test_a_reload_that_drops_the_fleet_says_when_it_leaves_a_marker_behind(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    d = fleet_daemon(tmp_path, etcd)
    marker = left_marker(d)
    etcd.stop()  # still away: the last try cannot remove it either
    logged = reload_with(d, tmp_path)
    assert d.fleet is None
    (left,) = [e for e in logged if e["event"] == "fleet_marker_left"]
    assert left["group"] == "g"
    assert marker.key in left["detail"]
    assert "the group counts this server out until " in left["detail"]
    marked = sample(d, "specd_fleet_marked_out")
    assert marked is not None
    assert math.isnan(marked)


def test_a_reload_that_drops_the_fleet_removes_a_marker_it_can(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    d = fleet_daemon(tmp_path, etcd)
    left_marker(d)
    watcher = Fleet.from_settings(
        FleetSettings(etcd_endpoints=[etcd.url], group="g", etcd_timeout_s=1), "watcher"
    )
    assert len(watcher.busy().out) == 1
    logged = reload_with(d, tmp_path)
    assert d.fleet is None
    assert not [e for e in logged if e["event"] == "fleet_marker_left"]
    assert watcher.busy().out == []
    watcher.close()
