"""Data-parallel replicas on a local Ray cluster (`ray.init(num_cpus=2)`, one for the whole module):
run-batch with 2 replicas (Ray Data) and `serve` with 2 replicas (Ray Serve), tiny model on CPU.

- 2-replica run-batch output equals one engine's, line for line by custom_id (greedy),
  for a resumed run (a cut-short output file) with a replica killed mid-job (SIGKILL):
  each custom_id answered exactly once, with the same answers and error lines;
- serving with 2 replicas answers the official `openai` client, streamed and not, with
  one engine's answers; a repeated prefix goes to one replica (its prefix-cache hit
  counter in /metrics); a killed replica fails only its in-flight request with a 503
  in OpenAI's shape, the other keeps serving, and Serve brings the replica back.

Marked `ray` (pyproject): `pytest -m "not ray"` leaves them out. Skipped without ray.
"""
import argparse
import json
import os
import re
import signal
import socket
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from smollm2_tokenizer import tiny_serving_model  # noqa: E402
from test_run_batch import MODEL_NAME, chat_line, completion_line, read_output, write_lines  # noqa: E402

pytestmark = pytest.mark.ray

ENGINE = dict(max_model_len=256, num_kvcache_blocks=200, max_num_seqs=4, dtype="float32")
NUM_REPLICAS = 2
CPUS_PER_REPLICA = 0.5     # two replicas on the 2-CPU cluster, with room left for Ray Data's own tasks
REPLICA_BACK_S = 120
KILLED_TOKENS = 200
# The request a replica is killed in: its samples run max_num_seqs at a time, so it outlasts many metrics
# pushes (PUSH_INTERVAL_S) on any machine. One 200-token sample took ~0.26 s on an idle 2-core VM, less
# than a push interval, and the kill then missed it or came after its answer.
KILLED_SAMPLES = 64
# the Ray Data job: 20 completions, 3 chats and 2 bad lines, 5 of them already answered, so 20 to do
# in 7 batches of 3 (TASKS_PER_REPLICA batches a replica); the kill lands after the first is written.
# Each completion is long enough that the rest of the job is still running then: at 24 tokens an idle
# 2-core VM wrote every line before the test could kill a replica.
JOB_COMPLETIONS, JOB_TOKENS = 20, 200
RUNNING = "nanovllm:num_requests_running"   # the gauge's sample line in a replica's /metrics text


def running_sequences(metrics_text: str) -> float:
    """The running-batch gauge's value in a replica's /metrics text."""
    match = re.search(rf"^{re.escape(RUNNING)} (\S+)$", metrics_text, re.MULTILINE)
    assert match, "no running gauge in the replica's metrics"
    return float(match[1])


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    try:
        from ray import serve
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_dir():
    return tiny_serving_model()


@pytest.fixture(scope="module")
def one_engine(model_dir):
    """run_local on one in-process engine: the reference output of a batch file."""
    from nanovllm.engine.async_llm import AsyncLLM
    from nanovllm.entrypoints.openai.chat_template import load_chat_template
    from nanovllm.entrypoints.run_batch import run_local
    llm = AsyncLLM(model_dir, log_stats_interval=0, **ENGINE)
    template = load_chat_template(None, llm.tokenizer)

    def run(input_path, output_path) -> list[dict]:
        run_local(llm, [MODEL_NAME], template, str(input_path), str(output_path), progress=False)
        return read_output(output_path)
    yield run
    llm.shutdown()


def ray_args(model_dir: str, input_path, output_path):
    from nanovllm.entrypoints.run_batch import add_cli_args
    argv = ["-i", str(input_path), "-o", str(output_path), "--model", model_dir, "--served-model-name", MODEL_NAME,
            "--no-progress", "-dp", str(NUM_REPLICAS), "--cpus-per-replica", str(CPUS_PER_REPLICA),
            *[f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]]
    return add_cli_args(argparse.ArgumentParser()).parse_args(argv)


def answers(lines: list[dict]) -> dict:
    """custom_id (or line number) -> what was answered: the text, or the error's status and message."""
    out = {}
    for o in lines:
        key = o["custom_id"] if o["custom_id"] is not None else o["error"]["line"]
        assert key not in out, f"{key} answered twice"
        body = o["response"]["body"]
        if o["error"] is not None:
            out[key] = (o["response"]["status_code"], o["error"]["message"])
        elif "message" in body["choices"][0]:
            out[key] = body["choices"][0]["message"]["content"]
        else:
            out[key] = body["choices"][0]["text"]
    return out


# ---- run-batch on Ray Data ----------------------------------------------------------------------

def _replica_pids(marker: str) -> list[int]:
    """Pids of this test's Ray worker processes whose title names `marker` (descendants of this process)."""
    import psutil
    found = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if marker in " ".join(proc.cmdline()):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def test_two_replicas_equal_one_engine_resumed_and_with_a_replica_killed(cluster, model_dir, one_engine, tmp_path):
    """One Ray Data job (each costs a replica pool's start-up): it resumes a cut-short output file,
    one replica is SIGKILLed mid-job, and the result must still equal one engine's line for line."""
    from nanovllm.entrypoints.ray.batch import run_on_ray
    lines = [completion_line(f"r{i}", f"Item {i} of the list" * (1 + i % 3), max_tokens=JOB_TOKENS)
             for i in range(JOB_COMPLETIONS)]
    lines += [chat_line(f"chat{i}", f"What is {i} times {i}?") for i in range(3)]
    lines += ["not json", completion_line("bad", "x", top_p=2.0)]
    write_lines(tmp_path / "in.jsonl", lines)
    ref_lines = one_engine(tmp_path / "in.jsonl", tmp_path / "ref.jsonl")
    kept = ref_lines[:5]   # an interrupted earlier run: 5 lines, then half a line
    with open(tmp_path / "out.jsonl", "w") as f:
        f.writelines(json.dumps(o) + "\n" for o in kept)
        f.write(json.dumps(ref_lines[5])[:40])

    result = {}
    job = threading.Thread(target=lambda: result.update(
        summary=run_on_ray(ray_args(model_dir, tmp_path / "in.jsonl", tmp_path / "out.jsonl"))))
    job.start()
    deadline = time.monotonic() + REPLICA_BACK_S
    while time.monotonic() < deadline and (tmp_path / "out.jsonl").read_bytes().count(b"\n") <= len(kept):
        time.sleep(0.05)
    pids = _replica_pids("OpenAIBatchProcessor")
    written_at_kill = (tmp_path / "out.jsonl").read_bytes().count(b"\n")
    assert pids and written_at_kill < len(lines), "no replica to kill mid-job"
    os.kill(pids[0], signal.SIGKILL)
    job.join(REPLICA_BACK_S * 2)
    assert not job.is_alive() and "summary" in result

    out = read_output(tmp_path / "out.jsonl")
    assert out[:len(kept)] == kept, "lines of the earlier run were rewritten"
    assert answers(out) == answers(ref_lines)     # each custom_id once, the same answers and errors
    assert result["summary"]["skipped"] == len(kept) and result["summary"]["errors"] == 2


# ---- serve on Ray Serve -------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(cluster, model_dir):
    """The Serve app with 2 engine replicas: (base url, board actor)."""
    from nanovllm.entrypoints.ray import metrics as board
    from nanovllm.entrypoints.ray import serve as ray_serve
    from nanovllm.entrypoints.ray.replica import ReplicaSpec
    spec = ReplicaSpec(model=model_dir, engine_kwargs=ENGINE, served_model_names=(MODEL_NAME,),
                       num_replicas=NUM_REPLICAS, num_cpus=CPUS_PER_REPLICA)
    port = _free_port()
    ray_serve.run(spec, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    yield url, board.metrics_board(ray_serve.APP_NAME)
    from ray import serve
    serve.delete(ray_serve.APP_NAME)
    board.delete_board(ray_serve.APP_NAME)


def live_replicas(board_actor, count: int, exclude: tuple = (), timeout: float = REPLICA_BACK_S) -> dict:
    """The board's healthy replicas (less `exclude`) once there are `count` of them, or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        live = {k: r for k, r in ray.get(board_actor.live.remote()).items() if r["healthy"] and k not in exclude}
        if len(live) >= count or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


def replica_counter(url: str, name: str) -> dict[str, float]:
    """replica id -> the value of counter `name` in the ingress's merged /metrics."""
    import httpx
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"nanovllm:{name}{{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            values[replica] = float(line.rsplit(" ", 1)[1])
    return values


def test_serve_answers_the_openai_client_streamed_and_not(served, one_engine, tmp_path):
    url, board_actor = served
    assert len(live_replicas(board_actor, NUM_REPLICAS)) == NUM_REPLICAS
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    prompts = [f"Serve me number {i}" for i in range(4)]
    write_lines(tmp_path / "in.jsonl", [completion_line(f"p{i}", p) for i, p in enumerate(prompts)]
                + [chat_line("chat", "Hello there")])
    reference = answers(one_engine(tmp_path / "in.jsonl", tmp_path / "ref.jsonl"))
    for i, prompt in enumerate(prompts):
        kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(**kwargs).choices[0].text == reference[f"p{i}"]
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
        assert streamed == reference[f"p{i}"]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == reference["chat"]
    with pytest.raises(openai.BadRequestError) as err:   # the server's own validation, at the ingress
        client.completions.create(model=MODEL_NAME, prompt="x", top_p=1.5)
    assert err.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


def test_repeated_prefix_goes_to_one_replica(served):
    url, board_actor = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    before = {name: replica_counter(url, name) for name in ("prefix_cache_hits_total", "prefix_cache_queries_total")}
    shared = " ".join(f"w{i}" for i in range(48))      # about 140 tokens: over 8 blocks of 16
    num_prompt_tokens = sum(client.completions.create(model=MODEL_NAME, prompt=f"{shared} question {i}", max_tokens=2,
                                                      temperature=0).usage.prompt_tokens for i in range(4))

    def gained(name: str) -> dict[str, float]:
        now = replica_counter(url, name)
        return {r: now.get(r, 0) - before[name].get(r, 0) for r in now}
    deadline = time.monotonic() + 30
    while sum(gained("prefix_cache_queries_total").values()) < num_prompt_tokens and time.monotonic() < deadline:
        time.sleep(0.2)   # the replicas push their metrics every half second
    hits = gained("prefix_cache_hits_total")
    winners = [r for r, g in hits.items() if g > 0]
    assert len(winners) == 1, hits
    assert hits[winners[0]] >= 3 * 8 * 16     # requests 2-4 each reused at least the 8 routed blocks


def test_a_killed_replica_fails_only_its_requests_and_comes_back(served):
    import httpx
    url, board_actor = served
    live = live_replicas(board_actor, NUM_REPLICAS)
    # the board may still hold a push from while an earlier test's request ran: wait for pushes with
    # none running, so that the one replica found running a request below runs the long one
    deadline = time.monotonic() + 60
    while any(running_sequences(r["text"]) for r in ray.get(board_actor.live.remote()).values()):
        assert time.monotonic() < deadline, "the replicas never reported an empty batch"
        time.sleep(0.05)
    result = {}

    def long_request():
        body = {"model": MODEL_NAME, "prompt": "a long answer", "max_tokens": KILLED_TOKENS, "ignore_eos": True,
                "n": KILLED_SAMPLES}
        result["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    worker = threading.Thread(target=long_request)
    worker.start()
    victim = None
    deadline = time.monotonic() + 60
    while victim is None and time.monotonic() < deadline:
        for replica_id, r in ray.get(board_actor.live.remote()).items():
            if running_sequences(r["text"]) and worker.is_alive():
                victim = (replica_id, r["pid"])
        time.sleep(0.05)
    assert victim is not None, "the long request never ran"
    os.kill(victim[1], signal.SIGKILL)
    worker.join(120)
    response = result["response"]
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "server_error" and "died" in response.json()["error"]["message"]

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    for i in range(3):    # the other replica keeps serving meanwhile
        assert client.completions.create(model=MODEL_NAME, prompt=f"still there {i}", max_tokens=4).choices[0].text
    back = live_replicas(board_actor, NUM_REPLICAS, exclude=(victim[0],))
    assert len(back) == NUM_REPLICAS, back.keys()
    assert set(live) - {victim[0]} <= set(back)


# ---- pieces without a cluster ---------------------------------------------------------------

def test_processor_reads_read_json_columns():
    """Rows as `ray.data.read_json(batch file)` gives them (numpy values, nulls for absent fields)."""
    import numpy as np
    from nanovllm.entrypoints import batch_file
    from nanovllm.entrypoints.ray.batch import _rows
    batch = {"custom_id": np.array(["a", "b"], dtype=object), "method": np.array(["POST", "POST"], dtype=object),
             "url": np.array(["/v1/completions"] * 2, dtype=object),
             "body": np.array([{"prompt": "x", "max_tokens": np.int64(4), "stop": None},
                               {"prompt": np.array([5, 6]), "max_tokens": np.int64(2), "stop": np.array(["."])}],
                              dtype=object)}
    requests = [batch_file.parse_batch_line(n, text) for n, text in _rows(batch)]
    assert [(r.line_no, r.custom_id) for r in requests] == [(1, "a"), (2, "b")]
    assert requests[0].body == {"prompt": "x", "max_tokens": 4}
    assert requests[1].body == {"prompt": [5, 6], "max_tokens": 2, "stop": ["."]}


def test_merged_metrics_label_every_replica_once_per_family():
    from nanovllm.entrypoints.ray.metrics import merge_replica_metrics
    text = ("# HELP nanovllm:hits Hits.\n# TYPE nanovllm:hits counter\nnanovllm:hits {}\n"
            "# HELP nanovllm:lat Latency.\n# TYPE nanovllm:lat histogram\nnanovllm:lat_bucket{{le=\"1.0\"}} {}\n")
    merged = merge_replica_metrics({"r2": {"text": text.format(7, 1)}, "r1": {"text": text.format(3, 2)}})
    assert merged.count("# HELP nanovllm:hits") == 1 and merged.count("# TYPE nanovllm:lat") == 1
    assert 'nanovllm:hits{replica="r1"} 3\nnanovllm:hits{replica="r2"} 7\n' in merged
    assert 'nanovllm:lat_bucket{replica="r2",le="1.0"} 1' in merged
