"""specd's settings: one declaration of every field, its default, bounds and meaning.

One model per TOML table of /etc/specd/specd.toml (``[sglang]``, ``[files]``, ``[observe]``,
``[choose]``, ``[restart]``, ``[report]``) plus the arrays ``[[bands]]`` and ``[[windows]]``,
composed by ``Settings``. Pure: no environment, no files (the calibration table is checked
by the loader in ``specd.io.config``, which adds the file and the ``SPECD_*`` environment).

Every duration and ratio is finite and bounded above: an ``inf`` or ``1e300`` would turn a
timeout into "never" (a restart that never gets healthy would never be rolled back) or a
half-life into "never forget". The bounds are generous; each description says why.
"""

from __future__ import annotations

import ipaddress
import itertools
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specd.core import windows as windows_mod
from specd.core.setting import format_setting, plain_word
from specd.core.setting import parse as parse_setting
from specd.core.text import check_root_url, is_service_name
from specd.core.units import DAY_S, HOUR_S, MINUTE_S, WEEK_S

MAX_STEPS_ALLOWED = 16
MAX_ADAPTIVE_SETS = 16  # each is predicted at every tick
# Every window is read at each tick, and each costs milliseconds (its cron searched through
# its zone): some thousands outlasted WatchdogSec= at every tick. One cron covers many days
# ('0 3 * * mon-fri'), so a real schedule needs a handful.
MAX_WINDOWS = 32
# A band per step count (at most MAX_STEPS_ALLOWED) is the most a mapping needs.
MAX_BANDS = 32
# SGLang 0.5.23's DEFAULT_ADAPTIVE_CONFIG (specd.core.adaptive.DEFAULT_SLOTS), then sets
# whose deepest candidate costs less KV, for mid and high load.
DEFAULT_ADAPTIVE_SETS = (
    "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0",
    "adaptive:1,3",
    "adaptive:2,4",
    "adaptive:3,4",
    "adaptive:1,2,3",
)

# Goes into systemctl's argv: a leading '-' would be read as an option.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_GROUP = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


# Frozen, no unknown keys, no inf/nan anywhere.
def _table() -> ConfigDict:
    """Each table's pydantic config: typos are errors, values immutable, no inf/nan."""
    return ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Problems(ValueError):
    """Problems found across keys, each with the keys it is about (``choose.max_steps``,
    ``bands``), so the loader can name the ``SPECD_*`` variable that set one of them."""

    def __init__(self, problems: list[tuple[str, tuple[str, ...]]]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(text for text, _ in self.problems))


def _at_most(value: Any, limit: int, what: str, why: str) -> Any:
    """Refuse a list longer than ``limit`` before its items are validated: validating
    thousands of windows took seconds, and their problems would be thousands of lines."""
    if isinstance(value, (list, tuple)) and len(value) > limit:
        raise ValueError(f"{len(value)} {what}; at most {limit} ({why})")
    return value


def _absolute(value: Path | None) -> Path | None:
    # Relative paths would depend on the daemon's working directory.
    if value is not None and not value.is_absolute():
        raise ValueError(f"{str(value)!r} must be an absolute path")
    return value


class Band(BaseModel):
    """Offered concurrency up to ``max_concurrency`` (inclusive) runs ``steps`` steps."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    max_concurrency: float | None = Field(
        default=None,
        ge=0,
        le=100_000,
        description="Upper bound (inclusive) of offered concurrency for this band; omit for "
        "the catch-all last band. At most 100000 (no SGLang server runs that many requests).",
    )
    steps: int = Field(description="Speculative steps to run in this band.")


class Window(BaseModel):
    """A maintenance window: a cron start, a duration and the zone the cron reads in."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    cron: str = Field(
        description="Start, 5 cron fields; weekday names only (mon..sun), e.g. '0 3 * * mon-fri'."
    )
    duration_s: float = Field(
        gt=0,
        le=WEEK_S,
        description="How long the window stays open, in seconds; at most a week (a window "
        "open longer than the cron's period is always open: no window at all).",
    )
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


def _http_url(value: str) -> str:
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL such as http://127.0.0.1:30000")
    try:
        parsed.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"{value!r} has an invalid port") from None
    return value.rstrip("/")


class SGLangSettings(BaseModel):
    """[sglang]: the server specd tunes and how a step count reaches it."""

    model_config = _table()

    url: str = Field(
        default="http://127.0.0.1:30000",
        description="SGLang's root URL (http or https; no path: not .../v1); its /metrics "
        "needs --enable-metrics.",
    )
    unit: str = Field(
        default="sglang.service",
        description="systemd unit that runs SGLang; specd restarts exactly this unit.",
    )
    env_file: Path = Field(
        default=Path("/var/lib/specd/sglang.env"),
        description="Environment file the SGLang unit reads (EnvironmentFile=-); specd writes "
        "the speculative setting into it as SPECD_SPECULATIVE_ARGS (a static one also as "
        "SPECULATIVE_NUM_STEPS and SPECULATIVE_NUM_DRAFT_TOKENS). Absolute path.",
    )
    speculative_algorithm: str | None = Field(
        default=None,
        pattern=r"^[A-Z0-9_]{1,32}$",
        description="SGLang's --speculative-algorithm (EAGLE, EAGLE3, NEXTN, STANDALONE) specd "
        "writes with a static or adaptive setting; `specd install` sets it from the unit. "
        "Unset: the one in the env file specd last wrote, else the one the running SGLang "
        "reports (a static setting without any is written as step variables only).",
    )
    apply_mode: Literal["static-topk1"] = Field(
        default="static-topk1",
        description="How steps are applied: steps K, eagle topk 1, draft tokens K+1.",
    )
    server_api_key_file: Path | None = Field(
        default=None,
        description="File holding SGLang's --api-key, sent as a bearer token with each "
        "request to SGLang that needs it (not /metrics, not /health*; read at each request: "
        "a rotated key needs no reload); omit when SGLang runs without one. Not "
        "--admin-api-key: specd calls no admin route. Absolute path; keep it mode 0600 "
        "specd:specd (group specd, who may read the state, must not read the key).",
    )

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        # The root only: a path such as /v1 would read /v1/metrics (as if metrics were off).
        return check_root_url(_http_url(value))

    _server_api_key_file_absolute = field_validator("server_api_key_file")(_absolute)

    @field_validator("unit")
    @classmethod
    def _unit(cls, value: str) -> str:
        if not is_service_name(value):
            raise ValueError(f"{value!r} is not a systemd service name such as sglang.service")
        return value

    _env_file_absolute = field_validator("env_file")(_absolute)


class FilesSettings(BaseModel):
    """[files]: specd's own files."""

    model_config = _table()

    state_dir: Path = Field(
        default=Path("/var/lib/specd"),
        description="Directory of specd's state.json (history, last decision, restart "
        "journal). Absolute path.",
    )
    override_file: Path = Field(
        default=Path("/etc/specd/override.toml"),
        description="The on-call override file (`specd override ...` writes it). Absolute path.",
    )

    _absolute_paths = field_validator("state_dir", "override_file")(_absolute)

    @field_validator("state_dir")
    @classmethod
    def _state_dir_plain(cls, value: Path) -> Path:
        # An adaptive set's config file (state_dir/adaptive-<hash>.json) reaches SGLang's
        # command line through the env file.
        if not plain_word(str(value)):
            raise ValueError(
                f"{str(value)!r} holds a space, quote, backslash, $ or control character, "
                "which SGLang's command line would not get as written (an adaptive set's "
                "config file is named under it)"
            )
        return value


class ObserveSettings(BaseModel):
    """[observe]: scraping SGLang and folding what it reports into the history."""

    model_config = _table()

    scrape_interval_s: float = Field(
        default=5,
        gt=0,
        le=HOUR_S,
        description="Seconds between scrapes; at most an hour (rarer scrapes see no traffic).",
    )
    scrape_timeout_s: float = Field(
        default=3,
        gt=0,
        le=10 * MINUTE_S,
        description="Deadline of one scrape, seconds; at most 10 minutes (a /metrics page "
        "that takes longer is not an answer).",
    )
    stale_after_s: float = Field(
        default=60,
        gt=0,
        le=DAY_S,
        description="An observation older than this (seconds) is stale: no change is made on "
        "it; SGLang unseen for longer (scrapes failing, specd stopped) restarts the "
        "stabilization window. At most a day.",
    )
    history_half_life_s: float = Field(
        default=DAY_S,
        gt=0,
        le=90 * DAY_S,
        description="Half-life of the offered-concurrency history, seconds; at most 90 days "
        "(older traffic describes another deployment).",
    )
    min_history_s: float = Field(
        default=900,
        ge=0,
        le=30 * DAY_S,
        description="Busy seconds of history needed before any decision; at most 30 days.",
    )
    warmup_exclude_s: float = Field(
        default=120,
        ge=0,
        le=DAY_S,
        description="Seconds after an SGLang start whose observations are ignored (warm-up, "
        "empty caches); at most a day.",
    )


class ChooseSettings(BaseModel):
    """[choose]: which step counts specd may pick, and how it picks."""

    model_config = _table()

    min_steps: int = Field(
        default=1,
        ge=1,
        le=MAX_STEPS_ALLOWED,
        description="Fewest speculative steps allowed: of a static setting, and of an "
        "adaptive set's candidates unless the set is listed in adaptive_candidate_sets.",
    )
    max_steps: int = Field(
        default=6,
        ge=1,
        le=MAX_STEPS_ALLOWED,
        description="Most speculative steps allowed: of a static setting, and of an adaptive "
        "set's candidates unless the set is listed in adaptive_candidate_sets (the policy "
        "may choose those, SGLang's own reaching 7; so may a pin and a sweep).",
    )
    policy: Literal["bands", "model"] = Field(
        default="bands",
        description="Decision policy: concurrency bands or the throughput model. Unset, it "
        'is "model" when calibration_file is set, else "bands".',
    )
    calibration_file: Path | None = Field(
        default=None,
        description="Performance table (CSV: steps,concurrency,output_tok_s[,accept_length]"
        "[,max_running_requests], as `specd sweep` writes) the model policy starts from; "
        "absolute path, checked when the config loads.",
    )
    restart_cost_s: float = Field(
        default=100,
        ge=0,
        le=DAY_S,
        description="Serving time a restart of SGLang loses (model load + warm-up), seconds; "
        "the model policy charges it against a change. At most a day.",
    )
    band_quantile_ratio: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Quantile of busy-time offered concurrency that picks the band (0.5 = median).",
    )
    stabilization_window_s: float = Field(
        default=900,
        ge=0,
        le=WEEK_S,
        description="Seconds a recommendation must hold before it is acted on; at most a week.",
    )
    outcome_min_observed_s: float = Field(
        default=1800,
        ge=0,
        le=WEEK_S,
        description="Busy seconds (decayed) a step count specd changed to must be observed "
        "before its outcome can count as a regression (it served less than the step count "
        "before it, beyond noise, and so lost over the epoch it was predicted for); at most "
        "a week. Half an hour leaves a one-hour window time to go back in.",
    )
    regression_min_ratio: float = Field(
        default=0.02,
        ge=0,
        lt=1,
        description="A regression's shortfall (what the new step count served below the old "
        "one, relative) must also exceed this, on top of the prediction interval: what one "
        "step count serves varies with the day's prompts by about this much, which the "
        "calibration's noise does not cover. Also how far short of its candidates' rows a "
        "live adaptive set must serve before safe exploration measures step counts from it. "
        "Below 1.",
    )
    regression_avoid_s: float = Field(
        default=WEEK_S,
        ge=0,
        le=90 * DAY_S,
        description="Seconds a step count that regressed stays on the avoid list (the policy "
        "skips it); at most 90 days.",
    )
    regression_lift_mix_ratio: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="A step count that regressed is avoided, and specd goes back from it, "
        "only while the forecast's mix of offered concurrency is within this (total "
        "variation distance: 0 the same traffic, 1 none in common) of the mix it regressed "
        "under. At most 1.",
    )
    tolerance_ratio: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="Bands policy: relative distance past a band boundary a change must beat; "
        "below 1.",
    )
    min_gain_ratio: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Model policy: minimum relative gain (net of the restart) a change must "
        "also beat, on top of the prediction interval; 0 lets the evidence decide. Below 1.",
    )
    calibration_noise_ratio: float = Field(
        default=0.01,
        ge=0,
        le=0.5,
        description="Model policy: relative standard error of a calibration point (sweep "
        "noise); observation at a step count shrinks it. At most 0.5.",
    )
    min_forecast_seen_ratio: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Model policy: share of the coming epoch whose traffic must be forecast "
        "from those hours of the day as seen before (on any day) for a change or an "
        "exploration, once the hours seen show a daily rhythm (they differ from recent "
        "traffic); the rest is forecast from recent traffic alone, which cannot know the "
        "hours of such a rhythm not seen yet: then a change goes only to the setting whose "
        "worst loss is least if those hours are like the quietest or the busiest hour seen, "
        "and surely less than the live one's. Steady traffic so far is trusted, but while "
        "less than this share is seen a change goes to the shallowest setting (most room "
        "for requests) the prediction interval cannot tell from the top one. Going back "
        "from a regression is never held. 0 turns both off; at most 1.",
    )
    explore_max_loss_ratio: float = Field(
        default=0.01,
        ge=0,
        lt=1,
        description="Model policy: safe exploration runs one epoch at a step count it cannot "
        "tell apart from the live one (or never observed) only if its predicted tokens over "
        "that epoch, net of the restart, are at most this ratio below the live one's. Below 1.",
    )
    explore_max_per_week: int = Field(
        default=2,
        ge=0,
        le=16,
        description="Model policy: explorations allowed per rolling 7 days (never more than "
        "one per step count); 0 turns exploration off. At most 16.",
    )

    kinds: tuple[Literal["off", "static", "adaptive"], ...] = Field(
        default=("off", "static", "adaptive"),
        min_length=1,
        description='Kinds of setting the model policy may choose for the epoch ahead: "off" '
        '(no speculation), "static" (K steps in min_steps..max_steps) and "adaptive" '
        "(SGLang's --speculative-adaptive with one of adaptive_candidate_sets). Each only "
        "where the server runs it, the unit's ExecStart= can be given it and the calibration "
        "can predict it (off: a steps-0 row; a set: a row per step count); `specd doctor` "
        'says why not. ["static"] chooses step counts only. Each kind once.',
    )
    adaptive_candidate_sets: tuple[str, ...] = Field(
        default=DEFAULT_ADAPTIVE_SETS,
        min_length=1,
        max_length=MAX_ADAPTIVE_SETS,
        description='Adaptive settings the model policy may consider, as "adaptive:1,3,5" '
        "(one candidate list for every batch size) or with per-batch slots "
        '"adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3" (0 = no drafting in that slot); candidates '
        "ascending, unique. The default starts with SGLang's own default config. At most "
        f"{MAX_ADAPTIVE_SETS}; each step count of a set listed here must be a row of the "
        "calibration table (a default set it lacks rows for is left out).",
    )
    adaptive_restart_extra_s_per_candidate: float = Field(
        default=20,
        ge=0,
        le=HOUR_S,
        description="Serving time an adaptive setting's restart loses per candidate step "
        "count beyond the first, seconds: SGLang captures one set of CUDA graphs per "
        "candidate at start. At most an hour.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_policy(cls, data: Any) -> Any:
        # A calibration is what the model policy needs: once one is configured, the model
        # is the default; an explicit `policy` always wins.
        if isinstance(data, dict) and data.get("policy") is None:
            data = dict(data)
            data["policy"] = "model" if data.get("calibration_file") else "bands"
        return data

    _calibration_absolute = field_validator("calibration_file")(_absolute)

    @model_validator(mode="after")
    def _range(self) -> ChooseSettings:
        if self.min_steps > self.max_steps:
            raise Problems(
                [
                    (
                        f"min_steps ({self.min_steps}) > max_steps ({self.max_steps})",
                        ("choose.min_steps", "choose.max_steps"),
                    )
                ]
            )
        return self

    @field_validator("kinds", mode="before")
    @classmethod
    def _few_kinds(cls, value: Any) -> Any:
        return _at_most(value, 3, "kinds", "off, static and adaptive, each once")

    @field_validator("kinds")
    @classmethod
    def _kinds(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"kinds {list(value)} name a kind twice")
        return value

    @field_validator("adaptive_candidate_sets")
    @classmethod
    def _adaptive_sets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        seen: set[str] = set()
        for text in value:
            try:
                setting = parse_setting(text)
            except ValueError as exc:
                raise ValueError(str(exc)) from None
            if setting.kind != "adaptive":
                raise ValueError(f"{text!r} is not an adaptive setting such as 'adaptive:1,3,5'")
            canonical = format_setting(setting)
            # Written in another order, the same set would be two names for one setting.
            if canonical != text.strip():
                raise ValueError(f"{text!r}: write it as {canonical!r} (ascending, no spaces)")
            if canonical in seen:
                raise ValueError(f"{text!r} is listed twice")
            if setting.max_steps > MAX_STEPS_ALLOWED:
                raise ValueError(f"{text!r}: step counts must be at most {MAX_STEPS_ALLOWED}")
            seen.add(canonical)
        # As written, less the spaces around it: a set is matched by its text (a pin of a
        # listed set; `setting.outside_steps`).
        return tuple(text.strip() for text in value)


class RestartSettings(BaseModel):
    """[restart]: when and how carefully specd restarts SGLang."""

    model_config = _table()

    min_dwell_s: float = Field(
        default=HOUR_S,
        ge=0,
        le=30 * DAY_S,
        description="Minimum seconds between restarts; at most 30 days. Going back from a "
        "change that regressed against its prediction, in the window it was made in, is not "
        "held by it (it stops the policy flapping; that is the change's own outcome).",
    )
    daily_restart_budget: int = Field(
        default=4,
        ge=0,
        le=1440,
        description="Automatic SGLang restarts allowed per rolling 24 hours: each restart "
        "specd issues counts (a change 1, a change and its rollback 2, 1 where the change's "
        "own start ran no SGLang: refused for the start limit, or not set up by systemd), "
        "none where SGLang was not restarted; at most 1440 (one a minute: a restart takes "
        "longer than that).",
    )
    quiet_concurrency_max: int = Field(
        default=2,
        ge=0,
        le=100_000,
        description="A quiet moment: offered concurrency at or below this.",
    )
    quiet_deadline_s: float = Field(
        default=600,
        ge=0,
        le=DAY_S,
        description="Seconds to wait for a quiet moment inside the window before restarting "
        "anyway (still inside the window); at most a day.",
    )
    startup_timeout_s: float = Field(
        default=600,
        gt=0,
        le=DAY_S,
        description="Seconds to wait for /health_generate after a restart before rolling "
        "back; at most a day (the largest models load in well under an hour).",
    )
    health_probe_timeout_s: float = Field(
        default=30,
        ge=25,
        le=10 * MINUTE_S,
        description="Timeout of one /health_generate probe, seconds (SGLang's own is 20); at "
        "most 10 minutes.",
    )
    health_poll_interval_s: float = Field(
        default=2.0,
        gt=0,
        le=MINUTE_S,
        description="Seconds between looks while a restart runs: at /health_generate while "
        "SGLang loads, between the reads that verify its setting, and at the gateway while "
        "the worker is re-added; at most a minute.",
    )
    restart_command_timeout_s: float = Field(
        default=420,
        gt=0,
        le=DAY_S,
        description=(
            "Timeout of `systemctl restart`, seconds. Must exceed the SGLang unit's "
            "TimeoutStopSec= (5 min in the example unit): on SIGTERM SGLang drains running "
            "requests with no deadline, so under load the stop lasts that long. At most a "
            "day, so a restart that hangs is still rolled back."
        ),
    )


class FleetSettings(BaseModel):
    """[fleet]: at most ``slots`` servers of a ``group`` restart at once, through etcd.

    Present: a restart first takes one of the group's slots (a key under an etcd lease),
    keeps the lease alive while it runs and releases it at the end; no etcd answer or no
    free slot means no restart. Absent: this server restarts on its own window alone."""

    model_config = _table()

    etcd_endpoints: list[str] = Field(
        min_length=1,
        max_length=16,
        description="Base URL of each etcd member's client API (its v3 JSON gateway), e.g. "
        "['http://10.0.0.5:2379']; tried in order, one that fails tried last after; at "
        "most 16.",
    )
    group: str = Field(
        description="The servers that share slots: the same name on every specd of a fleet "
        "(letters, digits, '.', '_', '-'; at most 64).",
    )
    slots: int = Field(
        default=1, ge=1, le=64, description="How many servers of the group may restart at once."
    )
    lease_ttl_s: float = Field(
        default=30,
        ge=5,
        le=HOUR_S,
        description="TTL of the slot's etcd lease, seconds, renewed every third of it while "
        "a restart runs: a specd that dies frees its slot this long after. 5 s to an hour.",
    )
    etcd_timeout_s: float = Field(
        default=5,
        gt=0,
        le=10,
        description="Timeout of one etcd request (over all endpoints), seconds; at most 10, "
        "so the few requests of one try for a slot stay well inside specd's watchdog.",
    )
    slot_wait_max_s: float = Field(
        default=1800,
        ge=0,
        le=DAY_S,
        description="Longest wait for a free slot, seconds; a closing window ends the wait "
        "sooner (the change waits for the next window). At most a day.",
    )
    slot_poll_interval_s: float = Field(
        default=2,
        gt=0,
        le=MINUTE_S,
        description="Seconds between tries for a slot while all are held; at most a minute.",
    )
    holder_name: str | None = Field(
        default=None,
        max_length=200,
        description="How this specd names itself in the slot it holds (`specd status` shows "
        "it); omit for the host name and SGLang unit.",
    )

    @field_validator("etcd_endpoints")
    @classmethod
    def _endpoints(cls, value: list[str]) -> list[str]:
        urls = [_http_url(u) for u in value]
        for url in urls:
            # specd adds the API's own path (/v3/...): a path here would double it.
            parsed = urllib.parse.urlsplit(url)
            if parsed.path or parsed.query or parsed.fragment:
                raise ValueError(f"{url!r}: an etcd endpoint is scheme://host:port, without a path")
        if len(set(urls)) != len(urls):
            raise ValueError("each etcd endpoint may be listed once")
        return urls

    @field_validator("group")
    @classmethod
    def _group(cls, value: str) -> str:
        # Part of an etcd key: no '/' (another group's prefix) and nothing to escape.
        if not _GROUP.match(value):
            raise ValueError(
                f"{value!r} is not a group name (letters, digits, '.', '_', '-'; at most 64)"
            )
        return value


class GatewaySettings(BaseModel):
    """[gateway]: the SGLang model gateway (smg) replicas that route to this server.

    Present: every restart is preceded by a drain on every replica and followed by a re-add;
    a replica that cannot be reached blocks the restart. Absent: restarts wait for a quiet
    moment instead (``[restart]``)."""

    model_config = _table()

    urls: list[str] = Field(
        min_length=1,
        max_length=16,
        description="Base URL of each gateway replica's admin API, e.g. "
        "['http://10.0.0.2:30080']; at most 16.",
    )
    worker_url: str | None = Field(
        default=None,
        description="The URL the gateway routes to this server by (its worker's `url`); "
        "omit when it is [sglang] url.",
    )
    api_key_file: Path | None = Field(
        default=None,
        description="File holding the gateway's admin API key (sent as a bearer token); omit "
        "when the gateway needs none. Absolute path; keep it mode 0600.",
    )
    drain_timeout_s: float = Field(
        default=300,
        gt=0,
        le=DAY_S,
        description="After the drain, seconds to wait for SGLang to report no running and no "
        "queued request; not idle by then: no restart, the worker is re-added. At most a day.",
    )
    ready_timeout_s: float = Field(
        default=120,
        gt=0,
        le=DAY_S,
        description="Seconds to wait for every replica to report the re-added worker ready "
        "(also for a draining entry to be gone first); at most a day.",
    )
    request_timeout_s: float = Field(
        default=5,
        gt=0,
        le=MINUTE_S,
        description="Timeout of one admin API call to a replica, seconds; at most a minute.",
    )

    @field_validator("urls")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        urls = [_http_url(u) for u in value]
        if len(set(urls)) != len(urls):
            raise ValueError("each gateway replica may be listed once")
        return urls

    @field_validator("worker_url")
    @classmethod
    def _worker_url(cls, value: str | None) -> str | None:
        return None if value is None else _http_url(value)

    _api_key_file_absolute = field_validator("api_key_file")(_absolute)


class ReportSettings(BaseModel):
    """[report]: specd's own /metrics and logs."""

    model_config = _table()

    metrics_listen_address: str = Field(
        default="127.0.0.1", description="Address specd's /metrics listens on."
    )
    metrics_port: int = Field(
        default=9464, ge=0, le=65535, description="Port of specd's /metrics; 0 picks a free port."
    )
    log_format: Literal["json", "console"] = Field(
        default="json", description="Log lines as JSON (journald) or for a console."
    )

    @field_validator("metrics_listen_address")
    @classmethod
    def _address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            if not _HOSTNAME.match(value):
                raise ValueError(f"{value!r} is not an IP address or host name") from None
        return value


def _default_bands() -> list[Band]:
    return [Band(max_concurrency=4, steps=4), Band(steps=3)]


def _default_windows() -> list[Window]:
    return [Window(cron="0 3 * * mon-sun", duration_s=3600, timezone="UTC")]


class Settings(BaseModel):
    """specd's settings, table by table (``settings.observe.scrape_interval_s``)."""

    model_config = _table()

    sglang: SGLangSettings = Field(default_factory=SGLangSettings)
    files: FilesSettings = Field(default_factory=FilesSettings)
    observe: ObserveSettings = Field(default_factory=ObserveSettings)
    choose: ChooseSettings = Field(default_factory=ChooseSettings)
    restart: RestartSettings = Field(default_factory=RestartSettings)
    report: ReportSettings = Field(default_factory=ReportSettings)
    fleet: FleetSettings | None = Field(
        default=None,
        description="The fleet this server restarts in turn with; absent or empty: none.",
    )
    gateway: GatewaySettings | None = Field(
        default=None, description="The model gateway in front of SGLang; absent: none."
    )
    bands: list[Band] = Field(
        default_factory=_default_bands,
        description="Bands of offered concurrency → steps, by ascending max_concurrency; "
        f"the last has no max_concurrency. At most {MAX_BANDS}.",
    )
    windows: list[Window] = Field(
        default_factory=_default_windows,
        min_length=1,
        description="Maintenance windows; automatic restarts happen only inside one. At most "
        f"{MAX_WINDOWS}: each is read at every tick (one cron covers several days, as "
        "'0 3 * * mon-fri').",
    )

    @field_validator("bands", mode="before")
    @classmethod
    def _few_bands(cls, value: Any) -> Any:
        return _at_most(value, MAX_BANDS, "bands", "a band per step count is the most needed")

    @field_validator("windows", mode="before")
    @classmethod
    def _few_windows(cls, value: Any) -> Any:
        return _at_most(
            value,
            MAX_WINDOWS,
            "windows",
            "each is read at every tick; one cron covers several days, as '0 3 * * mon-fri'",
        )

    @field_validator("fleet", mode="before")
    @classmethod
    def _empty_fleet(cls, value: Any) -> Any:
        # The example file shows [fleet] with every key commented out: an empty table is
        # no fleet, as an absent one is.
        return None if value == {} else value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        # Each problem with the keys it is about: a SPECD_* variable may have set one.
        problems: list[tuple[str, tuple[str, ...]]] = []
        catch_alls = [i for i, b in enumerate(self.bands) if b.max_concurrency is None]
        if not self.bands:
            problems.append(("bands: at least one band is needed", ("bands",)))
        elif catch_alls != [len(self.bands) - 1]:
            problems.append(
                (
                    "bands: exactly one band, the last, must omit max_concurrency (the catch-all)",
                    ("bands",),
                )
            )
        bounds = [b.max_concurrency for b in self.bands if b.max_concurrency is not None]
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            problems.append(
                ("bands: max_concurrency must strictly increase from band to band", ("bands",))
            )
        lo, hi = self.choose.min_steps, self.choose.max_steps
        for i, band in enumerate(self.bands):
            if not lo <= band.steps <= hi:
                problems.append(
                    (
                        f"bands[{i}].steps: {band.steps} is outside choose.min_steps..max_steps "
                        f"({lo}..{hi})",
                        ("bands", "choose.min_steps", "choose.max_steps"),
                    )
                )
        if problems:
            raise Problems(problems)
        return self


def _table_model(annotation: Any) -> type[BaseModel] | None:
    """The table's model, also for an optional table (``GatewaySettings | None``)."""
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


# The tables, by their TOML name, and the keys each holds.
# (Read-only, as all of the core's module state.)
TABLES: Mapping[str, type[BaseModel]] = MappingProxyType(
    {
        name: model
        for name, field in Settings.model_fields.items()
        if name not in ("bands", "windows")
        and (model := _table_model(field.annotation)) is not None
    }
)
ARRAYS: Mapping[str, type[BaseModel]] = MappingProxyType({"bands": Band, "windows": Window})
TABLE_OF_KEY: Mapping[str, str] = MappingProxyType(
    {key: table for table, model in TABLES.items() for key in model.model_fields}
)
# Keys of the flat config before the tables, whose name changed on the way into one.
RENAMED_KEYS: Mapping[str, tuple[str, str]] = MappingProxyType(
    {"sglang_url": ("sglang", "url"), "sglang_unit": ("sglang", "unit")}
)
