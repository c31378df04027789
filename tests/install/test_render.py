"""The files install writes: specd.toml with the keys in place, the polkit rule scoped to the
unit, and which of specd's own files a config names."""

from __future__ import annotations

from pathlib import Path

import pytest
from install_views import UNIT

from specd.core.settings import Settings
from specd.install.layout import InstallError
from specd.install.render import (
    DEFAULT_FILES,
    _set_key,
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


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", {"sglang": {"url": "u"}}),
        ("a = 1\n", {"a": 1, "sglang": {"url": "u"}}),
        ('[sglang]\nurl = "old"\nunit = "x"\n', {"sglang": {"url": "u", "unit": "x"}}),
        (
            '[sglang]\nunit = "x"\n[observe]\nurl = 2\n',
            {"sglang": {"url": "u", "unit": "x"}, "observe": {"url": 2}},
        ),
        (
            'url = "top"\n[sglang]\n[[windows]]\nurl = 3\n',
            {"url": "top", "sglang": {"url": "u"}, "windows": [{"url": 3}]},
        ),
    ],
)
def test_set_key_in_a_table(text: str, expected: dict[str, object]) -> None:
    """Keys in TOML tables ([sglang] url): the same writer, for when the config moves there."""
    assert parse_toml(_set_key(text, ("sglang", "url"), "u")) == expected


def test_polkit_rule_is_scoped_to_the_unit() -> None:
    shipped = template("polkit")
    assert render_polkit(shipped, UNIT) == shipped
    assert 'var SGLANG_UNIT = "llm@a.service";' in render_polkit(shipped, "llm@a.service")
    with pytest.raises(InstallError, match="no `var SGLANG_UNIT"):
        render_polkit("polkit.addRule(function () {});", UNIT)


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
