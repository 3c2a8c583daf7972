"""The structured-output bitmask fill alone: one step's masks for a batch of matchers.

B1 with half its requests under an unbounded JSON array of strings is host-bound on this
fill (RESULTS.md, "Structured outputs"): 128 rows of Qwen3's 151,936 tokens a step, most of
them inside a string, where a row costs the most. This times, on the same matchers:
the engine's fill (`backend.fill_bitmasks`: a thread pool, every thread taking every n-th
row) at several thread counts, xgrammar's own `BatchGrammarMatcher` at the same counts,
and one thread calling each matcher in turn.

    python benchmarks/bench_bitmask_fill.py --tokenizer DIR [--rows 128] [--threads 1,4,8,16]
"""
import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanovllm.structured_outputs import backend  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string"}}  # bench_structured's schema
WORDS = ["alpha", "beta", "gamma", "delta", "north", "south", "river", "stone"]
REPEATS = 20


def matchers_in_strings(tokenizer_dir: str, vocab_size: int, rows: int, seed: int = 0) -> list:
    """`rows` matchers over SCHEMA, most inside a string of random length, some between items."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tokenizer_dir), vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    rng = random.Random(seed)
    matchers = []
    for _ in range(rows):
        items = [" ".join(rng.choices(WORDS, k=rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        text = "[" + "".join(f'"{item}", ' for item in items)
        text += '"' + rng.choice(WORDS)[: rng.randint(0, 5)] if rng.random() < 0.85 else ""
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(text), text
        matchers.append(matcher)
    return matchers


def median_ms(fill, repeats: int = REPEATS) -> float:
    fill()  # first call: pools and caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fill()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def fill_on_pool(pool: ThreadPoolExecutor, threads: int, matchers: list, bitmask: torch.Tensor,
                 rows: list[int]) -> None:
    def every_nth(first: int) -> None:
        for i in range(first, len(matchers), threads):
            matchers[i].fill_next_token_bitmask(bitmask, rows[i])
    list(pool.map(every_nth, range(threads)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True, help="an HF tokenizer directory (Qwen3's for B1)")
    ap.add_argument("--vocab", type=int, default=151936, help="the logits' width (Qwen3: 151936)")
    ap.add_argument("--rows", type=int, default=128, help="constrained rows a step")
    ap.add_argument("--threads", default="1,4,8,16", help="thread counts to time")
    args = ap.parse_args()
    matchers = matchers_in_strings(args.tokenizer, args.vocab, args.rows)
    rows = list(range(0, 2 * args.rows, 2))  # every other row of a batch twice as large
    bitmask = torch.full((2 * args.rows, -(-args.vocab // backend.BITS_PER_WORD)), -1, dtype=torch.int32)
    result = {"rows": args.rows, "vocab": args.vocab, "cpus": os.cpu_count(),
              "one_thread_in_turn_ms": median_ms(lambda: [m.fill_next_token_bitmask(bitmask, r)
                                                         for m, r in zip(matchers, rows)])}
    for threads in (int(t) for t in args.threads.split(",")):
        backend.set_fill_threads(threads)
        result[f"engine_{threads}_ms"] = median_ms(lambda: backend.fill_bitmasks(matchers, bitmask, rows))
        with ThreadPoolExecutor(threads) as pool:
            result[f"python_pool_{threads}_ms"] = median_ms(lambda: fill_on_pool(pool, threads, matchers, bitmask, rows))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
