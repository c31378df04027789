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
import math
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from aiohttp import hdrs, web

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
from specd.twin.validation import (
    ChatBody,
    CompletionBody,
    Errors,
    body_errors,
    generate_body_errors,
    read_body,
    validation_message,
)

# SGLang's own warm-up request (http_server._execute_server_warmup), sent once the server
# answers /model_info: 8 greedy tokens, from /generate (one prompt per DP rank), or, when
# /model_info says the model understands images, from /v1/chat/completions with a picture.
WARMUP_PROMPT = "The capital city of France is"
WARMUP_MAX_NEW_TOKENS = 8
WARMUP_TIMEOUT_S = 600.0
# http_server.MINIMUM_PNG_PICTURE_BASE64: the picture a VLM (not Kimi's) warms up with.
WARMUP_PNG_BASE64 = (
    "iVBORw0KGgoAAAANSUhEUgAAACAAAAAgCAYAAABzenr0AAAACXBIWXMAAA7EAAAOxAGVKw4bAAAAbUlE"
    "QVRYhe3VsQ2AMAxE0Y/lIgNQULD/OqyCMgCihCKSG4yRuKuiNH6JLsoEbMACOGBcua9HOR7Y6w6swBwM"
    "y0qLTpkeI77qdEBpBFAHBBDAGH8WrwJKI4AAegUCfAKgEgpQDvh3CR3oQCuav58qlAw73kKCSgAAAABJ"
    "RU5ErkJggg=="
)
# sampling_params.SamplingParams.max_new_tokens: /generate's default.
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128
# Scheduler.init_req_max_new_tokens: what a request without a limit asks for.
UNLIMITED_NEW_TOKENS = 1 << 30
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
# The twin's vocabulary: a token id per word (made up, as the words are).
WORD_IDS = (1782, 1614, 27497, 21191, 11211, 518, 264, 16878, 4379, 13)
# SGLang's route paths where aiohttp spells the route another way (its metrics label).
ROUTE_PATHS = {"/metrics{path}": "/metrics", "/v1/models/{model}": "/v1/models/{model:path}"}
# Starlette's CORSMiddleware as SGLang configures it (allow_methods ["*"], max_age 600).
# Set once past the CORS middleware: the request's Origin, if it had one.
CORS_KEY: web.RequestKey[tuple[str, ...]] = web.RequestKey("cors_origin", tuple)
CORS_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")
CORS_PREFLIGHT_VARY = (
    "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
    "Access-Control-Request-Private-Network"
)


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
        self._routing_keys: dict[str, int] = {}  # active requests per x-smg-routing-key
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
        endpoint = request.path
        if handled and resource is not None:
            endpoint = ROUTE_PATHS.get(resource.canonical, resource.canonical)
        labels = (("endpoint", endpoint), ("method", request.method))
        self.state.inc("sglang:http_requests_total", 1, -1, labels)
        self.state.inc("sglang:http_requests_active", 1, -1, labels)
        # A gateway's routing key: counted once while any request bearing it runs.
        routing_key = request.headers.get("x-smg-routing-key")
        if routing_key:
            self._routing_key_active(routing_key, +1)
        status = 500
        try:
            if self.args.slow_s > 0:
                await asyncio.sleep(self.args.slow_s)
            try:
                response = await handler(request)
            except web.HTTPNotFound:
                # FastAPI's own answer for a path no route has.
                response = _json_response({"detail": "Not Found"}, status=404)
            except web.HTTPMethodNotAllowed as exc:
                response = _json_response(
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
            if routing_key:
                self._routing_key_active(routing_key, -1)
            self.state.inc(
                "sglang:http_responses_total", 1, -1, (*labels, ("status_code", str(status)))
            )

    def _routing_key_active(self, key: str, step: int) -> None:
        """http_request_metrics.RefCountedGauge: the gauge counts keys, not requests."""
        count = self._routing_keys.get(key, 0) + step
        if count > 0:
            self._routing_keys[key] = count
        else:
            self._routing_keys.pop(key, None)
        if count == (1 if step > 0 else 0):  # the key's first request began, or last ended
            self.state.inc("sglang:routing_keys_active", float(step))

    @web.middleware
    async def cors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Starlette's CORSMiddleware as SGLang installs it (every origin, credentials, all
        methods and headers), inside the HTTP metrics: a preflight is answered here; any
        other response gets its headers as it is prepared (``_on_prepare``)."""
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method == "OPTIONS" and origin is not None and method is not None:
            return _preflight(origin, method, request.headers.get("Access-Control-Request-Headers"))
        request[CORS_KEY] = () if origin is None else (origin,)
        return await handler(request)

    async def _on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        # uvicorn's Server header, and CORS on what passed the CORS middleware.
        response.headers[hdrs.SERVER] = "uvicorn"
        if CORS_KEY not in request:
            return
        for origin in request[CORS_KEY]:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers[hdrs.VARY] = ", ".join([*response.headers.getall(hdrs.VARY, []), "Origin"])

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth, self.middleware, self.cors])
        app.on_response_prepare.append(self._on_prepare)
        r = app.router
        profile = self.config.profile
        # FastAPI routes: GET ones do not answer HEAD.
        get: Callable[..., Any] = functools.partial(r.add_get, allow_head=False)
        get("/health", self.health)
        get("/health_generate", self.health)
        if profile.ready:
            get("/ready", self.ready)
        if self.args.enable_metrics and not self.args.metrics_404:
            # A mounted ASGI app: it answers every method, on every path that starts with
            # /metrics (utils.add_prometheus_middleware's path_regex).
            r.add_route("*", "/metrics{path:.*}", self.metrics)
        if profile.server_info:
            get("/server_info", self.server_info)
        get("/get_server_info", self.server_info)
        if profile.model_info:
            get("/model_info", self.model_info)
        get("/get_model_info", self.model_info)
        get("/freeze_gc", self.freeze_gc)
        r.add_post("/freeze_gc", self.freeze_gc)
        get("/v1/models", self.models)
        get("/v1/models/{model:.*}", self.model_card)
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
        return _json_response(self.server_info_dict())

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
        return _json_response(self.model_info_dict())

    async def freeze_gc(self, request: web.Request) -> web.Response:
        # A Starlette Response given no media type: no Content-Type at all.
        return _UntypedResponse(status=200, body=b"Garbage collection frozen.\n")

    def _model_card(self) -> dict[str, Any]:
        # A ModelCard made per request: created is now.
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": self.config.model_name,
            "parent": None,
            "max_model_len": self.context_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        """http_server.retrieve_model: the served model's card, else OpenAI's 404."""
        model = request.match_info["model"]
        if model != self.config.model_name:
            error = {"message": f"The model '{model}' does not exist",
                     "type": "invalid_request_error", "param": "model",
                     "code": "model_not_found"}  # fmt: skip
            return _json_response({"error": error}, status=404)
        return _json_response(self._model_card())

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
                return _json_response(_bad_request("dp_rank: not a valid integer"), status=400)
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
            return _json_response(
                loads_json(ranks, version, include, accelerators=max(accelerators, 1))
            )
        except BadInclude:
            # Raised past the endpoint's own handling: Starlette's 500.
            return web.Response(status=500, text="Internal Server Error")

    # -- generation ------------------------------------------------------------------

    def _invalid(self, request: web.Request, errors: Errors) -> web.Response:
        """http_server.validation_exception_handler's answer to a body FastAPI refused."""
        message = validation_message(errors, request.method, request.path,
                                     self.config.profile.version)  # fmt: skip
        return _openai_error(message, "Bad Request")

    def max_new_tokens(self, prompt_tokens: int, asked: int | None) -> int:
        """Scheduler.init_req_max_new_tokens: what a request may generate, its limit (none:
        unlimited) cut to what the context (max_req_len, /server_info's max_req_input_len
        plus 5) and the KV pool leave after its prompt (a page of 1 reserved)."""
        wanted = UNLIMITED_NEW_TOKENS if asked is None else asked
        pool = int(self.state.get("sglang:max_total_num_tokens", 0))
        max_req_len = min(self.context_len - 1, pool - 1)
        room = min(max_req_len - prompt_tokens - 1, pool - prompt_tokens - 1 - 1)
        return max(0, min(wanted, room))

    def _request(self, prompt_tokens: int, asked: int | None, streaming: bool) -> Request:
        return Request(
            prompt_tokens=prompt_tokens,
            max_tokens=self.max_new_tokens(prompt_tokens, asked),
            streaming=streaming,
            arrival=self.engine.clock(),
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if not _json_media_type(request):
            return _openai_error(_UNSUPPORTED_MEDIA, "Bad Request")
        raw, errors = read_body(await request.read())
        body, errors = body_errors(CompletionBody, raw) if not errors else (None, errors)
        if not isinstance(body, CompletionBody):
            return self._invalid(request, errors)
        prompt = body.prompt
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        # serving_completions._validate_request.
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
            return _openai_error("Prompt cannot be empty")
        req = self._request(_words(text), body.max_tokens, body.stream)
        return await self._openai(request, raw, body.model, req, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        if not _json_media_type(request):
            return _openai_error(_UNSUPPORTED_MEDIA, "Bad Request")
        raw, errors = read_body(await request.read())
        body, errors = body_errors(ChatBody, raw) if not errors else (None, errors)
        if not isinstance(body, ChatBody):
            return self._invalid(request, errors)
        # serving_chat._validate_request.
        if not body.messages:
            return _openai_error("Messages cannot be empty.")
        text = " ".join(_message_text(m.get("content", "")) for m in body.messages)
        # protocol.ChatCompletionRequest.to_sampling_params: no limit unless one is given.
        asked = body.max_completion_tokens or body.max_tokens
        req = self._request(_words(text), asked, body.stream)
        return await self._openai(request, raw, body.model, req, chat=True)

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
        self, request: web.Request, body: dict[str, Any], model: str, req: Request, chat: bool
    ) -> web.StreamResponse:
        """/v1/chat/completions and /v1/completions as SGLang 0.5.23's serving_chat and
        serving_completions answer them: the id is the request's rid (a uuid4 hex unless the
        client gave one), the model the one the client named ("default" if none), every
        answer ends for length (the twin has no stop tokens)."""
        rid = body.get("rid") if isinstance(body.get("rid"), str) else uuid.uuid4().hex
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

    def _meta_info(self, req: Request, rid: str, completion: int, finished: bool) -> dict[str, Any]:
        """A /generate output's meta_info as TokenizerManager builds it, in its order (without
        --enable-metrics' timestamps): the latency once finished, and with speculation the
        request's draft figures, once finished and verified."""
        info: dict[str, Any] = {
            "id": rid,
            "finish_reason": {"type": "length", "length": req.max_tokens} if finished else None,
            "prompt_tokens": req.prompt_tokens,
            "weight_version": self._serving["weight_version"],
            "num_retractions": req.retractions,
            "reasoning_tokens": 0,
            "completion_tokens": completion,
            "cached_tokens": 0,
        }
        if not finished:
            return info
        end = req.finished if req.finished is not None else self.engine.clock()
        info["e2e_latency"] = end - req.arrival
        verify_ct = math.ceil(req.verifies - 1e-9)
        proposed = verify_ct * (self.config.draft_tokens - 1)
        if self.config.algorithm is not None and verify_ct > 0 and proposed > 0:
            # The bonus token of each verify is no accepted draft.
            correct = max(completion - verify_ct, 0)
            info["spec_accept_rate"] = correct / proposed
            info["spec_accept_length"] = completion / verify_ct
            info["spec_num_correct_drafts"] = correct
            info["spec_num_proposed_drafts"] = proposed
            info["spec_verify_ct"] = verify_ct
        return info

    async def _outputs(self, req: Request, rid: str) -> AsyncIterator[dict[str, Any]]:
        """The request's /generate outputs as SGLang streams them (not incremental): all the
        text and ids so far, the last one finished; a request that ends without a token
        (max_new_tokens 0) still gives that last one."""
        text, ids = "", list[int]()
        finished = False
        try:
            async for count, piece in self._tokens(req):
                ids.extend(WORD_IDS[(len(ids) + i) % len(WORD_IDS)] for i in range(count))
                text += piece
                finished = len(ids) >= req.max_tokens
                meta = self._meta_info(req, rid, len(ids), finished)
                yield {"text": text, "output_ids": list(ids), "meta_info": meta}
        except asyncio.CancelledError:
            self.engine.abort(req)
            raise
        if not finished:
            meta = self._meta_info(req, rid, len(ids), True)
            yield {"text": text, "output_ids": list(ids), "meta_info": meta}

    async def _last_output(self, req: Request, rid: str) -> dict[str, Any]:
        last: dict[str, Any] = {}
        async for out in self._outputs(req, rid):
            last = out
        return last

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """/generate as http_server.generate_request answers it: a body FastAPI refuses
        (no JSON, no object) gets the validation handler's answer, a max_new_tokens of the
        wrong type the API contract's, a request TokenizerManager refuses (no text nor
        input_ids, a negative max_new_tokens) {"error": {"message"}} (an SSE error chunk
        when streamed). A list of texts (or of input_ids lists) is a batch."""
        body, errors = read_body(await request.read())
        errors = errors or generate_body_errors(body)
        if errors or not isinstance(body, dict):
            return self._invalid(request, errors)
        contract = _generate_contract_error(body)
        if contract is not None:
            return _json_response({"error": contract}, status=400)
        stream = body.get("stream") is True
        try:
            prompts, rids = _generate_inputs(body)
            params = body.get("sampling_params")
            asked = [_max_new_tokens(params, i) for i in range(len(prompts))]
        except ValueError as exc:
            if stream:
                return await self._sse_error(request, exc)
            return _json_response({"error": {"message": str(exc)}}, status=400)
        reqs = [self._request(p, a, stream) for p, a in zip(prompts, asked, strict=True)]
        for req in reqs:
            self.engine.submit(req)
        batch = isinstance(rids, list)
        rid_list = rids if isinstance(rids, list) else [rids]
        if not stream:
            results = await asyncio.gather(
                *(self._last_output(r, rid) for r, rid in zip(reqs, rid_list, strict=True))
            )
            return _json_response(results if batch else results[0])
        resp = self._sse_response()
        try:
            await resp.prepare(request)
            async for index, out in _merged([self._outputs(r, rid) for r, rid
                                             in zip(reqs, rid_list, strict=True)]):  # fmt: skip
                if batch:
                    out["index"] = index
                await resp.write(_sse(out))
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            for req in reqs:
                self._client_gone(req)
        except asyncio.CancelledError:
            for req in reqs:
                self.engine.abort(req)
            raise
        return resp

    async def _sse_error(self, request: web.Request, exc: ValueError) -> web.StreamResponse:
        """A streamed /generate that TokenizerManager refused: 200, then the error as one
        event (http_server.serve_generate_request's stream_results)."""
        resp = self._sse_response()
        await resp.prepare(request)
        error = {"message": str(exc), "type": "invalid_request_error", "code": 400,
                 "retryable": False}  # fmt: skip
        await resp.write(_sse({"error": error}))
        await resp.write(b"data: [DONE]\n\n")
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
        """SGLang's warm-up, over HTTP to itself: model info, then 8 tokens from the endpoint
        that model info calls for (``warmup_request``), then (0.5.2x) /freeze_gc. Raises if
        any of them fails."""
        import aiohttp  # noqa: PLC0415  (the server side already imports it)

        profile = self.config.profile
        timeout = aiohttp.ClientTimeout(total=WARMUP_TIMEOUT_S)
        # With --api-key every request bears it; /freeze_gc the admin key if there is one.
        headers = self.keys.warmup_headers()
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
            async with session.get(url + profile.warmup_model_info_path) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{profile.warmup_model_info_path}: HTTP {resp.status}")
                model_info = await resp.json()
            path, body = self.warmup_request(model_info)
            async with session.post(url + path, json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{path}: HTTP {resp.status}: {await resp.text()}")
                await resp.read()
            if profile.freeze_gc_after_warmup:
                # A refusal here is only a warning in SGLang (the server still comes up).
                freeze = self.keys.warmup_headers(admin=True)
                async with session.post(url + "/freeze_gc", headers=freeze) as resp:
                    await resp.read()

    def warmup_request(self, model_info: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """http_server._execute_server_warmup's request for what /model_info said: a model
        that understands images, a chat completion with a picture; else a /generate, one
        prompt per DP rank."""
        if model_info.get("has_image_understanding"):
            image = {"url": "data:image/png;base64," + WARMUP_PNG_BASE64}
            content = [{"type": "image_url", "image_url": image},
                       {"type": "text", "text": "Describe the image."}]  # fmt: skip
            return "/v1/chat/completions", {
                "model": self.config.model_name,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": WARMUP_MAX_NEW_TOKENS,
                "stream": False,
                "temperature": 0.0,
            }
        ranks = max(self.args.dp_size, 1)
        text: str | list[str] = WARMUP_PROMPT if ranks == 1 else [WARMUP_PROMPT] * ranks
        params = {"temperature": 0, "max_new_tokens": WARMUP_MAX_NEW_TOKENS}
        return "/generate", {"sampling_params": params, "text": text}

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
    # orjson, msgspec, pydantic and Starlette's JSONResponse all write compact JSON,
    # non-ASCII as it is.
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _json_response(
    obj: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """FastAPI's JSONResponse and (SGLang)ORJSONResponse: compact JSON, and the media type
    without a charset."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    return web.Response(status=status, body=_dumps(obj), headers=headers)


class _UntypedResponse(web.Response):
    """A Starlette Response given no media type: it sends no Content-Type, where aiohttp
    would call the body application/octet-stream."""

    async def _write_headers(self) -> None:
        self._headers.popall(hdrs.CONTENT_TYPE, None)
        await super()._write_headers()


def _preflight(origin: str, method: str, asked_headers: str | None) -> web.Response:
    """CORSMiddleware.preflight_response: every origin (named back, as credentials are
    allowed) and every header asked for; only a method outside its list fails."""
    headers = {"Vary": CORS_PREFLIGHT_VARY, "Access-Control-Allow-Methods": ", ".join(CORS_METHODS),
               "Access-Control-Max-Age": "600", "Access-Control-Allow-Credentials": "true",
               "Access-Control-Allow-Origin": origin}  # fmt: skip
    if asked_headers is not None:
        headers["Access-Control-Allow-Headers"] = asked_headers
    ok = method in CORS_METHODS
    return web.Response(status=200 if ok else 400, text="OK" if ok else "Disallowed CORS method",
                        headers=headers)  # fmt: skip


def _words(text: str) -> int:
    """The twin's tokenizer: a token per word, at least one."""
    return max(1, len(text.split()))


def _message_text(content: Any) -> str:
    """A chat message's text: its text parts when it has parts (a picture is no words)."""
    if isinstance(content, list):
        return " ".join(
            str(part.get("text", "")) for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )  # fmt: skip
    return str(content)


def _unexpected(value: Any) -> str:
    """api_types._unexpected: serde's wording of a JSON value of the wrong type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map" if isinstance(value, dict) else "?"


def _generate_contract_error(body: dict[str, Any]) -> str | None:
    """http_server's API contract gate (api_types.decode_GenerateRequest), for what the twin
    reads past FastAPI's dataclass check: each sampling_params' max_new_tokens, an i64."""
    params = body.get("sampling_params")
    for one in params if isinstance(params, list) else [params]:
        if not isinstance(one, dict):
            continue
        value = one.get("max_new_tokens")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"invalid type: {_unexpected(value)}, expected i64"
    return None


def _generate_inputs(body: dict[str, Any]) -> tuple[list[int], str | list[str]]:
    """GenerateReqInput.normalize_batch_and_arguments, for what the twin reads: each
    prompt's tokens, and the request id (a client's rid as given; a batch's one per prompt,
    a single rid suffixed with the index). Raises ValueError as SGLang does."""
    text, input_ids, rid = body.get("text"), body.get("input_ids"), body.get("rid")
    if text is None and input_ids is None:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    prompts: list[int]
    if text is not None:
        batch = isinstance(text, list)
        prompts = [_words(str(t)) for t in text] if batch else [_words(str(text))]
    else:
        batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        ids = input_ids if batch and isinstance(input_ids, list) else [input_ids]
        prompts = [max(1, len(i)) if isinstance(i, list) else 1 for i in ids]
    if not batch:
        return prompts, rid if isinstance(rid, str) else uuid.uuid4().hex
    if rid is None:
        rids = [uuid.uuid4().hex for _ in prompts]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(len(prompts))]
    elif isinstance(rid, list):
        if len(rid) != len(prompts):
            raise ValueError(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        rids = [str(r) for r in rid]
    else:
        raise ValueError("The rid should be a string or a list of strings.")
    if len(set(rids)) != len(rids):
        duplicates = [r for r in dict.fromkeys(rids) if rids.count(r) > 1]
        raise ValueError(f"Duplicate request IDs detected within the request: {duplicates}")
    return prompts, rids


def _max_new_tokens(params: Any, index: int) -> int:
    """Prompt ``index``'s max_new_tokens (SamplingParams' 128 unless given); a negative one
    fails SamplingParams.verify."""
    if isinstance(params, list):
        params = params[index] if index < len(params) else None
    value = params.get("max_new_tokens") if isinstance(params, dict) else None
    if value is None:
        return GENERATE_DEFAULT_MAX_NEW_TOKENS
    if value < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {value}.")
    return int(value)


async def _merged(
    streams: list[AsyncIterator[dict[str, Any]]],
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """The items of several streams as each comes (TokenizerManager._stream_batch_responses),
    with the index of its stream."""
    queue: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[dict[str, Any]]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


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
