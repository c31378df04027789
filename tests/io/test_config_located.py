"""Each problem of a config, with what it is about (`ConfigError.located`): the key paths
of the file's data, whether a SPECD_* variable made it, and for a key in the wrong place the
setting it was meant as. `specd.commands.config_fallback` leaves those keys out of a file
with problems (the on-call's commands), so it must not depend on how a problem is worded.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specd.commands import config_fallback
from specd.io import config as io_config
from specd.io.config import ConfigError, KeyPath, Problem, load_config, load_config_data

CALIBRATION = "steps,concurrency,output_tok_s\n3,1,230\n4,1,280\n"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("SPECD_"):
            monkeypatch.delenv(name)


def located(tmp_path: Path, text: str, **env: str) -> tuple[Problem, ...]:
    path = tmp_path / "specd.toml"
    path.write_text(text.replace("{tmp}", str(tmp_path)))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(ConfigError) as info:
            load_config(path)
    assert info.value.problems == [p.text for p in info.value.located]
    return info.value.located


# (the file, SPECD_* variables; the problem's first words, its key paths, from the
# environment, meant as)
CASES: dict[str, tuple[str, dict[str, str], str, tuple[KeyPath, ...], bool, str | None]] = {
    "unknown key": (
        "[observe]\nscrape_intervall_s = 10\n",
        {},
        "observe.scrape_intervall_s: unknown key",
        (("observe", "scrape_intervall_s"),),
        False,
        None,
    ),
    "renamed key at the top level": (
        'sglang_url = "http://127.0.0.1:1"\n',
        {},
        "`sglang_url` is now `url` in [sglang]",
        (("sglang_url",),),
        False,
        "sglang.url",
    ),
    "renamed key in a table": (
        '[observe]\nsglang_unit = "x.service"\n',
        {},
        "observe.sglang_unit: `sglang_unit` is now `unit` in [sglang]",
        (("observe", "sglang_unit"),),
        False,
        "sglang.unit",
    ),
    "[files] key in another table": (
        '[choose]\nstate_dir = "/var/lib/x"\n',
        {},
        "choose.state_dir: `state_dir` belongs in [files]",
        (("choose", "state_dir"),),
        False,
        "files.state_dir",
    ),
    "key at the top level": (
        "scrape_interval_s = 5\n",
        {},
        "`scrape_interval_s` belongs in [observe]",
        (("scrape_interval_s",),),
        False,
        "observe.scrape_interval_s",
    ),
    "array in a table": (
        "[choose]\nwindows = []\n",
        {},
        "choose.windows: `windows` is an array at the top level",
        (("choose", "windows"),),
        False,
        "windows",
    ),
    "table not a table": (
        "choose = 5\n",
        {},
        "choose: expected a table",
        (("choose",),),
        False,
        None,
    ),
    "array not an array": (
        "windows = 5\n",
        {},
        "windows: expected an array of tables",
        (("windows",),),
        False,
        None,
    ),
    "wrong type": (
        '[choose]\nmax_steps = "6"\n',
        {},
        "choose.max_steps: expected an integer",
        (("choose", "max_steps"),),
        False,
        None,
    ),
    "NUL in an item of [[windows]]": (
        '[[windows]]\ncron = "0 3 * * mon\\u0000"\nduration_s = 3600\n',
        {},
        "windows[0].cron: holds a NUL character",
        (("windows", 0, "cron"),),
        False,
        None,
    ),
    "bad value": (
        "[report]\nmetrics_port = 99999\n",
        {},
        "report.metrics_port: Input should be less than or equal to 65535",
        (("report", "metrics_port"),),
        False,
        None,
    ),
    "item of [[windows]]": (
        '[[windows]]\ncron = "0 3 * * 1"\nduration_s = 3600\n',
        {},
        "windows[0].cron: weekday '1'",
        (("windows", 0, "cron"),),
        False,
        None,
    ),
    "[files] key in an item of [[windows]]": (
        '[[windows]]\ncron = "0 3 * * mon"\nduration_s = 3600\noverride_file = "/x"\n',
        {},
        "windows[0].override_file: unknown key",
        (("windows", 0, "override_file"),),
        False,
        "files.override_file",
    ),
    "min_steps > max_steps": (
        "[choose]\nmin_steps = 7\nmax_steps = 5\n",
        {},
        "choose: min_steps (7) > max_steps (5)",
        (("choose", "min_steps"), ("choose", "max_steps")),
        False,
        None,
    ),
    "a band outside the step range": (
        "[choose]\nmax_steps = 3\n[[bands]]\nsteps = 5\n",
        {},
        "bands[0].steps: 5 is outside choose.min_steps..max_steps",
        (("bands",), ("choose", "min_steps"), ("choose", "max_steps")),
        False,
        None,
    ),
    "required key missing": (
        '[fleet]\ngroup = "g"\n',
        {},
        "fleet.etcd_endpoints: required key is missing",
        (("fleet", "etcd_endpoints"),),
        False,
        None,
    ),
    "required key of an item missing": (
        '[[windows]]\ncron = "0 3 * * mon"\n',
        {},
        "windows[0].duration_s: required key is missing",
        (("windows", 0, "duration_s"),),
        False,
        None,
    ),
    "bad calibration file": (
        "[choose]\ncalibration_file = '{tmp}/absent.csv'\n",
        {},
        "choose.calibration_file: ",
        (("choose", "calibration_file"),),
        False,
        None,
    ),
    "calibration lacking a set's rows": (
        "[choose]\ncalibration_file = '{tmp}/cal.csv'\nkinds = ['static', 'adaptive']\n"
        "adaptive_candidate_sets = ['adaptive:3,5']\n",
        {},
        "choose.adaptive_candidate_sets: 'adaptive:3,5' uses steps 5",
        (("choose", "adaptive_candidate_sets"), ("choose", "calibration_file")),
        False,
        None,
    ),
    "calibration predicting none of the kinds": (
        "[choose]\ncalibration_file = '{tmp}/cal.csv'\nkinds = ['off']\n",
        {},
        "choose.kinds: ",
        (("choose", "kinds"), ("choose", "calibration_file")),
        False,
        None,
    ),
    "unknown SPECD_* variable": (
        "# defaults\n",
        {"SPECD_FOO": "1"},
        "SPECD_FOO: unknown setting in the environment",
        (),
        True,
        None,
    ),
    "SPECD_* variable of a [files] key without its table": (
        "# defaults\n",
        {"SPECD_STATE_DIR": "/x"},
        "SPECD_STATE_DIR: unknown setting in the environment; `state_dir` belongs in [files]",
        (),
        True,
        "files.state_dir",
    ),
    "SPECD_* variable not JSON": (
        "# defaults\n",
        {"SPECD_WINDOWS": "nope"},
        "SPECD_WINDOWS: not valid JSON",
        (),
        True,
        None,
    ),
    "bad value of a variable": (
        "[choose]\nmax_steps = 5\n",
        {"SPECD_CHOOSE__MAX_STEPS": "99"},
        "choose.max_steps: Input should be less than or equal to",
        (("choose", "max_steps"),),
        True,
        None,
    ),
    "bad value beside a table's variable": (
        "[choose]\nmax_steps = 99\n",
        {"SPECD_CHOOSE": '{"min_steps": 2}'},
        "choose.max_steps: Input should be less than or equal to",
        (("choose", "max_steps"),),
        False,
        None,
    ),
    "unknown key of a table's variable": (
        "# defaults\n",
        {"SPECD_CHOOSE": '{"foo": 2}'},
        "choose.foo: unknown key",
        (("choose", "foo"),),
        True,
        None,
    ),
    "a check across keys, one set by a variable": (
        "[choose]\nmin_steps = 5\n",
        {"SPECD_CHOOSE__MAX_STEPS": "4"},
        "choose: min_steps (5) > max_steps (4) (choose.max_steps set by",
        (("choose", "min_steps"), ("choose", "max_steps")),
        False,
        None,
    ),
    "a check across keys, all set by variables": (
        "# defaults\n",
        {"SPECD_CHOOSE__MIN_STEPS": "5", "SPECD_CHOOSE__MAX_STEPS": "4"},
        "choose: min_steps (5) > max_steps (4)",
        (("choose", "min_steps"), ("choose", "max_steps")),
        True,
        None,
    ),
}


@pytest.mark.parametrize("kind", CASES)
def test_each_problem_says_what_it_is_about(tmp_path: Path, kind: str) -> None:
    text, env, first, keys, from_env, meant_as = CASES[kind]
    (tmp_path / "cal.csv").write_text(CALIBRATION)
    problems = [p for p in located(tmp_path, text, **env) if p.text.startswith(first)]
    assert len(problems) == 1, located(tmp_path, text, **env)
    assert problems[0] == Problem(problems[0].text, keys, env=from_env, meant_as=meant_as)


# The file as a whole: no key of it.
WHOLE: dict[str, bytes | None] = {
    "absent": None,
    "empty": b"",
    "not TOML": b"[observe\n",
    "not UTF-8": b"# r\xe9glages\n",
    "a BOM": b"\xef\xbb\xbf[observe]\n",
}


@pytest.mark.parametrize("kind", WHOLE)
def test_a_problem_of_the_file_as_a_whole_names_no_key(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "specd.toml"
    content = WHOLE[kind]
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [(p.keys, p.env, p.meant_as) for p in info.value.located] == [((), False, None)]
    assert info.value.problems == [p.text for p in info.value.located]


def test_a_config_error_of_lines_alone_locates_none() -> None:
    error = ConfigError(["one", Problem("two", (("choose",),))])
    assert error.problems == ["one", "two"]
    assert error.located == (Problem("one"), Problem("two", (("choose",),)))
    assert str(error) == "one; two"


def test_loading_data_is_loading_its_file(tmp_path: Path) -> None:
    data: dict[str, Any] = {
        "choose": {"max_steps": 5, "kinds": ["static"]},
        "windows": [{"cron": "0 3 * * mon", "duration_s": 60}],
    }
    config = load_config_data(data, path_shown=None)
    assert (config.choose.max_steps, config.choose.kinds) == (5, ("static",))
    assert config.windows[0].duration_s == 60
    data["choose"]["state_dir"] = "/x"  # misplaced
    with pytest.raises(ConfigError) as info:
        load_config_data(data, path_shown=tmp_path / "specd.toml")
    assert info.value.path == tmp_path / "specd.toml"
    assert info.value.problems == ["choose.state_dir: `state_dir` belongs in [files]"]
    assert data["choose"]["state_dir"] == "/x"  # the caller's data, as it was


def reworded(make: Callable[..., Any]) -> Callable[..., Any]:
    """``make`` with its problems' lines reworded: none of specd's words left."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        made = make(*args, **kwargs)
        if isinstance(made, tuple):  # (problems, kept)
            return [_reword(p) for p in made[0]], *made[1:]
        return [_reword(p) for p in made]

    return wrapped


def _reword(problem: Problem) -> Problem:
    return dataclasses.replace(problem, text=f"problem {zlib.crc32(problem.text.encode()):08x}")


@pytest.mark.parametrize(
    ("added", "defaults_for", "refused"),
    [
        ("[report]\nmetrics_port = 99999\n", ("report.metrics_port",), False),
        ('[[windows]]\ncron = "0 3 * * 1"\nduration_s = 3600\n', ("windows",), False),
        ("[choose]\nmin_steps = 7\nmax_steps = 5\n", ("choose.min_steps",), False),
        ("[observe]\nscrape_intervall_s = 10\n", (), False),
        ('[observe]\noverride_file = "/x"\n', (), True),
        ('state_dr = "/x"\n', (), True),  # in [files]
    ],
)
def test_the_oncall_fallback_works_from_located_not_the_wording(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    added: str,
    defaults_for: tuple[str, ...],
    refused: bool,
) -> None:
    for name in ("_placement_problems", "_type_problems", "_nul_problems", "_problems_from"):
        monkeypatch.setattr(io_config, name, reworded(getattr(io_config, name)))
    path = tmp_path / "specd.toml"
    path.write_text(
        f'[sglang]\nunit = "x.service"\n[files]\nstate_dir = "{tmp_path}/state"\n{added}'
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert all(p.startswith("problem ") for p in info.value.problems)  # reworded
    found = config_fallback.load_for_oncall("specd status", path)
    lines = capsys.readouterr().err.splitlines()
    if refused:
        assert found is None
        assert len(lines) == 1
        assert lines[0].startswith(f"specd status: {path}: problem "), lines
        return
    assert found is not None
    assert found.defaults_for == defaults_for
    assert found.problems == tuple(info.value.problems)
    assert str(found.config.files.state_dir) == f"{tmp_path}/state"
    assert found.config.sglang.unit == "x.service"
    assert len(lines) == 1, lines
    assert lines[0].startswith("specd status: warning: "), lines
