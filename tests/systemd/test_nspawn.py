"""The harness itself, where a mistake would make other tests pass or fail for the wrong
reason: the container's boot state, and ExecStart= lines built from argv."""

from __future__ import annotations

import json

import pytest
from nspawn import VENV_PYTHON, Container, exec_line

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
