"""SGLang's command line as install reads it: which speculative setup it runs, where SGLang
listens, and the same command with the step count taken from specd's variables."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specd.install.execline import Command, expand_argv, expand_word, whole_word_variable
from specd.install.layout import InstallError
from specd.io.apply import ENV_DRAFT_TOKENS, ENV_STEPS

# What specd's drop-in used before the variables left the SPECD_ settings prefix. An
# installation of that form is read as installed, and rewritten to today's names.
LEGACY_ENV_STEPS = "SPECD_SPEC_STEPS"
LEGACY_ENV_DRAFT_TOKENS = "SPECD_SPEC_DRAFT_TOKENS"
LEGACY_NAMES = {LEGACY_ENV_STEPS: ENV_STEPS, LEGACY_ENV_DRAFT_TOKENS: ENV_DRAFT_TOKENS}
SPECD_VARIABLES = frozenset({ENV_STEPS, ENV_DRAFT_TOKENS, *LEGACY_NAMES})

# SGLang's options that matter here. argparse (allow_abbrev) also accepts any unambiguous
# prefix; as these are a subset of SGLang's options, a prefix SGLang accepted and that
# matches one of them can only mean that one.
VALUE_OPTIONS = frozenset(
    {
        "--speculative-algorithm",
        "--speculative-draft-model-path",
        "--speculative-draft-model-revision",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
        "--speculative-accept-threshold-single",
        "--speculative-accept-threshold-acc",
        "--speculative-token-map",
        "--speculative-attention-mode",
        "--speculative-adaptive-config",
        "--host",
        "--port",
    }
)
SWITCH_OPTIONS = frozenset(
    {"--enable-metrics", "--enable-metrics-for-all-schedulers", "--speculative-adaptive"}
)
ALIASES = {"--speculative-draft-model": "--speculative-draft-model-path"}
_ALL_OPTIONS = VALUE_OPTIONS | SWITCH_OPTIONS | frozenset(ALIASES)
# Draft-model algorithms whose depth is --speculative-num-steps.
TUNABLE_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE"})
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
_BRACED = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Flag:
    """One option on the command line: where, how written, and its value."""

    name: str  # canonical (aliases and abbreviations resolved)
    index: int  # word index of the option
    inline: bool  # --flag=value
    value: str | None

    @property
    def value_index(self) -> int:
        return self.index if self.inline else self.index + 1


def _canonical(option: str) -> str | None:
    if option in _ALL_OPTIONS:
        return ALIASES.get(option, option)
    matches = {ALIASES.get(o, o) for o in _ALL_OPTIONS if o.startswith(option)}
    if len(matches) > 1:
        raise InstallError(
            f"{option} is an ambiguous abbreviation ({', '.join(sorted(matches))}); "
            "SGLang itself would refuse it"
        )
    return matches.pop() if matches else None


def find_flags(words: Sequence[str]) -> dict[str, Flag]:
    """The known options among the words (first-to-last; argparse keeps the last)."""
    flags: dict[str, Flag] = {}
    for i, word in enumerate(words):
        if not word.startswith("--") or word == "--":
            continue
        option, eq, value = word.partition("=")
        name = _canonical(option)
        if name is None:
            continue
        if name in SWITCH_OPTIONS:
            flags[name] = Flag(name, i, bool(eq), value if eq else None)
        elif eq:
            flags[name] = Flag(name, i, True, value)
        else:
            following = words[i + 1] if i + 1 < len(words) else None
            flags[name] = Flag(name, i, False, following)
    return flags


@dataclass(frozen=True)
class Speculation:
    """What install found in the live command line."""

    algorithm: str
    steps: int
    draft_tokens: int
    steps_flag: Flag
    draft_flag: Flag
    metrics: bool
    host: str
    port: int | None  # None: not read from the command (the operator gave --url)
    legacy: bool = False  # wired with the old SPECD_SPEC_* variables


def _int_value(flag: Flag, defaults: Mapping[str, str], environment: Mapping[str, str]) -> int:
    """The number SGLang gets for ``flag``. specd's own variables (and their old names) count
    as their ``Environment=`` default, today's value of a wired unit; any other ``${VAR}``
    comes from the unit's environment."""
    raw = flag.value or ""
    if whole_word_variable(raw) is not None:
        raise InstallError(
            f"{flag.name} has the value {raw!r}, which systemd splits into any number of "
            "words: write the number itself in ExecStart= (or ${VAR} in braces)"
        )
    braced = _BRACED.fullmatch(raw)
    if braced is not None and braced.group(1) in SPECD_VARIABLES:
        text = defaults.get(braced.group(1), "")
        if not text.isdigit():
            raise InstallError(
                f"{flag.name} is {raw} but the unit sets no default for it in Environment="
            )
        return int(text)
    text = expand_word(raw, environment)
    if not text.isdigit():
        shown = f"{raw!r}" if text == raw else f"{raw!r} (= {text!r} in the unit's environment)"
        raise InstallError(
            f"{flag.name} has the value {shown}: write the number itself in ExecStart="
        )
    return int(text)


def _port(unit: str, raw: Flag | None, flags: Mapping[str, Flag]) -> int:
    flag = flags.get("--port")
    text = str(DEFAULT_PORT) if flag is None else flag.value or ""
    if text.isdigit() and 0 < int(text) < 65536:
        return int(text)
    written = raw.value if raw is not None and raw.value is not None else text
    if "$" in written:
        raise InstallError(
            f"{unit} runs with --port {written!r}, which its environment makes {text!r}, "
            "not a TCP port: pass --url http://HOST:PORT"
        )
    raise InstallError(f"{unit} runs with --port {text!r}: not a TCP port")


def analyse(
    command: Command,
    environment: Mapping[str, str],
    unit: str,
    *,
    defaults: Mapping[str, str] | None = None,
    read_url: bool = True,
) -> Speculation:
    """The speculative setup of the command, or InstallError saying why specd cannot tune it.
    ``environment`` is what systemd runs the command with (Environment= and EnvironmentFile=);
    ``defaults`` the Environment= part alone (the drop-in's defaults; by default the same).
    A missing --enable-metrics is reported in ``metrics`` (install can add it)."""
    defaults = environment if defaults is None else defaults
    args = expand_argv(command.words, environment)
    flags = find_flags([a.text for a in args])  # what SGLang parses
    written = find_flags(command.words)  # where install can rewrite a value
    algorithm = flags.get("--speculative-algorithm")
    if algorithm is None or not algorithm.value:
        raise InstallError(
            f"{unit} runs without speculative decoding (no --speculative-algorithm in "
            "ExecStart=): specd has nothing to tune"
        )
    name = algorithm.value.upper()
    if name not in TUNABLE_ALGORITHMS:
        raise InstallError(
            f"{unit} uses --speculative-algorithm {algorithm.value}: specd tunes the step count "
            f"of {', '.join(sorted(TUNABLE_ALGORITHMS))} only"
        )
    adaptive = flags.get("--speculative-adaptive")
    if adaptive is not None and (adaptive.value or "true").lower() not in ("false", "0", "no"):
        raise InstallError(
            f"{unit} runs with --speculative-adaptive: SGLang already switches step counts "
            "itself and would fight specd; remove it (and --speculative-adaptive-config) first"
        )
    needed = (
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
    )
    missing = [f for f in needed if f not in flags]
    if missing:
        raise InstallError(
            f"{unit}: ExecStart= lacks {', '.join(missing)}; specd needs all three written out "
            "(--speculative-num-steps K --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens K+1)"
        )
    for option in ("--speculative-num-steps", "--speculative-num-draft-tokens"):
        arg = args[flags[option].index]
        if arg.split or option not in written or written[option].index != arg.source:
            variable = command.words[arg.source]
            raise InstallError(
                f"{unit}: {option} comes from {variable}, which specd cannot rewrite: write "
                "the option and its number on the ExecStart= line itself"
            )
    topk = flags["--speculative-eagle-topk"]
    if (topk.value or "").strip() != "1":
        raise InstallError(
            f"{unit} runs with --speculative-eagle-topk {topk.value}: specd applies chain "
            "drafting only (topk 1, draft tokens = steps + 1)"
        )
    steps_flag = written["--speculative-num-steps"]
    draft_flag = written["--speculative-num-draft-tokens"]
    steps = _int_value(steps_flag, defaults, environment)
    draft = _int_value(draft_flag, defaults, environment)
    if steps < 1:
        raise InstallError(f"{unit} runs with --speculative-num-steps {steps}: must be >= 1")
    legacy = any(
        _BRACED.fullmatch(f.value or "") is not None and (f.value or "")[2:-1] in LEGACY_NAMES
        for f in (steps_flag, draft_flag)
    )
    host_flag = flags.get("--host")
    host = host_flag.value if host_flag is not None and host_flag.value else DEFAULT_HOST
    port = _port(unit, written.get("--port"), flags) if read_url else None
    return Speculation(
        algorithm=algorithm.value,
        steps=steps,
        draft_tokens=draft,
        steps_flag=steps_flag,
        draft_flag=draft_flag,
        metrics="--enable-metrics" in flags,
        host=host,
        port=port,
        legacy=legacy,
    )


def sglang_url(host: str, port: int) -> str:
    """Where specd reaches SGLang: a wildcard listen address means loopback."""
    if host in ("0.0.0.0", "", "*"):  # noqa: S104 - mapping a bind-all address to loopback
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def wired_command(command: Command, spec: Speculation, add_metrics: bool) -> Command:
    """The command with the step count and draft tokens from specd's variables."""
    words = list(command.words)
    for flag, variable in ((spec.steps_flag, ENV_STEPS), (spec.draft_flag, ENV_DRAFT_TOKENS)):
        expansion = "${" + variable + "}"
        if flag.inline:
            words[flag.index] = words[flag.index].split("=", 1)[0] + "=" + expansion
        else:
            words[flag.index + 1] = expansion
    if add_metrics and not spec.metrics:
        words.append("--enable-metrics")
    return Command(command.prefix, tuple(words))
