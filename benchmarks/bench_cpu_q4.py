"""The C++ GGUF 4-bit kernel (kernels/cpu_gguf_q4.py) against torch's products at a few rows.

SmolLM2-135M's 120 linear layers (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, 30
layers each with its own random GGUF weight, so that they stream from memory as in a real decode
step: benchmarks/bench_cpu_gemm.py's shapes) at M rows, with each kernel:

- q4: cpu_gguf_q4.q4_linear, fp32 x (fp32 out); q4bf: the same with bf16 x (bf16 out)
- q4pfN: q4 built with software prefetch N bytes ahead of the block being read (q4pf0: none;
  q4 itself prefetches cpu_gguf_q4.PREFETCH_BYTES ahead)
- int4: torch's `_weight_int4pack_mm_for_cpu` on the same GGUF blocks as the engine packs them
  (kernels/cpu_int4.py: bf16 activations, bf16 scales and zeros), bf16 x; int4f: the same called
  with fp32 x (converted to bf16 and back, as an fp32 engine calls it)
- vnni: the int8 kernel for batches (kernels/cpu_gguf_vnni.py; x quantized to int8 per 32; its AVX512-VNNI
  form, or its AVX2 form where the CPU, or ATEN_CPU_CAPABILITY=avx2, has no AVX512-VNNI), fp32 x;
  vnnibf: bf16 x; vnniMxG / vnnibfMxG: fp32 / bf16 x, the kernel built with TILE_M = M, TILE_G = G
- dnnbf: oneDNN's bf16 `_linear_pointwise` on the dequantized weight packed once (kernels/cpu_gemm.py);
  dnn: the same in fp32
- dense: an fp32 engine's dense product on the dequantized weight (cpu_gemm.dense_linear: the
  column-major `F.linear` (kernels/cpu_linear.py) below PACKED_MIN_ROWS rows, oneDNN's packed fp32 product from there), fp32 x

The kernels alternate within each repeat (a busy machine slows all of them alike); medians are
printed, as ms for the 120 layers and GB/s of the bytes each kernel's weights occupy.

    python benchmarks/bench_cpu_q4.py --threads 2 --rows 1 2 4 8 --kinds q4 q4bf int4 dnnbf
    python benchmarks/bench_cpu_q4.py --threads 2 --rows 1 --kinds q4 q4pf0 q4pf1024 --type Q4_0
    python benchmarks/bench_cpu_q4.py --threads 2 --rows 16 64 256 --kinds vnnibf dnnbf --repeats 7
    python benchmarks/bench_cpu_q4.py --rows 1 2 4 8 --repeats 3 --accuracy   (errors against x @ dequant(W)^T)
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_cpu_q4.py --threads 2 \
        --rows 1 2 4 8 16 64 256 --kinds vnni q4 int4 dnn   (the AVX2 kind, emulated: utils/device.py)
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_cpu_q4.py --threads 2 \
        --rows 1 2 4 8 12 --kinds q4 int4f dense      (the AVX2 kind's fp32 engine, emulated)

Prints one line per row count and a final JSON line.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_cpu_gemm import LAYER_SHAPES, NUM_LAYERS, _dnn, median  # noqa: E402
from nanovllm.kernels import cpu_gemm, cpu_gguf_q4, cpu_gguf_vnni, cpu_int4  # noqa: E402
from nanovllm.utils import cpp_compiler  # noqa: E402
from nanovllm.utils.dequant import dequantize  # noqa: E402


def random_gguf(out_features: int, in_features: int, type_name: str, gen: torch.Generator) -> torch.Tensor:
    """Random GGUF rows [out, bytes] uint8: random nibbles, scales d ~ U(0, 0.004) (SmolLM2-like
    weights of |w| < ~0.05), Q4_1 mins m = -8 d +- a little."""
    blocks = out_features * in_features // 32
    raw = torch.randint(0, 256, (blocks, cpu_gguf_q4.GGUF_BLOCK_BYTES[type_name]), dtype=torch.uint8, generator=gen)
    d = torch.rand(blocks, generator=gen) * 0.004
    f16 = [d] if type_name == "Q4_0" else [d, -8 * d + (torch.rand(blocks, generator=gen) - 0.5) * 0.002]
    raw[:, :2 * len(f16)] = torch.stack(f16, -1).to(torch.float16).view(torch.uint8)
    return raw.reshape(out_features, -1)


def _q4_prefetched(prefetch: int, type_name: str):
    """q4_linear's call with the kernel built for `prefetch` bytes (fp32 x)."""
    saved, cpu_gguf_q4.PREFETCH_BYTES = cpu_gguf_q4.PREFETCH_BYTES, prefetch
    fn = cpp_compiler.build(cpu_gguf_q4.source_for(torch.float32, type_name),
                            [t.format(t="float") for t in cpu_gguf_q4._ARG_TYPES])
    cpu_gguf_q4.PREFETCH_BYTES = saved
    assert fn is not None, "no C++ compiler"

    def linear(x, p):
        y = torch.empty(x.shape[0], p.out_features, dtype=x.dtype)
        fn(x.contiguous(), p.data, y, x.shape[0], p.out_features, p.in_features, torch.get_num_threads())
        return y
    return linear


def prepare(kind: str, raws: list[torch.Tensor], type_name: str):
    """(weights in `kind`'s form, product fn, bf16 x?, weight bytes)."""
    if kind.startswith("q4"):
        packs = [cpu_gguf_q4.pack(r, type_name) for r in raws]
        assert all(p is not None for p in packs), "no C++ compiler"
        fn = _q4_prefetched(int(kind[4:]), type_name) if kind.startswith("q4pf") else cpu_gguf_q4.q4_linear
        return packs, fn, kind == "q4bf", sum(p.data.nbytes for p in packs)
    if kind.startswith("vnni"):
        packs = [cpu_gguf_vnni.pack(r, type_name) for r in raws]
        assert all(p is not None for p in packs), "no AVX512-VNNI nor AVX2, or no C++ compiler"
        fn = cpu_gguf_vnni.vnni_linear
        bf16 = kind.startswith("vnnibf")
        tile = kind[len("vnnibf" if bf16 else "vnni"):]
        if tile:  # vnniMxG / vnnibfMxG: another register tile
            tile_m, tile_g = (int(v) for v in tile.split("x"))
            built = cpu_gguf_vnni._build(torch.bfloat16 if bf16 else torch.float32, type_name, tile_m, tile_g)

            def fn(x, p, built=built):
                y = torch.empty(x.shape[0], p.out_features, dtype=x.dtype)
                built(x.contiguous(), p.data, y, x.shape[0], p.out_features, p.in_features, torch.get_num_threads())
                return y
        return packs, fn, bf16, sum(p.data.nbytes for p in packs)
    if kind in ("int4", "int4f"):
        packs = [cpu_int4.pack_int4(*cpu_int4.gguf_int4_affine(r, type_name), torch.bfloat16) for r in raws]
        weight_bytes = sum(a.nbytes + b.nbytes for a, b in packs)
        return packs, lambda x, w: cpu_int4.int4_linear(x, *w), kind == "int4", weight_bytes
    if kind == "dnnbf":
        ws = [cpu_gemm.pack(_dequantized(r, type_name).to(torch.bfloat16)) for r in raws]
        return ws, _dnn, True, sum(2 * o * i for o, i in LAYER_SHAPES) * NUM_LAYERS
    if kind == "dnn":
        ws = [cpu_gemm.pack(_dequantized(r, type_name)) for r in raws]
        return ws, _dnn, False, sum(4 * o * i for o, i in LAYER_SHAPES) * NUM_LAYERS
    if kind == "dense":
        ws = [(w.t().contiguous().t(), cpu_gemm.pack(w)) for w in (_dequantized(r, type_name) for r in raws)]
        return ws, lambda x, w: cpu_gemm.dense_linear(x, w[0], None, w[1]), False, \
            sum(4 * o * i for o, i in LAYER_SHAPES) * NUM_LAYERS
    raise ValueError(f"unknown kind {kind!r}")


def _dequantized(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """raw GGUF rows -> [out, in] fp32."""
    return dequantize(raw.reshape(-1), type_name, (raw.shape[0], raw.shape[1] // cpu_gguf_q4.GGUF_BLOCK_BYTES[type_name] * 32))


def accuracy(kinds: dict, raws: list[torch.Tensor], type_name: str, rows: int, gen: torch.Generator) -> dict:
    """Per kind, the largest max|y - ref| / max|ref| over the 120 layers, ref = x @ dequant(W)^T in
    fp32 on the same x values (bf16 kinds: x rounded to bf16 first)."""
    worst = dict.fromkeys(kinds, 0.0)
    for layer, (raw, (_, i)) in enumerate(zip(raws, LAYER_SHAPES * NUM_LAYERS)):
        w = _dequantized(raw, type_name)                           # [out, in]
        x = torch.randn(rows, i, generator=gen)                    # [rows, in]
        for kind, (ws, fn, bf16, _) in kinds.items():
            xk = x.to(torch.bfloat16) if bf16 else x
            ref = xk.float() @ w.T                                 # [rows, out]
            err = (fn(xk, ws[layer]).float() - ref).abs().max() / ref.abs().max()
            worst[kind] = max(worst[kind], float(err))
    return worst


@torch.inference_mode()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--kinds", nargs="+", default=["q4", "q4bf", "int4", "dnnbf"])
    ap.add_argument("--type", default="Q4_1", choices=sorted(cpu_gguf_q4.Q4_TYPES))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--accuracy", action="store_true", help="also print each kind's largest relative error")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    raws = [random_gguf(o, i, args.type, gen) for _ in range(NUM_LAYERS) for o, i in LAYER_SHAPES]
    kinds = {k: prepare(k, raws, args.type) for k in args.kinds}
    result = dict(bench="cpu_q4", type=args.type, threads=torch.get_num_threads(),
                  load_average=" ".join(f"{x:.2f}" for x in os.getloadavg()), ms={}, gb_s={})
    for rows in args.rows:
        xs = {i: torch.randn(rows, i, generator=gen) for i in {s[1] for s in LAYER_SHAPES}}
        xsbf = {i: x.to(torch.bfloat16) for i, x in xs.items()}
        times = {k: [] for k in kinds}
        for _ in range(args.repeats):
            for kind, (ws, fn, bf16, _) in kinds.items():
                x = xsbf if bf16 else xs
                start = time.perf_counter()
                for w, (_, i) in zip(ws, LAYER_SHAPES * NUM_LAYERS):
                    fn(x[i], w)
                times[kind].append(time.perf_counter() - start)
        ms = {k: median(v) * 1e3 for k, v in times.items()}
        result["ms"][rows] = {k: round(v, 2) for k, v in ms.items()}
        result["gb_s"][rows] = {k: round(kinds[k][3] / v / 1e6, 1) for k, v in ms.items()}
        print(f"{rows:>3} rows  " + "  ".join(f"{k}: {v:6.2f} ms {result['gb_s'][rows][k]:5.1f} GB/s"
                                         for k, v in ms.items()), flush=True)
        if args.accuracy:
            errors = accuracy(kinds, raws, args.type, rows, gen)
            result.setdefault("max_rel_error", {})[rows] = {k: float(f"{v:.2e}") for k, v in errors.items()}
            print(f"{'':>11}max |y - ref| / max |ref| over the layers: "
                  + "  ".join(f"{k}: {v:.1e}" for k, v in errors.items()), flush=True)
    result["load_average_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
