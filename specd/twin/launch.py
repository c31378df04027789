"""A launch of the twin up to the moment it listens: its command line resolved as SGLang
resolves it (warnings and refusals alike), then the port kept closed while the "model
loads", and a launch that fails while loading failing then.

aiohttp and the HTTP side (specd.twin.server) are imported only once the twin is about to
listen: a launch SGLang would refuse, or one that fails while loading, never pays for them
(~0.17 s of CPU, two thirds of such a start), and a refused or failed launch is what a
restart that goes wrong looks like to specd.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specd.twin.adaptive import (
    SLOTS,
    AdaptiveConfigError,
    Controller,
    candidate_union,
    initial_steps_error,
    load_slots,
    unsupported_reason,
)
from specd.twin.faults import ENV_FAIL_SETTINGS, SettingKey, adaptive_key, fail_settings
from specd.twin.preset import ALPHA, PRESET_NAME, accept_length, preset_table
from specd.twin.table import PerfTable, PerfTableError
from specd.twin.versions import Profile, UnknownVersionError, profile_for

EAGLE_FAMILY = {"EAGLE": "EAGLE", "NEXTN": "EAGLE", "EAGLE3": "EAGLE3", "STANDALONE": "STANDALONE"}


class TwinConfigError(ValueError):
    """Launch flags SGLang would refuse; the message is one line."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # 2: argparse's own refusal of an unknown flag


@dataclass
class TwinConfig:
    args: argparse.Namespace
    table: PerfTable
    # The step count at launch (0: no speculation); under adaptive mode the initial tier.
    steps: int
    draft_tokens: int
    topk: int | None
    algorithm: str | None
    # The most requests the server runs at once, all DP ranks together, and each rank's
    # scheduler's own limit (what /server_info and /v1/loads report per rank).
    max_running: int
    max_running_per_rank: int
    accept_length: float
    model_name: str
    launch_command: str
    profile: Profile
    warnings: list[str] = field(default_factory=list)
    # Adaptive mode as resolved: the slots (batch size -> settings) when it runs, else None.
    adaptive_slots: dict[int, dict[str, Any]] | None = None
    # Tokens per verify (bonus included) at every step count the server may run.
    accept_lengths: dict[int, float] = field(default_factory=dict)
    # Port-closed time: the model load plus one CUDA-graph set per extra candidate.
    load_s: float = 0.0
    graph_set_s: float = 0.0
    graph_sets: int = 1
    # Why this launch fails while loading (injected, or a config SGLang reads at load).
    load_error: str | None = None
    # The setting the command line asks for, in specd's text form.
    setting: SettingKey = field(default_factory=lambda: SettingKey("off"))

    @property
    def adaptive(self) -> bool:
        return self.adaptive_slots is not None

    @property
    def candidates(self) -> list[int]:
        return candidate_union(self.adaptive_slots) if self.adaptive_slots else [self.steps]


def _resolve_dp_layout(args: argparse.Namespace, profile: Profile) -> None:
    """The DP layout as that version resolves it, in the twin's one form: ``dp_size`` DP
    ranks, and ``enable_dp_attention`` whether they are attention-DP groups of one model
    (else replicas, each a server of its own).

    Before 0.5.23 (server_args._handle_data_parallelism) DP attention at ``--dp-size 1`` is
    turned off; ``--attn-dp-size`` is not a flag yet. 0.5.23 (parallel_hook) reads
    ``--dp-size N --enable-dp-attention`` as ``--attn-dp-size N`` with one replica, and
    refuses replicas beside attention DP.
    """
    given = args.attn_dp_size
    if not profile.attn_dp_size:
        if given is not None:
            # argparse's own refusal of a flag that version does not have.
            raise TwinConfigError(f"unrecognized arguments: --attn-dp-size {given}", exit_code=2)
        if args.dp_size == 1:
            args.enable_dp_attention = False
    else:
        groups = 1 if given is None else given
        if groups < 1:
            raise TwinConfigError(f"ValueError: --attn-dp-size must be positive (got {groups}).")
        if args.enable_dp_attention and groups == 1:
            groups, args.dp_size = args.dp_size, 1
        if groups > 1 and args.dp_size > 1:
            raise TwinConfigError(
                f"ValueError: --dp-size {args.dp_size} with --attn-dp-size {groups}: "
                "data-parallel replicas combined with attention data parallelism are not "
                "supported."
            )
        args.enable_dp_attention = groups > 1
        if groups > 1:
            args.dp_size = groups
    if args.enable_dp_attention and args.tp_size % args.dp_size:
        # Attention DP splits one TP group: a bare assert in every version
        # (_handle_data_parallelism; 0.5.23's parallel_hook), before anything loads.
        raise TwinConfigError(
            f"AssertionError: tp_size % dp_size == 0 with DP attention "
            f"(--tp-size {args.tp_size}, {args.dp_size} attention DP groups)"
        )


def _max_running_per_rank(
    max_running: int | None, capacity: int | None, args: argparse.Namespace, profile: Profile
) -> int:
    """Each DP rank's scheduler's max_running_requests, as SGLang sizes it.

    Every version (0.5.4 tp_worker, 0.5.8-0.5.11 model_runner, 0.5.23
    kv_cache_configurator.resolve_max_num_reqs) gives each scheduler
    ``--max-running-requests // dp_size`` with DP attention (the ranks share one model) and
    the whole argument without it (each DP replica is a server of its own); memory can
    only lower it. Before 0.5.23 the share may be 0 (tp_worker then fails the load);
    0.5.23 gives each at least 1. The table's capacity is the whole server's
    (what specd reads and sweeps: the ranks' sum), so each rank's memory holds its share of
    it.
    """
    ranks = max(args.dp_size, 1)
    limits = []
    if max_running is not None:
        share = max_running // ranks if args.enable_dp_attention else max_running
        limits.append(max(share, 1) if profile.attn_dp_size else share)
    if capacity is not None:
        limits.append(max(capacity // ranks, 1))
    # No argument and no capacity in the table: 48 in all stands in for what SGLang would
    # size from memory.
    return min(limits) if limits else max(48 // ranks, 1)


def ignored_words(args: argparse.Namespace) -> list[str]:
    """The SGLang flags the twin's parser passed over (none from a plain parser)."""
    words = getattr(args, "ignored_args", None)
    return list(words) if isinstance(words, list) else []


def given_arguments(words: list[str], known: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the SGLang flags the twin does not model (``--context-length 8192``,
    ``--trust-remote-code``), for the arguments of that version among ``known``, typed
    like their defaults (a number for a flag whose default is unset)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        name, eq, text = word[2:].partition("=")
        key = name.replace("-", "_")
        if not eq and i < len(words) and not words[i].startswith("--"):
            text, eq = words[i], "="
            i += 1
        if key not in known:
            continue
        default = known[key]
        if not eq:
            out[key] = True
        elif isinstance(default, bool):
            out[key] = text.lower() in ("1", "true", "yes")
        else:
            out[key] = _typed(text, default)
    return out


def _typed(text: str, default: Any) -> Any:
    for kind in (int, float):
        if default is None or isinstance(default, kind):
            with contextlib.suppress(ValueError):
                return kind(text)
    return text


def _launch_command(argv: list[str]) -> str:
    """How the server was asked to run, as 0.5.2x's /server_info says it: the launch's
    arguments (``sys.argv[1:]`` of ``sglang.launch_server``) joined by spaces."""
    start = next((i for i, word in enumerate(argv) if word.startswith("-")), len(argv))
    return " ".join(argv[start:])


def _accept(table: PerfTable, steps: int) -> float:
    if steps <= 0:
        return 1.0
    measured = table.accept_length(steps)
    return measured if measured is not None else accept_length(steps, ALPHA)


def _adaptive_flags(args: argparse.Namespace) -> list[str]:
    words = ["--speculative-adaptive"] if args.speculative_adaptive else []
    if args.speculative_adaptive_config is not None:
        words += ["--speculative-adaptive-config", args.speculative_adaptive_config]
    return words


def resolve(
    args: argparse.Namespace,
    argv: list[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> TwinConfig:
    warnings: list[str] = []
    try:
        profile = profile_for(args.sglang_version)
    except UnknownVersionError as exc:
        raise TwinConfigError(str(exc)) from None
    removed = getattr(args, "removed_flag", None)
    if removed is not None:
        # A flag that version removed: its DeprecatedAction raises as argparse meets it.
        raise TwinConfigError(f"ValueError: {removed}")
    if args.table and args.preset:
        raise TwinConfigError("give --table or --preset, not both")
    try:
        table = (
            PerfTable.from_csv(args.table)
            if args.table
            else preset_table(args.preset or PRESET_NAME)
        )
    except (PerfTableError, KeyError) as exc:
        raise TwinConfigError(str(exc).strip("'\"")) from None
    for name in ("port", "dp_size", "tp_size", "decode_log_interval"):
        if getattr(args, name) < (0 if name == "port" else 1):
            raise TwinConfigError(f"--{name.replace('_', '-')} out of range: {getattr(args, name)}")
    if args.port > 65535:
        raise TwinConfigError(f"--port out of range: {args.port}")
    _resolve_dp_layout(args, profile)
    try:
        failing = fail_settings(args.fail_setting, os.environ if env is None else env)
    except ValueError as exc:
        raise TwinConfigError(f"{ENV_FAIL_SETTINGS}: {exc}") from None

    rules = profile.adaptive
    adaptive_words = _adaptive_flags(args)
    if adaptive_words and rules is None:
        # Before 0.5.11 SGLang's argparse does not know the flags.
        raise TwinConfigError(f"unrecognized arguments: {' '.join(adaptive_words)}", exit_code=2)

    if args.enable_multi_layer_eagle and "enable_multi_layer_eagle" in profile.lacks_args:
        raise TwinConfigError("unrecognized arguments: --enable-multi-layer-eagle", exit_code=2)

    algorithm = args.speculative_algorithm.upper() if args.speculative_algorithm else None
    if algorithm is not None and algorithm not in EAGLE_FAMILY:
        raise TwinConfigError(
            f"speculative algorithm {algorithm} is not simulated by the twin "
            f"(supported: {', '.join(sorted(EAGLE_FAMILY))})"
        )
    algorithm = EAGLE_FAMILY[algorithm] if algorithm is not None else None
    steps, topk, draft = (
        args.speculative_num_steps,
        args.speculative_eagle_topk,
        args.speculative_num_draft_tokens,
    )

    # Adaptive mode: the quiet fallback first (as SGLang's argument checks), then the config.
    slots: dict[int, dict[str, Any]] | None = None
    load_error: str | None = None
    requested: SettingKey | None = None
    if args.speculative_adaptive and rules is not None:
        try:
            requested = adaptive_key(load_slots(rules, args.speculative_adaptive_config))
        except AdaptiveConfigError:
            requested = None
        reason = unsupported_reason(rules, algorithm=algorithm, topk=topk, args=args)
        if reason is not None:
            warnings.append(
                f"speculative_adaptive disabled: {reason}. "
                "Falling back to static speculative params."
            )
        elif rules.config_at_start:
            try:
                slots = load_slots(rules, args.speculative_adaptive_config)
            except AdaptiveConfigError as exc:
                raise TwinConfigError(str(exc)) from None
        else:
            # Read by the worker once the weights are in: a bad file kills the load.
            try:
                slots = load_slots(rules, args.speculative_adaptive_config)
            except AdaptiveConfigError as exc:
                load_error = str(exc)
        if slots is not None and rules.initial_middle:
            union = candidate_union(slots)
            if steps is None:
                steps = union[len(union) // 2]
            if topk is None:
                topk = 1
            if topk == 1:
                draft = steps + 1

    max_running = args.max_running_requests
    if algorithm is None:
        resolved_steps, resolved_draft = 0, 0
        steps = topk = draft = None
    else:
        if max_running is None:
            max_running = 48
            warnings.append(
                "Max running requests is reset to 48 for speculative decoding. You can "
                "override this by explicitly setting --max-running-requests."
            )
        if steps is None:
            if topk is not None or draft is not None:
                raise TwinConfigError(
                    "AssertionError: --speculative-eagle-topk/--speculative-num-draft-tokens "
                    "given without --speculative-num-steps"
                )
            steps, topk, draft = 3, 1, 4
        if topk is None:
            raise TwinConfigError(
                "TypeError: '>' not supported between instances of 'NoneType' and 'int' "
                "(--speculative-num-steps needs --speculative-eagle-topk and "
                "--speculative-num-draft-tokens)"
            )
        if steps < 1 or topk < 1:
            raise TwinConfigError(
                "--speculative-num-steps and --speculative-eagle-topk must be >= 1"
            )
        if topk == 1 and draft != steps + 1:
            warnings.append(
                "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                "speculative_eagle_topk == 1"
            )
            draft = steps + 1
        if draft is None or draft < 2:
            raise TwinConfigError("--speculative-num-draft-tokens must be >= 2 with topk > 1")
        resolved_steps, resolved_draft = steps, draft
    if slots is not None and rules is not None and rules.config == SLOTS:
        union = candidate_union(slots)
        if resolved_steps not in union:
            raise TwinConfigError(initial_steps_error(resolved_steps, union))

    run_steps = candidate_union(slots) if slots is not None else [resolved_steps]
    for k in run_steps:
        if k not in table.steps():
            known = ",".join(str(s) for s in table.steps())
            raise TwinConfigError(
                f"{table.source}: no data for steps {k} (table has steps {known})"
            )
    # KV and graphs are sized for the deepest step count the server may run.
    capacity = table.capacity(max(run_steps))
    if max_running is not None and max_running < 1:
        raise TwinConfigError(f"--max-running-requests must be >= 1, got {max_running}")
    per_rank = _max_running_per_rank(max_running, capacity, args, profile)
    if per_rank < 1 and load_error is None:
        # tp_worker's check once the weights are in: the scheduler dies, and the server.
        load_error = "AssertionError: max_running_request is zero"
    if slots is not None and rules is not None:
        # Tuning values SGLang would only trip over at run time are refused up front.
        try:
            Controller(resolved_steps, slots, rules, None)
        except (TypeError, ValueError) as exc:
            raise TwinConfigError(f"{type(exc).__name__}: {exc}") from None

    if requested is None:
        requested = SettingKey("off") if algorithm is None else SettingKey("static", resolved_steps)
    static_or_off = requested.kind != "adaptive"
    if requested in failing or (static_or_off and resolved_steps in args.fail_start_at_steps):
        load_error = (
            f"failed to start with speculative_num_steps={resolved_steps} (setting {requested}; "
            "injected: RuntimeError: CUDA out of memory while capturing CUDA graphs)"
        )
    graph_set_s = args.graph_set_s if args.graph_set_s is not None else args.load_time_s / 4
    sets = len(run_steps)

    args.speculative_algorithm = algorithm
    args.speculative_num_steps = steps
    args.speculative_eagle_topk = topk
    args.speculative_num_draft_tokens = draft
    args.max_running_requests = max_running
    args.speculative_adaptive = slots is not None
    argv = argv if argv is not None else sys.argv
    return TwinConfig(
        args=args,
        table=table,
        steps=resolved_steps,
        draft_tokens=resolved_draft,
        topk=topk,
        algorithm=algorithm,
        max_running=per_rank * max(args.dp_size, 1),
        max_running_per_rank=per_rank,
        accept_length=_accept(table, resolved_steps),
        model_name=args.served_model_name or args.model_path,
        launch_command=_launch_command(argv),
        profile=profile,
        warnings=warnings,
        adaptive_slots=slots,
        accept_lengths={k: _accept(table, k) for k in run_steps},
        load_s=args.load_time_s + graph_set_s * (sets - 1),
        graph_set_s=graph_set_s,
        graph_sets=sets,
        load_error=load_error,
        setting=requested,
    )


async def load(config: TwinConfig, stop: asyncio.Event) -> int | None:
    """The model load: the port stays closed for ``config.load_s``, like SGLang while it
    loads weights and captures graphs; a launch that fails while loading fails halfway
    through, saying why. The exit code if the twin ends here (stopped: 143, failed: 1),
    None once it has loaded."""
    fail = config.load_error is not None
    load_s = config.load_s / 2 if fail else config.load_s
    try:
        await asyncio.wait_for(stop.wait(), timeout=max(load_s, 0.0))
        return 143
    except asyncio.TimeoutError:
        pass
    if fail:
        print(f"[twin] ERROR: {config.load_error}", file=sys.stderr, flush=True)
        return 1
    return None


def serve(config: TwinConfig) -> int:
    """`specd twin` once its command line is resolved: the process's whole life."""
    for warning in config.warnings:
        print(f"[twin] WARNING {warning}", file=sys.stderr, flush=True)
    if config.args.ignored_args if hasattr(config.args, "ignored_args") else False:
        print(f"[twin] ignoring SGLang flags: {' '.join(config.args.ignored_args)}",
              file=sys.stderr, flush=True)  # fmt: skip
    try:
        return asyncio.run(_main(config))
    except KeyboardInterrupt:
        return 130


async def _main(config: TwinConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    code = await load(config, stop)
    if code is not None:
        return code
    # Loaded: now the HTTP side (aiohttp).
    from specd.twin.server import listen  # noqa: PLC0415

    return await listen(config, stop)
