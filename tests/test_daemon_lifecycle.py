"""What the daemon tells systemd around a restart sequence, over a real AF_UNIX datagram
socket as NOTIFY_SOCKET: READY=1 before any sequence (a replay at start, a pin applied at
the first tick), and during a stop that waits for one, STOPPING=1 then EXTEND_TIMEOUT_USEC=
from the loop's heartbeat only; a loop that stops beating while specd stops ends the
process (the StopGuard), as systemd would not until TimeoutStopSec=, which is as long as a
whole restart sequence (tests/systemd/test_specd_service_lifecycle.py runs the same under a
real systemd, with a daemon-reload mid-stop). The applier is scripted; SGLang's reader too
(test_daemon.py's)."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from structlog.testing import capture_logs
from test_daemon import IN_WINDOW, Reader, config, daemon, obs
from test_units import SPECD_SERVICE, read_unit, seconds, single

from specd.core.setting import SpecSetting, format_setting
from specd.core.settings import RestartSettings
from specd.daemon import Daemon, StopGuard
from specd.io.apply import ApplyOutcome, out_of_service_bound_s, setting_steps
from specd.io.notify import Notifier

WATCHDOG_S = 1.0
# A sequence that is stopped lasts long enough for four extensions at one every half
# watchdog period (three are asserted) and, hung, for more than a period without one; a
# whole period is slack for a loaded 2-core machine. One that is not stopped extends
# nothing, however long it runs: it ends as soon as it may.
HOLD_S = 2.0
UNSTOPPED_HOLD_S = 0.2
# A loop hung mid-stop beats nothing for this long: the StopGuard ends it one watchdog
# period into it (its looks are a quarter period apart); the rest is slack for a loaded
# machine.
HANG_S = 3 * WATCHDOG_S


@dataclass
class Received:
    """What systemd's side of NOTIFY_SOCKET got: (time.monotonic(), message)."""

    sock: socket.socket
    messages: list[tuple[float, str]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def listen(self) -> None:
        self.sock.settimeout(0.05)
        while not self.done.is_set():
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    def texts(self) -> list[str]:
        return [m for _, m in self.messages]


@pytest.fixture
def systemd_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Received]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    monkeypatch.setenv("NOTIFY_SOCKET", sock.getsockname())
    got = Received(sock)
    thread = threading.Thread(target=got.listen, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        got.done.set()
        thread.join()
        sock.close()


JOURNAL = {"phase": "restart_issued", "from_setting": "4", "to_setting": "3"}


class CountingReader(Reader):
    """SGLang at 4 steps; counts the scrapes (a tick makes one)."""

    def __init__(self) -> None:
        super().__init__([obs(IN_WINDOW, steps=4)])
        self.scrapes = 0

    def observe(self) -> Any:
        self.scrapes += 1
        return super().observe()


class ScriptedApplier:
    """A restart sequence as a script: ``pre_journal`` waits (on the daemon's stop event)
    before any journal, as the quiet wait does, and aborts when stopped; otherwise it saves
    a journal at restart_issued and waits out ``hold_s`` the way the applier waits for
    SGLang: on the stop event (which beats), or, with ``hang_after_stop``, in a sleep that
    beats nothing once the stop is seen (a hung loop)."""

    def __init__(
        self,
        received: Received,
        reader: CountingReader,
        *,
        pre_journal: bool = False,
        hang_after_stop: bool = False,
        planned: bool = False,
        hold_s: float = HOLD_S,
    ) -> None:
        self.received = received
        self.reader = reader
        self.pre_journal = pre_journal
        # A journal at "planned" (a drain may follow), and a stop there ends the change.
        self.planned = planned
        self.hang_after_stop = hang_after_stop
        self.hold_s = hold_s
        self.daemon: Daemon | None = None
        self.in_sequence = threading.Event()
        self.seen_at_begin: list[str] | None = None  # what systemd had got by then
        self.scrapes_at_begin: int | None = None
        self.finished = threading.Event()
        self.calls = 0
        self.hung_at: float | None = None  # time.monotonic() when the hang began

    def _sequence(self, was: str, wanted: str, live_after: int | None) -> ApplyOutcome:
        assert self.daemon is not None
        self.calls += 1
        time.sleep(0.1)  # the listener's turn: what went out before is in
        self.seen_at_begin = self.received.texts()
        self.scrapes_at_begin = self.reader.scrapes
        stop = self.daemon.stop_event
        if self.pre_journal:
            self.in_sequence.set()
            while not stop.wait(0.02):
                pass
            return ApplyOutcome("aborted", 4, 3, 0.0, "stop requested", None, 0, was, wanted)
        if self.planned:
            self.daemon._persist_journal(
                {**JOURNAL, "phase": "planned", "from_setting": was, "to_setting": wanted}
            )
            self.in_sequence.set()
            while not stop.wait(0.02):
                pass
            time.sleep(0.1)  # the re-add of a drained worker: the loop beats meanwhile
            stop.wait(0)
            self.daemon._persist_journal({**JOURNAL, "phase": "aborted"})
            return ApplyOutcome("aborted", 4, 3, 0.0, "stop requested", None, 0, was, wanted)
        self.daemon._persist_journal({**JOURNAL, "from_setting": was, "to_setting": wanted})
        self.in_sequence.set()
        end = time.monotonic() + self.hold_s
        stopped_at: float | None = None
        while (left := end - time.monotonic()) > 0:
            if not stop.is_set():
                stop.wait(min(left, 0.02))
                continue
            stopped_at = stopped_at or time.monotonic()
            if self.hang_after_stop and time.monotonic() - stopped_at > 0.2:
                self.hung_at = time.monotonic()
                time.sleep(HANG_S)  # hung: nothing beats from here on
                break
            # As the applier's own pause: a set event's wait returns at once, so sleep too.
            stop.wait(0)
            time.sleep(min(left, 0.02))
        self.daemon._persist_journal({**JOURNAL, "phase": "done"})
        if live_after is not None:  # SGLang runs what was applied (a replay: as it was)
            self.reader.results = [obs(IN_WINDOW, steps=live_after)]
        self.finished.set()
        return ApplyOutcome("success", 4, 3, self.hold_s, "verified 3 steps", 13, 1, was, wanted)

    def apply_setting(
        self,
        target: SpecSetting,
        current: SpecSetting | None,
        *,
        window_open: Callable[[], bool],
        force: bool = False,
        cancelled: Callable[[], str | None] | None = None,
    ) -> ApplyOutcome:
        was = format_setting(current) if current is not None else "unknown"
        assert setting_steps(target) == 3
        return self._sequence(was, format_setting(target), setting_steps(target))

    def reconcile(self, journal_data: Any) -> ApplyOutcome | None:
        return self._sequence("4", "3", None)

    def stop_timeout_s(self) -> float:
        return 0.0

    def read_stop_timeout(self) -> None:
        pass

    def read_wiring(self) -> str | None:
        return None


def pin_now(cfg: Any) -> None:
    expires = datetime.fromtimestamp(IN_WINDOW + 3600, tz=timezone.utc)
    text = tomli_w.dumps(
        {"mode": "pin", "steps": 3, "expires_at": expires, "reason": "t", "apply": "now"}
    )
    Path(cfg.files.override_file).write_text(text)
    os.chmod(cfg.files.override_file, 0o600)


def extensions(received: Received, after: float) -> list[float]:
    return [t for t, m in received.messages if t >= after and m.startswith("EXTEND_TIMEOUT_USEC")]


@pytest.mark.parametrize(
    ("start", "stop", "script"),
    [
        pytest.param("journal", None, {}, id="a replay at start comes after READY=1"),
        pytest.param("pin", None, {}, id="a restart at the first tick comes after READY=1"),
        pytest.param("pin", "in_flight", {}, id="a stop mid-restart extends while it beats"),
        pytest.param("journal", "in_flight", {}, id="a stop mid-replay extends while it beats"),
        pytest.param(
            "pin",
            "in_flight",
            {"hang_after_stop": True},
            id="a loop hung mid-stop extends no more",
        ),
        pytest.param(
            "pin", "in_flight", {"pre_journal": True}, id="a stop before any journal: no extension"
        ),
        pytest.param(
            "pin",
            "in_flight",
            {"planned": True},
            id="a stop before the restart went out says it gives the change up",
        ),
    ],
)
def test_what_systemd_is_told_around_a_restart_sequence(
    tmp_path: Path,
    systemd_side: Received,
    start: str,
    stop: str | None,
    script: dict[str, bool],
) -> None:
    cfg = config(tmp_path, metrics_port=0)
    if start == "pin":
        pin_now(cfg)
    reader = CountingReader()
    hold_s = HOLD_S if stop else UNSTOPPED_HOLD_S
    applier = ScriptedApplier(systemd_side, reader, hold_s=hold_s, **script)
    d = daemon(cfg, reader, applier, [IN_WINDOW])  # type: ignore[arg-type]
    d.notifier = Notifier(
        {"NOTIFY_SOCKET": os.environ["NOTIFY_SOCKET"], "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}
    )
    applier.daemon = d
    ended_at: list[float] = []  # when the StopGuard ended the process (it goes on here)
    d.end_process = lambda: ended_at.append(time.monotonic())
    if start == "journal":
        d.state.journal = dict(JOURNAL)
    runner = threading.Thread(target=d.run)
    stopped_at = 0.0
    with capture_logs() as logged:
        runner.start()
        try:
            assert applier.in_sequence.wait(10)
            if stop is None:
                # Ended, and the loop idles (a scrape interval of 10 s) until stopped.
                assert applier.finished.wait(10)
                time.sleep(0.3)
            else:
                time.sleep(0.1)
            stopped_at = time.monotonic()
            d.request_stop()
        finally:
            runner.join(10 + HANG_S)
    assert not runner.is_alive()
    assert applier.calls == 1
    hung = [e for e in logged if e["event"] == "stop_hung"]
    if script.get("hang_after_stop"):
        # Ended once, one watchdog period into the hang (systemd would wait out
        # TimeoutStopSec=: the extensions only ever lengthen it).
        assert applier.hung_at is not None
        assert len(ended_at) == 1, ended_at
        assert WATCHDOG_S < ended_at[0] - applier.hung_at < HANG_S, (ended_at, applier.hung_at)
        assert len(hung) == 1, hung
        assert hung[0]["log_level"] == "error"
        assert hung[0]["detail"].startswith("the loop has not beaten for "), hung
        assert hung[0]["detail"].endswith(
            f"(WatchdogSec= {WATCHDOG_S:g} s) while the stop waits for the restart in flight "
            "(4 → 3, restart_issued); specd's next start finishes it: ending specd with "
            "SIGABRT, as systemd's watchdog would"
        ), hung
    else:
        assert (ended_at, hung) == ([], []), (ended_at, hung)

    # READY=1 went out before the sequence began, saying what it does.
    seen = applier.seen_at_begin
    assert seen is not None
    readies = [m for m in seen if m.startswith("READY=1\n")]
    assert len(readies) == 1, seen
    if start == "journal":
        assert readies[0].startswith(
            "READY=1\nSTATUS=finishing the restart interrupted when specd stopped (4 → 3): "
        ), readies
        assert applier.scrapes_at_begin == 0, "a tick ran before the replay"
    else:
        assert "override_pin" in readies[0], readies
    texts = systemd_side.texts()
    assert texts[-1] == "STOPPING=1\nSTATUS=stopping"
    if stop is None:
        assert not [m for m in texts if m.startswith("EXTEND_TIMEOUT_USEC")], texts
        return
    extended = extensions(systemd_side, stopped_at)
    stopping = [m for m in texts[:-1] if m.startswith("STOPPING=1")]
    if script.get("pre_journal"):
        assert (extended, stopping) == ([], []), texts
        return
    if script.get("planned"):
        # Not "stopping once the restart in flight ends … killed now, specd's next start
        # finishes it": there is no restart to finish, and the stop ends the change.
        assert len(stopping) == 1, texts
        assert stopping[0] == (
            "STOPPING=1\nSTATUS=stopping: the restart (4 → 3) had not gone out and will not; "
            "undoing what it began (env file, gateway drain, fleet slot)"
        ), stopping
        assert not [m for m in texts if "restart in flight ends" in m], texts
        return
    assert len(stopping) == 1, texts
    assert stopping[0].startswith(
        "STOPPING=1\nSTATUS=stopping once the restart in flight ends (4 → 3): waiting for"
    ), stopping
    first = next(m for m in texts if m.startswith("EXTEND_TIMEOUT_USEC"))
    assert first.startswith(f"EXTEND_TIMEOUT_USEC={int(WATCHDOG_S * 1e6)}\nSTATUS=stopping"), first
    ended = next(t for t, m in systemd_side.messages if m == "STOPPING=1\nSTATUS=stopping")
    # From the stop to the end, no gap as long as one extension: systemd never timed out.
    marks = [stopped_at, *extended]
    gaps = [b - a for a, b in itertools.pairwise(marks)]
    if script.get("hang_after_stop"):
        # The hang beats nothing: the extensions stop with it, and systemd would kill it.
        assert ended - extended[-1] > WATCHDOG_S, (extended, ended)
    else:
        assert len(extended) >= 3, extended
        assert max([*gaps, ended - extended[-1]]) < WATCHDOG_S, (gaps, ended)


def test_the_shipped_stop_timeout_outlasts_a_whole_restart_sequence() -> None:
    """systemd forgets the EXTEND_TIMEOUT_USEC= extensions at a daemon-reload, re-arming
    the stop timeout from TimeoutStopSec= alone: a stop finishing a restart in flight
    (verified or rolled back) was SIGKILLed at once by a daemon-reload more than 90 s into
    it. specd.service's covers a whole sequence at its worst with the default timeouts (the
    out-of-service bound and the quiet wait: the README's 77 minutes)."""
    restart = RestartSettings()
    worst_s = restart.quiet_deadline_s + out_of_service_bound_s(restart, None)
    assert worst_s == 4572  # as the unit's comment adds it up
    unit = read_unit(SPECD_SERVICE)
    timeout_s = seconds(single(unit, "Service", "TimeoutStopSec"))
    assert timeout_s >= worst_s + 60, timeout_s
    # Bounded still: a specd whose StopGuard cannot act (the whole process stuck) is killed.
    assert timeout_s <= 2 * worst_s, timeout_s


@pytest.mark.parametrize("stops", [False, True])
def test_the_stop_guard_acts_only_on_a_stop_whose_loop_stopped_beating(stops: bool) -> None:
    """A loop silent for longer than a period while specd runs is systemd's watchdog's to
    kill; while specd stops, the guard's, once."""
    period_s = 0.2
    beaten_at = time.monotonic()
    stopping = threading.Event()
    hung: list[tuple[float, float]] = []  # (when, silent_s)
    guard = StopGuard(
        period_s,
        beaten_at=lambda: beaten_at,
        stopping=stopping.is_set,
        hung=lambda silent: hung.append((time.monotonic(), silent)),
    )
    try:
        time.sleep(3 * period_s)  # silent, not stopping
        assert hung == []
        if stops:
            stopping.set()
            time.sleep(3 * period_s)
            # Silent since before the stop: acted on at its first look, once.
            assert len(hung) == 1, hung
            assert hung[0][1] > period_s
    finally:
        guard.close()
    assert len(hung) == (1 if stops else 0)


def test_the_stop_guard_leaves_a_beating_stop_alone() -> None:
    period_s = 0.2
    beats = [time.monotonic()]
    hung: list[float] = []
    guard = StopGuard(
        period_s, beaten_at=lambda: beats[-1], stopping=lambda: True, hung=hung.append
    )
    try:
        end = time.monotonic() + 5 * period_s
        while time.monotonic() < end:
            beats.append(time.monotonic())
            time.sleep(period_s / 4)
        assert hung == []
        time.sleep(4 * period_s)  # the beats stop
        assert len(hung) == 1, hung
        assert period_s < hung[0] < 4 * period_s, hung
    finally:
        guard.close()
