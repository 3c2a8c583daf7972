"""Decode speed of a synthetic Q5_K GGUF model on the CPU: its layers kept as Q5_K (the "gguf"
method's default) against the same file dequantized at load (`quantization="gguf_dequant"`).

The model: a random Qwen3 of `--hidden` (a multiple of 256, as Q5_K rows must be) written with every
2-D tensor Q5_K (tests/test_cpu_q5_k.py's writer: a plain round-to-nearest quantizer), so that each
layer, the embedding and the LM head are Q5_K. One sequence (`--prompt` random tokens, `--tokens` new
ones, ignore_eos) and a batch of `--batch` such sequences, each engine timed `--repeats` times
after one warm-up, alternating; medians of tokens per second.

    python benchmarks/bench_cpu_q5_k_model.py --threads 2
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_cpu_q5_k_model.py --threads 2

Prints one JSON line.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


HEAD_DIM = 64  # the heads' size (hidden / 64 query heads, half as many K/V heads)


def write_model(path: str, hidden: int, layers: int, vocab: int) -> str:
    from test_cpu_q5_k import write_q5_k_gguf
    from tiny_models import build_tiny_model
    heads = hidden // HEAD_DIM
    hf = build_tiny_model("qwen3", os.path.join(path, "hf"), rope_scaling=None, hidden_size=hidden,
                          intermediate_size=3 * hidden, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=heads // 2, head_dim=HEAD_DIM, vocab_size=vocab)
    out = os.path.join(path, "q5_k.gguf")
    write_q5_k_gguf(hf, out)
    return out


def tokens_per_s(llm, prompts, params) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from nanovllm import LLM, SamplingParams
    from tiny_models import random_prompts
    with tempfile.TemporaryDirectory() as d:
        path = write_model(d, args.hidden, args.layers, args.vocab)
        engines = {name: LLM(path, skip_tokenizer_init=True, num_kvcache_blocks=256, **options)
                   for name, options in (("q5_k", {}), ("dequant", {"quantization": "gguf_dequant"}))}
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in random_prompts([args.prompt] * args.batch, args.vocab)]
        result = {"threads": args.threads, "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "dtype": str(next(iter(engines.values())).llm_engine.model_runner.model.lm_head.q8_dtype)}
        for label, batch in (("one", prompts[:1]), (f"batch{args.batch}", prompts)):
            times = {name: [] for name in engines}
            for r in range(args.repeats + 1):
                for name, llm in engines.items():
                    t = tokens_per_s(llm, batch, params)
                    if r:
                        times[name].append(t)
            for name, t in times.items():
                result[f"{label}_{name}_tok_s"] = round(statistics.median(t), 1)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
