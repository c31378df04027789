"""The fleet semaphore against a real etcd on loopback (and a hostile fake one)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.parse
from dataclasses import replace
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from factories import EtcdProcess, LoopbackHTTP, gzip_bomb, module_etcd, module_etcd_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specd.core.settings import FleetSettings
from specd.io.fleet import (
    ERROR_KINDS,
    MAX_VALUE_BYTES,
    UNREADABLE_HOLDER,
    Busy,
    Fleet,
    FleetHooks,
    FleetUnavailable,
    OutMarker,
    Slot,
    default_instance,
    out_key,
    out_prefix,
    slot_key,
)
from specd.twin.process import free_port

TTL_S = 5  # the shortest lease the settings allow
# Two boxes' instances (`default_instance`), and the one a machine id gives.
# hmac.new(bytes.fromhex("0123456789abcdef0123456789abcdef"), b"specd fleet instance",
# hashlib.sha256).hexdigest()[:32], computed once by hand.
DERIVED = "d7ced66dd0de4c4ad5f1f3fec714f282"
BOX_A, BOX_B = (
    "0123456789abcdef0123456789abcdef sglang.service",
    "fedcba9876543210fedcba9876543210 sglang.service",
)
# One etcd for the module, reset between its tests (factories.module_etcd).
etcd, etcd_server = module_etcd, module_etcd_server


def fleet_settings(*endpoints: str, **fields: Any) -> FleetSettings:
    base: dict[str, Any] = {
        "etcd_endpoints": list(endpoints),
        "group": "g1",
        "lease_ttl_s": TTL_S,
        "etcd_timeout_s": 2,
        "slot_poll_interval_s": 0.05,
        "slot_wait_max_s": 60,
    }
    return FleetSettings(**{**base, **fields})


def make_fleet(url: str, name: str, errors: list[str] | None = None, **fields: Any) -> Fleet:
    hooks = FleetHooks(error=errors.append) if errors is not None else None
    return Fleet(fleet_settings(url, **fields), name, hooks=hooks)


def never() -> str | None:
    return None


def take(fleet: Fleet) -> Slot:
    slot, why = fleet.acquire(threading.Event(), never)
    assert slot is not None, why
    return slot


# -- mutual exclusion ---------------------------------------------------------------


@pytest.mark.parametrize(("slots", "clients"), [(1, 3), (2, 4)])
def test_at_most_n_hold_a_slot_at_once(etcd: EtcdProcess, slots: int, clients: int) -> None:
    inside: list[str] = []
    most = 0
    served: list[tuple[str, int]] = []
    lock = threading.Lock()
    failures: list[BaseException] = []

    def client(name: str) -> None:
        nonlocal most
        fleet = make_fleet(etcd.url, name, slots=slots)
        try:
            for _ in range(2):
                slot = take(fleet)
                keeper = fleet.keep_alive(slot)
                with lock:
                    inside.append(name)
                    most = max(most, len(inside))
                    served.append((name, slot.index))
                assert fleet.check(slot) is None
                time.sleep(0.3)
                with lock:
                    inside.remove(name)
                keeper.stop()
                assert fleet.release(slot) is None
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)
        finally:
            fleet.close()

    threads = [threading.Thread(target=client, args=(f"specd-{i}",)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    assert len(served) == 2 * clients
    assert most == slots  # never more, and the N slots were really used side by side
    assert {index for _, index in served} == set(range(slots))
    observer = make_fleet(etcd.url, "observer", slots=slots)
    assert observer.holders() == []
    assert observer.probe() is None


def test_holders_and_probe_say_who_holds_which_slot(etcd: EtcdProcess) -> None:
    a, b = make_fleet(etcd.url, "box-a sglang.service"), make_fleet(etcd.url, "box-b")
    slot = take(a)
    assert (slot.index, slot.key, slot.group) == (0, slot_key("g1", 0), "g1")
    [holder] = b.holders()
    assert (holder.slot, holder.name, holder.lease) == (0, "box-a sglang.service", slot.lease)
    assert holder.since is not None
    assert abs(holder.since - time.time()) < 30
    assert b.probe() == "all 1 slot(s) of fleet group g1 busy: slot 0 held by box-a sglang.service"
    assert b.try_acquire() is None
    # Another group has its own slots.
    assert make_fleet(etcd.url, "other", group="g2").try_acquire() is not None
    assert a.release(slot) is None
    assert b.probe() is None
    assert a.release(slot) is None  # releasing twice is harmless (the lease is gone)


def test_a_specd_counts_every_holder_of_its_group_against_its_own_slots(
    etcd: EtcdProcess,
) -> None:
    """While `slots` is being raised across a fleet (1 → 2, one host at a time), a specd
    still at 1 found slot 0 free while one at 2 held slot 1, and restarted beside it: two
    servers out where its config allows one. It now waits while as many servers of the group
    as its own `slots` restart, whichever slots they hold."""
    wider_a = make_fleet(etcd.url, "box-a", slots=2)
    wider_b = make_fleet(etcd.url, "box-b", slots=2)
    first, second = take(wider_a), take(wider_b)
    assert (first.index, second.index) == (0, 1)
    assert wider_a.release(first) is None  # box-b alone now, on slot 1
    narrow = make_fleet(etcd.url, "box-c", slots=1)
    assert narrow.try_acquire() is None
    assert narrow.probe() == (
        "all 1 slot(s) of fleet group g1 busy: slot 1 held by box-b "
        "(a specd of the group with more slots than this one's 1)"
    )
    assert wider_a.try_acquire() is not None  # box-a's own 2 allow it


def test_a_waiting_specd_gives_up_when_its_window_closes(etcd: EtcdProcess) -> None:
    holder, waiter = make_fleet(etcd.url, "holder"), make_fleet(etcd.url, "waiter")
    take(holder)
    closes_at = time.monotonic() + 0.5

    def window() -> str | None:
        return "window closed" if time.monotonic() >= closes_at else None

    started = time.monotonic()
    slot, why = waiter.acquire(threading.Event(), window)
    assert slot is None
    assert 0.4 < time.monotonic() - started < 5
    assert why.startswith("window closed while waiting")
    assert "all 1 slot(s) of fleet group g1 busy" in why
    # Bounded by slot_wait_max_s too, and a stop request ends the wait at once.
    bounded = make_fleet(etcd.url, "bounded", slot_wait_max_s=0.3)
    slot, why = bounded.acquire(threading.Event(), never)
    assert slot is None
    assert why.startswith("no fleet slot within 0.3 s")
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    slot, why = make_fleet(etcd.url, "stopped", slot_poll_interval_s=30).acquire(stop, never)
    assert slot is None
    assert why == "stop requested while waiting for a fleet slot"


def test_a_waiting_specd_takes_the_slot_once_it_is_released(etcd: EtcdProcess) -> None:
    holder, waiter = make_fleet(etcd.url, "holder"), make_fleet(etcd.url, "waiter")
    waits: list[float] = []
    waiter.hooks.waited = waits.append
    slot = take(holder)
    threading.Timer(0.5, holder.release, args=(slot,)).start()
    got, why = waiter.acquire(threading.Event(), never)
    assert got is not None, why
    assert got.index == 0
    assert len(waits) == 1
    assert 0.4 < waits[0] < 10


# -- servers out of service: markers count against the slots ---------------------------

# id, slots, slots held (index, holder), servers marked out, this specd, the slot it may take
OUT_CASES = [
    ("a marker alone fills the one slot", 1, [], ["box-a"], "box-c", None),
    ("a holder's own marker counts once", 2, [(0, "box-a")], ["box-a"], "box-c", 1),
    ("a marker and another holder fill two", 2, [(0, "box-a")], ["box-b"], "box-c", None),
    ("two dead holders' markers fill three", 3, [(0, "box-a")], ["box-b", "box-d"], "box-c", None),
    ("... and leave one of four", 4, [(0, "box-a")], ["box-b", "box-d"], "box-c", 1),
    ("this specd's own stale marker does not block it", 1, [], ["box-c"], "box-c", 0),
    ("a name with '/', '%' and spaces", 1, [], ["rack 1/box-a 100% sglang.service"], "box-c", None),
    ("no marker: the slots as before", 2, [(1, "box-a")], [], "box-c", 0),
]


def put_marker(fleet: Fleet, name: str, ttl_s: int = TTL_S) -> int:
    lease = fleet.etcd.grant(ttl_s)
    since = time.time()
    value = json.dumps({"holder": name, "since": since, "until": since + ttl_s})
    fleet.etcd.put(out_key(fleet.group, name), value, lease)
    return lease


@pytest.mark.parametrize(
    ("slots", "held", "out", "me", "free"), [pytest.param(*c[1:], id=c[0]) for c in OUT_CASES]
)
def test_servers_marked_out_of_service_count_against_the_slots(
    etcd: EtcdProcess,
    slots: int,
    held: list[tuple[int, str]],
    out: list[str],
    me: str,
    free: int | None,
) -> None:
    """A specd that died (or lost etcd) mid-restart frees its slot one lease TTL later, but
    its server stays out for minutes: its out-of-service marker keeps it counted."""
    fleet = make_fleet(etcd.url, me, slots=slots)
    for index, name in held:
        lease = fleet.etcd.grant(TTL_S)
        holder = json.dumps({"holder": name, "since": time.time()})
        assert fleet.etcd.put_if_absent(slot_key("g1", index), holder, lease)
    for name in out:
        put_marker(fleet, name)
    busy = fleet.busy()
    assert [o.name for o in busy.out] == sorted(out)
    assert all(o.since is not None and o.until is not None for o in busy.out)
    assert fleet._free(busy) == free
    probe = fleet.probe()
    if free is not None:
        assert probe is None
        slot = fleet.try_acquire()
        assert slot is not None
        assert slot.index == free
        return
    assert probe is not None
    assert probe.startswith(f"all {slots} slot(s) of fleet group g1 busy: ")
    for name in out:
        if name not in {n for _, n in held}:
            assert f"{name} out of service since " in probe
    assert fleet.try_acquire() is None


def test_a_marker_expires_at_its_bound_and_a_revoked_one_frees_at_once(etcd: EtcdProcess) -> None:
    a, b = make_fleet(etcd.url, "box-a"), make_fleet(etcd.url, "box-b")
    slot = take(a)
    marker = a.out_marker(time.time(), TTL_S)
    a.mark_out(marker)
    assert a.release(slot) is None  # as when box-a's slot lease ran out: its server is out
    started = time.monotonic()
    got, why = b.acquire(threading.Event(), never)
    waited = time.monotonic() - started
    assert got is not None, why
    assert TTL_S - 1.5 < waited < TTL_S + 3, waited  # until the marker's own lease ran out
    assert b.release(got) is None
    # Revoked (the server serves again): the next one goes at once.
    slot = take(a)
    marker = a.out_marker(time.time(), 600)
    a.mark_out(marker)
    assert a.release(slot) is None
    assert b.try_acquire() is None
    assert a.mark_in(marker) is None
    assert b.try_acquire() is not None
    assert a.mark_in(marker) is None  # twice is harmless
    assert b.busy().out == []


def test_a_marker_that_cannot_be_revoked_says_when_it_frees_itself(etcd: EtcdProcess) -> None:
    a = make_fleet(etcd.url, "box-a")
    marker = a.out_marker(time.time(), 600)
    etcd.stop()
    with pytest.raises(FleetUnavailable):
        a.mark_out(marker)
    problem = a.mark_in(marker)
    assert problem is not None
    assert problem.startswith("removing the out-of-service marker failed (etcd ")
    assert problem.endswith(" at the latest")
    assert " it frees itself by 2" in problem


# The module's etcd, reset once for the test (not per example: each cleans up after itself).
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    suffix=st.text(max_size=80) | st.sampled_from(["", "%", "%zz", "%ff", "a%2", "a/b", "a%2Fb"]),
    value=st.binary(max_size=200)
    | st.builds(
        lambda since, until, instance: json.dumps(
            {"holder": "x", "since": since, "until": until, "instance": instance}
        ).encode(),
        st.one_of(st.floats(), st.integers(), st.text(max_size=5), st.none(), st.booleans()),
        st.one_of(st.floats(), st.integers(), st.lists(st.integers(), max_size=2)),
        st.one_of(st.text(max_size=300), st.integers(), st.none(), st.lists(st.text(), max_size=2)),
    ),
)
def test_any_marker_key_or_value_someone_else_wrote_is_read_safely(
    etcd: EtcdProcess, suffix: str, value: bytes
) -> None:
    """Only the exact encoding specd writes is a marker; its value is another host's word."""
    fleet = Fleet(fleet_settings(etcd.url), "box-z", instance=BOX_A)
    key = out_prefix("g1") + suffix
    lease = fleet.etcd.grant(TTL_S)
    try:
        fleet.etcd.put(key, value.decode("latin-1"), lease)  # any bytes, through JSON
        busy = fleet.busy()
        assert busy.holders == []
        for out in busy.out:
            # Read back only what specd itself writes (the name as one line, as for slots).
            assert out_key("g1", urllib.parse.unquote(suffix, errors="strict")) == key
            assert out.name == " ".join(urllib.parse.unquote(suffix).split())
            assert "\n" not in out.name
            assert 0 < len(out.name) <= 200
            for t in (out.since, out.until):
                assert t is None or 0 <= t <= 253402300799
            assert out.instance is None or 0 < len(out.instance) <= 200
            assert out.instance is None or "\n" not in out.instance
        probe = fleet.probe()
        assert (probe is None) == (busy.out == [])
        # Another server's marker, or one of this name another instance signed.
        said = ("out of service", "also calls itself 'box-z'")
        assert probe is None or ("\n" not in probe and any(s in probe for s in said))
    finally:
        fleet.etcd.revoke(lease)
        fleet.close()


def test_a_journal_marker_is_read_back_or_refused() -> None:
    marker = OutMarker("g1", out_key("g1", "box a/1"), 2**62, 900, 1.5, 901.5)
    assert OutMarker.from_dict(json.loads(json.dumps(marker.to_dict()))) == marker
    for bad in (
        None,
        [],
        {**marker.to_dict(), "key": "/etc/passwd"},
        {**marker.to_dict(), "key": slot_key("g1", 0)},
        {**marker.to_dict(), "key": out_key("g2", "box a/1")},
        {**marker.to_dict(), "lease": "0"},
        {**marker.to_dict(), "since": "x"},
        {k: v for k, v in marker.to_dict().items() if k != "until"},
    ):
        with pytest.raises(ValueError, match="fleet out-of-service marker"):
            OutMarker.from_dict(bad)


# -- leases: kept alive, lost, expired -------------------------------------------------

HOLDER = """
import sys, threading, time
from specd.core.settings import FleetSettings
from specd.io.fleet import Fleet
fleet = Fleet(FleetSettings(etcd_endpoints=[sys.argv[1]], group="g1", lease_ttl_s=5), "victim")
slot, why = fleet.acquire(threading.Event(), lambda: None)
fleet.keep_alive(slot)
print(slot.index, flush=True)
time.sleep(600)
"""


def test_the_keeper_holds_a_slot_past_its_ttl_and_sigkill_frees_it(etcd: EtcdProcess) -> None:
    victim = subprocess.Popen(
        [sys.executable, "-c", HOLDER, etcd.url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "0"
        granted_by = time.monotonic()  # the victim reports its slot after the grant
        other = make_fleet(etcd.url, "survivor")
        # Longer than one TTL since the grant, and etcd's half-second sweep of expired
        # leases: only the keeper's renewals keep it.
        time.sleep(max(0.0, granted_by + TTL_S + 1 - time.monotonic()))
        [holder] = other.holders()
        assert holder.name == "victim"
        assert other.try_acquire() is None
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        killed_at = time.monotonic()
        slot = take(other)
        freed_after = time.monotonic() - killed_at
        assert freed_after <= TTL_S + 2, freed_after
        assert other.holders()[0].name == "survivor"
        assert slot.index == 0
    finally:
        victim.kill()
        victim.wait(10)


def test_check_fails_once_the_lease_is_gone(etcd: EtcdProcess) -> None:
    errors: list[str] = []
    fleet = make_fleet(etcd.url, "a", errors)
    slot = take(fleet)
    assert fleet.check(slot) is None
    fleet.etcd.revoke(slot.lease)  # as etcd does when the lease expires
    assert fleet.check(slot) == "the lease of fleet slot 0 expired"
    assert errors == ["lost"]
    # A key held on another lease (someone else's slot) is not ours either.
    other = take(make_fleet(etcd.url, "b"))
    forged = Slot("g1", 0, other.key, fleet.etcd.grant(TTL_S), TTL_S, time.time())
    assert fleet.check(forged) == "fleet slot 0 is no longer on this specd's lease"


def test_a_slot_taken_on_a_stale_read_of_the_group_is_not_taken(etcd: EtcdProcess) -> None:
    """slots = 2. A holds slot 0, its server marked out. B reads the group (slot 0 held:
    slot 1 is free). Then A's slot lease runs out with its server still out, and C takes
    slot 0 (the marker counts 1 of 2). B's take on its earlier read put slot 1 beside them:
    three servers out. The take holds only while the group is as read."""
    a, b, c = (make_fleet(etcd.url, name, slots=2) for name in ("box-a", "box-b", "box-c"))
    slot_a = take(a)
    assert a.mark_out(a.out_marker(time.time(), 600), slot_a) is None
    stale = b.busy()
    assert b._free(stale) == 1
    a.etcd.revoke(slot_a.lease)  # as etcd does when A's lease expires
    slot_c = c.try_acquire()
    assert slot_c is not None
    assert slot_c.index == 0
    assert b._take(stale) is None
    assert b.try_acquire() is None  # read again: A out and C's slot are the 2 allowed
    busy = b.busy()
    assert ([h.name for h in busy.holders], [o.name for o in busy.out]) == (["box-c"], ["box-a"])
    # A read that is still current takes as before.
    assert c.release(slot_c) is None
    fresh = b.busy()
    got = b._take(fresh)
    assert got is not None
    assert got.index == 0


# id, key put under group g1 (beside nothing else), its value's size, slots, what probe says
# (None: a slot is free), the slot try_acquire takes (None: none)
LARGE = 800_000  # within etcd's 1.5 MiB request limit; over MAX_ANSWER_BYTES as base64
FOREIGN_CASES = [
    ("another tool's large value", "/specd/g1/notes/runbook", LARGE, 1, None, 0),
    ("another tool's small value", "/specd/g1/heartbeat", 10, 1, None, 0),
    (
        "a slot too large to answer",
        "/specd/g1/slots/0",
        LARGE,
        1,
        f"all 1 slot(s) of fleet group g1 busy: slot 0 held by {UNREADABLE_HOLDER}",
        None,
    ),
    (
        "a slot over the value bound",
        "/specd/g1/slots/0",
        MAX_VALUE_BYTES + 1,
        1,
        f"all 1 slot(s) of fleet group g1 busy: slot 0 held by {UNREADABLE_HOLDER}",
        None,
    ),
    ("a slot too large, another free", "/specd/g1/slots/0", LARGE, 2, None, 1),
    (
        "a marker too large to answer",
        "/specd/g1/out/box-z",
        LARGE,
        1,
        "all 1 slot(s) of fleet group g1 busy: box-z out of service (holds no slot)",
        None,
    ),
]


@pytest.mark.parametrize(
    ("key", "size", "slots", "says", "takes"),
    [pytest.param(*c[1:], id=c[0]) for c in FOREIGN_CASES],
)
def test_a_large_value_under_the_group_is_no_etcd_outage(
    etcd: EtcdProcess, key: str, size: int, slots: int, says: str | None, takes: int | None
) -> None:
    """A large value anywhere under /specd/<group>/ made the read of the whole group over
    the answer cap: every restart of the group stopped and status said etcd was away. Only
    slots/ and out/ are read now, and one value there too large to read is a holder that
    cannot be read: busy, named, not an outage. The other slots and markers still read."""
    errors: list[str] = []
    fleet = make_fleet(etcd.url, "box-a", errors, slots=slots)
    fleet.etcd.put(key, "x" * size, 0)
    assert fleet.probe() == says
    slot = fleet.try_acquire()
    assert (None if slot is None else slot.index) == takes
    assert errors == []
    # The other slots and markers of the group read as ever beside it.
    other = make_fleet(etcd.url, "box-y", slots=9)
    put_marker(other, "box-y", 600)
    busy = other.busy()
    assert [(o.name, o.until is not None) for o in busy.out if o.name == "box-y"] == [
        ("box-y", True)
    ]
    if takes is not None:
        assert [h.name for h in busy.holders if h.slot == takes] == ["box-a"]


def test_another_writer_under_the_group_loses_no_race_for_a_slot(etcd: EtcdProcess) -> None:
    """A take holds only while the group's slots and markers are as read; another tool's key
    written under the group since the read (a heartbeat) made it fail all the same: 6 of 40
    tries lost to a busy writer. Only slots/ and out/ are compared now."""
    fleet = make_fleet(etcd.url, "box-a")
    stale = fleet.busy()
    fleet.etcd.put("/specd/g1/heartbeat", str(time.time()), 0)  # since the read
    fleet.etcd.put("/specd/g1/slotsmith", "x", 0)  # no slot key: the prefix ends in "/"
    slot = fleet._take(stale)
    assert slot is not None
    assert fleet.release(slot) is None
    # A marker put since the read still makes it fail (as a slot does: the stale-read test).
    stale = fleet.busy()
    put_marker(make_fleet(etcd.url, "box-b"), "box-b", 600)
    assert fleet._take(stale) is None


def test_a_server_is_marked_out_only_while_its_slot_is_held(etcd: EtcdProcess) -> None:
    """The check before a restart can pass with a second left on the slot's lease; if it
    runs out before the marker goes in, another specd may take the slot and restart its
    server meanwhile. The marker then goes in only while the slot is still this one's."""
    errors: list[str] = []
    a, b = make_fleet(etcd.url, "box-a", errors), make_fleet(etcd.url, "box-b")
    slot_a = take(a)
    assert a.check(slot_a) is None
    a.etcd.revoke(slot_a.lease)  # the lease runs out right after the check
    slot_b = take(b)
    marker = a.out_marker(time.time(), 600)
    assert a.mark_out(marker, slot_a) == "fleet slot 0 is no longer on this specd's lease"
    assert errors == ["lost"]
    assert b.busy().out == []  # not counted: A's change is aborted, nothing restarted
    assert a.etcd.time_to_live(marker.lease)[0] <= 0  # and its lease is not left behind
    # B, holding its slot, marks itself out as before.
    assert b.mark_out(b.out_marker(time.time(), 600), slot_b) is None
    assert [o.name for o in a.busy().out] == ["box-b"]


def test_the_keeper_stops_at_once_and_notices_a_lost_lease(etcd: EtcdProcess) -> None:
    fleet = make_fleet(etcd.url, "a", lease_ttl_s=30)
    slot = take(fleet)
    keeper = fleet.keep_alive(slot)
    started = time.monotonic()
    keeper.stop()  # mid-way through a 10 s sleep
    assert time.monotonic() - started < 1.5
    assert not keeper.is_alive()
    assert keeper.lost is None
    short = make_fleet(etcd.url, "b", group="g2")
    lost_slot = take(short)
    keeper = short.keep_alive(lost_slot)
    short.etcd.revoke(lost_slot.lease)
    keeper.join(TTL_S)
    assert keeper.lost == "etcd says the lease of fleet slot 0 expired"


def test_a_lost_lease_puts_a_marker_etcd_lost_again_and_no_other(etcd: EtcdProcess) -> None:
    """etcd's data lost while the server is out: the keeper finds the slot's lease gone,
    says the slot is no longer held at once, and puts the marker it watches again, only if
    no key of its name is there; a marker whose lease lives (the slot's lease alone ran out)
    is left as it is."""
    held: list[bool] = []
    marked: list[bool] = []
    hooks = FleetHooks(held=lambda slot: held.append(slot is not None), out=marked.append)
    a = Fleet(fleet_settings(etcd.url), "box-a", instance=BOX_A, hooks=hooks)
    b = make_fleet(etcd.url, "box-b")
    slot = take(a)
    keeper = a.keep_alive(slot)
    marker = a.out_marker(time.time(), 600)
    assert a.mark_out(marker, slot) is None
    keeper.watch_out(marker)
    etcd.stop()
    shutil.rmtree(etcd.data_dir)
    etcd.start()
    keeper.join(3 * TTL_S)
    assert not keeper.is_alive()
    assert keeper.lost == (
        "etcd says the lease of fleet slot 0 expired; its out-of-service marker was gone too: "
        "put again"
    )
    assert held == [True, True, False]  # taken, kept, lost: specd_fleet_slot_held 0 at once
    assert marked == [True, True]
    [out] = b.busy().out
    assert (out.name, out.instance, out.since) == ("box-a", BOX_A, marker.since)
    assert out.until is not None
    assert marker.until - 1 <= out.until <= marker.until + 5  # the same bound
    assert b.try_acquire() is None  # a one-slot group: box-a's server still counts
    again = keeper.stop_watching_out()
    assert again is not None
    assert again.lease != marker.lease
    assert again.lease == out.lease
    assert a.mark_in(again) is None
    assert b.busy().out == []
    # The slot's lease alone gone: the marker is left on its own lease.
    slot = take(a)
    keeper = a.keep_alive(slot)
    marker = a.out_marker(time.time(), 600)
    assert a.mark_out(marker, slot) is None
    keeper.watch_out(marker)
    a.etcd.revoke(slot.lease)
    keeper.join(3 * TTL_S)
    assert keeper.lost == "etcd says the lease of fleet slot 0 expired"
    assert keeper.stop_watching_out() == marker
    assert [o.lease for o in b.busy().out] == [marker.lease]
    # Nor is a key of its name put by someone else meanwhile overwritten.
    gone = replace(marker, lease=a.etcd.grant(TTL_S))
    a.etcd.revoke(gone.lease)
    assert a.mark_out_again(gone, a.etcd) is None
    assert [o.lease for o in b.busy().out] == [marker.lease]


def test_a_slot_survives_a_short_etcd_restart(etcd: EtcdProcess) -> None:
    fleet = make_fleet(etcd.url, "a")
    slot = take(fleet)
    keeper = fleet.keep_alive(slot)
    etcd.stop()
    time.sleep(1.0)  # renewals fail meanwhile, and are retried sooner
    etcd.start()
    time.sleep(TTL_S)  # past the TTL: only renewals after the restart kept it
    assert keeper.lost is None
    assert keeper.renewals >= 1
    assert fleet.check(slot) is None
    keeper.stop()
    assert fleet.release(slot) is None


# -- etcd down, etcd elsewhere ---------------------------------------------------------


def test_etcd_stopped_is_a_problem_and_back_is_fine(etcd: EtcdProcess) -> None:
    errors: list[str] = []
    fleet = make_fleet(etcd.url, "a", errors)
    assert fleet.probe() is None
    etcd.stop()
    problem = fleet.probe()
    assert problem is not None
    assert problem.startswith(f"etcd {etcd.url} POST /v3/kv/range: ")
    assert "cannot connect" in problem
    assert "\n" not in problem
    with pytest.raises(FleetUnavailable) as info:
        fleet.try_acquire()
    assert info.value.kind == "connect"
    assert errors == ["connect", "connect"]
    etcd.start()
    assert fleet.probe() is None
    assert fleet.try_acquire() is not None


def test_a_dead_first_endpoint_gives_way_to_the_next(etcd: EtcdProcess) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    fleet = Fleet(fleet_settings(dead, etcd.url), "a")
    slot = take(fleet)
    assert fleet.check(slot) is None
    assert fleet.release(slot) is None


class Hung(BaseHTTPRequestHandler):
    """An etcd member that takes requests and never answers (stopped, its disk stalled)."""

    def do_POST(self) -> None:
        time.sleep(30)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_hung_first_endpoint_costs_one_call_not_every_call(etcd: EtcdProcess) -> None:
    """Every call tried the endpoints in the configured order under one deadline: a first
    member that hangs took the whole deadline each time, the healthy ones after it were
    never asked, and specd made no restart (fleet_unavailable) while etcd had a quorum. The
    endpoint that last answered is now asked first."""
    with LoopbackHTTP(Hung) as hung:
        fleet = Fleet(fleet_settings(hung.url, etcd.url, etcd_timeout_s=1), "a")
        started = time.monotonic()
        # Half the deadline each: the healthy member after it answers the very first call
        # (`specd status` and `doctor` make only that one; they said etcd was away).
        assert fleet.probe() is None
        assert time.monotonic() - started < 1.0 + 0.5
        assert fleet.probe() is None
        slot = take(fleet)
        assert fleet.check(slot) is None
        keeper = fleet.keep_alive(slot)
        time.sleep(TTL_S + 1)  # renewed past a TTL, through the healthy member
        assert keeper.lost is None
        keeper.stop()
        assert fleet.release(slot) is None
        assert time.monotonic() - started < TTL_S + 4
        fleet.close()


def test_a_holder_name_that_is_no_unicode_text_is_shown_as_its_bytes(etcd: EtcdProcess) -> None:
    """A lone surrogate escape in a slot's value: shown as the text etcd holds, never as a
    string no encoder takes (it went on into state.json, which then would not load)."""
    fleet = make_fleet(etcd.url, "a")
    lease = fleet.etcd.grant(TTL_S)
    assert fleet.etcd.put_if_absent(slot_key("g1", 0), '{"holder": "box\\ud800"}', lease)
    [holder] = fleet.holders()
    assert holder.name == '{"holder": "box\\ud800"}'
    holder.name.encode("utf-8")  # Unicode text
    problem = fleet.probe()
    assert problem is not None
    problem.encode("utf-8")
    fleet.close()


def test_garbage_in_a_slot_key_is_shown_not_trusted(etcd: EtcdProcess) -> None:
    fleet = make_fleet(etcd.url, "a")
    lease = fleet.etcd.grant(TTL_S)
    assert fleet.etcd.put_if_absent(slot_key("g1", 0), "\x00 not json \n at all", lease)
    assert fleet.etcd.put_if_absent("/specd/g1/slots/x", "{}", lease)  # not a slot key
    [holder] = fleet.holders()
    assert (holder.slot, holder.name, holder.since) == (0, "\x00 not json at all", None)
    assert fleet.try_acquire() is None


# -- a hostile etcd --------------------------------------------------------------------


class FakeEtcd:
    """A real HTTP server on loopback that answers every POST with one canned reply, or
    per path with ``routes``."""

    def __init__(
        self,
        status: int,
        body: bytes,
        headers: dict[str, str] | None = None,
        routes: dict[str, bytes] | None = None,
    ) -> None:
        self.requests: list[str] = []
        requests = self.requests
        by_path = routes or {}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                self.rfile.read(length)
                requests.append(self.path)
                answer = by_path.get(self.path, body)
                self.send_response(status)
                for name, value in (headers or {"Content-Length": str(len(answer))}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(answer)
                self.wfile.flush()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = LoopbackHTTP(Handler)
        self.url = self.server.url

    def close(self) -> None:
        self.server.close()


HEADER = {"header": {"revision": "1"}}
HUGE = b'{"kvs": [' + b'{"key": "AA=="},' * 200_000 + b'{"key": "AA=="}]}'
HOSTILE = [
    ("not json", 200, b"<html>hello</html>", "protocol", "answer is not JSON"),
    ("json array", 200, b"[1, 2]", "protocol", "answer is not a JSON object"),
    ("empty body", 200, b"", "protocol", "answer is not JSON"),
    ("kvs not a list", 200, json.dumps({**HEADER, "kvs": "x"}).encode(), "protocol", "kvs is"),
    (
        "key not base64",
        200,
        json.dumps({**HEADER, "kvs": [{"key": "!!", "lease": "1"}]}).encode(),
        "protocol",
        "key is not base64",
    ),
    (
        "lease not a number",
        200,
        json.dumps({**HEADER, "kvs": [{"key": "AA==", "lease": [1]}]}).encode(),
        "protocol",
        "kv lease is not an integer",
    ),
    ("no header", 200, b"{}", "protocol", "range header is not a JSON object"),
    ("html 502", 502, b"<h1>Bad Gateway</h1>", "http", "HTTP 502"),
    ("etcd error", 400, b'{"error": "bad", "message": "etcdserver: bad", "code": 3}', "http", ""),
    ("huge", 200, HUGE, "protocol", "answer over 1048576 bytes"),
    ("deeply nested", 200, b"[" * 100_000, "protocol", "answer is not JSON"),
    ("not utf-8", 200, b'{"x": "\xff\xfe"}', "protocol", "answer is not JSON"),
    # Valid JSON, no Unicode text: it reached decisions and state.json, which then refused
    # to load (the learned history started over at every start of specd).
    ("lone surrogate", 200, b'{"header": {"revision": "\\ud800"}}', "protocol", "not JSON"),
    ("NaN", 200, b'{"header": {"revision": NaN}, "kvs": []}', "protocol", "answer is not JSON"),
]


@pytest.mark.parametrize(
    ("status", "body", "kind", "says"),
    [pytest.param(*row[1:], id=row[0]) for row in HOSTILE],
)
def test_a_hostile_etcd_is_a_clear_one_line_problem(
    status: int, body: bytes, kind: str, says: str
) -> None:
    fake = FakeEtcd(status, body)
    try:
        errors: list[str] = []
        fleet = make_fleet(fake.url, "a", errors)
        problem = fleet.probe()
        assert problem is not None
        assert says in problem
        assert "\n" not in problem
        assert len(problem) <= 300
        with pytest.raises(FleetUnavailable) as info:
            fleet.try_acquire()
        assert info.value.kind == kind
        assert errors == [kind, kind]
        assert set(errors) <= set(ERROR_KINDS)
        slot = Slot("g1", 0, slot_key("g1", 0), 7, TTL_S, time.time())
        assert fleet.check(slot) is not None  # never "still held" on a nonsense answer
        # Releasing against it reports, never raises.
        released = fleet.release(slot)
        assert released is None or released.startswith("releasing fleet slot 0 failed")
    finally:
        fake.close()


def test_a_lost_race_for_a_slot_is_five_requests_and_leaves_no_lease() -> None:
    # Two reads (the group's slots, then its markers: no other key under the group), the
    # grant, the take that fails, the revoke.
    fake = FakeEtcd(
        200,
        json.dumps(HEADER).encode(),
        routes={"/v3/lease/grant": json.dumps({**HEADER, "ID": "42", "TTL": "5"}).encode()},
    )
    try:
        fleet = make_fleet(fake.url, "a", slots=3)
        assert fleet.try_acquire() is None  # the txn did not succeed: someone else won
        assert fake.requests == [
            "/v3/kv/range",
            "/v3/kv/range",
            "/v3/lease/grant",
            "/v3/kv/txn",
            "/v3/lease/revoke",
        ]
    finally:
        fake.close()


def test_keys_an_etcd_should_not_have_answered_are_not_slots() -> None:
    keys = ["/other/0", "/specd/g1/slots/\u00b2", "/specd/g1/slots/-1", "/specd/g1/slots/"]
    keys.append("/specd/g1/slots/" + "9" * 5000)  # past int()'s digit limit
    kvs = [{"key": base64.b64encode(k.encode()).decode(), "lease": "1"} for k in keys]
    fake = FakeEtcd(200, json.dumps({**HEADER, "kvs": kvs}).encode())
    try:
        fleet = make_fleet(fake.url, "a")
        assert fleet.holders() == []
        assert fleet.probe() is None
    finally:
        fake.close()


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        ({**HEADER, "ID": "0"}, "lease grant without a lease ID"),
        ({**HEADER, "ID": "x"}, "lease ID is not an integer"),
        ({**HEADER, "ID": "99999999999999999999"}, "lease ID is out of range"),
        ({**HEADER, "ID": True}, "lease ID is not an integer"),
        ({"error": "etcdserver: too many requests"}, "too many requests"),
    ],
)
def test_a_hostile_lease_grant_takes_no_slot(answer: dict[str, Any], says: str) -> None:
    # A range with no holders, then a grant answered badly: the slot is never taken.
    fake = FakeEtcd(200, json.dumps(answer).encode())
    try:
        fleet = make_fleet(fake.url, "a")
        fleet.busy = lambda: Busy([], [])  # type: ignore[method-assign]
        with pytest.raises(FleetUnavailable) as info:
            fleet.try_acquire()
        assert says in str(info.value)
    finally:
        fake.close()


def test_an_etcd_that_trickles_its_answer_is_cut_at_the_deadline() -> None:
    body = b" " * 100 + b"{}"

    class Slow(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # specd hung up
                for byte in body:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.05)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with LoopbackHTTP(Slow) as server:
        fleet = make_fleet(server.url, "a", etcd_timeout_s=1)
        started = time.monotonic()
        problem = fleet.probe()
        assert time.monotonic() - started < 3
        assert problem is not None
        assert "no answer within 1 s" in problem


def test_a_journal_slot_is_read_back_or_refused() -> None:
    slot = Slot("g1", 2, slot_key("g1", 2), 2**62, TTL_S, 1.5)
    assert Slot.from_dict(json.loads(json.dumps(slot.to_dict()))) == slot
    for bad in (
        None,
        [],
        {**slot.to_dict(), "key": "/etc/passwd"},
        {**slot.to_dict(), "lease": "x"},
        {**slot.to_dict(), "lease": "0"},
        {k: v for k, v in slot.to_dict().items() if k != "index"},
    ):
        with pytest.raises(ValueError, match="fleet slot"):
            Slot.from_dict(bad)


CLASH = (
    f"another specd of fleet group g1 ({BOX_B}) also calls itself 'box' (this one: {BOX_A}): "
    "each needs its own [fleet] holder_name, or one may take the other's out-of-service "
    "marker for its own"
)
NAME_CASES = [
    # (id, who wrote a key under the name "box", what, who reads it, clash, the marker its own)
    # This specd itself, restarted: its marker is its own to remove, no clash.
    ("itself", BOX_A, "marker", BOX_A, False, True),
    # Another box given the same holder_name (a config copied as it was).
    ("another-box-marker", BOX_B, "marker", BOX_A, True, False),
    ("another-box-slot", BOX_B, "slot", BOX_A, True, False),
    # A key that names no instance (an older specd, or put by hand): read by its name.
    ("no-instance-said", None, "marker", BOX_A, False, True),
    # A reader that knows no instance of its own (built by hand): by the name, as before.
    ("reader-without-instance", BOX_B, "marker", None, False, True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("writer", "what", "reader", "clash", "own"),
    [pytest.param(*c[1:], id=c[0]) for c in NAME_CASES],
)
def test_a_holder_name_another_specd_uses_is_said_and_takes_nothing(
    etcd: EtcdProcess, writer: str | None, what: str, reader: str | None, clash: bool, own: bool
) -> None:
    """Two specds of one name would take each other's marker for their own: the one that
    finds its name under another instance restarts nothing and says why, at once."""
    other = Fleet(fleet_settings(etcd.url, slots=2), "box", instance=writer)
    mine = Fleet(fleet_settings(etcd.url, slots=2), "box", instance=reader)
    if what == "slot":
        take(other)
    else:
        other.mark_out(other.out_marker(time.time(), TTL_S))
    busy = mine.busy()
    assert [k.instance for k in (*busy.holders, *busy.out)] == [writer]
    if clash:
        assert mine.clash(busy) == CLASH
        assert mine.probe() == CLASH
        assert mine.try_acquire() is None
        started = time.monotonic()
        assert mine.acquire(threading.Event(), never) == (None, CLASH)
        assert time.monotonic() - started < 1.0  # said at once, not waited on
    else:
        assert mine.clash(busy) is None
        assert mine.probe() is None
    found, said = mine.own_out()
    assert (found is not None) is own
    assert said == (CLASH if clash else None)
    # Another's slot and marker stay where they are, whatever this one read.
    assert len(mine.holders()) == (1 if what == "slot" else 0)


@pytest.mark.parametrize(
    ("content", "kind", "instance"),
    [
        # specd's own id derived from it (HMAC-SHA256), never the machine id itself.
        ("0123456789abcdef0123456789abcdef\n", "file", DERIVED + " sglang.service"),
        ("not a machine id\n", "file", None),
        ("", "file", None),
        (None, "missing", None),
        (None, "fifo", None),
        (None, "directory", None),
    ],
)
def test_this_specds_instance_is_its_machine_id_and_unit(
    tmp_path: Path, content: str | None, kind: str, instance: str | None
) -> None:
    """The machine id where it reads as one, else the host name; a FIFO is never waited on."""
    path = tmp_path / "machine-id"
    if kind == "file":
        path.write_text(content or "")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    expected = instance if instance is not None else f"{socket.gethostname()} sglang.service"
    assert default_instance("sglang.service", path) == expected


def test_the_daemons_fleet_signs_its_keys(etcd: EtcdProcess) -> None:
    fleet = Fleet.from_settings(fleet_settings(etcd.url), "sglang.service")
    assert fleet.instance == default_instance("sglang.service")
    take(fleet)
    fleet.mark_out(fleet.out_marker(time.time(), TTL_S))
    busy = fleet.busy()
    assert [h.instance for h in busy.holders] == [fleet.instance]
    assert [o.instance for o in busy.out] == [fleet.instance]


def test_a_holder_name_is_kept_as_its_keys_read_back(etcd: EtcdProcess) -> None:
    """A name with a tab, doubled or trailing spaces (a hand-written holder_name) reads back
    from its keys on one line: compared as configured, this specd's own marker was not its
    own, never removed between restarts, and its slot not "(this specd)"."""
    fleet = Fleet(fleet_settings(etcd.url), "box\t a  ", instance=BOX_A)
    assert fleet.holder == "box a"
    take(fleet)
    fleet.mark_out(fleet.out_marker(time.time(), TTL_S))
    busy = fleet.busy()
    assert [h.name for h in busy.holders] == [o.name for o in busy.out] == [fleet.holder]
    found, clash = fleet.own_out()
    assert found is not None
    assert clash is None


def test_a_compressed_etcd_answer_is_refused_undecoded() -> None:
    """Decoded, a few KB of nested gzip were gigabytes before the cap counted a chunk, and
    the MemoryError escaped as no FleetUnavailable (the applier's slot wait let it through)."""
    bomb = gzip_bomb(256 << 20, layers=2)
    fake = FakeEtcd(
        200, bomb, headers={"Content-Length": str(len(bomb)), "Content-Encoding": "gzip, gzip"}
    )
    tracemalloc.start()
    try:
        fleet = make_fleet(fake.url, "a")
        with pytest.raises(FleetUnavailable) as info:
            fleet.try_acquire()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        fake.close()
    assert info.value.kind == "protocol"
    assert "Content-Encoding gzip, gzip" in str(info.value)
    assert peak < 16 << 20, peak
