"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention; sparse layers route each
token to num_experts_per_tok of num_experts experts (top-k weights renormalized when
norm_topk_prob), dense layers (mlp_only_layers, decoder_sparse_step) keep Qwen3's MLP."""
from nanovllm.models.decoder import DecoderForCausalLM


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    pass
