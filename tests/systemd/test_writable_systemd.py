"""specd.service (ProtectSystem=strict, StateDirectory=specd) and a specd.toml whose
[sglang] env_file or [files] state_dir lies outside /var/lib/specd, under a real systemd.

Before: install wrote the unit as shipped, so specd could write only /var/lib/specd. An env
file elsewhere failed the first change ("Read-only file system") and froze specd, and every
change after an unfreeze failed the same way; a state directory elsewhere stopped specd's
start ("state_dir_unusable: Read-only file system", no fix named), and install ended at
`systemctl enable --now`. check-config, install and doctor said nothing of it."""

from __future__ import annotations

import pytest
import tomli_w
from nspawn import SGLANG_UNIT, SPECD_UNIT, VENV_SPECD, Container, ContainerError
from test_doctor_systemd import verdicts
from test_install_repairs import no_window, start_sglang
from test_install_systemd import live_steps

from specd.io.files import parse_toml

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

SPECD = str(VENV_SPECD)
ENV_DIR = "/srv/llm"
ENV_FILE = f"{ENV_DIR}/specd.env"
STATE_DIR = "/srv/specd-state"
FIX = (
    f"`specd install --unit {SGLANG_UNIT}` prepares it (creates it for user specd and adds it "
    "to specd.service's ReadWritePaths=: ProtectSystem=strict lets specd write only "
    "/var/lib/specd and those), or keep sglang.env_file under /var/lib/specd"
)


def config_with(sd: Container, **files: str) -> str:
    config = parse_toml(no_window(sd))
    if "env_file" in files:
        config.setdefault("sglang", {})["env_file"] = files["env_file"]
    if "state_dir" in files:
        config.setdefault("files", {})["state_dir"] = files["state_dir"]
    return tomli_w.dumps(config)


def test_install_lets_specd_write_where_the_config_says(sd: Container) -> None:
    start_sglang(sd)
    (sd.config_dir / "specd.toml").write_text(
        config_with(sd, env_file=ENV_FILE, state_dir=STATE_DIR)
    )
    try:
        checked = sd.sh(SPECD, "check-config")
        warned = [line for line in checked.stderr.splitlines() if ": warning: " in line]
        assert [line.split(": warning: ")[0].rsplit(": ", 1)[1] for line in warned] == [
            "files.state_dir",
            "sglang.env_file",
        ], checked.stderr
        done = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90, check=False)
        assert done.returncode == 0, done.stdout + done.stderr + sd.journal(SPECD_UNIT)
        assert f"created {ENV_DIR}\n" in done.stdout, done.stdout
        allowed = sd.show(SPECD_UNIT, "ReadWritePaths").split()
        assert [p.lstrip("-") for p in allowed] == [STATE_DIR, ENV_DIR], allowed
        assert sd.active_state(SPECD_UNIT) == "active"
        _, found = verdicts(sd)
        assert found["writable"]["ok"], found["writable"]
        assert found["writable"]["detail"] == (
            f"{SPECD_UNIT} may write {STATE_DIR} (files.state_dir), {ENV_DIR} (sglang.env_file)"
        )

        # A change goes through: the env file written where the unit reads it, verified.
        sd.sh(SPECD, "override", "pin", "4", "--for", "2h", "--reason", "on-call", "--now")
        try:
            sd.wait_for(lambda: live_steps(sd) == 4, timeout=45, interval=0.5, what="pinned 4")
        except ContainerError as exc:
            raise AssertionError(
                f"{exc}\n--- {SPECD_UNIT} ---\n{sd.journal(SPECD_UNIT)}\n--- {SGLANG_UNIT} ---\n"
                f"{sd.journal(SGLANG_UNIT)}"
            ) from exc
        status = sd.sh(SPECD, "status").stdout
        assert "frozen         no" in status, status
        assert "--speculative-num-steps 4 " in sd.sh("cat", ENV_FILE).stdout
        assert sd.sh("test", "-s", f"{STATE_DIR}/state.json", check=False).returncode == 0
    finally:
        gone = sd.sh(SPECD, "uninstall", check=False, timeout=90)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    # What install made, uninstall takes away (specd's files archived first).
    for directory in (ENV_DIR, STATE_DIR):
        assert sd.sh("test", "-e", directory, check=False).returncode == 1, gone.stdout


def test_specd_and_doctor_name_what_a_unit_by_hand_cannot_write(sd: Container) -> None:
    """The README's install by hand: the shipped unit, an env file in /srv/llm."""
    start_sglang(sd)
    sd.sh("mkdir", "-p", ENV_DIR)
    try:
        sd.install_specd(config_toml=config_with(sd, env_file=ENV_FILE))
        started = sd.sh("systemctl", "start", SPECD_UNIT, check=False, timeout=60)
        assert started.returncode != 0
        journal = sd.journal(SPECD_UNIT)
        said = [line for line in journal.splitlines() if "env_file_unwritable" in line]
        assert said, journal
        assert (
            f"sglang.env_file: specd cannot write {ENV_DIR} (read-only file system), where it "
            f"writes SGLang's env file; {FIX}"
        ) in said[0]
        sd.systemctl("stop", SPECD_UNIT)
        code, found = verdicts(sd)
        assert code == 1
        assert not found["writable"]["ok"]
        assert found["writable"]["detail"] == (
            f"sglang.env_file {ENV_FILE}: specd cannot write {ENV_DIR}: ProtectSystem=strict "
            "makes it read-only to specd (it may write /var/lib/specd: StateDirectory= and "
            "ReadWritePaths=)"
        )
        assert found["writable"]["advice"] == FIX

        # Allowed in the unit, but root's: doctor names the owner and the chown.
        sd.write_unit(f"{SPECD_UNIT}.d/70-llm.conf", f"[Service]\nReadWritePaths={ENV_DIR}\n")
        sd.daemon_reload()
        code, found = verdicts(sd)
        assert found["writable"]["detail"] == (
            f"sglang.env_file {ENV_FILE}: specd cannot write {ENV_DIR}: user specd cannot "
            f"write {ENV_DIR} (0755 root:root)"
        )
        assert found["writable"]["advice"] == (
            f"`chown specd:specd {ENV_DIR}` if it is specd's alone, or keep sglang.env_file "
            "under /var/lib/specd"
        )
        # The advice followed, specd starts and doctor passes the check.
        sd.sh("chown", "specd:specd", ENV_DIR)
        _, found = verdicts(sd)
        assert found["writable"]["ok"], found["writable"]
        # Its earlier failures count against the start limit; once garbage-collected (not
        # loaded) the unit has none to reset.
        sd.systemctl("reset-failed", SPECD_UNIT, check=False)
        sd.systemctl("start", SPECD_UNIT, timeout=60)
        assert sd.active_state(SPECD_UNIT) == "active"
    finally:
        sd.sh("rm", "-rf", ENV_DIR, check=False)
