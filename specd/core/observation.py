"""What one scrape of SGLang tells specd: an Observation, or a ScrapeError saying why not."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

ErrorKind = Literal["timeout", "refused", "http_status", "malformed", "missing"]


@dataclass(frozen=True)
class Observation:
    t: float
    running: int
    queued: int
    accept_length: float | None
    spec_fresh: bool
    steps: int | None
    draft_tokens: int | None
    topk: int | None
    algorithm: str | None
    max_running_requests: int | None
    token_usage: float | None
    gen_throughput: float | None
    generation_tokens_total: float | None
    decode_tokens_total: float | None
    spec_verify_calls_total: float | None
    retracted_total: float | None
    version: str | None
    dp_ranks: int
    launch_command: str | None

    @property
    def offered(self) -> int:
        return self.running + self.queued

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "offered": self.offered}


@dataclass(frozen=True)
class ScrapeError:
    kind: ErrorKind
    reason: str
    t: float
