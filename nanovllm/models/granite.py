"""Granite (IBM Granite 3.x dense): Llama's layers with four scalars from its config
(ModelConfig: embedding, residual and attention multipliers, logits scaling)."""
from nanovllm.models.decoder import DecoderForCausalLM


class GraniteForCausalLM(DecoderForCausalLM):
    pass
