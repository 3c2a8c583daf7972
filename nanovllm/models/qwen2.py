"""Qwen2 / Qwen2.5: bias on the q/k/v projections (flag from ModelConfig)."""
from nanovllm.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    pass
