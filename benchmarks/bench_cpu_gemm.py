"""CPU products per kernel and row count: which one each batch size should run.

One step of SmolLM2-135M's products at M rows: its 120 linear layers (qkv 960x576, o
576x576, gate_up 3072x576, down 576x1536, 30 layers, each its own random weight so they
stream from memory as in a real step) and the LM head (49152x576), one after another,
with each kernel:

- row: `F.linear` on the row-major [out, in] weight (as checkpoints store it)
- col: `F.linear` on the column-major weight (kernels/cpu_linear.py)
- dnn: oneDNN's `_linear_pointwise` on a weight packed once (kernels/cpu_gemm.py)
- int4: `_weight_int4pack_mm_for_cpu`, bf16 activations (kernels/cpu_int4.py); head by dnn
- int8: `_weight_int8pack_mm` per-channel, bf16 activations (head too)
- int8dyn: FBGEMM's dynamic int8 linear, per-token activation scales, inputs Hadamard-rotated
  (kernels/cpu_int8_dynamic.py; head too); int8dyn_t: the same with FBGEMM's own per-tensor
  activation scale; int8dyn_norot: per token without the rotation
- colbf, dnnbf: `col` and `dnn` in bf16 (weights and activations), what the engine's dense
  products run where bf16 is fast (AVX512-BF16, AMX: utils/device.py); int4bf: int4 with
  its head by colbf; int8bf: `int8` on bf16 activations with no casts around it

The kernels alternate within each repeat, so a busy machine slows all of them alike;
medians are printed. fp32 everywhere else (the *bf kinds: bf16 activations in, bf16 out).

    python benchmarks/bench_cpu_gemm.py --threads 1 --rows 1 2 4 16 64 --kinds col dnn int4 int8
    python benchmarks/bench_cpu_gemm.py --threads 1 --rows 2 3 4 8 12 16 64 256 --kinds dnn int4 int8dyn --per-shape

Prints one line per row count and a final JSON line.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels import cpu_gemm, cpu_int4, cpu_int8_dynamic  # noqa: E402
from nanovllm.utils.device import cpu_kind  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in] of one decoder layer
NUM_LAYERS, HEAD_SHAPE = 30, (49152, 576)


def _dnn(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _int8(x, w):
    return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), *w).float()


def prepare(kind: str, weights: list[torch.Tensor], head: torch.Tensor):
    """(layer weights, head weight, product fn) in `kind`'s form."""
    if kind == "row":
        return weights, head, F.linear
    if kind == "col":
        col = lambda w: w.t().contiguous().t()  # noqa: E731
        return [col(w) for w in weights], col(head), F.linear
    if kind == "dnn":
        return [cpu_gemm.pack(w) for w in weights], cpu_gemm.pack(head), _dnn
    if kind == "int4":
        packs = [cpu_int4.pack_int4(*cpu_int4.quantize_affine(w), torch.bfloat16) for w in weights]
        return packs, cpu_gemm.pack(head), lambda x, w: cpu_int4.int4_linear(x, *w) if isinstance(w, tuple) else _dnn(x, w)
    if kind in ("colbf", "dnnbf", "int4bf", "int8bf"):
        bf = [w.to(torch.bfloat16) for w in weights]
        col = lambda w: w.t().contiguous().t()  # noqa: E731
        if kind == "colbf":
            return [col(w) for w in bf], col(head.to(torch.bfloat16)), F.linear
        if kind == "dnnbf":
            return [cpu_gemm.pack(w) for w in bf], cpu_gemm.pack(head.to(torch.bfloat16)), _dnn
        if kind == "int4bf":
            packs = [cpu_int4.pack_int4(*cpu_int4.quantize_affine(w), torch.bfloat16) for w in weights]
            return packs, col(head.to(torch.bfloat16)), lambda x, w: (
                cpu_int4.int4_linear(x, *w) if isinstance(w, tuple) else F.linear(x, w))
        q8 = lambda w: (lambda q, s: (q, s.to(torch.bfloat16)))(*cpu_int8_dynamic.quantize_per_channel(w))  # noqa: E731
        return [q8(w) for w in weights], q8(head), lambda x, w: torch.ops.aten._weight_int8pack_mm(x, *w)
    if kind == "int8":
        q8 = lambda w: (lambda q, s: (q, s.to(torch.bfloat16)))(*cpu_int8_dynamic.quantize_per_channel(w))  # noqa: E731
        return [q8(w) for w in weights], q8(head), _int8
    if kind in ("int8dyn", "int8dyn_t", "int8dyn_norot"):
        per_token = kind != "int8dyn_t"

        def fn(x, w):
            cpu_int8_dynamic.PER_TOKEN = per_token
            return cpu_int8_dynamic.int8_linear(x, w, None)
        block, cpu_int8_dynamic.ROTATION_BLOCK = cpu_int8_dynamic.ROTATION_BLOCK, (
            0 if kind == "int8dyn_norot" else cpu_int8_dynamic.ROTATION_BLOCK)
        packs = [cpu_int8_dynamic.prepack(w, 1) for w in weights], cpu_int8_dynamic.prepack(head, 1), fn
        cpu_int8_dynamic.ROTATION_BLOCK = block  # each weight remembers its own rotation
        return packs
    raise ValueError(f"unknown kind {kind!r}")


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


@torch.inference_mode()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    ap.add_argument("--kinds", nargs="+", default=["col", "dnn", "int4", "int8"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--per-shape", action="store_true", help="also print each layer shape's time (30 layers)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=gen) * 0.02 for _ in range(NUM_LAYERS) for s in LAYER_SHAPES]
    head = torch.randn(*HEAD_SHAPE, generator=gen) * 0.02
    kinds = {k: prepare(k, weights, head) for k in args.kinds}
    result = dict(bench="cpu_gemm", cpu_kind=cpu_kind(),
                  threads=torch.get_num_threads(), load_average=" ".join(f"{x:.2f}" for x in os.getloadavg()),
                  ms={})
    for rows in args.rows:
        xs32 = {k: torch.randn(rows, k, generator=gen) for k in {s[1] for s in LAYER_SHAPES}}
        xsbf = {k: v.to(torch.bfloat16) for k, v in xs32.items()}
        times = {k: ([], []) for k in kinds}
        shapes = {k: {s: [] for s in LAYER_SHAPES} for k in kinds}
        for _ in range(args.repeats):
            for kind, (ws, hw, fn) in kinds.items():
                xs = xsbf if kind.endswith("bf") else xs32
                start = time.perf_counter()
                per = dict.fromkeys(LAYER_SHAPES, 0.0)
                for w, shape in zip(ws, LAYER_SHAPES * NUM_LAYERS):
                    t = time.perf_counter()
                    fn(xs[shape[1]], w)
                    per[shape] += time.perf_counter() - t
                mid = time.perf_counter()
                for shape, seconds in per.items():
                    shapes[kind][shape].append(seconds)
                fn(xs[HEAD_SHAPE[1]], hw)
                times[kind][0].append(mid - start)
                times[kind][1].append(time.perf_counter() - mid)
        row = {k: {"layers": round(median(a) * 1e3, 1), "head": round(median(b) * 1e3, 1)} for k, (a, b) in times.items()}
        if args.per_shape:
            for k in kinds:
                row[k]["shapes"] = {f"{o}x{i}": round(median(v) * 1e3, 2) for (o, i), v in shapes[k].items()}
        result["ms"][rows] = row
        print(f"{rows:>5} rows  " + "  ".join(f"{k}: {v['layers']:7.1f} + head {v['head']:6.1f} ms" for k, v in row.items()),
              flush=True)
        if args.per_shape:
            for k in kinds:
                print(f"{'':>11}{k} per shape (30 layers, ms): {row[k]['shapes']}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
