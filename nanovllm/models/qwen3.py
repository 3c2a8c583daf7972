"""Qwen3: q/k RMSNorm per head, no qkv bias (flags from ModelConfig)."""
from nanovllm.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    pass
