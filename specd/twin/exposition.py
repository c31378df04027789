"""Render the twin's metric state in SGLang's multiprocess-mode Prometheus text format.

Quirks copied from the real page: no ``_created`` samples, label keys sorted, histogram
``_sum`` before the buckets and ``_count`` after, ``pid`` on two gauges, one series per DP
rank for scheduler metrics (``dp_rank`` only with several ranks).
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.exposition import (
    choose_encoder,
    generate_latest,
    gzip_accepted,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from specd.twin.families import CACHE, PLAIN, REQ, SCHED, STARTUP, Family, Labels
from specd.twin.versions import DEFAULT_VERSION, Profile, profile_for

RANKED_SCOPES = (SCHED, CACHE)
# Families whose series exist only once a request has touched them (prometheus_client
# creates a labelled child on first use, and SGLang's tokenizer-side metrics are labelled).
LAZY_SCOPES = (REQ,)

Key = tuple[str, int, Labels]


@dataclass
class Hist:
    buckets: tuple[float, ...]
    counts: list[float] = field(default_factory=list)
    total: float = 0.0
    count: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0.0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


@dataclass
class MetricState:
    """Values keyed by (family name, DP rank or -1, extra labels)."""

    model_name: str
    dp_size: int = 1
    tp_size: int = 1
    # The DP ranks are attention-DP groups of one model (else replicas, each a server of its
    # own with its own TP ranks counted from 0).
    dp_attention: bool = False
    # --enable-metrics-for-all-schedulers: every TP rank reports the batch, not only the
    # first of each DP rank.
    all_schedulers: bool = False
    pid: int = 0
    profile: Profile = field(default_factory=lambda: profile_for(DEFAULT_VERSION))
    values: dict[Key, float] = field(default_factory=dict)
    hists: dict[Key, Hist] = field(default_factory=dict)

    def set(self, name: str, value: float, rank: int = -1, labels: Labels = ()) -> None:
        self.values[(name, rank, labels)] = value

    def inc(self, name: str, amount: float = 1.0, rank: int = -1, labels: Labels = ()) -> None:
        key = (name, rank, labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, name: str, rank: int = -1, labels: Labels = ()) -> float:
        return self.values.get((name, rank, labels), 0.0)

    def touched(self, name: str, rank: int, labels: Labels) -> bool:
        """Whether the series was ever set, added to or observed."""
        key = (name, rank, labels)
        return key in self.values or key in self.hists

    def request_labels(self, streaming: bool) -> Labels:
        """The extra labels of a finished request's series at this version."""
        if not self.profile.req_streaming_label:
            return ()
        return (("is_streaming", "true" if streaming else "false"),)

    def cache_source(self, source: str) -> Labels:
        return (("cache_source", source),) if self.profile.cache_source_label else ()

    def observe(self, family: Family, value: float, rank: int = -1, labels: Labels = ()) -> None:
        key = (family.name, rank, labels)
        hist = self.hists.get(key)
        if hist is None:
            # This version's buckets (they changed over time), not 0.5.23's.
            own = self.profile.by_name.get(family.name, family)
            hist = self.hists[key] = Hist(own.buckets)
        hist.observe(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_text(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _group_tp(state: MetricState) -> int:
    """TP ranks per DP rank: an attention-DP group's share of the TP group, or a replica's
    own TP group."""
    if state.dp_attention:
        return max(state.tp_size // max(state.dp_size, 1), 1)
    return max(state.tp_size, 1)


def _first_tp(state: MetricState, rank: int) -> int:
    """DP rank ``rank``'s first TP rank: with DP attention the ranks are slices of one TP
    group (tp_rank = group x its width), each replica counts its TP ranks from 0."""
    return max(rank, 0) * _group_tp(state) if state.dp_attention else 0


def scheduler_pid(state: MetricState, rank: int, tp: int = 0) -> int:
    """The pid of DP rank ``rank``'s ``tp``-th TP rank's scheduler: each DP rank's first is
    the twin's pid plus the rank, the others follow all of those."""
    if tp == 0:
        return state.pid + max(rank, 0)
    width = _group_tp(state)
    return state.pid + state.dp_size + max(rank, 0) * (width - 1) + tp - 1


def _base_labels(state: MetricState, scope: str, rank: int, tp: int = 0) -> dict[str, str]:
    """The labels SGLang gives DP rank ``rank``'s series (TP rank ``tp`` of it, counted from
    its first, for the series every TP rank's scheduler has)."""
    profile = state.profile
    if scope in (REQ, STARTUP):
        if not profile.req_engine_label:
            return {"model_name": state.model_name}
        return {"engine_type": "unified", "model_name": state.model_name}
    if scope == SCHED:
        # The reporting scheduler is each DP rank's first TP rank.
        first = _first_tp(state, rank)
        labels = {
            "engine_type": "unified",
            "model_name": state.model_name,
            "pp_rank": "0",
            "tp_rank": str(first + tp),
        }
        if profile.sched_moe_label:
            labels["moe_ep_rank"] = "0"
        if state.dp_size > 1:
            labels["dp_rank"] = str(rank)
        return labels
    if scope == CACHE:
        if not profile.cache_rank_labels:
            return {}
        # metrics_collector.radix_cache_metric_labels: the attention ranks with DP attention,
        # else the TP rank and DP rank 0, so replicas share label sets (and add up).
        dp_rank = rank if state.dp_attention else 0
        return {"dp_rank": str(dp_rank), "pp_rank": "0", "tp_rank": str(tp)}
    return {}


Series = tuple[int, Labels, dict[str, str]]


def _series(state: MetricState, family: Family) -> list[Series]:
    """Each series of ``family``: its value key (DP rank or -1, extra labels), its labels."""
    if family.dynamic:
        # In the order first used, as prometheus_client's multiprocess files list them.
        keys = [(r, labels) for (name, r, labels) in list(state.values) if name == family.name]
        seen = list(dict.fromkeys(keys))
        return [(r, labels, _base_labels(state, family.scope, r)) for r, labels in seen]
    if family.scope == CACHE:
        return _cache_series(state, family)
    ranked = family.scope in RANKED_SCOPES
    ranks = range(state.dp_size) if ranked else (-1,)
    out: list[Series] = []
    for rank in ranks:
        for variant in family.variants:
            key = (family.name, rank, variant)
            lazy = family.lazy or family.scope in LAZY_SCOPES
            if lazy and not state.touched(*key):
                continue
            # The TP ranks of a DP rank run the same batches: one value stands for all.
            for tp in _reporting_tp(state, family, variant):
                out.append((rank, variant, _base_labels(state, family.scope, rank, tp)))
    return out


def _reporting_tp(state: MetricState, family: Family, variant: Labels) -> range:
    """Which TP ranks of a DP rank (counted from its first) have a scheduler series."""
    if family.scope != SCHED:
        return range(1)
    if state.all_schedulers or state.profile.every_rank_emits(family, variant):
        return range(_group_tp(state))
    return range(1)


def _cache_series(state: MetricState, family: Family) -> list[Series]:
    """The radix cache's series: every scheduler (each TP rank of each DP rank) runs its
    own cache and collector. Before 0.5.2x they carry cache_type only, so multiprocess mode
    adds all of them into one series; since, their rank labels set them apart, except that
    replicas (no DP attention) all say dp_rank 0 and add up per TP rank. One value per DP
    rank stands for all its TP ranks (they evict alike)."""
    ranks = cache_ranks(state)
    seen = [
        (rank, variant)
        for rank in ranks
        for variant in family.variants
        if state.touched(family.name, rank, variant)
    ]  # the cache's series come with its first eviction
    if not state.profile.cache_rank_labels:
        return [(rank, variant, {}) for rank, variant in seen]
    return [
        (rank, variant, _base_labels(state, CACHE, rank, tp))
        for rank, variant in seen
        for tp in range(_group_tp(state))
    ]


def cache_ranks(state: MetricState) -> tuple[int, ...]:
    """The value keys of the radix cache's series: one per attention-DP group in 0.5.2x;
    else one (-1), which replicas (dp_rank 0 each in 0.5.2x) and, before, every cache of
    every TP rank add up to in multiprocess mode."""
    if state.profile.cache_rank_labels and state.dp_attention:
        return tuple(range(state.dp_size))
    return (-1,)


def cache_copies(state: MetricState) -> int:
    """How many TP ranks' caches one series adds up: before 0.5.2x (cache_type alone) every
    TP rank of a DP rank, evicting alike; since, each has its own series."""
    return 1 if state.profile.cache_rank_labels else _group_tp(state)


def render(state: MetricState, families: tuple[Family, ...] | None = None) -> str:
    lines: list[str] = []
    add = lines.append
    for family in state.profile.families if families is None else families:
        series = _series(state, family)
        if not series:
            continue
        add(f"# HELP {family.name} {family.help}")
        add(f"# TYPE {family.name} {family.type}")
        for rank, variant, base in series:
            labels = dict(base)
            labels.update(variant)
            if family.pid:
                tp = int(base["tp_rank"]) - _first_tp(state, rank)
                labels["pid"] = str(scheduler_pid(state, rank, tp))
            if family.type == "histogram":
                hist = state.hists.get((family.name, rank, variant)) or Hist(family.buckets)
                add(f"{family.name}_sum{_label_text(labels)} {floatToGoString(hist.total)}")
                for bound, count in zip(hist.buckets, hist.counts, strict=True):
                    with_le = dict(labels, le=floatToGoString(bound))
                    add(f"{family.name}_bucket{_label_text(with_le)} {floatToGoString(count)}")
                with_inf = dict(labels, le="+Inf")
                add(f"{family.name}_bucket{_label_text(with_inf)} {floatToGoString(hist.count)}")
                add(f"{family.name}_count{_label_text(labels)} {floatToGoString(hist.count)}")
            else:
                value = state.values.get((family.name, rank, variant), 0.0)
                add(f"{family.name}{_label_text(labels)} {floatToGoString(value)}")
    return "\n".join(lines) + "\n"


class _Page:
    """A collector holding the families of one rendered page."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))

    def collect(self) -> Iterable[Any]:
        return self.families


def serve_page(
    text: str, accept: str, accept_encoding: str, query: Mapping[str, Sequence[str]]
) -> tuple[bytes, dict[str, str]]:
    """The body and headers SGLang's /metrics answers with for ``text``: its route is
    prometheus_client's ASGI app over a registry holding one MultiProcessCollector, so the
    format follows the Accept header (OpenMetrics, text 1.0.0 with name escaping, else text
    0.0.4), Accept-Encoding: gzip compresses it, and ``name[]`` gives an empty page (the
    collector describes no names for the registry to keep). The page is re-read into that
    app's encoders, which give ``text`` itself back as text 0.0.4.

    OpenMetrics (Prometheus 2's default Accept) as prometheus_client >= 0.23 writes it under
    SGLang: the samples' names with ``_`` for ``:`` (sglang_num_running_reqs) while HELP and
    TYPE keep sglang:..., and Prometheus stores the samples' names. The example scrape config
    (etc/prometheus/prometheus.example.yml) renames them back for the rules and dashboard."""
    encoder, content_type = choose_encoder(accept)
    names = list(query.get("name[]", ()))
    if encoder is generate_latest and not names:
        body = text.encode()
    else:
        registry = CollectorRegistry()  # SGLang's: no auto-describe, a collector without
        registry.register(_Page(text))  # describe(), as MultiProcessCollector
        body = encoder(registry.restricted_registry(names) if names else registry)
    headers = {"Content-Type": content_type}
    if gzip_accepted(accept_encoding):
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    return body, headers


__all__ = [
    "PLAIN",
    "Hist",
    "MetricState",
    "cache_copies",
    "cache_ranks",
    "render",
    "scheduler_pid",
    "serve_page",
]
