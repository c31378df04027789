"""Install's check that the etcd endpoints and gateway replicas it writes into specd.toml
answer now: a typo found at install, not at the first maintenance window."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specd.core.observation import ScrapeError
from specd.core.settings import FleetSettings, GatewaySettings
from specd.install.layout import Layout
from specd.io.fleet import EtcdClient, FleetUnavailable
from specd.io.gateway import GatewayClient, GatewayUnavailable
from specd.io.sglang import SGLangClient

# Short: install waits on each endpoint in turn, and a down one is the case to report.
PROBE_TIMEOUT_S = 3.0


def probe_etcd(endpoints: Sequence[str], timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """One line per etcd endpoint that does not answer its status call."""
    problems = []
    for endpoint in endpoints:
        client = EtcdClient([endpoint], timeout_s)
        try:
            client.version()
        except FleetUnavailable as exc:
            problems.append(str(exc))
        finally:
            client.close()
    return problems


def probe_gateways(
    settings: GatewaySettings,
    worker_url: str,
    layout: Layout,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> tuple[list[str], list[str]]:
    """(one line per replica that does not answer GET /workers with the key, one note per
    replica that answers but does not route this server yet)."""
    key = None if settings.api_key_file is None else layout.host(settings.api_key_file)
    client = GatewayClient(settings.urls, worker_url, api_key=key, timeout_s=timeout_s)
    problems, notes = [], []
    try:
        for gateway in client.gateways:
            try:
                worker = client.find(gateway)
            except GatewayUnavailable as exc:
                hint = (
                    " (is the admin key in --gateway-api-key-file one of the gateway's "
                    "--control-plane-api-keys?)"
                    if exc.kind in ("http_status", "api_key")
                    else ""
                )
                problems.append(f"{exc}{hint}")
                continue
            if worker is None:
                notes.append(
                    f"gateway {gateway} routes no worker with url {client.worker_url} yet; "
                    "specd drains only a worker the gateway knows (`specd doctor` checks it)"
                )
    finally:
        client.close()
    return problems, notes


def server_port(
    url: str, timeout_s: float = PROBE_TIMEOUT_S, api_key: Path | None = None
) -> int | str | ScrapeError | None:
    """The --port the SGLang at ``url`` says it was started with (its /server_info, asked
    with the key in ``api_key``, SGLang's --api-key); None when it answers without saying;
    why, when it does not answer; the ScrapeError (kind api_key) when it refused the key."""
    with SGLangClient(url, timeout_s=timeout_s, api_key=api_key) as client:
        info = client.server_info()
    if isinstance(info, ScrapeError) and info.kind == "api_key":
        return info
    if not isinstance(info, dict):
        return info.reason
    port = info.get("port")
    return port if isinstance(port, int) and not isinstance(port, bool) else None


def check_sglang(
    url: str,
    unit: str,
    unit_port: int | None,
    given: bool,
    timeout_s: float = PROBE_TIMEOUT_S,
    api_key: Path | None = None,
) -> tuple[str | None, str | None]:
    """(why install must refuse ``url``, what to warn of) from what answers there now.

    A server there that runs another --port than ``unit`` is another server: specd would
    watch it and restart ``unit``, fail every change's verification, roll back and freeze.
    None answering is only warned of (``unit`` may be down; specd waits for it). A URL read
    from the unit's --host/--port (``given`` False) is wrong when SGLang runs in a container
    that publishes its port under another number (``docker run -p 8000:30000``). One that
    refuses the key (``api_key``: the host's path of [sglang] server_api_key_file) or its
    lack is refused: specd would decide nothing there."""
    answered = server_port(url, timeout_s, api_key)
    source = f"--url {url}" if given else f"SGLang at {url} (from {unit}'s --host/--port)"
    if isinstance(answered, ScrapeError):
        if api_key is None:
            todo = (
                "SGLang runs with --api-key: pass --sglang-api-key-file FILE, a file holding "
                "that key"
            )
        else:
            todo = "check the key in --sglang-api-key-file (or [sglang] server_api_key_file)"
        return f"{source}: {answered.reason}; {todo}", None
    if isinstance(answered, int) and unit_port is not None and answered != unit_port:
        container = "" if given else " (a container that publishes its port under another number?)"
        return (
            f"{source}: the SGLang there runs --port {answered}, but {unit} runs --port "
            f"{unit_port}: that is another server{container}; give the URL {unit} answers at"
            + ("" if given else " with --url"),
            None,
        )
    if isinstance(answered, str):
        elsewhere_hint = (
            "check --url"
            if given
            else "it serves elsewhere (a container that publishes its port under another "
            "number, e.g. `docker run -p 8000:30000`): install again with --url"
        )
        return None, (
            f"{source} does not answer now ({answered}): specd waits for it to come up; if "
            f"{unit} is running, {elsewhere_hint}"
        )
    return None, None


def probe_config(
    fleet: Mapping[str, Any] | None,
    gateway: Mapping[str, Any] | None,
    sglang_url: str,
    layout: Layout,
) -> tuple[list[str], list[str]]:
    """(problems, notes) for the [fleet] and [gateway] keys install is about to write."""
    problems: list[str] = []
    notes: list[str] = []
    if fleet is not None:
        problems += probe_etcd(FleetSettings.model_validate(fleet).etcd_endpoints)
    if gateway is not None:
        settings = GatewaySettings.model_validate(gateway)
        found, notes = probe_gateways(settings, settings.worker_url or sglang_url, layout)
        problems += found
    return problems, notes


__all__ = [
    "PROBE_TIMEOUT_S",
    "check_sglang",
    "probe_config",
    "probe_etcd",
    "probe_gateways",
    "server_port",
]
