"""B2's batched run with two CPU attention backends in one process, alternating: this
checkout's `kernels/cpu_attn.py` against another copy of it (e.g. main's), and optionally
this checkout with its decode mirrors off (a gather every step: the torch-only path only;
where a C++ compiler is found, this checkout's decodes run kernels/cpu_paged_decode.py,
which reads the paged cache directly).

Each variant is its own engine on the embedded SmolLM2 (fp32, one thread by default);
the baseline module is its engine's attention backend (a module without `new_kv_cache`
gets the contiguous cache). A warm-up run of each fills its prefix cache, then `--repeats`
alternating rounds of 64 chat prompts x `--max-tokens` greedy tokens (`ignore_eos`);
medians, and whether every variant's ids equal the first's.

    git show main:nanovllm/kernels/cpu_attn.py > /tmp/cpu_attn_main.py
    python benchmarks/ab_cpu_attn.py --baseline /tmp/cpu_attn_main.py --max-tokens 128 --repeats 2
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nanovllm.engine.model_runner as model_runner  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels import cpu_attn, cpu_decode_mirror  # noqa: E402
from nanovllm.layers.attention import Attention  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import chat_prompts  # noqa: E402


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("cpu_attn_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_engine(backend, max_model_len: int) -> LLM:
    real = model_runner.get_attention_backend
    model_runner.get_attention_backend = lambda device_type: backend
    try:
        return LLM(device="cpu", dtype="float32", max_model_len=max_model_len)
    finally:
        model_runner.get_attention_backend = real


def run(llm: LLM, backend, mirrors: bool, prompts, params) -> tuple[float, list[list[int]]]:
    Attention.backend = backend  # (a class attribute: every engine's layers share it)
    lookup, remember = cpu_decode_mirror.lookup, cpu_decode_mirror.remember
    if not mirrors:
        cpu_decode_mirror.lookup = cpu_decode_mirror.remember = lambda *args: None
    try:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]
    finally:
        cpu_decode_mirror.lookup, cpu_decode_mirror.remember = lookup, remember


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="path of another cpu_attn.py")
    ap.add_argument("--no-mirror-variant", action="store_true", help="also this checkout with mirrors off")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    baseline = load_module(args.baseline)
    variants = {"baseline": (baseline, True), "ours": (cpu_attn, True)}
    if args.no_mirror_variant:
        variants["ours_no_mirror"] = (cpu_attn, False)
    engines = {name: make_engine(backend, args.max_model_len) for name, (backend, _) in variants.items()}
    prompts = chat_prompts(next(iter(engines.values())).get_tokenizer(), args.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for name, (backend, mirrors) in variants.items():  # warm-up: prefix caches filled
        run(engines[name], backend, mirrors, prompts, params)
    times, ids = {name: [] for name in variants}, {}
    for _ in range(args.repeats):
        for name, (backend, mirrors) in variants.items():
            seconds, ids[name] = run(engines[name], backend, mirrors, prompts, params)
            times[name].append(seconds)
            print(f"{name}: {seconds:.2f} s (load {os.getloadavg()[0]:.2f})", flush=True)
    tokens = args.num_prompts * args.max_tokens
    print(json.dumps({"max_tokens": args.max_tokens, "threads": args.threads,
                      "median_s": {n: round(statistics.median(t), 2) for n, t in times.items()},
                      "tok_s": {n: round(tokens / statistics.median(t), 1) for n, t in times.items()},
                      "ids_equal_baseline": {n: ids[n] == ids["baseline"] for n in variants}}))


if __name__ == "__main__":
    main()
