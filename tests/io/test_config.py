from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from specd.cli import main
from specd.io.config import Band, Config, ConfigError, Window, config_to_dict, load_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "etc" / "specd" / "specd.toml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # A SPECD_* variable from the developer's shell must not leak into these tests.
    for name in list(os.environ):
        if name.upper().startswith("SPECD_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "specd.toml"
    path.write_text(text)
    return path


def test_defaults_match_the_agreed_fields() -> None:
    cfg = Config()
    assert cfg.sglang_url == "http://127.0.0.1:30000"
    assert cfg.sglang_unit == "sglang.service"
    assert cfg.env_file == Path("/var/lib/specd/sglang.env")
    assert cfg.state_dir == Path("/var/lib/specd")
    assert cfg.override_file == Path("/etc/specd/override.toml")
    assert (cfg.min_steps, cfg.max_steps) == (1, 6)
    assert cfg.apply_mode == "static-topk1"
    assert cfg.policy == "bands"
    assert cfg.bands == [Band(max_concurrency=4, steps=4), Band(steps=3)]
    assert cfg.windows == [Window(cron="0 3 * * mon-sun", duration_s=3600, timezone="UTC")]
    assert cfg.health_probe_timeout_s == 30
    assert cfg.metrics_listen_address == "127.0.0.1"
    assert cfg.metrics_port == 9464
    assert cfg.log_format == "json"
    for name, field in Config.model_fields.items():
        assert field.description, f"{name} has no description"


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(pydantic.ValidationError):
        cfg.max_steps = 3  # type: ignore[misc]


def test_example_file_lists_every_option_and_is_valid() -> None:
    text = EXAMPLE.read_text()
    for name in Config.model_fields:
        # Options without a default value (calibration_file) or whose default depends on
        # another (policy) are shown commented out.
        listed = (f"\n{name} = ", f"[[{name}]]", f"\n# {name} = ")
        assert any(form in text for form in listed), f"{name} not in {EXAMPLE}"
    assert config_to_dict(load_config(EXAMPLE)) == config_to_dict(Config())


def test_example_passes_check_config_as_a_real_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "check-config", str(EXAMPLE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SPECD_")},
    )
    assert proc.returncode == 0, proc.stderr
    assert 'sglang_unit = "sglang.service"' in proc.stdout


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_step = 4\n", ["max_step: unknown key"]),
        ("[[windows]]\ncron = '0 3 * * *'\nduration_s = 60\nzone = 'UTC'\n", ["windows[0].zone:"]),
        ('max_steps = "six"\n', ["max_steps: expected an integer, got str 'six'"]),
        ('max_steps = "6"\n', ["max_steps: expected an integer"]),
        ("min_steps = true\n", ["min_steps: expected an integer, got bool"]),
        ("scrape_interval_s = '5'\n", ["scrape_interval_s: expected a number"]),
        ("sglang_url = 5\n", ["sglang_url: expected a string"]),
        ("windows = 'daily'\n", ["windows: expected an array of tables"]),
        ("policy = 'magic'\n", ["policy: Input should be 'bands' or 'model'"]),
        ("min_steps = 5\nmax_steps = 3\n", ["min_steps (5) > max_steps (3)"]),
        ("max_steps = 17\n", ["max_steps: Input should be less than or equal to 16"]),
        ("min_steps = 0\n", ["min_steps: Input should be greater than or equal to 1"]),
        ("max_steps = 3\n", ["bands[0].steps: 4 is outside min_steps..max_steps (1..3)"]),
        (
            "[[bands]]\nmax_concurrency = 8\nsteps = 4\n[[bands]]\nmax_concurrency = 4\n"
            "steps = 3\n[[bands]]\nsteps = 3\n",
            ["bands: max_concurrency must strictly increase"],
        ),
        ("[[bands]]\nsteps = 3\n[[bands]]\nsteps = 4\n", ["bands: exactly one band, the last"]),
        ("[[bands]]\nmax_concurrency = 4\nsteps = 4\n", ["bands: exactly one band, the last"]),
        ("bands = []\n", ["bands: at least one band"]),
        ("health_probe_timeout_s = 20\n", ["health_probe_timeout_s: Input should be greater"]),
        ("min_dwell_s = -1\n", ["min_dwell_s: Input should be greater than or equal to 0"]),
        ("scrape_interval_s = 0\n", ["scrape_interval_s: Input should be greater than 0"]),
        ("tolerance_ratio = 1.5\n", ["tolerance_ratio: Input should be less than 1"]),
        ("metrics_port = 70000\n", ["metrics_port: Input should be less than or equal"]),
        ("windows = []\n", ["windows: List should have at least 1 item"]),
        (
            "[[windows]]\ncron = '0 3 * * 1-5'\nduration_s = 3600\n",
            ["windows[0].cron: weekday '1-5': use names mon..sun, not numbers"],
        ),
        (
            "[[windows]]\ncron = '0 3 * * mon'\nduration_s = -5\n",
            ["windows[0].duration_s: Input should be greater than 0"],
        ),
        (
            "[[windows]]\ncron = '0 3 * * mon'\nduration_s = 60\ntimezone = 'Europe/Berlinn'\n",
            ["windows[0].timezone: unknown timezone 'Europe/Berlinn'"],
        ),
        (
            "[[windows]]\ncron = '0 3 * * mon'\nduration_s = 60\n"
            "[[windows]]\ncron = '0 0 30 feb *'\nduration_s = 60\n",
            ["windows[1]: '0 0 30 feb *' never fires"],
        ),
        ("sglang_url = 'localhost:30000'\n", ["sglang_url: 'localhost:30000' is not an http(s)"]),
        ("sglang_unit = '--force'\n", ["sglang_unit: '--force' is not a systemd service"]),
        ("sglang_unit = 'sglang'\n", ["sglang_unit: 'sglang' is not a systemd service"]),
        ("state_dir = 'state'\n", ["state_dir: 'state' must be an absolute path"]),
        ("metrics_listen_address = 'not an address'\n", ["metrics_listen_address: 'not an"]),
        (
            "max_steps = 'x'\nmin_dwell_s = -1\nfoo = 1\n",
            ["max_steps: expected an integer", "foo: unknown key", "min_dwell_s: Input"],
        ),
        ("max_steps = \n", ["invalid TOML: Invalid value (at line 1, column 13)"]),
        ("[[windows]\n", ["invalid TOML:"]),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    problems = info.value.problems
    assert len(problems) == len(expected), problems
    for want in expected:
        assert any(want in p for p in problems), (want, problems)
    assert all("\n" not in p for p in problems)


@pytest.mark.parametrize(
    ("text", "check"),
    [
        ("", lambda c: c == Config()),
        ("max_steps = 4\n", lambda c: c.max_steps == 4),
        ("scrape_interval_s = 2\n", lambda c: c.scrape_interval_s == 2.0),
        ("sglang_url = 'http://10.0.0.5:30000/'\n", lambda c: c.sglang_url.endswith(":30000")),
        ("metrics_listen_address = '::1'\n", lambda c: c.metrics_listen_address == "::1"),
        ("metrics_port = 0\n", lambda c: c.metrics_port == 0),
        (
            "[[windows]]\ncron = '0 2 * * sat,sun'\nduration_s = 7200\ntimezone = 'Europe/Berlin'\n"
            "[[windows]]\ncron = '30 22 * * mon-fri'\nduration_s = 1800\n",
            lambda c: [w.timezone for w in c.windows] == ["Europe/Berlin", "UTC"],
        ),
        (
            "min_steps = 2\nmax_steps = 5\n[[bands]]\nmax_concurrency = 2\nsteps = 5\n"
            "[[bands]]\nmax_concurrency = 8.5\nsteps = 4\n[[bands]]\nsteps = 2\n",
            lambda c: [b.steps for b in c.bands] == [5, 4, 2],
        ),
    ],
)
def test_good_config(tmp_path: Path, text: str, check: object) -> None:
    cfg = load_config(write(tmp_path, text))
    assert check(cfg)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("env", "check"),
    [
        ({"SPECD_MAX_STEPS": "4"}, lambda c: c.max_steps == 4),  # overrides the file's 5
        ({"SPECD_SGLANG_UNIT": "llm.service"}, lambda c: c.sglang_unit == "llm.service"),
        (
            {"SPECD_WINDOWS": '[{"cron": "0 4 * * sat", "duration_s": 60}]'},
            lambda c: c.windows == [Window(cron="0 4 * * sat", duration_s=60)],
        ),
        ({"SPECD_SPEC_STEPS": "3"}, lambda c: c.max_steps == 5),  # the SGLang unit's, ignored
    ],
)
def test_environment_overrides_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], check: object
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = load_config(write(tmp_path, "max_steps = 5\n"))
    assert check(cfg)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SPECD_MAX_STEPS": "six"}, "max_steps: Input should be a valid integer"),
        ({"SPECD_MAX_STEPS": "3"}, "bands[0].steps: 4 is outside"),
        ({"SPECD_MAX_STEP": "4"}, "SPECD_MAX_STEP: unknown setting in the environment"),
        ({"SPECD_WINDOWS": "[{oops"}, "SPECD_WINDOWS: not valid JSON"),
        ({"SPECD_WINDOWS": '[{"cron": "0 4 * * 6", "duration_s": 60}]'}, "windows[0].cron:"),
    ],
)
def test_bad_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, ""))
    assert len(info.value.problems) == 1
    assert expected in info.value.problems[0]


def test_env_problem_says_which_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECD_MAX_STEPS", "six")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, ""))
    assert info.value.problems[0].endswith("(set by SPECD_MAX_STEPS)")


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "missing.toml", "cannot read the file: No such file or directory"),
        (lambda d: d, "cannot read the file: Is a directory"),
        (lambda d: (d / "b.toml", (d / "b.toml").write_bytes(b"\xff\xfe"))[0], "not UTF-8"),
        (
            lambda d: (d / "big.toml", (d / "big.toml").write_bytes(b"#" * (2 << 20)))[0],
            "larger than",
        ),
    ],
)
def test_unreadable_file(tmp_path: Path, make: object, expected: str) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [info.value.problems[0]]
    assert expected in info.value.problems[0]
    assert info.value.path == path


def test_missing_default_file_means_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("specd.io.config.DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    assert load_config(None) == Config()


def test_check_config_prints_a_loadable_effective_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write(tmp_path, "max_steps = 5\n[[windows]]\ncron = '0 1 * * sun'\nduration_s = 60\n")
    monkeypatch.setenv("SPECD_MIN_STEPS", "2")
    assert main(["check-config", "--config", str(source)]) == 0
    out = capsys.readouterr().out
    assert "overridden by environment: SPECD_MIN_STEPS" in out
    monkeypatch.delenv("SPECD_MIN_STEPS")
    printed = tmp_path / "printed.toml"
    printed.write_text(out)
    reloaded = load_config(printed)
    assert (reloaded.min_steps, reloaded.max_steps) == (2, 5)
    assert reloaded == load_config(source).model_copy(update={"min_steps": 2})

    assert main(["check-config", str(source), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["windows"] == [{"cron": "0 1 * * sun", "duration_s": 60.0, "timezone": "UTC"}]
    assert data["bands"] == [{"max_concurrency": 4.0, "steps": 4}, {"steps": 3}]


def test_check_config_bad_file_exits_2_one_line_per_problem(tmp_path: Path) -> None:
    path = write(tmp_path, "max_step = 4\n[[windows]]\ncron = '0 3 * * 7'\nduration_s = 0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "check-config", "--config", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SPECD_")},
    )
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 3, proc.stderr
    assert all(line.startswith(f"{path}: ") for line in lines)
    assert {line.split(": ")[1] for line in lines} == {
        "max_step",
        "windows[0].cron",
        "windows[0].duration_s",
    }
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_check_config_path_given_twice_differently(tmp_path: Path) -> None:
    a, b = write(tmp_path, ""), tmp_path / "other.toml"
    assert main(["check-config", str(a), "--config", str(b)]) == 2


CALIBRATION = "steps,concurrency,output_tok_s\n3,1,230\n4,1,280\n"


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([], "bands"),
        (["calibration_file = '{cal}'"], "model"),
        (["calibration_file = '{cal}'", "policy = 'bands'"], "bands"),
        (["policy = 'model'"], "model"),
    ],
)
def test_policy_defaults_to_model_once_a_calibration_is_configured(
    tmp_path: Path, lines: list[str], expected: str
) -> None:
    cal = tmp_path / "cal.csv"
    cal.write_text(CALIBRATION)
    path = write(tmp_path, "\n".join(line.format(cal=cal) for line in lines) + "\n")
    assert load_config(path).policy == expected


@pytest.mark.parametrize(
    ("content", "value", "problem"),
    [
        (None, "/nonexistent/cal.csv", "cannot read"),
        ("steps,concurrency\n1,1\n", "{cal}", "header must be"),
        ("steps,concurrency,output_tok_s\n0,1,100\n", "{cal}", "no speculative step count"),
        (CALIBRATION, "relative.csv", "must be an absolute path"),
    ],
)
def test_a_bad_calibration_file_is_one_line(
    tmp_path: Path, content: str | None, value: str, problem: str
) -> None:
    cal = tmp_path / "cal.csv"
    if content is not None:
        cal.write_text(content)
    path = write(tmp_path, f"calibration_file = '{value.format(cal=cal)}'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("calibration_file: ")
    assert problem in info.value.problems[0]


@pytest.mark.parametrize(
    ("text", "ok"), [("restart_cost_s = 0", True), ("restart_cost_s = -1", False)]
)
def test_restart_cost_is_a_non_negative_number_of_seconds(
    tmp_path: Path, text: str, ok: bool
) -> None:
    path = write(tmp_path, text + "\n")
    if ok:
        assert load_config(path).restart_cost_s == 0
    else:
        with pytest.raises(ConfigError, match="restart_cost_s"):
            load_config(path)
