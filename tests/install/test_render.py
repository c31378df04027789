"""The files install writes: specd.toml with the keys in place, the polkit rule scoped to the
unit, and which of specd's own files a config names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from install_views import UNIT

from specd.core.settings import Settings
from specd.install.layout import InstallError
from specd.install.render import (
    DEFAULT_FILES,
    configured_files,
    render_config,
    render_polkit,
    template,
)
from specd.io.files import parse_toml


@pytest.mark.parametrize(
    ("existing", "kept"),
    [
        (None, ["[[windows]]"]),
        (
            "[observe]\nmin_history_s = 2.0\n[[windows]]\ncron = '* * * * mon'\nduration_s = 5.0\n",
            ["min_history_s = 2.0", "cron = '* * * * mon'"],
        ),
        (
            '[sglang]\nurl="http://old:1"\n[choose]\nmax_steps = 4\n[[bands]]\nsteps = 3\n',
            ["max_steps = 4"],
        ),
    ],
)
def test_render_config(existing: str | None, kept: list[str]) -> None:
    text = render_config(existing, "http://h:1", "llm.service", "EAGLE3")
    data = parse_toml(text)
    assert (data["sglang"]["url"], data["sglang"]["unit"]) == ("http://h:1", "llm.service")
    # The applier writes the algorithm with every setting ($SPECD_SPECULATIVE_ARGS).
    assert data["sglang"]["speculative_algorithm"] == "EAGLE3"
    for part in kept:
        assert part in text
    assert "http://old:1" not in text
    if existing is None or "[[bands]]" not in existing:
        # What install writes, specd accepts (a one-band config is not a config).
        Settings.model_validate(data)


SET = {"url": "u", "unit": "llm.service", "speculative_algorithm": "NEXTN"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("# no keys yet\n", {"sglang": SET}),  # an empty file gets the shipped example
        ("a = 1\n", {"a": 1, "sglang": SET}),
        ('[sglang]\nurl = "old"\nunit = "x"\n', {"sglang": SET}),
        ('[sglang]\nunit = "x"\n[observe]\nurl = 2\n', {"sglang": SET, "observe": {"url": 2}}),
        (
            'url = "top"\n[sglang]\n[[windows]]\nurl = 3\n',
            {"url": "top", "sglang": SET, "windows": [{"url": 3}]},
        ),
    ],
)
def test_a_key_is_set_in_its_table_only(text: str, expected: dict[str, object]) -> None:
    assert parse_toml(render_config(text, "u", "llm.service", "NEXTN")) == expected


GATEWAY = {"urls": ["http://10.0.0.9:30080", "http://10.0.0.8:30080"]}
FLEET = {"etcd_endpoints": ["http://10.0.0.7:2379"], "group": "g"}

# Ordinary TOML an operator writes, each form of it (audit item 1): the regex editor gave the
# first a second [sglang], left the arrays' old items dangling, and broke the dotted keys
# and the inline table.
FORMS = {
    "header with a comment": (
        '[sglang]  # our box\nurl = "http://old:1"  # set by hand\n',
        ["[sglang]  # our box", "# set by hand"],
    ),
    "multi-line arrays": (
        '# gateways and etcd\n[gateway]\nurls = [\n  "http://10.0.0.2:30080",  # rack a\n'
        '  "http://10.0.0.3:30080",\n]\n\n[fleet]\netcd_endpoints = [\n'
        '  "http://10.0.0.5:2379",\n  "http://10.0.0.6:2379",\n]\ngroup = "g"  # ours\n',
        ["# gateways and etcd", 'group = "g"  # ours', 'urls = [\n    "http://10.0.0.9:30080",\n'],
    ),
    "dotted keys": (
        '# flat\nsglang.url = "http://old:1"\ngateway.urls = ["http://old:2"]\n',
        ["# flat", 'sglang.url = "http://h:1"'],
    ),
    "inline tables": (
        'sglang = { url = "http://old:1" }  # inline\nfleet = { group = "old" }\n',
        ["# inline"],
    ),
}


@pytest.mark.parametrize("form", FORMS)
def test_every_form_of_toml_is_edited_in_place(form: str) -> None:
    text, kept = FORMS[form]
    out = render_config(text, "http://h:1", "llm.service", "EAGLE3", GATEWAY, FLEET)
    data = parse_toml(out)  # still TOML
    assert data["sglang"]["url"] == "http://h:1"
    assert data["sglang"]["unit"] == "llm.service"
    assert data["gateway"]["urls"] == GATEWAY["urls"]
    assert data["fleet"]["etcd_endpoints"] == FLEET["etcd_endpoints"]
    assert data["fleet"]["group"] == "g"
    for part in kept:  # comments and layout survive
        assert part in out, out
    for gone in ("http://old:", "10.0.0.2", "10.0.0.5"):
        assert gone not in out, out


def test_a_key_already_right_is_left_as_written() -> None:
    text = "[sglang]\nurl = 'http://h:1'   # ours\nunit = \"llm.service\"\n"
    out = render_config(text, "http://h:1", "llm.service", "EAGLE3")
    assert out.startswith(text)
    assert render_config(out, "http://h:1", "llm.service", "EAGLE3") == out


def test_a_crlf_file_stays_crlf() -> None:
    text = '[sglang]\r\nurl = "http://old:1"\r\n[observe]\r\nmin_history_s = 5.0\r\n'
    out = render_config(text, "http://h:1", "llm.service", "EAGLE3", GATEWAY)
    assert "\n" not in out.replace("\r\n", "")
    assert parse_toml(out)["gateway"] == GATEWAY


def test_polkit_rule_is_scoped_to_the_unit() -> None:
    shipped = template("polkit")
    assert render_polkit(shipped, UNIT) == shipped
    assert 'var SGLANG_UNIT = "llm@a.service";' in render_polkit(shipped, "llm@a.service")
    with pytest.raises(InstallError, match="no `var SGLANG_UNIT"):
        render_polkit("polkit.addRule(function () {});", UNIT)


def test_the_rendered_polkit_rule_lets_specd_restart_and_reset_failed_the_unit_only() -> None:
    """What a rollback needs after a change used up the unit's start limit (`systemctl
    reset-failed UNIT`) comes with the rule install writes, for that unit, and nothing more:
    behaviour under a real polkitd is tested in tests/systemd/test_sglang_unit.py."""
    rule = render_polkit(template("polkit"), "llm@a.service")
    assert re.findall(r'verb === "([a-z-]+)"', rule) == ["restart", "try-restart", "reset-failed"]
    # Every verb under the one test of the unit, which names the rendered unit.
    assert rule.count('action.lookup("unit") === SGLANG_UNIT') == 1
    assert rule.count("polkit.Result.YES") == 1
    assert 'var SGLANG_UNIT = "llm@a.service";' in rule


def test_configured_files() -> None:
    assert configured_files(None) == (DEFAULT_FILES, None)
    assert configured_files(template("config")) == (DEFAULT_FILES, None)
    files, problem = configured_files(
        '[files]\noverride_file = "/srv/o.toml"\nstate_dir = "/srv/s"\n'
    )
    assert problem is None
    assert (files.override_file, files.state_dir) == (Path("/srv/o.toml"), Path("/srv/s"))
    assert files.env_file == DEFAULT_FILES.env_file
    files, problem = configured_files("a = [")
    assert files == DEFAULT_FILES
    assert problem is not None
    assert "not valid TOML" in problem
