"""The server's lighter request path: the generation routes on plain ASGI, SSE chunks rendered
with their shared head once, events with nothing between them sent in one write.

What must hold: every chunk's bytes are exactly `data: {json.dumps(chunk)}`; the coalesced
events concatenate to the same stream; a streamed response whose chunks carry several tokens
each (multi-step rounds) folds to the non-streamed text; the routes answer errors, other
methods and disconnects as before.
"""
import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")

from nanovllm.engine.async_llm import EngineDeadError  # noqa: E402
from nanovllm.entrypoints.openai.serving_engine import SSE_DONE, ChunkEncoder, dumps, sse_events  # noqa: E402
from smollm2_tokenizer import tiny_serving_model  # noqa: E402

MODEL = "tiny"
HEAD = {"id": "chatcmpl-\"q\"\\", "object": "chat.completion.chunk", "created": 1764633600, "model": "m/ü"}


def _chunk(choices, usage=None, **head):
    chunk = {**HEAD, **head, "choices": choices}
    return chunk if usage is None else {**chunk, "usage": usage}


def _choice(delta, finish=None, stop=None, logprobs=None, index=0):
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}


CHUNKS = [
    _chunk([_choice({"role": "assistant", "content": ""})]),
    _chunk([_choice({"content": "x\n\"é😀\u2028</script>"})]),
    _chunk([_choice({"content": "", "reasoning_content": "hmm"},
                    logprobs={"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]})]),
    _chunk([_choice({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]})]),
    _chunk([_choice({"content": "end"}, "stop", "STOP")]),
    _chunk([], {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}),
    _chunk([{"index": 1, "text": "t", "logprobs": None, "finish_reason": "length", "stop_reason": None}],
           id="cmpl-1", object="text_completion"),
]


def test_chunk_encoder_writes_exactly_what_json_dumps_writes():
    encoder = ChunkEncoder()
    for chunk in CHUNKS:   # the head changes on the last one: re-rendered
        expected = f"data: {json.dumps(chunk, ensure_ascii=False, separators=(',', ':'))}\n\n"
        assert encoder.event(chunk) == expected.encode()


async def _events(chunks, num_choices, error=None):
    async def gen():
        for chunk in chunks:
            yield chunk
        if error is not None:
            raise error
    return [e async for e in sse_events(gen(), num_choices)]


def _singly(chunks) -> list[bytes]:
    return [f"data: {dumps(c)}\n\n".encode() for c in chunks]


def test_events_with_nothing_between_them_go_together():
    stream = [CHUNKS[0], CHUNKS[1], CHUNKS[1], CHUNKS[4], CHUNKS[5]]   # role, 2 contents, finish, usage
    singly = _singly(stream)
    joined = asyncio.run(_events(stream, 1))
    # the role chunk with the first token's; the finish with the usage chunk and [DONE]
    assert joined == [singly[0] + singly[1], singly[2], singly[3] + singly[4] + SSE_DONE]
    # choices not known: every event alone (the role chunk still waits for the first token)
    assert asyncio.run(_events(stream, None)) == [singly[0] + singly[1], singly[2], singly[3], singly[4], SSE_DONE]
    # two choices: the stream's tail starts once both have finished
    two = [_chunk([_choice({"content": "a"}, "stop")]), _chunk([_choice({"content": "b"}, "length", index=1)]),
           CHUNKS[5]]
    singly = _singly(two)
    assert asyncio.run(_events(two, 2)) == [singly[0], singly[1] + singly[2] + SSE_DONE]


def test_an_engine_fault_ends_the_held_events_with_an_error_event():
    events = asyncio.run(_events(CHUNKS[:1], 1, EngineDeadError("the engine failed: boom")))
    assert len(events) == 1 and events[0].startswith(_singly(CHUNKS[:1])[0]) and events[0].endswith(SSE_DONE)
    error = json.loads(events[0].split(b"\n\n")[1][len(b"data: "):])
    assert error["error"]["message"] == "the engine failed: boom" and error["error"]["type"] == "server_error"


@pytest.fixture(scope="module")
def async_llm():
    from nanovllm.engine.async_llm import AsyncLLM
    llm = AsyncLLM(tiny_serving_model(), max_model_len=256, num_kvcache_blocks=64,
                   num_scheduler_steps=8, log_stats_interval=0)
    yield llm
    llm.shutdown()


def _run(app, go):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            return await go(http)
    return asyncio.run(main())


def _sse_json(body: str) -> list[dict]:
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_chunks_of_several_tokens_fold_to_the_non_streamed_text(async_llm, route):
    from nanovllm.entrypoints.openai.api_server import build_app
    from nanovllm.entrypoints.openai.chat_template import load_chat_template
    app = build_app(async_llm, [MODEL], load_chat_template(None, async_llm.tokenizer))
    if route == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}]}
    else:
        path, body = "/v1/completions", {"prompt": "Once upon a time"}
    body = {**body, "max_tokens": 40, "temperature": 0, "ignore_eos": True}

    async def go(http):
        whole = await http.post(path, json=body)
        streamed = await http.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
        return whole, streamed
    whole, streamed = _run(app, go)
    assert whole.status_code == 200 and streamed.status_code == 200
    assert streamed.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert streamed.headers["cache-control"] == "no-cache"
    chunks = _sse_json(streamed.text)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    if route == "chat":
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for c in choices)
        expected = whole.json()["choices"][0]["message"]["content"]
    else:
        text, expected = "".join(c["text"] for c in choices), whole.json()["choices"][0]["text"]
    assert text == expected and text
    assert chunks[-1]["usage"] == whole.json()["usage"] and whole.json()["usage"]["completion_tokens"] == 40
    assert len(choices) < 20   # rounds of 8 steps: several tokens a chunk
    assert choices[-1]["finish_reason"] == whole.json()["choices"][0]["finish_reason"] == "length"
    assert async_llm.num_unfinished_requests == 0


def test_generation_routes_answer_errors_and_other_methods_as_before(async_llm):
    from nanovllm.entrypoints.openai.api_server import build_app
    app = build_app(async_llm, [MODEL], api_key="k", max_request_body_bytes=200)
    auth = {"Authorization": "Bearer k"}

    async def go(http):
        return (await http.post("/v1/chat/completions", json={"messages": []}),
                await http.post("/v1/completions", json={"prompt": "hi"}, headers=auth | {"content-type": "x"}),
                await http.post("/v1/completions", content=b"{", headers=auth),
                await http.post("/v1/completions", json={"prompt": "x" * 300}, headers=auth),
                await http.post("/v1/completions", json={"prompt": "hi", "n": 0}, headers=auth),
                await http.get("/v1/chat/completions", headers=auth),
                await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth))
    no_key, ok_any_type, bad_json, too_big, bad_n, get, ok = _run(app, go)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    assert too_big.status_code == 413 and too_big.json()["error"]["type"] == "invalid_request_error"
    assert bad_n.status_code == 400 and bad_n.json()["error"]["param"] == "n"
    assert get.status_code == 405 and get.json()["error"]["type"] == "invalid_request_error"
    assert ok_any_type.status_code == ok.status_code == 200
    assert ok.headers["content-type"] == "application/json" and ok.json()["usage"]["completion_tokens"] == 2
    assert async_llm.num_unfinished_requests == 0 and async_llm.engine_stats.num_free_blocks == 64


def test_unexpected_error_is_a_500_in_openai_shape(async_llm, monkeypatch):
    from nanovllm.entrypoints.openai.api_server import build_app
    app = build_app(async_llm, [MODEL])

    def broken(*args, **kwargs):
        raise KeyError("boom")
    monkeypatch.setattr(app.state.server.chat, "render", broken)
    response = _run(app, lambda http: http.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                                               "content": "hi"}]}))
    assert response.status_code == 500 and response.json()["error"]["message"] == "internal server error: KeyError"
