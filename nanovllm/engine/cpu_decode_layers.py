"""The decoder layers of a CPU decode step, called straight through to their kernels.

At one sequence a CPU decode step of SmolLM2-135M spent about as long in Python as in its
kernels (benchmarks/RESULTS.md "Eighteenth session"): each layer's dozen module calls, the
dispatch in front of every kernel (which device, compiled or not, which kernel applies) and
the attribute lookups between them. Where every layer of a model takes, at each decode step,
the path that step takes on this CPU anyway (the C++ RoPE + K/V store and paged decode
kernels of kernels/, the RMSNorm and SiLU-and-mul of kernels/fused_ops.py, and the layer's
own linear method), `DecodeLayers` calls the same functions in the same order with the same
arguments, so a step gives the same bits; what it leaves out is the modules and the choosing
in front of the kernels, done once at start-up (`build`) and once a step.
Prefill and mixed steps, and engines it does not apply to, run the modules as before.

It is the CPU's counterpart of the GPU's CUDA graphs, not a second model: the layers'
tensors are the modules' own, read at each step (the KV caches are attached after start-up).
At a few rows a step goes further: a `StepPlan` per row count (engine/cpu_decode_plan.py) binds
each layer's built kernels, weights and output buffers once and calls them with no checks.
"""
import torch
from torch import nn

from nanovllm.engine import cpu_decode_plan
from nanovllm.kernels import cpu_attn, cpu_decode_mirror, cpu_paged_decode, cpu_small_ops, fused_ops
from nanovllm.layers.attention import Attention
from nanovllm.models.decoder import DecoderLayer, DecoderMLP, run_decoder_layers
from nanovllm.utils.context import get_context

# Off: every step runs the modules (an A/B switch for benchmarks and tests; the outputs are the same).
ENABLED = True


def build(model: nn.Module, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> "DecodeLayers | None":
    """A `DecodeLayers` for `model` on the CPU, or None where one of its layers would take
    another path (the per-layer conditions of `_why_not`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not ENABLED or not layers or Attention.backend is not cpu_attn:
        return None
    head_dim = layers[0].self_attn.head_dim
    kernel = cpu_paged_decode.kernel_for(dtype, kv_cache_dtype, head_dim)
    if kernel is None or not cpu_small_ops.prepare(dtype, head_dim) or any(_why_not(layer) for layer in layers):
        return None
    return DecodeLayers(dtype, kv_cache_dtype, head_dim, kernel)


def _why_not(layer: nn.Module) -> str | None:
    """Why a layer's decode step would not take the kernels DecodeLayers calls, or None."""
    if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, DecoderMLP):
        return "not a dense decoder layer"
    attn = layer.self_attn
    if hasattr(attn, "q_norm"):
        return "q/k RMSNorm before RoPE (the C++ RoPE + store does not take it)"
    if attn.qkv_proj.tp_size > 1:
        return "tensor parallel (all-reduces between the products)"
    if any(getattr(m, "quantized_output", False) for m in (layer.input_layernorm, layer.post_attention_layernorm,
                                                             layer.mlp.act_fn)):
        return "fp8 activations"
    return None


class DecodeLayers:
    """`run_layers` (DecoderModel.forward's argument) for decode-only steps; other steps, and a
    step whose tensors the kernels do not take, go to the modules (`run_decoder_layers`)."""

    def __init__(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, head_dim: int, kernel):
        """`kernel`: the C++ paged decode kernel for these dtypes and head size (cpu_paged_decode.kernel_for)."""
        self.dtype, self.kv_cache_dtype, self.head_dim, self.kernel = dtype, kv_cache_dtype, head_dim, kernel
        # rows -> the StepPlan for that many rows, or None where its own path runs; None: no plans
        self.plans: dict[int, cpu_decode_plan.StepPlan | None] | None = {} if cpu_decode_plan.ENABLED else None

    def __call__(self, layers, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        ctx = get_context()
        attn = layers[0].self_attn.attn
        if not (ctx.is_decode_only and residual is None and hidden.dtype == self.dtype and hidden.is_contiguous()
                and attn.k_cache.dtype == self.kv_cache_dtype and attn.k_cache.dim() == 4
                and attn.kv_amax is None and not torch.compiler.is_compiling()):
            return run_decoder_layers(layers, positions, hidden, residual)
        step = cpu_paged_decode.DecodeStep(self.kernel, attn.k_cache, ctx.seq_lens_k, ctx.block_tables,
                                           attn.scale, cpu_decode_mirror.longest(ctx.seq_lens_k))
        positions = positions.to(torch.int64).contiguous()      # [num_seqs]
        slots = ctx.slot_mapping.to(torch.int64).contiguous()   # [num_seqs]
        plan = self._plan(layers, hidden.shape[0])
        if plan is not None:
            return plan(step, positions, slots, hidden)
        cos_sin = layers[0].self_attn.rotary_emb.cos_sin_cache  # [max_position, d] float32
        for layer in layers:
            hidden, residual = self._layer(layer, step, positions, slots, cos_sin, hidden, residual)
        return hidden, residual

    def _plan(self, layers, rows: int) -> "cpu_decode_plan.StepPlan | None":
        """The StepPlan for `rows` rows (made at the first step with that many, again if the caches
        changed), or None where this class's own path runs."""
        if self.plans is None:
            return None
        plan = self.plans.get(rows, False)
        if plan is False or (plan is not None and not plan.applies(layers)):
            plan = self.plans[rows] = cpu_decode_plan.plan_for(layers, rows, self.dtype, self.head_dim)
        return plan

    def _layer(self, layer: DecoderLayer, step: "cpu_paged_decode.DecodeStep", positions: torch.Tensor,
               slots: torch.Tensor, cos_sin: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        """DecoderLayer.forward's arithmetic for one decode step: hidden [num_seqs, hidden_size]."""
        attn, mlp = layer.self_attn, layer.mlp
        if residual is None:
            hidden, residual = _rms_norm(layer.input_layernorm, hidden), hidden
        else:
            hidden, residual = _rms_norm(layer.input_layernorm, hidden, residual)
        qkv = _linear(attn.qkv_proj, hidden)  # [num_seqs, (heads + 2 kv_heads) d]
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        q = q.view(-1, attn.num_heads, self.head_dim)
        k = k.view(-1, attn.num_kv_heads, self.head_dim)
        v = v.view(-1, attn.num_kv_heads, self.head_dim)
        cache = attn.attn
        if cpu_small_ops.rope_store_applies(q, k, v, cache.k_cache):
            cpu_small_ops.rope_store(q, k, v, positions, cos_sin, cache.k_cache, cache.v_cache, slots)
            o = step(q, cache.k_cache, cache.v_cache).flatten(1)  # [num_seqs, heads * d]
            hidden = layer.scaled_branch(_linear(attn.o_proj, o))
        else:  # (the C++ RoPE + store switched off since start-up) the modules' path from q/k/v on
            hidden = layer.scaled_branch(attn.attend(positions, qkv))
        hidden, residual = _rms_norm(layer.post_attention_layernorm, hidden, residual)
        act = fused_ops.silu_and_mul(_linear(mlp.gate_up_proj, hidden))  # [num_seqs, intermediate]
        return layer.scaled_branch(_linear(mlp.down_proj, act)), residual


def _rms_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None):
    """RMSNorm.forward's norm (with the residual add before it): the C++ one in bf16 and fp16."""
    return fused_ops.rms_norm(x, norm.weight, norm.eps, residual)


def _linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's product by its own method (one rank: no all-reduce)."""
    return layer.quant_method.apply(layer, x, layer.bias)
