"""The twin's lifecycle and HTTP API (aiohttp).

Start (specd.twin.launch): resolve the flags like SGLang (warnings and errors alike), keep
the port closed for ``--load-time-s`` ("loading the model"). Then here: answer 503 on
/health for ``--warmup-s``, then 200 (after a second: SGLang's /health generates a token
unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false). SIGTERM: 503 on /health, keep
serving and accepting, exit once nothing runs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from aiohttp import web

from specd.twin.adaptive import (
    Controller,
    cuda_graph_batch_sizes,
)
from specd.twin.auth import UNAUTHORIZED, Keys, allowed
from specd.twin.cli import SGLANG_DESTS
from specd.twin.engine import KV_TOKENS_PER_REQUEST, PREFILL_S_PER_TOKEN, Engine, Request
from specd.twin.exposition import MetricState, render, scheduler_pid, serve_page
from specd.twin.families import BY_NAME
from specd.twin.launch import TwinConfig, given_arguments, ignored_words, load
from specd.twin.loads import BadInclude, RankLoad, loads_json, loads_prometheus
from specd.twin.sglang_args import DEFAULTS

# SGLang's own warm-up request (http_server._execute_server_warmup): one /generate of 8
# greedy tokens, one prompt per DP rank, sent once the server answers /model_info.
WARMUP_PROMPT = "The capital city of France is"
WARMUP_MAX_NEW_TOKENS = 8
WARMUP_TIMEOUT_S = 600.0
DEFAULT_MAX_TOKENS = 256
# protocol.DEFAULT_MODEL_NAME: the model an OpenAI request names when it names none.
DEFAULT_MODEL_NAME = "default"
DRAIN_CHECK_S = 0.2
# What the twin's GPUs hold, in GB (a loaded Qwen3.5-122B rank): weights, KV pool, CUDA
# graphs, free memory when the pool was sized.
WEIGHT_GB, KV_CACHE_GB, GRAPH_GB, STARTUP_FREE_GB = 61.87, 44.13, 2.32, 9.87
CONTEXT_LEN = 262144  # the model's own (Qwen3.5's max_position_embeddings)
# SGLang's CUDA-graph phases (model_executor.graph_memory_usage), and the twin's share of
# capture time and memory in each: plain decode graphs without speculation, verify and
# draft graphs with it.
GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode",
                "draft_extend")  # fmt: skip
SPEC_GRAPH_SHARES = {"target_verify": 0.5, "draft_decode": 0.3, "draft_extend": 0.2}
DECODE_GRAPH_PHASES = ("decode", "target_verify", "draft_decode", "draft_extend")
# cpu_monitor.start_cpu_monitor_thread's default interval.
CPU_MONITOR_S = 5.0
log = logging.getLogger("specd.twin")
WORDS = ("the", " model", " twin", " speaks", " tokens", " at", " a", " measured", " rate", ".")


class Twin:
    def __init__(self, config: TwinConfig) -> None:
        self.config = config
        self.args = config.args
        self.phase = "warmup"  # warmup -> ready -> draining
        self.started = time.time()
        # SGLang reads it once, at import (http_server.HEALTH_CHECK_TIMEOUT): a value that is
        # no integer stops it from starting.
        self.health_check_timeout_s = int(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
        self.state = MetricState(
            model_name=config.model_name,
            dp_size=self.args.dp_size,
            tp_size=self.args.tp_size,
            dp_attention=self.args.enable_dp_attention,
            all_schedulers=self.args.enable_metrics_for_all_schedulers,
            pid=os.getpid(),
            profile=config.profile,
        )
        # --context-length, where given, is the model's context (model_config.context_len).
        given = given_arguments(ignored_words(self.args), DEFAULTS[config.profile.version])
        length = given.get("context_length")
        self.context_len = length if isinstance(length, int) and length > 0 else CONTEXT_LEN
        self.keys = Keys.from_words(ignored_words(self.args))
        self.engine = Engine(
            config.table,
            steps=config.steps,
            draft_tokens=config.draft_tokens,
            max_running=config.max_running,
            state=self.state,
            accept_length=config.accept_length,
            accept_noise=self.args.accept_noise,
            seed=self.args.seed,
            controller=self._controller(),
            accept_lengths=config.accept_lengths,
            decode_log_interval=self.args.decode_log_interval,
            radix_cache=not self.args.disable_radix_cache,
        )
        self._init_metrics()

    def _controller(self) -> Controller | None:
        cfg = self.config
        rules = cfg.profile.adaptive
        if cfg.adaptive_slots is None or rules is None:
            return None
        per_rank = cfg.max_running_per_rank
        return Controller(cfg.steps, cfg.adaptive_slots, rules, cuda_graph_batch_sizes(per_rank))

    def graph_shares(self) -> dict[str, float]:
        shares = SPEC_GRAPH_SHARES if self.config.algorithm is not None else {"decode": 1.0}
        return {phase: shares.get(phase, 0.0) for phase in GRAPH_PHASES}

    def startup_time(self) -> dict[str, Any]:
        """The scheduler's startup durations by phase (SGLang's build_scheduler_startup_time:
        what /server_info and sglang:startup_*_seconds report)."""
        a, cfg = self.args, self.config
        graphs = cfg.graph_set_s * cfg.graph_sets
        return {
            "load_weight": a.load_time_s * 0.6,
            "kv_cache_allocation": a.load_time_s * 0.05,
            "scheduler_e2e": cfg.load_s * 0.95,
            "cuda_graph": {phase: graphs * share for phase, share in self.graph_shares().items()},
        }

    def _init_metrics(self) -> None:
        st, a, cfg = self.state, self.args, self.config
        load = cfg.load_s
        startup = self.startup_time()
        for phase in ("load_weight", "kv_cache_allocation", "scheduler_e2e"):
            st.set("sglang:startup_time_seconds", startup[phase], -1, (("phase", phase),))
        st.set("sglang:startup_time_seconds", load, -1, (("phase", "tokenizer_e2e"),))
        for phase, seconds in startup["cuda_graph"].items():
            st.set("sglang:startup_cuda_graph_time_seconds", seconds, -1, (("phase", phase),))
        per_rank = self.config.max_running_per_rank
        for rank in range(a.dp_size):
            total = float(per_rank * KV_TOKENS_PER_REQUEST)
            if a.max_total_tokens:
                # SGLang takes --max-total-tokens where memory holds it (a warning if not).
                total = min(total, float(a.max_total_tokens))
            st.set("sglang:max_total_num_tokens", total, rank)
            st.set("sglang:num_pages", total, rank)
            st.set("sglang:kv_available_tokens", total, rank)
            st.set("sglang:page_size", 1.0, rank)
            st.set("sglang:context_len", float(self.context_len), rank)
            st.set("sglang:weight_memory_usage_gb", WEIGHT_GB, rank)
            st.set("sglang:kv_cache_memory_usage_gb", KV_CACHE_GB, rank)
            st.set("sglang:startup_available_gpu_memory_gb", STARTUP_FREE_GB, rank)
            for phase, share in self.graph_shares().items():
                st.set("sglang:graph_memory_usage_gb", GRAPH_GB * share, rank,
                       (("phase", phase),))  # fmt: skip
            # Before 0.5.18 two gauges stood for startup_time_seconds{phase}; the scheduler
            # set both to 0.0 (0.5.11-0.5.13 pass 0.0; 0.5.4 never sets its stats' 0.0).
            st.set("sglang:engine_startup_time", 0.0, rank)
            st.set("sglang:engine_load_weights_time", 0.0, rank)
            st.set("sglang:is_cuda_graph", 1.0, rank)
            st.set("sglang:fwd_occupancy", float("nan"), rank)
            for gt, le in (("0", "1"), ("1", "2"), ("2", "3"), ("3", "5"), ("5", "7"),
                           ("7", "10"), ("10", "20"), ("20", "50"), ("50", "100"),
                           ("100", "200"), ("200", "+Inf")):  # fmt: skip
                for fam in (
                    "sglang:routing_key_running_req_count",
                    "sglang:routing_key_all_req_count",
                ):
                    st.set(fam, 0.0, rank, (("gt", gt), ("le", le)))

    # -- HTTP ------------------------------------------------------------------------

    @web.middleware
    async def auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """SGLang's API-key middleware (specd.twin.auth): the outermost, so a refused request
        reaches no route and no HTTP metric."""
        profile = self.config.profile
        try:
            ok = allowed(self.keys, request.method, request.path,
                         request.headers.get("Authorization"), exempt=profile.auth_exempt,
                         levels=profile.auth_levels)  # fmt: skip
        except TypeError:
            return web.Response(status=500, text="Internal Server Error")
        if ok:
            return await handler(request)
        return web.Response(
            status=401, body=UNAUTHORIZED, headers={"Content-Type": "application/json"}
        )

    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        resource = request.match_info.route.resource
        # The route's path, else (no route, or not this method) the path asked for, as
        # SGLang's HTTP middleware labels it.
        handled = resource is not None and not isinstance(
            request.match_info.http_exception, web.HTTPMethodNotAllowed
        )
        endpoint = resource.canonical if handled and resource is not None else request.path
        labels = (("endpoint", endpoint), ("method", request.method))
        self.state.inc("sglang:http_requests_total", 1, -1, labels)
        self.state.inc("sglang:http_requests_active", 1, -1, labels)
        status = 500
        try:
            if self.args.slow_s > 0:
                await asyncio.sleep(self.args.slow_s)
            try:
                response = await handler(request)
            except web.HTTPNotFound:
                # FastAPI's own answer for a path no route has.
                response = web.json_response({"detail": "Not Found"}, status=404)
            except web.HTTPMethodNotAllowed as exc:
                response = web.json_response(
                    {"detail": "Method Not Allowed"},
                    status=405,
                    headers={"Allow": ", ".join(sorted(exc.allowed_methods))},
                )
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            self.state.inc("sglang:http_requests_active", -1, -1, labels)
            self.state.inc(
                "sglang:http_responses_total", 1, -1, (*labels, ("status_code", str(status)))
            )

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth, self.middleware])
        r = app.router
        profile = self.config.profile
        # FastAPI routes: GET ones do not answer HEAD.
        get: Callable[..., Any] = functools.partial(r.add_get, allow_head=False)
        get("/health", self.health)
        get("/health_generate", self.health)
        if profile.ready:
            get("/ready", self.ready)
        if self.args.enable_metrics and not self.args.metrics_404:
            # A mounted ASGI app: it answers every method.
            r.add_route("*", "/metrics", self.metrics)
        if profile.server_info:
            get("/server_info", self.server_info)
        get("/get_server_info", self.server_info)
        if profile.model_info:
            get("/model_info", self.model_info)
        get("/get_model_info", self.model_info)
        get("/freeze_gc", self.freeze_gc)
        r.add_post("/freeze_gc", self.freeze_gc)
        get("/v1/models", self.models)
        if profile.v1_loads:
            get("/v1/loads", self.loads)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        return app

    async def health(self, request: web.Request) -> web.Response:
        """SGLang's health_generate (both paths): 503 at once while starting or draining;
        else it sends a 1-token generation and, a second later and every second after, looks
        whether anything came back since (the twin's always has), so 200 takes >= 1 s
        (``--health-first-look-s``). Nothing back within SGLANG_HEALTH_CHECK_TIMEOUT (20 s):
        503 then, not before."""
        if self.phase != "ready":
            return web.Response(status=503)
        # The fault stands for a server whose generation never comes back: unhealthy on
        # both paths, as SGLang's default /health (which generates) would be, after SGLang's
        # whole wait (a prober whose timeout is shorter sees a timeout, as on the GPU box).
        if self.args.never_healthy:
            await asyncio.sleep(max(self.health_check_timeout_s, 0))
            return web.Response(status=503)
        if request.path == "/health" and not self._health_generates():
            return web.Response(status=200)
        await asyncio.sleep(self.args.health_first_look_s)
        return web.Response(status=200)

    def _health_generates(self) -> bool:
        """Whether /health runs the generation too (and so takes >= 1 s), as SGLang's does
        unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is false (0.5.11+; always before).
        Read at each probe, as SGLang reads it. /health_generate, what specd probes, always
        takes SGLang's second; a gateway (smg) probes /health."""
        if not self.config.profile.health_generation_env:
            return True
        value = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION")
        return value is None or value.strip().lower() in ("true", "1", "yes", "y")

    async def ready(self, request: web.Request) -> web.Response:
        # /ready (0.5.20+): up and not shutting down, answered at once, no generation.
        healthy = self.phase == "ready" and not self.args.never_healthy
        return web.Response(status=200 if healthy else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        ctype = "text/plain; version=0.0.4; charset=utf-8"
        if self.args.garbage_metrics:
            garbage = 'sglang:num_running_reqs{engine_type="unified" 3\n# TYPE broken\n\x00garbage'
            return web.Response(body=garbage.encode(), headers={"Content-Type": ctype})
        self.engine.advance()
        text = render(self.state)
        pad = self.args.metrics_pad_bytes
        if pad > 0:
            text = _padding(pad) + text
        body, headers = serve_page(
            text,
            ",".join(request.headers.getall("Accept", [])),
            ",".join(request.headers.getall("Accept-Encoding", [])),
            parse_qs(request.query_string),
        )
        return web.Response(body=body, headers=headers)

    def server_arguments(self) -> dict[str, Any]:
        """The server arguments as this SGLang resolved them: /server_info's top level and
        the start of each internal state."""
        a, cfg = self.args, self.config
        # That version's arguments at their defaults, then those given: the twin's own
        # (as the twin resolved them), and the SGLang flags it does not model.
        info: dict[str, Any] = dict(DEFAULTS[cfg.profile.version])
        info.update(given_arguments(ignored_words(a), info))
        info.update({k: v for k, v in vars(a).items() if k in SGLANG_DESTS and k in info})
        resolved = {
            "model_path": a.model_path,
            "tokenizer_path": info.get("tokenizer_path") or a.model_path,
            "served_model_name": cfg.model_name,
            "speculative_algorithm": cfg.algorithm,
            "speculative_num_steps": a.speculative_num_steps,
            "speculative_eagle_topk": a.speculative_eagle_topk,
            "speculative_num_draft_tokens": a.speculative_num_draft_tokens,
            "speculative_adaptive": cfg.adaptive,
            "speculative_adaptive_config": a.speculative_adaptive_config,
            "max_running_requests": a.max_running_requests,
        }
        info.update({k: v for k, v in resolved.items() if k in info})
        # The keys as given: text (argparse's type str), never a number.
        keys = {"api_key": self.keys.api_key, "admin_api_key": self.keys.admin_api_key}
        info.update({k: v for k, v in keys.items() if k in info})
        if cfg.profile.attn_dp_size:
            # 0.5.23 resolves the deprecated `--dp-size N --enable-dp-attention` into
            # `--attn-dp-size N` with dp_size 1 (parallel_hook), and reports
            # enable_dp_attention as whether attention DP runs (ServerArgs.resolved_dict).
            attn = a.dp_size if a.enable_dp_attention else 1
            info.update(
                dp_size=1 if attn > 1 else a.dp_size,
                attn_dp_size=attn,
                enable_dp_attention=attn > 1,
            )
        return info

    def _scheduler_pids(self) -> list[int]:
        """The scheduler processes the DP controller started: every TP rank of every DP
        rank, as their metrics' pid labels say."""
        ranks, tp = self.args.dp_size, max(self.args.tp_size, 1)
        per_rank = max(tp // ranks, 1) if self.args.enable_dp_attention else tp
        return [scheduler_pid(self.state, k, t) for k in range(ranks) for t in range(per_rank)]

    def internal_state(self, rank: int, arguments: dict[str, Any]) -> dict[str, Any]:
        """What DP rank ``rank``'s scheduler answers to get_internal_state: its server
        arguments (a copy of the launch's) plus its own figures, per version."""
        cfg = self.config
        state = dict(arguments)
        total = int(self.state.get("sglang:max_total_num_tokens", rank))
        graphs = {phase: GRAPH_GB * share for phase, share in self.graph_shares().items()}
        throughput = self.state.get("sglang:gen_throughput", rank)
        if cfg.profile.resolved_server_info:
            # internal_state.SchedulerInternalStateController.get_internal_state.
            a = self.args
            replicas = 1 if a.enable_dp_attention else a.dp_size
            state["world_size"] = replicas * max(a.tp_size, 1)
            state["startup_time"] = self.startup_time()
            state["effective_max_running_requests_per_dp"] = cfg.max_running_per_rank
            state["last_gen_throughput"] = throughput
            state["memory_usage"] = {
                "weight": round(WEIGHT_GB, 3),
                "kvcache": round(KV_CACHE_GB, 3),
                "startup_available": round(STARTUP_FREE_GB, 3),
                "token_capacity": total,
                "token_capacity_swa": None,
                "graph": {phase: round(gb, 3) for phase, gb in graphs.items()},
            }
            state["disaggregation_mode"] = "null"
            state["decode_cuda_graph_bs"] = cuda_graph_batch_sizes(cfg.max_running_per_rank)
            state["decode_cuda_graph_memory_gb"] = round(
                sum(graphs[phase] for phase in DECODE_GRAPH_PHASES), 3
            )
        else:
            # scheduler.get_internal_state: vars(server_args) and the scheduler's figures;
            # the limit memory sizing left it with since 0.5.8.
            state["last_gen_throughput"] = throughput
            state["memory_usage"] = {
                "weight": round(WEIGHT_GB, 2),
                "kvcache": round(KV_CACHE_GB, 2),
                "token_capacity": total,
                "graph": round(GRAPH_GB, 2),
            }
            if cfg.profile.effective_capacity:
                state["effective_max_running_requests_per_dp"] = cfg.max_running_per_rank
        # Only with speculation, once a decode log has counted its verify steps.
        accept = self.engine.lifetime_accept_length(rank)
        if accept is not None:
            state["avg_spec_accept_length"] = accept
        return state

    def server_info_dict(self) -> dict[str, Any]:
        """/server_info (/get_server_info), as that version's http_server builds it."""
        a, cfg = self.args, self.config
        profile = cfg.profile
        arguments = self.server_arguments()
        info: dict[str, Any] = dict(arguments)
        if profile.resolved_server_info:
            info["launch_command"] = cfg.launch_command
        total = int(self.state.get("sglang:max_total_num_tokens", 0))
        # The scheduler's (or DP controller's) ready message.
        info["status"] = "ready"
        info["max_total_num_tokens"] = total
        info["max_req_input_len"] = min(self.context_len - 1, total - 1) - 5
        if profile.resolved_server_info:
            # The tokenizer's startup times (the schedulers', its own end to end added)
            # stand where the ready message's are.
            info["startup_time"] = {**self.startup_time(), "tokenizer_e2e": cfg.load_s}
            info["hicache_object_layout"] = {
                "enabled": False,
                "backend": None,
                "page_size": 1,
                "hicache_object_layout": {"pools": []},
                "reason": "Hierarchical cache is disabled",
            }
            if a.dp_size > 1:
                info["scheduler_pids"] = self._scheduler_pids()
            info["kv_events"] = None
        info["internal_states"] = [
            self.internal_state(rank, arguments) for rank in range(a.dp_size)
        ]
        info["version"] = profile.version
        if profile.resolved_server_info:
            info["frontend"] = "python"
        elif profile.kv_events:
            info["kv_events"] = None
        for name in a.server_info_missing:
            info.pop(name, None)
        return info

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.server_info_dict())

    def model_info_dict(self) -> dict[str, Any]:
        """/model_info (/get_model_info), as that version's http_server builds it."""
        arguments = self.server_arguments()
        profile = self.config.profile
        info: dict[str, Any] = {"model_path": self.args.model_path}
        if profile.resolved_server_info:
            info["served_model_name"] = self.config.model_name
        info.update(
            tokenizer_path=arguments["tokenizer_path"],
            is_generation=True,
            preferred_sampling_params=arguments["preferred_sampling_params"],
            weight_version=arguments["weight_version"],
        )
        if profile.resolved_server_info:
            for name in ("load_format", "reasoning_parser", "tool_call_parser",
                         "disaggregation_mode"):  # fmt: skip
                info[name] = arguments[name]
        if profile.model_info:
            # The model's own config (Qwen3.5's, a multimodal MoE), since 0.5.11.
            info.update(
                has_image_understanding=True,
                has_audio_understanding=False,
                model_type="qwen3_5_moe",
                architectures=["Qwen3_5MoeForConditionalGeneration"],
            )
        return info

    async def model_info(self, request: web.Request) -> web.Response:
        # Answered while warming up too: SGLang's warm-up waits for exactly this.
        return web.json_response(self.model_info_dict())

    async def freeze_gc(self, request: web.Request) -> web.Response:
        return web.Response(status=200, text="Garbage collection frozen.\n")

    async def models(self, request: web.Request) -> web.Response:
        # A ModelCard made per request: created is now.
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.config.model_name,
            "parent": None,
            "max_model_len": self.context_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    def rank_loads(self) -> list[RankLoad]:
        """Each DP rank's scheduler's load figures (its load_inquirer's)."""
        engine, st = self.engine, self.state
        engine.advance()
        ranks = self.args.dp_size
        out = []
        for rank in range(ranks):
            running = [r for r in engine.running if r.rank == rank]
            waiting = [r for r in engine.waiting if r.rank == rank]
            out.append(
                RankLoad(
                    dp_rank=rank if ranks > 1 else None,
                    running=len(running),
                    waiting=len(waiting),
                    used_tokens=sum(r.prompt_tokens + r.emitted for r in running),
                    waiting_tokens=sum(r.prompt_tokens for r in waiting),
                    max_total_num_tokens=int(st.get("sglang:max_total_num_tokens", rank)),
                    # The rank's scheduler's own limit, as internal_states report it.
                    max_running_requests=self.config.max_running_per_rank,
                    token_usage=st.get("sglang:token_usage", rank),
                    gen_throughput=st.get("sglang:gen_throughput", rank),
                    utilization=st.get("sglang:utilization", rank),
                    # None until a decode log has counted verify steps.
                    accept_length=engine.lifetime_accept_length(rank),
                    accept_rate=st.get("sglang:spec_accept_rate", rank),
                    weight_gb=WEIGHT_GB,
                    kv_cache_gb=KV_CACHE_GB,
                    graph_gb=GRAPH_GB,
                    prefill_tokens=engine.prefill_tokens[rank],
                    prefill_busy_us=int(engine.prefill_tokens[rank] * PREFILL_S_PER_TOKEN * 1e6),
                    decode_moments=list(engine.decode_moments[rank]),
                    timestamp=time.time(),
                )
            )
        return out

    async def loads(self, request: web.Request) -> web.Response:
        """/v1/loads (0.5.8+), as that version answers it (specd.twin.loads)."""
        start = time.perf_counter()
        try:
            return self._loads(request)
        finally:
            if self.config.profile.has_family("sglang:get_loads_duration_seconds"):
                self.state.observe(
                    BY_NAME["sglang:get_loads_duration_seconds"],
                    time.perf_counter() - start,
                    -1,
                )

    def _loads(self, request: web.Request) -> web.Response:
        version = self.config.profile.version
        query = request.query
        include = {s.strip() for s in query["include"].split(",")} if "include" in query else None
        ranks = self.rank_loads()
        if "dp_rank" in query:
            try:
                wanted = int(query["dp_rank"])
            except ValueError:
                return web.json_response(_bad_request("dp_rank: not a valid integer"), status=400)
            ranks = [load for load in ranks if (load.dp_rank or 0) == wanted]
            if version == "0.5.11":  # filtered on the scheduler's dp_rank, None without DP
                ranks = [load for load in ranks if load.dp_rank == wanted]
        try:
            if query.get("format") == "prometheus":
                text = loads_prometheus(ranks, version, include)
                ctype = "text/plain; version=0.0.4; charset=utf-8"
                return web.Response(body=text.encode(), headers={"Content-Type": ctype})
            tp, ranks_n = max(self.args.tp_size, 1), max(self.args.dp_size, 1)
            accelerators = tp // ranks_n if self.args.enable_dp_attention else tp
            return web.json_response(
                loads_json(ranks, version, include, accelerators=max(accelerators, 1))
            )
        except BadInclude:
            # Raised past the endpoint's own handling: Starlette's 500.
            return web.Response(status=500, text="Internal Server Error")

    # -- generation ------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise web.HTTPBadRequest(
                text=json.dumps(_bad_request("request body is not valid JSON")),
                content_type="application/json",
            ) from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(
                text=json.dumps(_bad_request("request body must be a JSON object")),
                content_type="application/json",
            )
        return body

    def _request(self, body: dict[str, Any], prompt_text: str, max_key: str) -> Request:
        raw = body.get(max_key, body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
        if raw is None:
            raw = DEFAULT_MAX_TOKENS
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
            raise web.HTTPBadRequest(
                text=json.dumps(_bad_request(f"{max_key} must be a positive integer")),
                content_type="application/json",
            )
        prompt_tokens = max(1, len(prompt_text.split()))
        return Request(
            prompt_tokens=prompt_tokens,
            max_tokens=raw,
            streaming=bool(body.get("stream", False)),
            arrival=self.engine.clock(),
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if not _json_media_type(request):
            return _openai_error(_UNSUPPORTED_MEDIA, "Bad Request")
        body = await self._body(request)
        prompt = body.get("prompt", "")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        req = self._request(body, text, "max_tokens")
        # serving_completions._validate_request.
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
            return _openai_error("Prompt cannot be empty")
        return await self._openai(request, body, req, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        if not _json_media_type(request):
            return _openai_error(_UNSUPPORTED_MEDIA, "Bad Request")
        body = await self._body(request)
        messages = body.get("messages", [])
        text = (
            " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            if isinstance(messages, list)
            else ""
        )
        req = self._request(body, text, "max_tokens")
        # serving_chat._validate_request.
        if not messages:
            return _openai_error("Messages cannot be empty.")
        return await self._openai(request, body, req, chat=True)

    @functools.cached_property
    def _serving(self) -> dict[str, Any]:
        """The server arguments the OpenAI answers depend on, as given at launch."""
        arguments = self.server_arguments()
        return {
            "stream_response_default_include_usage": (
                arguments.get("stream_response_default_include_usage") is True
            ),
            "enable_cache_report": arguments.get("enable_cache_report") is True,
            "weight_version": arguments.get("weight_version", "default"),
        }

    def _usage(self, req: Request, completion: int, *, cache_report: bool) -> dict[str, Any]:
        """A UsageInfo (protocol.py) as pydantic dumps it. The twin generates no reasoning
        tokens and finds no prompt cached, so those counts are 0."""
        return {
            "prompt_tokens": req.prompt_tokens,
            "total_tokens": req.prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": 0} if cache_report else None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    async def _openai(
        self, request: web.Request, body: dict[str, Any], req: Request, chat: bool
    ) -> web.StreamResponse:
        """/v1/chat/completions and /v1/completions as SGLang 0.5.23's serving_chat and
        serving_completions answer them: the id is the request's rid (a uuid4 hex unless the
        client gave one), the model the one the client named ("default" if none), every
        answer ends for length (the twin has no stop tokens)."""
        rid = body.get("rid") if isinstance(body.get("rid"), str) else uuid.uuid4().hex
        model = body.get("model", DEFAULT_MODEL_NAME)
        if not isinstance(model, str):
            model = DEFAULT_MODEL_NAME
        cache_report = self._serving["enable_cache_report"]
        self.engine.submit(req)
        if not req.streaming:
            text = await self._collect(req)
            choice: dict[str, Any] = {"index": 0}
            if chat:
                choice["message"] = {"role": "assistant", "content": text,
                                     "reasoning_content": None}  # fmt: skip
            else:
                choice["text"] = text
            choice.update(logprobs=None, finish_reason="length", matched_stop=None)
            answer = {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),  # once the output is all there
                "model": model,
                "choices": [choice],
                "usage": self._usage(req, req.emitted, cache_report=cache_report),
                "metadata": {"weight_version": self._serving["weight_version"]},
            }
            return web.Response(body=_dumps(answer), headers={"Content-Type": "application/json"})
        include_usage, continuous = _should_include_usage(
            body.get("stream_options"), self._serving["stream_response_default_include_usage"]
        )
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model}  # fmt: skip
        resp = self._sse_response()
        emitted = 0
        try:
            await resp.prepare(request)
            async for count, text in self._tokens(req):
                first, emitted = emitted == 0, emitted + count
                if not chat:
                    # CompletionStreamResponse.model_dump_json(): the finish reason on the
                    # last text, usage null unless continuous_usage_stats (and then without
                    # cached-token details).
                    finish = "length" if emitted >= req.max_tokens else None
                    choice = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": finish, "matched_stop": None}  # fmt: skip
                    usage = self._usage(req, emitted, cache_report=False) if continuous else None
                    await resp.write(_sse({**head, "choices": [choice], "usage": usage}))
                    continue
                if first:
                    # The role first, in a chunk of its own.
                    await resp.write(_chat_chunk(head, {"role": "assistant", "content": ""}))
                usage = self._usage(req, emitted, cache_report=cache_report) if continuous else None
                await resp.write(_chat_chunk(head, {"content": text}, usage=usage))
            if chat and emitted >= req.max_tokens:
                # The finish reason in a chunk of its own, its delta empty.
                await resp.write(_chat_chunk(head, {}, finish="length"))
            if include_usage:
                usage = self._usage(req, emitted, cache_report=cache_report)
                tail: dict[str, Any] = {**head, "choices": [], "usage": usage}
                if not chat:
                    # model_dump_json(exclude_none=True).
                    tail["usage"] = {k: v for k, v in usage.items() if v is not None}
                await resp.write(_sse(tail))
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            self._client_gone(req)
        except asyncio.CancelledError:
            self.engine.abort(req)
            raise
        return resp

    def _client_gone(self, req: Request) -> None:
        # A streaming client hanging up is normal (a load generator lowering concurrency,
        # Ctrl-C): stop generating for it; the response is done, not an error.
        self.engine.abort(req)
        log.debug("client disconnected mid-stream")

    async def _collect(self, req: Request) -> str:
        """The whole output of a non-streamed request; a client gone mid-way aborts it."""
        pieces: list[str] = []
        try:
            async for _, text in self._tokens(req):
                pieces.append(text)
        except asyncio.CancelledError:
            self.engine.abort(req)
            raise
        return "".join(pieces)

    def _meta(self, req: Request) -> Callable[[], dict[str, Any]]:
        rid = uuid.uuid4().hex

        def meta() -> dict[str, Any]:
            done = req.emitted >= req.max_tokens
            return {
                "id": rid,
                "finish_reason": {"type": "length", "length": req.max_tokens} if done else None,
                "prompt_tokens": req.prompt_tokens,
                "completion_tokens": req.emitted,
                "cached_tokens": 0,
                "spec_verify_ct": int(req.verifies + 1e-9),
                "e2e_latency": self.engine.clock() - req.arrival,
            }

        return meta

    async def _generate_one(self, req: Request) -> dict[str, Any]:
        meta = self._meta(req)
        self.engine.submit(req)
        text = await self._collect(req)
        return {"text": text, "meta_info": meta()}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            params = {}
        text_in = body.get("text", "")
        if isinstance(text_in, list) and not body.get("stream", False):
            # A batch, as SGLang's warm-up sends with several DP ranks: one result each.
            batch = [self._request(params, str(t), "max_new_tokens") for t in text_in]
            results = await asyncio.gather(*(self._generate_one(r) for r in batch))
            return web.json_response(results)
        req = self._request(params | {"stream": body.get("stream", False)},
                            str(text_in), "max_new_tokens")  # fmt: skip
        if not req.streaming:
            return web.json_response(await self._generate_one(req))
        meta = self._meta(req)
        self.engine.submit(req)
        resp = self._sse_response()
        so_far = ""
        try:
            await resp.prepare(request)
            async for _, text in self._tokens(req):
                so_far += text
                chunk = {"text": so_far, "meta_info": meta()}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            self._client_gone(req)
        except asyncio.CancelledError:
            self.engine.abort(req)
            raise
        return resp

    @staticmethod
    def _sse_response() -> web.StreamResponse:
        # Starlette's StreamingResponse(media_type="text/event-stream"): the charset added.
        return web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})

    async def _tokens(self, req: Request) -> AsyncIterator[tuple[int, str]]:
        """Each piece of output as the engine hands it over: how many tokens, their text."""
        position = 0
        while True:
            count = await req.chunks.get()
            if count is None:
                return
            words = [WORDS[(position + i) % len(WORDS)] for i in range(count)]
            position += count
            yield count, "".join(words)

    # -- warm-up ---------------------------------------------------------------------

    async def warm_up(self, url: str) -> None:
        """SGLang's warm-up, over HTTP to itself: model info, then one /generate of 8 tokens
        (one prompt per DP rank), then (0.5.2x) /freeze_gc. Raises if any of them fails."""
        import aiohttp  # noqa: PLC0415  (the server side already imports it)

        profile = self.config.profile
        ranks = max(self.args.dp_size, 1)
        text: str | list[str] = WARMUP_PROMPT if ranks == 1 else [WARMUP_PROMPT] * ranks
        body = {
            "sampling_params": {"temperature": 0, "max_new_tokens": WARMUP_MAX_NEW_TOKENS},
            "text": text,
        }
        timeout = aiohttp.ClientTimeout(total=WARMUP_TIMEOUT_S)
        # With --api-key every request bears it; /freeze_gc the admin key if there is one.
        headers = self.keys.warmup_headers()
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            async with session.get(url + profile.warmup_model_info_path) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{profile.warmup_model_info_path}: HTTP {resp.status}")
            async with session.post(url + "/generate", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"/generate: HTTP {resp.status}: {await resp.text()}")
                await resp.read()
            if profile.freeze_gc_after_warmup:
                # A refusal here is only a warning in SGLang (the server still comes up).
                freeze = self.keys.warmup_headers(admin=True)
                async with session.post(url + "/freeze_gc", headers=freeze) as resp:
                    await resp.read()

    # -- background ------------------------------------------------------------------

    async def reporter(self) -> None:
        interval = max(self.args.report_interval_s, 0.05)
        while True:
            await asyncio.sleep(interval)
            self.engine.report()

    async def cpu_monitor(self) -> None:
        """SGLang's cpu_monitor threads (0.5.11+): each process adds the CPU time it used to
        sglang:process_cpu_seconds_total{component} every 5 s, from before the model loads
        (so a ready server has its series). The twin is all of them in one process: the
        tokenizer gets half of its CPU time, the detokenizer and, with several DP ranks,
        the DP controller the rest."""
        components = ["tokenizer", "detokenizer"]
        if self.args.dp_size > 1:
            components.append("data_parallel_controller")
        shares = {"tokenizer": 0.5}
        rest = 0.5 / (len(components) - 1)
        last = time.process_time()
        while True:
            now = time.process_time()
            for component in components:
                self.state.inc("sglang:process_cpu_seconds_total",
                               (now - last) * shares.get(component, rest), -1,
                               (("component", component),))  # fmt: skip
            last = now
            await asyncio.sleep(CPU_MONITOR_S)


def _bad_request(message: str, err_type: str = "Bad Request") -> dict[str, Any]:
    """SGLang's ErrorResponse for a request it cannot validate (its RequestValidationError
    handler: 400, "Bad Request"; the OpenAI routes' own checks: "BadRequestError")."""
    return {"object": "error", "message": message, "type": err_type, "param": None,
            "code": 400}  # fmt: skip


# http_server.validate_json_request's error, as its RequestValidationError handler words it
# (FastAPI's str() of the exception, then its errors, as FastAPI 0.124+ formats them).
_MEDIA_ERRORS = [
    {
        "loc": ["header", "content-type"],
        "msg": "Unsupported Media Type: Only 'application/json' is allowed",
        "type": "value_error",
    }
]
_UNSUPPORTED_MEDIA = f"1 validation error:\n  {_MEDIA_ERRORS[0]} {_MEDIA_ERRORS}"


def _json_media_type(request: web.Request) -> bool:
    """http_server.validate_json_request: the media type must be exactly application/json."""
    content_type = request.headers.get("Content-Type", "").lower()
    return content_type.split(";", maxsplit=1)[0] == "application/json"


def _dumps(obj: Any) -> bytes:
    # orjson, msgspec and pydantic all write compact JSON, non-ASCII as it is.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _openai_error(message: str, err_type: str = "BadRequestError") -> web.Response:
    """serving_base.create_error_response (and the validation handler, err_type
    "Bad Request"): an ErrorResponse as ORJSONResponse writes it, HTTP 400."""
    return web.Response(
        status=400,
        body=_dumps(_bad_request(message, err_type)),
        headers={"Content-Type": "application/json"},
    )


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _chat_chunk(
    head: dict[str, Any],
    delta: dict[str, Any],
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
) -> bytes:
    """sse_utils.build_sse_content: msgspec structs that leave out what is at its default,
    except the delta's reasoning_content and the choice's fields; ``head`` is the id, object,
    created and model."""
    choice = {"index": 0, "delta": {"reasoning_content": None, **delta}, "logprobs": None,
              "finish_reason": finish, "matched_stop": None}  # fmt: skip
    chunk = {**head, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return _sse(chunk)


def _lax_bool(value: Any) -> bool:
    """A bool as pydantic reads one in lax mode (true, 1, "yes", "on"...)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "t", "yes", "y", "on")
    return value is True or (isinstance(value, int) and value == 1)


def _should_include_usage(stream_options: Any, default_include_usage: bool) -> tuple[bool, bool]:
    """utils.should_include_usage: (a final usage chunk, usage on every chunk). Usage on
    every chunk needs only continuous_usage_stats; the final chunk include_usage or the
    server's --stream-response-default-include-usage."""
    if isinstance(stream_options, dict):
        include = _lax_bool(stream_options.get("include_usage")) or default_include_usage
        return include, _lax_bool(stream_options.get("continuous_usage_stats"))
    return default_include_usage, False


def _self_url(host: str, port: int) -> str:
    # A wildcard listen address is reached through loopback, as SGLang's server_args.url().
    reach = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host  # noqa: S104
    return f"http://[{reach}]:{port}" if ":" in reach else f"http://{reach}:{port}"


def _bound_port(addresses: list[Any]) -> int:
    """The port the listening sockets got (the first's: one host, one socket, one port)."""
    for address in addresses:
        if isinstance(address, tuple) and len(address) >= 2 and isinstance(address[1], int):
            return address[1]
    raise RuntimeError(f"no TCP port among the listening sockets {addresses!r}")


def _padding(size: int) -> str:
    header = "# HELP sglang:twin_padding Padding series for large-page tests.\n"
    header += "# TYPE sglang:twin_padding gauge\n"
    lines = [header]
    total = len(header)
    i = 0
    while total < size:
        line = f'sglang:twin_padding{{i="{i}"}} 0.0\n'
        lines.append(line)
        total += len(line)
        i += 1
    return "".join(lines)


async def run_until(config: TwinConfig, stop: asyncio.Event) -> int:
    """The twin's life in the running loop: load (port closed), listen, warm up, serve
    until ``stop`` is set (SIGTERM's part in a process), then drain; the exit code.
    A caller that owns no signals (a thread of a test process) sets ``stop`` itself."""
    code = await load(config, stop)
    return code if code is not None else await listen(config, stop)


async def listen(config: TwinConfig, stop: asyncio.Event) -> int:
    """The twin once loaded: listen, warm up, serve until ``stop``, drain; the exit code."""
    args = config.args
    twin = Twin(config)
    runner = web.AppRunner(twin.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    try:
        await site.start()
    except OSError as exc:
        print(f"[twin] ERROR: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        await runner.cleanup()
        return 1
    if args.port == 0:
        # --port 0: the system picked a free port. It is the twin's port from now on (its
        # warm-up, /server_info) and is announced below, where a caller reads it.
        args.port = _bound_port(runner.addresses)
    mode = f"adaptive {config.candidates}" if config.adaptive else f"steps {config.steps}"
    print(f"[twin] listening on http://{args.host}:{args.port} ({mode})",
          file=sys.stderr, flush=True)  # fmt: skip
    tasks = [asyncio.create_task(twin.engine.run()), asyncio.create_task(twin.reporter())]
    tasks.append(asyncio.create_task(twin.cpu_monitor()))
    try:
        try:
            await asyncio.wait_for(stop.wait(), timeout=max(args.warmup_s, 0.0))
        except asyncio.TimeoutError:
            if not args.skip_server_warmup:
                warm = asyncio.create_task(twin.warm_up(_self_url(args.host, args.port)))
                halt = asyncio.create_task(stop.wait())
                await asyncio.wait({warm, halt}, return_when=asyncio.FIRST_COMPLETED)
                halt.cancel()
                if not warm.done():
                    warm.cancel()
                    return 143
                error = warm.exception()
                if error is not None:
                    # SGLang kills itself when its warm-up fails.
                    print(f"[twin] ERROR: Initialization failed. warmup error: {error}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    return 1
            twin.phase = "ready"
            print("[twin] The server is fired up and ready to roll!", file=sys.stderr, flush=True)
            await stop.wait()
        # SIGTERM: unhealthy, keep serving and accepting until nothing runs.
        twin.phase = "draining"
        while not twin.engine.idle():
            await asyncio.sleep(DRAIN_CHECK_S)
    finally:
        for task in tasks:
            task.cancel()
        await runner.cleanup()
    return 0
