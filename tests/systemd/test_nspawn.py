"""The harness itself, where a mistake would make other tests pass or fail for the wrong
reason: the container's boot state, and ExecStart= lines built from argv."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from nspawn import VENV_PYTHON, Container, ContainerError, exec_line, machine_name

pytestmark = pytest.mark.systemd

ECHO_ARGV = (
    "import json, sys; open('/var/lib/specd/argv.json', 'w').write(json.dumps(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["plain", "a b", "100%", "$HOME", "${HOME}x"],
            ["plain", "a b", "100%", "$HOME", "${HOME}x"],
        ),
        (
            ['say "hi"', "back\\slash", "semi;colon", ""],
            ['say "hi"', "back\\slash", "semi;colon", ""],
        ),
        (
            ["${SPECULATIVE_NUM_STEPS}", "--n=${SPECULATIVE_NUM_STEPS}"],
            ["7", "--n=${SPECULATIVE_NUM_STEPS}"],
        ),
    ],
)
def test_exec_line_passes_arguments_verbatim(
    sd: Container, args: list[str], expected: list[str]
) -> None:
    sd.write_unit(
        "echo-argv.service",
        "[Service]\nType=oneshot\nEnvironment=SPECULATIVE_NUM_STEPS=7\n"
        f"ExecStart={exec_line([str(VENV_PYTHON), '-c', ECHO_ARGV, *args])}\n",
    )
    sd.daemon_reload()
    sd.systemctl("start", "echo-argv.service")
    assert json.loads((sd.state_dir / "argv.json").read_text()) == expected


def test_container_runs_only_what_tests_start(container: Container) -> None:
    assert container.sh("systemctl", "is-system-running").stdout.strip() == "running"
    running = container.sh(
        "systemctl", "list-units", "--type=service", "--state=running", "--no-legend", "--plain"
    ).stdout.split()
    # No package presets applied at this "first boot" (prometheus, networkd, ...).
    assert not {"prometheus.service", "systemd-networkd.service"} & set(running)
    # The repo's sysusers.d entry is in force.
    assert container.sh("id", "-un", "specd").stdout.strip() == "specd"


class _HostAnswer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"host"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_http_probes_reach_the_containers_loopback_not_the_hosts(sd: Container) -> None:
    """http_get connects from the test process: on a port the host's loopback serves too
    (colleagues run twins on 30000 here), only the container's server may answer."""
    host = ThreadingHTTPServer(("127.0.0.1", 0), _HostAnswer)
    port = host.server_address[1]
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        (sd.state_dir / "where").write_text("container")
        argv = [str(VENV_PYTHON), "-m", "http.server", str(port), "--bind", "127.0.0.1",
                "--directory", "/var/lib/specd"]  # fmt: skip
        sd.write_unit("answer.service", f"[Service]\nExecStart={exec_line(argv)}\n")
        sd.daemon_reload()
        sd.systemctl("start", "answer.service")
        answer = sd.wait_http("/where", base=f"http://127.0.0.1:{port}")
        assert answer["body"] == "container", answer
    finally:
        host.shutdown()
        host.server_close()


def test_a_boot_that_never_comes_up_is_tried_once_more_then_says_what_it_saw(
    tmp_path: Path,
) -> None:
    """A container neither running nor failed when its boot's time is up (seen once in a
    full run: nothing on its console after 90 s) is halted and booted again; where that one
    does not come up either, the error shows both, with nspawn's state and the kernel wait
    it was in."""
    box = Container(root=tmp_path / "box", machine=machine_name("never-up"))
    try:
        with pytest.raises(ContainerError) as raised:
            box.boot(timeout_s=0.0)  # no time to come up, either time
    finally:
        box.halt()
    text = str(raised.value)
    assert text.count("container not running after 0 s (state ''; nspawn ") == 2, text
    assert "\n--- booted again ---\n" in text
    assert ": state " in text, text
    assert "waits in " in text, text
