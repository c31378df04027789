"""The applier's fleet hooks: a slot before the restart, checked right before it, released at
every end; healed after a kill. Real twin units (test_apply's), a real etcd on loopback."""

from __future__ import annotations

import math
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from factories import EtcdProcess, module_etcd, module_etcd_server
from test_apply import (
    ORIGINAL_ENV,
    UNIT,
    Killed,
    KillingRunner,
    Recorder,
    TwinUnit,
    always_open,
    applier_for,
    make_unit,  # noqa: F401 - the fixture
    one_replica_away_at_the_readd,
    other_twin,  # noqa: F401 - the fixture
    routed,
    second_worker,  # noqa: F401 - the fixture
)

from specd.core.settings import FleetSettings, GatewaySettings, RestartSettings
from specd.io.apply import Applier, out_of_service_bound_s, restart_argv
from specd.io.fleet import Fleet, FleetHooks, Slot
from specd.io.runner import RunResult
from specd.twin.process import TwinProcess

TTL_S = 5
# One etcd for the module, reset between its tests (factories.module_etcd).
etcd, etcd_server = module_etcd, module_etcd_server


def fleet_for(url: str, name: str, hooks: FleetHooks | None = None, **fields: Any) -> Fleet:
    settings: dict[str, Any] = {
        "etcd_endpoints": [url],
        "group": "g",
        "lease_ttl_s": TTL_S,
        "etcd_timeout_s": 2,
        "slot_poll_interval_s": 0.05,
        "slot_wait_max_s": 60,
    }
    return Fleet(FleetSettings(**{**settings, **fields}), name, hooks=hooks)


def with_fleet(
    unit: TwinUnit,
    persist: Callable[[dict[str, Any] | None], None],
    fleet: Fleet,
    **overrides: Any,
) -> Applier:
    applier = applier_for(unit, persist, **overrides)
    applier.fleet = fleet
    return applier


# id, [restart] fields, [gateway] fields (None: no gateway), bound (README's formula)
BOUND_CASES = [
    ("defaults", {}, None, 4 * 420 + 3 * 600 + 6 * (2 + 30) + 300),
    ("defaults, gateway", {}, {}, 3972 + 5 + 300 + 2 * 120),
    (
        "long loads",
        {"startup_timeout_s": 3600, "restart_command_timeout_s": 900},
        None,
        4 * 900 + 3 * 3600 + 6 * 32 + 300,
    ),
    (
        "fractions round up",
        {"health_poll_interval_s": 0.5, "startup_timeout_s": 10.1},
        {"drain_timeout_s": 1, "ready_timeout_s": 1, "request_timeout_s": 0.2},
        math.ceil(4 * 420 + 3 * 10.1 + 6 * 30.5 + 300 + 0.2 + 1 + 2),
    ),
]


@pytest.mark.parametrize(
    ("restart", "gateway", "bound"), [pytest.param(*c[1:], id=c[0]) for c in BOUND_CASES]
)
def test_the_out_of_service_bound_is_the_readme_formula(
    restart: dict[str, Any], gateway: dict[str, Any] | None, bound: int
) -> None:
    gw = None if gateway is None else GatewaySettings(urls=["http://10.0.0.2:30080"], **gateway)
    assert out_of_service_bound_s(RestartSettings(**restart), gw) == bound


class WatchingRunner:
    """The unit, plus who held the group's slots at each `systemctl restart`."""

    def __init__(self, unit: TwinUnit, watcher: Fleet) -> None:
        self.unit = unit
        self.watcher = watcher
        self.holders_at_restart: list[list[str]] = []

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        if list(argv) == restart_argv(UNIT):
            self.holders_at_restart.append([h.name for h in self.watcher.holders()])
        return self.unit(argv, timeout_s=timeout_s)


def test_a_restart_holds_a_slot_and_releases_it(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    unit = make_unit(ORIGINAL_ENV)
    rec = Recorder(tmp_path / "journal.json")
    watcher = fleet_for(etcd.url, "watcher")
    runner = WatchingRunner(unit, watcher)
    applier = with_fleet(unit, rec, fleet_for(etcd.url, "box-a"), runner=runner)
    outcome = applier.apply(4, 3, window_open=always_open)
    assert outcome.result == "success", outcome.message
    assert runner.holders_at_restart == [["box-a"]]
    assert watcher.holders() == []
    journal = rec.stored()
    assert journal is not None
    assert journal["fleet_slot"]["key"] == "/specd/g/slots/0"
    assert journal["fleet_released"] is True
    assert journal["messages"][-1] == "done: released fleet slot 0 of group g"
    assert all(c is not None and c["fleet_slot"] for c in rec.calls)  # from the first write


def test_a_target_that_fails_is_rolled_back_and_the_slot_released(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    unit = make_unit(ORIGINAL_ENV, lambda steps: ["--fail-start-at-steps", "4"])
    rec = Recorder(tmp_path / "journal.json")
    watcher = fleet_for(etcd.url, "watcher")
    runner = WatchingRunner(unit, watcher)
    applier = with_fleet(unit, rec, fleet_for(etcd.url, "box-a"), runner=runner)
    outcome = applier.apply(4, 3, window_open=always_open, force=False)
    assert outcome.result == "rolled_back", outcome.message
    assert unit.restarts == [4, 3]
    assert runner.holders_at_restart == [["box-a"], ["box-a"]]  # the rollback too
    assert watcher.holders() == []


class EtcdGoneAfterRestart:
    """The unit; etcd stops right after `systemctl restart` returned (the marker is in etcd,
    its removal at the sequence's end will not be)."""

    def __init__(self, unit: TwinUnit, etcd: EtcdProcess) -> None:
        self.unit = unit
        self.etcd = etcd

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        result = self.unit(argv, timeout_s=timeout_s)
        if list(argv) == restart_argv(UNIT):
            self.etcd.stop()
        return result


def test_a_marker_etcd_did_not_remove_at_the_end_is_removed_once_it_answers(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    """Else the group's other servers wait for this one, back in service, up to the
    marker's bound (an hour): `retry_mark_in`, asked by the daemon once a minute."""
    unit = make_unit(ORIGINAL_ENV)
    marked: list[bool] = []  # what specd_fleet_marked_out follows
    applier = with_fleet(
        unit,
        Recorder(tmp_path / "journal.json"),
        fleet_for(etcd.url, "box-a", FleetHooks(out=marked.append), etcd_timeout_s=1),
        runner=EtcdGoneAfterRestart(unit, etcd),
    )
    outcome = applier.apply(4, 3, window_open=always_open)
    assert outcome.result == "success", outcome.message
    marker = applier.unremoved_out
    assert marker is not None
    assert applier.retry_mark_in() is not None  # etcd still away: kept for the next try
    assert applier.unremoved_out == marker
    assert marked == [True]
    etcd.start()
    watcher = fleet_for(etcd.url, "watcher")
    assert [o.name for o in watcher.busy().out] == ["box-a"]  # held up the group until now
    assert applier.retry_mark_in() is None
    assert (applier.unremoved_out, watcher.busy().out) == (None, [])
    assert marked == [True, False]
    assert applier.retry_mark_in() is None  # nothing left: no etcd call


def test_a_marker_an_earlier_run_left_is_removed_once_this_server_serves(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    """A specd restarted after its sequence's end could not remove the marker forgets it:
    its next run looks in etcd once, when SGLang answers and no restart is pending, and
    removes a leased marker of its own name; not another server's, nor one put by hand."""
    unit = make_unit(ORIGINAL_ENV)
    first = with_fleet(
        unit,
        Recorder(tmp_path / "journal.json"),
        fleet_for(etcd.url, "box-a", etcd_timeout_s=1),
        runner=EtcdGoneAfterRestart(unit, etcd),
    )
    assert first.apply(4, 3, window_open=always_open).result == "success"
    assert first.unremoved_out is not None  # and then specd restarts: forgotten
    marked: list[bool] = []
    fleet = fleet_for(etcd.url, "box-a", FleetHooks(out=marked.append), etcd_timeout_s=1)
    rerun = with_fleet(unit, Recorder(tmp_path / "journal2.json"), fleet)
    problem = rerun.retry_mark_in(serving=True)  # etcd still away: looked for again later
    assert problem is not None
    assert "cannot look for an out-of-service marker an earlier run left" in problem
    assert not rerun.stale_out_checked
    etcd.start()
    watcher = fleet_for(etcd.url, "watcher")
    other = fleet_for(etcd.url, "box-b")
    other.mark_out(other.out_marker(time.time(), 600))
    assert [o.name for o in watcher.busy().out] == ["box-a", "box-b"]
    assert rerun.retry_mark_in() is None  # not serving, or a restart pending: left
    assert [o.name for o in watcher.busy().out] == ["box-a", "box-b"]
    with structlog.testing.capture_logs() as logs:
        assert rerun.retry_mark_in(serving=True) is None
    (removed,) = [e for e in logs if e["event"] == "fleet_marked_in"]
    assert removed["log_level"] == "warning"
    assert removed["detail"].endswith("(an earlier run left it)")
    assert [o.name for o in watcher.busy().out] == ["box-b"]
    assert rerun.stale_out_checked
    assert marked == [True, False]  # found, then removed
    # Once a run: from here on its own sequences remove their markers.
    fleet.mark_out(fleet.out_marker(time.time(), 600))
    assert rerun.retry_mark_in(serving=True) is None
    assert [o.name for o in watcher.busy().out] == ["box-a", "box-b"]


def test_a_worker_left_out_of_a_gateway_replica_keeps_its_server_marked_out(
    make_unit: Any,  # noqa: F811
    second_worker: TwinProcess,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    """A replica away at the re-add routes nothing to this server: it is still out of
    service there, and the group's other servers must not restart beside it (with slots = 1
    that replica would lose both). The marker stays until the daemon put the worker back
    (`retry_mark_in` with ``serving``, which the daemon says only then)."""
    unit = make_unit()
    marked: list[bool] = []
    watcher = fleet_for(etcd.url, "watcher")
    rec = Recorder(tmp_path / "journal.json")
    with one_replica_away_at_the_readd(unit, second_worker, tmp_path, rec) as (
        applier,
        away,
        there,
    ):
        applier.fleet = fleet_for(etcd.url, "box-a", FleetHooks(out=marked.append))
        outcome = applier.apply(4, 3, window_open=always_open)
        assert outcome.result == "success", outcome.message
        assert outcome.drain is not None
        assert [w["gateway_url"] for w in outcome.drain["left_out"]] == [away.url]
        after = routed(there, unit)
        assert after is not None
        assert after.status == "ready"
    assert [o.name for o in watcher.busy().out] == ["box-a"]
    assert watcher.holders() == []  # the slot is back: only the marker counts
    assert watcher.probe() is not None  # another server of the group waits
    journal = rec.stored()
    assert journal is not None
    notes = " | ".join(journal["messages"])
    assert "kept marked out of service: 1 gateway replica(s) leave the worker out" in notes
    assert journal["fleet_out_removed"] is False
    assert marked == [True]
    assert applier.retry_mark_in() is None  # still left out: kept
    assert [o.name for o in watcher.busy().out] == ["box-a"]
    with structlog.testing.capture_logs() as logs:
        assert applier.retry_mark_in(serving=True) is None  # routed everywhere again
    assert watcher.busy().out == []
    (removed,) = [e for e in logs if e["event"] == "fleet_marked_in"]
    assert removed["log_level"] == "info"  # the expected end, no leftover
    assert removed["detail"].endswith(": every gateway replica routes the worker again")
    assert marked == [True, True, False]  # put, found in etcd by the look, removed


def test_a_marker_put_by_hand_is_left_to_whoever_put_it(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    marked: list[bool] = []
    fleet = fleet_for(etcd.url, "box-a", FleetHooks(out=marked.append))
    fleet.etcd.put("/specd/g/out/box-a", '{"holder": "box-a"}', 0)
    applier = with_fleet(make_unit(ORIGINAL_ENV), Recorder(tmp_path / "journal.json"), fleet)
    assert applier.retry_mark_in(serving=True) is None
    assert applier.stale_out_checked
    assert [(o.name, o.lease) for o in fleet.busy().out] == [("box-a", 0)]
    assert marked == []  # not specd's: SpecdFleetMarkerLeftBehind is not for it


def test_a_marker_past_its_bound_is_tried_until_etcd_says_it_is_gone(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    """etcd counts a lease's TTL only while it runs, and each start of etcd gives every lease
    its whole TTL again: a marker whose bound passed by this clock during an etcd outage comes
    back with its whole bound. Given up at ``until`` (gauge 0, never tried again, the
    once-a-run look done), it held the group up to another bound, with nothing saying so. It
    is now counted and tried until etcd revokes it or says it is gone, and this server's
    markers are looked for once more."""
    unit = make_unit(ORIGINAL_ENV)
    marked: list[bool] = []
    fleet = fleet_for(etcd.url, "box-a", FleetHooks(out=marked.append), etcd_timeout_s=1)
    applier = with_fleet(unit, Recorder(tmp_path / "journal.json"), fleet)
    assert applier.retry_mark_in(serving=True) is None  # this run's look: nothing yet
    assert applier.stale_out_checked
    marker = fleet.out_marker(time.time(), TTL_S)
    assert fleet.mark_out(marker) is None
    applier.unremoved_out = marker  # the sequence's end could not remove it
    etcd.stop()
    time.sleep(max(0.0, marker.until - time.time()) + 1)  # past its bound, and its TTL
    problem = applier.retry_mark_in(serving=True)
    assert problem is not None
    assert "unless etcd restarts meanwhile" in problem
    assert applier.unremoved_out == marker  # kept, and counted
    assert marked == [True]
    etcd.start()
    watcher = fleet_for(etcd.url, "watcher")
    assert [o.name for o in watcher.busy().out] == ["box-a"]  # back with its whole TTL
    assert watcher.probe() is not None
    assert applier.retry_mark_in(serving=True) is None
    assert (applier.unremoved_out, watcher.busy().out) == (None, [])
    assert marked == [True, False]
    assert not applier.stale_out_checked  # looked for once more when it serves
    assert applier.retry_mark_in(serving=True) is None
    assert applier.stale_out_checked
    assert applier.retry_mark_in(serving=True) is None  # nothing left: no etcd call


class EtcdWipedAtRestart:
    """The unit; right after `systemctl restart` etcd's data is lost (wiped, or restored from
    a snapshot older than the sequence) and etcd is back at once, while the server loads: what
    another server's specd then sees, once this one's lease keeper found its lease gone."""

    def __init__(self, unit: TwinUnit, etcd: EtcdProcess, watcher: Fleet, held: list[bool]):
        self.unit, self.etcd, self.watcher, self.held = unit, etcd, watcher, held
        self.seen: tuple[list[str], bool] | None = None  # (out of service, slot held)

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        result = self.unit(argv, timeout_s=timeout_s)
        if list(argv) == restart_argv(UNIT) and self.seen is None:
            self.etcd.stop()
            shutil.rmtree(self.etcd.data_dir)
            self.etcd.start()
            deadline = time.monotonic() + 3 * TTL_S
            out: list[str] = []
            while time.monotonic() < deadline:
                out = [o.name for o in self.watcher.busy().out]
                if out and not self.held[-1]:
                    break
                time.sleep(0.05)
            self.seen = (out, self.held[-1])
        return result


def test_a_marker_etcd_lost_while_the_server_loads_is_put_again(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    """etcd's data lost mid-restart took the slot and the marker with it: another server
    of a one-slot group restarted beside this one, still loading, and
    specd_fleet_slot_held said 1 until the sequence's end. The keeper, finding the slot's
    lease gone, now says the slot is lost at once and, the marker's lease gone too, puts the
    marker again (only if absent) under a fresh lease; the sequence's end removes that one."""
    unit = make_unit(ORIGINAL_ENV)
    held: list[bool] = []
    marked: list[bool] = []
    hooks = FleetHooks(held=lambda slot: held.append(slot is not None), out=marked.append)
    watcher = fleet_for(etcd.url, "box-b")
    runner = EtcdWipedAtRestart(unit, etcd, watcher, held)
    rec = Recorder(tmp_path / "journal.json")
    applier = with_fleet(unit, rec, fleet_for(etcd.url, "box-a", hooks), runner=runner)
    outcome = applier.apply(4, 3, window_open=always_open)
    assert outcome.result == "success", outcome.message
    assert runner.seen == (["box-a"], False)  # counted while it loads; the slot known lost
    assert (watcher.busy().out, watcher.holders()) == ([], [])  # the new marker removed
    assert watcher.try_acquire() is not None
    assert marked == [True, True, False]  # put, put again, removed
    journal = rec.stored()
    assert journal is not None
    notes = " | ".join(journal["messages"])
    assert "its out-of-service marker was gone too: put again" in notes
    assert "marked back in service in fleet group g" in notes


class RevokingRecorder(Recorder):
    """Persists like the daemon; once the journal is first written, etcd loses the lease
    (as when this specd was cut off from etcd for a whole TTL)."""

    def __init__(self, path: Path, fleet: Fleet) -> None:
        super().__init__(path)
        self.fleet = fleet

    def __call__(self, journal: dict[str, Any] | None) -> None:
        if not self.calls and journal is not None:
            self.fleet.etcd.revoke(Slot.from_dict(journal["fleet_slot"]).lease)
        super().__call__(journal)


def test_a_lost_lease_means_no_restart(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    unit = make_unit(ORIGINAL_ENV)
    fleet = fleet_for(etcd.url, "box-a")
    rec = RevokingRecorder(tmp_path / "journal.json", fleet)
    outcome = with_fleet(unit, rec, fleet).apply(4, 3, window_open=always_open)
    assert outcome.result == "aborted"
    assert outcome.message == (
        "lost the fleet slot: the lease of fleet slot 0 expired; nothing was restarted"
    )
    assert unit.restarts == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV
    assert fleet.holders() == []


def test_busy_slots_until_the_window_closes_mean_no_restart(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    unit = make_unit(ORIGINAL_ENV)
    other = fleet_for(etcd.url, "box-b")
    other.try_acquire()
    closes = time.monotonic() + 0.5
    rec = Recorder(tmp_path / "journal.json")
    outcome = with_fleet(unit, rec, fleet_for(etcd.url, "box-a")).apply(
        4, 3, window_open=lambda: time.monotonic() < closes
    )
    assert outcome.result == "aborted"
    assert outcome.message.startswith("window closed while waiting")
    assert outcome.message.endswith(
        "for a fleet slot (all 1 slot(s) of fleet group g busy); nothing was restarted"
    )
    assert unit.restarts == []
    assert rec.calls == []  # no journal: nothing was begun
    assert [h.name for h in other.holders()] == ["box-b"]


def test_etcd_down_means_no_restart(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    unit = make_unit(ORIGINAL_ENV)
    etcd.stop()
    rec = Recorder(tmp_path / "journal.json")
    outcome = with_fleet(unit, rec, fleet_for(etcd.url, "box-a")).apply(
        4, 3, window_open=always_open, force=True
    )
    assert outcome.result == "aborted"
    assert outcome.message.startswith(f"fleet unavailable: etcd {etcd.url} POST /v3/kv/range")
    assert unit.restarts == []
    assert unit.env_file.read_bytes() == ORIGINAL_ENV


class Waiter(threading.Thread):
    """Another specd of the group waiting for the slot (as its applier does), from now on."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(daemon=True)
        self.fleet = fleet
        self.slot: Slot | None = None
        self.why = ""
        self.got_at: float | None = None

    def run(self) -> None:
        self.slot, self.why = self.fleet.acquire(threading.Event(), lambda: None)
        self.got_at = time.monotonic()


class HealWatch(Recorder):
    """Persists like the daemon; at each write of the heal until its server serves again,
    who holds a slot, as another specd sees the group."""

    def __init__(self, path: Path, watcher: Fleet) -> None:
        super().__init__(path)
        self.watcher = watcher
        self.holders_while_out: list[list[str]] = []

    def __call__(self, journal: dict[str, Any] | None) -> None:
        if journal is not None and not journal.get("fleet_out_removed"):
            self.holders_while_out.append([h.name for h in self.watcher.holders()])
        super().__call__(journal)


@pytest.mark.parametrize("lease_expired", [False, True])
def test_a_specd_killed_mid_restart_keeps_its_server_counted_until_the_heal(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
    lease_expired: bool,
) -> None:
    """A specd killed after `systemctl restart` went out stops renewing its slot's lease,
    which expired lease_ttl_s later: another server of the group took the slot and restarted
    while this one was still out (loading, verifying, rolling back), two out at once with
    slots = 1. Its out-of-service marker, put before the restart and renewed by nobody, now
    counts it until the heal at its next start marks it back in service; then the other
    goes."""
    unit = make_unit(ORIGINAL_ENV)
    rec = Recorder(tmp_path / "state.json")
    # Expiring: the shortest lease, which runs out before the heal. Held: a lease that
    # cannot run out while the heal restarts and verifies the twin, however loaded this
    # machine is.
    ttl_s = TTL_S if lease_expired else 600
    dying = with_fleet(
        unit,
        rec,
        fleet_for(etcd.url, "box-a", lease_ttl_s=ttl_s),
        runner=KillingRunner(unit, kill_on_restart=1),
    )
    with pytest.raises(Killed):
        dying.apply(4, 3, window_open=always_open)
    assert dying._keeper is not None
    dying._keeper.stop()  # the process is gone: nothing renews the lease any more
    journal = rec.stored()
    assert journal is not None
    assert journal["phase"] == "restart_issued"
    assert journal["fleet_released"] is False
    assert journal["fleet_out"]["key"] == "/specd/g/out/box-a"
    assert journal["fleet_out_removed"] is False
    # Marked before the restart went out, under a lease bounding the rest of the sequence.
    marked = [c for c in rec.calls if c is not None and c["fleet_out"] is not None]
    assert marked[0]["phase"] == "env_written"
    assert journal["fleet_out"]["ttl_s"] == dying.out_bound_s > 600

    other = fleet_for(etcd.url, "box-b")
    waiter = Waiter(other)
    waiter.start()
    if lease_expired:
        deadline = time.monotonic() + TTL_S + 5
        while other.holders() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert other.holders() == []  # box-a's slot is gone ...
        time.sleep(0.5)  # ... and box-b tried for it meanwhile, every 0.05 s
    assert waiter.got_at is None, waiter.why  # box-a's server still counts
    probe = other.probe()
    assert probe is not None
    assert probe.startswith("all 1 slot(s) of fleet group g busy: ")
    if lease_expired:
        assert "box-a out of service since " in probe
        assert "(holds no slot; counted until " in probe
    else:
        assert probe.endswith("slot 0 held by box-a")

    after = HealWatch(tmp_path / "state2.json", fleet_for(etcd.url, "watcher"))
    marked: list[bool] = []
    healer = with_fleet(
        unit, after, fleet_for(etcd.url, "box-a", FleetHooks(out=marked.append), lease_ttl_s=ttl_s)
    )
    outcome = healer.reconcile(journal)
    assert outcome is not None
    assert outcome.result == "success", outcome.message
    # Marked again under a fresh lease (the old one revoked: the marker stays), then removed.
    assert marked == [True, False]
    assert unit.restarts == [4]  # healed without a second restart
    # box-b never held the slot while box-a was out: at no write of the heal before its end.
    assert after.holders_while_out
    assert all("box-b" not in held for held in after.holders_while_out), after.holders_while_out
    healed = after.stored()
    assert healed is not None
    notes = " | ".join(healed["messages"])
    if lease_expired:
        assert "fleet slot 0 not held any more (the lease of fleet slot 0 expired)" in notes
    else:
        assert "fleet slot 0 still held: kept while healing" in notes
    assert f"still out of service: marked again for at most {healer.out_bound_s} s" in notes
    assert "marked back in service in fleet group g" in notes
    assert healed["fleet_released"] is True
    assert healed["fleet_out_removed"] is True
    # The heal's end lets box-b go.
    waiter.join(30)
    assert waiter.slot is not None, waiter.why
    assert [h.name for h in other.holders()] == ["box-b"]
    assert other.busy().out == []
    assert other.release(waiter.slot) is None


def test_two_specds_restart_one_after_the_other(tmp_path: Path, etcd: EtcdProcess) -> None:
    # From each `systemctl restart` to the journal's "done" (written before the release).
    spans: dict[str, list[float]] = {"a": [], "b": []}

    class Timed:
        def __init__(self, name: str, unit: TwinUnit) -> None:
            self.name, self.unit = name, unit

        def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
            if list(argv) == restart_argv(UNIT):
                spans[self.name].append(time.monotonic())
            return self.unit(argv, timeout_s=timeout_s)

    class DoneAt(Recorder):
        def __init__(self, path: Path, name: str) -> None:
            super().__init__(path)
            self.name = name

        def __call__(self, journal: dict[str, Any] | None) -> None:
            if journal is not None and journal["phase"] == "done" and len(spans[self.name]) == 1:
                spans[self.name].append(time.monotonic())
            super().__call__(journal)

    outcomes: dict[str, str] = {}

    def run(name: str, unit: TwinUnit) -> None:
        persist = DoneAt(tmp_path / f"{name}.json", name)
        applier = with_fleet(unit, persist, fleet_for(etcd.url, name), runner=Timed(name, unit))
        outcomes[name] = applier.apply(4, 3, window_open=always_open).result

    units = {}
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            env = tmp_path / name / "sglang.env"
            env.write_bytes(ORIGINAL_ENV)
            units[name] = TwinUnit(env)
            units[name].start_healthy()
        threads = [threading.Thread(target=run, args=item) for item in units.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for unit in units.values():
            unit.close()
    assert outcomes == {"a": "success", "b": "success"}
    (a0, a1), (b0, b1) = spans["a"], spans["b"]
    assert a1 < b0 or b1 < a0, spans  # never both out at once


class SlowHeal(Recorder):
    """Persists like the daemon; the first write after the slot was taken back stands for a
    heal that takes a while (SGLang still loading), and records who held the group's slots
    at its end, as another specd would see them."""

    def __init__(self, path: Path, watcher: Fleet, heal_s: float) -> None:
        super().__init__(path)
        self.watcher = watcher
        self.heal_s = heal_s
        self.holders_after_wait: list[str] | None = None

    def __call__(self, journal: dict[str, Any] | None) -> None:
        super().__call__(journal)
        notes = (journal or {}).get("messages", [])
        if self.holders_after_wait is None and any("still held" in n for n in notes):
            time.sleep(self.heal_s)
            self.holders_after_wait = [h.name for h in self.watcher.holders()]


def test_a_restarted_specd_keeps_a_slot_whose_lease_was_about_to_run_out(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
) -> None:
    """specd.service comes back RestartSec= (10 s) after a kill: of a 30 s lease that was
    renewed up to 10 s before the kill, a few seconds may be left. The slot is taken back to
    heal, so it must be renewed at once, not a third of a TTL later: by then the lease ran
    out and another server of the group took its turn while this one was still out."""
    ttl_s = 9
    unit = make_unit(ORIGINAL_ENV)
    rec = Recorder(tmp_path / "state.json")
    dying = with_fleet(
        unit,
        rec,
        fleet_for(etcd.url, "box-a", lease_ttl_s=ttl_s),
        runner=KillingRunner(unit, kill_on_restart=1),
    )
    with pytest.raises(Killed):
        dying.apply(4, 3, window_open=always_open)
    assert dying._keeper is not None
    dying._keeper.stop()  # the process is gone: nothing renews the lease any more
    journal = rec.stored()
    assert journal is not None
    lease = Slot.from_dict(journal["fleet_slot"]).lease
    watcher = fleet_for(etcd.url, "box-b")
    while watcher.etcd.time_to_live(lease)[0] > 2:  # the lease about to run out
        time.sleep(0.2)

    after = SlowHeal(tmp_path / "state2.json", watcher, heal_s=ttl_s / 3 + 1)
    outcome = with_fleet(unit, after, fleet_for(etcd.url, "box-a", lease_ttl_s=ttl_s)).reconcile(
        journal
    )
    assert outcome is not None
    assert outcome.result == "success", outcome.message
    assert after.holders_after_wait == ["box-a"]  # nobody else's turn while this one heals
    assert watcher.holders() == []  # released at the end
