"""Structured outputs: what a JSON-schema constraint costs.

GPU (the default): B1's workload (bench_offline.py: 256 prompts, the Qwen3-0.6B
configuration with dummy weights, temperature 0.6, ignore_eos) run twice in one process,
unconstrained and with every other request under a JSON schema whose outputs can run to
max_tokens (an unbounded array of strings); prints both throughputs and their ratio. A
constrained request whose array closes ends there (its grammar is complete), so the
output token counts are printed too. Needs a tokenizer for the grammar (--tokenizer DIR, an
HF tokenizer directory; Qwen3's matches the model's vocabulary).

CPU (--cpu-mask): the host's per-step cost of the masks at batch 64: 64 matchers on one
schema walk random valid paths; per step, filling the 64 bitmask rows from the matchers
(sampling_metadata.fill_token_bitmask), applying them to [64, vocab] float32 logits
(layers/sampler.py `apply_token_bitmask`), and each matcher accepting its token; beside
them, one copy of the logits as a yardstick of the machine's speed at the time.

    python benchmarks/bench_structured.py --tokenizer DIR            # GPU, B1 half constrained
    python benchmarks/bench_structured.py --cpu-mask [--tokenizer DIR --vocab 151936]  # CPU, batch 64
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

WARMUP_PROMPTS = 2  # the untimed warm-up: one constrained request and one free one

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.engine.warmup import VariantCounter  # noqa: E402

UNBOUNDED = {"type": "array", "items": {"type": "string"}}
MASK_BATCH, MASK_STEPS = 64, 64


def gpu_b1(tokenizer: str, small: bool) -> dict:
    from bench_offline import QWEN3_0_6B, SMALL, WARMUP_TOKENS, model_dir, workload
    cfg = SMALL if small else QWEN3_0_6B
    n, max_in, max_out = (16, 64, 64) if small else (256, 1024, 1024)
    prompts, params = workload(n, max_in, max_out)
    constraint = StructuredOutputsParams(json=UNBOUNDED)
    constrained = [SamplingParams(temperature=p.temperature, ignore_eos=True, max_tokens=p.max_tokens,
                                  structured_outputs=constraint if i % 2 == 0 else None)
                   for i, p in enumerate(params)]
    llm = LLM(model_dir(cfg), load_format="dummy", tokenizer=tokenizer, max_model_len=4096)
    variants = VariantCounter().__enter__()  # Triton variants first met after start-up: should be none
    warm = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=WARMUP_TOKENS, structured_outputs=c)
            for c in (constraint, None) * (WARMUP_PROMPTS // 2)]
    llm.generate([[i + 1] * 50 for i in range(WARMUP_PROMPTS)], warm, use_tqdm=False)
    result = {}
    for name, run_params in (("unconstrained", params), ("half_json", constrained)):
        start = time.perf_counter()
        outputs = llm.generate(prompts, run_params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result[name] = {"seconds": round(seconds, 3), "output_tokens": tokens, "tok_per_s": round(tokens / seconds, 1)}
        print(f"{name}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
    variants.__exit__()
    result["variants_after_start"] = len(variants.names)
    print(f"Triton kernel variants first met after start-up: {len(variants.names)} {variants.names}")
    result["ratio"] = round(result["half_json"]["tok_per_s"] / result["unconstrained"]["tok_per_s"], 3)
    print(f"half-constrained / unconstrained throughput: {result['ratio']}")
    return result


def cpu_mask(tokenizer_dir: str | None, vocab: int | None) -> dict:
    from nanovllm.engine.sampling_metadata import fill_token_bitmask
    from nanovllm.engine.sequence import Sequence
    from nanovllm.layers.sampler import apply_token_bitmask
    from nanovllm.structured_outputs.manager import StructuredOutputManager
    tokenizer = _tokenizer(tokenizer_dir)
    vocab = vocab or len(tokenizer)
    manager = StructuredOutputManager(tokenizer, vocab, {tokenizer.eos_token_id})
    params = StructuredOutputsParams(json=UNBOUNDED)
    seqs = [Sequence([1]) for _ in range(MASK_BATCH)]
    for seq in seqs:
        seq.grammar = manager.grammar_for(params, frozenset())
    seqs[0].grammar.compiled.result()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(MASK_BATCH, vocab, generator=gen)
    fill, apply, accept, copy = [], [], [], []
    for _ in range(MASK_STEPS):
        t = time.perf_counter()
        logits.clone()  # a reference on the same machine: one pass over the logits
        copy.append(time.perf_counter() - t)
        t0 = time.perf_counter()
        bitmask = fill_token_bitmask(seqs, vocab, torch.device("cpu"))
        t1 = time.perf_counter()
        masked = apply_token_bitmask(logits, bitmask)
        t2 = time.perf_counter()
        tokens = torch.multinomial(torch.softmax(masked, -1), 1, generator=gen).squeeze(1).tolist()
        t3 = time.perf_counter()
        for seq, token in zip(seqs, tokens):
            seq.grammar.accept(token)
        t4 = time.perf_counter()
        fill.append(t1 - t0), apply.append(t2 - t1), accept.append(t4 - t3)
    manager.shutdown()
    result = {name: round(statistics.median(values) * 1e3, 3) for name, values in
              (("fill_ms", fill), ("apply_ms", apply), ("accept_ms", accept), ("logits_copy_ms", copy))}
    result.update(batch=MASK_BATCH, vocab=vocab, steps=MASK_STEPS, threads=torch.get_num_threads())
    print(f"per step at batch {MASK_BATCH}, vocab {vocab} (medians of {MASK_STEPS} steps): fill "
          f"{result['fill_ms']} ms, apply {result['apply_ms']} ms, accept {result['accept_ms']} ms "
          f"(a copy of the logits: {result['logits_copy_ms']} ms)")
    return result


def _tokenizer(directory: str | None):
    """The tokenizer of DIR, else SmolLM2's from the embedded GGUF."""
    if directory is not None:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(directory)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from smollm2_tokenizer import smollm2_tokenizer
    return smollm2_tokenizer()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=None, help="an HF tokenizer directory (Qwen3's for B1)")
    ap.add_argument("--cpu-mask", action="store_true", help="the CPU per-step mask cost at batch 64")
    ap.add_argument("--vocab", type=int, default=None,
                    help="--cpu-mask: the logits' width (the model's vocabulary; Qwen3: 151936)")
    ap.add_argument("--small", action="store_true", help="a tiny GPU smoke run")
    args = ap.parse_args()
    if args.cpu_mask:
        result = {"benchmark": "structured_cpu_mask", **cpu_mask(args.tokenizer, args.vocab)}
    else:
        if args.tokenizer is None:
            ap.error("the GPU run needs --tokenizer DIR (the grammar is compiled against its vocabulary)")
        result = {"benchmark": "structured_b1", **gpu_b1(args.tokenizer, args.small)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
