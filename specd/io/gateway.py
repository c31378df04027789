"""The SGLang model gateway (smg 1.x) admin API, for draining this server before a restart.

A drain removes this server's worker from routing on every gateway replica and, after the
restart, adds it back with the URL, labels and settings it had, then waits until every
replica it was removed from reports it ready. Any replica that cannot be reached raises
``GatewayUnavailable`` with a one-line reason and a bounded ``kind``: with a gateway
configured, specd never restarts a server it could not drain. The admin API key is read from
a file (at every use, so a rotated key is picked up) and sent as a bearer token; it never
appears in an error or a log.

smg's drain is a fixed settle time, not "until idle": ``DELETE /workers/{id}`` marks the
worker ``draining`` (no new requests routed), its requests in flight run on, and the entry is
gone after the settle time. Whether SGLang is idle is for the applier to read off SGLang.
The DELETE only queues the removal (202, "queued for background processing"): until the
gateway's job runs, the entry stays ``ready`` and requests are still routed to it, so a
drain is over only once every replica says so (`GatewayClient.await_removed`).
"""

from __future__ import annotations

import functools
import grp
import ipaddress
import json
import os
import pwd
import shlex
import socket
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from specd.core.settings import GatewaySettings
from specd.io.answers import read_capped
from specd.io.files import (
    MAX_KEY_FILE_BYTES,
    KeyFileError,
    ParseError,
    bearer_header,
    parse_json,
    read_key_file,
)
from specd.io.tls import context_for

MAX_API_KEY_FILE_BYTES = MAX_KEY_FILE_BYTES  # install reads the bound from here

READY = "ready"
DRAINING = "draining"
# Bounded error kinds: a metric label (specd_gateway_errors_total).
ERROR_KINDS = ("connect", "timeout", "http_status", "malformed", "api_key")
# Worker settings smg takes back on POST /workers besides url and labels (it lists the
# last four only where they were set): an operator's per-worker timeouts, drain settle
# time, pool and retries were back at smg's defaults after specd's first restart.
SETTING_KEYS = (
    "worker_type",
    "runtime_type",
    "connection_mode",
    "priority",
    "cost",
    "max_connection_attempts",
    "health",
    "http_pool",
    "resilience",
)


class GatewayUnavailable(Exception):
    """A gateway replica could not be reached or answered nonsense (message: one line)."""

    def __init__(self, message: str, kind: str = "malformed") -> None:
        super().__init__(message)
        self.kind = kind if kind in ERROR_KINDS else "malformed"


class WorkerNotListed(GatewayUnavailable):
    """Every replica answered, but none can be drained of this server: none lists the worker
    URL, or one lists this host's port under another URL instead. No call failed (nothing
    for specd_gateway_errors_total). ``elsewhere``: the gateway routes this server under
    another URL (so it is not left out, whatever specd's URL says)."""

    def __init__(self, message: str, *, elsewhere: bool) -> None:
        super().__init__(message)
        self.elsewhere = elsewhere


@dataclass(frozen=True)
class Worker:
    """This server as one gateway replica knows it."""

    gateway_url: str
    worker_id: str
    url: str
    status: str
    labels: Mapping[str, str] = field(default_factory=dict)
    settings: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["labels"], data["settings"] = dict(self.labels), dict(self.settings)
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Worker:
        """From a journal; ValueError (one line) on a bad shape."""
        if not isinstance(data, Mapping):
            raise ValueError(f"drained worker {data!r:.60} is not an object")
        texts = {}
        for name in ("gateway_url", "worker_id", "url", "status"):
            value = data.get(name)
            if not isinstance(value, str):
                raise ValueError(f"drained worker {name} {value!r:.60} is not a string")
            texts[name] = value
        labels, settings = data.get("labels", {}), data.get("settings", {})
        if not isinstance(labels, Mapping) or not isinstance(settings, Mapping):
            raise ValueError("drained worker labels/settings are not objects")
        return cls(
            labels={str(k): str(v) for k, v in labels.items()},
            settings={str(k): v for k, v in settings.items() if k in SETTING_KEYS},
            **texts,
        )


def read_api_key(path: Path | None) -> str | None:
    """The admin API key from ``path`` (None: no key); a one-line error names the file."""
    if path is None:
        return None
    try:
        return read_key_file(path, "gateway api key file")
    except KeyFileError as exc:
        raise GatewayUnavailable(str(exc), "api_key") from None


def _name(table: Callable[[int], Any], number: int) -> str:
    try:
        return str(table(number)[0])
    except KeyError:
        return str(number)


def _may(info: os.stat_result, uid: int, gids: set[int], bit: int) -> bool:
    """Whether user ``uid`` in groups ``gids`` has permission ``bit`` (4 read, 1 search)
    on a file with ``info``, by its mode bits as the kernel picks them (owner, else group,
    else others; root has all)."""
    if uid == 0:
        return True
    if info.st_uid == uid:
        return bool(info.st_mode >> 6 & bit)
    if info.st_gid in gids:
        return bool(info.st_mode >> 3 & bit)
    return bool(info.st_mode & bit)


def key_file_unreadable_by(path: Path, user: str) -> tuple[str, str] | None:
    """(why ``user`` cannot read the key file at ``path``: "cannot read it (0640 root:root)"
    or "cannot enter DIR (…)", the advice that lets it), or
    None when it can. Judged by owner, group and mode (ACLs are not read), for the file and
    every directory on the way to it, as the daemon (running as ``user``) would open it:
    a check run as root passes a 0600 root file the daemon then cannot read. KeyError: no
    such user."""
    entry = pwd.getpwnam(user)
    uid, group = entry.pw_uid, _name(grp.getgrgid, entry.pw_gid)
    gids = set(os.getgrouplist(user, entry.pw_gid))
    real = Path(os.path.realpath(path))
    # Both the way to the link (secret mounts are symlinks) and the way to its target.
    ways = [*reversed(Path(os.path.abspath(path)).parents), *reversed(real.parents)]
    for directory in dict.fromkeys(ways):
        info = directory.stat()
        if not _may(info, uid, gids, 1):
            owner = f"{_name(pwd.getpwuid, info.st_uid)}:{_name(grp.getgrgid, info.st_gid)}"
            return (
                f"cannot enter {directory} ({stat.S_IMODE(info.st_mode):04o} {owner})",
                f"keep the file where user {user} can reach it, e.g. /etc/specd/{path.name} "
                f"(0600 {user}:{group})",
            )
    info = real.stat()
    if _may(info, uid, gids, 4):
        return None
    owner = f"{_name(pwd.getpwuid, info.st_uid)}:{_name(grp.getgrgid, info.st_gid)}"
    shown = shlex.quote(str(path))
    if info.st_uid == uid:
        fix = f"chmod u+r {shown}"
    elif info.st_gid in gids:
        fix = f"chmod g+r {shown}"
    else:
        fix = f"chgrp {group} {shown} && chmod 0640 {shown}"
    return (
        f"cannot read it ({stat.S_IMODE(info.st_mode):04o} {owner})",
        f"run `{fix}`",
    )


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


# The listed URLs a "not listed" message shows at most: it is one line, a fleet has many.
MAX_LISTED_SHOWN = 3


def _host_port(url: str) -> tuple[str, int | None]:
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return "", None
    return (parts.hostname or "").lower(), port


def _is_this_host(host: str) -> bool:
    """Whether ``host`` (from a worker URL) names this machine. No DNS: an address is this
    machine's if a socket can be bound to it, a name if it is localhost or our hostname."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        name = socket.gethostname().lower()
        return host.rstrip(".") in ("localhost", name, name.split(".")[0])
    if address.is_loopback:
        return True
    if address.is_unspecified:
        return False
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


def this_server_as(worker_url: str, listed: Sequence[str]) -> list[str]:
    """The URLs in ``listed`` other than ``worker_url`` that name this server: this host,
    the same port (the gateway knows the server by its LAN address, specd by loopback)."""
    _, port = _host_port(worker_url)
    mine = []
    for url in listed:
        host, other_port = _host_port(url)
        if not _same_url(url, worker_url) and other_port == port and _is_this_host(host):
            mine.append(url)
    return mine


def _some(urls: Sequence[str]) -> str:
    shown = ", ".join(urls[:MAX_LISTED_SHOWN])
    more = len(urls) - MAX_LISTED_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


# A /workers answer is ~1.5 KB per worker; far beyond is no gateway's to read whole.
MAX_ANSWER_BYTES = 16 * 1024 * 1024


class GatewayClient:
    """Every replica of one gateway; each call is bounded by ``timeout_s``, its whole answer
    included (a replica trickling bytes never ends a read timeout).

    ``api_key`` is a key, or a file to read it from at each call (``Path``).
    ``on_error(kind)`` is told of every failed call (metrics). ``pause(seconds)`` paces
    the polls: the applier's keeps the watchdog fed and is not cut short by a stop request,
    because a worker drained for a restart must be re-added even while specd stops.
    ``beat()`` is called before each call and with each piece of an answer: calls to many
    replicas that each take their whole timeout still show the daemon's loop alive."""

    def __init__(
        self,
        gateway_urls: Sequence[str],
        worker_url: str,
        *,
        api_key: str | Path | None = None,
        timeout_s: float = 5.0,
        poll_s: float = 0.25,
        pause: Callable[[float], None] = time.sleep,
        on_error: Callable[[str], None] | None = None,
        beat: Callable[[], None] | None = None,
    ) -> None:
        if not gateway_urls:
            raise ValueError("gateway_urls: at least one gateway URL is needed")
        self.gateways = [u.rstrip("/") for u in gateway_urls]
        self.worker_url = worker_url.rstrip("/")
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._pause = pause
        self._on_error = on_error
        self._beat = beat or (lambda: None)
        # trust_env=False: an HTTP(S)_PROXY meant for the internet must not carry the admin
        # API (nor its key), as for etcd and SGLang.
        self._http = httpx.Client(
            timeout=timeout_s,
            verify=context_for(*self.gateways),
            trust_env=False,
            headers={"Accept-Encoding": "identity"},  # read_capped reads no other
        )

    @classmethod
    def from_settings(
        cls,
        settings: GatewaySettings,
        sglang_url: str,
        *,
        pause: Callable[[float], None] = time.sleep,
        on_error: Callable[[str], None] | None = None,
        poll_s: float = 1.0,
        beat: Callable[[], None] | None = None,
    ) -> GatewayClient:
        return cls(
            settings.urls,
            settings.worker_url or sglang_url,
            api_key=settings.api_key_file,
            timeout_s=settings.request_timeout_s,
            poll_s=poll_s,
            pause=pause,
            on_error=on_error,
            beat=beat,
        )

    def close(self) -> None:
        self._http.close()

    def _fail(self, message: str, kind: str) -> GatewayUnavailable:
        if self._on_error is not None:
            self._on_error(kind)
        return GatewayUnavailable(message, kind)

    def _headers(self) -> dict[str, str]:
        key = self._api_key
        if isinstance(key, Path):
            try:
                key = read_api_key(key)
            except GatewayUnavailable as exc:
                raise self._fail(str(exc), exc.kind) from None
        return bearer_header(key)

    def _call(self, method: str, gateway: str, path: str, body: Any = None) -> Any:
        headers = self._headers()
        content = None
        if body is not None:
            try:
                content = json.dumps(body, allow_nan=False).encode("utf-8")
            except (ValueError, TypeError) as exc:
                # What a worker's listing held (its settings go back at the re-add): said,
                # not raised through the restart that drained it.
                raise self._fail(
                    f"gateway {gateway}: {method} {path}: cannot send as JSON: {exc}", "malformed"
                ) from None
            headers = {**headers, "Content-Type": "application/json"}
        deadline = time.monotonic() + self._timeout_s
        self._beat()
        try:
            with self._http.stream(
                method, gateway + path, content=content, headers=headers
            ) as reply:
                raw = read_capped(reply, MAX_ANSWER_BYTES, deadline, self._beat)
        except httpx.TimeoutException:
            raise self._fail(
                f"gateway {gateway}: {method} {path}: no answer within {self._timeout_s:g} s",
                "timeout",
            ) from None
        except httpx.DecodingError as exc:  # a compressed answer (`read_capped`)
            raise self._fail(f"gateway {gateway}: {method} {path}: {exc}", "malformed") from None
        except httpx.HTTPError as exc:
            raise self._fail(
                f"gateway {gateway}: {method} {path}: {type(exc).__name__}", "connect"
            ) from None
        if reply.status_code >= 400:
            raise self._fail(
                f"gateway {gateway}: {method} {path}: HTTP {reply.status_code}", "http_status"
            )
        if raw is None:
            raise self._fail(
                f"gateway {gateway}: {method} {path}: answer over {MAX_ANSWER_BYTES} bytes",
                "malformed",
            )
        if not raw:
            return None
        try:
            # Finite numbers and Unicode text only: a worker's settings are saved in the
            # restart journal and sent back at the re-add, and neither takes NaN or "\ud800".
            return parse_json(raw, finite=True)
        except ParseError as exc:
            raise self._fail(f"gateway {gateway}: {method} {path}: {exc}", "malformed") from None

    def _workers(self, gateway: str) -> list[Mapping[str, Any]]:
        data = self._call("GET", gateway, "/workers")
        items = data.get("workers") if isinstance(data, Mapping) else data
        if not isinstance(items, list):
            raise self._fail(f"gateway {gateway}: GET /workers: no worker list", "malformed")
        return [w for w in items if isinstance(w, Mapping)]

    def look(self, gateway: str) -> tuple[Worker | None, list[str]]:
        """(this server's worker on ``gateway`` or None, the URL of every worker it lists)."""
        workers = self._workers(gateway)
        urls = [w["url"] for w in workers if isinstance(w.get("url"), str)]
        for w in workers:
            url = w.get("url")
            if isinstance(url, str) and _same_url(url, self.worker_url):
                raw = w.get("labels")
                labels = (
                    {str(k): str(v) for k, v in raw.items()} if isinstance(raw, Mapping) else {}
                )
                worker = Worker(
                    gateway_url=gateway,
                    worker_id=str(w.get("id", "")),
                    url=url,
                    status=str(w.get("status", "")),
                    labels=labels,
                    settings={k: w[k] for k in SETTING_KEYS if k in w},
                )
                return worker, urls
        return None, urls

    def find(self, gateway: str) -> Worker | None:
        """This server's worker on ``gateway`` (None: not routed there)."""
        return self.look(gateway)[0]

    def routing(self) -> list[str]:
        """Every replica's entry that routes this server now (``ready``), by its worker URL
        or any other name of this server (`this_server_as`), as "GATEWAY lists URL ready";
        raises if any replica cannot say. The last look before a restart: a replica
        restarted since the drain lists its configured workers again, and an entry by
        another name (localhost beside 127.0.0.1) was never drained."""
        found = []
        for gateway in self.gateways:
            for w in self._workers(gateway):
                url = w.get("url")
                if not isinstance(url, str) or w.get("status") != READY:
                    continue
                if _same_url(url, self.worker_url) or this_server_as(self.worker_url, [url]):
                    found.append(f"gateway {gateway} lists {url} {READY}")
        return found

    def find_all(self) -> list[Worker | None]:
        """This worker on each replica, in order, to drain it; raises if any replica cannot
        say. Raises ``WorkerNotListed`` when a drain could not take it out of routing: a
        replica lists this server under another URL (it would go on routing to it), or no
        replica lists the worker URL at all (then specd cannot tell a server the gateway
        does not route from one it knows by another name: never a restart without a drain).
        A replica that lists neither while another lists the worker is left out there:
        nothing to drain on it."""
        found, listed = [], []
        for gateway in self.gateways:
            worker, urls = self.look(gateway)
            found.append(worker)
            if worker is None:
                mine = this_server_as(self.worker_url, urls)
                if mine:
                    raise WorkerNotListed(
                        f"gateway {gateway} lists this server as {_some(mine)}, not as "
                        f'{self.worker_url}: set [gateway] worker_url = "{mine[0]}"',
                        elsewhere=True,
                    )
            listed += [u for u in urls if u not in listed]
        if any(w is not None for w in found):
            return found
        several = len(self.gateways) > 1
        where = (
            "no gateway replica lists" if several else f"gateway {self.gateways[0]} does not list"
        )
        raise WorkerNotListed(
            f"{where} worker {self.worker_url} ({'they list' if several else 'it lists'} "
            f"{_some(listed) if listed else 'no worker'}): add this server to the gateway, "
            "or set [gateway] worker_url to the URL the gateway routes it by",
            elsewhere=False,
        )

    def probe(self) -> tuple[str | None, int | None]:
        """(why a drain is impossible now or None, replicas not routing this worker as
        ready or None when unknown). The cheap check the daemon runs each tick."""
        try:
            found = self.find_all()
        except WorkerNotListed as exc:
            # Listed under no URL at all: left out on every replica (the alert's case), or
            # known by a name specd cannot recognise. Under another URL: not left out.
            return str(exc), None if exc.elsewhere else len(self.gateways)
        except GatewayUnavailable as exc:
            return str(exc), None
        return None, sum(1 for w in found if not _ready(w))

    def remove(self, worker: Worker) -> None:
        """Stop routing to ``worker`` on its replica (it goes draining, then away). One
        already draining is left to it: smg removes such an entry at once on a second
        DELETE, but the first removal stays armed, and at the end of its settle time it
        removed, by URL, the worker specd had added back since."""
        if worker.status == DRAINING:
            return
        self._call("DELETE", worker.gateway_url, f"/workers/{worker.worker_id}")

    def drain(self) -> list[Worker]:
        """Remove this worker from routing on every replica and wait until none routes it
        (`await_removed`, bounded by one call's timeout); returns what each had."""
        removed = []
        for worker in self.find_all():
            if worker is None:
                continue
            self.remove(worker)
            removed.append(worker)
        self.await_removed(removed, self._timeout_s)
        return removed

    def await_removed(self, removed: Sequence[Worker], timeout_s: float) -> None:
        """Poll each replica a worker was removed from until it no longer routes this server
        (its entry draining, gone, or in any state but ready). A replica that still does
        after ``timeout_s`` raises ("timeout"): its removal is queued but not done, and a
        restart now would cut the requests it still sends."""
        end = time.monotonic() + timeout_s
        for worker in removed:
            gateway = worker.gateway_url
            if _ready(self._poll_while(gateway, self.find(gateway), _ready, end)):
                raise self._fail(
                    f"gateway {gateway}: worker still routed {timeout_s:g} s after its "
                    "removal was accepted",
                    "timeout",
                )

    def _poll_while(
        self,
        gateway: str,
        current: Worker | None,
        still: Callable[[Worker | None], bool],
        end: float,
    ) -> Worker | None:
        """From ``current`` (this worker on ``gateway`` as just read), read it again every
        poll interval while ``still`` holds, until ``end`` (monotonic); returns the last
        read, of which ``still`` may hold when time ran out."""
        while still(current):
            left = end - time.monotonic()
            if left <= 0:
                break
            self._pause(min(self._poll_s, left))
            current = self.find(gateway)
        return current

    def readd(self, removed: Sequence[Worker], timeout_s: float) -> list[tuple[Worker, str]]:
        """Add the worker back where it was removed, with the URL, labels and settings it had;
        returns each one that could not be, with why (one line).

        Each replica on its own: one that is away must not keep the worker out of the others.
        A draining worker answers POST with 409 until its settle time is over, so each
        replica is polled until the old entry is gone (bounded by ``timeout_s``). A replica
        that already routes the worker again (a re-add before a crash) is left alone. The
        removed entry itself still ready is a removal queued and not yet done (a drain
        given up waiting for it) or never accepted: it is given one call's timeout to
        start draining before it counts as routed."""
        end = time.monotonic() + timeout_s
        failed = []
        for worker in removed:
            try:
                self._readd_one(worker, timeout_s, end)
            except GatewayUnavailable as exc:
                failed.append((worker, str(exc)))
        return failed

    def _readd_one(self, worker: Worker, timeout_s: float, end: float) -> None:
        gateway = worker.gateway_url
        pending_until = time.monotonic() + min(self._timeout_s, timeout_s)
        current = self._poll_while(
            gateway,
            self.find(gateway),
            functools.partial(_ready_as, worker.worker_id),
            pending_until,
        )
        current = self._poll_while(gateway, current, _draining, end)
        if _draining(current):
            raise self._fail(f"gateway {gateway}: worker still draining", "timeout")
        if current is not None:
            return
        body: dict[str, Any] = {**worker.settings, "url": self.worker_url}
        if worker.labels:
            body["labels"] = dict(worker.labels)
        self._call("POST", gateway, "/workers", body)

    def wait_ready(self, timeout_s: float, gateways: Sequence[str] | None = None) -> bool:
        """True once every replica (or each of ``gateways``) reports the worker ready;
        False on timeout or stop."""
        targets = list(gateways) if gateways is not None else self.gateways
        end = time.monotonic() + timeout_s
        while True:
            workers = [self.find(g) for g in targets]
            if all(_ready(w) for w in workers):
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            self._pause(min(self._poll_s, left))


def _ready(worker: Worker | None) -> bool:
    """Listed and routed to."""
    return worker is not None and worker.status == READY


def _ready_as(worker_id: str, worker: Worker | None) -> bool:
    """The entry ``worker_id`` itself, still routed to (its removal not done)."""
    return _ready(worker) and worker is not None and worker.worker_id == worker_id


def _draining(worker: Worker | None) -> bool:
    return worker is not None and worker.status == DRAINING


# Without a window open, a change pending or a pin, the daemon still looks this often, so
# specd_gateway_worker_not_ready_replicas (the alert on a worker left out) stays current.
IDLE_PROBE_S = 60.0


class GatewayWatch:
    """The daemon's look at the gateway before each step: one GET /workers per replica,
    every tick while specd may act (``needed``), at most every ``IDLE_PROBE_S`` otherwise.
    ``last`` is what the latest probe found, as state.json and `specd status` keep it."""

    def __init__(self, client: GatewayClient) -> None:
        self.client = client
        self.last: dict[str, Any] | None = None

    def check(self, now: float, needed: bool) -> str | None:
        """Why a drain is impossible now (one line), or None: the brain's gateway_problem."""
        last = self.last
        if not needed and last is not None and 0 <= now - float(last["t"]) < IDLE_PROBE_S:
            problem = last.get("problem")
            return problem if isinstance(problem, str) else None
        problem, not_ready = self.client.probe()
        self.last = {
            "t": now,
            "problem": problem,
            "not_ready_replicas": not_ready,
            "replicas": len(self.client.gateways),
        }
        return problem

    def close(self) -> None:
        self.client.close()
