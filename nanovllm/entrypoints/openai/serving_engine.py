"""What the completions and chat handlers share: model check, sampling params,
submitting requests, merging their streams, logprobs, SSE and folding helpers.

A handler turns one HTTP request into one or more engine requests (one per
prompt; `n` completions each), then into a stream of OpenAI chunk dicts. The
streaming response sends those chunks as server-sent events; the non-streaming
response is the same chunks folded into one object, so both always agree.
"""
import asyncio
import json
import math
import time
from dataclasses import dataclass, fields
from typing import AsyncIterator

from nanovllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from nanovllm.entrypoints.openai.errors import APIError, bad_request, check_model, error_body
from nanovllm.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from nanovllm.entrypoints.openai.prompt_encoder import PromptEncoder
from nanovllm.entrypoints.openai.protocol import SAMPLING_FIELDS
from nanovllm.outputs import Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.random_ids import random_hex

# JSON has no -inf: a token with zero probability gets this logprob, as in vLLM.
MIN_LOGPROB = -9999.0
SSE_DONE = b"data: [DONE]\n\n"
# how the engine's errors about an output constraint start ("json: Unsupported type ...")
CONSTRAINT_ERRORS = ("json:", "regex:", "choice:", "grammar:", "json_object:", "structured outputs")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass
class ChunkStream:
    """A streaming response's chunks, the engine requests behind them and its number of choices."""
    chunks: AsyncIterator[dict]
    streams: list[RequestStream]
    num_choices: int | None = None

    def abort(self) -> None:
        """Abort whatever is still running (also when the chunks were never read)."""
        for stream in self.streams:
            stream.abort()


class OpenAIServing:
    chunk_object: str  # the "object" of a streamed chunk, set by each endpoint
    def __init__(self, async_llm: AsyncLLM, served_model_names: list[str], metrics: ServerMetrics):
        self.async_llm = async_llm
        self.tokenizer = async_llm.tokenizer   # the event loop's own copy
        self.prompt_encoder = PromptEncoder(self.tokenizer) if self.tokenizer is not None else None
        self.served_model_names = served_model_names
        self.metrics = metrics
        self._param_names = {f.name for f in fields(SamplingParams)}
        self.generation_defaults = getattr(async_llm, "generation_defaults", {})

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def chunk(self, request_id: str, created: int, choices: list[dict], usage: Usage | None = None) -> dict:
        """One streamed chunk of this endpoint's kind (`chunk_object`), with usage when given."""
        chunk = {"id": request_id, "object": self.chunk_object, "created": created, "model": self.model_name,
                 "choices": choices}
        return chunk if usage is None else {**chunk, "usage": usage.as_dict()}

    def check_model(self, model: str | None) -> None:
        check_model(model, self.served_model_names)

    def sampling_params(self, kwargs: dict) -> SamplingParams:
        """Build SamplingParams, the model's generation_config.json defaults under the request's
        fields; an out-of-range value is a 400 naming it."""
        for name in kwargs:
            if name not in self._param_names:
                raise bad_request(f"'{name}' is not supported by this engine", name)
        try:
            return SamplingParams(**{**self.generation_defaults, **kwargs})
        except ValueError as e:
            first_word = str(e).split(" ", 1)[0]
            raise bad_request(str(e), first_word if first_word in kwargs else None) from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this server runs without a tokenizer: send token ids", "prompt")
        return self.prompt_encoder.encode(text, add_special_tokens)

    def token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     structured_param: str | None = None) -> list[RequestStream]:
        """Queue one engine request per prompt, or none: a bad prompt aborts those already queued.
        `structured_param`: the field an output constraint came from, named by its errors."""
        streams = []
        try:
            for i, token_ids in enumerate(prompts):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.async_llm.add_request(sub_id, token_ids, params))
        except ValueError as e:
            param = structured_param if str(e).startswith(CONSTRAINT_ERRORS) else _param_of(str(e), request_id)
            raise bad_request(str(e), param) from None
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None
        finally:
            if len(streams) < len(prompts):
                for stream in streams:
                    stream.abort()
        return streams

    async def merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream as they come; closing aborts the unfinished."""
        arrival = time.monotonic()
        if len(streams) == 1:   # timed here, not through track(): one async generator less per delta
            timer = RequestTimer(self.metrics, arrival)
            try:
                async for output in streams[0]:
                    timer.observe(output)
                    yield 0, output
            finally:
                streams[0].abort()
            return
        async for item in _merge([self.metrics.track(s, arrival) for s in streams], streams):
            yield item

    def completion_logprob_entries(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                                   top_k: int) -> list[tuple[str, float | None, dict | None]]:
        """(token text, its logprob, {text: logprob} of the top `top_k` plus the token) per position."""
        entries = []
        for token_id, position in zip(token_ids, logprobs or [None] * len(token_ids)):
            if position is None:  # the first prompt token has no logprob
                entries.append((self.token_text(token_id), None, None))
                continue
            chosen = position.get(token_id)
            top = {self.token_text(t, lp): clamp_logprob(lp.logprob) for t, lp in top_logprobs(position, top_k)}
            if chosen is not None:
                top.setdefault(self.token_text(token_id, chosen), clamp_logprob(chosen.logprob))
            entries.append((self.token_text(token_id, chosen),
                            clamp_logprob(chosen.logprob) if chosen else None, top))
        return entries

    def chat_logprob_entries(self, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None,
                             top_k: int) -> list[dict]:
        """OpenAI chat logprobs `content` entries for generated tokens."""
        entries = []
        for token_id, position in zip(token_ids, logprobs or []):
            chosen = position.get(token_id)
            entries.append({**self._chat_token(token_id, chosen),
                            "top_logprobs": [self._chat_token(t, lp) for t, lp in top_logprobs(position, top_k)]})
        return entries

    def _chat_token(self, token_id: int, logprob: Logprob | None) -> dict:
        text = self.token_text(token_id, logprob)
        return {"token": text, "logprob": clamp_logprob(logprob.logprob) if logprob else None,
                "bytes": list(text.encode("utf-8"))}


def _param_of(message: str, request_id: str) -> str | None:
    """The request field an engine error names ("n must be <= max_n ..."), the prompt, or None."""
    named = next((f for f in (*SAMPLING_FIELDS, "max_tokens") if message.startswith((f"{f} ", f"{f}:"))), None)
    if named is not None:  # "n must be <= max_n ...", "stop_token_ids: token id 9 is outside ..."
        return named
    for length_field in ("max_tokens", "min_tokens"):  # "prompt (9 tokens) + max_tokens (600) exceeds ..."
        if f"+ {length_field} (" in message:
            return length_field
    if message.startswith(("prompt", "the prompt", "token id", "sequence of")):
        return "messages" if request_id.startswith("chatcmpl") else "prompt"
    return None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{random_hex()}"


def top_logprobs(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The `k` most likely tokens of one position, most likely first."""
    return sorted(position.items(), key=lambda kv: -kv[1].logprob)[:k]


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB) if not math.isnan(value) else MIN_LOGPROB


async def _merge(tracked: list[AsyncIterator[RequestOutput]],
                 streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams; an error in one ends the merge with that error."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in outputs:
                queue.put_nowait((i, output, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        queue.put_nowait((i, None, StopAsyncIteration))

    tasks = [asyncio.create_task(pump(i, t)) for i, t in enumerate(tracked)]
    try:
        remaining = len(tasks)
        while remaining:
            i, output, error = await queue.get()
            if error is StopAsyncIteration:
                remaining -= 1
            elif error is not None:
                raise error
            else:
                yield i, output
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


# ---- SSE and folding -------------------------------------------------------------------

# one encoder for every response (json.dumps with options builds a new one each call)
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
CHUNK_HEAD_KEYS = ("id", "object", "created", "model", "choices")


def dumps(obj: dict) -> str:
    return _JSON.encode(obj)


class ChunkEncoder:
    """One stream's chunks as SSE events, each exactly `data: {dumps(chunk)}`: the fields every
    chunk of a stream shares (id, object, created, model) are rendered once."""

    def __init__(self):
        self._head: tuple | None = None
        self._prefix = ""

    def event(self, chunk: dict) -> bytes:
        head = (chunk["id"], chunk["object"], chunk["created"], chunk["model"])
        if head != self._head:
            self._head = head
            self._prefix = "data: {" + ",".join(f"{_JSON.encode(k)}:{_JSON.encode(v)}"
                                                for k, v in zip(CHUNK_HEAD_KEYS, head)) + ',"choices":'
        assert tuple(chunk)[:5] == CHUNK_HEAD_KEYS and len(chunk) <= 6, tuple(chunk)
        usage = chunk.get("usage")
        tail = "}\n\n" if usage is None else f',"usage":{_JSON.encode(usage)}}}\n\n'
        return (self._prefix + _JSON.encode(chunk["choices"]) + tail).encode()


async def sse_events(chunks: AsyncIterator[dict], num_choices: int | None = None) -> AsyncIterator[bytes]:
    """Server-sent events of `chunks`, ending with `data: [DONE]`; an engine fault becomes an error event.

    Events that follow one another with nothing to wait for between them are yielded together
    (one write to the client instead of several): the opening role chunks go with the first
    token's, and once all `num_choices` choices (None: unknown) have their finish reason, the
    rest (the usage chunk) goes with `[DONE]`.
    """
    encoder = ChunkEncoder()
    held: list[bytes] = []
    unfinished = num_choices
    try:
        async for chunk in chunks:
            held.append(encoder.event(chunk))
            choices = chunk["choices"]
            if choices and all("role" in c.get("delta", ()) for c in choices):
                continue  # a role chunk: sent with what comes next
            if unfinished is not None:
                unfinished -= sum(1 for c in choices if c["finish_reason"] is not None)
                if unfinished <= 0:
                    continue  # all done: the rest comes at once
            yield b"".join(held)
            held.clear()
    except EngineDeadError as e:
        held.append(f"data: {dumps(error_body(503, str(e)))}\n\n".encode())
    finally:
        await chunks.aclose()
    held.append(SSE_DONE)
    yield b"".join(held)


async def collect(chunks: AsyncIterator[dict]) -> list[dict]:
    """All chunks of a non-streaming request; an engine fault is a 503."""
    try:
        return [chunk async for chunk in chunks]
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None
    finally:
        await chunks.aclose()
