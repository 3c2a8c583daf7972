"""The fixed scales of an fp8 KV cache, set once at start-up.

A cache element is `fp8(x / scale)`; the scales never change while the cache lives,
since a prefix-cache hit reads blocks written long before (`kernels/kv_quant.py`).
Where they come from, in order:

1. the checkpoint's `k_scale` / `v_scale` tensors (one per layer, as vLLM and
   llm-compressor write them), kept by the loader on each `Attention` layer;
2. otherwise a calibration pass at start-up: one prefill of `CALIBRATION_SEQS` sequences
   of `CALIBRATION_SEQ_LEN` pseudo-random tokens (seeded, so every start gives the same
   scales, whatever the token budget; the same for every max_model_len >= the length) on
   a scratch cache in the model dtype, recording max |k| and max |v| of every KV head of
   every layer; scale = amax * SCALE_HEADROOM / fp8_max.

Granularity, measured on SmolLM2-135M (benchmarks/bench_fp8_kv_accuracy.py,
benchmarks/RESULTS.md "FP8 KV cache"): per layer, per tensor (one scale for all layers)
and per KV head were compared by teacher-forced logprob error against the unquantized
cache. fp8 keeps a fixed relative precision over a wide range (e4m3: 3 mantissa bits
from 2^-6 to 448), so the scale only decides where clipping and the subnormals start,
and finer scales gained little; per layer is what checkpoints carry, so it is the one
kept (`GRANULARITY`). Under tensor parallelism the per-layer amax is the max over all
ranks, so every rank quantizes as one rank would.
"""
import torch
from torch import nn

from nanovllm.layers.attention import Attention
from nanovllm.utils.context import Context, set_context

CALIBRATION_SEQS = 4       # one prefill of this many sequences ...
CALIBRATION_SEQ_LEN = 128  # ... of this many tokens (fewer if max_model_len is smaller)
SCALE_HEADROOM = 2.0       # values up to twice the calibration's largest are not clipped
GRANULARITY = "layer"      # "tensor" | "layer" | "head" (see the module docstring)
GRANULARITIES = ("tensor", "layer", "head")


def set_kv_scales(model: nn.Module, layers: list[Attention], cache_dtype: torch.dtype,
                  calibration: dict, device: torch.device, tp_size: int) -> None:
    """Give every layer its `k_scale` / `v_scale` ([num_kv_heads] float32): the checkpoint's
    where every layer has them, else calibrated (`calibration`: `calibrate_kv_amax`'s kwargs)."""
    fp8_max = torch.finfo(cache_dtype).max
    if layers[0].checkpoint_kv_scales is not None:  # the loader saw to it that every layer has them
        for attn in layers:
            k, v = attn.checkpoint_kv_scales
            attn.k_scale = torch.full((attn.num_kv_heads,), k, dtype=torch.float32, device=device)
            attn.v_scale = torch.full((attn.num_kv_heads,), v, dtype=torch.float32, device=device)
        return
    amax = calibrate_kv_amax(model, layers, device=device, **calibration)  # [layers, 2, kv_heads]
    scales = scales_from_amax(amax, GRANULARITY, fp8_max, tp_size)
    for attn, (k, v) in zip(layers, scales):
        attn.k_scale, attn.v_scale = k.contiguous(), v.contiguous()


def scales_from_amax(amax: torch.Tensor, granularity: str, fp8_max: float, tp_size: int = 1) -> torch.Tensor:
    """amax: [layers, 2 (k, v), kv_heads] -> scales of the same shape (equal within a layer
    for "layer", everywhere for "tensor")."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"kv scale granularity must be one of {', '.join(GRANULARITIES)}; got {granularity!r}")
    num_heads = amax.shape[2]
    if granularity == "layer":
        amax = amax.amax(2, keepdim=True)
    elif granularity == "tensor":
        amax = amax.amax((0, 2), keepdim=True).expand(amax.shape[0], -1, 1)
    if granularity != "head" and tp_size > 1:  # one scale for heads that live on other ranks too
        import torch.distributed as dist
        amax = amax.contiguous()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    tiny = torch.finfo(torch.float32).tiny  # a head that only saw zeros: any scale is exact
    scales = amax.clamp_min(tiny) * SCALE_HEADROOM / fp8_max
    return scales.expand(-1, -1, num_heads).contiguous()


@torch.inference_mode()
def calibrate_kv_amax(model: nn.Module, layers: list[Attention], *, device: torch.device,
                      dtype: torch.dtype, block_size: int, max_model_len: int, vocab_size: int,
                      seed: int) -> torch.Tensor:
    """Max |k| and |v| per KV head of every layer over one seeded prefill.

    Returns [num_layers, 2, num_kv_heads] float32. The layers get scratch caches in
    `dtype` for the pass and empty ones after it.
    """
    seq_len = min(CALIBRATION_SEQ_LEN, max_model_len)
    n, blocks_per_seq = CALIBRATION_SEQS * seq_len, -(-seq_len // block_size)
    for attn in layers:
        shape = (CALIBRATION_SEQS * blocks_per_seq, block_size, attn.num_kv_heads, attn.head_dim)
        attn.k_cache = torch.empty(shape, dtype=dtype, device=device)
        attn.v_cache = torch.empty(shape, dtype=dtype, device=device)
        attn.kv_amax = torch.zeros(2, attn.num_kv_heads, dtype=torch.float32, device=device)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(vocab_size, (n,), generator=generator).to(device)
    positions = torch.arange(seq_len, device=device).repeat(CALIBRATION_SEQS)
    tables = torch.arange(CALIBRATION_SEQS * blocks_per_seq, dtype=torch.int32, device=device)
    tables = tables.view(CALIBRATION_SEQS, blocks_per_seq)                  # [seqs, blocks_per_seq]
    slots = (tables[:, :1].long() * block_size + torch.arange(seq_len, device=device)).flatten()
    context = Context(
        slot_mapping=slots, seq_lens_k=torch.full((CALIBRATION_SEQS,), seq_len, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(0, n + 1, seq_len, dtype=torch.int32, device=device),
        block_tables=tables, max_seqlen_q=seq_len, max_seqlen_k=seq_len)
    try:
        with set_context(context):
            model(input_ids, positions)
        return torch.stack([attn.kv_amax for attn in layers])
    finally:
        for attn in layers:
            attn.kv_amax = None
            attn.k_cache = attn.v_cache = torch.tensor([])
