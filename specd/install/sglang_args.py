"""SGLang's command line as install reads it: which speculative setup it runs, where SGLang
listens, and the same command with the speculative setting taken from specd's variable.

The drop-in carries the whole speculative setting (algorithm, steps, topk, draft tokens, or
SGLang's adaptive flags, or nothing for "off") in one unbraced ``$SPECD_SPECULATIVE_ARGS``,
which systemd splits into words. A unit wired by an older specd (``${SPECD_STEPS}`` and
``${SPECD_DRAFT_TOKENS}``, or their older ``SPECD_SPEC_*`` names) is read as installed and
rewritten to that form."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specd.install.execline import Command, expand_argv, expand_word, whole_word_variable
from specd.install.layout import InstallError
from specd.io.apply import ARGS_WORD, ENV_ARGS, ENV_DRAFT_TOKENS, ENV_STEPS

# What specd's drop-in used before the variables left the SPECD_ settings prefix. An
# installation of that form is read as installed, and rewritten to today's names.
LEGACY_ENV_STEPS = "SPECD_SPEC_STEPS"
LEGACY_ENV_DRAFT_TOKENS = "SPECD_SPEC_DRAFT_TOKENS"
LEGACY_NAMES = {LEGACY_ENV_STEPS: ENV_STEPS, LEGACY_ENV_DRAFT_TOKENS: ENV_DRAFT_TOKENS}
SPECD_VARIABLES = frozenset({ENV_STEPS, ENV_DRAFT_TOKENS, *LEGACY_NAMES})
# The options that make up a speculative setting: they move into specd's variable.
SETTING_OPTIONS = (
    "--speculative-algorithm",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
)
# Also part of a setting (specd writes them for adaptive); a unit may only have them off.
ADAPTIVE_OPTIONS = ("--speculative-adaptive", "--speculative-adaptive-config")

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
        # Secrets: their value is a word of its own (never an option), shown as ***.
        "--api-key",
        "--admin-api-key",
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
    port: int | None  # None: not readable from the command (the operator gave --url)
    legacy: bool = False  # wired with the old SPECD_SPEC_* variables
    # Word indices (option and separate value) of the setting's options on the command line:
    # the drop-in replaces them with $SPECD_SPECULATIVE_ARGS. Empty when already wired so.
    setting_words: tuple[int, ...] = ()
    # Wired by an older specd with the step variables (${SPECD_STEPS}, ...): install
    # migrates the drop-in and the env file to $SPECD_SPECULATIVE_ARGS.
    step_variables: bool = False

    @property
    def default_args(self) -> str:
        """The setting's words as the drop-in's default (today's values, exactly)."""
        return (
            f"--speculative-algorithm {self.algorithm} --speculative-num-steps {self.steps} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {self.draft_tokens}"
        )


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
    wired = [i for i, w in enumerate(command.words) if w == ARGS_WORD]
    if len(wired) > 1:
        raise InstallError(f"{unit}: ExecStart= has {ARGS_WORD} {len(wired)} times")
    if wired:
        return _analyse_wired(command, environment, unit, defaults, read_url)
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
    for option in SETTING_OPTIONS:
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
    if read_url:
        port: int | None = _port(unit, written.get("--port"), flags)
    else:
        # The operator gave the URL (perhaps because the port is unreadable): kept only to
        # check that URL is this unit's server.
        try:
            port = _port(unit, written.get("--port"), flags)
        except InstallError:
            port = None
    words: list[int] = []
    moved = frozenset((*SETTING_OPTIONS, *ADAPTIVE_OPTIONS))
    # Every occurrence: argparse keeps the last, and none may stay behind.
    for i, word in enumerate(command.words):
        found = _canonical(word.partition("=")[0]) if word.startswith("--") else None
        if found in moved:
            alone = "=" in word or found in SWITCH_OPTIONS
            words += [i] if alone else [i, i + 1][: len(command.words) - i]
    variables = any(
        _BRACED.fullmatch(f.value or "") is not None and (f.value or "")[2:-1] in SPECD_VARIABLES
        for f in (steps_flag, draft_flag)
    )
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
        setting_words=tuple(sorted(set(words))),
        step_variables=variables,
    )


def _analyse_wired(
    command: Command,
    environment: Mapping[str, str],
    unit: str,
    defaults: Mapping[str, str],
    read_url: bool,
) -> Speculation:
    """A command already wired with $SPECD_SPECULATIVE_ARGS: today's setting is the drop-in's
    default for it (what install read from the unit), whatever specd applied since."""
    default = defaults.get(ENV_ARGS)
    if default is None:
        raise InstallError(
            f"{unit}: ExecStart= has {ARGS_WORD} but no Environment= gives it a default; "
            "restore the unit's own command (specd uninstall) and install again"
        )
    # The rest of the command as SGLang gets it, the setting's words from the default.
    own = Command(command.prefix, tuple(w for w in command.words if w != ARGS_WORD))
    words = [*own.words, *default.split()]
    spec = analyse(
        Command(command.prefix, tuple(words)),
        {**environment, ENV_ARGS: default},
        unit,
        defaults=defaults,
        read_url=read_url,
    )
    extra = [i for i in spec.setting_words if i < len(own.words)]
    if extra:
        raise InstallError(
            f"{unit}: ExecStart= has {ARGS_WORD} and also {own.words[extra[0]]}; SGLang would "
            f"keep the last one: remove it from the unit's own command"
        )
    return Speculation(
        algorithm=spec.algorithm,
        steps=spec.steps,
        draft_tokens=spec.draft_tokens,
        steps_flag=spec.steps_flag,
        draft_flag=spec.draft_flag,
        metrics=spec.metrics,
        host=spec.host,
        port=spec.port,
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
    """The command with the speculative setting from specd's variable, where the setting's
    first option was (a command already wired so is kept)."""
    words = list(command.words)
    if spec.setting_words:
        first = spec.setting_words[0]
        removed = set(spec.setting_words)
        words = [w for i, w in enumerate(words[:first]) if i not in removed]
        words.append(ARGS_WORD)
        words += [w for i, w in enumerate(command.words) if i > first and i not in removed]
    if add_metrics and not spec.metrics:
        words.append("--enable-metrics")
    return Command(command.prefix, tuple(words))
