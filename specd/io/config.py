"""specd's configuration: /etc/specd/specd.toml, overridden by ``SPECD_*`` environment variables.

The settings themselves (tables, fields, defaults, bounds) are declared once, in
``specd.core.settings``; this module adds where they come from. ``load_config(path)`` returns
a frozen ``Config`` or raises ``ConfigError`` whose ``problems`` are one line each, naming the
key as ``observe.scrape_interval_s`` or ``windows[0].cron``. Unknown keys are errors, in the
file and in the environment, so a typo never silently falls back to a default; a known key in
the wrong table (or at the top level, as in the flat files before the tables) is named with
its table: "`scrape_interval_s` belongs in [observe]".

Environment values are strings, one table level per ``__``
(``SPECD_OBSERVE__SCRAPE_INTERVAL_S=7``); arrays take JSON
(``SPECD_WINDOWS='[{"cron": "0 3 * * sat", "duration_s": 3600, "timezone": "UTC"}]'``).

A ``SPECD_*`` variable wins over the file: ``shadowed_keys`` names each key of the file one
overrides, since an edit to such a key does nothing (`specd check-config` warns of each; the
daemon, which runs in the unit's environment, on each reload).

Each problem is also made as a ``Problem`` (``ConfigError.located``, beside the lines): what
of the file's data it is about, as key paths (``("choose", "max_steps")``, ``("windows", 0,
"cron")``), whether a ``SPECD_*`` variable made it, and for a key in the wrong place the
setting it was meant as; `specd.commands.config_fallback` leaves those keys out of a file
with problems without reading the lines. ``load_config_data`` loads already parsed data.

`specd check-config` (specd.commands.check_config) prints the result.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from specd.core.setting import parse as parse_setting
from specd.core.settings import (
    ARRAYS,
    DEFAULT_ADAPTIVE_SETS,
    RENAMED_KEYS,
    TABLE_OF_KEY,
    TABLES,
    Band,
    Problems,
    Settings,
    Window,
)
from specd.io import files
from specd.io.calibration import CalibrationError, read_calibration
from specd.io.paths import DEFAULT_CONFIG_PATH

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ENV_PREFIX",
    "Band",
    "Config",
    "ConfigError",
    "KeyPath",
    "Problem",
    "Shadowed",
    "Window",
    "check_calibration",
    "config_changes",
    "config_to_dict",
    "load_config",
    "load_config_data",
    "read_config_file",
    "shadowed_in_file",
    "shadowed_keys",
]

ENV_PREFIX = "SPECD_"
ENV_NESTED_DELIMITER = "__"
# A config file is a few KiB; refusing huge ones keeps a mistake from eating memory.
MAX_CONFIG_BYTES = 1 << 20
# A reload reads the file until two reads this far apart agree, at most this many times
# (4.5 s): a write in progress (`cp`, an editor) has moved on by the next read.
SETTLE_INTERVAL_S = 0.5
SETTLE_READS = 10


# A key of the config file's data, from the top: ("choose", "max_steps"), ("windows", 0, "cron").
KeyPath = tuple[str | int, ...]


@dataclass(frozen=True)
class Problem:
    """One problem of a configuration: its line, and what it is about."""

    text: str  # the line, as ConfigError.problems has it
    # The keys of the file's data it is about (a key the file may not set: a required one
    # missing, one a variable set); () for the file as a whole, or a variable alone.
    keys: tuple[KeyPath, ...] = ()
    # Made by a SPECD_* variable (its value, or the variable itself), not by the file.
    env: bool = False
    # For a known key in the wrong place: the setting it was meant as ("files.state_dir").
    meant_as: str | None = None

    def __str__(self) -> str:
        return self.text


class ConfigError(Exception):
    """A configuration that cannot be used; ``problems`` has one line per problem, and
    ``located`` the same problems with what each is about (`Problem`)."""

    def __init__(self, problems: Sequence[str | Problem], path: Path | None = None) -> None:
        self.located = tuple(p if isinstance(p, Problem) else Problem(p) for p in problems)
        self.problems = [p.text for p in self.located]
        self.path = path  # the config file the problems are about, if any
        super().__init__("; ".join(self.problems))


# The parsed config file, handed to Config's settings source by load_config.
_FILE_DATA: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "specd_config_file_data", default=None
)


class _FileSource(PydanticBaseSettingsSource):
    """The TOML file's values, below the environment in priority."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_FILE_DATA.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_DATA.get() or {})


class Config(Settings, BaseSettings):
    """specd's effective configuration: ``Settings`` read from the file and ``SPECD_*``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _FileSource(settings_cls)


# -- where a key belongs ------------------------------------------------------------------


class Home(NamedTuple):
    """Where a known key belongs: the setting it is and the phrase that says so."""

    setting: str  # "files.state_dir", "windows"
    phrase: str  # "`state_dir` belongs in [files]"


def _home_of(key: str) -> Home | None:
    """Where ``key`` belongs, if it is a known key of some table (or an array)."""
    if key in RENAMED_KEYS:
        table, new = RENAMED_KEYS[key]
        return Home(f"{table}.{new}", f"`{key}` is now `{new}` in [{table}]")
    if key in TABLE_OF_KEY:
        return Home(f"{TABLE_OF_KEY[key]}.{key}", f"`{key}` belongs in [{TABLE_OF_KEY[key]}]")
    if key in ARRAYS:
        return Home(key, f"`{key}` is an array at the top level: [[{key}]]")
    return None


def _meant_as(key: str) -> str | None:
    """The setting ``key`` is, written elsewhere: ``files.state_dir``, ``windows``."""
    home = _home_of(key)
    return None if home is None else home.setting


def _placement_problems(data: dict[str, Any]) -> tuple[list[Problem], dict[str, Any]]:
    """Keys in the wrong place, one line each, and the data without them (so the rest is
    still validated and every problem is reported in one go)."""
    problems: list[Problem] = []
    kept: dict[str, Any] = {}
    for key, value in data.items():
        if key in TABLES:
            if not isinstance(value, dict):
                problems.append(
                    Problem(
                        f"{key}: expected a table ([{key}]), got {type(value).__name__} {value!r}",
                        ((key,),),
                    )
                )
                continue
            inner: dict[str, Any] = {}
            for name, item in value.items():
                home = None if name in TABLES[key].model_fields else _home_of(name)
                if home is None:
                    inner[name] = item
                else:
                    problems.append(
                        Problem(
                            f"{key}.{name}: {home.phrase}", ((key, name),), meant_as=home.setting
                        )
                    )
            kept[key] = inner
        elif key in ARRAYS:
            kept[key] = value
        elif (home := _home_of(key)) is not None:
            problems.append(Problem(home.phrase, ((key,),), meant_as=home.setting))
        else:
            kept[key] = value  # unknown: pydantic names it
    return problems, kept


def _type_problems(data: Mapping[str, Any]) -> list[Problem]:
    """Wrong scalar types in the file. TOML is typed: `max_steps = "6"` or `= true` is a
    mistake, although pydantic would coerce it (it must, for environment strings)."""
    problems = []
    for key, value in data.items():
        if key in ARRAYS:
            if not isinstance(value, list):
                problems.append(
                    Problem(
                        f"{key}: expected an array of tables ([[{key}]]), "
                        f"got {type(value).__name__} {value!r}",
                        ((key,),),
                    )
                )
            continue
        model = TABLES.get(key)
        if model is None or not isinstance(value, dict):
            continue
        for name, item in value.items():
            field = model.model_fields.get(name)
            if field is None:
                continue
            want = _wrong_type(field.annotation, item)
            if want is not None:
                problems.append(
                    Problem(
                        f"{key}.{name}: expected {want}, got {type(item).__name__} {item!r}",
                        ((key, name),),
                    )
                )
    return problems


def _nul_problems(value: Any, where: KeyPath = ()) -> list[Problem]:
    """Strings holding a NUL: TOML allows "\\u0000", but no path, unit, URL or argument can
    hold one (os and subprocess raise on it, where the daemon could not say why)."""
    if isinstance(value, str):
        if "\x00" not in value:
            return []
        return [Problem(f"{_dotted(where)}: holds a NUL character (\\u0000)", (where,))]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _nul_problems(v, (*where, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _nul_problems(v, (*where, i))]
    return []


def _dotted(where: KeyPath) -> str:
    """A key path as its lines name it: ``windows[0].cron``."""
    out = ""
    for part in where:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + part
    return out


def _key_path(setting: str) -> KeyPath:
    """``choose.max_steps`` (as `specd.core.settings.Problems` names a key) as a key path."""
    return tuple(setting.split(".", 1))


def _wrong_type(expected: Any, value: Any) -> str | None:
    if expected is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif expected is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif expected in (str, Path) or getattr(expected, "__origin__", None) is Literal:
        ok, want = isinstance(value, str), "a string"
    else:
        return None
    return None if ok else want


# -- pydantic's errors as one line each ---------------------------------------------------


def _loc_path(loc: tuple[int | str, ...]) -> KeyPath:
    """pydantic's location as a key path of the data (without its validators' names)."""
    return tuple(
        part
        for part in loc
        if isinstance(part, int) or (part and not part.startswith(("function-", "model-", "json-")))
    )


def _format_loc(loc: tuple[int | str, ...]) -> str:
    return _dotted(_loc_path(loc))


def _setting_of(where: KeyPath) -> str:
    """The setting a key path is in: ``choose.max_steps``, ``windows``, ``choose``."""
    head = str(where[0])
    if head in TABLES and len(where) >= 2:
        return f"{head}.{where[1]}"
    return head


def _in_data(data: Mapping[str, Any], where: KeyPath) -> bool:
    """Whether ``data`` holds the key path ``where``."""
    node: Any = data
    for part in where:
        held = (
            part in node
            if isinstance(node, Mapping)
            else isinstance(node, list) and isinstance(part, int) and part < len(node)
        )
        if not held:
            return False
        node = node[part]
    return True


def _env_name_of(loc: tuple[int | str, ...]) -> str | None:
    """The SPECD_* variable that set the value at ``loc``, if one did."""
    names = [p for p in loc if isinstance(p, str)][:2]
    if not names:
        return None
    environ = {name.upper() for name in os.environ}
    candidates = [ENV_PREFIX + names[0].upper()]
    if len(names) == 2 and names[0] in TABLES:
        candidates.insert(0, candidates[0] + ENV_NESTED_DELIMITER + names[1].upper())
    return next((c for c in candidates if c in environ), None)


def _env_setters(environ: Mapping[str, str]) -> dict[str, str]:
    """Each key a ``SPECD_*`` variable sets (``choose.max_steps``, ``windows``), and that
    variable, as pydantic-settings reads them: any case; a table's variable
    (SPECD_CHOOSE='{"max_steps": 4}') sets the keys its JSON object names, and the whole
    table (``gateway``) if it is not an object (null); a key's own variable wins over it.
    One that is not JSON sets nothing here: the load refuses it anyway."""
    by_table: dict[str, str] = {}
    by_key: dict[str, str] = {}
    for name, value in sorted(environ.items()):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        table, nested, key = rest.partition(ENV_NESTED_DELIMITER)
        if nested:
            if table in TABLES and key in TABLES[table].model_fields:
                by_key[f"{table}.{key}"] = name
        elif table in ARRAYS:
            by_key[table] = name
        elif table in TABLES:
            try:
                parsed = files.parse_json(value)
            except ValueError:
                continue
            if not isinstance(parsed, dict):
                by_table[table] = name
                continue
            fields = TABLES[table].model_fields
            by_table.update({f"{table}.{k}": name for k in parsed if k in fields})
    return {**by_table, **by_key}


def _setter_of(key: str, setters: Mapping[str, str]) -> str | None:
    """The variable that sets ``key`` (``choose.max_steps``, ``bands``), if one does."""
    return setters.get(key) or setters.get(key.partition(".")[0])


def _naming_setters(text: str, keys: tuple[str, ...], setters: Mapping[str, str]) -> str:
    """``text`` with the variables that set any of ``keys``: a check across keys (min_steps
    > max_steps, a band's steps) is about the file and the environment together."""
    by_variable: dict[str, list[str]] = {}
    for key in dict.fromkeys(keys):
        variable = _setter_of(key, setters)
        if variable is not None:
            by_variable.setdefault(variable, []).append(key)
    if not by_variable:
        return text
    said = ", ".join(f"{', '.join(k)} set by {v}" for v, k in by_variable.items())
    return f"{text} ({said})"


def _problems_from(
    error: ValidationError, reported_env: set[str], data: Mapping[str, Any]
) -> list[Problem]:
    """pydantic's errors, one line each; ``data``: the file's, as validated."""
    problems = []
    errors = error.errors(include_url=False)
    setters = _env_setters(os.environ)
    for err in errors:
        loc = tuple(err["loc"])
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, Problems):
            # A check across keys: each problem names the variables that set its keys (the
            # table's or the model's location alone would name none).
            where = _format_loc(loc)
            for text, keys in cause.problems:
                line = _naming_setters(text, keys, setters)
                problems.append(
                    Problem(
                        f"{where}: {line}" if where else line,
                        tuple(_key_path(k) for k in keys),
                        env=bool(keys) and all(_setter_of(k, setters) for k in keys),
                    )
                )
            continue
        if err["type"] in ("too_short", "too_long") and any(
            tuple(other["loc"])[: len(loc)] == loc and len(other["loc"]) > len(loc)
            for other in errors
        ):
            # pydantic counts the items that validated: kinds = ["statc"] is also "at
            # least 1 item, not 0". The item's own error is the problem.
            continue
        path = _loc_path(loc)
        key = _dotted(path)
        env_name = _env_name_of(loc)
        # From the environment: a variable sets the key, or one is named and the file does
        # not hold the key (an unknown key of a table's JSON).
        env = bool(path) and (
            _setter_of(_setting_of(path), setters) is not None
            or (env_name is not None and not _in_data(data, path))
        )
        about = (path,) if path else ()
        meant_as = None
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            if env_name in reported_env:
                continue  # already one line, naming the variable
            message = "unknown key (check the spelling; see etc/specd/specd.toml)"
            # A known key of another table (in an item of an array, a table's JSON).
            name = path[-1] if path else None
            meant_as = _meant_as(name) if isinstance(name, str) else None
        elif err["type"] == "missing":
            message = "required key is missing"
        elif err["type"] not in ("value_error", "assertion_error", "too_long") and "input" in err:
            # (too_long says the count; its input may be thousands of items on one line.)
            message += f" (got {err['input']!r})"
        if key and env_name is not None:
            message += f" (set by {env_name})"
        # A model-level check reports several problems joined by "; ".
        parts = message.split("; ") if err["type"] == "value_error" else [message]
        if key in TABLES or not key:
            lines = [f"{key}: {part}" if key else part for part in parts]
        else:
            lines = [f"{key}: {message}"]
        problems += [Problem(line, about, env=env, meant_as=meant_as) for line in lines]
    return problems


def _known_env_names() -> dict[str, str | None]:
    """Every SPECD_* name that sets something, mapped to None; hints for old names."""
    known: dict[str, str | None] = {}
    for table, model in TABLES.items():
        known[ENV_PREFIX + table.upper()] = None  # the whole table as JSON
        for name in model.model_fields:
            known[ENV_PREFIX + table.upper() + ENV_NESTED_DELIMITER + name.upper()] = None
    for array in ARRAYS:
        known[ENV_PREFIX + array.upper()] = None
    return known


def _env_hint(name: str) -> str:
    """For an unknown SPECD_* name: the variable it probably meant, if any."""
    rest = name[len(ENV_PREFIX) :]
    table, _, key = rest.partition(ENV_NESTED_DELIMITER)
    key = (key or table).lower()
    if key in RENAMED_KEYS:
        home, new = RENAMED_KEYS[key]
    elif key in TABLE_OF_KEY:
        home, new = TABLE_OF_KEY[key], key
    else:
        return " (check the spelling)"
    said = _home_of(key)
    assert said is not None
    return f"; {said.phrase}: use {ENV_PREFIX}{home.upper()}{ENV_NESTED_DELIMITER}{new.upper()}"


def _default_of(field: FieldInfo) -> Any:
    default = field.get_default(call_default_factory=True)
    return None if default is PydanticUndefined else default


def _json_shape(name: str) -> tuple[str, str] | None:
    """For a SPECD_* variable whose value pydantic-settings parses as JSON: what it must be
    and an example value (from the default; "" for none), else None."""
    table, nested, key = name.upper()[len(ENV_PREFIX) :].lower().partition(ENV_NESTED_DELIMITER)
    if nested:
        model = TABLES.get(table)
        field = None if model is None else model.model_fields.get(key)
        if field is None or getattr(field.annotation, "__origin__", None) not in (list, tuple):
            return None  # a scalar: taken as it is
        default = _default_of(field)
        example = json.dumps(to_jsonable_python(list(default)[:1])) if default else ""
        return "a list must be JSON", example
    if table in ARRAYS:
        default = _default_of(Settings.model_fields[table])
        return "an array of tables must be JSON", json.dumps(to_jsonable_python(default[:1]))
    if table in TABLES:
        for field_name, info in TABLES[table].model_fields.items():
            if (default := _default_of(info)) is not None:
                example = json.dumps({field_name: to_jsonable_python(default)})
                return "a table must be a JSON object", example
        return "a table must be a JSON object", ""
    return None


def _env_json_problems() -> list[Problem]:
    """One line per SPECD_* variable that must be JSON and is not: pydantic-settings stops
    at the first, and names its table only (SPECD_CHOOSE for SPECD_CHOOSE__KINDS)."""
    problems = []
    for name, value in sorted(os.environ.items()):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        shape = _json_shape(name)
        # An empty list variable is left to pydantic ("Input should be a valid tuple").
        if shape is None or (not value and ENV_NESTED_DELIMITER in name):
            continue
        try:
            # Bounded: a value nested thousands deep made json.loads raise RecursionError.
            files.parse_json(value)
        except ValueError as exc:
            what, example = shape
            bare = not value.lstrip().startswith(("[", "{", '"'))
            if what.startswith("a list") and bare and value.strip():
                example = json.dumps([value.strip()])  # the operator's item, quoted
            # For a bare word, JSON's "Expecting value at char 0" says nothing; for a
            # broken JSON text it says where.
            where = "" if bare else f" ({str(exc).removeprefix('invalid JSON: ')})"
            such_as = f", such as {name}='{example}'" if example else ""
            problems.append(Problem(f"{name}: not valid JSON{where}; {what}{such_as}", env=True))
    return problems


def _unknown_env() -> tuple[list[Problem], set[str]]:
    known = _known_env_names()
    problems, names = [], set()
    for name in sorted(os.environ):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX) and upper not in known:
            table, _, key = upper[len(ENV_PREFIX) :].partition(ENV_NESTED_DELIMITER)
            problems.append(
                Problem(
                    f"{name}: unknown setting in the environment{_env_hint(upper)}",
                    env=True,
                    meant_as=_meant_as((key or table).lower()),
                )
            )
            names.add(upper)
    return problems, names


# -- the file -----------------------------------------------------------------------------


def read_config_file(path: Path, settle: Callable[[float], bool] | None = None) -> dict[str, Any]:
    """The TOML file's contents; ConfigError (one line) if unreadable, empty or not TOML.

    A regular file only (a FIFO or device is refused at once), at most MAX_CONFIG_BYTES;
    a link is followed (configuration management often links /etc files).

    An empty file (or one of whitespace only) is refused although TOML reads it as no keys:
    it is what a reload sees in the middle of a `cp new.toml specd.toml` (truncated, not yet
    written), and taken as all defaults it would point the running daemon at another SGLang
    URL, unit and windows. A file of comments only is all defaults, as written.

    With ``settle`` (a reload's interruptible wait: True to give up), the file is read until
    it stays the same for SETTLE_INTERVAL_S (`files.read_settled`): cut short at a line,
    the half written file is still TOML, and read once it was applied."""
    try:
        if settle is None:
            raw = files.read_regular_file(path, MAX_CONFIG_BYTES, follow_symlinks=True)
        else:
            raw = files.read_settled(
                path,
                MAX_CONFIG_BYTES,
                pause=settle,
                interval_s=SETTLE_INTERVAL_S,
                reads=SETTLE_READS,
                follow_symlinks=True,
            )
    except files.FileReadError as exc:
        raise ConfigError([exc.problem], path) from None
    if raw.startswith(files.UTF8_BOM):
        raise ConfigError([files.BOM_PROBLEM], path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"not UTF-8 text (byte {exc.start})"], path) from None
    if not text.strip():
        raise ConfigError([_empty_problem(len(raw))], path)
    try:
        return files.parse_toml(text)
    except files.ParseError as exc:
        raise ConfigError([str(exc)], path) from None


def _empty_problem(size: int) -> str:
    what = "empty (0 bytes)" if size == 0 else f"only whitespace ({size} bytes)"
    return (
        f"the file is {what}, perhaps half written: write the keys you set, "
        "or a comment line (# defaults) to keep every default"
    )


def check_calibration(settings: Settings) -> list[str]:
    """The configured calibration table, read once so a bad table stops `specd
    check-config` and the daemon's start, not a decision hours later; one line or none."""
    return [text for text, _ in _calibration_problems(settings)]


_CALIBRATION_FILE = "choose.calibration_file"


def _calibration_problems(settings: Settings) -> list[tuple[str, tuple[str, ...]]]:
    """`check_calibration`'s lines, each with the settings it is about."""
    path = settings.choose.calibration_file
    if path is None:
        return []
    try:
        calibration = read_calibration(path)
    except CalibrationError as exc:
        return [(f"{_CALIBRATION_FILE}: {exc}", (_CALIBRATION_FILE,))]
    choose = settings.choose
    known = set(calibration.table.steps())
    sets = [(text, parse_setting(text)) for text in choose.adaptive_candidate_sets]
    predicted = [text for text, s in sets if s.table_steps <= known]
    if not (
        "static" in choose.kinds
        or ("off" in choose.kinds and 0 in known)
        or ("adaptive" in choose.kinds and predicted)
    ):
        return [
            (
                f"choose.kinds: {path} can predict none of {list(choose.kinds)} (off needs a "
                "steps-0 row, an adaptive set a row for each of its step counts)",
                ("choose.kinds", _CALIBRATION_FILE),
            )
        ]
    if "adaptive" not in choose.kinds:
        return []
    # specd predicts an adaptive set from its candidates' rows: one the table lacks
    # would be a guess about the deepest candidate's capacity. A set the operator wrote
    # that the table cannot predict is a mistake to stop on; one of specd's default sets
    # is left out of the choices instead (`specd.core.choices.offer`; doctor says so).
    problems: list[tuple[str, tuple[str, ...]]] = []
    for text, setting in sets:
        lacking = sorted(setting.table_steps - known)
        if lacking and text not in DEFAULT_ADAPTIVE_SETS:
            problems.append(
                (
                    f"choose.adaptive_candidate_sets: {text!r} uses steps "
                    f"{','.join(map(str, lacking))}, which {path} has no rows for",
                    ("choose.adaptive_candidate_sets", _CALIBRATION_FILE),
                )
            )
    return problems


def load_config(
    path: str | Path | None = None,
    *,
    settle: Callable[[float], bool] | None = None,
    calibration: bool = True,
) -> Config:
    """Load the config file (default /etc/specd/specd.toml), environment over file.

    A missing *default* file means built-in defaults (plus environment); a missing file that
    was named explicitly is an error. ``settle``: read the file once it stopped changing
    (`read_config_file`), as a reload does. ``calibration``: read the calibration table too
    (`check_calibration`); the on-call's commands leave it out, since the running daemon
    keeps its last good table and a freeze or a pin must not wait for a fixed one.
    """
    config_path: Path | None = DEFAULT_CONFIG_PATH if path is None else Path(path)
    data: dict[str, Any] = {}
    if path is None and not DEFAULT_CONFIG_PATH.exists():
        config_path = None
    elif config_path is not None:
        data = read_config_file(config_path, settle)
    return load_config_data(data, path_shown=config_path, calibration=calibration)


def load_config_data(
    data: Mapping[str, Any], *, path_shown: Path | None, calibration: bool = True
) -> Config:
    """`load_config` on the config file's data as `read_config_file` parsed it (not changed
    here), environment over it; ``path_shown``: the file it is said to be (ConfigError.path),
    None for none."""
    problems, kept = _placement_problems(dict(data))
    problems += _type_problems(kept)
    problems += _nul_problems(kept)
    env_problems, env_names = _unknown_env()
    problems += env_problems
    token = _FILE_DATA.set(kept)
    config: Config | None = None
    try:
        config = Config()
    except ValidationError as exc:
        # A key whose type was already reported gets one line, not two.
        seen = {p.text.split(":", 1)[0] for p in problems}
        problems += [
            p for p in _problems_from(exc, env_names, kept) if p.text.split(":", 1)[0] not in seen
        ]
    except (SettingsError, RecursionError) as exc:
        # pydantic-settings fails this way on malformed JSON in a variable (RecursionError:
        # nested thousands deep, which its json.loads does not survive).
        found = _env_json_problems()
        if not found:
            field = re.search(r'field "(\w+)"', str(exc))
            name = ENV_PREFIX + field.group(1).upper() if field else "environment"
            found = [Problem(f"{name}: not valid JSON: {exc.__cause__ or exc}", env=True)]
        problems += found
    finally:
        _FILE_DATA.reset(token)
    if (
        calibration
        and config is not None
        and not any(_key_path(_CALIBRATION_FILE) in p.keys for p in problems)
    ):
        # Its lines name the variable that set the table, the kinds or the sets, if one did.
        setters = _env_setters(os.environ)
        problems += [
            Problem(
                _naming_setters(text, keys, setters),
                tuple(_key_path(k) for k in keys),
                env=all(_setter_of(k, setters) for k in keys),
            )
            for text, keys in _calibration_problems(config)
        ]
    if problems:
        raise ConfigError(problems, path_shown)
    assert config is not None
    return config


class Shadowed(NamedTuple):
    """A key of the config file that a ``SPECD_*`` variable overrides."""

    key: str  # as check-config names it: ``choose.max_steps``, ``windows``
    variable: str  # ``SPECD_CHOOSE__MAX_STEPS``

    def warning(self) -> str:
        return (
            f"overridden by the environment variable {self.variable}: an edit to it in the "
            "file does nothing while the variable is set"
        )


def shadowed_keys(data: Mapping[str, Any], environ: Mapping[str, str]) -> list[Shadowed]:
    """Each key of the parsed config file ``data`` (`read_config_file`) that a ``SPECD_*``
    variable of ``environ`` overrides, in the file's order: the environment wins, so an edit
    to that key changes nothing, and a reload says nothing changed."""
    setters = _env_setters(environ)
    found = []
    for key, value in data.items():
        if key in TABLES and isinstance(value, Mapping):
            fields = TABLES[key].model_fields
            for name in value:
                variable = _setter_of(f"{key}.{name}", setters) if name in fields else None
                if variable is not None:
                    found.append(Shadowed(f"{key}.{name}", variable))
        elif key in ARRAYS and key in setters:
            found.append(Shadowed(key, setters[key]))
    return found


def shadowed_in_file(
    path: str | Path | None, environ: Mapping[str, str] | None = None
) -> list[Shadowed]:
    """`shadowed_keys` of the config file at ``path`` (None: the default, as `load_config`
    reads it) under ``environ`` (default: this process's). Read again, after `load_config`
    took it: none for a file it cannot read, whose problem the load has said."""
    if path is None and not DEFAULT_CONFIG_PATH.exists():
        return []
    try:
        data = read_config_file(DEFAULT_CONFIG_PATH if path is None else Path(path))
    except ConfigError:
        return []
    return shadowed_keys(data, os.environ if environ is None else environ)


def _flat(data: Mapping[str, Any]) -> dict[str, Any]:
    """Table values as ``table.key``; the arrays and anything else as they are."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in TABLES and isinstance(value, Mapping):
            out.update({f"{key}.{name}": item for name, item in value.items()})
        else:
            out[key] = value
    return out


def config_changes(old: BaseModel, new: BaseModel) -> dict[str, Any]:
    """What a reload changed, key by key (``{"observe.scrape_interval_s": 0.8}``)."""
    before = _flat(old.model_dump(mode="json"))
    return {k: v for k, v in _flat(new.model_dump(mode="json")).items() if before.get(k) != v}


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def config_to_dict(config: BaseModel) -> dict[str, Any]:
    """The config as plain TOML/JSON-able data, table by table (paths as strings, no None
    values: TOML has no null)."""
    data: dict[str, Any] = _without_none(config.model_dump(mode="json"))
    return data
