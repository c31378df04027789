"""The fleet's shared parts and its observer, run INSIDE the nspawn container as one unit
(the container has only `lo`, so the host can reach none of this):

    python fleet_inside.py --report FILE --dir DIR WORKER_URL...

Starts a real etcd (data under DIR) and a real smg gateway in front of the workers (admin
key, no retries: a worker restarted while still routed would show up as client errors),
streaming load through the gateway (factories.StreamingLoad), then polls, every
POLL_INTERVAL_S, which workers are out (not `ready` in the gateway, or SGLang not healthy).
FILE (JSON, rewritten atomically every tick) says: phase ("starting", "loaded",
"stopped"), etcd and gateway URLs, the load's complete 200s and failures, the most workers
out at one moment, and each worker's out episodes. SIGTERM: stop the load, let every
stream end, write the final report ("stopped").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: factories

import httpx
from factories import SMG_ADMIN_KEY, EtcdProcess, SmgGateway, StreamingLoad, servers_out

from specd.io.gateway import GatewayClient

POLL_INTERVAL_S = 0.1
LOAD_CLIENTS = 4
# Long enough that a restart without a drain cuts a stream.
MAX_TOKENS = 120


def write_report(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("workers", nargs="+")
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    report: dict[str, Any] = {"phase": "starting", "most_out": 0, "episodes": {}}
    write_report(args.report, report)
    etcd = EtcdProcess(args.dir / "etcd").start()
    gateway = SmgGateway(args.workers, admin_key=SMG_ADMIN_KEY, retries=False).wait_ready()
    clients = {w: GatewayClient([gateway.url], w, api_key=SMG_ADMIN_KEY) for w in args.workers}
    episodes: dict[str, list[list[float]]] = {w: [] for w in args.workers}
    try:
        with StreamingLoad(gateway.url, LOAD_CLIENTS, max_tokens=MAX_TOKENS) as load:
            load.wait_for(10)
            report.update(phase="loaded", etcd_url=etcd.url, gateway_url=gateway.url)
            with httpx.Client() as http:
                was_out: set[str] = set()
                while not stop.is_set():
                    out = servers_out(http, clients)
                    now = time.monotonic()
                    for url in set(out) - was_out:
                        episodes[url].append([now, now])
                    for url in out:
                        episodes[url][-1][1] = now
                    was_out = set(out)
                    report.update(
                        most_out=max(report["most_out"], len(out)),
                        out=out,
                        episodes=episodes,
                        ok=load.ok,
                        failures=load.failures[:20],
                        failure_count=len(load.failures),
                    )
                    write_report(args.report, report)
                    stop.wait(POLL_INTERVAL_S)
        report.update(
            phase="stopped",
            ok=load.ok,
            failures=load.failures[:20],
            failure_count=len(load.failures),
            gateway_log=gateway.log()[-3000:],
        )
        write_report(args.report, report)
    finally:
        for client in clients.values():
            client.close()
        gateway.stop()
        etcd.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
