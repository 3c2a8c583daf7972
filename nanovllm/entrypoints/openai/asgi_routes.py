"""The two generation routes answered on plain ASGI, ahead of FastAPI's routing.

POST /v1/chat/completions and /v1/completions carry nearly all of a server's traffic,
and each of their requests (and each streamed chunk) went through FastAPI's and
Starlette's layers: routing, the request object, the middleware stack's `send`
wrappers, StreamingResponse's anyio task group. On the B3 workload those layers
were a large share of the event loop's work per request and per chunk, which in a
closed loop of equal requests delays every wave's next requests (benchmarks/RESULTS.md,
"Eleventh session: frontend work per request"). `ServerApp` (the app `build_app`
returns) sends these two routes here and everything else to FastAPI.

What the routes do is the same as through FastAPI: the API key first (401), the body
read with its size cap (413) and parsed (400), the handler's `APIError` answered in
OpenAI's shape, an unexpected exception logged and answered as a 500, a client that
disconnects before the response aborts its requests (499), a streamed response sent
as server-sent events with `Cache-Control: no-cache` whose requests are aborted
however it ends (the client going away included).
"""
import asyncio
import json
import logging

from nanovllm.entrypoints.openai.errors import APIError, error_body

logger = logging.getLogger("nanovllm")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
JSON_CONTENT_TYPE = (b"content-type", b"application/json")
CLIENT_CLOSED_REQUEST = 499     # nginx's status for "the client went away"; nobody reads it


class ClientGone(Exception):
    """The client disconnected while its request body was being read."""


class RawRequest:
    """What the shared request helpers read of a request (headers, body, receive), on raw ASGI."""
    __slots__ = ("scope", "receive", "_headers")

    def __init__(self, scope: dict, receive):
        self.scope, self.receive = scope, receive
        self._headers: dict[str, str] | None = None

    @property
    def headers(self) -> dict[str, str]:
        if self._headers is None:   # ASGI header names are lowercase bytes; a repeated header: the last one
            self._headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in self.scope["headers"]}
        return self._headers

    async def stream(self):
        """The body's pieces; raises ClientGone if the client disconnects first."""
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            body = message.get("body", b"")
            if body:
                yield body
            if not message.get("more_body", False):
                return


class GenerationRoute:
    """The ASGI app of one generation route: `parse` turns the JSON body into a request, `create`
    (a handler's coroutine function) that into a `ChunkStream` or the folded response."""

    def __init__(self, state, parse, create):
        self.state, self.parse, self.create = state, parse, create

    async def __call__(self, scope: dict, receive, send) -> None:
        await serve_generation(self.state, self.parse, self.create, scope, receive, send)


async def serve_generation(state, parse, create, scope: dict, receive, send) -> None:
    """Answer one POST of a generation route (see `GenerationRoute`). One disconnect watcher
    covers the handler and, for a streaming request, its stream."""
    from nanovllm.entrypoints.openai.serving_engine import ChunkStream
    request = RawRequest(scope, receive)
    streaming = False   # True once the response is a stream: errors from then on go up to the server

    async def respond():
        nonlocal streaming
        result = await create(req)
        if isinstance(result, ChunkStream):
            streaming = True
            await stream_events(send, result)
        return result
    try:
        state.check_api_key(request)
        req = parse(await state.read_json(request))
        result = await until_disconnected(request, respond())
        if streaming:
            return
        if result is None:
            return await send_body(send, CLIENT_CLOSED_REQUEST, b"", None)
        return await send_json(send, 200, result)
    except ClientGone:
        return
    except APIError as e:
        if streaming:
            raise
        return await send_json(send, e.status, error_body(e.status, e.message, e.param, e.code))
    except Exception as e:
        if streaming:
            raise
        logger.exception("unexpected error while serving POST %s", scope["path"])
        return await send_json(send, 500, error_body(500, f"internal server error: {type(e).__name__}"))


async def stream_events(send, stream) -> None:
    """Send a `ChunkStream` as server-sent events; its requests are aborted however it ends
    (the client going away cancels this)."""
    from nanovllm.entrypoints.openai.serving_engine import SSE_DONE, sse_events
    events = sse_events(stream.chunks, stream.num_choices)
    try:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        async for data in events:
            # the last events end the body in the same write
            await send({"type": "http.response.body", "body": data, "more_body": not data.endswith(SSE_DONE)})
    finally:
        stream.abort()
        await events.aclose()


async def until_disconnected(request, coro):
    """Await `coro`, cancelling it if the client disconnects first; returns None then."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None


async def _wait_for_disconnect(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def send_json(send, status: int, value: dict) -> None:
    """A JSON response as Starlette's JSONResponse renders it."""
    body = json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()
    await send_body(send, status, body, JSON_CONTENT_TYPE)


async def send_body(send, status: int, body: bytes, content_type: tuple[bytes, bytes] | None) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type is not None:
        headers.append(content_type)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def server_app_class():
    """FastAPI with the generation routes taken first (imported lazily: FastAPI is optional)."""
    from fastapi import FastAPI

    class ServerApp(FastAPI):
        """The server's app: `generation_routes` (path -> ASGI handler) for POST, FastAPI for the rest."""
        generation_routes: dict = {}

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "http" and scope["method"] == "POST":
                route = self.generation_routes.get(scope["path"])
                if route is not None:
                    return await route(scope, receive, send)
            await super().__call__(scope, receive, send)
    return ServerApp
