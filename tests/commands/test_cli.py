"""The command line as an operator meets it: every command answers --help, a bad config
stops every command that reads it with one line per problem, and the on-call commands
(status, unfreeze) work on a real state directory with a real daemon."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from factories import run_specd as specd
from in_process import specd_main
from pages import Route, page_server
from prometheus_client import CollectorRegistry

from specd import cli
from specd.core.outcome import Avoided
from specd.core.setting import adaptive, traits_from_server_info, unavailable
from specd.daemon import Daemon
from specd.io.config import load_config
from specd.io.notify import Notifier
from specd.io.state import STATE_VERSION, UNFREEZE_REQUEST, State, StateStore
from specd.twin.process import free_port


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_command_answers_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main([name, "--help"])
    assert exit_.value.code == 0
    assert f"specd {name}" in capsys.readouterr().out


def test_top_level_help_lists_every_command() -> None:
    out = specd("--help").stdout
    assert all(name in out for name in cli.COMMANDS)
    # No command at all is a wrong command line: the usage on stderr, exit 2 (it was 0).
    bare = specd()
    assert (bare.returncode, bare.stdout) == (2, "")
    assert all(name in bare.stderr for name in cli.COMMANDS)


@pytest.mark.parametrize("command", ["override", "unfreeze", "status"])
def test_output_that_cannot_be_written_is_one_line_and_not_taken_for_the_action_failing(
    tmp_path: Path, command: str
) -> None:
    """`specd override freeze ... > FILE` on a full disk: the freeze was written, then its
    confirmation failed with a traceback and exit 1, which override documents as "not
    written". It is one line now, exit 74 (EX_IOERR), and what was done stays done."""
    cfg_path = write_config(tmp_path)
    frozen = {"since": time.time() - 60, "reason": "restart to 6 rolled_back: never healthy"}
    assert StateStore(tmp_path / "state").save(State(frozen=frozen)) is None
    argv = {
        "override": ["override", "freeze", "--for", "2h", "--reason", "investigating"],
        "unfreeze": ["unfreeze", "--reason", "fixed"],
        "status": ["status"],
    }[command]
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "specd.cli", *argv, "--config", str(cfg_path)],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 74, done.stderr
    assert "Traceback" not in done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("specd: cannot write the output (No space left on device)")
    if command == "override":
        assert 'mode = "freeze"' in (tmp_path / "override.toml").read_text()
    if command == "unfreeze":
        assert (tmp_path / "state" / UNFREEZE_REQUEST).exists()


# Runs `specd ARGS` as a lean install sees it: the named packages are absent (None in
# sys.modules is how Python marks a module that must not be imported: import raises
# ModuleNotFoundError and importlib.util.find_spec finds nothing).
WITHOUT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from specd import cli
sys.exit(cli.main(sys.argv[2:]))
"""
TOOLS = "aiohttp,rich,matplotlib"
NEEDS_TOOLS = ("twin", "demo", "load", "sweep")


def specd_without(packages: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, packages, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("argv", "hidden"),
    [
        (["twin", "--port", "1"], "aiohttp"),
        (["demo"], "rich"),
        (["demo"], "aiohttp"),
        (["load", "--url", "http://127.0.0.1:9"], "rich"),
        (["sweep", "--help"], "matplotlib"),
        (["sweep", "--help"], "rich"),
        # Installed but broken (a part of it missing): the command's import fails.
        (["load", "--url", "http://127.0.0.1:9"], "rich.console"),
    ],
    ids=lambda v: v if isinstance(v, str) else v[0],
)
def test_a_tool_without_the_tools_extra_says_what_to_install(argv: list[str], hidden: str) -> None:
    done = specd_without(hidden, *argv)
    assert (done.returncode, done.stdout) == (2, "")
    # From the checkout, as the README installs it: a bare `specd[tools]` would fetch
    # whatever the package index calls specd.
    assert done.stderr == (
        f"specd {argv[0]} needs the 'tools' extra: from the checkout, "
        "pip install -c requirements/constraints.txt '.[tools]'\n"
    )


OTHERS = [n for n in cli.COMMANDS if n not in NEEDS_TOOLS]
# Each other command's --help in turn, in one interpreter without the extra's packages: a
# module that imports one of them fails there whichever command imports it first.
HELP_WITHOUT = """
import contextlib, io, json, sys, traceback
for name in sys.argv[1].split(","):
    sys.modules[name] = None
from specd import cli
said = {}
for name in sys.argv[2:]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main([name, "--help"])
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = "raised"
    said[name] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(said))
"""


@pytest.fixture(scope="module")
def helped_without_tools() -> dict[str, list[Any]]:
    done = subprocess.run(
        [sys.executable, "-c", HELP_WITHOUT, TOOLS, *OTHERS],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", OTHERS)
def test_every_other_command_runs_without_the_tools_extra(
    helped_without_tools: dict[str, list[Any]], name: str
) -> None:
    code, stdout, stderr = helped_without_tools[name]
    assert code == 0, stderr
    assert f"specd {name}" in stdout


def test_the_daemon_imports_nothing_from_the_tools_extra() -> None:
    # The daemon's whole import graph loads with the extra's packages absent.
    code = (
        "import sys\n"
        f"for name in {TOOLS!r}.split(','):\n"
        "    sys.modules[name] = None\n"
        "import specd.daemon, specd.commands.run, specd.commands.status\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {TOOLS!r}.split(',')"
        " and sys.modules[m] is not None))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


# Each command in turn in one interpreter, then what it had imported. The tools extra is
# installed here (rich, and click through httpx[cli]): specd must not load it where it does
# not use it. The --help of run and override come first: they need no configuration.
IMPORTED_BY = """
import contextlib, io, json, socket, sys
from specd import cli
cfg, taken = sys.argv[1], sys.argv[2]
seen = {}
def loaded():
    return sorted(m for m in ("rich", "click", "pygments", "structlog", "httpx", "pydantic")
                  if sys.modules.get(m) is not None)
for argv in (["run", "--help"], ["override", "--help"], ["override", "pin", "3", "--for", "1y"],
             ["check-config"], ["status"], ["override", "show"], ["unfreeze", "--reason", "r"],
             ["run"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = cli.main([*argv, "--config", cfg if argv != ["run"] else taken])
        except SystemExit as exc:
            code = exc.code
    seen[" ".join(argv[:2])] = [code, loaded()]
# The CA bundle, loaded for clients of plain-HTTP servers that never do TLS.
from specd.io.tls import verifying_context
seen["CA bundle loaded"] = verifying_context.cache_info().currsize
print(json.dumps(seen))
"""


def test_a_command_imports_only_what_it_uses(tmp_path: Path) -> None:
    """Every `specd` process paid ~0.4 s of CPU importing: check-config loaded the HTTP client,
    every one-shot command structlog, and structlog and httpx loaded rich, click and pygments
    (for tracebacks and a command line specd never shows); `run --help` and a mistyped
    `override` argument loaded the daemon's or the config's whole graph to print a line."""
    cfg = write_config(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = tmp_path / "taken.toml"
        port = busy.getsockname()[1]
        taken.write_text(cfg.read_text().replace("metrics_port = 0", f"metrics_port = {port}"))
        done = subprocess.run(
            [sys.executable, "-c", IMPORTED_BY, str(cfg), str(taken)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {
        "run --help": [0, []],
        "override --help": [0, []],
        "override pin": [2, []],  # --for 1y: refused by argparse
        "check-config": [0, ["pydantic"]],
        "status": [0, ["httpx", "pydantic"]],
        "override show": [0, ["httpx", "pydantic"]],
        "unfreeze --reason": [0, ["httpx", "pydantic"]],
        # The daemon logs (structlog) and exits 1: its metrics port is taken.
        "run": [1, ["httpx", "pydantic", "structlog"]],
        "CA bundle loaded": 0,  # every URL above is http://
    }


# Builds clients of these URLs, then says whether the verifying context was made.
CLIENTS = """
import json, sys
from specd.io.fleet import EtcdClient
from specd.io.gateway import GatewayClient
from specd.io.sglang import SGLangClient
from specd.io.tls import verifying_context
said = []
for kind, urls in json.loads(sys.argv[1]):
    verifying_context.cache_clear()
    if kind == "sglang":
        SGLangClient(urls[0]).close()
    elif kind == "etcd":
        EtcdClient(urls, 1.0).close()
    else:
        GatewayClient(urls, "http://127.0.0.1:8").close()
    said.append(verifying_context.cache_info().currsize == 1)
print(json.dumps(said))
"""


def test_a_client_of_an_https_server_verifies_it() -> None:
    """A client of plain-HTTP servers only skips the CA bundle; one that may speak TLS to any
    of its servers verifies it as before."""
    cases = [
        ("sglang", ["https://sglang.internal:30000"], True),
        ("sglang", ["HTTPS://sglang.internal:30000"], True),
        ("etcd", ["http://10.0.0.1:2379", "https://10.0.0.2:2379"], True),
        ("gateway", ["https://gw.internal:30000"], True),
        ("sglang", ["http://127.0.0.1:30000"], False),
        ("etcd", ["http://10.0.0.1:2379", "http://10.0.0.2:2379"], False),
        ("gateway", ["http://127.0.0.1:30000"], False),
    ]
    done = subprocess.run(
        [sys.executable, "-c", CLIENTS, json.dumps([(kind, urls) for kind, urls, _ in cases])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [verifies for _, _, verifies in cases]


BAD_CONFIG = (
    "[choose]\nmin_steps = 5\nmax_steps = 2\n[observe]\nscrape_intervall_s = 3\n"
    '[restart]\nhealth_probe_timeout_s = "x"\n'
)


# `specd status`, `override` and `unfreeze` work on such a file, from its valid parts, and
# refuse only a broken [files]: tests/commands/test_oncall_bad_config.py.
@pytest.mark.parametrize(
    "argv",
    [
        ["run"],
        ["recommend", "--url", "http://127.0.0.1:9"],
        ["check-config"],
        ["sweep", "--steps", "3", "--concurrency", "1", "--yes"],
    ],
    ids=lambda argv: argv[0],
)
def test_a_bad_config_stops_the_command_with_one_line_per_problem(
    tmp_path: Path, argv: list[str]
) -> None:
    path = tmp_path / "specd.toml"
    path.write_text(BAD_CONFIG)
    # The daemon's exit status is what systemd sees: a real process; the others in-process.
    run = specd if argv == ["run"] else specd_main
    proc = run(*argv, "--config", str(path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert all(line.startswith(f"{path}: ") for line in lines), lines
    named = " ".join(lines)
    for key in ("observe.scrape_intervall_s", "restart.health_probe_timeout_s"):
        assert key in named, lines


@pytest.mark.parametrize(
    ("url", "root"),
    [
        ("http://127.0.0.1:30000/v1", "http://127.0.0.1:30000"),
        ("http://gpu-7:30000/v1/", "http://gpu-7:30000"),
        ("https://sglang.internal/generate?x=1", "https://sglang.internal"),
    ],
)
def test_a_sglang_url_under_the_root_is_a_config_error(tmp_path: Path, url: str, root: str) -> None:
    """[sglang] url = ".../v1" read /v1/metrics in every tick, as if metrics were off."""
    path = tmp_path / "specd.toml"
    path.write_text(f'[sglang]\nurl = "{url}"\n')
    proc = specd_main("check-config", str(path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines() == [
        f"{path}: sglang.url: {url.rstrip('/')!r} is not the server's root URL: specd wants {root} "
        f"(it reads /metrics and /server_info there: drop "
        f"{url.removeprefix(root).rstrip('/')})"
    ]


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "specd.toml"
    path.write_text(
        '[sglang]\nurl = "http://127.0.0.1:9"\n'  # nothing listens: the daemon sees no_data
        f'env_file = "{tmp_path / "sglang.env"}"\n'
        f'[files]\nstate_dir = "{tmp_path / "state"}"\n'
        f'override_file = "{tmp_path / "override.toml"}"\n'
        "[report]\nmetrics_port = 0\n[observe]\nscrape_timeout_s = 0.5\n"
    )
    return path


def test_status_unfreeze_and_the_daemon_clearing_the_freeze(tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path)
    config = load_config(cfg_path)
    store = StateStore(config.files.state_dir)
    frozen = {"since": time.time() - 60, "reason": "restart to 3 rolled_back: never healthy"}
    assert store.save(State(frozen=frozen)) is None

    status = specd_main("status", "--config", str(cfg_path))
    assert status.returncode == 0, status.stderr
    assert "FROZEN" in status.stdout
    assert "never healthy" in status.stdout
    assert json.loads(specd_main("status", "--config", str(cfg_path), "--json").stdout)["frozen"]

    done = specd_main("unfreeze", "--config", str(cfg_path), "--reason", "fixed the model path")
    assert done.returncode == 0, done.stderr
    request = Path(config.files.state_dir) / UNFREEZE_REQUEST
    assert json.loads(request.read_text())["reason"] == "fixed the model path"

    # The daemon, not the command, clears the freeze: at its next tick, and says who/why.
    daemon = Daemon(config, cfg_path, registry=CollectorRegistry(), notifier=Notifier({}))
    assert daemon.state.frozen is not None
    daemon.tick()
    assert daemon.state.frozen is None
    assert not request.exists()
    assert StateStore(config.files.state_dir).load()[0].frozen is None
    assert "FROZEN" not in specd_main("status", "--config", str(cfg_path)).stdout
    # Nothing frozen: nothing to request.
    again = specd_main("unfreeze", "--config", str(cfg_path), "--reason", "again")
    assert again.returncode == 0
    assert "not frozen" in again.stdout
    assert not request.exists()


def test_status_names_the_step_counts_avoided_after_a_regression(tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path)
    config = load_config(cfg_path)
    now = time.time()
    avoided = [
        Avoided(5, now - 3600, ((2, 1.0),), 0.031, 3),
        Avoided(6, now - 8 * 86400, ((2, 1.0),), 0.05, 3),  # past its week: not shown
    ]
    assert StateStore(config.files.state_dir).save(State(avoided=avoided)) is None
    status = specd_main("status", "--config", str(cfg_path))
    assert status.returncode == 0, status.stderr
    (line,) = [x for x in status.stdout.splitlines() if x.startswith("avoided")]
    assert "5 steps: served 3.1% less than 3" in line
    info = json.loads(specd_main("status", "--config", str(cfg_path), "--json").stdout)
    assert [(e["steps"], e["from_steps"]) for e in info["avoided"]] == [(5, 3)]
    assert info["avoided"][0]["until"] == pytest.approx(now - 3600 + 7 * 86400)


def test_run_with_its_metrics_port_taken_says_so_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = write_config(tmp_path)
        cfg.write_text(cfg.read_text().replace("metrics_port = 0", f"metrics_port = {port}"))
        proc = specd("run", "--config", str(cfg))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    [line] = [json.loads(x) for x in proc.stdout.splitlines() if "metrics_listen_failed" in x]
    assert line["level"] == "error"
    assert line["address"] == f"127.0.0.1:{port}"


PIN_6_NOW = {"mode": "pin", "steps": 6, "apply": "now"}


@pytest.mark.parametrize(
    ("override", "live", "argv", "code", "says"),
    [
        (None, "3", [], 0, "then: specd decides by itself again; a change it wants restarts"),
        # A failed `pin --now` freezes specd; unfrozen with the pin still in force, specd
        # restarts into it again at once: refused before anything is written.
        (PIN_6_NOW, "3", [], 2, "the override pins 6 steps with apply = now and SGLang runs 3"),
        (PIN_6_NOW, None, [], 2, "what SGLang runs is unknown"),
        ({**PIN_6_NOW, "steps": None, "setting": "adaptive:3,4"}, "3", [], 2, "adaptive:3,4"),
        (PIN_6_NOW, "3", ["--retry-pin"], 0, "pins 6 steps with apply = now: specd restarts"),
        # The pin runs: unfrozen, nothing restarts.
        (PIN_6_NOW, "6", [], 0, "then: the override pins 6 steps, which runs: no restart"),
        ({**PIN_6_NOW, "apply": "next-window"}, "3", [], 0, "into it in the next maintenance"),
        ({"mode": "freeze"}, "3", [], 0, "then: the override's freeze holds until "),
        ({**PIN_6_NOW, "expires_at": "2000-01-01T00:00:00Z"}, "3", [], 0, "decides by itself"),
        ({"mode": "pinn"}, "3", [], 0, "then: the override file is invalid"),
        # The restart budget used up (by the failed restart and its rollback, say): the
        # next window opens to no restart.
        (None, "3-budget", [], 0, "; none before 20"),
        ({**PIN_6_NOW, "apply": "next-window"}, "3-budget", [], 0, "(restart budget: 4 "),
    ],
)
def test_unfreeze_says_what_happens_next_and_never_retries_a_pin_unasked(
    tmp_path: Path,
    override: dict[str, Any] | None,
    live: str | None,
    argv: list[str],
    code: int,
    says: str,
) -> None:
    cfg_path = write_config(tmp_path)
    # The window opens 12 hours from now, so "the next maintenance window" whatever the time
    # of day (the default one, at 03:00 UTC, is open an hour a day: the open window's text).
    opens = (datetime.now(timezone.utc).hour + 12) % 24
    with cfg_path.open("a") as f:
        f.write(f'[[windows]]\ncron = "0 {opens} * * mon-sun"\nduration_s = 3600.0\n')
    config = load_config(cfg_path)
    now = time.time()
    frozen = {"since": now - 60, "reason": "restart to 6 rolled_back: never healthy"}
    restarts = []
    if live is not None and live.endswith("-budget"):
        live = live.removesuffix("-budget")
        restarts = [
            {"t": now - h * 3600, "from_steps": 3, "to_steps": 4, "result": "success"}
            for h in (1.0, 0.9, 0.8, 0.7)
        ]
    running = None if live is None else {"t": now - 5, "steps": 3, "source": "observation"}
    if running is not None:
        running |= {"setting": live, "steps": int(live) if live.isdigit() else None}
    saved = State(frozen=frozen, live=running, restarts=restarts)
    assert StateStore(config.files.state_dir).save(saved) is None
    if override is not None:
        expires = datetime.now(timezone.utc) + timedelta(hours=1)
        table = {"expires_at": expires, "reason": "incident", **override}
        table = {k: v for k, v in table.items() if v is not None}
        Path(config.files.override_file).write_text(tomli_w.dumps(table))
        Path(config.files.override_file).chmod(0o644)
    done = specd_main("unfreeze", "--config", str(cfg_path), "--reason", "fixed", *argv)
    assert done.returncode == code, done.stdout + done.stderr
    request = Path(config.files.state_dir) / UNFREEZE_REQUEST
    assert request.exists() is (code == 0)
    if code:
        assert says in done.stderr
        assert "nothing written" in done.stderr
        assert "specd override clear" in done.stderr
        assert "--retry-pin" in done.stderr
        assert done.stdout == ""
    else:
        lines = done.stdout.splitlines()
        assert lines[0].startswith("frozen since ")
        assert re.search(r" \(6\d s ago\): restart to 6 rolled_back: never healthy$", lines[0])
        assert says in lines[-1]
        assert lines[-1].startswith("then: ")


@pytest.mark.parametrize(
    ("reason", "says"),
    [
        ("", "say why it is safe to resume"),
        ("   ", "say why it is safe to resume"),
        # Refused as `override` refuses them: they would act on the reader's terminal, or
        # make the request file too large to read (the daemon then logs no reason at all).
        ("ok\x1b[2Jgone", "control characters"),
        ("two\nlines", "control characters"),
        ("x" * 70_000, "70000 characters; at most 2000"),
    ],
)
def test_unfreeze_needs_a_reason_it_can_keep(tmp_path: Path, reason: str, says: str) -> None:
    cfg_path = write_config(tmp_path)
    done = specd_main("unfreeze", "--config", str(cfg_path), "--reason", reason)
    assert done.returncode == 2
    assert says in done.stderr
    assert len(done.stderr.strip().splitlines()[-1]) < 300
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("reason", "says"),
    [
        # A Latin-1 terminal's "é": Python hands the byte on as a lone surrogate, which the
        # override's TOML could not hold (a traceback, exit 1: "could not be written").
        ("caf\udce9", "is not UTF-8 text"),
        # They turn the text after them around, or break the line, where it is shown.
        ("pin \u202e4 spets", "control characters"),
        ("one\u2028two", "control characters"),
    ],
)
@pytest.mark.parametrize("command", ["override", "unfreeze"])
def test_a_reason_that_is_no_text_to_show_is_refused_in_one_line(
    tmp_path: Path, command: str, reason: str, says: str
) -> None:
    cfg_path = write_config(tmp_path)
    argv = ["override", "pin", "3", "--for", "1h"] if command == "override" else ["unfreeze"]
    done = specd_main(*argv, "--config", str(cfg_path), "--reason", reason)
    assert (done.returncode, "Traceback" in done.stderr) == (2, False), done.stderr
    assert says in done.stderr
    assert not (tmp_path / "override.toml").exists()
    assert not any(p.name == "unfreeze.json" for p in tmp_path.rglob("*"))


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("qwen\udce9", "is not UTF-8 text"),  # a Latin-1 terminal's byte
        ("qwen\x1b[2J", "is no model name"),
        ("  ", "is no model name"),
    ],
)
def test_a_load_model_no_request_can_carry_is_refused_in_one_line(model: str, says: str) -> None:
    # It failed every request's encoding inside its worker: each died unseen, and the
    # summary said "errors: none".
    url = f"http://127.0.0.1:{free_port()}"
    done = specd_main("load", "--url", url, "--model", model, "--duration-s", "1")
    assert (done.returncode, "Traceback" in done.stderr) == (2, False), done.stderr
    assert says in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv",
    [
        ["status"],
        ["status", "--json"],
        ["check-config"],
        ["override", "show"],
        ["doctor", "--json"],
    ],
    ids=" ".join,
)
def test_a_reader_that_leaves_early_ends_the_command_quietly(
    tmp_path: Path, argv: list[str]
) -> None:
    # `specd status | head -1`: the pipe's reader is gone before the command writes.
    with subprocess.Popen(
        [sys.executable, "-m", "specd.cli", *argv, "--config", str(write_config(tmp_path))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        proc.stdout.close()
        stderr = proc.stderr.read()
        code = proc.wait(timeout=60)
    # What a shell reports for a command a closed pipe killed; no traceback.
    assert (code, stderr) == (128 + signal.SIGPIPE, "")


def start_holding_the_lock(cfg: Path, lock: Path) -> subprocess.Popen[str]:
    """`specd run` on ``cfg``, once it holds the state directory's ``lock``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "specd.cli", "run", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not (lock.exists() and lock.read_text().strip() == str(proc.pid)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"specd run never took the lock: {proc.communicate()}")
        time.sleep(0.1)
    return proc


def test_a_second_daemon_on_the_same_state_dir_refuses_to_start(tmp_path: Path) -> None:
    """Two daemons on one state directory each restart SGLang and each overwrite the
    other's state.json (the restart budget undercounted): the second says why and exits."""
    cfg = write_config(tmp_path)
    lock = tmp_path / "state" / "specd.lock"
    first = start_holding_the_lock(cfg, lock)
    try:
        second = specd("run", "--config", str(cfg))
        assert second.returncode == 1, second.stdout + second.stderr
        assert "Traceback" not in second.stdout + second.stderr
        [line] = [json.loads(x) for x in second.stdout.splitlines() if "state_dir_locked" in x]
        assert line["level"] == "error"
        assert line["error"] == (
            f"another specd runs with state directory {tmp_path / 'state'} (pid {first.pid})"
        )
        assert first.poll() is None  # the first runs on
    finally:
        first.terminate()
        first.communicate(timeout=30)
    # Gone with its process (even killed): the next start takes it.
    again = start_holding_the_lock(cfg, lock)
    again.terminate()
    again.communicate(timeout=30)


def _state_with(**parts: Any) -> str:
    return json.dumps({**State(last_decision={"t": time.time() - 60}).to_dict(), **parts})


@pytest.mark.parametrize(
    ("content", "said", "requested"),
    [
        # A freeze the daemon reads as one (it cannot read it): crashed after the request.
        (_state_with(frozen="yes"), "ago): state.json held a freeze specd cannot", True),
        # A journal the daemon cannot read keeps it frozen: "not frozen" was wrong.
        (_state_with(journal=["x"]), "ago): state.json held a restart journal", True),
        # A state that cannot be read says nothing of the freeze the daemon runs with.
        ("{", "cannot tell whether specd is frozen", True),
        (_state_with(frozen={"since": time.time(), "reason": "ok\x1b[2Jgone"}), "ok\\x1b[2J", True),
        # A newer specd's file: the daemon sets it aside and keeps its freeze.
        (
            _state_with(
                version=STATE_VERSION + 1, frozen={"since": time.time(), "reason": "failed"}
            ),
            "ago): state.json held a freeze in a file specd cannot read",
            True,
        ),
        (_state_with(frozen=None), "specd is not frozen; nothing to clear", False),
        (None, "specd is not frozen; nothing to clear", False),
    ],
    ids=[
        "freeze-text",
        "journal-unreadable",
        "state-not-json",
        "reason-escapes",
        "newer-specd-frozen",
        "not-frozen",
        "none",
    ],
)
def test_unfreeze_reads_the_freeze_as_the_daemon_does(
    tmp_path: Path, content: str | None, said: str, requested: bool
) -> None:
    cfg_path = write_config(tmp_path)
    state_dir = Path(load_config(cfg_path).files.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    if content is not None:
        (state_dir / "state.json").write_text(content)
    done = specd_main("unfreeze", "--config", str(cfg_path), "--reason", "looked at it")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert said in done.stdout + done.stderr
    assert "\x1b" not in done.stdout + done.stderr
    assert (state_dir / UNFREEZE_REQUEST).exists() is requested


def test_unfreeze_that_cannot_write_its_request_says_so_on_stderr(tmp_path: Path) -> None:
    """The error went to stdout, as `specd:`, where a script reading the output took it
    for what unfreeze had done."""
    cfg_path = write_config(tmp_path)
    (tmp_path / "state").write_text("not a directory\n")
    done = specd_main("unfreeze", "--config", str(cfg_path), "--reason", "fixed")
    assert done.returncode == 1
    assert done.stdout == ""
    assert "specd unfreeze: cannot write the request into " in done.stderr
    assert "Not a directory" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["doctor", "--help"],
        ["check-config", "{config}"],
        # Its message says "— restart at the next window" and names the file.
        ["override", "freeze", "--for", "1h", "--reason", "incident — 7", "--config",
         "{config}"],
    ],
)  # fmt: skip
def test_a_terminal_that_is_not_utf8_gets_escapes_not_a_traceback(
    tmp_path: Path, argv: list[str]
) -> None:
    """PYTHONIOENCODING=ascii (or a latin-1 locale): every command died on its first →,
    `override` after writing its file (exit 1, which says it could not write it)."""
    config = tmp_path / "specd.toml"
    config.write_text(
        f'[files]\nstate_dir = "{tmp_path}"\noverride_file = "{tmp_path}/o.toml"\n'
        f'[sglang]\nenv_file = "{tmp_path}/sglang.env"\nurl = "http://127.0.0.1:{free_port()}"\n'
    )
    args = [a.format(config=config) for a in argv]
    done = specd(*args, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.isascii()
    if argv[0] == "override":
        assert "\\u" in done.stdout, done.stdout  # what ASCII cannot hold, escaped
        assert 'mode = "freeze"' in (tmp_path / "o.toml").read_text()


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_closed_stdout_or_stderr_is_no_traceback(closed: str) -> None:
    """`specd check-config >&-`: Python leaves None for a closed stream, and every command
    raised AttributeError (exit 1) on its first print or at the final flush."""
    code = (
        "import sys\n"
        f"sys.{closed}.close(); sys.{closed} = None\n"
        "from specd import cli\n"
        "raise SystemExit(cli.main(['check-config', sys.argv[1]]))\n"
    )
    config = Path(__file__).resolve().parents[2] / "etc" / "specd" / "specd.toml"
    done = subprocess.run(
        [sys.executable, "-c", code, str(config)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


def test_what_sglang_says_is_shown_not_run_by_the_terminal() -> None:
    """A /server_info whose launch command, version and algorithm carry terminal escapes
    (clear the screen, retitle the window): `specd observe` printed them raw, and the
    reason a pin cannot run (status, doctor) named the algorithm raw."""
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
    info = json.loads((fixtures / "server_info-loaded.json").read_text())
    info["launch_command"] = "python -m sglang.launch_server \x1b]0;PWNED\x07\x1b[2J"
    info["version"] = "0.5.23\x1b[5m"
    info["speculative_algorithm"] = "EAGLE\x1b[1m"
    with page_server() as server:
        server.routes["/metrics"] = Route(
            body=(fixtures / "sglang-0.5.23-loaded.prom").read_bytes()
        )
        server.routes["/server_info"] = Route(body=json.dumps(info).encode())
        done = specd("observe", "--url", server.url)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout + done.stderr
    assert "\\x1b]0;PWNED\\x07" in done.stdout
    traits = traits_from_server_info({**info, "speculative_algorithm": "MEDUSA\x1b[1M"})
    why = unavailable(adaptive((1, 3)), traits, allow_off=True)
    assert why is not None
    assert "\x1b" not in why
