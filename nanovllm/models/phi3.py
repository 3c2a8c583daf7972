"""Phi-3 (mini/medium, 4k context): Llama's layers; its checkpoints store q/k/v and
gate/up fused, split here at load so that each part is sharded like Llama's. The 128k
variants' longrope scaling is refused (ModelConfig for HF configs, the GGUF loader for
files)."""
import torch

from nanovllm.layers.linear import read_whole
from nanovllm.model_config import ModelConfig
from nanovllm.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig, max_position: int):
        super().__init__(cfg, max_position)
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        # fused checkpoint fragment -> its parts (Llama's fragment, rows) in order
        self.fused_parts = {
            "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
            "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)),
        }

    def split_checkpoint_tensor(self, name: str, tensor) -> list[tuple[str, object]]:
        for fused, parts in self.fused_parts.items():
            if f".{fused}." in name:
                whole: torch.Tensor = read_whole(tensor)  # [sum of the parts' rows, in_features]
                sizes = [rows for _, rows in parts]
                if whole.shape[0] != sum(sizes):
                    raise ValueError(f"checkpoint tensor {name!r} has {whole.shape[0]} rows; this config's "
                                     f"{' + '.join(part for part, _ in parts)} need {sum(sizes)}")
                pieces = whole.split(sizes)
                return [(name.replace(f".{fused}.", f".{part}."), piece) for (part, _), piece in zip(parts, pieces)]
        return [(name, tensor)]
