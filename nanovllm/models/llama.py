"""Llama 2/3.x and compatible (SmolLM2): optional attention bias, llama3 rope scaling."""
from nanovllm.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
