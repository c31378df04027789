"""The applier's fleet hooks: a slot before the restart, checked right before it, released at
every end; healed after a kill. Real twin units (test_apply's), a real etcd on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
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
)

from specd.core.settings import FleetSettings
from specd.io.apply import Applier, restart_argv
from specd.io.fleet import Fleet, Slot
from specd.io.runner import RunResult

TTL_S = 5
# One etcd for the module, reset between its tests (factories.module_etcd).
etcd, etcd_server = module_etcd, module_etcd_server


def fleet_for(url: str, name: str, **fields: Any) -> Fleet:
    settings: dict[str, Any] = {
        "etcd_endpoints": [url],
        "group": "g",
        "lease_ttl_s": TTL_S,
        "etcd_timeout_s": 2,
        "slot_poll_interval_s": 0.05,
        "slot_wait_max_s": 60,
    }
    return Fleet(FleetSettings(**{**settings, **fields}), name)


def with_fleet(
    unit: TwinUnit,
    persist: Callable[[dict[str, Any] | None], None],
    fleet: Fleet,
    **overrides: Any,
) -> Applier:
    applier = applier_for(unit, persist, **overrides)
    applier.fleet = fleet
    return applier


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


@pytest.mark.parametrize("lease_expired", [False, True])
def test_a_specd_killed_mid_restart_heals_and_releases(
    make_unit: Any,  # noqa: F811
    tmp_path: Path,
    etcd: EtcdProcess,
    lease_expired: bool,
) -> None:
    unit = make_unit(ORIGINAL_ENV)
    rec = Recorder(tmp_path / "state.json")
    # Expiring: the shortest lease, which box-b waits out. Held: a lease that cannot run
    # out while the heal restarts and verifies the twin, however loaded this machine is.
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
    other = fleet_for(etcd.url, "box-b")
    if lease_expired:
        # Another server gets its turn once the lease ran out, and gives it back.
        slot, why = other.acquire(threading.Event(), lambda: None)
        assert slot is not None, why
        assert other.release(slot) is None
    else:
        assert [h.name for h in other.holders()] == ["box-a"]

    after = Recorder(tmp_path / "state2.json")
    outcome = with_fleet(unit, after, fleet_for(etcd.url, "box-a", lease_ttl_s=ttl_s)).reconcile(
        journal
    )
    assert outcome is not None
    assert outcome.result == "success", outcome.message
    assert unit.restarts == [4]  # healed without a second restart
    healed = after.stored()
    assert healed is not None
    notes = " | ".join(healed["messages"])
    if lease_expired:
        assert "fleet slot 0 not held any more (the lease of fleet slot 0 expired)" in notes
    else:
        assert "fleet slot 0 still held: kept while healing" in notes
    assert healed["fleet_released"] is True
    assert other.holders() == []


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
