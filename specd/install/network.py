"""What specd.service must be allowed to reach beyond loopback: the shipped unit has
``IPAddressAllow=localhost`` and ``IPAddressDeny=any``, so an SGLang server, gateway replica or
etcd endpoint that specd.toml names elsewhere needs its address allowed, or specd waits on it
for ever (``fleet_unavailable``, ``drain_unavailable``)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specd.install.layout import CONFIG_FILE, Layout
from specd.io.files import parse_toml

RESOLV_CONF = Path("/etc/resolv.conf")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass
class Reach:
    """``IPAddressAllow=`` entries for specd.service, and what install says about them."""

    addresses: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _urls(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(what, URL) for everything specd connects to, as the config names it."""
    found: list[tuple[str, str]] = []
    sglang = data.get("sglang")
    if isinstance(sglang, dict) and isinstance(sglang.get("url"), str):
        found.append(("SGLang", sglang["url"]))
    gateway = data.get("gateway")
    if isinstance(gateway, dict):
        found += [("gateway replica", u) for u in gateway.get("urls") or [] if isinstance(u, str)]
    fleet = data.get("fleet")
    if isinstance(fleet, dict):
        endpoints = fleet.get("etcd_endpoints") or []
        found += [("etcd endpoint", u) for u in endpoints if isinstance(u, str)]
    return found


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _resolve(host: str) -> list[IPAddress]:
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    addresses = {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos}
    return sorted(addresses, key=lambda a: (a.version, a))


def _name_servers(layout: Layout) -> list[IPAddress]:
    """The name servers resolv.conf lists (specd resolves host names at run time too)."""
    try:
        text = layout.host(RESOLV_CONF).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            address = _literal(words[1].split("%", 1)[0])
            if address is not None:
                found.append(address)
    return found


def _outside(addresses: Iterable[IPAddress]) -> list[IPAddress]:
    # IPAddressAllow=localhost in the shipped unit covers loopback already.
    return [a for a in addresses if not a.is_loopback]


def reach(config_text: str, layout: Layout) -> Reach:
    """The addresses beyond loopback that the config (as install writes it) has specd reach:
    IP literals as written, host names resolved now (said in a note: the unit does not follow
    a later change of address), and then also the name servers, so specd can resolve them."""
    data = parse_toml(config_text)
    out = Reach()
    allowed: set[IPAddress] = set()
    named_hosts = False
    for what, url in _urls(data):
        try:
            host = urlsplit(url).hostname
        except ValueError:
            continue
        if not host or host == "localhost":
            continue
        literal = _literal(host)
        if literal is not None:
            allowed.update(_outside([literal]))
            continue
        named_hosts = True
        try:
            resolved = _resolve(host)
        except (OSError, UnicodeError) as exc:
            out.warnings.append(
                f"{what} {url}: cannot resolve {host} now ({exc}): specd.service will not be "
                f"allowed to reach it; run `specd install` again once it resolves"
            )
            continue
        outside = _outside(resolved)
        allowed.update(outside)
        if outside:
            out.notes.append(
                f"{what} {url}: {host} is {', '.join(map(str, outside))} now; specd.service "
                "may reach that address only (IPAddressAllow=): run `specd install` again "
                "if it changes"
            )
    if named_hosts:
        servers = [a for a in _outside(_name_servers(layout)) if a not in allowed]
        if servers:
            allowed.update(servers)
            out.notes.append(
                f"specd.service may also reach the name servers of {RESOLV_CONF} "
                f"({', '.join(map(str, servers))}) to resolve the host names in {CONFIG_FILE}"
            )
    out.addresses = [str(a) for a in sorted(allowed, key=lambda a: (a.version, a))]
    return out


def is_local(address: IPAddress) -> bool:
    """Whether ``address`` is one of this machine's: only those can be bound."""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


def elsewhere(url: str) -> str | None:
    """Why ``url`` is not a server on this machine (its host names no address of it), or
    None: it is, or the name does not resolve now (reach() warns of that)."""
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return None
    if not host or host == "localhost":
        return None
    literal = _literal(host)
    try:
        addresses = [literal] if literal is not None else _resolve(host)
    except (OSError, UnicodeError):
        return None
    if not addresses or any(a.is_loopback or is_local(a) for a in addresses):
        return None
    shown = host if literal is not None else f"{host} ({', '.join(map(str, addresses))})"
    return f"{shown} is not an address of this machine"
