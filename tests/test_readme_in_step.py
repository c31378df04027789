"""README.md and the product, kept in step: what the README tells an operator to type or to
look for exists and means what it says. Every `specd` command line it shows parses (flags,
placeholders filled in), every config key it names is a field and every field of a table is
listed, every specd_* metric is exported, every decision reason is one specd gives, every
alert and recording rule it names is in the rules file, every repository path exists, and
`specd doctor`'s sample output lists the checks doctor runs; and what the On call section
says an expired override reads as, it reads as. Fast: nothing here starts a process or
opens a socket."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from specd import cli
from specd.cli import COMMANDS
from specd.commands.doctor import NEEDS_CONFIG
from specd.core import settings
from specd.core.decide import Reason
from specd.io.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
RULES = ROOT / "etc" / "prometheus" / "specd.rules.yml"
TABLES: dict[str, type[Any]] = {
    "sglang": settings.SGLangSettings,
    "files": settings.FilesSettings,
    "observe": settings.ObserveSettings,
    "choose": settings.ChooseSettings,
    "restart": settings.RestartSettings,
    "report": settings.ReportSettings,
    "fleet": settings.FleetSettings,
    "gateway": settings.GatewaySettings,
    "bands": settings.Band,
    "windows": settings.Window,
}
# The README's placeholders, as an operator fills them in.
PLACEHOLDERS = {"K": "3", "N": "3", "NAME": "host-a", "URL": "http://10.0.0.5:2379"}


def code_blocks() -> list[str]:
    return re.findall(r"^```\w*\n(.*?)^```", README, re.M | re.S)


def spans() -> list[str]:
    return re.findall(r"`([^`\n]+)`", README)


def command_of(line: str) -> list[str] | None:
    """``specd COMMAND ...`` as words (``$ ``, ``sudo`` and a trailing ``# comment`` taken
    off, placeholders filled in), or None for a line that is not one (specd's own output)."""
    line = re.sub(r"^(\$ )?(sudo )?", "", line.strip())
    line = re.split(r"\s+#\s", line, maxsplit=1)[0]
    if not line.startswith("specd "):
        return None
    words = shlex.split(line)
    if len(words) < 2 or words[1] not in COMMANDS:
        return None
    return [PLACEHOLDERS.get(w, w) for w in words[1:]]


def block_commands() -> list[list[str]]:
    """Every command line of the README's code blocks, continuation lines joined, optional
    ``[--flag VALUE]`` parts given."""
    found = []
    for block in code_blocks():
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = command_of(line.replace("[", "").replace("]", ""))
            if words is not None:
                found.append(words)
    return found


def span_commands() -> list[list[str]]:
    """Every ``specd COMMAND ...`` the prose shows in backticks (often partial: a flag named
    in passing), ``[--flag]`` given."""
    return [
        words
        for span in spans()
        if (words := command_of(span.replace("[", "").replace("]", ""))) is not None
    ]


def parser_for(words: list[str]) -> argparse.ArgumentParser:
    """The parser `specd` builds for ``words[0]`` (for `override`, its action's)."""
    module = importlib.import_module(COMMANDS[words[0]][0])
    parser = argparse.ArgumentParser(prog=f"specd {words[0]}", exit_on_error=False)
    module.configure(parser)
    if words[0] == "override" and len(words) > 1:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        return sub[words[1]]
    return parser


def test_the_readme_shows_commands() -> None:
    # The extraction itself: it would pass vacuously on a README it cannot read.
    assert len(block_commands()) >= 20
    assert len(span_commands()) >= 30


@pytest.mark.parametrize("words", block_commands(), ids=" ".join)
def test_every_command_line_in_a_code_block_parses(words: list[str]) -> None:
    parser = parser_for(words)
    module = importlib.import_module(COMMANDS[words[0]][0])
    top = argparse.ArgumentParser(prog=f"specd {words[0]}", exit_on_error=False)
    module.configure(top)
    try:
        top.parse_args(words[1:])
    except (argparse.ArgumentError, SystemExit) as exc:
        pytest.fail(f"`specd {' '.join(words)}` does not parse: {exc}")
    assert parser is not None


@pytest.mark.parametrize("words", span_commands(), ids=" ".join)
def test_every_flag_named_in_the_prose_is_one_of_its_command(words: list[str]) -> None:
    options = {o for a in parser_for(words)._actions for o in a.option_strings}
    unknown = [w for w in words if w.startswith("-") and w.split("=", 1)[0] not in options]
    assert not unknown, f"`specd {' '.join(words)}`: no such option {unknown}"


def test_the_configuration_table_lists_every_key_of_every_table() -> None:
    rows = dict(re.findall(r"^\| `\[\[?(\w+)\]\]?` \| (.*) \|$", README, re.M))
    assert set(rows) == set(TABLES), sorted(rows)
    for table, row in rows.items():
        named = set(re.findall(r"`(\w+)`", row))
        declared = set(TABLES[table].model_fields)
        assert named - declared == set(), f"[{table}]: no such keys {named - declared}"
        assert declared - named == set(), f"[{table}]: keys not listed {declared - named}"


def test_every_key_the_readme_names_with_its_table_is_a_field() -> None:
    tables = "|".join(TABLES)
    named = set(re.findall(rf"`\[\[?({tables})\]\]? (\w+)`", README))
    named |= set(re.findall(rf"`({tables})\.(\w+)`", README))
    assert len(named) >= 5
    unknown = sorted((t, k) for t, k in named if k not in TABLES[t].model_fields)
    assert not unknown, unknown


def test_every_env_override_the_readme_shows_names_a_field() -> None:
    for table, key in re.findall(r"SPECD_([A-Z]+)__([A-Z_]+)=", README):
        assert key.lower() in TABLES[table.lower()].model_fields, (table, key)


def metric_names() -> set[str]:
    registry = CollectorRegistry()
    Metrics(registry=registry)
    return set(registry._names_to_collectors)


def test_every_specd_metric_the_readme_names_is_exported() -> None:
    exported = metric_names()
    named = set()
    for found in re.findall(r"\bspecd_[a-z0-9_{},]*[a-z0-9}]", README):
        name = re.sub(r"\{\w+\}?$", "", found)  # its labels: specd_x_total{kind}
        # specd_predicted_throughput_{low,high}_tokens_per_second: both names.
        choice = re.search(r"\{(\w+),(\w+)\}", name)
        alternatives = choice.groups() if choice else ("",)
        named |= {name.replace(choice[0], a) if choice else name for a in alternatives}
    assert len(named) >= 20
    assert named - exported == set()


def test_the_reason_table_is_every_reason_specd_gives() -> None:
    section = README.split("| reason | meaning |", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert sorted(listed) == sorted(r.value for r in Reason)


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def test_every_alert_has_its_runbook_heading_and_every_heading_an_alert() -> None:
    runbook = README.split("### Alerts and what to do", 1)[1].split("\n## ", 1)[0]
    headings = re.findall(r"^#### (\w+)$", runbook, re.M)
    assert sorted(headings) == sorted(r["alert"] for r in rules() if "alert" in r)


def test_every_recording_rule_the_readme_names_is_recorded() -> None:
    recorded = {r["record"] for r in rules() if "record" in r}
    named = set(re.findall(r"`(\w+:\w+:\w+)`", README))
    assert named, "no recording rule named"
    assert named - recorded == set()


def test_every_repository_path_the_readme_names_exists() -> None:
    tops = "tests|specd|etc|grafana|bench|systemd|data|requirements|scripts|\\.ci"
    named = {
        span.split()[0].rstrip(",.:")
        for span in spans()
        if re.match(rf"^({tops})/", span) and "*" not in span
    }
    assert len(named) >= 40
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


# The order doctor prints its checks in (Doctor.run): the unit's checks after SGLang's.
DOCTOR_ORDER = [
    "config",
    "sglang",
    "metrics",
    "version",
    "choices",
    "drop-in",
    "command",
    "setting",
    "polkit",
    "windows",
    "override",
    "fleet",
    "writable",
    "service",
    "specd-metrics",
]


def test_doctors_sample_output_lists_the_checks_doctor_runs() -> None:
    """The ✓/✗ lines of the README's `specd doctor` samples: each a check doctor runs, and
    each check doctor runs on a box without [gateway] in both samples, in doctor's order."""
    runs = ["config", *(name for name, _ in NEEDS_CONFIG if name != "gateway"), "service"]
    samples = [b for b in code_blocks() if b.startswith("✓ config ")]
    assert len(samples) == 2
    healthy, broken = [re.findall(r"^[✓✗-] (\S+)", s, re.M) for s in samples]
    assert healthy == [n for n in DOCTOR_ORDER if n in runs], healthy
    # A /metrics that fails leaves nothing to read SGLang's version from: no version check.
    assert broken == [n for n in healthy if n != "version"], broken


@pytest.mark.parametrize("argv", [["override", "show"], ["status"]], ids=" ".join)
def test_an_expired_override_is_said_expired_as_the_readme_has_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """README (On call): "`specd status` and `specd override show` say EXPIRED until the file
    is deleted or cleared". `override show` said "pin expired 2.0 h ago": an on-call looking
    for the word the README and `specd status` use did not find it."""
    override = tmp_path / "override.toml"
    override.write_text(
        'mode = "pin"\nsteps = 4\nexpires_at = 2026-01-01T00:00:00Z\nreason = "x"\n'
    )
    override.chmod(0o644)
    config = tmp_path / "specd.toml"
    config.write_text(
        f'[sglang]\nurl = "http://127.0.0.1:9"\nenv_file = "{tmp_path}/sglang.env"\n'
        f'[files]\nstate_dir = "{tmp_path}/state"\noverride_file = "{override}"\n'
    )
    assert cli.main([*argv, "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"\bpin (4 steps )?EXPIRED [0-9.]+ \w+ ago \(2026-01-01T00:00:00\+00:00\)", out
    ), out
