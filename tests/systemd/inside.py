"""A probe run INSIDE the nspawn container as specd.service (with its real hardening):

    python inside.py probe URL --report FILE [--restart UNIT ...] [--import MODULE ...]

It checks, without a shell, what the daemon will need to do, writing the findings as JSON
to --report: GET URL over loopback, listen on 127.0.0.1, `systemctl --no-ask-password
restart UNIT` for each UNIT, import each MODULE, and which paths are writable. Standard
library only (the probe itself must not depend on what it checks).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any


def fetch(url: str, timeout_s: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return {
                "status": response.status,
                "body": response.read().decode("utf-8", "replace"),
                "error": None,
            }
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode("utf-8", "replace"), "error": None}
    except (OSError, ValueError) as exc:
        return {"status": None, "body": "", "error": f"{type(exc).__name__}: {exc}"}


def probe(url: str, units: list[str], report: str, modules: list[str]) -> dict[str, Any]:
    findings: dict[str, Any] = {"uid": os.getuid(), "url": fetch(url, timeout_s=5.0)}
    # Seccomp and MemoryDenyWriteExecute= fail at import time, if at all, for native
    # extensions (pydantic-core, ...): import what the daemon imports.
    findings["imports"] = {}
    for module in modules:
        try:
            importlib.import_module(module)
            findings["imports"][module] = "ok"
        except Exception as exc:  # report any failure, whatever it is
            findings["imports"][module] = f"{type(exc).__name__}: {exc}"
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        findings["listen_loopback"] = True
    except OSError as exc:
        findings["listen_loopback"] = f"{type(exc).__name__}: {exc}"
    finally:
        listener.close()
    findings["restart"] = {}
    for unit in units:
        done = subprocess.run(
            ["systemctl", "--no-ask-password", "restart", unit],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        findings["restart"][unit] = {"rc": done.returncode, "stderr": done.stderr.strip()}
    state_dir = os.path.dirname(report)
    findings["writable"] = {
        path: os.access(path, os.W_OK)
        for path in ("/etc/specd", "/usr/local", "/tmp", "/var/tmp", state_dir)
    }
    # The mode a file the daemon creates gets (UMask= of the unit).
    created = os.path.join(state_dir, "probe.created")
    with open(created, "w"):
        pass
    findings["created_mode"] = f"{os.stat(created).st_mode & 0o777:04o}"
    with open(report + ".tmp", "w") as out:
        json.dump(findings, out)
    os.replace(report + ".tmp", report)
    return findings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="inside.py")
    parser.add_argument("command", choices=["probe"])
    parser.add_argument("url")
    parser.add_argument("--report", default="/var/lib/specd/probe.json")
    parser.add_argument("--restart", action="append", default=[])
    parser.add_argument("--import", dest="modules", action="append", default=[])
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.url, args.restart, args.report, args.modules)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
