"""A speculative setting as a value: off, static K, or SGLang's adaptive mode.

Pure: parsing the operator form, SGLang's argument list and adaptive config body, and
which kinds a given server can run (with the reason when it cannot).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from specd.core.observation import MAX_STEPS
from specd.core.sglang_features import (
    ADAPTIVE_SLOT_ZERO,
    ADAPTIVE_SLOTS,
    parse_version,
)
from specd.core.sglang_features import version_text as _version_text
from specd.core.text import printable

Kind = Literal["off", "static", "adaptive"]

KINDS: tuple[Kind, ...] = ("off", "static", "adaptive")

# SGLang's adaptive mode is implemented for these chain drafters only.
ADAPTIVE_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN"})

# Per-batch-size slots in the adaptive config arrived in 0.5.13; a 0 ("no drafting") tier
# inside a slot in 0.5.14.
SLOTS_VERSION = ADAPTIVE_SLOTS.since
SLOT_ZERO_VERSION = ADAPTIVE_SLOT_ZERO.since

MAX_CANDIDATES = 8  # one CUDA-graph set per candidate: more is a startup and memory bill
MAX_SLOTS = 16
MAX_BATCH_SIZE = 65536


@dataclass(frozen=True)
class SpecSetting:
    """One speculative setting. Build through off()/static()/adaptive() or parse()."""

    kind: Kind
    steps: int | None = None  # static only
    candidates: tuple[int, ...] = ()  # adaptive only: sorted, unique
    slots: tuple[tuple[int, tuple[int, ...]], ...] = ()  # adaptive: (min batch size, candidates)

    def __post_init__(self) -> None:
        if self.kind == "off":
            if self.steps is not None or self.candidates or self.slots:
                raise ValueError("an 'off' setting has no steps or candidates")
        elif self.kind == "static":
            if self.steps is None or not 1 <= self.steps <= MAX_STEPS:
                raise ValueError(f"static steps must be 1..{MAX_STEPS}, not {self.steps}")
            if self.candidates or self.slots:
                raise ValueError("a static setting has no candidates")
        elif self.kind == "adaptive":
            if self.steps is not None:
                raise ValueError("an adaptive setting has candidates, not steps")
            _check_candidates(self.candidates, zero_ok=False, where="adaptive candidates")
            if len(self.slots) > MAX_SLOTS:
                raise ValueError(
                    f"adaptive setting has {len(self.slots)} slots, at most {MAX_SLOTS}"
                )
            sizes = [size for size, _ in self.slots]
            if sizes != sorted(set(sizes)):
                raise ValueError("adaptive slots must have distinct batch sizes in ascending order")
            for size, cands in self.slots:
                if not 1 <= size <= MAX_BATCH_SIZE:
                    raise ValueError(
                        f"adaptive slot batch size must be 1..{MAX_BATCH_SIZE}, not {size}"
                    )
                _check_candidates(cands, zero_ok=True, where=f"adaptive slot {size}")
                if not set(cands) - {0} <= set(self.candidates):
                    raise ValueError(
                        f"adaptive slot {size} uses steps outside the candidates "
                        f"{_join(self.candidates)}"
                    )
            # SGLang builds graphs for the union of the slots: a candidate no slot uses would
            # be a different setting than the one written.
            used = {step for _, cands in self.slots for step in cands} - {0}
            if self.slots and used != set(self.candidates):
                raise ValueError(
                    f"adaptive candidates {_join(self.candidates)} are not the steps its slots use"
                )
        else:
            raise ValueError(f"unknown setting kind {self.kind!r}")

    @property
    def max_steps(self) -> int:
        """The deepest step count this setting can run (KV and graphs are sized for it)."""
        if self.kind == "static":
            assert self.steps is not None
            return self.steps
        if self.kind == "adaptive":
            return max(self.candidates)
        return 0

    @property
    def table_steps(self) -> frozenset[int]:
        """The step counts a table must have to predict this setting: K, 0 for off, an
        adaptive set's candidates and its slots' tiers (0: no drafting)."""
        if self.kind != "adaptive":
            return frozenset({self.max_steps})
        return frozenset(self.candidates).union(*(cands for _, cands in self.slots))

    @property
    def uses_slot_zero(self) -> bool:
        return any(0 in cands for _, cands in self.slots)

    def allows_live_steps(self, steps: int) -> bool:
        """Whether a live `sglang:spec_num_steps` reading fits this setting."""
        if self.kind == "static":
            return steps == self.steps
        if self.kind == "adaptive":
            return steps in self.candidates or (steps == 0 and self.uses_slot_zero)
        return steps == 0


def off() -> SpecSetting:
    return SpecSetting("off")


def static(steps: int) -> SpecSetting:
    return SpecSetting("static", steps=steps)


def adaptive(
    candidates: tuple[int, ...] | list[int],
    slots: Mapping[int, tuple[int, ...] | list[int]] | None = None,
) -> SpecSetting:
    ordered = tuple(sorted(set(candidates)))
    slot_items = tuple(
        (size, tuple(sorted(set(cands)))) for size, cands in sorted((slots or {}).items())
    )
    if len(ordered) != len(tuple(candidates)):
        raise ValueError(f"adaptive candidates repeat a step count: {_join(tuple(candidates))}")
    return SpecSetting("adaptive", candidates=ordered, slots=slot_items)


def _check_candidates(cands: tuple[int, ...], *, zero_ok: bool, where: str) -> None:
    low = 0 if zero_ok else 1
    if not cands:
        raise ValueError(f"{where} are empty")
    if len(cands) > MAX_CANDIDATES:
        raise ValueError(f"{where} list {len(cands)} step counts, at most {MAX_CANDIDATES}")
    if list(cands) != sorted(set(cands)):
        raise ValueError(f"{where} must be distinct and ascending")
    for value in cands:
        if not low <= value <= MAX_STEPS:
            raise ValueError(f"{where} must be step counts {low}..{MAX_STEPS}, not {value}")


def _join(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def _ints(text: str, where: str) -> tuple[int, ...]:
    parts = text.split(",")
    if any(not re.fullmatch(r"\d{1,5}", p.strip()) for p in parts):
        raise ValueError(f"{where}: {text!r} is not a comma-separated list of step counts")
    return tuple(int(p) for p in parts)


# Pure and keyed by the text: the policy parses [choose] adaptive_candidate_sets at every
# tick. Bounded; a ValueError is raised again, never cached.
@functools.lru_cache(maxsize=256)
def parse(text: str) -> SpecSetting:
    """Parse the operator form: "off", "4" (or "static:4"), "adaptive:1,3,5" or with per-batch
    slots "adaptive:1,3,5/1=1,3,5;8=0,1,3". Raises ValueError with a one-line message."""
    raw = text.strip()
    where = f"setting {text!r}"
    if raw.lower() == "off":
        return off()
    body = raw[len("static:") :] if raw.lower().startswith("static:") else raw
    if re.fullmatch(r"\d{1,5}", body):
        try:
            return static(int(body))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    if raw.lower().startswith("adaptive:"):
        spec = raw[len("adaptive:") :]
        cand_text, _, slot_text = spec.partition("/")
        candidates = _ints(cand_text, where)
        slots: dict[int, tuple[int, ...]] = {}
        if slot_text:
            for item in slot_text.split(";"):
                size_text, eq, cands_text = item.partition("=")
                if not eq or not re.fullmatch(r"\d{1,5}", size_text.strip()):
                    raise ValueError(f"{where}: slot {item!r} is not BATCH=STEPS,STEPS,...")
                size = int(size_text)
                if size in slots:
                    raise ValueError(f"{where}: slot {size} is given twice")
                slots[size] = _ints(cands_text, where)
        try:
            return adaptive(candidates, slots)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    raise ValueError(f"{where} is not 'off', a step count such as '4', or 'adaptive:1,3,5'")


@functools.lru_cache(maxsize=256)  # pure, keyed by the frozen setting: labels every tick
def format_setting(setting: SpecSetting) -> str:
    """The operator form; parse(format_setting(s)) == s."""
    if setting.kind == "off":
        return "off"
    if setting.kind == "static":
        return str(setting.steps)
    text = "adaptive:" + _join(setting.candidates)
    if setting.slots:
        text += "/" + ";".join(f"{size}={_join(c)}" for size, c in setting.slots)
    return text


# What rules out a set whose candidates leave min_steps..max_steps (`outside_steps`), as
# every refusal of one says it.
UNLISTED_SET = "the set is not one of [choose] adaptive_candidate_sets"


def outside_steps(
    setting: SpecSetting, low: int, high: int, listed: Sequence[str] = ()
) -> tuple[int, ...]:
    """The step counts of ``setting`` outside ``low``..``high`` (min_steps..max_steps) that
    rule it out, () when none: a static K's own; an adaptive set's candidates unless the set
    is one of ``listed`` (adaptive_candidate_sets: the policy chooses those whatever their
    depth, SGLang's own set reaching 7, so a pin and a sweep may run them too); off none."""
    if setting.kind == "off" or (setting.kind == "adaptive" and format_setting(setting) in listed):
        return ()
    counts = setting.candidates if setting.kind == "adaptive" else (setting.steps or 0,)
    return tuple(k for k in counts if not low <= k <= high)


@functools.lru_cache(maxsize=256)  # a sha256 per candidate per tick otherwise
def setting_key(setting: SpecSetting) -> int:
    """One int per setting, for what records a choice as a number (the stabilization
    window's recommendations, kept in the state file): a static K is K, off is 0, an
    adaptive setting a negative number fixed by its content."""
    if setting.kind == "static":
        assert setting.steps is not None
        return setting.steps
    if setting.kind == "off":
        return 0
    digest = hashlib.sha256(format_setting(setting).encode()).hexdigest()
    return -1 - int(digest[:12], 16)


def adaptive_config(setting: SpecSetting, *, slots_supported: bool = True) -> dict[str, object]:
    """The JSON body of --speculative-adaptive-config for an adaptive setting.

    SGLang (adaptive_spec_params.py) reads an object whose integer-string keys are batch-size
    slots, each {"candidate_steps": [...]}, and routes a batch to the closest slot; other keys
    are global tuning (left at SGLang's defaults here). Without slots one slot "1" carries the
    candidates for every batch size. Before 0.5.13 the file had no slots: a flat candidate list.
    """
    if setting.kind != "adaptive":
        raise ValueError(f"setting {format_setting(setting)} is not adaptive")
    if not slots_supported:
        if setting.slots:
            raise ValueError(f"setting {format_setting(setting)} needs per-batch slots")
        return {"candidate_steps": list(setting.candidates)}
    slots = setting.slots or ((1, setting.candidates),)
    return {str(size): {"candidate_steps": list(c)} for size, c in slots}


def adaptive_config_text(setting: SpecSetting, *, slots_supported: bool = True) -> str:
    """Canonical bytes of the config: the same setting always gives the same file."""
    body = adaptive_config(setting, slots_supported=slots_supported)
    return json.dumps(body, sort_keys=True, separators=(",", ":")) + "\n"


@functools.lru_cache(maxsize=256)  # pure: a JSON text and a sha256 per set per tick otherwise
def adaptive_config_name(setting: SpecSetting, *, slots_supported: bool = True) -> str:
    """File name keyed by content, so a restart never reads a half-replaced config."""
    text = adaptive_config_text(setting, slots_supported=slots_supported)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"adaptive-{digest}.json"


def config_key(config_path: str) -> int:
    """The key under which the history records what an adaptive server reading
    ``config_path`` serves: a negative int fixed by the file's name (specd names the files it
    writes by their content, `adaptive_config_name`), so one adaptive set is one setting
    however `sglang:spec_num_steps` moves among its candidates."""
    name = config_path.rstrip("/").rsplit("/", 1)[-1]
    digest = hashlib.sha256(name.encode()).hexdigest()
    return -1 - int(digest[:12], 16)


@functools.lru_cache(maxsize=256)  # pure: the model reads each set's keys at every tick
def observed_keys(setting: SpecSetting) -> tuple[int, ...]:
    """The history keys of what ``setting`` served: its K (0: off); an adaptive set's
    `config_key` of each file name it may run under (with and without per-batch slots)."""
    if setting.kind != "adaptive":
        return (setting.max_steps,)
    names = [adaptive_config_name(setting)]
    if not setting.slots:
        names.append(adaptive_config_name(setting, slots_supported=False))
    return tuple(config_key(n) for n in names)


def plain_word(text: str) -> bool:
    """Whether ``text`` passes whole through the env file into SGLang's command line: no
    whitespace or control character (which split it), no quote, backslash or $ (which
    systemd's EnvironmentFile= and ExecStart= parsing take away or expand)."""
    return bool(text) and not any(c.isspace() or not c.isprintable() or c in "\"'\\$" for c in text)


def sglang_args(
    setting: SpecSetting, *, algorithm: str, config_path: str | None = None
) -> tuple[str, ...]:
    """The speculative part of SGLang's command line for this setting."""
    if setting.kind == "off":
        return ()
    if not algorithm or not re.fullmatch(r"[A-Z0-9_]+", algorithm):
        raise ValueError(f"speculative algorithm {algorithm!r} is not an SGLang algorithm name")
    if setting.kind == "static":
        assert setting.steps is not None
        return (
            "--speculative-algorithm", algorithm,
            "--speculative-num-steps", str(setting.steps),
            "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(setting.steps + 1),
        )  # fmt: skip
    if config_path is None or not config_path.startswith("/") or not plain_word(config_path):
        raise ValueError(
            f"adaptive config path {config_path!r} must be absolute, without spaces, quotes, "
            "backslashes or $"
        )
    # The deepest candidate sizes the static arguments SGLang validates at start.
    top = setting.max_steps
    return (
        "--speculative-algorithm", algorithm,
        "--speculative-num-steps", str(top),
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(top + 1),
        "--speculative-adaptive",
        "--speculative-adaptive-config", config_path,
    )  # fmt: skip


def runs_adaptive_config(setting: SpecSetting, config_path: str | None) -> bool:
    """Whether an adaptive server reading ``config_path`` runs ``setting``: specd names the
    files it writes by their content (`adaptive_config_name`), so the name says which."""
    if setting.kind != "adaptive" or not config_path:
        return False
    name = config_path.rstrip("/").rsplit("/", 1)[-1]
    names = {adaptive_config_name(setting)}
    if not setting.slots:
        names.add(adaptive_config_name(setting, slots_supported=False))
    return name in names


@dataclass(frozen=True)
class ServerTraits:
    """What decides which settings a server can run, as its /server_info reports it."""

    algorithm: str | None
    topk: int | None
    dp_attention: bool
    multi_layer_eagle: bool
    two_batch_overlap: bool
    pdmux: bool
    version: tuple[int, int, int] | None


def traits_from_server_info(info: Mapping[str, object]) -> ServerTraits:
    algorithm = info.get("speculative_algorithm")
    topk = info.get("speculative_eagle_topk")
    return ServerTraits(
        algorithm=algorithm.upper() if isinstance(algorithm, str) and algorithm else None,
        topk=topk if isinstance(topk, int) and not isinstance(topk, bool) else None,
        dp_attention=info.get("enable_dp_attention") is True,
        multi_layer_eagle=info.get("enable_multi_layer_eagle") is True,
        two_batch_overlap=info.get("enable_two_batch_overlap") is True,
        pdmux=info.get("enable_pdmux") is True,
        version=parse_version(info.get("version")),
    )


def unavailable(setting: SpecSetting, traits: ServerTraits, *, allow_off: bool) -> str | None:
    """Why this server cannot run the setting, or None when it can."""
    if setting.kind == "off":
        return None if allow_off else "the operator does not allow 'off' ([choose] kinds)"
    if traits.algorithm is None:
        return "the server has no speculative algorithm configured"
    if traits.topk is not None and traits.topk != 1:
        return f"the server drafts with topk {traits.topk}; specd runs chains (topk 1) only"
    if setting.kind == "static":
        return None
    if traits.algorithm not in ADAPTIVE_ALGORITHMS:
        # As SGLang's /server_info said it: shown, never run by a terminal.
        algorithm = printable(traits.algorithm)
        return f"SGLang's adaptive mode needs EAGLE, EAGLE3 or NEXTN, not {algorithm}"
    if traits.dp_attention:
        return "SGLang's adaptive mode does not run with DP attention"
    if traits.multi_layer_eagle:
        return "SGLang's adaptive mode does not run with multi-layer EAGLE"
    if traits.two_batch_overlap:
        return "SGLang's adaptive mode does not run with two-batch overlap"
    if traits.pdmux:
        return "SGLang's adaptive mode does not run with PD multiplexing"
    if setting.slots:
        need = SLOT_ZERO_VERSION if setting.uses_slot_zero else SLOTS_VERSION
        what = "step 0 in a slot" if setting.uses_slot_zero else "per-batch slots"
        if traits.version is None:
            return f"{what} need SGLang >= {_version_text(need)}; the server's version is unknown"
        if traits.version < need:
            return (
                f"{what} need SGLang >= {_version_text(need)}; "
                f"the server runs {_version_text(traits.version)}"
            )
    return None


def kinds_available(traits: ServerTraits, *, allow_off: bool) -> dict[Kind, str | None]:
    """Each kind with the reason it is unavailable (None = available), for doctor/status."""
    probes: dict[Kind, SpecSetting] = {
        "off": off(),
        "static": static(1),
        "adaptive": adaptive((1,)),
    }
    return {kind: unavailable(probe, traits, allow_off=allow_off) for kind, probe in probes.items()}


def mismatch(
    setting: SpecSetting, info: Mapping[str, object], live_steps: int | None
) -> str | None:
    """After a restart: why the server is not running `setting`, or None when it is.

    `info` is /server_info; `live_steps` is `sglang:spec_num_steps` (None when unknown)."""
    algorithm = info.get("speculative_algorithm")
    adaptive_on = info.get("speculative_adaptive") is True
    if setting.kind == "off":
        if algorithm:
            return f"asked for off, the server still runs speculative algorithm {algorithm}"
        return None
    if not algorithm:
        return f"asked for {format_setting(setting)}, the server runs no speculative algorithm"
    if setting.kind == "static":
        if adaptive_on:
            return f"asked for static {setting.steps}, the server runs adaptive mode"
        steps = info.get("speculative_num_steps")
        if steps != setting.steps:
            return f"asked for static {setting.steps}, /server_info reports {steps} steps"
        return None
    if not adaptive_on:
        return f"asked for {format_setting(setting)}, /server_info shows adaptive mode off"
    if live_steps is not None and not setting.allows_live_steps(live_steps):
        return (
            f"asked for {format_setting(setting)}, the server runs {live_steps} steps, "
            "outside the candidates"
        )
    return None


def _basename(path: object) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1] if path else "SGLang's default slots"


def describe_args(words: Sequence[str]) -> str:
    """What SGLang runs with these speculative words (specd's env file, a drop-in's
    default), in the words ``describe_server`` uses for a running server."""
    if "--speculative-algorithm" not in words:
        return "no speculation"
    values = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}
    if "--speculative-adaptive" in words:
        return f"adaptive ({_basename(values.get('--speculative-adaptive-config'))})"
    return f"{values.get('--speculative-num-steps', '?')} steps"


def describe_server(info: Mapping[str, object]) -> str:
    """What a running SGLang runs, from its /server_info (see ``describe_args``)."""
    algorithm = info.get("speculative_algorithm")
    if not algorithm or str(algorithm).upper() == "NONE":
        return "no speculation"
    if info.get("speculative_adaptive") is True:
        return f"adaptive ({_basename(info.get('speculative_adaptive_config'))})"
    return f"{info.get('speculative_num_steps', '?')} steps"
