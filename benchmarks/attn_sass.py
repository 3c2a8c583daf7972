"""The paged-attention kernel compiled for a GPU without one: shared memory, registers and
the machine code of its main loop (its barriers, and the shared-memory bytes it moves a tile,
summed from its load/store instructions), per cache dtype and tile.

`triton.compile` runs the whole NVIDIA pipeline (TTGIR, PTX, ptxas) on any machine with
Triton's bundled CUDA tools, so a kernel change can be read before device time is spent on
it: how the fp8 decode tile read its V tile a byte at a time (`ld.shared.b8`) was found this
way (benchmarks/RESULTS.md, "FP8 KV at B1"). Install the device's Triton beside it (e.g.
`pip install --target /tmp/tr triton==3.6.0`, then `PYTHONPATH=/tmp/tr`) to see its code.
The shapes are Qwen3-0.6B's decode (16 query heads, 8 KV heads, head_dim 128, block size 16);
`--qpk 4` gives Qwen3-8B's groups (32 query heads on 8 KV heads).

    python benchmarks/attn_sass.py                                # bf16, e4m3, e5m2 at the engine's tiles
    python benchmarks/attn_sass.py --tiles 128/4/3,64/4/5 --kv fp8 --keep /tmp/sass
    python benchmarks/attn_sass.py --kv fp8:vkm --tiles 64/4/3 --maxnreg 128   # key-minor V, capped registers
    python benchmarks/attn_sass.py --kv fp8 --qpk 4 --added-zero   # the fp8 tile before the opaque V cast
    python benchmarks/attn_sass.py --kv fp8,fp8:mma                # fp8 tile against fp8 tensor-core products
    python benchmarks/attn_sass.py --kv auto,fp8 --qpk 4          # Qwen3-8B's groups of 4 query heads
    python benchmarks/attn_sass.py --prefill --tiles 256/64/8/3,128/64/4/3   # prefill: gather vs TMA kernel
    python benchmarks/attn_sass.py --kv auto,fp8 --fused-rope     # decode tiles with the RoPE fused in
    python benchmarks/attn_sass.py --kv fp8 --fma [--fused-rope]  # triton_decode_fma's kernel
    python benchmarks/attn_sass.py --kv fp8,fp8_e5m2 --gluon --qpk 4 --tiles 16,32   # gluon_decode_mma's

`--prefill` compiles the bf16 prefill tiles instead (BLOCK_M/BLOCK_N/warps/stages, default the engine's large
tile), each for `triton_attn`'s gather kernel (pages of 16) and for `triton_prefill_tma`'s (pages of 64), and
counts the TMA copies (UTMALDG), cp.async copies (LDGSTS) and wgmma instructions (HGMMA) in the code.
"""
import argparse
import collections
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels import triton_attn as ta  # noqa: E402
from nanovllm.kernels import triton_prefill_tma as tma  # noqa: E402

KV_POINTER = {"auto": "*bf16", "fp8": "*fp8e4nv", "fp8_e4m3": "*fp8e4nv", "fp8_e5m2": "*fp8e5"}
QPK, HEAD_DIM, PAGE_SIZE = 2, 128, 16  # QPK: query heads per KV head (--qpk)
FLOAT_ARGS = ("scale_log2", "rope_eps")  # the attention kernel's float (not int) run-time scalars
ALIGNED = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_kr", "stride_kh",
           "stride_vb", "stride_vr", "stride_vh", "stride_vd")  # strides Triton sees as multiples of 16 in the engine


def _attention_pointers(kv: str) -> dict:
    """The pointer types of the attention kernels' arguments (`triton_attn._launch_args`, `_rope_args`)
    over a `kv` cache."""
    return dict(out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32", q_ptr="*bf16",
                k_cache_ptr=KV_POINTER[kv], v_cache_ptr=KV_POINTER[kv], cu_seqlens_q_ptr="*i32",
                seq_lens_k_ptr="*i32", block_tables_ptr="*i32", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                k_new_ptr="*bf16", v_new_ptr="*bf16", pos_ptr="*i64", slot_ptr="*i64", cos_sin_ptr="*fp32",
                q_w_ptr="*bf16", k_w_ptr="*bf16")


def _compile(fn, consts: dict, pointers: dict, aligned: tuple, warps: int, stages: int, arch: int,
             maxnreg: int | None = None, source=ASTSource):
    """`fn` for `arch` with these constexprs, pointer (and tensor-descriptor) types and 16-aligned ints
    (`source`: Gluon's GluonASTSource for a Gluon kernel)."""
    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in FLOAT_ARGS else "i32")
                 for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n in aligned or pointers.get(n, "").startswith("*")}
    return triton.compile(source(fn, signature, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg))


def compile_decode(kv: str, block_n: int, warps: int, stages: int, arch: int, v_key_minor: bool = False,
                   maxnreg: int | None = None, fp8_mma: bool = False, pv_mma: bool = False, qpk: int = QPK,
                   opaque_v_cast: bool = True, opaque_k_cast: bool = False, rope: bool = False):
    """The unified kernel's decode tile (fp8_mma: DECODE_FP8_QUERY_QUANT's, both products on the fp8
    tensor cores; pv_mma: DECODE_FP8_PV_MMA's, P V only; opaque_v_cast: DECODE_FP8_OPAQUE_V_CAST's
    form of an fp8 tile, else the added zero; opaque_k_cast: DECODE_FP8_OPAQUE_K_CAST's; rope:
    DECODE_FUSED_ROPE's, with the q/k norm)."""
    fn = ta._unified_attention_kernel
    fp8 = kv != "auto"
    opaque = fp8 and opaque_v_cast and not (v_key_minor or fp8_mma or pv_mma)  # as triton_attn._opaque_casts
    consts = dict(QPK=qpk, QPK_PAD=qpk, BLOCK_Q=ta.MIN_DOT_DIM // qpk, BLOCK_M=ta.MIN_DOT_DIM, BLOCK_N=block_n,
                  HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, IS_SPLIT=False,
                  DOT_PRECISION="tf32", KV_FP8=fp8, FP16_PRODUCTS=fp8, V_KEY_MINOR=v_key_minor,
                  FP8_MMA=fp8_mma, PV_MMA=pv_mma, OPAQUE_V_CAST=opaque, OPAQUE_K_CAST=opaque and opaque_k_cast,
                  ROPE=rope, QK_NORM=rope, OPAQUE_Q=rope, FP8_MAX=448.0 if fp8 else 0.0, Q_TILES_OUTER=False,
                  SCALE_IN_EXP=ta.SOFTMAX_SCALE_IN_EXP, PDL=True)
    # Triton specializes an int argument equal to 1 into a constant: the unit stride of each layout
    consts["stride_vr" if v_key_minor else "stride_vd"] = 1
    return _compile(fn, consts, _attention_pointers(kv), ALIGNED, warps, stages, arch, maxnreg)


def compile_decode_fma(kv: str, arch: int, qpk: int = QPK, rope: bool = False):
    """`triton_decode_fma`'s kernel at the engine's settings (rope: DECODE_FUSED_ROPE's, with the q/k norm)."""
    from nanovllm.kernels import triton_decode_fma as fma
    fp8 = kv != "auto"
    consts = dict(QPK=qpk, BLOCK_N=ta.DECODE_FMA_BLOCK_N, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM, PAGE_SIZE=PAGE_SIZE,
                  IS_SPLIT=False, KV_FP8=fp8, ACC_2D=ta.DECODE_FMA_ACC_2D, PV_FP16=False,
                  LOOP_STAGES=ta.DECODE_FMA_NUM_STAGES, ACC_ROWS=ta.DECODE_FMA_ACC_ROWS, ROPE=rope, QK_NORM=rope,
                  FP8_MAX=448.0 if fp8 else 0.0, PDL=True, stride_vd=1)
    return _compile(fma.decode_fma_kernel, consts, _attention_pointers(kv), ALIGNED[:-1], ta.DECODE_FMA_NUM_WARPS,
                    ta.DECODE_FMA_NUM_STAGES, arch)


def compile_decode_mma(kv: str, arch: int, qpk: int = QPK, block_n: int | None = None, head_dim: int = HEAD_DIM,
                       split: bool = False, rope: bool = False, prefetch: int | None = None):
    """`gluon_decode_mma`'s kernel over a `kv` cache ("auto": bf16), passed as int32 words as
    `triton_attn._decode_mma` passes it (rope: DECODE_FUSED_ROPE's, with the q/k norm)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from nanovllm.kernels import gluon_decode_mma as gdm
    fn = gdm.decode_mma_kernel
    block_n = block_n or ta.DECODE_MMA_BLOCK_N  # (a tile lies in one cache block: pages of at least BLOCK_N)
    consts = dict(QPK=qpk, BLOCK_N=block_n, HEAD_DIM=head_dim, PAGE_SIZE=max(PAGE_SIZE, block_n),
                  PREFETCH=prefetch or ta.DECODE_MMA_PREFETCH,
                  KV_FP8=kv != "auto", E5M2=kv == "fp8_e5m2", IS_SPLIT=split, ROPE=rope, QK_NORM=rope,
                  FP8_MAX=448.0 if kv == "fp8" else 57344.0 if kv == "fp8_e5m2" else 0.0, PDL=True)
    pointers = dict(_attention_pointers(kv), k_cache_ptr="*i32", v_cache_ptr="*i32")
    # no stride_vd (its V rows are contiguous); 1 warp and Triton's default 3 stages, as the engine launches it
    return _compile(fn, consts, pointers, ALIGNED[:-1], 1, 3, arch, source=GluonASTSource)


def compile_prefill(kernel: str, block_m: int, block_n: int, warps: int, stages: int, arch: int, qpk: int = QPK,
                    warp_specialize: bool = False):
    """A bf16 prefill tile: `triton_attn`'s gather kernel over pages of PAGE_SIZE, or ("tma")
    `triton_prefill_tma`'s over pages of its BLOCK_N's smallest multiple of 64 (its loop warp-specialized
    where `warp_specialize`)."""
    common = dict(QPK=qpk, QPK_PAD=qpk, BLOCK_Q=block_m // qpk, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=HEAD_DIM,
                  PDL=True)
    rows = dict(out_ptr="*bf16", q_ptr="*bf16", cu_seqlens_q_ptr="*i32", seq_lens_k_ptr="*i32",
                block_tables_ptr="*i32")
    if kernel == "tma":
        desc = f"tensordesc<bf16[{block_n}, {HEAD_DIM}]>"
        consts = dict(common, PAGE_SIZE=max(64, block_n), LOOP_STAGES=stages, WARP_SPECIALIZE=warp_specialize)
        return _compile(tma._prefill_tma_kernel, consts, dict(rows, k_desc=desc, v_desc=desc),
                        ("stride_qt", "stride_qh", "stride_ot", "stride_oh"), warps, stages, arch)
    consts = dict(common, HEAD_DIM_PAD=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, IS_SPLIT=False, DOT_PRECISION="tf32",
                  KV_FP8=False, FP16_PRODUCTS=False, V_KEY_MINOR=False, FP8_MMA=False, PV_MMA=False,
                  OPAQUE_V_CAST=False, OPAQUE_K_CAST=False, ROPE=False, QK_NORM=False, OPAQUE_Q=False, FP8_MAX=0.0,
                  Q_TILES_OUTER=False, SCALE_IN_EXP=ta.SOFTMAX_SCALE_IN_EXP, stride_vd=1)
    return _compile(ta._unified_attention_kernel, consts, _attention_pointers("auto"), ALIGNED[:-1], warps, stages,
                    arch)


def print_prefill(tiles: str, arch: int, qpk: int, keep: str | None, check_ws: bool = False) -> None:
    """Registers, shared memory, spills and copy/product instruction counts of each prefill tile, both kernels;
    with `check_ws`, whether the TMA tile's warp-specialized loop compiles to other machine code."""
    engine = (ta.PREFILL_LARGE_BLOCK_M, ta.PREFILL_LARGE_BLOCK_N, ta.PREFILL_LARGE_NUM_WARPS,
              ta.PREFILL_LARGE_NUM_STAGES)
    for tile in [tuple(int(x) for x in t.split("/")) for t in tiles.split(",") if t] or [engine]:
        for kernel in ("gather", "tma"):
            name = f"prefill_{kernel}_{'_'.join(map(str, tile))}"
            compiled = compile_prefill(kernel, *tile, arch, qpk)
            sass, usage = sass_of(compiled, keep, name)
            ops = collections.Counter(re.findall(r"\b(UTMALDG|LDGSTS|HGMMA)\b", sass))
            regs = re.search(r"REG:(\d+)", usage)
            spills = len(re.findall(r"\bSTL\b", sass))
            loop = collections.Counter(first_loop(sass))
            loop_local = sum(n for op, n in loop.items() if op.startswith(("STL", "LDL")))
            loop_wgmma = sum(n for op, n in loop.items() if op.startswith("HGMMA"))
            print(f"{name}: registers {regs.group(1) if regs else '?'}, shared {compiled.metadata.shared} B, "
                  f"spill stores {spills}, TMA copies {ops['UTMALDG']}, "
                  f"cp.async {ops['LDGSTS']}, wgmma {ops['HGMMA']}; first loop {sum(loop.values())} instructions, "
                  f"{loop_local} local loads/stores, {loop_wgmma} wgmma")
            if check_ws and kernel == "tma":
                try:
                    ws = compile_prefill(kernel, *tile, arch, qpk, warp_specialize=True)
                except RuntimeError as e:  # Triton's warp-specialization pass may fail on a kernel
                    print(f"   warp-specialized loop: failed to compile ({str(e).splitlines()[0]})")
                    continue
                ws_sass = sass_of(ws, keep, name + "_ws")[0]
                same = ws_sass.replace(name + "_ws", name) == sass
                print(f"   warp-specialized loop: {'the same' if same else 'other'} machine code "
                      f"(TTGIR {'the same' if ws.asm['ttgir'] == compiled.asm['ttgir'] else 'differs'})")


def engine_maxnreg(kv: str, layout: str, opaque_v_cast: bool) -> int | None:
    """The register cap the engine gives this decode tile (triton_attn._tile_config's)."""
    opaque = kv != "auto" and opaque_v_cast and ta.DECODE_FP8_OPAQUE_V_CAST and not layout  # plain layout
    return ta._tile_config(1, QPK, kv != "auto", on_gpu=True, opaque_v_cast=opaque).get("maxnreg")


def sass_of(kernel, keep: str | None, name: str) -> tuple[str, str]:
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    path = os.path.join(keep or "/tmp", f"{name}.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    def cuobjdump(option: str) -> str:
        return subprocess.run([os.path.join(tools, "cuobjdump"), option, path], capture_output=True, text=True).stdout
    sass, usage = cuobjdump("-sass"), cuobjdump("-res-usage")
    if keep:
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(keep, f"{name}.{ext}"), "w") as f:
                f.write(kernel.asm[ext])
        with open(os.path.join(keep, f"{name}.sass"), "w") as f:
            f.write(sass)
    return sass, usage


# bytes one thread moves through shared memory per instruction (cp.async: global -> shared)
SHARED_READ_BYTES = {"LDS.U8": 1, "LDS.U16": 2, "LDS": 4, "LDS.64": 8, "LDS.128": 16,
                     "LDSM.16.M88.2": 8, "LDSM.16.MT88.2": 8, "LDSM.16.M88.4": 16, "LDSM.16.MT88.4": 16}
SHARED_WRITE_BYTES = {"STS.U8": 1, "STS.U16": 2, "STS": 4, "STS.64": 8, "STS.128": 16, "STSM.16.M88.2": 8,
                      "STSM.16.M88.4": 16, "LDGSTS.E": 4, "LDGSTS.E.64": 8, "LDGSTS.E.128": 16,
                      "LDGSTS.E.BYPASS.128": 16}


def shared_traffic(loop: collections.Counter, warps: int) -> tuple[float, float, list[str]]:
    """KB read from and written to shared memory by one program in one pass of the loop (all its
    threads), and the shared-memory opcodes the tables above do not know."""
    def kb(table: dict) -> float:
        return sum(n * table.get(op, 0) for op, n in loop.items()) * 32 * warps / 1024
    known = SHARED_READ_BYTES.keys() | SHARED_WRITE_BYTES.keys()
    unknown = [op for op in loop if op.startswith(("LDS", "STS", "LDGSTS")) and op not in known]
    return kb(SHARED_READ_BYTES), kb(SHARED_WRITE_BYTES), unknown


# opcodes that read or write shared memory (or wait at a barrier for it)
SHARED_OPS = ("LDS", "STS", "LDSM", "STSM", "LDGSTS", "BAR")


def loops(sass: str) -> list[list[str]]:
    """Each loop's opcodes (with modifiers), from the target of a backward branch to that branch, in
    the order the branches appear."""
    rows = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\s*([^;]*);", sass)]
    found = []
    for addr, op, rest in rows:
        target = re.match(r"(0x[0-9a-f]+)", rest)
        if op == "BRA" and target and int(target.group(1), 16) < addr:
            found.append([o for a, o, _ in rows if int(target.group(1), 16) <= a <= addr])
    return found


def first_loop(sass: str) -> list[str]:
    """Opcodes (with modifiers) from the target of the first backward branch to that branch."""
    found = loops(sass)
    return found[0] if found else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="auto,fp8,fp8_e5m2",
                    help="comma list of kv_cache_dtype values; a :vkm suffix compiles for a key-minor V cache, "
                         ":mma for DECODE_FP8_QUERY_QUANT's tile (fp8 products, key-minor V), :pv for DECODE_FP8_PV_MMA's")
    ap.add_argument("--tiles", default="",
                    help="comma list of BLOCK_N/warps/stages (default: the engine's)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--maxnreg", type=int, default=None,
                    help="cap on registers per thread (ptxas spills past it); 0: none; default: the engine's for the tile")
    ap.add_argument("--added-zero", action="store_true",
                    help="fp8 tiles with the added zero instead of DECODE_FP8_OPAQUE_V_CAST's identity")
    ap.add_argument("--opaque-k", action="store_true", help="fp8 tiles with K behind the identity too")
    ap.add_argument("--qpk", type=int, default=QPK, help="query heads per KV head (2: Qwen3-0.6B, 4: Qwen3-8B)")
    ap.add_argument("--keep", metavar="DIR", help="also write each variant's TTGIR, PTX, SASS there")
    ap.add_argument("--fused-rope", action="store_true", help="decode tiles with DECODE_FUSED_ROPE's q/k norm + RoPE")
    ap.add_argument("--fma", action="store_true", help="triton_decode_fma's kernel instead of the decode tile")
    ap.add_argument("--gluon", action="store_true",
                    help="gluon_decode_mma's kernel instead (--tiles: its BLOCK_N values; --split: its split variant)")
    ap.add_argument("--split", action="store_true", help="with --gluon: the split-KV variant")
    ap.add_argument("--head-dim", type=int, default=HEAD_DIM, help="with --gluon: the head size")
    ap.add_argument("--prefetch", type=int, default=None, help="with --gluon: tiles its loads run ahead (1 or 2)")
    ap.add_argument("--prefill", action="store_true", help="the prefill tiles (--tiles BLOCK_M/BLOCK_N/warps/stages)")
    ap.add_argument("--check-warp-specialize", action="store_true",
                    help="with --prefill: also compile each TMA tile's loop warp-specialized and compare")
    args = ap.parse_args()
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    print(f"triton {triton.__version__}, sm_{args.arch}")
    if args.prefill:
        print_prefill(args.tiles, args.arch, args.qpk, args.keep, args.check_warp_specialize)
        return
    if args.gluon:
        for kv in args.kv.split(","):
            for block_n in [int(t) for t in args.tiles.split(",") if t] or [ta.DECODE_MMA_BLOCK_N]:
                name = (f"decode_mma_{kv}_q{args.qpk}_d{args.head_dim}_n{block_n}{'_split' if args.split else ''}"
                        f"{'_rope' if args.fused_rope else ''}{f'_p{args.prefetch}' if args.prefetch else ''}")
                kernel = compile_decode_mma(kv, args.arch, args.qpk, block_n, args.head_dim, args.split,
                                            args.fused_rope, args.prefetch)
                sass, usage = sass_of(kernel, args.keep, name)
                regs = re.search(r"REG:(\d+)", usage)
                spills = len(re.findall(r"\bSTL\b", sass))
                for i, loop in enumerate(loops(sass)):
                    ops = collections.Counter(loop)
                    shared = sum(n for op, n in ops.items() if op.startswith(SHARED_OPS))
                    print(f"{name}: registers {regs.group(1) if regs else '?'}, spill stores {spills}, "
                          f"loop {i + 1}: {len(loop)} instructions, {shared} through shared memory")
                    print("   " + " ".join(f"{op}:{n}" for op, n in ops.most_common(14)))
        return
    if args.fma:
        for kv in args.kv.split(","):
            name = f"decode_fma_{kv}{'_rope' if args.fused_rope else ''}"
            kernel = compile_decode_fma(kv, args.arch, args.qpk, args.fused_rope)
            sass, usage = sass_of(kernel, args.keep, name)
            loop = collections.Counter(first_loop(sass))
            regs = re.search(r"REG:(\d+)", usage)
            spills = len(re.findall(r"\bSTL\b", sass))
            print(f"{name}: registers {regs.group(1) if regs else '?'}, shared {kernel.metadata.shared} B, "
                  f"spill stores {spills}, main loop {sum(loop.values())} instructions")
        return
    for spec in args.kv.split(","):
        kv, _, layout = spec.partition(":")
        engine = ((ta.DECODE_FP8_BLOCK_N, ta.DECODE_FP8_NUM_WARPS, ta.DECODE_FP8_NUM_STAGES)
                  if kv != "auto" else (ta.DECODE_BLOCK_N, ta.DECODE_NUM_WARPS, ta.DECODE_NUM_STAGES))
        tiles = [tuple(int(x) for x in t.split("/")) for t in args.tiles.split(",") if t] or [engine]
        for block_n, warps, stages in tiles:
            name = f"decode_{kv}{'_' + layout if layout else ''}_{block_n}_{warps}_{stages}"
            maxnreg = engine_maxnreg(kv, layout, not args.added_zero) if args.maxnreg is None else args.maxnreg or None
            kernel = compile_decode(kv, block_n, warps, stages, args.arch, layout in ("vkm", "mma", "pv"), maxnreg,
                                    layout == "mma", layout == "pv", args.qpk, not args.added_zero,
                                    args.opaque_k, args.fused_rope)
            sass, usage = sass_of(kernel, args.keep, name)
            loop = collections.Counter(first_loop(sass))
            regs = re.search(r"REG:(\d+)", usage)
            spills = len(re.findall(r"\bSTL\b", sass))
            loop_spills = sum(n for op, n in loop.items() if op.startswith(("STL", "LDL")))
            print(f"{name}: shared {kernel.metadata.shared} B, registers {regs.group(1) if regs else '?'}, "
                  f"spill stores {spills} (local loads/stores in the main loop {loop_spills}), "
                  f"ld.shared.b8 {kernel.asm['ptx'].count('ld.shared.b8')}, "
                  f"main loop {sum(loop.values())} instructions, "
                  f"{sum(n for op, n in loop.items() if op.startswith('BAR'))} barriers")
            read, written, unknown = shared_traffic(loop, warps)
            print(f"   shared memory per tile: {read:.1f} KB read, {written:.1f} KB written"
                  + (f" (not counted: {', '.join(unknown)})" if unknown else ""))
            print("   " + " ".join(f"{op}:{n}" for op, n in loop.most_common(16)))


if __name__ == "__main__":
    main()
