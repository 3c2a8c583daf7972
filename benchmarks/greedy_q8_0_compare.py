"""Greedy ids and top-5 logprobs of the embedded model on B2's chat prompts, for comparing two trees.

Run once per tree (its PYTHONPATH) and once more with `--compare A.json B.json`: the number of
prompts whose ids are identical, and for each that parts, whether the first divergence is a near-tie
(each side's token among the other's top-5 logprobs at that position).

    PYTHONPATH=<old tree> python benchmarks/greedy_q8_0_compare.py --out old.json
    PYTHONPATH=<new tree> python benchmarks/greedy_q8_0_compare.py --out new.json
    python benchmarks/greedy_q8_0_compare.py --compare old.json new.json
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def generate(out: str, prompts: int, tokens: int) -> None:
    import nanovllm  # first: the tree on PYTHONPATH (bench_cpu puts this script's tree on sys.path)
    from nanovllm import LLM, SamplingParams
    from bench_cpu import chat_prompts
    print(f"nanovllm from {nanovllm.__file__}", file=sys.stderr)
    llm = LLM(device="cpu")
    ids = chat_prompts(llm.get_tokenizer(), prompts)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    rows = [{"ids": list(o.outputs[0].token_ids),
             "top": [sorted(d, key=lambda t: -d[t].logprob)[:5] for d in o.outputs[0].logprobs]} for o in outs]
    with open(out, "w") as f:
        json.dump(rows, f)


def compare(a_path: str, b_path: str) -> None:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    same, near, far = 0, 0, 0
    for ra, rb in zip(a, b):
        diff = next((i for i, (x, y) in enumerate(zip(ra["ids"], rb["ids"])) if x != y), None)
        if diff is None:
            same += 1
        elif ra["ids"][diff] in rb["top"][diff] and rb["ids"][diff] in ra["top"][diff]:
            near += 1
            print(f"parts at token {diff}: a near-tie")
        else:
            far += 1
            print(f"parts at token {diff}: NOT a near-tie")
    print(json.dumps({"prompts": len(a), "identical": same, "near_tie": near, "other": far}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--compare", nargs=2)
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        generate(args.out, args.prompts, args.tokens)


if __name__ == "__main__":
    main()
