"""Where a model comes from: an HF directory or a GGUF file.

`ModelSource` resolves a user's `model` argument once: its normalized
`ModelConfig`, its tokenizer, and an iterator over its named weights.
"""
import json
import os
from dataclasses import dataclass

from nanovllm.model_config import ModelConfig


@dataclass(frozen=True)
class ModelSource:
    path: str
    format: str  # "safetensors" or "gguf"

    @classmethod
    def resolve(cls, model: str, load_format: str = "auto") -> "ModelSource":
        if not os.path.exists(model):
            raise ValueError(f"model path {model!r} does not exist (models are loaded from local "
                             "paths: an HF directory or a .gguf file)")
        if os.path.isfile(model) or load_format == "gguf":
            return cls(model, "gguf")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"{model!r} has no config.json: not an HF model directory")
        return cls(model, "safetensors")

    def model_config(self) -> ModelConfig:
        if self.format == "gguf":
            from nanovllm.utils.gguf_loader import gguf_model_config
            return gguf_model_config(self.path)
        hf = _read_json(os.path.join(self.path, "config.json"))
        gen_path = os.path.join(self.path, "generation_config.json")
        gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
        return ModelConfig.from_hf(hf, gen)

    def named_weights(self):
        if self.format == "gguf":
            from nanovllm.utils.gguf_loader import iter_gguf_weights
            return iter_gguf_weights(self.path)
        from nanovllm.utils.loader import iter_safetensors
        return iter_safetensors(self.path)

    def tokenizer(self, tokenizer_path: str | None = None):
        if self.format == "gguf" and tokenizer_path is None:
            from nanovllm.utils.gguf_loader import gguf_tokenizer
            return gguf_tokenizer(self.path)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(tokenizer_path or self.path)


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
