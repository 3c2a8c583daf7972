"""B2's anchors: vLLM's CPU backend and llama.cpp, each run inside its own venv.

benchmarks/bench_cpu.py makes the venvs (`ensure_venv`) and runs this file with their
python, so neither engine is ever a dependency of nano-vLLM:

    <venv>/bin/python benchmarks/cpu_anchors.py vllm --model HF_DIR --prompts P.json --max-tokens 128
    <venv>/bin/python benchmarks/cpu_anchors.py llamacpp --model FILE.gguf --prompts P.json --max-tokens 128

P.json is a list of prompts as token ids. Both measure what bench_cpu.py measures of ours:
load time, one batched greedy run of every prompt (`ignore_eos`; llama-cpp-python has no
batched API, so it gives none) and the single-prompt decode rate, (t(1 + n) - t(1)) / n.
Each also reports what it runs on: vLLM the kernel libraries (vllm/_C*.so) its processes
loaded (_C_AVX2 under bench_cpu.py --isa avx2), llama.cpp its build's instruction sets
(`llama_print_system_info`). Prints one JSON line. Only the standard library, torch and the
anchor are imported here.
"""
import argparse
import glob
import json
import os
import time

VLLM_KERNEL_LIB = "/vllm/_C"  # vllm/_C.abi3.so, _C_AVX2.abi3.so, _C_AVX512.abi3.so in /proc/<pid>/maps


def decode_rate(generate, prompt: list[int], new_tokens: int) -> float:
    _, one = generate([prompt], 1)
    _, many = generate([prompt], new_tokens + 1)
    return new_tokens / max(many - one, 1e-9)


def _descendants(pid: int) -> set[int]:
    """pid and every process below it (vLLM runs its engine core in a child process)."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:
            continue
        parents[int(stat.split("/")[2])] = int(fields[1])
    found, grew = {pid}, True
    while grew:
        new = {p for p, parent in parents.items() if parent in found} - found
        found, grew = found | new, bool(new)
    return found


def vllm_kernel_libs() -> list[str]:
    """The vllm/_C*.so files mapped by this process and its children."""
    libs = set()
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/maps") as f:
                libs |= {os.path.basename(line.split()[-1]) for line in f if VLLM_KERNEL_LIB in line}
        except OSError:
            continue
    return sorted(libs)


def run_vllm(args, prompts: list[list[int]]) -> dict:
    from vllm import LLM, SamplingParams
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enable_prefix_caching=False,
              seed=0)
    load_s = time.perf_counter() - start

    def generate(batch, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start

    generate(prompts[:2], 4)  # warm-up
    tokens, seconds = generate(prompts, args.max_tokens)
    return dict(load_s=load_s, batched_s=seconds, single_decode_tok_s=decode_rate(generate, prompts[0], args.max_tokens),
                tokens=tokens, runs_on=" ".join(vllm_kernel_libs()))


def run_llamacpp(args, prompts: list[list[int]]) -> dict:
    from llama_cpp import Llama, llama_print_system_info
    start = time.perf_counter()
    llm = Llama(model_path=args.model, n_ctx=args.max_model_len, n_threads=args.threads or os.cpu_count(),
                n_batch=512, verbose=False, seed=0)
    load_s = time.perf_counter() - start

    def generate(batch, n):
        (prompt,) = batch
        llm.reset()  # no reuse of the last call's prefix
        start, tokens = time.perf_counter(), []
        for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            tokens.append(token)
            if len(tokens) == n:
                break
        return [tokens], time.perf_counter() - start

    generate(prompts[:1], 4)  # warm-up
    return dict(load_s=load_s, batched_s=None, single_decode_tok_s=decode_rate(generate, prompts[0], args.max_tokens),
                tokens=None, runs_on=llama_print_system_info().decode().strip(" |"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=("vllm", "llamacpp"))
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    result = (run_vllm if args.engine == "vllm" else run_llamacpp)(args, prompts)
    print("ANCHOR_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
