"""specd's configuration: /etc/specd/specd.toml, overridden by ``SPECD_*`` environment variables.

``load_config(path)`` returns a frozen ``Config`` or raises ``ConfigError`` whose ``problems``
are one line each, naming the key (``windows[0].cron: ...``). Unknown keys are errors, in the
file and in the environment, so a typo never silently falls back to a default.

Environment values are strings (``SPECD_MAX_STEPS=4``); list settings take JSON
(``SPECD_WINDOWS='[{"cron": "0 3 * * sat", "duration_s": 3600, "timezone": "UTC"}]'``).
``SPECD_SPEC_*`` variables belong to the SGLang unit's drop-in and are not specd settings.

`specd check-config` (specd.commands.check_config) prints the result.
"""

from __future__ import annotations

import contextvars
import ipaddress
import itertools
import os
import re
import sys
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from specd.core import windows as windows_mod
from specd.core.perftable import PerfTable, PerfTableError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

DEFAULT_CONFIG_PATH = Path("/etc/specd/specd.toml")
ENV_PREFIX = "SPECD_"
# The SGLang unit's drop-in reads these; they may share specd's environment in tests.
FOREIGN_ENV_PREFIXES = ("SPECD_SPEC_",)
# A config file is a few KiB; refusing huge ones keeps a mistake from eating memory.
MAX_CONFIG_BYTES = 1 << 20

_UNIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9:_.\\@-]*\.service$")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


class ConfigError(Exception):
    """A configuration that cannot be used; ``problems`` has one line per problem."""

    def __init__(self, problems: list[str], path: Path | None = None) -> None:
        self.problems = list(problems)
        self.path = path  # the config file the problems are about, if any
        super().__init__("; ".join(self.problems))


class Band(BaseModel):
    """Offered concurrency up to ``max_concurrency`` (inclusive) runs ``steps`` steps."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_concurrency: float | None = Field(
        default=None,
        ge=0,
        description="Upper bound (inclusive) of offered concurrency for this band; "
        "omit for the catch-all last band.",
    )
    steps: int = Field(description="Speculative steps to run in this band.")


class Window(BaseModel):
    """A maintenance window: a cron start, a duration and the zone the cron reads in."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    cron: str = Field(
        description="Start, 5 cron fields; weekday names only (mon..sun), e.g. '0 3 * * mon-fri'."
    )
    duration_s: float = Field(gt=0, description="How long the window stays open, in seconds.")
    timezone: str = Field(default="UTC", description="IANA zone the cron is read in.")

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str) -> str:
        windows_mod.parse_cron(value)
        return value

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        windows_mod.load_zone(value)
        return value

    @model_validator(mode="after")
    def _fires(self) -> Window:
        windows_mod.check_window(self.cron, self.timezone, self.duration_s)
        return self


def _default_bands() -> list[Band]:
    return [Band(max_concurrency=4, steps=4), Band(steps=3)]


def _default_windows() -> list[Window]:
    return [Window(cron="0 3 * * mon-sun", duration_s=3600, timezone="UTC")]


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


class Config(BaseSettings):
    """specd's effective configuration. Units are in the field names."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    sglang_url: str = Field(
        default="http://127.0.0.1:30000", description="SGLang base URL (http or https)."
    )
    sglang_unit: str = Field(
        default="sglang.service", description="systemd unit that runs SGLang; specd restarts it."
    )
    env_file: Path = Field(
        default=Path("/var/lib/specd/sglang.env"),
        description="Environment file the SGLang unit reads (EnvironmentFile=-); specd writes it.",
    )
    state_dir: Path = Field(
        default=Path("/var/lib/specd"), description="Directory of specd's state.json."
    )
    override_file: Path = Field(
        default=Path("/etc/specd/override.toml"), description="The on-call override file."
    )
    min_steps: int = Field(default=1, ge=1, le=16, description="Fewest speculative steps allowed.")
    max_steps: int = Field(default=6, ge=1, le=16, description="Most speculative steps allowed.")
    apply_mode: Literal["static-topk1"] = Field(
        default="static-topk1",
        description="How steps are applied: steps K, eagle topk 1, draft tokens K+1.",
    )
    policy: Literal["bands", "model"] = Field(
        default="bands",
        description="Decision policy: concurrency bands or the throughput model. When unset, "
        '"model" if calibration_file is set, else "bands".',
    )
    calibration_file: Path | None = Field(
        default=None,
        description="Performance table (CSV: steps,concurrency,output_tok_s[,accept_length]"
        "[,max_running_requests], as `specd sweep` writes) the model policy starts from; "
        "absolute path.",
    )
    restart_cost_s: float = Field(
        default=100,
        ge=0,
        description="Serving time a restart of SGLang loses (model load + warm-up), seconds; "
        "the model policy charges it against a change.",
    )
    bands: list[Band] = Field(
        default_factory=_default_bands,
        description="Bands of offered concurrency → steps, by ascending max_concurrency; "
        "the last has no max_concurrency.",
    )
    band_quantile_ratio: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Quantile of busy-time offered concurrency that picks the band (0.5 = median).",
    )
    scrape_interval_s: float = Field(default=5, gt=0, description="Seconds between scrapes.")
    scrape_timeout_s: float = Field(default=3, gt=0, description="Timeout of one scrape, seconds.")
    stale_after_s: float = Field(
        default=60, gt=0, description="An observation older than this (seconds) is stale."
    )
    history_half_life_s: float = Field(
        default=86400, gt=0, description="Half-life of the offered-concurrency history, seconds."
    )
    min_history_s: float = Field(
        default=900, ge=0, description="Busy seconds of history needed before any decision."
    )
    warmup_exclude_s: float = Field(
        default=120,
        ge=0,
        description="Seconds after an SGLang start whose observations are ignored.",
    )
    stabilization_window_s: float = Field(
        default=900, ge=0, description="Seconds a recommendation must hold before it is acted on."
    )
    tolerance_ratio: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="Relative margin a change must beat (predicted gain, or distance past a "
        "band boundary).",
    )
    min_dwell_s: float = Field(default=3600, ge=0, description="Minimum seconds between restarts.")
    daily_restart_budget: int = Field(
        default=4, ge=0, description="Automatic restarts allowed per rolling 24 hours."
    )
    windows: list[Window] = Field(
        default_factory=_default_windows,
        min_length=1,
        description="Maintenance windows; automatic restarts happen only inside one.",
    )
    quiet_concurrency_max: int = Field(
        default=2, ge=0, description="A quiet moment: offered concurrency at or below this."
    )
    quiet_deadline_s: float = Field(
        default=600,
        ge=0,
        description="Seconds to wait for a quiet moment inside the window before restarting "
        "anyway (still inside the window).",
    )
    startup_timeout_s: float = Field(
        default=600, gt=0, description="Seconds to wait for /health_generate after a restart."
    )
    health_probe_timeout_s: float = Field(
        default=30,
        ge=25,
        description="Timeout of one /health_generate probe, seconds (SGLang's own is 20).",
    )
    metrics_listen_address: str = Field(
        default="127.0.0.1", description="Address specd's /metrics listens on."
    )
    metrics_port: int = Field(
        default=9464, ge=0, le=65535, description="Port of specd's /metrics; 0 picks a free port."
    )
    log_format: Literal["json", "console"] = Field(
        default="json", description="Log lines as JSON (journald) or for a console."
    )
    restart_command_timeout_s: float = Field(
        default=420,
        gt=0,
        description=(
            "Timeout of `systemctl restart`, seconds. Must exceed the SGLang unit's "
            "TimeoutStopSec= (5 min in the example unit): on SIGTERM SGLang drains running "
            "requests with no deadline, so under load the stop lasts that long."
        ),
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

    @field_validator("sglang_url")
    @classmethod
    def _url(cls, value: str) -> str:
        parsed = urllib.parse.urlsplit(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL such as http://127.0.0.1:30000")
        try:
            parsed.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ValueError(f"{value!r} has an invalid port") from None
        return value.rstrip("/")

    @field_validator("sglang_unit")
    @classmethod
    def _unit(cls, value: str) -> str:
        # Goes into systemctl's argv: a leading '-' would be read as an option.
        if not _UNIT_NAME.match(value):
            raise ValueError(f"{value!r} is not a systemd service name such as sglang.service")
        return value

    @field_validator("env_file", "state_dir", "override_file", "calibration_file")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        # Relative paths would depend on the daemon's working directory.
        if value is not None and not value.is_absolute():
            raise ValueError(f"{str(value)!r} must be an absolute path")
        return value

    @field_validator("calibration_file")
    @classmethod
    def _calibration(cls, value: Path | None) -> Path | None:
        # Read once here so a bad table stops `specd check-config` and the daemon's start,
        # not a decision hours later.
        if value is not None:
            try:
                table = PerfTable.from_csv(value)
            except PerfTableError as exc:
                raise ValueError(str(exc)) from None
            if not any(k >= 1 for k in table.steps()):
                raise ValueError(f"{value}: no speculative step count (steps >= 1) in the table")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_policy(cls, data: Any) -> Any:
        # A calibration is what the model policy needs: once one is configured, the model
        # is the default; an explicit `policy` always wins.
        if isinstance(data, dict) and data.get("policy") is None:
            data = dict(data)
            data["policy"] = "model" if data.get("calibration_file") else "bands"
        return data

    @field_validator("metrics_listen_address")
    @classmethod
    def _address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            if not _HOSTNAME.match(value):
                raise ValueError(f"{value!r} is not an IP address or host name") from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        problems: list[str] = []
        if self.min_steps > self.max_steps:
            problems.append(f"min_steps ({self.min_steps}) > max_steps ({self.max_steps})")
        catch_alls = [i for i, b in enumerate(self.bands) if b.max_concurrency is None]
        if not self.bands:
            problems.append("bands: at least one band is needed")
        elif catch_alls != [len(self.bands) - 1]:
            problems.append(
                "bands: exactly one band, the last, must omit max_concurrency (the catch-all)"
            )
        bounds = [b.max_concurrency for b in self.bands if b.max_concurrency is not None]
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            problems.append("bands: max_concurrency must strictly increase from band to band")
        for i, band in enumerate(self.bands):
            if (
                self.min_steps <= self.max_steps
                and not self.min_steps <= band.steps <= self.max_steps
            ):
                problems.append(
                    f"bands[{i}].steps: {band.steps} is outside min_steps..max_steps "
                    f"({self.min_steps}..{self.max_steps})"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _type_problems(data: Mapping[str, Any]) -> list[str]:
    """Wrong scalar types in the file. TOML is typed: `max_steps = "6"` or `= true` is a
    mistake, although pydantic would coerce it (it must, for environment strings)."""
    problems = []
    for key, value in data.items():
        field = Config.model_fields.get(key)
        if field is None:
            continue
        expected = field.annotation
        if expected is int:
            ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif expected is float:
            ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        elif expected in (str, Path) or getattr(expected, "__origin__", None) is Literal:
            ok, want = isinstance(value, str), "a string"
        elif getattr(expected, "__origin__", None) is list:
            ok, want = isinstance(value, list), "an array of tables ([[" + key + "]])"
        else:
            continue
        if not ok:
            problems.append(f"{key}: expected {want}, got {type(value).__name__} {value!r}")
    return problems


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part and not part.startswith(("function-", "model-", "json-")):
            out += ("." if out else "") + part
    return out


def _problems_from(error: ValidationError) -> list[str]:
    problems = []
    for err in error.errors(include_url=False):
        key = _format_loc(tuple(err["loc"]))
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; see etc/specd/specd.toml)"
        elif err["type"] == "missing":
            message = "required key is missing"
        elif err["type"] not in ("value_error", "assertion_error") and "input" in err:
            message += f" (got {err['input']!r})"
        env_name = ENV_PREFIX + key.split(".")[0].split("[")[0].upper()
        if key and env_name in os.environ:
            message += f" (set by {env_name})"
        # The model-level check reports several problems joined by "; ".
        for part in message.split("; ") if not key else [message]:
            problems.append(f"{key}: {part}" if key else part)
    return problems


def _unknown_env() -> list[str]:
    known = {ENV_PREFIX + name.upper() for name in Config.model_fields}
    return [
        f"{name}: unknown setting in the environment (check the spelling)"
        for name in sorted(os.environ)
        if name.upper().startswith(ENV_PREFIX)
        and name.upper() not in known
        and not name.upper().startswith(FOREIGN_ENV_PREFIXES)
    ]


def read_config_file(path: Path) -> dict[str, Any]:
    """The TOML file's contents; ConfigError (one line) if unreadable or not TOML."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([f"cannot read the file: {exc.strerror or exc}"], path) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([f"larger than {MAX_CONFIG_BYTES} bytes; not a config file"], path)
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError([f"not UTF-8 text (byte {exc.start})"], path) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"invalid TOML: {exc}"], path) from None


def load_config(path: str | Path | None = None) -> Config:
    """Load the config file (default /etc/specd/specd.toml), environment over file.

    A missing *default* file means built-in defaults (plus environment); a missing file that
    was named explicitly is an error.
    """
    config_path: Path | None = DEFAULT_CONFIG_PATH if path is None else Path(path)
    data: dict[str, Any] = {}
    if path is None and not DEFAULT_CONFIG_PATH.exists():
        config_path = None
    elif config_path is not None:
        data = read_config_file(config_path)
    problems = _type_problems(data) + _unknown_env()
    token = _FILE_DATA.set(data)
    try:
        config = Config()
    except ValidationError as exc:
        # A key whose type was already reported gets one line, not two.
        seen = {p.split(":", 1)[0] for p in problems}
        problems += [p for p in _problems_from(exc) if p.split(":", 1)[0] not in seen]
    except SettingsError as exc:
        # pydantic-settings fails this way on malformed JSON in a list-valued variable.
        field = re.search(r'field "(\w+)"', str(exc))
        name = ENV_PREFIX + field.group(1).upper() if field else "environment"
        problems.append(f"{name}: not valid JSON: {exc.__cause__ or exc}")
    finally:
        _FILE_DATA.reset(token)
    if problems:
        raise ConfigError(problems, config_path)
    return config


def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as plain TOML/JSON-able data (paths as strings, no None values)."""
    data = config.model_dump(mode="json")
    data["bands"] = [{k: v for k, v in band.items() if v is not None} for band in data["bands"]]
    return {k: v for k, v in data.items() if v is not None}
