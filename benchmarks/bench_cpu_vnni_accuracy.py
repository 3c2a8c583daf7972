"""How much the int8 VNNI products (kernels/cpu_gguf_vnni.py) move the embedded SmolLM2's outputs.

On the embedded Q4_1 file, the engine's default dtype (bf16 where the CPU multiplies bf16 fast),
three engines:

- fp32: `quantization="gguf_dequant", dtype="float32"`, the exact product of the file's values;
- bf16: `quantization="gguf"` with gguf.VNNI_PRODUCTS = False (batches above the Q4 kernel's rows by
  oneDNN's bf16 product on the dequantized weight: the path before the VNNI kernel; on the AVX2 kind,
  ATEN_CPU_CAPABILITY=avx2 included, the engine's dtype is fp32 and so is this product);
- vnni: `quantization="gguf"` with gguf.VNNI_PREFILL = True (those batches by the VNNI kernel,
  prefill included); vnni_decode: as it is (decode steps by the VNNI kernel, prefill by bf16).

1. teacher-forced logprobs (bench_cpu_int8_accuracy.py's method: `prompt_logprobs=0`, every
   prompt a prefill, so every product past the Q4 kernel's rows runs the kernel under test) over
   bench_fp8_kv_accuracy.py's four passages and `--chat-prompts` of B2's chat prompts followed by
   the bf16 engine's greedy answer: mean / max |dlogprob| of bf16 and vnni against fp32, and of
   vnni against bf16;
2. greedy ids over B2's `--num-prompts` chat prompts x `--max-tokens` (`ignore_eos`) of vnni against
   bf16 (and fp32 against bf16, for scale): identical sequences, and at each first divergence
   whether it is a near-tie (each side's token in the other's top-5, the rule tests/ use).

3. with --per-layer only: each linear layer's relative RMS error against the fp32 product, on the
   inputs it gets in the fp32 engine over the four passages (one prefill each), per layer shape
   (mean and max over the 30 layers): the VNNI kernel's product (`cpu_gguf_vnni.reference`, which
   the kernel equals to fp32 rounding: tests/test_cpu_gguf_vnni.py) and the bf16 product (x and
   the weight rounded to bf16, as oneDNN's bf16 product multiplies them).

    python benchmarks/bench_cpu_vnni_accuracy.py --threads 2 [--chat-prompts 16] [--num-prompts 64]
    python benchmarks/bench_cpu_vnni_accuracy.py --per-layer

Prints one line per comparison and a final JSON line.
"""
import argparse
import json
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_cpu import chat_prompts  # noqa: E402
from bench_cpu_int8_accuracy import agreement, diff_stats, greedy, teacher_forced  # noqa: E402
from bench_fp8_kv_accuracy import PASSAGES  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.kernels import cpu_gguf_vnni  # noqa: E402
from nanovllm.layers.quantization import gguf  # noqa: E402

ENGINES = {"fp32": dict(quantization="gguf_dequant", dtype="float32"), "bf16": {}, "vnni": {}, "vnni_decode": {}}


def run(name: str, prompts: list[list[int]], forced_from: list | None, args) -> dict:
    """The engine `name`'s greedy outputs over `prompts` and teacher-forced logprobs."""
    with (mock.patch.object(gguf, "VNNI_PRODUCTS", name.startswith("vnni")),
          mock.patch.object(gguf, "VNNI_PREFILL", name == "vnni")):
        llm = LLM(enable_prefix_caching=False, max_model_len=1024, **ENGINES[name])
        vnni_layers = sum(getattr(getattr(m, "quant_method", None), "vnni", None) is not None
                          for m in llm.llm_engine.model_runner.model.modules())
        outs = greedy(llm, prompts, args.max_tokens)
        forced = [{"prompt_token_ids": p + list(o.token_ids)} for p, o in
                  zip(prompts[:args.chat_prompts], forced_from or outs)]
        result = dict(greedy=outs, forced=forced, vnni_layers=vnni_layers,
                      passages=teacher_forced(llm, PASSAGES), chat=teacher_forced(llm, forced))
    del llm
    return result


@torch.inference_mode()
def per_layer() -> dict:
    """Per layer kind (qkv_proj, o_proj, gate_up_proj, down_proj): mean / max over layers and
    passages of |y - exact| / |exact| (Frobenius), y the VNNI or the bf16 product."""
    from nanovllm.layers.linear import LinearBase
    llm = LLM(enable_prefix_caching=False, max_model_len=1024, **ENGINES["fp32"])
    errors: dict[str, dict[str, list[float]]] = {}

    def hook(name):
        def record(module, inputs, output):
            x, w = inputs[0].double(), module.weight.double()         # [tokens, in], [out, in]
            exact = x @ w.T                                           # [tokens, out]
            ys = {"vnni": cpu_gguf_vnni.reference(inputs[0], module.weight),
                  "bf16": x.bfloat16().double() @ w.bfloat16().double().T}
            kind = errors.setdefault(name.rsplit(".", 1)[-1], {"vnni": [], "bf16": []})
            for k, y in ys.items():
                kind[k].append(((y - exact).norm() / exact.norm()).item())
        return record
    handles = [m.register_forward_hook(hook(n)) for n, m in llm.llm_engine.model_runner.model.named_modules()
               if isinstance(m, LinearBase)]
    for passage in PASSAGES:
        llm.generate([passage], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for h in handles:
        h.remove()
    return {kind: {k: dict(mean=round(sum(v) / len(v), 5), max=round(max(v), 5)) for k, v in per.items()}
            for kind, per in errors.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chat-prompts", type=int, default=16, help="B2 chat prompts (+ answers) teacher-forced")
    ap.add_argument("--num-prompts", type=int, default=64, help="B2 prompts for the greedy agreement")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-layer", action="store_true", help="only the per-layer errors (3.)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.per_layer:
        result = dict(bench="cpu_vnni_accuracy_per_layer", passages=len(PASSAGES), rel_rms=per_layer())
        for kind, row in result["rel_rms"].items():
            print(kind, json.dumps(row), flush=True)
        print(json.dumps(result))
        return
    runs = {}
    probe = LLM(enable_prefix_caching=False, max_model_len=1024, **ENGINES["fp32"])
    prompts = chat_prompts(probe.get_tokenizer(), args.num_prompts)
    del probe
    runs["bf16"] = run("bf16", prompts, None, args)
    for name in ("fp32", "vnni", "vnni_decode"):
        runs[name] = run(name, prompts, runs["bf16"]["greedy"], args)
    result = dict(bench="cpu_vnni_accuracy", threads=args.threads, load_average=" ".join(
        f"{x:.2f}" for x in os.getloadavg()), vnni_layers=runs["vnni"]["vnni_layers"], rows={})
    assert runs["bf16"]["vnni_layers"] == 0 and runs["vnni"]["vnni_layers"] > 0
    for ours, ref in (("bf16", "fp32"), ("vnni", "fp32"), ("vnni", "bf16"), ("vnni_decode", "bf16")):
        row = {part: diff_stats(runs[ours][part], runs[ref][part]) for part in ("passages", "chat")}
        if ref == "bf16":
            row["greedy"] = agreement(runs[ours]["greedy"], runs[ref]["greedy"])
        result["rows"][f"{ours} vs {ref}"] = row
        print(f"{ours} vs {ref}", json.dumps(row), flush=True)
    row = {"greedy": agreement(runs["fp32"]["greedy"], runs["bf16"]["greedy"])}
    result["rows"]["fp32 vs bf16"] = row
    print("fp32 vs bf16", json.dumps(row), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
