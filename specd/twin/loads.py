"""/v1/loads as each SGLang version answers it (0.5.8+; the twin's 0.5.11, 0.5.13, 0.5.23).

0.5.11 (entrypoints/v1_loads.py over io_struct.GetLoadsReqOutput): the scheduler's dataclass
without its None fields and timestamp, num_total_reqs, and an aggregate over the ranks.
0.5.13 (load_snapshot.LoadSnapshot.to_dict): flat snapshots, sections only where the
scheduler filled them, dp_rank 0 without DP ranks. 0.5.23: the snapshot's every core field
(timestamp, decode_moments, prefill totals, ...) and the accelerators behind a rank.
``format=prometheus`` gives the same figures as gauges labelled by dp_rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

# What torch.cuda.get_device_name() says on the twin's pretend GPUs.
ACCELERATOR = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
VALID_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
# (include key, section name) of the optional sections, in the order SGLang adds them.
SECTIONS = (
    ("memory", "memory"),
    ("spec", "speculative"),
    ("lora", "lora"),
    ("disagg", "disaggregation"),
    ("queues", "queues"),
)
# 0.5.11's gauges (name, HELP) in GetLoadsReqOutput's field order, then its sections'.
_HELP_0_5_11: tuple[tuple[str, str], ...] = (
    ("num_running_reqs", "Number of running requests"),
    ("num_waiting_reqs", "Number of waiting requests"),
    ("num_used_tokens", "Number of tokens in use"),
    ("num_total_tokens", "Used tokens plus pending prefill tokens"),
    ("max_total_num_tokens", "Maximum token capacity"),
    ("token_usage", "Token pool usage ratio"),
    ("gen_throughput", "Generation throughput tokens/sec"),
    ("cache_hit_rate", "Prefix cache hit rate"),
    ("utilization", "Overall utilization ratio"),
    ("max_running_requests", "Maximum running requests capacity"),
)
_SECTION_HELP_0_5_11: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    "memory": (
        "memory",
        (
            ("weight_gb", "Model weight memory in GB"),
            ("kv_cache_gb", "KV cache memory in GB"),
            ("graph_gb", "CUDA graph memory in GB"),
            ("token_capacity", "Max tokens in KV cache"),
        ),
    ),
    "speculative": (
        "spec",
        (
            (
                "accept_length",
                "Mean acceptance length (accepted drafts + bonus token per forward)",
            ),
            ("accept_rate", "Speculative acceptance rate"),
        ),
    ),
    "disaggregation": (
        "disagg",
        (
            ("prefill_prealloc_queue_reqs", "Prefill prealloc queue requests"),
            ("prefill_inflight_queue_reqs", "Prefill inflight queue requests"),
            ("decode_prealloc_queue_reqs", "Decode prealloc queue requests"),
            ("decode_transfer_queue_reqs", "Decode transfer queue requests"),
            ("decode_retracted_queue_reqs", "Decode retracted queue requests"),
            ("kv_transfer_speed_gb_s", "KV transfer speed in GB/s"),
            ("kv_transfer_latency_ms", "KV transfer latency in ms"),
        ),
    ),
    "queues": (
        "queues",
        (
            ("waiting", "Main waiting queue size"),
            ("grammar", "Grammar compilation queue size"),
            ("paused", "Requests paused by weight sync"),
            ("retracted", "Retracted requests count"),
        ),
    ),
}


@dataclass(frozen=True)
class RankLoad:
    """One DP rank's scheduler's figures, as its load inquirer reads them."""

    dp_rank: int | None  # None without DP ranks (no DP controller)
    running: int
    waiting: int
    used_tokens: int
    waiting_tokens: int
    max_total_num_tokens: int
    max_running_requests: int
    token_usage: float
    gen_throughput: float
    utilization: float
    accept_length: float | None  # lifetime; None before a decode log counted verifies
    accept_rate: float
    weight_gb: float
    kv_cache_gb: float
    graph_gb: float
    prefill_tokens: int
    prefill_busy_us: int
    decode_moments: Sequence[float]
    timestamp: float


class BadInclude(ValueError):
    """An include section SGLang does not know (0.5.13+ fails the request on it)."""


def _sections(load: RankLoad, version: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "memory": {
            "weight_gb": round(load.weight_gb, 3),
            "kv_cache_gb": round(load.kv_cache_gb, 3),
            "graph_gb": round(load.graph_gb, 3),
            "token_capacity": load.max_total_num_tokens,
        }
    }
    if load.accept_length is not None:
        out["speculative"] = {"accept_length": load.accept_length, "accept_rate": load.accept_rate}
    bootstrap = (
        "prefill_prealloc_queue_reqs" if version == "0.5.11" else "prefill_bootstrap_queue_reqs"
    )
    out["disaggregation"] = {
        "mode": "null",
        bootstrap: 0,
        "prefill_inflight_queue_reqs": 0,
        "decode_prealloc_queue_reqs": 0,
        "decode_transfer_queue_reqs": 0,
        "decode_retracted_queue_reqs": 0,
        "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": 0.0,
    }
    queues: dict[str, Any] = {"waiting": load.waiting, "grammar": 0, "paused": 0, "retracted": 0}
    if version == "0.5.23":
        queues["prealloc_ready"] = 0
    out["queues"] = queues
    return out


def _wanted(include: set[str] | None) -> set[str] | None:
    """The section names ``include`` keeps (None: all)."""
    if include is None or "all" in include:
        return None
    return {name for key, name in SECTIONS if key in include}


def _core(load: RankLoad, version: str) -> dict[str, Any]:
    total_tokens = load.used_tokens + load.waiting_tokens
    common = {
        "num_running_reqs": load.running,
        "num_waiting_reqs": load.waiting,
    }
    if version == "0.5.11":
        core: dict[str, Any] = {} if load.dp_rank is None else {"dp_rank": load.dp_rank}
        return (
            core
            | common
            | {
                "num_used_tokens": load.used_tokens,
                "num_total_tokens": total_tokens,
                "max_total_num_tokens": load.max_total_num_tokens,
                "token_usage": round(load.token_usage, 4),
                "gen_throughput": round(load.gen_throughput, 2),
                "cache_hit_rate": 0.0,
                "utilization": round(load.utilization, 4),
                "max_running_requests": load.max_running_requests,
            }
        )
    rank = load.dp_rank or 0
    if version == "0.5.13":
        return (
            {"dp_rank": rank}
            | common
            | {
                "num_waiting_uncached_tokens": load.waiting_tokens,
                "num_used_tokens": load.used_tokens,
                "num_total_tokens": total_tokens,
                "max_total_num_tokens": load.max_total_num_tokens,
                "max_running_requests": load.max_running_requests,
                "token_usage": round(load.token_usage, 4),
                "gen_throughput": round(load.gen_throughput, 2),
                "cache_hit_rate": 0.0,
                "utilization": round(load.utilization, 4),
            }
        )
    return (
        {"timestamp": load.timestamp, "dp_rank": rank}
        | common
        | {
            "num_waiting_uncached_tokens": load.waiting_tokens,
            "num_used_tokens": load.used_tokens,
            "num_total_tokens": total_tokens,
            "num_active_tokens": total_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": load.max_total_num_tokens,
            "max_running_requests": load.max_running_requests,
            "token_usage": round(load.token_usage, 4),
            "gen_throughput": round(load.gen_throughput, 2),
            "cache_hit_rate": 0.0,
            "utilization": round(load.utilization, 4),
            "total_prefill_uncached_tokens": load.prefill_tokens,
            "total_prefill_busy_us": load.prefill_busy_us,
            "decode_moments": list(load.decode_moments) if load.decode_moments[0] > 0 else None,
        }
    )


def load_dict(load: RankLoad, version: str, include: set[str] | None) -> dict[str, Any]:
    """One rank's entry of ``loads``."""
    if version != "0.5.11" and include is not None and not include <= VALID_SECTIONS:
        raise BadInclude(f"Invalid include sections: {include - VALID_SECTIONS}")
    out = _core(load, version)
    wanted = _wanted(include)
    for name, section in _sections(load, version).items():
        if wanted is None or name in wanted:
            out[name] = section
    if version == "0.5.11":
        out["num_total_reqs"] = load.running + load.waiting
    return out


def _aggregate(loads: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(loads)
    if not n:
        return {"total_running_reqs": 0, "total_waiting_reqs": 0, "total_reqs": 0,
                "total_used_tokens": 0, "total_tokens": 0, "avg_token_usage": 0.0,
                "avg_throughput": 0.0, "avg_utilization": 0.0}  # fmt: skip
    return {
        "total_running_reqs": sum(d["num_running_reqs"] for d in loads),
        "total_waiting_reqs": sum(d["num_waiting_reqs"] for d in loads),
        "total_reqs": sum(d["num_running_reqs"] + d["num_waiting_reqs"] for d in loads),
        "total_used_tokens": sum(d["num_used_tokens"] for d in loads),
        "total_tokens": sum(d["num_total_tokens"] for d in loads),
        "avg_token_usage": round(sum(d["token_usage"] for d in loads) / n, 4),
        "avg_throughput": round(sum(d["gen_throughput"] for d in loads) / n, 2),
        "avg_utilization": round(sum(d["utilization"] for d in loads) / n, 4),
    }


def loads_json(
    ranks: Sequence[RankLoad],
    version: str,
    include: set[str] | None,
    *,
    accelerators: int,
) -> dict[str, Any]:
    """The JSON body of /v1/loads."""
    loads = [load_dict(load, version, include) for load in ranks]
    body: dict[str, Any] = {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": version,
    }
    if version == "0.5.11":
        return body | {"dp_rank_count": len(loads), "loads": loads, "aggregate": _aggregate(loads)}
    if version == "0.5.23":
        body |= {"accelerator": ACCELERATOR, "num_accelerators": accelerators}
    return body | {"loads": loads}


def _number(value: Any) -> bool:
    return isinstance(value, int | float)


def loads_prometheus(ranks: Sequence[RankLoad], version: str, include: set[str] | None) -> str:
    """The body of /v1/loads?format=prometheus."""
    lines: list[str] = []
    if version == "0.5.11":
        dicts = [(load.dp_rank, load_dict(load, version, include)) for load in ranks]
        for name, help_ in _HELP_0_5_11:
            lines += [f"# HELP sglang_{name} {help_}", f"# TYPE sglang_{name} gauge"]
            lines += [f'sglang_{name}{{dp_rank="{rank}"}} {d[name]}' for rank, d in dicts]
        for section, (prefix, fields) in _SECTION_HELP_0_5_11.items():
            if not any(section in d for _, d in dicts):
                continue
            for name, help_ in fields:
                metric = f"sglang_{prefix}_{name}"
                lines += [f"# HELP {metric} {help_}", f"# TYPE {metric} gauge"]
                lines += [f'{metric}{{dp_rank="{rank}"}} {d[section][name]}'
                          for rank, d in dicts if section in d]  # fmt: skip
        return "\n".join(lines) + "\n"
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[Any, Any]]] = {}
    for load in ranks:
        entry = load_dict(load, version, include)
        rank = entry.pop("dp_rank")
        for key, value in entry.items():
            if isinstance(value, Mapping):
                prefix = prefixes.get(key, key)
                for sub, sub_value in value.items():
                    if _number(sub_value):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, sub_value))
            elif _number(value):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values]
    return "\n".join(lines) + "\n"
