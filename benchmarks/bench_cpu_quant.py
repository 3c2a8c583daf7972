"""CPU quantized products: where the int4 kernel beats the dense one, per token count.

Loads the embedded SmolLM2-135M GGUF (Q4_1) with its 4-bit layers packed for
`_weight_int4pack_mm_for_cpu` (layers/quantization/gguf.py) and times, for each token
count, every linear layer of one step both ways: the int4 kernel (bf16 activations) and
the dense product on the dequantized weight in the engine's dtype. The weights of all
30 layers are used in turn, as in a real step, so they come from memory, not cache.
The largest count where int4 is faster is the crossover (`MAX_INT4_ROWS` in
layers/quantization/gguf.py, per CPU kind). Also prints the int4 path's error against
the dequantized product (relative Frobenius norm over the step's outputs).

    python benchmarks/bench_cpu_quant.py [--threads N] [--rows 1 2 4 8 16 32 64] [--repeats 7]

Prints a table and a final JSON line.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM  # noqa: E402
from nanovllm.kernels import cpu_int4  # noqa: E402
from nanovllm.layers.quantization.gguf import GGUFLinearMethod  # noqa: E402
from nanovllm.utils.device import cpu_kind  # noqa: E402


def packed_layers(llm) -> list:
    model = llm.llm_engine.model_runner.model
    return [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)
            and m.quant_method.packed is not None]


def step_seconds(layers, rows: int, int4: bool, repeats: int) -> float:
    """Median time of one step's products (every packed layer once) at `rows` tokens."""
    dtype = layers[0].weight.dtype
    xs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1], dtype=dtype) for m in layers}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for m in layers:
            x = xs[m.weight.shape[1]]
            cpu_int4.int4_linear(x, *m.quant_method.packed) if int4 else F.linear(x, m.weight)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def int4_error(layers, rows: int = 8) -> float:
    """||int4 - dense|| / ||dense|| over every packed layer's output at `rows` random tokens."""
    num, den = 0.0, 0.0
    for m in layers:
        x = torch.randn(rows, m.weight.shape[1], dtype=m.weight.dtype)
        ref = F.linear(x.float(), m.weight.float())
        num += (cpu_int4.int4_linear(x, *m.quant_method.packed).float() - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
    return (num / den) ** 0.5


@torch.inference_mode()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(max_model_len=256)
    layers = packed_layers(llm)
    result = dict(bench="cpu_quant", cpu_kind=cpu_kind(),
                  threads=torch.get_num_threads(), load_average=" ".join(f"{x:.2f}" for x in os.getloadavg()),
                  packed_layers=len(layers), dense_dtype=str(layers[0].weight.dtype).removeprefix("torch."),
                  int4_rel_error=round(int4_error(layers), 5), steps_ms={})
    for rows in args.rows:
        int4, dense = (step_seconds(layers, rows, flag, args.repeats) * 1e3 for flag in (True, False))
        result["steps_ms"][rows] = {"int4": round(int4, 2), "dense": round(dense, 2)}
        print(f"{rows:>4} tokens  int4 {int4:8.2f} ms  dense {dense:8.2f} ms  ratio {dense / int4:5.2f}", flush=True)
    faster = [r for r, v in result["steps_ms"].items() if v["int4"] < v["dense"]]
    result["crossover_rows"] = max(faster) if faster else 0
    print(json.dumps(result))


if __name__ == "__main__":
    main()
