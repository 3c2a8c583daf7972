"""The decoder-only transformer shared by the Llama, Mistral, Phi-3, Qwen2, Qwen3,
Granite, Qwen3-MoE and Mixtral families.

The families differ only in what `ModelConfig` carries: bias on the q/k/v projections
(Qwen2), RMSNorm on q and k per head (Qwen3), tied embeddings, the RoPE scaling, and
Granite's four scalars, the experts that replace the MLP in a mixture-of-experts
model's sparse layers; and in how a checkpoint names its tensors (Phi-3 fuses some).
Each family file names a subclass for the registry.

A step of one row on the GPU (one sequence's decode) runs `DecoderLayer.forward_one_row`,
the same math in fewer kernel launches, since such a step is bound by its kernels' latency.
"""
import torch
from torch import nn

from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.fused_moe import SparseMoeBlock, map_expert_name
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.quantization.base import is_unquantized
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.model_config import ModelConfig
from nanovllm.utils.context import get_context


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding):
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size)
        self.rotary_emb = rotary_emb  # one for all layers: the same cos/sin table
        scale = d ** -0.5 if cfg.attention_multiplier is None else cfg.attention_multiplier
        self.attn = Attention(self.num_heads, d, scale, self.num_kv_heads)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head_dim = d

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """qkv: [num_tokens, (heads + 2 * kv_heads) * d] -> the attention's output projection,
        [num_tokens, hidden_size]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        store = self.attn.kv_store(v)  # on the GPU, RoPE writes K/V into the cache
        q_norm, k_norm = getattr(self, "q_norm", None), getattr(self, "k_norm", None)
        if store is not None and self.attn.fuses_rope(q):  # the decode kernel does the norm, RoPE and store
            return self.o_proj(self.attn(q, k, v, rope=self.rotary_emb.for_attention(positions, k, q_norm, k_norm,
                                                                                     store)))
        q, k = self.rotary_emb(positions, q, k, q_norm, k_norm, kv_store=store)
        return self.o_proj(self.attn(q, k, v, kv_stored=store is not None))


class DecoderMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, layer: int):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, rotary_emb)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_moe_layer(layer) else DecoderMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = cfg.residual_multiplier
        # unquantized products can take their RMSNorm in (forward_one_row)
        self.dense_qkv = is_unquantized(self.self_attn.qkv_proj)
        self.dense_mlp = isinstance(self.mlp, DecoderMLP) and is_unquantized(self.mlp.gate_up_proj)

    def quantized_input_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(layer, linear) pairs where the linear layer is the only reader of the layer's output, which
        it may then take quantized (layers/quantization/__init__.py): the norms before q/k/v and (in a
        layer without experts) gate/up, and the SiLU-and-mul before down; not o, whose input the
        attention writes."""
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, DecoderMLP):
            pairs += [(self.post_attention_layernorm, self.mlp.gate_up_proj), (self.mlp.act_fn, self.mlp.down_proj)]
        return pairs

    def forward(self, positions, hidden, residual):
        # exactly one row: the fused norm normalizes one row (skinny_norm_linear)
        if self.dense_qkv and hidden.is_cuda and hidden.shape[0] == 1:
            from nanovllm.kernels import triton_skinny_gemm
            if triton_skinny_gemm.applies(hidden, self.self_attn.qkv_proj.weight):
                return self.forward_one_row(positions, hidden, residual)
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.scaled_branch(self.self_attn(positions, hidden))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.scaled_branch(self.mlp(hidden)), residual

    def forward_one_row(self, positions, hidden, residual):
        """`forward` for one row on the GPU in fewer launches (a one-sequence decode is bound by
        its kernels' latency): each RMSNorm runs inside the product after it, and SiLU-and-mul
        inside gate/up (kernels/triton_skinny_gemm.py: rounded where the kernels they replace
        round; the products' sums in another order)."""
        from nanovllm.kernels.triton_skinny_gemm import skinny_norm_linear
        attn, mlp, norm1, norm2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        qkv, residual = skinny_norm_linear(hidden, residual, norm1.weight, norm1.eps, attn.qkv_proj.weight,
                                           attn.qkv_proj.bias)
        hidden = self.scaled_branch(attn.attend(positions, qkv))
        if not self.dense_mlp:
            hidden, residual = norm2(hidden, residual)
            return self.scaled_branch(mlp(hidden)), residual
        act, residual = skinny_norm_linear(hidden, residual, norm2.weight, norm2.eps, mlp.gate_up_proj.weight,
                                           None, gated=True)
        return self.scaled_branch(mlp.down_proj(act)), residual

    def scaled_branch(self, branch: torch.Tensor) -> torch.Tensor:
        """A branch's output as the residual add takes it (Granite scales it)."""
        return branch if self.residual_multiplier == 1.0 else branch * self.residual_multiplier


def run_decoder_layers(layers, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
    """`layers` one after the other; returns their (hidden, residual)."""
    for layer in layers:
        hidden, residual = layer(positions, hidden, residual)
    return hidden, residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        # every layer rotates by the same table ([max_position, head_dim] float32): one copy, and
        # the CPU path looks up a step's cos/sin once for all layers (kernels/step_memo.py)
        rotary_emb = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList([DecoderLayer(cfg, rotary_emb, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embedding_multiplier = cfg.embedding_multiplier

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, run_layers=None) -> torch.Tensor:
        """`run_layers(layers, positions, hidden, residual) -> (hidden, residual)`: how the decoder
        layers run (engine/cpu_compile.py passes its compiled form); None: `run_decoder_layers`."""
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        hidden, residual = (run_layers or run_decoder_layers)(self.layers, positions, hidden, None)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    # checkpoint name fragment -> (packed parameter fragment, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_position: int):
        super().__init__()
        self.model = DecoderModel(cfg, max_position)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.logits_scaling = cfg.logits_scaling
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def split_checkpoint_tensor(self, name: str, tensor) -> list[tuple[str, object]]:
        """The checkpoint tensors `name` stands for: itself here; a family that stores
        several in one tensor returns the parts, under the names they have elsewhere."""
        return [(name, tensor)]

    def map_expert_name(self, name: str) -> tuple[str, object] | None:
        """(packed parameter, shard id) of an expert checkpoint tensor; None for any other."""
        return map_expert_name(name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, run_layers=None) -> torch.Tensor:
        return self.model(input_ids, positions, run_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [num_tokens, hidden] -> logits [num_sampled, vocab] of the rows to sample."""
        indices = get_context().logits_indices
        if indices is not None:
            hidden = hidden[indices]
        return self.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [n, hidden] -> logits [n, vocab], for every row (sampling and prompt
        logprobs alike); None on tensor-parallel ranks other than 0."""
        logits = self.lm_head(hidden)
        if logits is None or self.logits_scaling == 1.0:
            return logits
        return logits / self.logits_scaling
