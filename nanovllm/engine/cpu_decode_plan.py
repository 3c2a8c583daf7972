"""A few-row CPU decode step's layers bound once to their built kernels: what is left of the host's share.

`DecodeLayers` (engine/cpu_decode_layers.py) calls each layer's kernels without the modules, but
every call still goes through the checks and the dispatch in front of its kernel (the Q4
product's shape, dtype and `is_compiling` checks, the `_build` look-ups, `.contiguous()`,
`rope_store_applies`), a `torch.empty` for its output and the layer's `nn.Module` attribute
look-ups: at one sequence of SmolLM2-135M about 3 ms of a 9 ms step (nine kernel calls a layer, 270
calls a step). A `StepPlan` does that once, for one row count, at the first decode step with that
many rows: for every layer the functions `utils/cpp_compiler.build` returned (the C++ RMSNorm,
RoPE + K/V store, paged decode attention, SiLU-and-mul, and the Q4 product where the layer's
own method would run it) with the layer's weights, sizes and cache strides, and output buffers
that all layers share (each is read before the next layer writes it), as the GPU's CUDA graphs
keep static buffers. It calls the same functions with the same arguments in the same order as
DecodeLayers' path, so a step gives the same bits. A product the Q4 kernel does not run at this
row count is called through its layer's own method (`_MethodProduct`). One sequence of the
embedded SmolLM2 GGUF, two engines alternating in one process: decode steps 6.06 against 9.11 ms
(median) with and without plans, the same ids and logprobs (benchmarks/RESULTS.md "One-sequence
decode steps: host time (nineteenth session)").

A plan is made only where all of that holds at start-up of the plan (`plan_for`: fp32, bf16 or
fp16; RoPE + store applying to the qkv rows; no Granite branch scale); elsewhere DecodeLayers runs
its own path. Its RMSNorm is the one DecodeLayers' path runs (fused_ops.rms_norm): the C++ one in
bf16 and fp16, torch's `F.rms_norm` in fp32 (`_torch_rms_norm`, into the same buffers), so fp32
steps give the same bits too; fp32 is the dtype of engines on CPUs without fast bf16 (the AVX2
kind, utils/device.resolve_dtype). The caches' tensors are checked at each step (a plan
made for other caches is made again).
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels import cpu_gguf_q4, cpu_paged_decode, cpu_small_ops

# Off: DecodeLayers runs its own path at every row count (an A/B switch for benchmarks and tests;
# the outputs are the same). Read when an engine's DecodeLayers is made (cpu_decode_layers.build).
ENABLED = True
# The most rows a plan is made for: the host's share of a step matters at a few rows (one
# sequence: about a third of it without plans); larger batches keep DecodeLayers' path.
MAX_ROWS = 8
# Dtypes a plan is made for; the RMSNorm of those in C_RMS_NORM_DTYPES is the C++ one, fp32's is
# torch's F.rms_norm (fused_ops.rms_norm keeps it for fp32).
PLAN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
C_RMS_NORM_DTYPES = (torch.bfloat16, torch.float16)


def _torch_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, normed: torch.Tensor,
                    summed: torch.Tensor, rows: int, width: int, add_residual: int, eps: float, threads: int) -> None:
    """The C++ rms_norm's call (cpu_small_ops.cpp) with fused_ops.rms_norm's fp32 arithmetic: `summed`
    = x + residual (where `add_residual`), `normed` = F.rms_norm of it; x, residual [rows, width]."""
    if add_residual:
        torch.add(x, residual, out=summed)
        x = summed
    normed.copy_(F.rms_norm(x, (width,), weight, eps))


class _Q4Product:
    """x [rows, in] @ W^T -> `out` [rows, out], by the Q4 kernel's built function (what
    cpu_gguf_q4.q4_linear calls, without its checks and its `torch.empty`)."""

    def __init__(self, fn, packed: "cpu_gguf_q4.PackedQ4", out: torch.Tensor):
        self.fn, self.data, self.out = fn, packed.data, out
        self.out_features, self.in_features = packed.out_features, packed.in_features

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        self.fn(x, self.data, self.out, x.shape[0], self.out_features, self.in_features, threads)
        return self.out


class _MethodProduct:
    """A linear layer's product by its own method (one rank: no all-reduce), into a new tensor."""

    def __init__(self, layer: nn.Module):
        self.apply, self.layer, self.bias = layer.quant_method.apply, layer, layer.bias

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        return self.apply(self.layer, x, self.bias).contiguous()


def _product(layer: nn.Module, rows: int, dtype: torch.dtype, out: torch.Tensor):
    """The Q4 kernel bound to `layer`'s weight where its method runs it at `rows` rows of a decode step
    (as GGUFLinearMethod.apply chooses), else the method itself."""
    method = layer.quant_method
    packed = getattr(method, "q4", None)
    max_rows = min(getattr(method, "max_q4_rows", 0), cpu_gguf_q4.MAX_ROWS)  # (one call of the C++: MAX_ROWS at most)
    # (a method with a Q4 pack is GGUFLinearMethod: its decode batches may run the VNNI kernel first)
    if packed is not None and layer.bias is None and rows <= max_rows and not method.runs_vnni(rows, decode=True):
        fn = cpu_gguf_q4.function(dtype, packed.type_name)
        if fn is not None:
            return _Q4Product(fn, packed, out)
    return _MethodProduct(layer)


class _LayerPlan:
    """One layer's bound calls: its norms' weights and eps, its products, its caches and strides."""

    def __init__(self, layer: nn.Module, rows: int, dtype: torch.dtype, bufs: "_Buffers"):
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1_weight, self.norm1_eps = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.norm2_weight, self.norm2_eps = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self.qkv = _product(attn.qkv_proj, rows, dtype, bufs.qkv)
        self.o = _product(attn.o_proj, rows, dtype, bufs.branch)
        self.gate_up = _product(mlp.gate_up_proj, rows, dtype, bufs.gate_up)
        self.down = _product(mlp.down_proj, rows, dtype, bufs.branch)
        self.k_cache, self.v_cache = attn.attn.k_cache, attn.attn.v_cache  # [blocks, block_size, kv_heads, d]
        self.cache_strides = (*self.k_cache.stride()[:3], *self.v_cache.stride()[:3])


class _Buffers:
    """The step's intermediate tensors at `rows` rows, shared by all layers."""

    def __init__(self, rows: int, hidden: int, q_size: int, kv_size: int, intermediate: int, dtype: torch.dtype):
        def empty(width: int) -> torch.Tensor:
            return torch.empty(rows, width, dtype=dtype)
        self.normed = empty(hidden)                    # [rows, hidden] an RMSNorm's output
        self.residual = (empty(hidden), empty(hidden))  # [rows, hidden] the running sum, two in turn
        self.qkv = empty(q_size + 2 * kv_size)         # [rows, q | k | v]
        self.q = empty(q_size)                         # [rows, heads * d] q alone, contiguous
        self.attn = empty(q_size)                      # [rows, heads * d] attention's output
        self.branch = empty(hidden)                    # [rows, hidden] o's and down's output
        self.gate_up = empty(2 * intermediate)         # [rows, gate | up]
        self.act = empty(intermediate)                 # [rows, intermediate] SiLU(gate) * up


class StepPlan:
    """Every layer of a decode step of `rows` rows as calls of built functions (module docstring).
    Made by `plan_for`; called with each step's embedding output and that step's tables."""

    def __init__(self, layers: nn.ModuleList, rows: int, dtype: torch.dtype, head_dim: int):
        attn0 = layers[0].self_attn
        self.rows, self.head_dim = rows, head_dim
        self.num_heads, self.num_kv_heads, self.q_size = attn0.num_heads, attn0.num_kv_heads, attn0.q_size
        hidden = layers[0].input_layernorm.weight.shape[0]
        intermediate = layers[0].mlp.down_proj.input_size
        self.bufs = _Buffers(rows, hidden, attn0.q_size, attn0.kv_size, intermediate, dtype)
        self.rms_norm = cpu_small_ops.function("rms_norm", dtype) if dtype in C_RMS_NORM_DTYPES else _torch_rms_norm
        self.silu_mul = cpu_small_ops.function("silu_mul", dtype)
        self.rope_store = cpu_small_ops.function("rope_store", dtype, head_dim)
        self.cos_sin = attn0.rotary_emb.cos_sin_cache.to(torch.float32).contiguous()  # [max_position, d]
        self.layers = [_LayerPlan(layer, rows, dtype, self.bufs) for layer in layers]
        self.k_cache = self.layers[0].k_cache  # (the plan holds while the caches are these)
        self.block_size = self.k_cache.shape[1]
        # q as a contiguous [rows, heads * d] for the attention kernel: the qkv rows themselves
        # at one row (q is then their first heads * d values), else a copy into bufs.q
        self.q_in_qkv = self.bufs.qkv[:, :attn0.q_size]

    def applies(self, layers: nn.ModuleList) -> bool:
        """Whether the plan still holds for these layers (their caches those it was made with)."""
        return layers[0].self_attn.attn.k_cache is self.k_cache

    def __call__(self, step: "cpu_paged_decode.DecodeStep", positions: torch.Tensor, slots: torch.Tensor,
                 hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [rows, hidden] (the embedding's output); positions, slots [rows] int64 contiguous.
        Returns the last layer's (hidden, residual), in the plan's buffers (valid until its next call)."""
        b, rows, threads = self.bufs, self.rows, step.threads
        width = hidden.shape[1]
        qkv_stride = b.qkv.stride(0)
        q = b.qkv if rows == 1 else b.q
        partials = step.scratch(self.num_heads, self.head_dim)
        residual, turn = hidden, 0
        for i, lp in enumerate(self.layers):
            if i == 0:   # no residual yet: norm(x), the sum is x itself
                self.rms_norm(hidden, hidden, lp.norm1_weight, b.normed, b.normed, rows, width, 0, lp.norm1_eps,
                              threads)
            else:        # norm(x + residual); the sum into the other residual buffer
                residual, turn = self._add_norm(hidden, residual, turn, lp.norm1_weight, lp.norm1_eps, threads)
            qkv = lp.qkv(b.normed, threads)  # [rows, q | k | v]
            if qkv is not b.qkv:             # (a method's product: a new tensor)
                b.qkv.copy_(qkv)
            self.rope_store(b.qkv, positions, self.cos_sin, lp.k_cache, lp.v_cache, slots, rows, qkv_stride,
                            self.num_heads, self.num_kv_heads, self.block_size, *lp.cache_strides, threads)
            if rows > 1:
                b.q.copy_(self.q_in_qkv)
            step.kernel(q, lp.k_cache, lp.v_cache, step.tables, step.lens, b.attn, partials, rows, self.num_heads,
                        self.num_kv_heads, self.head_dim, self.block_size, step.tables.shape[1], *lp.cache_strides,
                        step.part_len, step.num_parts, step.scale, threads)
            hidden = lp.o(b.attn, threads)   # [rows, hidden]
            residual, turn = self._add_norm(hidden, residual, turn, lp.norm2_weight, lp.norm2_eps, threads)
            gate_up = lp.gate_up(b.normed, threads)  # [rows, 2 intermediate]
            self.silu_mul(gate_up, b.act, rows, b.act.shape[1], threads)
            hidden = lp.down(b.act, threads)  # [rows, hidden]
        return hidden, residual

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, turn: int, weight: torch.Tensor, eps: float,
                  threads: int) -> tuple[torch.Tensor, int]:
        """norm(x + residual) into bufs.normed, x + residual into the residual buffer not read now;
        returns (that buffer, the next turn)."""
        summed = self.bufs.residual[turn]
        self.rms_norm(x, residual, weight, self.bufs.normed, summed, self.rows, x.shape[1], 1, eps, threads)
        return summed, 1 - turn


def plan_for(layers: nn.ModuleList, rows: int, dtype: torch.dtype, head_dim: int) -> StepPlan | None:
    """A StepPlan for `rows` rows, or None where DecodeLayers' own path should run (module docstring)."""
    if rows > MAX_ROWS or dtype not in PLAN_DTYPES:
        return None
    if any(layer.residual_multiplier != 1.0 for layer in layers):
        return None
    if dtype in C_RMS_NORM_DTYPES and cpu_small_ops.function("rms_norm", dtype) is None:
        return None
    norms = [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if dtype not in C_RMS_NORM_DTYPES and any(norm.weight.dtype != dtype for norm in norms):
        return None  # (fused_ops' fp32 RMSNorm is F.rms_norm only with an fp32 weight)
    if cpu_small_ops.function("silu_mul", dtype) is None:
        return None
    if not cpu_small_ops.rope_store_built(dtype, head_dim):
        return None
    plan = StepPlan(layers, rows, dtype, head_dim)
    attn0 = layers[0].self_attn
    q, k, v = plan.bufs.qkv.split([attn0.q_size, attn0.kv_size, attn0.kv_size], -1)
    views = (q.view(rows, attn0.num_heads, head_dim), k.view(rows, attn0.num_kv_heads, head_dim),
             v.view(rows, attn0.num_kv_heads, head_dim))
    if not all(cpu_small_ops.rope_store_applies(*views, lp.k_cache) for lp in plan.layers):
        return None
    return plan
