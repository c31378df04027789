"""Fixtures for tests under a real systemd: ONE nspawn container per test session.

`container` (session): the booted Container (see nspawn.py).
`sd` (function): the same container, reset after each test (units the test installed
are stopped and removed, /var/lib/specd and /etc/specd emptied).

No nspawn, not root, or a container that cannot boot: the tests FAIL with the reason,
unless SPECD_ALLOW_SKIP=1, when they skip loudly. CI must never pass by skipping.

A specd.service test, for example:

    def test_ready_reaches_systemd(sd: Container) -> None:
        sd.install_twin_sglang()                      # twin + repo drop-in as sglang.service
        sd.systemctl("start", SGLANG_UNIT)
        sd.wait_http("/health")
        sd.install_specd(config_toml=CONFIG, watchdog_sec=2)   # repo unit + test drop-in
        sd.systemctl("start", SPECD_UNIT)             # Type=notify: returns after READY=1
        assert "steps 3" in sd.show(SPECD_UNIT, "StatusText")

Files: sd.state_dir is /var/lib/specd inside (sd.write_env_file(steps) writes sglang.env),
sd.config_dir is /etc/specd; sd.sh(*argv, user="specd") runs as the specd user.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator

import pytest
from nspawn import Container, ContainerError, machine_name, nspawn_unavailable_reason


def _unavailable(reason: str) -> None:
    if os.environ.get("SPECD_ALLOW_SKIP") == "1":
        sys.stderr.write(f"\n*** SKIPPING real-systemd tests: {reason} ***\n")
        pytest.skip(f"real systemd unavailable (SPECD_ALLOW_SKIP=1): {reason}")
    pytest.fail(
        f"real systemd unavailable: {reason}. Set SPECD_ALLOW_SKIP=1 to skip on a laptop; "
        "CI must run these.",
        pytrace=False,
    )


@pytest.fixture(scope="session")
def container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    reason = nspawn_unavailable_reason()
    if reason is not None:
        _unavailable(reason)
    box = Container(root=tmp_path_factory.mktemp("nspawn"), machine=machine_name("test"))
    # atexit as well as the fixture finalizer: a crash in pytest itself must not leave a
    # systemd running (halt() is idempotent).
    atexit.register(box.halt)
    try:
        box.boot()
    except (ContainerError, OSError) as exc:
        box.halt()
        _unavailable(f"container did not boot: {exc}")
    try:
        yield box
    finally:
        box.halt()
        atexit.unregister(box.halt)


@pytest.fixture
def sd(container: Container) -> Iterator[Container]:
    container.reset()
    try:
        yield container
    finally:
        container.reset()
