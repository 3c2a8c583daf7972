"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) on an `AsyncLLM`.

    nanovllm serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...
    python -m nanovllm.entrypoints.openai.api_server [MODEL] ...

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize;
GET /v1/models (these five need the API key when --api-key is set), /health,
/version, /metrics (open). Bodies are read with a size cap (413), must be JSON
objects (400) and are validated before the engine sees them (protocol.py).
A client that disconnects aborts its requests at once, streaming or not.
SIGTERM stops accepting connections, lets in-flight requests finish for up to
--shutdown-timeout seconds, aborts the rest and exits.

fastapi and uvicorn are imported only when the server is built, so `add_cli_args`
works (for `nanovllm --help`) without them.
"""
import argparse
import json
import logging
import os
from contextlib import asynccontextmanager

from nanovllm.entrypoints.engine_args import add_engine_args, engine_kwargs
from nanovllm.entrypoints.openai.errors import (APIError, bad_request, check_api_key, error_response,
                                                 install_error_handlers)
from nanovllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, reasoning_config
from nanovllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from nanovllm.entrypoints.openai.protocol import (parse_chat_request, parse_completion_request,
                                                  parse_detokenize_request, parse_tokenize_request)
from nanovllm.entrypoints.ray_args import add_data_parallel_args, uses_ray

logger = logging.getLogger("nanovllm")

DEFAULT_HOST = "127.0.0.1"      # loopback only unless asked: never expose a model by accident
DEFAULT_PORT = 8000             # vLLM's
# Generous for any legitimate request: a 32k-token prompt sent as token ids is about 250 KB.
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# Where the engine loop runs unless --enable/--disable-frontend-multiprocessing says: a thread of the
# server's process, except for a CPU engine with more than one thread, which gets a process of its own
# (`default_multiprocess_mode`). On the 2-core AVX512-BF16 machine with two threads the process mode served
# 148.7-173.6 tok/s at TPOT 64-75 ms against the thread's 91.3-116.0 at 103-122 ms (benchmarks/RESULTS.md,
# "B2 CPU, round 10"); with one thread, and on an H200's host, it measured no faster ("Tenth session").
DEFAULT_SERVER_MULTIPROCESS_MODE = False


# ---- command line ---------------------------------------------------------------------

def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server's and the engine's flags to `parser` (for `nanovllm serve`)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="an HF model directory or a .gguf file; default: the embedded SmolLM2-135M-Instruct")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind; 0 picks a free one "
                        f"(default {DEFAULT_PORT})")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on API routes")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use; the first is reported (default: the model argument)")
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template file (default: the tokenizer's template)")
    server.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies are refused with 413")
    server.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    server.add_argument("--log-stats-interval", type=float, default=10.0,
                        help="seconds between throughput lines in the log; 0 disables them")
    server.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    server.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no log line per HTTP request (each is written from the event loop)")
    server.add_argument("--disable-frontend-multiprocessing", dest="multiprocess_mode", action="store_false",
                        default=None,
                        help="run the engine loop in a thread of the server's process instead of a process of "
                             "its own (the default, except for a CPU engine on more than one thread)"
                             ": the event loop (HTTP, chat templates, streams) and the engine's steps then share "
                             "one GIL")
    server.add_argument("--enable-frontend-multiprocessing", dest="multiprocess_mode", action="store_true",
                        help="run the engine loop in a process of its own (the default for a CPU engine on more "
                             "than one thread), fed through a pipe: the server's event loop and the engine's "
                             "steps run on separate cores, each with its own GIL")
    server.add_argument("--api-server-count", type=int, default=1,
                        help="API server processes on the one port, sharing one engine process (vLLM's flag): "
                             "HTTP, chat templates and stream chunks spread over more cores (default 1)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model call tools itself (tool_choice 'auto'); needs --tool-call-parser")
    server.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how this model family writes tool calls (hermes: Hermes/Qwen <tool_call>; "
                             "llama3_json: Llama 3 JSON)")
    server.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="split a thinking model's <think>...</think> into reasoning_content")
    add_engine_args(parser.add_argument_group("engine"))
    add_data_parallel_args(parser.add_argument_group("data parallelism (Ray Serve)"))
    return parser


# ---- request plumbing -------------------------------------------------------------------

async def read_json_object(request, max_bytes: int) -> dict:
    """The request body as a JSON object: 413 when too large, 400 when not a JSON object."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {max_bytes}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(413, f"the request body is over the limit of {max_bytes} bytes")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError (invalid UTF-8) is a ValueError
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(value).__name__}")
    return value


# ---- the app -------------------------------------------------------------------------------

class ServerState:
    """What the routes share: the engine, the handlers, metrics and the security settings."""

    def __init__(self, async_llm, served_model_names: list[str], chat_template, api_key: str | None,
                 max_request_body_bytes: int, tool_parser: str | None = None, reasoning_parser: str | None = None,
                 metrics_shared: tuple | None = None):
        from nanovllm.entrypoints.openai.metrics import ServerMetrics
        from nanovllm.entrypoints.openai.serving_chat import OpenAIServingChat
        from nanovllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
        self.async_llm = async_llm
        self.metrics = ServerMetrics(metrics_shared)
        self.completion = OpenAIServingCompletion(async_llm, served_model_names, self.metrics)
        reasoning = None if reasoning_parser is None else reasoning_config(reasoning_parser, async_llm.tokenizer)
        self.chat = OpenAIServingChat(async_llm, served_model_names, self.metrics, chat_template, tool_parser,
                                      reasoning)
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_request_body_bytes = max_request_body_bytes

    def check_api_key(self, request) -> None:
        """The guarded routes' dependency: a constant-time compare with the configured key."""
        check_api_key(request, self.api_key)

    async def read_json(self, request) -> dict:
        return await read_json_object(request, self.max_request_body_bytes)


def build_app(async_llm, served_model_names: list[str], chat_template=None, api_key: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, tool_parser: str | None = None,
              reasoning_parser: str | None = None, metrics_shared: tuple | None = None):
    """The FastAPI app serving `async_llm`; its shutdown stops the engine (or leaves it, when other
    servers share it). `tool_parser`: the parser of tool_choice "auto" (None: "auto" is refused);
    `reasoning_parser`: a name of reasoning_parsers.py (ValueError if this tokenizer lacks its tags);
    `metrics_shared`: (metrics.SharedMetricsRows, this server's row) when several servers run."""
    from fastapi import Depends, Request
    from nanovllm import __version__
    from nanovllm.entrypoints.openai.asgi_routes import server_app_class

    @asynccontextmanager
    async def lifespan(app):
        yield
        async_llm.shutdown()

    state = ServerState(async_llm, served_model_names, chat_template, api_key, max_request_body_bytes,
                        tool_parser, reasoning_parser, metrics_shared)
    app = server_app_class()(title="nano-vLLM OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)

    async def require_api_key(request: Request) -> None:
        state.check_api_key(request)
    # without a key nothing is checked, so the routes skip FastAPI's dependency pass
    guarded = [Depends(require_api_key)] if api_key is not None else []
    _add_generation_routes(app, state)
    _add_token_routes(app, state, guarded)
    _add_info_routes(app, state, guarded)
    return app


def _add_generation_routes(app, state: ServerState) -> None:
    """The two generation routes, answered on plain ASGI (asgi_routes.py): POSTs reach them ahead of
    FastAPI's stack; the router has them too, so other methods get a 405. They check the API key
    themselves."""
    from nanovllm.entrypoints.openai.asgi_routes import GenerationRoute
    routes = {"/v1/completions": GenerationRoute(state, parse_completion_request, state.completion.create_completion),
              "/v1/chat/completions": GenerationRoute(state, parse_chat_request, state.chat.create_chat_completion)}
    for path, route in routes.items():
        app.router.add_route(path, route, methods=["POST"])
    app.generation_routes = routes


def _add_token_routes(app, state: ServerState, guarded: list) -> None:
    from fastapi import Request

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request):
        req = parse_tokenize_request(await state.read_json(request))
        state.chat.check_model(req.model)
        if req.messages is not None:
            tokens = state.chat.render(req.messages, req.add_generation_prompt, req.add_special_tokens,
                                       **req.chat_template_kwargs)
        else:
            tokens = state.chat.encode(req.prompt, req.add_special_tokens)
        return {"count": len(tokens), "max_model_len": state.async_llm.max_model_len, "tokens": tokens}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request):
        model, tokens = parse_detokenize_request(await state.read_json(request))
        state.chat.check_model(model)
        tokenizer = state.chat.tokenizer
        if tokenizer is None:
            raise bad_request("this server runs without a tokenizer", "tokens")
        bad = next((t for t in tokens if not 0 <= t < len(tokenizer)), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {len(tokenizer)})", "tokens")
        return {"prompt": tokenizer.decode(tokens)}


def _add_info_routes(app, state: ServerState, guarded: list) -> None:
    from fastapi.responses import Response
    from nanovllm import __version__
    from nanovllm.entrypoints.openai.metrics import CONTENT_TYPE, engine_snapshot

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        data = [{"id": name, "object": "model", "created": int(state.async_llm.started_at), "owned_by": "nanovllm",
                 "max_model_len": state.async_llm.max_model_len} for name in state.completion.served_model_names]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        if state.async_llm.is_healthy:
            return Response(status_code=200)
        error = state.async_llm.dead_error
        return error_response(503, str(error) if error else "the engine is not running")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(engine_snapshot(state.async_llm, await _fresh_stats(state.async_llm))),
                        media_type=CONTENT_TYPE)


async def _fresh_stats(async_llm):
    """The engine's state read now, in process mode (a round trip to the engine process: its messages
    to this server carry it only while this server has requests running), else None: live already."""
    if not async_llm.multiprocess_mode or not async_llm.is_healthy:
        return None
    try:
        return await async_llm.get_engine_stats()
    except Exception:   # the engine died meanwhile: its last state
        return None


# ---- main -----------------------------------------------------------------------------------

def main(args: argparse.Namespace) -> None:
    """Load the engine, then serve until SIGTERM/SIGINT. A bad setting exits with one line."""
    if uses_ray(args):   # N engine replicas behind one OpenAI ingress (entrypoints/ray/serve.py)
        if args.disable_uvicorn_access_log:
            raise SystemExit("nanovllm serve: error: --disable-uvicorn-access-log is for the single-engine "
                             "server; Ray Serve's proxy writes its own access log")
        if args.multiprocess_mode is not None or args.api_server_count != 1:
            raise SystemExit("nanovllm serve: error: --enable/--disable-frontend-multiprocessing and "
                             "--api-server-count are for the single-engine server; a Ray Serve replica runs "
                             "its engine in a thread of its own actor, apart from the HTTP proxy already")
        from nanovllm.entrypoints.ray.serve import main as serve_on_ray
        return serve_on_ray(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _check_server_args(args)
    try:
        import uvicorn  # noqa: F401  (missing: the message below, before the slow model load)
        from nanovllm.engine.async_llm import AsyncLLM
        from nanovllm.engine.cpu_compile import server_compilation_mode
        from nanovllm.entrypoints.openai.chat_template import load_chat_template
        if args.chat_template is not None:
            load_chat_template(args.chat_template, None)   # a bad file fails before the slow model load
        kwargs = engine_kwargs(args)
        kwargs["compilation_config"] = server_compilation_mode(args.model, kwargs)  # CPU: by its kind
        if args.api_server_count > 1:   # the engine in a process of its own, always
            from nanovllm.entrypoints.openai.api_server_processes import serve_api_servers
            return serve_api_servers(args, kwargs, build_uvicorn_server)
        multiprocess = args.multiprocess_mode
        if multiprocess is None:
            multiprocess = default_multiprocess_mode(kwargs.get("device", "auto"))
        async_llm = AsyncLLM(args.model, multiprocess_mode=multiprocess,
                             log_stats_interval=args.log_stats_interval, **kwargs)
        build_uvicorn_server(args, async_llm).run()
    except ImportError as e:
        raise SystemExit(f"nanovllm serve: error: the server needs fastapi, uvicorn and jinja2 "
                         f"(pip install fastapi uvicorn jinja2): {e}") from None
    except (ValueError, OSError) as e:
        raise SystemExit(f"nanovllm serve: error: {e}") from None


def _check_server_args(args: argparse.Namespace) -> None:
    """The flags that go together or exclude each other (SystemExit with one line)."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise SystemExit("nanovllm serve: error: --enable-auto-tool-choice and --tool-call-parser go together")
    if args.api_server_count < 1:
        raise SystemExit(f"nanovllm serve: error: --api-server-count must be at least 1, got {args.api_server_count}")
    if args.api_server_count > 1 and args.multiprocess_mode is False:
        raise SystemExit("nanovllm serve: error: --api-server-count above 1 runs the engine in a process of its "
                         "own, which --disable-frontend-multiprocessing forbids")


def build_uvicorn_server(args: argparse.Namespace, async_llm, metrics_shared: tuple | None = None):
    """One server's app on `async_llm`, as a uvicorn Server not yet running (ValueError for a
    bad chat template or reasoning parser)."""
    import uvicorn
    from nanovllm.entrypoints.openai.chat_template import load_chat_template
    chat_template = load_chat_template(args.chat_template, async_llm.tokenizer)
    names = args.served_model_name or [default_model_name(args.model, async_llm)]
    app = build_app(async_llm, names, chat_template, args.api_key, args.max_request_body_bytes,
                    args.tool_call_parser, args.reasoning_parser, metrics_shared)
    logger.info("serving %s (max_model_len %d, %d KV blocks)", names[0], async_llm.max_model_len,
                async_llm.engine_stats.num_blocks)
    return uvicorn.Server(uvicorn_config(app, args))


def default_multiprocess_mode(device: str) -> bool:
    """The engine loop's home when no flag says: a process of its own for a CPU engine with more than one
    torch thread, else DEFAULT_SERVER_MULTIPROCESS_MODE (a thread). In one process the engine thread
    shares the GIL with the event loop (every step's deltas, SSE, new requests), and the step's
    OpenMP threads wait while it does: on two threads its 16-row decode steps took 91-117 ms (76-86 ms
    of the engine thread's CPU) against 58-73 ms offline (benchmarks/RESULTS.md, "B2 CPU, round 10")."""
    import torch

    from nanovllm.utils.device import resolve_device
    if resolve_device(device).type == "cpu" and torch.get_num_threads() > 1:
        return True
    return DEFAULT_SERVER_MULTIPROCESS_MODE


def uvicorn_config(app, args: argparse.Namespace):
    """uvicorn's settings from the server's flags."""
    import uvicorn
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          timeout_graceful_shutdown=args.shutdown_timeout,
                          access_log=not args.disable_uvicorn_access_log)


def default_model_name(model: str | None, async_llm) -> str:
    """The model argument as given (as vLLM); for the embedded default, its file name."""
    if model is not None:
        return model
    name = os.path.basename(str(async_llm.config.model).rstrip("/"))
    return name.removesuffix(".gguf")


if __name__ == "__main__":
    main(add_cli_args(argparse.ArgumentParser(
        prog="python -m nanovllm.entrypoints.openai.api_server",
        description="OpenAI-compatible server for nano-vLLM")).parse_args())
