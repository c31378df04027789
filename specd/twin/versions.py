"""What the twin looks like at each SGLang version it can pretend to be.

Read from each version's own code: the /metrics families from the pages its collectors
wrote (tests/fixtures/metrics/versions/, made by sglang_pages.py), the endpoints from its
``entrypoints/http_server.py``. ``families.FAMILIES`` is 0.5.23; older versions are that
minus what they had not added yet, plus what they had and later removed or renamed.
"""

# ruff: noqa: E501  (HELP texts are verbatim SGLang strings)
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property

from specd.twin.adaptive import (
    DEFAULT_SLOTS_0_5_13,
    DEFAULT_SLOTS_0_5_23,
    FLAT,
    SLOTS,
    AdaptiveRules,
)
from specd.twin.families import _B7, BY_NAME, FAMILIES, REQ, SCHED, Family, G, Labels

DEFAULT_VERSION = "0.5.23"
# queue_time_seconds before 0.5.13: no buckets below 0.1 s but 0.
_QUEUE_TIME_OLD = tuple(b for b in _B7 if b == 0.0 or b >= 0.1)


@dataclass(frozen=True)
class Profile:
    """One SGLang version as seen from the outside."""

    version: str
    families: tuple[Family, ...]
    # Scheduler series carry moe_ep_rank (0.5.11+).
    sched_moe_label: bool
    # Tokenizer-side series carry engine_type (0.5.11+) and is_streaming (0.5.2x).
    req_engine_label: bool
    req_streaming_label: bool
    # sglang:cached_tokens_total has cache_source (0.5.11+).
    cache_source_label: bool
    # Radix-cache series carry dp_rank/pp_rank/tp_rank (0.5.2x; cache_type only before).
    cache_rank_labels: bool
    # spec_accept_rate = accepted drafts / proposed drafts (0.5.11+); before: L / draft tokens.
    accept_rate_of_drafts: bool
    # /server_info's internal states carry effective_max_running_requests_per_dp (0.5.8+;
    # of the versions here, 0.5.11+). Every version's internal state is the scheduler's
    # server arguments plus its own figures.
    effective_capacity: bool
    # /server_info since 0.5.6 (/get_server_info stays as the old alias).
    server_info: bool
    # /model_info since 0.5.11 (/get_model_info before, and still as an alias).
    model_info: bool
    # /ready since 0.5.20; /v1/loads since 0.5.8.
    ready: bool
    v1_loads: bool
    # After its warm-up request the server freezes its GC through /freeze_gc (0.5.2x).
    freeze_gc_after_warmup: bool
    # --speculative-adaptive (0.5.11+; None: argparse does not know the flag).
    adaptive: AdaptiveRules | None = None
    # --attn-dp-size replaces `--dp-size N --enable-dp-attention`, which /server_info shows
    # as attn_dp_size N, dp_size 1 (0.5.23; 0.5.13 has no attn_dp_size).
    attn_dp_size: bool = False
    # /server_info as 0.5.2x builds it (utils.build_server_info, the scheduler's
    # SchedulerInternalStateController): launch_command, startup_time and frontend at the
    # top, and in each internal state the scheduler's world size, startup times, memory by
    # CUDA-graph phase and decode graph sizes.
    resolved_server_info: bool = False
    # /server_info's kv_events (0.5.13+; null while KV events are off).
    kv_events: bool = False
    # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false makes /health answer without a
    # generation (0.5.11+; of the versions here).
    health_generation_env: bool = True
    # Server arguments of the twin's that this version does not have yet: argparse refuses
    # the flag, /server_info has no such field.
    lacks_args: frozenset[str] = frozenset({"attn_dp_size"})
    # Scheduler families every TP rank emits, not only the one that reports the batch: each
    # rank's scheduler has its own collector wherever --enable-metrics is on, and some calls
    # are gated on that alone (the constants at start, decode passes, each request's queue
    # time and stages; 0.5.2x's pre-seeded series). The rest (log_stats' gauges, realtime
    # tokens, prefill passes) come from the reporting rank only, or from every rank with
    # --enable-metrics-for-all-schedulers. Read from each version's scheduler code and
    # checked against the --tp-size 2 pages its collectors wrote.
    every_rank: frozenset[str] = frozenset()
    # An idle scheduler logs at once when its running gauge no longer matches its running
    # batch (0.5.23's _maybe_log_idle_metrics); before, only 30 s after its last log.
    idle_log_when_stale: bool = False
    # The API-key middleware (specd.twin.auth): the path prefixes it lets through without a
    # key (0.5.20+ adds /ready), and whether routes have auth levels and --admin-api-key
    # exists (0.5.11+; 0.5.4 has one key for every route).
    auth_exempt: tuple[str, ...] = ("/health", "/metrics")
    auth_levels: bool = True

    def every_rank_emits(self, family: Family, variant: Labels) -> bool:
        """Whether each TP rank's scheduler has this series (not only the reporting one)."""
        if family.name not in self.every_rank:
            return False
        # Decode passes are counted on every rank, prefill passes where the batch is reported.
        return family.name != CUDA_GRAPH_PASSES or dict(variant).get("mode", "").startswith(
            "decode"
        )

    @cached_property
    def by_name(self) -> dict[str, Family]:
        return {f.name: f for f in self.families}

    def has_family(self, name: str) -> bool:
        return name in self.by_name

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.families)

    @property
    def warmup_model_info_path(self) -> str:
        return "/model_info" if self.model_info else "/get_model_info"

    @property
    def has_spec_steps_gauge(self) -> bool:
        return "sglang:spec_num_steps" in self.names


def _derive(
    absent: frozenset[str],
    extra: tuple[Family, ...] = (),
    helps: Mapping[str, str] | None = None,
    buckets: Mapping[str, tuple[float, ...]] | None = None,
    *,
    streaming: bool,
    cache_source: bool,
) -> tuple[Family, ...]:
    unknown = absent - set(BY_NAME)
    if unknown:  # a typo would silently keep a family the version never had
        raise ValueError(f"unknown families: {sorted(unknown)}")
    out: list[Family] = []
    for base in FAMILIES:
        if base.name in absent:
            continue
        family = base
        if helps and base.name in helps:
            family = replace(family, help=helps[base.name])
        if buckets and base.name in buckets:
            family = replace(family, buckets=buckets[base.name])
        if not streaming and base.scope == REQ:
            # One series where 0.5.2x has one per is_streaming value.
            kept = [v for v in base.variants if ("is_streaming", "true") not in v]
            family = replace(
                family,
                variants=tuple(tuple(kv for kv in v if kv[0] != "is_streaming") for v in kept),
            )
        if not cache_source and base.name == "sglang:cached_tokens_total":
            family = replace(family, variants=((),))
        out.append(family)
    return (*out, *extra)


# Families 0.5.23 has that were added after 0.5.13 (absent from 0.5.13's page).
_AFTER_0_5_13 = frozenset(
    {
        "sglang:startup_time_seconds",  # 0.5.18
        "sglang:startup_cuda_graph_time_seconds",  # 0.5.18
        "sglang:routing_keys_active",
        "sglang:http_requests_active",
        "sglang:http_requests_total",
        "sglang:http_responses_total",
        "sglang:request_time_per_output_token_seconds",
        "sglang:prefill_effective_tokens_total",
        "sglang:scheduler_idle_seconds_total",
        "sglang:scheduler_process_cpu_seconds_total",
        "sglang:scheduler_stage_seconds_total",
        "sglang:dp_attention_tokens_total",
        "sglang:dp_attention_steps_total",
        "sglang:dp_attention_pairs_total",
        "sglang:dp_attention_token_imbalance_ratio",
        "sglang:dp_attention_sync_wait_seconds",
        "sglang:weight_memory_usage_gb",
        "sglang:kv_cache_memory_usage_gb",
        "sglang:graph_memory_usage_gb",
        "sglang:spec_cap_length",
        "sglang:spec_block_accept_length",
        "sglang:num_decode_host_receive_queue_reqs",
        "sglang:num_decode_deferred_kv_release_reqs",
        "sglang:prealloc_full_token_usage",
        "sglang:prealloc_swa_token_usage",
    }
)
# Added between 0.5.11 and 0.5.13.
_AFTER_0_5_11 = _AFTER_0_5_13 | {
    "sglang:get_loads_duration_seconds",
    "sglang:uncached_prompt_tokens_histogram",
    "sglang:swa_available_tokens",
    "sglang:swa_evictable_tokens",
    "sglang:swa_used_tokens",
    "sglang:mamba_available_tokens",
    "sglang:mamba_evictable_tokens",
    "sglang:mamba_used_tokens",
    "sglang:spec_num_steps",
    "sglang:spec_num_draft_tokens",
    "sglang:spec_verify_calls_total",
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:fwd_occupancy",
}
# Added between 0.5.4 and 0.5.11.
_AFTER_0_5_4 = _AFTER_0_5_11 | {
    "sglang:num_retracted_requests_total",
    "sglang:num_retracted_input_tokens_total",
    "sglang:num_retracted_output_tokens_total",
    "sglang:prompt_tokens_histogram",
    "sglang:generation_tokens_histogram",
    "sglang:cuda_graph_passes_total",
    "sglang:realtime_tokens_total",
    "sglang:evicted_tokens_total",
    "sglang:eviction_duration_seconds",
    "sglang:process_cpu_seconds_total",
    "sglang:max_total_num_tokens",
    "sglang:page_size",
    "sglang:num_pages",
    "sglang:context_len",
    "sglang:startup_available_gpu_memory_gb",
    "sglang:decode_sum_seq_lens",
    "sglang:full_token_usage",
    "sglang:mamba_usage",
    "sglang:kv_available_tokens",
    "sglang:kv_evictable_tokens",
    "sglang:kv_used_tokens",
    "sglang:new_token_ratio",
    "sglang:num_unique_running_routing_keys",
    "sglang:routing_key_running_req_count",
    "sglang:routing_key_all_req_count",
}

_DP_REASON_OLD = (
    "enable_dp_attention=True is not supported "
    "(adaptive tier decisions are not synchronized across DP ranks)"
)
# 0.5.11-0.5.12: one flat candidate list, v1 worker only (no overlap scheduler).
ADAPTIVE_FLAT = AdaptiveRules(
    config=FLAT,
    slot_zero=False,
    needs_no_overlap=True,
    ceiling=False,
    initial_middle=False,
    dp_reason=_DP_REASON_OLD,
)
# 0.5.13: per-batch slots, positive steps only.
ADAPTIVE_SLOTS = AdaptiveRules(
    config=SLOTS,
    slot_zero=False,
    needs_no_overlap=False,
    ceiling=True,
    initial_middle=False,
    dp_reason=_DP_REASON_OLD,
    default_slots=DEFAULT_SLOTS_0_5_13,
)
# 0.5.23: step 0 in a slot (since 0.5.14), the middle candidate without --speculative-num-steps.
ADAPTIVE_SLOTS_ZERO = AdaptiveRules(
    config=SLOTS,
    slot_zero=True,
    needs_no_overlap=False,
    ceiling=True,
    initial_middle=True,
    dp_reason=(
        "attention DP is not supported "
        "(adaptive tier decisions are not synchronized across DP ranks)"
    ),
    default_slots=DEFAULT_SLOTS_0_5_23,
)

# Gone by 0.5.18 (the startup_* gauges by phase replaced the two engine_* gauges).
_ENGINE_TIMES = (
    Family("sglang:engine_startup_time", G, "The time taken for the engine to start up.", SCHED),
    Family(
        "sglang:engine_load_weights_time",
        G,
        "The time taken for the engine to load weights.",
        SCHED,
    ),
)
_PREFILL_PREALLOC = Family(
    "sglang:num_prefill_prealloc_queue_reqs",
    G,
    "The number of requests in the prefill prealloc queue.",
    SCHED,
)
CUDA_GRAPH_PASSES = "sglang:cuda_graph_passes_total"
# Every TP rank: each request's queue time and stages (0.5.4: scheduler.py and
# Req.add_latency; 0.5.11+: req_time_stats, its collector set on every rank).
_EVERY_RANK_0_5_4 = frozenset({"sglang:queue_time_seconds", "sglang:per_stage_req_latency_seconds"})
# 0.5.11-0.5.13: also emit_constants at start, each decode pass, and each retraction
# (scheduler.py: gated on enable_metrics).
_EVERY_RANK_0_5_11 = _EVERY_RANK_0_5_4 | {
    CUDA_GRAPH_PASSES,
    "sglang:num_retracted_requests_total",
    "sglang:num_retracted_input_tokens_total",
    "sglang:num_retracted_output_tokens_total",
    "sglang:max_total_num_tokens",
    "sglang:page_size",
    "sglang:num_pages",
    "sglang:context_len",
    "sglang:startup_available_gpu_memory_gb",
    "sglang:engine_startup_time",
    "sglang:engine_load_weights_time",
}
# 0.5.23: the constants by memory kind instead of the engine times, and the series its
# collector pre-seeds at construction.
_EVERY_RANK_0_5_23 = (
    _EVERY_RANK_0_5_11 - {"sglang:engine_startup_time", "sglang:engine_load_weights_time"}
) | {
    "sglang:weight_memory_usage_gb",
    "sglang:kv_cache_memory_usage_gb",
    "sglang:graph_memory_usage_gb",
    "sglang:prefill_effective_tokens_total",
    "sglang:scheduler_idle_seconds_total",
    "sglang:scheduler_process_cpu_seconds_total",
    "sglang:scheduler_stage_seconds_total",
    "sglang:dp_attention_tokens_total",
    "sglang:dp_attention_steps_total",
    "sglang:dp_attention_pairs_total",
    "sglang:dp_attention_token_imbalance_ratio",
    "sglang:dp_attention_sync_wait_seconds",
}
_OLD_EVICTION_HELP = {
    "sglang:evicted_tokens_total": "The number of tokens evicted from GPU to CPU.",
    "sglang:eviction_duration_seconds": "Time taken to evict memory from GPU to CPU in seconds.",
}

PROFILES: dict[str, Profile] = {
    "0.5.4": Profile(
        version="0.5.4",
        every_rank=_EVERY_RANK_0_5_4,
        families=_derive(
            _AFTER_0_5_4,
            extra=(
                Family(
                    "sglang:num_running_reqs_offline_batch",
                    G,
                    "The number of running low-priority offline batch requests(label is 'batch').",
                    SCHED,
                ),
                _PREFILL_PREALLOC,
                Family(
                    "sglang:kv_transfer_speed_gb_s",
                    G,
                    "The transfer speed of the KV cache in GB/s.",
                    SCHED,
                ),
                Family(
                    "sglang:kv_transfer_latency_ms",
                    G,
                    "The transfer latency of the KV cache in ms.",
                    SCHED,
                ),
                *_ENGINE_TIMES,
            ),
            helps={
                "sglang:spec_accept_length": "The average acceptance length of speculative decoding.",
                "sglang:spec_accept_rate": "The average acceptance rate of speculative decoding (`accepted tokens / total draft tokens` in batch).",
                "sglang:cached_tokens_total": "Number of cached prompt tokens.",
            },
            buckets={"sglang:queue_time_seconds": _QUEUE_TIME_OLD},
            streaming=False,
            cache_source=False,
        ),
        sched_moe_label=False,
        req_engine_label=False,
        req_streaming_label=False,
        cache_source_label=False,
        cache_rank_labels=False,
        accept_rate_of_drafts=False,
        effective_capacity=False,
        server_info=False,
        model_info=False,
        ready=False,
        v1_loads=False,
        freeze_gc_after_warmup=False,
        health_generation_env=False,
        auth_levels=False,
        lacks_args=frozenset(
            {
                "speculative_adaptive",
                "speculative_adaptive_config",
                "enable_multi_layer_eagle",
                "attn_dp_size",
            }
        ),
    ),
    "0.5.11": Profile(
        version="0.5.11",
        every_rank=_EVERY_RANK_0_5_11,
        families=_derive(
            _AFTER_0_5_11,
            extra=(_PREFILL_PREALLOC, *_ENGINE_TIMES),
            helps=_OLD_EVICTION_HELP,
            buckets={"sglang:queue_time_seconds": _QUEUE_TIME_OLD},
            streaming=False,
            cache_source=True,
        ),
        sched_moe_label=True,
        req_engine_label=True,
        req_streaming_label=False,
        cache_source_label=True,
        cache_rank_labels=False,
        accept_rate_of_drafts=True,
        effective_capacity=True,
        server_info=True,
        model_info=True,
        ready=False,
        v1_loads=True,
        freeze_gc_after_warmup=False,
        adaptive=ADAPTIVE_FLAT,
    ),
    "0.5.13": Profile(
        version="0.5.13",
        every_rank=_EVERY_RANK_0_5_11,
        families=_derive(
            _AFTER_0_5_13,
            extra=_ENGINE_TIMES,
            helps=_OLD_EVICTION_HELP,
            streaming=False,
            cache_source=True,
        ),
        sched_moe_label=True,
        req_engine_label=True,
        req_streaming_label=False,
        cache_source_label=True,
        cache_rank_labels=False,
        accept_rate_of_drafts=True,
        effective_capacity=True,
        server_info=True,
        model_info=True,
        ready=False,
        v1_loads=True,
        freeze_gc_after_warmup=False,
        adaptive=ADAPTIVE_SLOTS,
        kv_events=True,
    ),
    "0.5.23": Profile(
        version="0.5.23",
        every_rank=_EVERY_RANK_0_5_23,
        idle_log_when_stale=True,
        families=FAMILIES,
        sched_moe_label=True,
        req_engine_label=True,
        req_streaming_label=True,
        cache_source_label=True,
        cache_rank_labels=True,
        accept_rate_of_drafts=True,
        effective_capacity=True,
        server_info=True,
        model_info=True,
        ready=True,
        v1_loads=True,
        freeze_gc_after_warmup=True,
        adaptive=ADAPTIVE_SLOTS_ZERO,
        attn_dp_size=True,
        resolved_server_info=True,
        auth_exempt=("/health", "/ready", "/metrics"),
        kv_events=True,
        lacks_args=frozenset(),
    ),
}
VERSIONS = tuple(PROFILES)


class UnknownVersionError(ValueError):
    pass


def profile_for(version: str) -> Profile:
    try:
        return PROFILES[version]
    except KeyError:
        raise UnknownVersionError(
            f"--sglang-version {version!r} is not simulated (known: {', '.join(VERSIONS)})"
        ) from None
