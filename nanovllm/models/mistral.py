"""Mistral: Llama's layers and weight names; its sliding window caps the context
(ModelConfig.max_model_len_limit)."""
from nanovllm.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    pass
