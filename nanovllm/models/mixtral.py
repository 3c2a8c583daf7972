"""Mixtral (8x7B, 8x22B): Mistral's attention, every layer sparse (top-2 of 8 experts,
renormalized). Its checkpoints name the block `block_sparse_moe` and the experts' gate,
down and up projections w1, w2, w3; they load into the same packed experts as Qwen3-MoE's."""
from nanovllm.models.decoder import DecoderForCausalLM


class MixtralForCausalLM(DecoderForCausalLM):
    def split_checkpoint_tensor(self, name: str, tensor) -> list[tuple[str, object]]:
        return [(name.replace(".block_sparse_moe.", ".mlp."), tensor)]
