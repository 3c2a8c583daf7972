"""`nanovllm serve --data-parallel-size N`: the OpenAI server as a Ray Serve application.

    client ──HTTP──> Serve proxy ──> OpenAIIngress ──handle (PrefixAwareRequestRouter)──> EngineReplica x N
                                    parse + validate             (one AsyncLLM each, the server's
                                    tokenize, hash the           handlers: same answers, same errors)
                                    first blocks

The ingress (a FastAPI deployment) reads and validates bodies with the server's
code (entrypoints/openai/: a bad body is the server's 400/404/413 and never reaches a
replica), renders chat templates, tokenizes the prompt and hashes its first blocks;
the router (router.py) picks the replica by that prefix, falling back to the least
loaded. Each engine replica runs the server's `OpenAIServingCompletion` and
`OpenAIServingChat` on its own `AsyncLLM` and answers a folded response or the SSE
bytes of a stream. /metrics merges every replica's metrics (metrics.py).

Faults: a replica whose process dies fails only the requests it was running (a
503 in OpenAI's shape, or an error event in a stream already started); Serve
drops it from routing and starts a new one; a replica whose engine loop died
fails its health check and is replaced the same way.

Routes: POST /v1/completions, /v1/chat/completions; GET /v1/models (these need the API
key when one is set), /health, /version, /metrics.
"""
import argparse
import logging
import os
import signal
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from nanovllm.config import DEFAULT_BLOCK_SIZE
from nanovllm.entrypoints.openai.api_server import (DEFAULT_MAX_REQUEST_BODY_BYTES as DEFAULT_MAX_BODY,
                                                    DEFAULT_SHUTDOWN_TIMEOUT_S, read_json_object)
from nanovllm.entrypoints.openai.errors import (APIError, check_api_key, check_model, error_body, error_response,
                                                 install_error_handlers)
from nanovllm.entrypoints.openai.metrics import CONTENT_TYPE
from nanovllm.entrypoints.openai.protocol import parse_chat_request, parse_completion_request
from nanovllm.entrypoints.ray import metrics as board
from nanovllm.entrypoints.ray.replica import ReplicaSpec, served_model_names, start_engine
from nanovllm.entrypoints.ray.router import DEFAULT_ROUTING_BLOCKS, prefix_hashes

logger = logging.getLogger("nanovllm")

APP_NAME = "nanovllm"
ENGINE_DEPLOYMENT = "NanoVLLMEngine"
INGRESS_DEPLOYMENT = "OpenAIIngress"
# Requests Serve may hand one engine replica at once: it batches them all continuously,
# so the bound is the engine's own queue, not Serve's default of 5.
MAX_ONGOING_REQUESTS_PER_REPLICA = 1024
MAX_ONGOING_REQUESTS_PER_INGRESS = 4096
HEALTH_CHECK_PERIOD_S = 2.0
REPLICA_DIED = (RayActorError, ActorDiedError, ActorUnavailableError)
COMPLETION, CHAT = "completion", "chat"


api = FastAPI(title="nano-vLLM OpenAI-compatible server (Ray Serve)")
install_error_handlers(api)


# Serve pickles the deployment classes as they are decorated: what they call is defined above them.

async def _relay(stream):
    """The replica's SSE bytes; a replica that dies mid-stream ends it with a 503 error event."""
    from nanovllm.entrypoints.openai.serving_engine import SSE_DONE, dumps
    try:
        async for event in stream:
            yield event
    except REPLICA_DIED as e:
        message = f"the engine replica serving this request died: {type(e).__name__}"
        yield f"data: {dumps(error_body(503, message))}\n\n".encode()
        yield SSE_DONE
    finally:
        stream.cancel()


# ---- engine replicas -------------------------------------------------------------------

class MetricsPusher:
    """A thread pushing the replica's metrics text to the app's board every PUSH_INTERVAL_S."""

    def __init__(self, app_name: str, replica_id: str, replica: "EngineReplica"):
        self.app_name, self.replica_id, self.replica = app_name, replica_id, replica
        self.stopped = threading.Event()
        self.board = None
        threading.Thread(target=self._run, name="nanovllm-metrics-push", daemon=True).start()

    def _run(self) -> None:
        import ray
        while not self.stopped.wait(board.PUSH_INTERVAL_S):
            try:
                self.board = self.board or board.metrics_board(self.app_name)
                healthy = self.replica.replica.async_llm.is_healthy
                ray.get(self.board.push.remote(self.replica_id, os.getpid(), healthy, self.replica.metrics_text()),
                        timeout=board.STALE_AFTER_S)
            except Exception:  # noqa: BLE001 -- the board is restarting or busy: look it up again next time
                logger.debug("metrics push failed", exc_info=True)
                self.board = None

    def stop(self) -> None:
        self.stopped.set()


@serve.deployment(name=ENGINE_DEPLOYMENT)
class EngineReplica:
    """One engine and the server's handlers; answers what the ingress parsed."""

    def __init__(self, spec: ReplicaSpec):
        from nanovllm.entrypoints.openai.metrics import ServerMetrics
        from nanovllm.entrypoints.openai.serving_chat import OpenAIServingChat
        from nanovllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
        self.replica = start_engine(spec)
        llm, names = self.replica.async_llm, self.replica.served_model_names
        self.metrics = ServerMetrics()
        self.handlers = {COMPLETION: OpenAIServingCompletion(llm, names, self.metrics).create_completion,
                         CHAT: OpenAIServingChat(llm, names, self.metrics, self.replica.chat_template)
                         .create_chat_completion}
        context = serve.get_replica_context()
        self.pusher = MetricsPusher(context.app_name, context.replica_id.unique_id, self)

    async def generate(self, kind: str, request, prefix_hashes: list[int] | None = None) -> dict:
        """{"status", "body"}: the folded response, or the server's error body.
        `prefix_hashes` is the router's key (router.py); the block manager finds cached blocks itself."""
        try:
            return {"status": 200, "body": await self.handlers[kind](request)}
        except APIError as e:
            return {"status": e.status, "body": error_body(e.status, e.message, e.param, e.code)}

    async def stream(self, kind: str, request, prefix_hashes: list[int] | None = None):
        """First {"status", "body"} (200 and no body when the stream starts), then its SSE bytes."""
        from nanovllm.entrypoints.openai.serving_engine import sse_events
        try:
            chunks = await self.handlers[kind](request)
        except APIError as e:
            yield {"status": e.status, "body": error_body(e.status, e.message, e.param, e.code)}
            return
        yield {"status": 200, "body": None}
        try:
            async for event in sse_events(chunks.chunks, chunks.num_choices):
                yield event
        finally:
            chunks.abort()

    def metrics_text(self) -> str:
        from nanovllm.entrypoints.openai.metrics import engine_snapshot
        return self.metrics.render(engine_snapshot(self.replica.async_llm))

    def check_health(self) -> None:
        """Serve's health check: an engine whose loop died makes Serve replace this replica."""
        llm = self.replica.async_llm
        if not llm.is_healthy:
            raise RuntimeError(f"the engine is not running: {llm.dead_error}")

    def __del__(self):
        """Serve stops the replica (after its graceful shutdown timeout): stop pushing, stop the engine."""
        pusher = getattr(self, "pusher", None)
        if pusher is not None:
            pusher.stop()
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.async_llm.shutdown()


# ---- ingress -------------------------------------------------------------------------------

@serve.deployment(name=INGRESS_DEPLOYMENT)
@serve.ingress(api)
class OpenAIIngress:
    """The OpenAI API in front of the engine replicas (see the module docstring)."""

    def __init__(self, engine, spec: ReplicaSpec, api_key: str | None, max_request_body_bytes: int,
                 routing_blocks: int = DEFAULT_ROUTING_BLOCKS):
        from nanovllm.entrypoints.ray.replica import load_ingress_tokenizer
        self.engine = engine
        self.tokenizer, self.chat_template = load_ingress_tokenizer(spec)
        self.served_model_names = served_model_names(spec)
        self.block_size = spec.engine_kwargs.get("kvcache_block_size", DEFAULT_BLOCK_SIZE)
        self.routing_blocks = routing_blocks
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_request_body_bytes = max_request_body_bytes
        self.board = board.metrics_board(serve.get_replica_context().app_name)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        check_api_key(request, self.api_key)
        req = parse_completion_request(await read_json_object(request, self.max_request_body_bytes))
        check_model(req.model, self.served_model_names)
        first = req.prompts[0]
        tokens = first if isinstance(first, list) else self._encode(first, True)
        return await self._forward(COMPLETION, req, tokens)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        from nanovllm.entrypoints.openai.errors import bad_request
        check_api_key(request, self.api_key)
        req = parse_chat_request(await read_json_object(request, self.max_request_body_bytes))
        check_model(req.model, self.served_model_names)
        if self.chat_template is None:
            raise bad_request("this model has no chat template; start the server with --chat-template FILE",
                              "messages")
        text = self.chat_template.render(req.messages, **req.chat_template_kwargs)
        return await self._forward(CHAT, req, self._encode(text, False))

    @api.get("/v1/models")
    async def models(self, request: Request):
        check_api_key(request, self.api_key)
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "nanovllm"}
                                           for name in self.served_model_names]}

    @api.get("/health")
    async def health(self):
        replicas = await self.board.live.remote()
        if any(r["healthy"] for r in replicas.values()):
            return Response(status_code=200)
        return error_response(503, "no engine replica is running")

    @api.get("/version")
    async def version(self):
        from nanovllm import __version__
        return {"version": __version__}

    @api.get("/metrics")
    async def metrics(self):
        return Response(board.merge_replica_metrics(await self.board.live.remote()), media_type=CONTENT_TYPE)

    # ---- plumbing ----

    async def _forward(self, kind: str, req, token_ids: list[int]):
        hashes = prefix_hashes(token_ids, self.block_size, self.routing_blocks)
        if req.stream:
            return await self._forward_stream(kind, req, hashes)
        try:
            result = await self.engine.generate.remote(kind, req, prefix_hashes=hashes)
        except REPLICA_DIED as e:
            raise APIError(503, f"the engine replica serving this request died: {type(e).__name__}") from None
        return JSONResponse(result["body"], status_code=result["status"])

    async def _forward_stream(self, kind: str, req, hashes: list[int]):
        stream = self.engine.options(stream=True).stream.remote(kind, req, prefix_hashes=hashes)
        try:
            head = await stream.__anext__()
        except REPLICA_DIED as e:
            raise APIError(503, f"the engine replica serving this request died: {type(e).__name__}") from None
        if head["status"] != 200:
            return JSONResponse(head["body"], status_code=head["status"])
        return StreamingResponse(_relay(stream), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        from nanovllm.entrypoints.openai.errors import bad_request
        if self.tokenizer is None:
            raise bad_request("this server runs without a tokenizer: send token ids", "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


# ---- the application ------------------------------------------------------------------------

def build_app(spec: ReplicaSpec, api_key: str | None = None, max_request_body_bytes: int = DEFAULT_MAX_BODY,
              shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S):
    """The Serve application: the ingress bound to `spec.num_replicas` engine replicas, each given
    `shutdown_timeout` seconds to finish its requests when it is stopped."""
    from ray.serve.config import RequestRouterConfig
    from nanovllm.entrypoints.ray.router import PrefixAwareRequestRouter
    engine = EngineReplica.options(
        num_replicas=spec.num_replicas, ray_actor_options=spec.actor_options(),
        max_ongoing_requests=MAX_ONGOING_REQUESTS_PER_REPLICA, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=shutdown_timeout,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAwareRequestRouter))
    ingress = OpenAIIngress.options(ray_actor_options={"num_cpus": 0},
                                    max_ongoing_requests=MAX_ONGOING_REQUESTS_PER_INGRESS)
    return ingress.bind(engine.bind(spec), spec, api_key, max_request_body_bytes)


def run(spec: ReplicaSpec, host: str, port: int, api_key: str | None = None,
        max_request_body_bytes: int = DEFAULT_MAX_BODY, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        name: str = APP_NAME) -> None:
    """Start (or update) the application on the connected Ray cluster; returns once it is running."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(spec, api_key, max_request_body_bytes, shutdown_timeout), name=name, route_prefix="/")


def main(args: argparse.Namespace) -> None:
    """`nanovllm serve --data-parallel-size N`: run until SIGTERM/SIGINT, then shut the app down."""
    import ray
    from nanovllm.entrypoints.ray import init_ray
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.port == 0:
        raise SystemExit("nanovllm serve: error: --port 0 is not supported with Ray Serve; give a port")
    try:
        init_ray(args.ray_address)
        spec = ReplicaSpec.from_args(args, ray.cluster_resources())
    except (ValueError, OSError) as e:
        raise SystemExit(f"nanovllm serve: error: {e}") from None
    run(spec, args.host, args.port, args.api_key, args.max_request_body_bytes, args.shutdown_timeout)
    logger.info("serving %s on http://%s:%d with %d engine replicas", served_model_names(spec)[0], args.host,
                args.port, spec.num_replicas)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(APP_NAME)
    board.delete_board(APP_NAME)
    serve.shutdown()
