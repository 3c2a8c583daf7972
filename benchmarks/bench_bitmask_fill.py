"""The structured-output bitmask fill alone: one step's masks for a batch of matchers.

B1 with half its requests under an unbounded JSON array of strings is host-bound on this
fill (RESULTS.md, "Structured outputs"): 128 rows of Qwen3's 151,936 tokens a step, most of
them inside a string, where a row costs the most. This times, on the same matchers:
the engine's fill (`backend.fill_bitmasks`: xgrammar's BatchGrammarMatcher) at several
thread counts, alone and (in turn with it) right after a parallel torch CPU op (a torch.full of the batch's
bitmask, what the engine ran before each fill until the ninth session: torch's OpenMP
threads spin for milliseconds after it, on the cores the fill's threads need), a pool of
Python threads each filling every n-th row, and one thread calling each matcher in turn.

The grammar is the engine's (`backend.parse_grammar`: at most 20 whitespace characters
in a row); --unbounded-whitespace times xgrammar's default instead (what this script
timed before the ninth session). One thread filling each row in turn is timed with both,
at the same states, in turn, so their ratio shows what the whitespace limit costs. The matchers
sit in states like the engine's: --histories FILE replays the constrained outputs that
bench_structured.py --save-histories recorded, each to --step tokens (or to its last
token); without it, random words in strings, 85% of the rows inside one.

    python benchmarks/bench_bitmask_fill.py --tokenizer DIR [--rows 128] [--threads 1,4,8,16]
        [--histories FILE [--step 64]] [--unbounded-whitespace]
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
from nanovllm.structured_outputs.params import StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string"}}  # bench_structured's schema
WORDS = ["alpha", "beta", "gamma", "delta", "north", "south", "river", "stone"]
REPEATS = 20
IDLE_S = 0.05  # before each timed fill: longer than OpenMP's spin after a parallel region (~10 ms here)


def compiled_grammar(tokenizer, vocab_size: int, unbounded_whitespace: bool):
    """SCHEMA compiled as the engine compiles it, or with xgrammar's default whitespace."""
    import xgrammar as xgr
    if unbounded_whitespace:
        grammar = xgr.Grammar.from_json_schema(json.dumps(SCHEMA), any_whitespace=True, strict_mode=True)
    else:
        grammar = backend.parse_grammar(StructuredOutputsParams(json=SCHEMA))
    return backend.GrammarCompiler(tokenizer, vocab_size, max_threads=os.cpu_count() or 1).compile(grammar)


def matchers_in_strings(compiled, stop_ids: list[int], rows: int, seed: int = 0) -> list:
    """`rows` matchers over SCHEMA, most inside a string of random length, some between items."""
    rng = random.Random(seed)
    matchers = []
    for _ in range(rows):
        items = [" ".join(rng.choices(WORDS, k=rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        text = "[" + "".join(f'"{item}", ' for item in items)
        text += '"' + rng.choice(WORDS)[: rng.randint(0, 5)] if rng.random() < 0.85 else ""
        matcher = backend.new_matcher(compiled, stop_ids)
        assert matcher.accept_string(text), text
        matchers.append(matcher)
    return matchers


def matchers_from_histories(compiled, stop_ids: list[int], path: str, rows: int, step: int) -> list:
    """`rows` matchers that follow recorded outputs (taken in turn, again from the first when
    there are fewer), each to `step` tokens or to its last one (still under the grammar)."""
    with open(path) as f:
        histories = [h for h in json.load(f)["histories"] if len(h) > 1]
    if not histories:
        raise ValueError(f"{path}: no constrained output of two tokens or more")
    matchers = []
    for i in range(rows):
        history = histories[i % len(histories)]
        matcher = backend.new_matcher(compiled, stop_ids)
        for token_id in history[:min(step, len(history) - 1)]:
            assert matcher.accept_token(token_id), token_id
        matchers.append(matcher)
    return matchers


def median_ms(fill, repeats: int = REPEATS) -> float:
    """Median time of `fill()`, each after IDLE_S (as paired_ms times)."""
    fill()  # first call: pools and caches
    times = []
    for _ in range(repeats):
        time.sleep(IDLE_S)
        start = time.perf_counter()
        fill()
        times.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times), 3)


def paired_ms(fill, before, repeats: int = REPEATS, alone=None) -> tuple[float, float, float]:
    """Medians of `alone()` (default: `fill`) and of `fill()` right after `before()` (untimed),
    the two in turn (a shared machine's speed drifts less within a pair), and the median of
    the pairs' ratios (second / first)."""
    alone = alone or fill
    alone(), fill()  # first calls: pools and caches
    first, second = [], []
    for _ in range(repeats):
        for times, run, ahead in ((first, alone, None), (second, fill, before)):
            time.sleep(IDLE_S)  # torch's OpenMP threads go back to sleep
            if ahead is not None:
                ahead()
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
    ratio = statistics.median(b / a for a, b in zip(first, second))
    return round(statistics.median(first), 3), round(statistics.median(second), 3), round(ratio, 2)


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
    ap.add_argument("--histories", default=None, help="outputs recorded by bench_structured.py --save-histories")
    ap.add_argument("--step", type=int, default=64, help="--histories: tokens each matcher follows")
    ap.add_argument("--unbounded-whitespace", action="store_true", help="xgrammar's default JSON whitespace")
    args = ap.parse_args()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    stop_ids = [tokenizer.eos_token_id]
    both = {}  # unbounded whitespace or not -> matchers in the same states
    for unbounded in (False, True):
        compiled = compiled_grammar(tokenizer, args.vocab, unbounded)
        if args.histories:
            both[unbounded] = matchers_from_histories(compiled, stop_ids, args.histories, args.rows, args.step)
        else:
            both[unbounded] = matchers_in_strings(compiled, stop_ids, args.rows)
    matchers = both[args.unbounded_whitespace]
    rows = list(range(0, 2 * args.rows, 2))  # every other row of a batch twice as large
    shape = (2 * args.rows, -(-args.vocab // backend.BITS_PER_WORD))
    bitmask = torch.full(shape, -1, dtype=torch.int32)

    def in_turn(unbounded: bool):
        return lambda: [m.fill_next_token_bitmask(bitmask, r) for m, r in zip(both[unbounded], rows)]

    def torch_op() -> None:  # a parallel torch CPU op: the engine's bitmask before the ninth session
        torch.full(shape, -1, dtype=torch.int32)
    unbounded_mask = torch.full(shape, -1, dtype=torch.int32)
    for engine_matcher, unbounded_matcher, row in zip(both[False], both[True], rows):
        engine_matcher.fill_next_token_bitmask(bitmask, row)
        unbounded_matcher.fill_next_token_bitmask(unbounded_mask, row)
    differing = sum(not torch.equal(bitmask[row], unbounded_mask[row]) for row in rows)
    # one thread, each matcher in turn: the engine's grammar, then the unbounded one at the same states
    engine_ms, unbounded_ms, unbounded_ratio = paired_ms(in_turn(True), lambda: None, alone=in_turn(False))
    result = {"rows": args.rows, "vocab": args.vocab, "cpus": os.cpu_count(),
              "torch_threads": torch.get_num_threads(),
              "states": f"{args.histories} at step {args.step}" if args.histories else "random words",
              "whitespace": "unbounded" if args.unbounded_whitespace else "the engine's",
              "one_thread_in_turn_ms": engine_ms, "one_thread_in_turn_unbounded_whitespace_ms": unbounded_ms,
              "unbounded_over_engine_whitespace": unbounded_ratio, "rows_whose_masks_differ": differing}
    for threads in (int(t) for t in args.threads.split(",")):
        backend.set_fill_threads(threads)
        (result[f"engine_{threads}_ms"], result[f"engine_{threads}_after_torch_op_ms"],
         result[f"engine_{threads}_after_torch_op_ratio"]) = paired_ms(
            lambda: backend.fill_bitmasks(matchers, bitmask, rows), torch_op)
        with ThreadPoolExecutor(threads) as pool:
            result[f"python_pool_{threads}_ms"] = median_ms(
                lambda: fill_on_pool(pool, threads, matchers, bitmask, rows))
    backend.set_fill_threads(None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
