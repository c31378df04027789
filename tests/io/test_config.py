from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pydantic
import pytest
import tomli_w
from factories import run_specd, without_specd_env
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python as to_jsonable

from specd.cli import main
from specd.core.settings import (
    MAX_BANDS,
    MAX_WINDOWS,
    RENAMED_KEYS,
    TABLE_OF_KEY,
    TABLES,
    ChooseSettings,
    Settings,
)
from specd.io.apply import ENV_DRAFT_TOKENS, ENV_STEPS
from specd.io.config import (
    ENV_PREFIX,
    Band,
    Config,
    ConfigError,
    Window,
    config_to_dict,
    load_config,
    shadowed_in_file,
    shadowed_keys,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "etc" / "specd" / "specd.toml"
INSTALLED = REPO / "specd" / "data" / "install" / "etc" / "specd" / "specd.toml"


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
    assert cfg.sglang.url == "http://127.0.0.1:30000"
    assert cfg.sglang.unit == "sglang.service"
    assert cfg.sglang.env_file == Path("/var/lib/specd/sglang.env")
    assert cfg.files.state_dir == Path("/var/lib/specd")
    assert cfg.files.override_file == Path("/etc/specd/override.toml")
    assert (cfg.choose.min_steps, cfg.choose.max_steps) == (1, 6)
    assert cfg.sglang.apply_mode == "static-topk1"
    assert cfg.choose.policy == "bands"
    assert cfg.bands == [Band(max_concurrency=4, steps=4), Band(steps=3)]
    assert cfg.windows == [Window(cron="0 3 * * mon-sun", duration_s=3600, timezone="UTC")]
    assert cfg.restart.health_probe_timeout_s == 30
    assert cfg.restart.restart_command_timeout_s == 420
    assert cfg.report.metrics_listen_address == "127.0.0.1"
    assert cfg.report.metrics_port == 9464
    assert cfg.report.log_format == "json"


def test_every_field_is_declared_once_with_a_description() -> None:
    seen: dict[str, str] = {}
    for table, model in TABLES.items():
        for name, field in model.model_fields.items():
            assert field.description, f"{table}.{name} has no description"
            assert name not in seen, f"{name} in [{table}] and [{seen[name]}]"
            seen[name] = table
    for model in (Band, Window):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
    assert set(Config.model_fields) == set(TABLES) | {"bands", "windows"}


def test_durations_and_ratios_have_an_upper_bound() -> None:
    for table, model in TABLES.items():
        for name, field in model.model_fields.items():
            if name.endswith(("_s", "_ratio")) and field.annotation is float:
                bounded = any(hasattr(m, "le") or hasattr(m, "lt") for m in field.metadata)
                assert bounded, f"{table}.{name} has no upper bound"


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(pydantic.ValidationError):
        cfg.choose.max_steps = 3  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        cfg.choose = ChooseSettings()  # type: ignore[misc]


# Tables whose absence turns a feature off, and the keys each needs when present.
OPTIONAL_TABLES: dict[str, dict[str, Any]] = {
    "gateway": {"urls": ["http://127.0.0.1:30080"]},
    "fleet": {"etcd_endpoints": ["http://127.0.0.1:2379"], "group": "g"},
}


def test_example_file_lists_every_option_in_its_table_and_is_valid() -> None:
    data = tomllib.loads(EXAMPLE.read_text())
    text = EXAMPLE.read_text()
    optional = {t for t in TABLES if Settings.model_fields[t].default is None}
    assert optional == set(OPTIONAL_TABLES)
    for table, model in TABLES.items():
        # An optional table (absent: the feature is off) is shown commented out.
        header = f"\n[{table}]\n" if table not in OPTIONAL_TABLES else f"\n# [{table}]\n"
        assert header in text, f"{header.strip()} not in {EXAMPLE}"
        section = text.split(header, 1)[1].split("\n[", 1)[0].split("\n# [", 1)[0]
        for name in model.model_fields:
            # Options without a default value (calibration_file) or whose default depends on
            # another (policy) are shown commented out.
            listed = (f"\n{name} = ", f"\n# {name} = ")
            assert any(form in section for form in listed), f"{table}.{name} not in {EXAMPLE}"
    assert "bands" in data
    assert "windows" in data
    assert config_to_dict(load_config(EXAMPLE)) == config_to_dict(Config())


def test_example_is_the_installed_copy() -> None:
    assert INSTALLED.read_text() == EXAMPLE.read_text()


def test_example_passes_check_config_as_a_real_process() -> None:
    proc = run_specd("check-config", str(EXAMPLE), env=without_specd_env())
    assert proc.returncode == 0, proc.stderr
    assert '[sglang]\nurl = "http://127.0.0.1:30000"\nunit = "sglang.service"' in proc.stdout


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[choose]\nmax_step = 4\n", ["choose.max_step: unknown key"]),
        ("[chose]\nmax_steps = 4\n", ["chose: unknown key"]),
        ("[[windows]]\ncron = '0 3 * * *'\nduration_s = 60\nzone = 'UTC'\n", ["windows[0].zone:"]),
        ('[choose]\nmax_steps = "six"\n', ["choose.max_steps: expected an integer, got str 'six'"]),
        ('[choose]\nmax_steps = "6"\n', ["choose.max_steps: expected an integer"]),
        ("[choose]\nmin_steps = true\n", ["choose.min_steps: expected an integer, got bool"]),
        ("[observe]\nscrape_interval_s = '5'\n", ["observe.scrape_interval_s: expected a number"]),
        ("[sglang]\nurl = 5\n", ["sglang.url: expected a string"]),
        ("windows = 'daily'\n", ["windows: expected an array of tables"]),
        ("observe = 5\n", ["observe: expected a table ([observe]), got int 5"]),
        ("[choose]\npolicy = 'magic'\n", ["choose.policy: Input should be 'bands' or 'model'"]),
        # The item only, not also pydantic's count of the items that validated ("not 0").
        (
            "[choose]\nkinds = ['statc']\n",
            ["choose.kinds[0]: Input should be 'off', 'static' or 'adaptive' (got 'statc')"],
        ),
        ("[choose]\nmin_steps = 5\nmax_steps = 3\n", ["choose: min_steps (5) > max_steps (3)"]),
        (
            "[choose]\nmax_steps = 17\n",
            ["choose.max_steps: Input should be less than or equal to 16"],
        ),
        ("[choose]\nmin_steps = 0\n", ["choose.min_steps: Input should be greater than or equal"]),
        (
            "[choose]\nmax_steps = 3\n",
            ["bands[0].steps: 4 is outside choose.min_steps..max_steps (1..3)"],
        ),
        (
            "[[bands]]\nmax_concurrency = 8\nsteps = 4\n[[bands]]\nmax_concurrency = 4\n"
            "steps = 3\n[[bands]]\nsteps = 3\n",
            ["bands: max_concurrency must strictly increase"],
        ),
        ("[[bands]]\nsteps = 3\n[[bands]]\nsteps = 4\n", ["bands: exactly one band, the last"]),
        ("[[bands]]\nmax_concurrency = 4\nsteps = 4\n", ["bands: exactly one band, the last"]),
        ("bands = []\n", ["bands: at least one band"]),
        ("[restart]\nhealth_probe_timeout_s = 20\n", ["restart.health_probe_timeout_s: Input"]),
        ("[restart]\nmin_dwell_s = -1\n", ["restart.min_dwell_s: Input should be greater than or"]),
        (
            "[observe]\nscrape_interval_s = 0\n",
            ["observe.scrape_interval_s: Input should be greater"],
        ),
        (
            "[choose]\ntolerance_ratio = 1.5\n",
            ["choose.tolerance_ratio: Input should be less than 1"],
        ),
        ("[report]\nmetrics_port = 70000\n", ["report.metrics_port: Input should be less than or"]),
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
        (
            "[sglang]\nurl = 'localhost:30000'\n",
            ["sglang.url: 'localhost:30000' is not an http(s)"],
        ),
        ("[sglang]\nunit = '--force'\n", ["sglang.unit: '--force' is not a systemd service"]),
        ("[sglang]\nunit = 'sglang'\n", ["sglang.unit: 'sglang' is not a systemd service"]),
        ("[files]\nstate_dir = 'state'\n", ["files.state_dir: 'state' must be an absolute path"]),
        # A trailing newline passed `^...$` with re.match (a polkit rule for no unit).
        (
            '[sglang]\nunit = "sglang.service\\n"\n',
            ["sglang.unit: 'sglang.service\\n' is not a systemd service"],
        ),
        ("[sglang]\nunit = 'sglang@.service'\n", ["sglang.unit: 'sglang@.service' is not a"]),
        # Under state_dir, an adaptive set's config file reaches SGLang's command line
        # through the env file: systemd takes quotes and backslashes away, expands $.
        *(
            (
                f"[files]\nstate_dir = '{bad}'\n",
                [f"files.state_dir: {bad!r} holds a space, quote, backslash, $ or control"],
            )
            for bad in ('/var/lib/sp"ecd --api-key x', "/var/lib/sp\\ecd", "/var/lib/$HOME")
        ),
        (
            "[report]\nmetrics_listen_address = 'not an address'\n",
            ["report.metrics_listen_address"],
        ),
        (
            "foo = 1\n[choose]\nmax_steps = 'x'\n[restart]\nmin_dwell_s = -1\n",
            ["choose.max_steps: expected an integer", "foo: unknown key", "restart.min_dwell_s:"],
        ),
        ("max_steps = \n", ["invalid TOML: Invalid value (at line 1, column 13)"]),
        ("[[windows]\n", ["invalid TOML:"]),
        (
            "[fleet]\netcd_endpoints = ['http://127.0.0.1:2379/v3']\ngroup = 'g'\n",
            ["fleet.etcd_endpoints: 'http://127.0.0.1:2379/v3': an etcd endpoint is"],
        ),
        (
            "[fleet]\netcd_endpoints = ['http://127.0.0.1:2379?x=1']\ngroup = 'g'\n",
            ["fleet.etcd_endpoints: 'http://127.0.0.1:2379?x=1': an etcd endpoint is"],
        ),
        (
            "[fleet]\netcd_endpoints = ['http://127.0.0.1:2379', 'http://127.0.0.1:2379/']\n"
            "group = 'g/h'\n",
            ["fleet.etcd_endpoints: each etcd endpoint may be listed once", "fleet.group:"],
        ),
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


# Every key of the flat config before the tables, at the top level, and keys in another
# table than their own: one line naming the table.
FLAT_KEYS = sorted(set(TABLE_OF_KEY) - {"url", "unit"} | set(RENAMED_KEYS))


@pytest.mark.parametrize("key", FLAT_KEYS)
def test_a_flat_key_at_the_top_level_is_told_its_table(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, f"{key} = 1\n"))
    if key in RENAMED_KEYS:
        table, new = RENAMED_KEYS[key]
        assert info.value.problems == [f"`{key}` is now `{new}` in [{table}]"]
    else:
        assert info.value.problems == [f"`{key}` belongs in [{TABLE_OF_KEY[key]}]"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("scrape_interval_s = 5\n", "`scrape_interval_s` belongs in [observe]"),
        ("sglang_url = 'http://h:1'\n", "`sglang_url` is now `url` in [sglang]"),
        ("[observe]\nmin_steps = 2\n", "observe.min_steps: `min_steps` belongs in [choose]"),
        ("[choose]\nsglang_unit = 'a.service'\n", "choose.sglang_unit: `sglang_unit` is now"),
        ("[restart]\nbands = []\n", "restart.bands: `bands` is an array at the top level"),
        ("[sglang]\nstate_dir = '/x'\n", "sglang.state_dir: `state_dir` belongs in [files]"),
    ],
)
def test_a_key_in_the_wrong_table_is_told_its_table(
    tmp_path: Path, text: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(expected), info.value.problems


def test_misplaced_keys_do_not_hide_other_problems(tmp_path: Path) -> None:
    text = "max_steps = 4\n[observe]\nscrape_interval_s = inf\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.problems == [
        "`max_steps` belongs in [choose]",
        "observe.scrape_interval_s: Input should be a finite number (got inf)",
    ]


@pytest.mark.parametrize(
    ("table", "key", "value"),
    [
        ("observe", "scrape_interval_s", "inf"),
        ("observe", "history_half_life_s", "inf"),
        ("observe", "stale_after_s", "inf"),
        ("observe", "scrape_timeout_s", "nan"),
        ("observe", "min_history_s", "1e300"),
        ("observe", "warmup_exclude_s", "-inf"),
        ("choose", "restart_cost_s", "inf"),
        ("choose", "stabilization_window_s", "1e300"),
        ("choose", "tolerance_ratio", "nan"),
        ("choose", "band_quantile_ratio", "inf"),
        ("restart", "startup_timeout_s", "inf"),
        ("restart", "restart_command_timeout_s", "1e300"),
        ("restart", "quiet_deadline_s", "inf"),
        ("restart", "min_dwell_s", "1e300"),
        ("restart", "health_probe_timeout_s", "inf"),
    ],
)
def test_non_finite_or_absurd_durations_are_one_line(
    tmp_path: Path, table: str, key: str, value: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, f"[{table}]\n{key} = {value}\n"))
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(f"{table}.{key}: "), info.value.problems


@pytest.mark.parametrize(
    "text",
    [
        "[[windows]]\ncron = '0 3 * * mon'\nduration_s = inf\n",
        "[[windows]]\ncron = '0 3 * * mon'\nduration_s = 1e300\n",
        "[[bands]]\nmax_concurrency = inf\nsteps = 4\n[[bands]]\nsteps = 3\n",
        "[[bands]]\nmax_concurrency = nan\nsteps = 4\n[[bands]]\nsteps = 3\n",
    ],
)
def test_non_finite_values_in_the_arrays_are_rejected(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(("windows[0].duration_s", "bands[0].max_")), (
        info.value.problems
    )


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[files]\nstate_dir = "/var/lib/a\\u0000b"\n', "files.state_dir"),
        ('[files]\noverride_file = "/etc/specd/o\\u0000.toml"\n', "files.override_file"),
        ('[sglang]\nenv_file = "/var/lib/specd/\\u0000"\n', "sglang.env_file"),
        ('[sglang]\nunit = "sglang\\u0000.service"\n', "sglang.unit"),
        ('[sglang]\nspeculative_algorithm = "EAGLE\\u0000"\n', "sglang.speculative_algorithm"),
        ('[choose]\ncalibration_file = "/tmp/c\\u0000.csv"\n', "choose.calibration_file"),
        (
            "[[windows]]\ncron = '0 3 * * *'\nduration_s = 3600\ntimezone = \"UTC\\u0000\"\n",
            "windows[0].timezone",
        ),
    ],
)
def test_a_nul_in_any_string_is_one_line_not_a_crash_later(
    tmp_path: Path, text: str, key: str
) -> None:
    """TOML allows "\\u0000"; os and subprocess raise on it. It once passed check-config
    and ended `specd run` (or a reload's next tick) with a traceback."""
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.problems == [f"{key}: holds a NUL character (\\u0000)"]


# The keys an optional table cannot do without, so one key can be tried in it alone.


def test_minimal_lists_every_table_with_required_keys() -> None:
    for table, model in TABLES.items():
        required = {n for n, f in model.model_fields.items() if f.is_required()}
        assert required == set(OPTIONAL_TABLES.get(table, {})), table
        if required:
            assert getattr(load_config_text({table: OPTIONAL_TABLES[table]}), table) is not None
    # As in the example file: [fleet] with every key commented out is no fleet.
    assert load_config_text({"fleet": {}}).fleet is None


def load_config_text(data: dict[str, Any]) -> Config:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "specd.toml"
        path.write_text(tomli_w.dumps(data))
        return load_config(path)


BOUNDED = [
    (table, name, field)
    for table, model in TABLES.items()
    for name, field in model.model_fields.items()
    if field.annotation is float
]


@settings(max_examples=60, deadline=None)
@given(
    where=st.sampled_from(BOUNDED),
    value=st.floats(allow_nan=True, allow_infinity=True),
)
def test_a_float_setting_loads_only_when_finite_and_in_bounds(
    where: tuple[str, str, FieldInfo], value: float
) -> None:
    table, name, field = where
    inside = math.isfinite(value)
    for limit in field.metadata:
        for attr, ok in (
            ("gt", float.__gt__),
            ("ge", float.__ge__),
            ("lt", float.__lt__),
            ("le", float.__le__),
        ):
            if hasattr(limit, attr):
                inside = inside and ok(float(value), float(getattr(limit, attr)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "specd.toml"
        path.write_text(tomli_w.dumps({table: {**OPTIONAL_TABLES.get(table, {}), name: value}}))
        problems: list[str] = []
        loaded: Config | None = None
        try:
            loaded = load_config(path)
        except ConfigError as exc:
            problems = exc.problems
    if inside:
        assert loaded is not None, problems
        assert getattr(getattr(loaded, table), name) == value
    else:
        assert len(problems) == 1, problems
        assert problems[0].startswith(f"{table}.{name}: ")


def windows_text(count: int, cron: str = "{i} 3 * * mon") -> str:
    return "".join(
        f"[[windows]]\ncron = '{cron.format(i=i % 60)}'\nduration_s = 60\n" for i in range(count)
    )


def bands_text(count: int) -> str:
    """``count`` - 1 bands with a max_concurrency: the catch-all is the caller's."""
    return "".join(f"[[bands]]\nmax_concurrency = {i + 1}\nsteps = 3\n" for i in range(count - 1))


WINDOWS_WHY = "each is read at every tick; one cron covers several days, as '0 3 * * mon-fri'"
ENDPOINTS = [f"http://10.0.0.{i}:2379" for i in range(1, 18)]


# Each window is read at every tick: 1,440 took 25 s a tick, a few thousand outlasted
# WatchdogSec= at every one, and the config that did so validated.
@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        (
            windows_text(MAX_WINDOWS + 1),
            {},
            [f"windows: {MAX_WINDOWS + 1} windows; at most {MAX_WINDOWS} ({WINDOWS_WHY})"],
        ),
        # Refused before each is read: one line, not one per bad cron.
        (
            windows_text(2000, "0 3 * * 1"),
            {},
            [f"windows: 2000 windows; at most {MAX_WINDOWS} ({WINDOWS_WHY})"],
        ),
        (
            "# every default\n",
            {"SPECD_WINDOWS": json.dumps([{"cron": "0 3 * * sat", "duration_s": 60}] * 40)},
            [f"windows: 40 windows; at most {MAX_WINDOWS} ({WINDOWS_WHY}) (set by SPECD_WINDOWS)"],
        ),
        (
            bands_text(MAX_BANDS + 1) + "[[bands]]\nsteps = 3\n",
            {},
            [
                f"bands: {MAX_BANDS + 1} bands; at most {MAX_BANDS} (a band per step count is "
                "the most needed)"
            ],
        ),
        (
            "[choose]\nkinds = ['off', 'static', 'adaptive', 'static']\n",
            {},
            ["choose.kinds: 4 kinds; at most 3 (off, static and adaptive, each once)"],
        ),
        # A list bounded before: the count, not the whole list again on the same line.
        (
            tomli_w.dumps({"fleet": {"etcd_endpoints": ENDPOINTS, "group": "g"}}),
            {},
            ["fleet.etcd_endpoints: List should have at most 16 items after validation, not 17"],
        ),
    ],
)
def test_a_list_past_its_bound_is_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    env: dict[str, str],
    expected: list[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert info.value.problems == expected


def test_as_many_as_the_bound_load(tmp_path: Path) -> None:
    text = windows_text(MAX_WINDOWS) + bands_text(MAX_BANDS) + "[[bands]]\nsteps = 3\n"
    loaded = load_config(write(tmp_path, text))
    assert (len(loaded.windows), len(loaded.bands)) == (MAX_WINDOWS, MAX_BANDS)


LISTS = [(table, name) for table, model in TABLES.items() for name in model.model_fields] + [
    (name, None) for name in ("bands", "windows")
]


@pytest.mark.parametrize(
    ("table", "name"),
    [
        (table, name)
        for table, name in LISTS
        if name is None
        or getattr(TABLES[table].model_fields[name].annotation, "__origin__", None) in (list, tuple)
    ],
)
def test_every_list_setting_is_bounded(tmp_path: Path, table: str, name: str | None) -> None:
    """A list as long as a config file holds is one line naming its bound, for each list a
    setting takes, also one added later."""
    if name is None:
        item = to_jsonable(Settings.model_fields[table].get_default(call_default_factory=True))[0]
        data: dict[str, Any] = {table: [item] * 100}
    else:
        field = TABLES[table].model_fields[name]
        items = (
            OPTIONAL_TABLES[table][name]
            if field.is_required()
            else field.get_default(call_default_factory=True)
        )
        values = {**OPTIONAL_TABLES.get(table, {}), name: [items[0]] * 100}
        data = {table: values}
    where = table if name is None else f"{table}.{name}"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, tomli_w.dumps(data)))
    [problem] = info.value.problems
    assert problem.startswith(f"{where}: "), problem
    assert "at most" in problem, problem
    assert len(problem) < 200, problem


def test_a_utf8_bom_is_named(tmp_path: Path) -> None:
    path = tmp_path / "specd.toml"
    path.write_bytes(b"\xef\xbb\xbf[choose]\nmax_steps = 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        "starts with a UTF-8 byte order mark (BOM); save the file as UTF-8 without BOM"
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (b"", "the file is empty (0 bytes)"),
        (b"\n \t\r\n", "the file is only whitespace (5 bytes)"),
    ],
)
def test_an_empty_config_file_stops_check_config_and_the_start_in_one_line(
    tmp_path: Path, text: bytes, problem: str
) -> None:
    """TOML reads an empty file as no keys, so specd took it as every default: a start (or a
    reload) in the middle of `cp new.toml specd.toml` ran on another SGLang URL, unit and
    windows. A file of comments only is still every default (test_good_config)."""
    path = tmp_path / "specd.toml"
    path.write_bytes(text)
    # Were the file taken as defaults, `specd run` would stay up on these, not on /var/lib.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    env |= {
        "SPECD_FILES__STATE_DIR": str(tmp_path),
        "SPECD_REPORT__METRICS_PORT": "0",
        "SPECD_SGLANG__URL": "http://127.0.0.1:9",
    }
    said = (
        f"{path}: {problem}, perhaps half written: write the keys you set, or a comment line "
        "(# defaults) to keep every default"
    )
    for command in ("check-config", "run"):
        proc = run_specd(command, "--config", str(path), env=env)
        assert (proc.returncode, proc.stderr.splitlines(), proc.stdout) == (2, [said], "")


def test_check_config_names_the_bom_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "specd.toml"
    path.write_bytes(b"\xef\xbb\xbf\n")
    proc = run_specd("check-config", str(path), env=without_specd_env())
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"{path}: starts with a UTF-8 byte order mark (BOM); "
                                        "save the file as UTF-8 without BOM"]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "check"),
    [
        ("# every default\n", lambda c: c == Config()),  # comments only: said on purpose
        ("[choose]\nmax_steps = 4\n", lambda c: c.choose.max_steps == 4),
        ("[observe]\nscrape_interval_s = 2\n", lambda c: c.observe.scrape_interval_s == 2.0),
        ("[sglang]\nurl = 'http://10.0.0.5:30000/'\n", lambda c: c.sglang.url.endswith(":30000")),
        (
            "[report]\nmetrics_listen_address = '::1'\n",
            lambda c: c.report.metrics_listen_address == "::1",
        ),
        ("[report]\nmetrics_port = 0\n", lambda c: c.report.metrics_port == 0),
        (
            "[restart]\nrestart_command_timeout_s = 86400\n",
            lambda c: c.restart.restart_command_timeout_s == 86400,
        ),
        (
            "[[windows]]\ncron = '0 2 * * sat,sun'\nduration_s = 7200\ntimezone = 'Europe/Berlin'\n"
            "[[windows]]\ncron = '30 22 * * mon-fri'\nduration_s = 1800\n",
            lambda c: [w.timezone for w in c.windows] == ["Europe/Berlin", "UTC"],
        ),
        (
            "[choose]\nmin_steps = 2\nmax_steps = 5\n[[bands]]\nmax_concurrency = 2\nsteps = 5\n"
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
        ({"SPECD_CHOOSE__MAX_STEPS": "4"}, lambda c: c.choose.max_steps == 4),  # over the 5
        ({"specd_choose__max_steps": "4"}, lambda c: c.choose.max_steps == 4),  # any case
        ({"SPECD_SGLANG__UNIT": "llm.service"}, lambda c: c.sglang.unit == "llm.service"),
        (
            {"SPECD_OBSERVE__SCRAPE_INTERVAL_S": "7"},
            lambda c: (c.observe.scrape_interval_s, c.choose.max_steps) == (7, 5),
        ),
        (
            # A whole table as JSON, merged with the file's table.
            {"SPECD_RESTART": '{"min_dwell_s": 60}'},
            lambda c: (c.restart.min_dwell_s, c.choose.max_steps) == (60, 5),
        ),
        (
            {"SPECD_WINDOWS": '[{"cron": "0 4 * * sat", "duration_s": 60}]'},
            lambda c: c.windows == [Window(cron="0 4 * * sat", duration_s=60)],
        ),
    ],
)
def test_environment_overrides_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], check: object
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = load_config(write(tmp_path, "[choose]\nmax_steps = 5\n"))
    assert check(cfg)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SPECD_CHOOSE__MAX_STEPS": "six"}, "choose.max_steps: Input should be a valid integer"),
        ({"SPECD_CHOOSE__MAX_STEPS": "3"}, "bands[0].steps: 4 is outside"),
        ({"SPECD_OBSERVE__STALE_AFTER_S": "inf"}, "observe.stale_after_s: Input should be a"),
        (
            {"SPECD_CHOOSE__MAX_STEP": "4"},
            "SPECD_CHOOSE__MAX_STEP: unknown setting in the environment (check the spelling)",
        ),
        (
            {"SPECD_MAX_STEPS": "4"},
            "SPECD_MAX_STEPS: unknown setting in the environment; `max_steps` belongs in "
            "[choose]: use SPECD_CHOOSE__MAX_STEPS",
        ),
        (
            {"SPECD_SGLANG_URL": "http://h:1"},
            "SPECD_SGLANG_URL: unknown setting in the environment; `sglang_url` is now `url` in "
            "[sglang]: use SPECD_SGLANG__URL",
        ),
        (
            {"SPECD_OBSERVE__MIN_STEPS": "2"},
            "SPECD_OBSERVE__MIN_STEPS: unknown setting in the environment; `min_steps` belongs "
            "in [choose]: use SPECD_CHOOSE__MIN_STEPS",
        ),
        # The old names of the SGLang unit's variables share the prefix no more.
        ({"SPECD_SPEC_STEPS": "3"}, "SPECD_SPEC_STEPS: unknown setting in the environment"),
        ({"SPECD_WINDOWS": "[{oops"}, "SPECD_WINDOWS: not valid JSON (Expecting property name"),
        # Nested thousands deep: json.loads raised RecursionError, a traceback.
        ({"SPECD_WINDOWS": "[" * 5000}, "SPECD_WINDOWS: not valid JSON (nested deeper than 64"),
        ({"SPECD_CHOOSE": '{"a":' * 5000}, "SPECD_CHOOSE: not valid JSON (nested deeper than 64"),
        # The variable itself, not its table (SPECD_CHOOSE), and what a list looks like.
        (
            {"SPECD_CHOOSE__KINDS": "static"},
            "SPECD_CHOOSE__KINDS: not valid JSON; a list must be JSON, such as "
            "SPECD_CHOOSE__KINDS='[\"static\"]'",
        ),
        (
            {"SPECD_CHOOSE": "static"},
            "SPECD_CHOOSE: not valid JSON; a table must be a JSON object, such as "
            "SPECD_CHOOSE='{\"min_steps\": 1}'",
        ),
        ({"SPECD_WINDOWS": '[{"cron": "0 4 * * 6", "duration_s": 60}]'}, "windows[0].cron:"),
    ],
)
def test_bad_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "# every default\n"))
    assert len(info.value.problems) == 1, info.value.problems
    assert expected in info.value.problems[0]


def test_every_variable_that_is_not_json_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECD_CHOOSE__KINDS", "static")
    monkeypatch.setenv("SPECD_FLEET__ETCD_ENDPOINTS", "http://10.0.0.5:2379")
    monkeypatch.setenv("SPECD_CHOOSE__MAX_STEPS", "4")  # a number: not JSON to parse
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "# every default\n"))
    assert info.value.problems == [
        "SPECD_CHOOSE__KINDS: not valid JSON; a list must be JSON, such as "
        "SPECD_CHOOSE__KINDS='[\"static\"]'",
        "SPECD_FLEET__ETCD_ENDPOINTS: not valid JSON; a list must be JSON, such as "
        "SPECD_FLEET__ETCD_ENDPOINTS='[\"http://10.0.0.5:2379\"]'",
    ]


def test_the_sglang_unit_variables_do_not_share_the_settings_prefix() -> None:
    assert not ENV_STEPS.startswith(ENV_PREFIX)
    assert not ENV_DRAFT_TOKENS.startswith(ENV_PREFIX)


def test_env_problem_says_which_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECD_CHOOSE__MAX_STEPS", "six")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "# every default\n"))
    assert info.value.problems[0].endswith("(set by SPECD_CHOOSE__MAX_STEPS)")


# The environment wins over the file: an edit to a key a SPECD_* variable also sets did
# nothing, and a reload said "changed: {}". Each such key of the file, with its variable.
@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        (
            "[choose]\nmax_steps = 6\nmin_steps = 2\n",
            {"SPECD_CHOOSE__MAX_STEPS": "4"},
            [("choose.max_steps", "SPECD_CHOOSE__MAX_STEPS")],
        ),
        # Any case, named as the environment spells it.
        (
            "[choose]\nmax_steps = 6\n",
            {"specd_choose__max_steps": "4"},
            [("choose.max_steps", "specd_choose__max_steps")],
        ),
        # A key the file leaves out is the variable's alone: nothing to shadow.
        ("[choose]\nmax_steps = 6\n", {"SPECD_CHOOSE__MIN_STEPS": "2"}, []),
        ("[choose]\nmax_steps = 6\n", {"SPECD_OBSERVE__SCRAPE_INTERVAL_S": "7"}, []),
        # A table's variable overrides the keys its JSON names, not the rest of the table.
        (
            "[restart]\nmin_dwell_s = 10\ndaily_restart_budget = 2\n",
            {"SPECD_RESTART": '{"min_dwell_s": 60}'},
            [("restart.min_dwell_s", "SPECD_RESTART")],
        ),
        # A key's own variable wins over its table's, as pydantic-settings reads them.
        (
            "[choose]\nmax_steps = 6\n",
            {"SPECD_CHOOSE": '{"max_steps": 5}', "SPECD_CHOOSE__MAX_STEPS": "4"},
            [("choose.max_steps", "SPECD_CHOOSE__MAX_STEPS")],
        ),
        # Not an object: the whole table goes (SPECD_GATEWAY=null is no gateway).
        (
            "[gateway]\nurls = ['http://127.0.0.1:30080']\nrequest_timeout_s = 3.0\n",
            {"SPECD_GATEWAY": "null"},
            [("gateway.urls", "SPECD_GATEWAY"), ("gateway.request_timeout_s", "SPECD_GATEWAY")],
        ),
        # An array is replaced whole.
        (
            "[[windows]]\ncron = '0 3 * * sat'\nduration_s = 3600\n[[bands]]\nsteps = 3\n",
            {"SPECD_WINDOWS": '[{"cron": "0 4 * * sat", "duration_s": 60}]'},
            [("windows", "SPECD_WINDOWS")],
        ),
        # In the file's order.
        (
            "[observe]\nscrape_interval_s = 5.0\n[choose]\nmax_steps = 6\n",
            {"SPECD_CHOOSE__MAX_STEPS": "4", "SPECD_OBSERVE__SCRAPE_INTERVAL_S": "7"},
            [
                ("observe.scrape_interval_s", "SPECD_OBSERVE__SCRAPE_INTERVAL_S"),
                ("choose.max_steps", "SPECD_CHOOSE__MAX_STEPS"),
            ],
        ),
        # A key in the wrong table is a problem of its own, not shadowed.
        ("[observe]\nmax_steps = 6\n", {"SPECD_CHOOSE__MAX_STEPS": "4"}, []),
        # A variable that is not JSON sets nothing: the load refuses it.
        ("[restart]\nmin_dwell_s = 10\n", {"SPECD_RESTART": "{min_dwell_s"}, []),
        # Not SPECD_*: the SGLang unit's variables are no settings of specd's.
        ("[choose]\nmax_steps = 6\n", {"SPECULATIVE_NUM_STEPS": "4", "MAX_STEPS": "4"}, []),
    ],
)
def test_each_file_key_a_variable_overrides_is_named(
    tmp_path: Path, text: str, env: dict[str, str], expected: list[tuple[str, str]]
) -> None:
    path = write(tmp_path, text)
    assert shadowed_keys(tomllib.loads(text), env) == expected
    assert shadowed_in_file(path, env) == expected


def test_the_overridden_keys_of_the_default_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the daemon reloads it (no --config): the default file, in this process's environment.
    default = tmp_path / "specd.toml"
    monkeypatch.setattr("specd.io.config.DEFAULT_CONFIG_PATH", default)
    monkeypatch.setenv("SPECD_CHOOSE__MAX_STEPS", "4")
    assert shadowed_in_file(None) == []  # absent: nothing to shadow
    default.write_text("[choose]\nmax_steps = 6\n")
    [found] = shadowed_in_file(None)
    assert found == ("choose.max_steps", "SPECD_CHOOSE__MAX_STEPS")
    assert found.warning() == (
        "overridden by the environment variable SPECD_CHOOSE__MAX_STEPS: an edit to it in the "
        "file does nothing while the variable is set"
    )
    default.write_text("[choose]\nmax_steps = \n")  # not TOML: the load says so, not this
    assert shadowed_in_file(None) == []


# A check across keys (min_steps > max_steps, a band's steps outside them) named no variable
# when one of its keys came from the environment: the operator looked in the file for it.
@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        (
            "# every default\n",
            {"SPECD_CHOOSE__MAX_STEPS": "3"},
            "bands[0].steps: 4 is outside choose.min_steps..max_steps (1..3) "
            "(choose.max_steps set by SPECD_CHOOSE__MAX_STEPS)",
        ),
        (
            "[choose]\nmax_steps = 5\n",
            {"SPECD_CHOOSE__MIN_STEPS": "6"},
            "choose: min_steps (6) > max_steps (5) (choose.min_steps set by "
            "SPECD_CHOOSE__MIN_STEPS)",
        ),
        (
            "# every default\n",
            {"SPECD_CHOOSE": '{"min_steps": 6, "max_steps": 5}'},
            "choose: min_steps (6) > max_steps (5) "
            "(choose.min_steps, choose.max_steps set by SPECD_CHOOSE)",
        ),
        (
            "# every default\n",
            {"SPECD_BANDS": '[{"max_concurrency": 3, "steps": 3}]'},
            "bands: exactly one band, the last, must omit max_concurrency (the catch-all) "
            "(bands set by SPECD_BANDS)",
        ),
        (
            "# every default\n",
            {"SPECD_BANDS": '[{"steps": 9}]', "SPECD_CHOOSE__MAX_STEPS": "8"},
            "bands[0].steps: 9 is outside choose.min_steps..max_steps (1..8) "
            "(bands set by SPECD_BANDS, choose.max_steps set by SPECD_CHOOSE__MAX_STEPS)",
        ),
        # All from the file: no variable named, though one of another key is set.
        (
            "[choose]\nmax_steps = 3\n",
            {"SPECD_OBSERVE__SCRAPE_INTERVAL_S": "7"},
            "bands[0].steps: 4 is outside choose.min_steps..max_steps (1..3)",
        ),
        # The calibration's checks too.
        (
            "[choose]\ncalibration_file = '{cal}'\n",
            {"SPECD_CHOOSE__KINDS": '["off"]'},
            "choose.kinds: {cal} can predict none of ['off'] (off needs a steps-0 row, an "
            "adaptive set a row for each of its step counts) "
            "(choose.kinds set by SPECD_CHOOSE__KINDS)",
        ),
        (
            "[choose]\nkinds = ['off']\n",
            {"SPECD_CHOOSE__CALIBRATION_FILE": "{cal}"},
            "choose.kinds: {cal} can predict none of ['off'] (off needs a steps-0 row, an "
            "adaptive set a row for each of its step counts) "
            "(choose.calibration_file set by SPECD_CHOOSE__CALIBRATION_FILE)",
        ),
    ],
)
def test_a_check_across_keys_names_the_variable_that_set_one(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    env: dict[str, str],
    expected: str,
) -> None:
    cal = tmp_path / "cal.csv"
    cal.write_text(CALIBRATION)
    for name, value in env.items():
        monkeypatch.setenv(name, value.replace("{cal}", str(cal)))
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text.replace("{cal}", str(cal))))
    assert info.value.problems == [expected.replace("{cal}", str(cal))]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "missing.toml", "cannot read: No such file or directory"),
        # Only a regular file is read: a directory, FIFO or device is refused at once.
        (lambda d: d, "is not a regular file (a directory)"),
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
    source = write(
        tmp_path, "[choose]\nmax_steps = 5\n[[windows]]\ncron = '0 1 * * sun'\nduration_s = 60\n"
    )
    monkeypatch.setenv("SPECD_CHOOSE__MIN_STEPS", "2")
    assert main(["check-config", "--config", str(source)]) == 0
    out = capsys.readouterr().out
    assert "overridden by environment: SPECD_CHOOSE__MIN_STEPS" in out
    # Grouped: every table once, in the order of the example file.
    headers = [line for line in out.splitlines() if line.startswith("[")]
    assert headers == [
        "[sglang]",
        "[files]",
        "[observe]",
        "[choose]",
        "[restart]",
        "[report]",
        "[[bands]]",
        "[[bands]]",
        "[[windows]]",
    ]
    monkeypatch.delenv("SPECD_CHOOSE__MIN_STEPS")
    printed = tmp_path / "printed.toml"
    printed.write_text(out)
    reloaded = load_config(printed)
    assert (reloaded.choose.min_steps, reloaded.choose.max_steps) == (2, 5)
    source_config = load_config(source)
    choose = source_config.choose.model_copy(update={"min_steps": 2})
    assert reloaded == source_config.model_copy(update={"choose": choose})

    assert main(["check-config", str(source), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["windows"] == [{"cron": "0 1 * * sun", "duration_s": 60.0, "timezone": "UTC"}]
    assert data["bands"] == [{"max_concurrency": 4.0, "steps": 4}, {"steps": 3}]


def test_check_config_bad_file_exits_2_one_line_per_problem(tmp_path: Path) -> None:
    path = write(
        tmp_path, "[choose]\nmax_step = 4\n[[windows]]\ncron = '0 3 * * 7'\nduration_s = 0\n"
    )
    proc = run_specd("check-config", "--config", str(path), env=without_specd_env())
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 3, proc.stderr
    assert all(line.startswith(f"{path}: ") for line in lines)
    assert {line.split(": ")[1] for line in lines} == {
        "choose.max_step",
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
        (["policy = 'bands'", "calibration_file = '{cal}'"], "bands"),
        (["policy = 'model'"], "model"),
    ],
)
def test_policy_defaults_to_model_once_a_calibration_is_configured(
    tmp_path: Path, lines: list[str], expected: str
) -> None:
    cal = tmp_path / "cal.csv"
    cal.write_text(CALIBRATION)
    text = "[choose]\n" + "\n".join(line.format(cal=cal) for line in lines) + "\n"
    assert load_config(write(tmp_path, text)).choose.policy == expected


@pytest.mark.parametrize(
    ("content", "value", "problem"),
    [
        (None, "/nonexistent/cal.csv", "cannot read"),
        ("steps,concurrency\n1,1\n", "{cal}", "header must be"),
        ("steps,concurrency,output_tok_s\n0,1,100\n", "{cal}", "no speculative step count"),
        # What no server measures stops the start (and a reload) here, not a decision later.
        (
            "steps,concurrency,output_tok_s,accept_length\n1,1,100,50\n",
            "{cal}",
            "cal.csv:2: accept_length 50 is more than steps + 1 = 2",
        ),
        ("steps,concurrency,output_tok_s\n1,1,1e308\n", "{cal}", "cal.csv:2: output_tok_s 1e308"),
        (CALIBRATION, "relative.csv", "must be an absolute path"),
    ],
)
def test_a_bad_calibration_file_is_one_line(
    tmp_path: Path, content: str | None, value: str, problem: str
) -> None:
    cal = tmp_path / "cal.csv"
    if content is not None:
        cal.write_text(content)
    path = write(tmp_path, f"[choose]\ncalibration_file = '{value.format(cal=cal)}'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("choose.calibration_file: ")
    assert problem in info.value.problems[0]


@pytest.mark.parametrize(
    ("text", "ok"),
    [("restart_cost_s = 0", True), ("restart_cost_s = -1", False), ("restart_cost_s = 1e9", False)],
)
def test_restart_cost_is_a_non_negative_number_of_seconds(
    tmp_path: Path, text: str, ok: bool
) -> None:
    path = write(tmp_path, "[choose]\n" + text + "\n")
    if ok:
        assert load_config(path).choose.restart_cost_s == 0
    else:
        with pytest.raises(ConfigError, match=r"choose\.restart_cost_s"):
            load_config(path)


@pytest.mark.parametrize(
    ("lines", "problems"),
    [
        # Only steps 1 and 3 are rows of the table.
        (["kinds = ['static', 'adaptive']", "adaptive_candidate_sets = ['adaptive:1,3']"], []),
        (["kinds = ['static']", "adaptive_candidate_sets = ['adaptive:1,4']"], []),
        (
            ["kinds = ['static', 'adaptive']",
             "adaptive_candidate_sets = ['adaptive:1,3', 'adaptive:1,4', "
             "'adaptive:1,3/1=1,3;8=0,1']"],
            ["'adaptive:1,4' uses steps 4, which",
             "'adaptive:1,3/1=1,3;8=0,1' uses steps 0, which"],
        ),
        # A default set the table cannot predict is left out, not an error (the default
        # SGLang set reaches 7 and a 0 tier; adaptive:1,3 is predicted), written out or not.
        (["kinds = ['adaptive']"], []),
        (["kinds = ['adaptive']",
          "adaptive_candidate_sets = ['adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0', "
          "'adaptive:1,3']"], []),
        # ... but kinds the table can predict nothing of are (no steps-0 row for off).
        (["kinds = ['off', 'adaptive']",
          "adaptive_candidate_sets = ['adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0']"],
         ["can predict none of ['off', 'adaptive'] (off needs a steps-0 row"]),
        (["kinds = ['off']"], ["can predict none of ['off']"]),
    ],
)  # fmt: skip
def test_adaptive_sets_must_be_rows_of_the_calibration(
    tmp_path: Path, lines: list[str], problems: list[str]
) -> None:
    cal = tmp_path / "cal.csv"
    cal.write_text("steps,concurrency,output_tok_s\n1,1,100\n3,1,150\n")
    text = f"[choose]\ncalibration_file = '{cal}'\n" + "\n".join(lines) + "\n"
    if not problems:
        load_config(write(tmp_path, text))
        return
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    found = info.value.problems
    for problem in problems:
        assert any(problem in p for p in found), (problem, found)
    assert len(found) == len(problems), found
    assert all(
        f"which {cal} has no rows for" in p or p.startswith(f"choose.kinds: {cal} can predict")
        for p in found
    ), found
