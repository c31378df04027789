"""At most N servers of a group restart at once: a lease-backed semaphore in etcd.

Slot ``i`` of group ``g`` is the key ``/specd/g/slots/i``. Taking it is one transaction that
puts the key, attached to a fresh lease, only if the key does not exist (its
``create_revision`` is 0), so two specds can never both hold it. While the restart runs a
``LeaseKeeper`` thread renews the lease at once, then every third of its TTL; the applier
checks the key is still on the lease right before the restart (a specd cut off from etcd
for a TTL has lost its slot and must not restart: no split brain), and releases it
(revokes the lease, which deletes the key) once SGLang is verified or rolled back. A specd
that dies, even by SIGKILL, stops renewing: etcd deletes the key one TTL later and the next
server may go. The key's value says who holds it (JSON: holder, since, instance) for
``specd status``.

A slot alone does not keep the promise "at most ``slots`` out of service": its lease is short
(``lease_ttl_s``, 30 s) so that a dead specd frees it soon, but a server whose specd died
(SIGKILL, OOM) or lost etcd after the restart went out stays out of service for minutes (a
model load, a rollback). So while its server is out, a holder also writes an out-of-service
marker, ``/specd/g/out/<holder>`` (the holder name percent-encoded), under a lease of its own
that nobody renews: its TTL is the bound of the rest of the sequence (the applier derives it
from the drain, restart, start and verification timeouts, ``out_of_service_bound_s``), so the
marker outlives a dead holder exactly as long as its server can be out, and a dead host never
blocks its group longer than that. The holder revokes it once the server serves again. Chosen
over renewing the slot's lease from afar (impossible once the holder is dead) and over one long
slot lease (a specd that dies before taking its server out would then block the group for the
whole bound). ``_free`` counts distinct holders over slots and markers: a marker whose holder
still holds a slot counts once; this specd's own marker counts not at all (it has no sequence
in flight when it asks, so a marker under its name is one a failed revoke left behind, or one
kept while a gateway replica leaves its worker out: its next sequence overwrites it, and the
applier removes it once the server serves, `Applier.retry_mark_in`). Holder names must
therefore differ within a group (the default, host name and unit, does). A name given twice
(`holder_name` copied with the config to another box, two hosts of one name) would let one
specd take another's marker for its own, overwrite or remove it: each specd writes who it is
beside its name (``instance``: an id of the machine and the unit) and one that finds its name under
another instance in a slot or marker restarts nothing and says why (`Fleet.clash`). A key
without an instance (written by hand, or by an older specd) is read by its name, as before.

Client: etcd's v3 JSON gateway (grpc-gateway, served on the client port since etcd 3.3;
3.4.23 here), spoken with httpx, specd's HTTP client already. Chosen over ``etcd3gw``
(OpenStack's client for the same gateway), because specd needs five calls (lease grant,
keepalive, revoke, time-to-live; kv range and txn), each one POST of a small JSON body,
and etcd3gw would add a dependency on ``requests`` and ``futurist`` (a second HTTP stack
beside httpx, with its own proxy/timeout rules) whose errors surface as that library's
exceptions; here every answer is size-capped, bounded by one deadline over all endpoints,
and every failure is one ``FleetUnavailable`` with a bounded kind for the metrics. The
``etcd3`` gRPC client is unmaintained and needs grpcio and protobuf pins.

Every call to etcd can fail: the errors are ``FleetUnavailable`` (never another exception,
whatever etcd or something pretending to be it answers), and the applier turns them into
"no restart" (reason ``fleet_unavailable``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from specd import __version__
from specd.core.settings import FleetSettings
from specd.core.text import ascii_count, one_line, utc_time
from specd.io import files
from specd.io.answers import read_capped
from specd.io.files import FileReadError, read_regular_file
from specd.io.tls import context_for

KEY_PREFIX = "/specd"
# An etcd answer to these calls is a few hundred bytes; a range over 64 slots a few KB.
MAX_ANSWER_BYTES = 1024 * 1024
# A slot's or marker's value is a few hundred bytes: one longer is not specd's, and is not
# read (its key counts, held by an unreadable holder).
MAX_VALUE_BYTES = 64 * 1024
# Keys of one sub-prefix read one by one, when reading them at once was over
# MAX_ANSWER_BYTES (a huge value among them); a group has at most a few dozen.
MAX_KEYS_ONE_BY_ONE = 256
# The name a slot holder whose value cannot be read goes by (status, probe).
UNREADABLE_HOLDER = "(a holder whose value cannot be read)"
MAX_HOLDER_CHARS = 200
# 9999-12-31T23:59:59Z: the last second a datetime (and `specd status`) can show.
MAX_SINCE = 253402300799
# systemd's id of this machine (machine-id(5)): 32 lowercase hex digits.
MACHINE_ID = Path("/etc/machine-id")
# What specd's own id of the machine is derived with (`default_instance`).
SPECD_APP_ID = b"specd fleet instance"
# Bounded labels of specd_fleet_etcd_errors_total.
ERROR_KINDS = ("connect", "timeout", "http", "protocol", "lost")


class FleetUnavailable(Exception):
    """etcd could not be asked, or did not answer as etcd does. One line; ``kind`` is one
    of ERROR_KINDS."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        assert kind in ERROR_KINDS, kind
        super().__init__(_one_line(message))
        self.kind = kind
        self.status = status  # the HTTP status etcd answered with, if it answered
        self.counted = False  # on_error was told already
        self.oversized = False  # the answer was over MAX_ANSWER_BYTES


def _one_line(text: str, limit: int = 300) -> str:
    return one_line(text, limit)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise FleetUnavailable("protocol", f"etcd answer: {what} is not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise FleetUnavailable("protocol", f"etcd answer: {what} is not base64") from None


def _int64(value: Any, what: str, default: int | None = None) -> int:
    """grpc-gateway sends int64 as a decimal string and omits zero values."""
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise FleetUnavailable("protocol", f"etcd answer: {what} is not an integer")
    try:
        number = int(value)
    except ValueError:
        raise FleetUnavailable("protocol", f"etcd answer: {what} is not an integer") from None
    if not -(2**63) <= number < 2**63:
        raise FleetUnavailable("protocol", f"etcd answer: {what} is out of range")
    return number


def _object(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise FleetUnavailable("protocol", f"etcd answer: {what} is not a JSON object")
    return value


class EtcdClient:
    """The few v3 JSON gateway calls specd makes, against the endpoints in order.

    One call has one deadline (``timeout_s``) over all its endpoints, body reads included;
    an endpoint that cannot be reached, times out, answers 5xx or garbage gives way to the
    next, and goes to the end of the order for the calls after. ``on_error(kind)`` is
    called once per failed call. ``beat()`` before each request and with each piece of an
    answer: the few calls of one try for a slot, each up to its timeout, still show the
    daemon's loop alive (its watchdog heartbeat is sent at most every half period, so a gap
    of 4 calls of 10 s could outlast it)."""

    def __init__(
        self,
        endpoints: list[str],
        timeout_s: float,
        *,
        on_error: Callable[[str], None] | None = None,
        beat: Callable[[], None] | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._on_error = on_error
        self._beat = beat or (lambda: None)
        # trust_env=False: an HTTP(S)_PROXY meant for the internet must not capture etcd.
        self._http = httpx.Client(
            timeout=timeout_s,
            trust_env=False,
            verify=context_for(*self.endpoints, trust_env=False),
            headers={"User-Agent": f"specd/{__version__}", "Accept-Encoding": "identity"},
        )
        self._lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def call(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        expected: tuple[int, ...] = (),
        oversized_ok: bool = False,
    ) -> Mapping[str, Any]:
        """POST ``body`` to ``path``; the JSON object answered. ``expected``: HTTP statuses
        that are an answer, not an error (raised, but not counted). ``oversized_ok``: an
        answer over MAX_ANSWER_BYTES is an answer too (the data is that large: every member
        would say the same), raised at once with ``oversized`` set, not counted."""
        deadline = time.monotonic() + self.timeout_s
        problems: list[FleetUnavailable] = []
        order = list(self.endpoints)
        for index, endpoint in enumerate(order):
            now = time.monotonic()
            if now >= deadline and problems:
                break
            # An equal share of what is left for each endpoint not asked yet: a member that
            # hangs took the whole deadline, so a one-shot command (status, doctor) said
            # etcd was away while the member after it answered.
            share = now + (deadline - now) / (len(order) - index)
            try:
                answer = self._call_one(endpoint, path, body, share)
            except FleetUnavailable as exc:
                if exc.oversized and oversized_ok:
                    exc.counted = True
                    raise
                problems.append(exc)
                if exc.status is not None and 400 <= exc.status < 500:
                    break  # etcd refused the request itself: another member would too
                # Asked last from now on: a member that hangs (its host down, SYNs dropped)
                # would take each call's whole deadline before the others were asked.
                self.endpoints.remove(endpoint)
                self.endpoints.append(endpoint)
                continue
            return answer
        last = problems[-1]
        tried = f"{len(problems)} of {len(self.endpoints)} etcd endpoints"
        error = FleetUnavailable(last.kind, f"{last} ({tried} tried)", last.status)
        error.counted = last.status in expected
        raise error

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        """Each failed call reported once to ``on_error``, a malformed answer included."""
        try:
            yield
        except FleetUnavailable as exc:
            if not exc.counted and self._on_error is not None:
                self._on_error(exc.kind)
            exc.counted = True
            raise

    def _call_one(
        self, endpoint: str, path: str, body: Mapping[str, Any], deadline: float
    ) -> Mapping[str, Any]:
        where = f"etcd {endpoint} POST {path}"
        self._beat()
        left = max(0.05, deadline - time.monotonic())
        try:
            with (
                self._lock,
                self._http.stream(
                    "POST", endpoint + path, json=dict(body), timeout=httpx.Timeout(left)
                ) as resp,
            ):
                raw = read_capped(resp, MAX_ANSWER_BYTES, deadline, self._beat)
                status = resp.status_code
        except httpx.TimeoutException:
            raise FleetUnavailable(
                "timeout", f"{where}: no answer within {_seconds(left)} s"
            ) from None
        except (httpx.ConnectError, socket.gaierror) as exc:
            raise FleetUnavailable("connect", f"{where}: cannot connect: {exc}") from None
        except httpx.HTTPError as exc:
            raise FleetUnavailable(
                "protocol", f"{where}: broken response: {type(exc).__name__} {exc}"
            ) from None
        if raw is None:
            oversized = FleetUnavailable(
                "protocol", f"{where}: answer over {MAX_ANSWER_BYTES} bytes"
            )
            oversized.oversized = True
            raise oversized
        try:
            # Finite numbers and Unicode text: a holder's name reaches decisions, the state
            # file and status.
            data = files.parse_json(raw, finite=True)
        except files.ParseError:
            if status != 200:
                raise FleetUnavailable("http", f"{where}: HTTP {status}", status) from None
            raise FleetUnavailable("protocol", f"{where}: answer is not JSON") from None
        if status != 200:
            detail = data.get("message") or data.get("error") if isinstance(data, dict) else None
            suffix = f": {_one_line(str(detail), 120)}" if detail else ""
            raise FleetUnavailable("http", f"{where}: HTTP {status}{suffix}", status)
        if not isinstance(data, dict):
            raise FleetUnavailable("protocol", f"{where}: answer is not a JSON object")
        return data

    # -- the calls ------------------------------------------------------------------
    def version(self) -> str:
        """The etcd server's version (maintenance status), for `specd doctor`."""
        with self._counting():
            answer = self.call("/v3/maintenance/status", {})
            version = answer.get("version")
            if not isinstance(version, str) or not version:
                raise FleetUnavailable("protocol", "etcd answer: status without a version")
            return _one_line(version, 40)

    def grant(self, ttl_s: int) -> int:
        with self._counting():
            answer = self.call("/v3/lease/grant", {"TTL": ttl_s})
            if answer.get("error"):
                raise FleetUnavailable(
                    "http", f"etcd lease grant: {_one_line(answer['error'], 120)}"
                )
            lease = _int64(answer.get("ID"), "lease ID")
            if lease <= 0:
                raise FleetUnavailable("protocol", "etcd answer: lease grant without a lease ID")
            return lease

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its TTL now, 0 when the lease is gone."""
        with self._counting():
            answer = self.call("/v3/lease/keepalive", {"ID": str(lease)})
            if "error" in answer:
                raise FleetUnavailable("http", f"etcd keepalive: {_one_line(answer['error'], 120)}")
            result = _object(answer.get("result"), "keepalive result")
            return max(0, _int64(result.get("TTL"), "keepalive TTL", default=0))

    def time_to_live(self, lease: int) -> tuple[int, list[str]]:
        """(seconds left, -1 when gone; the keys on the lease)."""
        with self._counting():
            answer = self.call("/v3/lease/timetolive", {"ID": str(lease), "keys": True})
            ttl = _int64(answer.get("TTL"), "lease TTL", default=0)
            keys = answer.get("keys", [])
            if not isinstance(keys, list):
                raise FleetUnavailable("protocol", "etcd answer: lease keys is not a list")
            names = [_unb64(k, "lease key").decode("utf-8", "replace") for k in keys]
            return ttl, names

    def revoke(self, lease: int) -> None:
        with self._counting():
            try:
                self.call("/v3/lease/revoke", {"ID": str(lease)}, expected=(404,))
            except FleetUnavailable as exc:
                if exc.status != 404:
                    raise  # 404: gone already (expired), released all the same

    def put_if_absent(
        self, key: str, value: str, lease: int, *, unchanged: Sequence[tuple[str, int]] = ()
    ) -> bool:
        """Put ``key`` on ``lease`` only if it does not exist, and, for each (prefix,
        revision) of ``unchanged``, only if no key under the prefix was put since that
        revision (a decision made on a read at it still holds); True when it was put."""
        k = _b64(key)
        compare: list[dict[str, str]] = [
            {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        ]
        for prefix, revision in unchanged:
            compare.append(
                {
                    "key": _b64(prefix),
                    "range_end": _b64(_prefix_end(prefix)),
                    "target": "MOD",
                    "result": "LESS",
                    "mod_revision": str(revision + 1),
                }
            )
        return self._txn_put(compare, k, value, lease)

    def put_if_leased(self, key: str, value: str, lease: int, held: str, held_lease: int) -> bool:
        """Put ``key`` on ``lease`` only while the key ``held`` lives on ``held_lease``;
        True when it was put."""
        compare = [
            {"key": _b64(held), "target": "LEASE", "result": "EQUAL", "lease": str(held_lease)}
        ]
        return self._txn_put(compare, _b64(key), value, lease)

    def _txn_put(self, compare: list[dict[str, str]], key: str, value: str, lease: int) -> bool:
        with self._counting():
            answer = self.call(
                "/v3/kv/txn",
                {
                    "compare": compare,
                    "success": [
                        {"request_put": {"key": key, "value": _b64(value), "lease": str(lease)}}
                    ],
                },
            )
            _object(answer.get("header"), "txn header")
            succeeded = answer.get("succeeded", False)
            if not isinstance(succeeded, bool):
                raise FleetUnavailable("protocol", "etcd answer: txn succeeded is not a boolean")
            return succeeded

    def put(self, key: str, value: str, lease: int) -> None:
        """Put ``key`` on ``lease`` (over whatever was there, on whichever lease)."""
        with self._counting():
            answer = self.call(
                "/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(lease)}
            )
            _object(answer.get("header"), "put header")

    def read_small(self, prefix: str) -> tuple[list[tuple[str, bytes | None, int]], int]:
        """(key, value, lease) of every key under ``prefix``, and the store's revision the
        read saw them at; a value over MAX_VALUE_BYTES is None (not read): one large value
        under ``prefix`` (another tool's, a hand's) makes the others no less readable. One
        request; only when its answer is over MAX_ANSWER_BYTES, the keys alone, then each
        key's value alone."""
        end = _prefix_end(prefix)
        with self._counting():
            try:
                kvs, revision = self._range(prefix, end, oversized_ok=True)
            except FleetUnavailable as exc:
                if not exc.oversized:
                    raise
            else:
                return [(k, _small(v), lease) for k, v, lease in kvs], revision
            keys, revision = self._range(prefix, end, keys_only=True)
            if len(keys) > MAX_KEYS_ONE_BY_ONE:
                raise FleetUnavailable(
                    "protocol",
                    f"etcd answer: {len(keys)} keys under {_one_line(prefix, 100)} with "
                    f"{MAX_ANSWER_BYTES} bytes of values and more",
                )
            out: list[tuple[str, bytes | None, int]] = []
            for key, _, lease in keys:
                try:
                    one, _ = self._range(key, None, oversized_ok=True)
                except FleetUnavailable as exc:
                    if not exc.oversized:
                        raise
                    out.append((key, None, lease))
                    continue
                # Gone since the keys were read: not there (a compare at ``revision`` of
                # a take sees any key put since).
                out += [(k, _small(v), lease) for k, v, lease in one if k == key]
            return out, revision

    def _range(
        self, key: str, end: str | None, *, keys_only: bool = False, oversized_ok: bool = False
    ) -> tuple[list[tuple[str, bytes, int]], int]:
        body: dict[str, Any] = {"key": _b64(key)}
        if end is not None:
            body["range_end"] = _b64(end)
        if keys_only:
            body["keys_only"] = True
        answer = self.call("/v3/kv/range", body, oversized_ok=oversized_ok)
        header = _object(answer.get("header"), "range header")
        revision = _int64(header.get("revision"), "range revision", default=0)
        kvs = answer.get("kvs", [])
        if not isinstance(kvs, list):
            raise FleetUnavailable("protocol", "etcd answer: kvs is not a list")
        out = []
        for item in kvs:
            kv = _object(item, "kv")
            name = _unb64(kv.get("key"), "key").decode("utf-8", "replace")
            value = _unb64(kv.get("value", ""), "value")
            out.append((name, value, _int64(kv.get("lease"), "kv lease", default=0)))
        return out, revision


def _small(value: bytes) -> bytes | None:
    return value if len(value) <= MAX_VALUE_BYTES else None


def _prefix_end(prefix: str) -> str:
    """The end of etcd's range of keys that start with ``prefix`` (its last byte + 1)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@dataclass(frozen=True)
class Holder:
    """Who holds a slot, as its key says."""

    slot: int
    name: str
    since: float | None
    lease: int
    # Who wrote it (`default_instance`); None where the value does not say.
    instance: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Slot:
    """A slot this specd took; the journal keeps ``to_dict`` so a restarted specd can
    release it (or find it gone)."""

    group: str
    index: int
    key: str
    lease: int
    ttl_s: int
    taken_at: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lease": str(self.lease)}

    @classmethod
    def from_dict(cls, data: Any) -> Slot:
        if not isinstance(data, Mapping):
            raise ValueError("fleet slot is not an object")
        try:
            slot = cls(
                group=str(data["group"]),
                index=int(data["index"]),
                key=str(data["key"]),
                lease=int(str(data["lease"])),
                ttl_s=int(data["ttl_s"]),
                taken_at=float(data["taken_at"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"fleet slot is not readable ({exc})") from None
        if slot.key != slot_key(slot.group, slot.index) or slot.lease <= 0:
            raise ValueError(f"fleet slot {slot.key!r} is not a slot key of its group")
        return slot


@dataclass(frozen=True)
class OutOfService:
    """A server out of service for a restart, as its marker says: who (from the key), since
    when, and until when the marker lasts at most (from the value; None: not readable)."""

    name: str
    since: float | None
    until: float | None
    lease: int
    # Who wrote it (`default_instance`); None where the value does not say.
    instance: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Busy:
    """The group as etcd shows it: the slots held and the servers marked out of service."""

    holders: list[Holder]
    out: list[OutOfService]
    # The etcd revisions its slots and its markers were read at (0: not read from etcd).
    revision: int = 0
    out_revision: int = 0


@dataclass(frozen=True)
class OutMarker:
    """The out-of-service marker this specd put; the journal keeps ``to_dict`` so a resumed
    sequence keeps it and revokes it at its end."""

    group: str
    key: str
    lease: int
    ttl_s: int
    since: float
    until: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lease": str(self.lease)}

    @classmethod
    def from_dict(cls, data: Any) -> OutMarker:
        if not isinstance(data, Mapping):
            raise ValueError("fleet out-of-service marker is not an object")
        try:
            marker = cls(
                group=str(data["group"]),
                key=str(data["key"]),
                lease=int(str(data["lease"])),
                ttl_s=int(data["ttl_s"]),
                since=float(data["since"]),
                until=float(data["until"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"fleet out-of-service marker is not readable ({exc})") from None
        if _out_name(marker.group, marker.key) is None or marker.lease <= 0:
            raise ValueError(
                f"fleet out-of-service marker {marker.key!r} is not a marker key of its group"
            )
        return marker


def slot_prefix(group: str) -> str:
    return f"{KEY_PREFIX}/{group}/slots/"


def slot_key(group: str, index: int) -> str:
    return f"{slot_prefix(group)}{index}"


def out_prefix(group: str) -> str:
    return f"{KEY_PREFIX}/{group}/out/"


def out_key(group: str, holder: str) -> str:
    # Percent-encoded: a holder name may hold '/', spaces, anything but a line break.
    return out_prefix(group) + urllib.parse.quote(holder, safe="")


def _out_name(group: str, key: str) -> str | None:
    """The holder a marker key names, or None for a key that is not one (written by someone
    else): only the exact encoding ``out_key`` writes is read."""
    prefix = out_prefix(group)
    if not key.startswith(prefix):
        return None
    encoded = key[len(prefix) :]
    if not encoded or len(encoded) > 3 * 4 * MAX_HOLDER_CHARS:
        return None
    if not encoded.isascii():
        return None
    try:
        name = urllib.parse.unquote(encoded, errors="strict")
    except UnicodeDecodeError:
        return None
    if urllib.parse.quote(name, safe="") != encoded:
        return None
    return _one_line(name, MAX_HOLDER_CHARS) or None


def default_holder(unit: str) -> str:
    return f"{socket.gethostname()} {unit}"


def default_instance(unit: str, machine_id: Path = MACHINE_ID) -> str:
    """Who this specd is, beyond its holder name: an id of this machine (machine-id(5):
    systemd's, stable across reboots, set by no config of specd's) and the SGLang unit; the
    host name where the machine id cannot be read. Not the machine id itself, which
    machine-id(5) asks to keep confidential: an id derived from it for specd alone
    (HMAC-SHA256 keyed by it, as sd_id128_get_machine_app_specific does), 32 hex digits."""
    try:
        # A symlink in some images (/etc/machine-id -> /run/...); never a FIFO's wait.
        text = read_regular_file(machine_id, 64, follow_symlinks=True).decode("ascii").strip()
    except (FileReadError, UnicodeDecodeError):
        text = ""
    if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
        text = hmac.new(bytes.fromhex(text), SPECD_APP_ID, hashlib.sha256).hexdigest()[:32]
    else:
        text = socket.gethostname()
    return _one_line(f"{text} {unit}", MAX_HOLDER_CHARS)


@dataclass
class FleetHooks:
    """What the fleet reports as it goes (the daemon points these at its metrics)."""

    error: Callable[[str], None] = field(default=lambda kind: None)
    # The slot this specd holds from now on (its `Slot.taken_at` says since when), or None
    # once it gave the slot back.
    held: Callable[[Slot | None], None] = field(default=lambda slot: None)
    waited: Callable[[float], None] = field(default=lambda seconds: None)
    # True once this server's out-of-service marker is in etcd, False once it is gone
    # (removed, or past its bound).
    out: Callable[[bool], None] = field(default=lambda marked: None)
    # Each time `Fleet.clash` finds this specd's holder name under another specd.
    clash: Callable[[], None] = field(default=lambda: None)
    # The daemon loop's heartbeat, called around etcd requests made by the loop's own
    # thread (never by the lease keeper's: the watchdog must see the loop stuck).
    beat: Callable[[], None] = field(default=lambda: None)


class Fleet:
    """The group's slots, as this specd sees and takes them."""

    def __init__(
        self,
        settings: FleetSettings,
        holder: str,
        *,
        instance: str | None = None,
        hooks: FleetHooks | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.group = settings.group
        self.slots = settings.slots
        # As its keys read back (`_out_name`, `_parse_holder`): one line, bounded, so every
        # comparison with a name read from etcd holds for this specd's own.
        self.holder = _one_line(holder, MAX_HOLDER_CHARS)
        # Written beside the name so a second specd of the same name shows (`clash`);
        # None writes none (a key read by its name alone, as before instances).
        self.instance = None if instance is None else _one_line(instance, MAX_HOLDER_CHARS)
        self.hooks = hooks or FleetHooks()
        self.etcd = EtcdClient(
            settings.etcd_endpoints,
            settings.etcd_timeout_s,
            on_error=self.hooks.error,
            beat=self.hooks.beat,
        )
        self._clock = clock
        self._mono = monotonic
        # Whole seconds, as etcd grants them; never below the 5 s the settings allow.
        self.ttl_s = max(5, round(settings.lease_ttl_s))

    @classmethod
    def from_settings(
        cls,
        settings: FleetSettings,
        unit: str,
        hooks: FleetHooks | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Fleet:
        return cls(
            settings,
            settings.holder_name or default_holder(unit),
            instance=default_instance(unit),
            hooks=hooks,
            clock=clock,
        )

    def close(self) -> None:
        self.etcd.close()

    # -- reading ----------------------------------------------------------------------
    def busy(self) -> Busy:
        """The group's slot keys, by slot (also slots beyond ``slots``, held by a specd
        configured with more: they are shown and counted, never taken), and its
        out-of-service markers, by name; two etcd requests, one per sub-prefix: other keys
        under the group (another tool's, however large or often written) are not ours to
        read. A slot whose value is too large to read is held all the same, by
        UNREADABLE_HOLDER; a marker's, all the same, at no time said."""
        slots = slot_prefix(self.group)
        held: list[Holder] = []
        out: list[OutOfService] = []
        slot_keys, revision = self.etcd.read_small(slots)
        for key, value, lease in slot_keys:
            index = ascii_count(key[len(slots) :], 6) if key.startswith(slots) else None
            if index is not None:
                if value is None:
                    held.append(Holder(index, UNREADABLE_HOLDER, None, lease))
                else:
                    name, since, instance = _parse_holder(value)
                    held.append(Holder(index, name, since, lease, instance))
        out_keys, out_revision = self.etcd.read_small(out_prefix(self.group))
        for key, value, lease in out_keys:
            name_out = _out_name(self.group, key)
            if name_out is not None:
                # The key names the server (a value is only another host's word on times).
                since, until, instance = (None, None, None) if value is None else _parse_out(value)
                out.append(OutOfService(name_out, since, until, lease, instance))
        return Busy(
            sorted(held, key=lambda h: h.slot),
            sorted(out, key=lambda o: o.name),
            revision,
            out_revision,
        )

    def holders(self) -> list[Holder]:
        """Every slot key of the group, by slot (see ``busy``)."""
        return self.busy().holders

    def probe(self) -> str | None:
        """Why this specd could not take a slot now (one line), or None: etcd answers and
        a slot is free."""
        try:
            busy = self.busy()
        except FleetUnavailable as exc:
            return str(exc)
        clash = self.clash(busy)
        if clash is not None:
            return clash
        if self._free(busy) is not None:
            return None
        return f"all {self.slots} slot(s) of fleet group {self.group} busy: " + _who(
            busy, self.slots, self._mine
        )

    def _mine(self, name: str, instance: str | None) -> bool:
        """Whether a key of ``name`` written by ``instance`` is this specd's: its name, and
        its instance or none said (on either side)."""
        return name == self.holder and same_instance(instance, self.instance)

    def clash(self, busy: Busy) -> str | None:
        """Why this specd must not take a slot while another specd of the group uses its
        holder name (a slot or marker under it, written by another instance), or None."""
        keys: list[tuple[str, str | None]] = [(h.name, h.instance) for h in busy.holders]
        keys += [(o.name, o.instance) for o in busy.out]
        others = sorted(
            {
                str(instance)
                for name, instance in keys
                if name == self.holder and not same_instance(instance, self.instance)
            }
        )
        if not others:
            return None
        self.hooks.clash()
        return (
            f"another specd of fleet group {self.group} ({others[0]}) also calls itself "
            f"{self.holder!r} (this one: {self.instance}): each needs its own [fleet] "
            "holder_name, or one may take the other's out-of-service marker for its own"
        )

    def _free(self, busy: Busy) -> int | None:
        """The slot to take, or None. Every holder counts against this specd's ``slots``,
        also one beyond them (a specd of the group configured with more, as while `slots`
        is raised host by host), and so does every other server marked out of service whose
        holder no longer holds a slot (its lease ran out while the server was still out): at
        most ``slots`` out at once, as this config says."""
        taken = {h.slot for h in busy.holders}
        if len(taken) + len(_out_only(busy, self._mine)) >= self.slots:
            return None
        return next((i for i in range(self.slots) if i not in taken), None)

    # -- taking, keeping, releasing ---------------------------------------------------
    def try_acquire(self) -> Slot | None:
        """Take a free slot now, or None when all are held (or another specd took the one
        tried first: the next try sees it; or its holder name clashes, `clash`). Five etcd
        requests at most (two reads, grant, take, revoke), each beating the watchdog, so one
        try stays inside it whatever etcd does."""
        busy = self.busy()
        return None if self.clash(busy) is not None else self._take(busy)

    def _take(self, busy: Busy) -> Slot | None:
        index = self._free(busy)
        if index is None:
            return None
        lease = self.etcd.grant(self.ttl_s)
        taken_at = self._clock()
        value = json.dumps({"holder": self.holder, "since": taken_at, **self._signed()})
        try:
            # Only if the group's slots and markers are as read: one put since (another
            # specd's, taken while this one decided) could make one server out too many.
            # Only those: another tool's keys under the group change nothing here.
            unchanged = [
                (slot_prefix(self.group), busy.revision),
                (out_prefix(self.group), busy.out_revision),
            ]
            taken = self.etcd.put_if_absent(
                slot_key(self.group, index), value, lease, unchanged=unchanged
            )
        except FleetUnavailable:
            self._revoke_quietly(lease)
            raise
        if not taken:
            # Another specd was faster, or the group changed since it was read: the next
            # try reads it again. No lease left behind.
            self._revoke_quietly(lease)
            return None
        slot = Slot(self.group, index, slot_key(self.group, index), lease, self.ttl_s, taken_at)
        self.hooks.held(slot)
        return slot

    def acquire(
        self, stop: threading.Event, give_up: Callable[[], str | None]
    ) -> tuple[Slot | None, str]:
        """Wait for a slot (every slot_poll_interval_s) until one is free, ``give_up``
        returns a reason (the window closed), ``stop`` is set or slot_wait_max_s passed.
        Returns (the slot, how long it took) or (None, why not). Raises FleetUnavailable."""
        started = self._mono()
        deadline = started + self.settings.slot_wait_max_s
        while True:
            busy = self.busy()
            clash = self.clash(busy)
            if clash is not None:
                return None, clash  # waiting would not end it: an operator must
            slot = self._take(busy)
            waited = self._mono() - started
            if slot is not None:
                self.hooks.waited(waited)
                return (
                    slot,
                    f"took fleet slot {slot.index} of group {self.group} after {waited:.1f} s",
                )
            all_busy = f"all {self.slots} slot(s) of fleet group {self.group} busy"
            why = give_up()
            if why is not None:
                return None, f"{why} while waiting {waited:.0f} s for a fleet slot ({all_busy})"
            left = deadline - self._mono()
            if left <= 0:
                return (
                    None,
                    f"no fleet slot within {self.settings.slot_wait_max_s:g} s ({all_busy})",
                )
            if stop.wait(min(self.settings.slot_poll_interval_s, left)):
                return None, "stop requested while waiting for a fleet slot"

    def holds(self, slot: Slot) -> str | None:
        """None while ``slot``'s key still lives on its lease; else why not (one line).
        Raises FleetUnavailable when etcd cannot say."""
        ttl, keys = self.etcd.time_to_live(slot.lease)
        if ttl <= 0:
            return f"the lease of fleet slot {slot.index} expired"
        if slot.key not in keys:
            return f"fleet slot {slot.index} is no longer on this specd's lease"
        return None

    def check(self, slot: Slot) -> str | None:
        """Right before a restart: None only when etcd confirms the slot is still ours."""
        try:
            problem = self.holds(slot)
        except FleetUnavailable as exc:
            return f"cannot confirm the fleet slot is still held: {exc}"
        if problem is not None:
            self.hooks.error("lost")
            self.hooks.held(None)
        return problem

    def keep_alive(self, slot: Slot) -> LeaseKeeper:
        """Renew ``slot``'s lease from now on (also a slot a killed predecessor took: its
        journal keeps when it was taken)."""
        self.hooks.held(slot)
        keeper = LeaseKeeper(self, slot)
        keeper.start()
        return keeper

    def release(self, slot: Slot) -> str | None:
        """Free the slot (revoke its lease: etcd deletes the key). A problem or None; a
        slot that cannot be released frees itself one TTL after its keeper stopped."""
        self.hooks.held(None)
        try:
            self.etcd.revoke(slot.lease)
        except FleetUnavailable as exc:
            return (
                f"releasing fleet slot {slot.index} failed ({exc}); "
                f"it frees itself within {slot.ttl_s} s"
            )
        return None

    # -- out of service -----------------------------------------------------------------
    def out_marker(self, since: float, ttl_s: int) -> OutMarker:
        """A lease for this server's out-of-service marker (not put yet: the journal keeps
        it first, so a specd killed from here on revokes it at its next start). ``ttl_s``
        bounds how long the server can be out from now; nothing renews it."""
        ttl = max(5, math.ceil(ttl_s))
        lease = self.etcd.grant(ttl)
        until = self._clock() + ttl
        return OutMarker(self.group, out_key(self.group, self.holder), lease, ttl, since, until)

    def mark_out(self, marker: OutMarker, slot: Slot | None = None) -> str | None:
        """Put the marker: from now on this server counts against its group's slots even
        without a slot. With ``slot``, only while this specd still holds it (else another
        specd may have taken it and be restarting its server): why not, or None. Raises
        FleetUnavailable. Not put, its lease is revoked."""
        value = json.dumps(
            {"holder": self.holder, "since": marker.since, "until": marker.until, **self._signed()}
        )
        try:
            if slot is None:
                self.etcd.put(marker.key, value, marker.lease)
            elif not self.etcd.put_if_leased(marker.key, value, marker.lease, slot.key, slot.lease):
                self._revoke_quietly(marker.lease)
                self.hooks.error("lost")
                self.hooks.held(None)
                return f"fleet slot {slot.index} is no longer on this specd's lease"
        except FleetUnavailable:
            self._revoke_quietly(marker.lease)
            raise
        self.hooks.out(True)
        return None

    def mark_in(self, marker: OutMarker) -> str | None:
        """This server serves again: revoke the marker's lease (etcd deletes the key). A
        problem or None; a marker that cannot be revoked frees itself at its TTL."""
        try:
            self.etcd.revoke(marker.lease)
        except FleetUnavailable as exc:
            # Not "by until" alone: etcd counts a lease's TTL only while it runs, and each
            # start of etcd gives every lease its whole TTL again.
            return (
                f"removing the out-of-service marker failed ({exc}); tried again until etcd "
                f"takes it; unless etcd restarts meanwhile (each start of etcd gives its lease "
                f"the whole {marker.ttl_s} s again), it frees itself by "
                f"{utc_time(marker.until)} at the latest"
            )
        self.hooks.out(False)
        return None

    def mark_out_again(self, marker: OutMarker, etcd: EtcdClient) -> OutMarker | None:
        """``marker``'s lease is gone while its server is still out (etcd's data wiped or
        restored from an older snapshot mid-restart): put it again under a fresh lease for
        what is left of its bound, only if no key of its name is there (another specd's,
        or one put by hand, is left as it is). The marker now, or None (not put: its bound
        passed, or the key is there). Raises FleetUnavailable. Through ``etcd``: the lease
        keeper's own client, on its own thread."""
        left = math.ceil(marker.until - self._clock())
        if left <= 0:
            return None
        ttl = max(5, left)
        lease = etcd.grant(ttl)
        again = OutMarker(marker.group, marker.key, lease, ttl, marker.since, self._clock() + ttl)
        value = json.dumps(
            {"holder": self.holder, "since": again.since, "until": again.until, **self._signed()}
        )
        try:
            put = etcd.put_if_absent(again.key, value, lease)
        except FleetUnavailable:
            with contextlib.suppress(FleetUnavailable):
                etcd.revoke(lease)
            raise
        if not put:
            with contextlib.suppress(FleetUnavailable):
                etcd.revoke(lease)
            return None
        self.hooks.out(True)
        return again

    def moved_off(self, marker: OutMarker) -> None:
        """Revoke the lease ``marker``'s key moved off (`mark_out` put it under another):
        the marker stays. Best effort: an unused lease expires at its TTL."""
        self._revoke_quietly(marker.lease)

    def own_out(self) -> tuple[OutOfService | None, str | None]:
        """This server's out-of-service marker as etcd holds it, or None; and `clash` of
        the same read (one request). Raises FleetUnavailable."""
        busy = self.busy()
        # Another specd's of the same name is not ours to remove (`clash` says so).
        found = next((o for o in busy.out if self._mine(o.name, o.instance)), None)
        if found is not None and found.lease > 0:  # one specd put (a hand-put key has none)
            self.hooks.out(True)
        return found, self.clash(busy)

    def remove_out(self, out: OutOfService) -> None:
        """Revoke the lease of a marker read from etcd (etcd deletes the key). Raises
        FleetUnavailable."""
        self.etcd.revoke(out.lease)
        self.hooks.out(False)

    def _signed(self) -> dict[str, str]:
        return {} if self.instance is None else {"instance": self.instance}

    def _revoke_quietly(self, lease: int) -> None:
        with contextlib.suppress(FleetUnavailable):  # an unused lease expires in one TTL
            self.etcd.revoke(lease)


class LeaseKeeper(threading.Thread):
    """Renews a slot's lease at once, then every third of its TTL until ``stop``. Its waits
    are on its own event, so stopping it is immediate; a renewal that fails is retried
    sooner, and once etcd says the lease is gone (or a whole TTL passed without a renewal)
    ``lost`` says why, and the slot counts as not held (``hooks.held(None)``). Its own etcd
    client, with requests short enough to retry within a TTL, so a renewal never waits for the
    applier's requests nor they for it.

    While the server is out (``watch_out``: its marker) and etcd says the slot's lease is
    gone, the keeper looks at the marker's lease too: gone as well (etcd's data wiped or
    restored from an older snapshot), the marker is put again under a fresh lease
    (`Fleet.mark_out_again`), or the group's other servers would restart beside this one
    still loading. ``stop_watching_out`` hands back the marker as it is then."""

    def __init__(self, fleet: Fleet, slot: Slot) -> None:
        super().__init__(name=f"fleet-lease-{slot.index}", daemon=True)
        self.fleet = fleet
        self.slot = slot
        self.interval_s = slot.ttl_s / 3
        self.etcd = EtcdClient(
            fleet.etcd.endpoints,
            min(fleet.etcd.timeout_s, slot.ttl_s / 4),
            on_error=fleet.hooks.error,
        )
        self.lost: str | None = None
        self.renewals = 0
        self._halt = threading.Event()
        self._out: OutMarker | None = None
        self._out_lock = threading.Lock()
        # Why the marker, gone with the slot's lease, could not be put again (None: it was,
        # or needed not be).
        self.out_problem: str | None = None

    def watch_out(self, marker: OutMarker) -> None:
        """The server is out of service under ``marker`` from now on."""
        with self._out_lock:
            self._out = marker

    def stop_watching_out(self) -> OutMarker | None:
        """The server serves again (or the sequence ends): no more putting the marker
        again. The marker as it is now (under a fresh lease if the keeper put it again)."""
        with self._out_lock:
            marker, self._out = self._out, None
            return marker

    def run(self) -> None:
        try:
            self._renew()
        finally:
            self.etcd.close()

    def _renew(self) -> None:
        mono = time.monotonic
        renewed = mono()
        # The first renewal at once: a slot taken back after a restart of specd may have
        # seconds of its lease left, fewer than the interval (RestartSec= of a 30 s lease).
        wait = 0.0
        while not self._halt.wait(wait):
            try:
                ttl = self.etcd.keepalive(self.slot.lease)
            except Exception as exc:  # a thread of its own: nothing above it would see it
                if not isinstance(exc, FleetUnavailable):
                    self.lost = f"lease renewal failed: {_one_line(repr(exc), 200)}"
                    return
                if mono() - renewed >= self.slot.ttl_s:
                    self.lost = f"no lease renewal for {self.slot.ttl_s} s (etcd unreachable)"
                    self.fleet.hooks.error("lost")
                    self.fleet.hooks.held(None)
                    return
                wait = max(0.2, self.interval_s / 3)
                continue
            if ttl <= 0:
                self.lost = f"etcd says the lease of fleet slot {self.slot.index} expired"
                self.fleet.hooks.error("lost")
                self.fleet.hooks.held(None)
                self._keep_out()
                return
            renewed, wait = mono(), self.interval_s
            self.renewals += 1

    def _keep_out(self) -> None:
        """The slot's lease is gone: so may the marker's be (etcd's data lost, not only a
        renewal). Put it again while the server is out; a few tries while etcd, just back,
        does not answer."""
        for attempt in range(3):
            if attempt and self._halt.wait(max(0.2, self.interval_s / 3)):
                return
            with self._out_lock:
                marker = self._out
                if marker is None:
                    return
                try:
                    ttl, _ = self.etcd.time_to_live(marker.lease)
                    if ttl > 0:
                        return  # only the slot's lease ran out: the marker counts this server
                    again = self.fleet.mark_out_again(marker, self.etcd)
                except Exception as exc:  # a thread of its own: nothing above it would see it
                    problem = _one_line(
                        str(exc) if isinstance(exc, FleetUnavailable) else repr(exc), 200
                    )
                    self.out_problem = f"cannot put the out-of-service marker again: {problem}"
                    if not isinstance(exc, FleetUnavailable):
                        return
                    continue
                if again is not None:
                    self._out = again
                    self.out_problem = None
                    self.lost = f"{self.lost}; its out-of-service marker was gone too: put again"
                return

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            # A renewal in flight ends within one etcd timeout.
            self.join(self.etcd.timeout_s + 1)


def _parse_holder(value: bytes) -> tuple[str, float | None, str | None]:
    try:
        data = files.parse_json(value, finite=True)
    except files.ParseError:
        return _one_line(value.decode("utf-8", "replace"), MAX_HOLDER_CHARS), None, None
    if not isinstance(data, dict):
        return _one_line(str(data), MAX_HOLDER_CHARS), None, None
    name = _one_line(str(data.get("holder", "?")), MAX_HOLDER_CHARS)
    return name, _calendar_time(data.get("since")), _instance(data.get("instance"))


def _parse_out(value: bytes) -> tuple[float | None, float | None, str | None]:
    """(since, until, instance) of a marker's value; None for what a calendar cannot show,
    or no instance said."""
    try:
        data = files.parse_json(value, finite=True)
    except files.ParseError:
        return None, None, None
    if not isinstance(data, dict):
        return None, None, None
    since, until = _calendar_time(data.get("since")), _calendar_time(data.get("until"))
    return since, until, _instance(data.get("instance"))


def _instance(value: Any) -> str | None:
    # Another host's word: a string, one line, bounded; anything else says nothing.
    return _one_line(value, MAX_HOLDER_CHARS) or None if isinstance(value, str) else None


def _calendar_time(value: Any) -> float | None:
    # Another host's word: only a time a calendar can show (not ms, not year 10000+).
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= MAX_SINCE
    ):
        return float(value)
    return None


def _out_only(busy: Busy, mine: Callable[[str, str | None], bool]) -> list[OutOfService]:
    """Servers out of service that hold no slot: each counts once more against the slots.
    This specd's own marker (``mine``: `Fleet._mine`) is left out (see the module
    docstring)."""
    holding = {h.name for h in busy.holders}
    return [o for o in busy.out if o.name not in holding and not mine(o.name, o.instance)]


def same_instance(a: str | None, b: str | None) -> bool:
    """Whether two keys of one name may be one specd's: unless both say who, and differ."""
    return a is None or b is None or a == b


def out_text(out: OutOfService, holds_slot: bool = False) -> str:
    """How a marker reads: "box-a out of service since …", and for one that ``holds_slot``
    no more (its specd died, or lost etcd, while it was out for a restart) "(holds no slot;
    counted until … at the latest)"."""
    since = "" if out.since is None else f" since {utc_time(out.since)}"
    if holds_slot:
        return f"{out.name} out of service{since}"
    until = "" if out.until is None else f"; counted until {utc_time(out.until)} at the latest"
    return f"{out.name} out of service{since} (holds no slot{until})"


def _who(busy: Busy, slots: int, mine: Callable[[str, str | None], bool]) -> str:
    held = [
        f"slot {h.slot} held by {h.name}"
        + (
            f" (a specd of the group with more slots than this one's {slots})"
            if h.slot >= slots
            else ""
        )
        for h in busy.holders
    ]
    return ", ".join(held + [out_text(o) for o in _out_only(busy, mine)])


def _seconds(value: float) -> str:
    """A wait as the message says it: 5, 2.5, 1.67."""
    return f"{round(value, 2):g}"
