"""Tiny random models of each supported family, saved as HF directories.

Built with HF transformers from a fixed seed and `initializer_range` 0.2, so the
greedy continuation varies (at HF's default 0.02 a tiny model repeats one token).
Both HF and nano-vLLM load the saved directory; HF's model is the reference.
"""
import inspect

import torch
from transformers import (AutoModelForCausalLM, GraniteConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config,
                          Qwen2Config, Qwen3Config, Qwen3MoeConfig)

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=1024, initializer_range=0.2)

FAMILIES = {
    # Qwen3: q/k norm, head_dim (32) != hidden / heads (16), tied embeddings, GQA 4:2
    "qwen3": (Qwen3Config, dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                                eos_token_id=[1, 2])),
    # Qwen2: qkv bias, untied embeddings, yarn rope scaling
    "qwen2": (Qwen2Config, dict(num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=1,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 256})),
    # Llama: MQA (one KV head), untied, llama3 rope scaling
    "llama": (LlamaConfig, dict(num_key_value_heads=1, tie_word_embeddings=False, eos_token_id=1,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Mistral: Llama's layers with a sliding window (512 caps the context; every test stays
    # inside it), GQA 4:2, head_dim 32, untied
    "mistral": (MistralConfig, dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                                    eos_token_id=1, sliding_window=512)),
    # Phi-3: Llama's layers, q/k/v and gate/up fused in the checkpoint, GQA 4:2, untied
    "phi3": (Phi3Config, dict(num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)),
    # Granite: Llama's layers scaled by four scalars (none of them at its neutral value), tied
    "granite": (GraniteConfig, dict(num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=1,
                                    embedding_multiplier=1.5, residual_multiplier=0.8, attention_multiplier=0.2,
                                    logits_scaling=1.25)),
    # Qwen3-MoE: 3 layers, the middle one dense (mlp_only_layers); 8 experts of 64, top-3 not
    # renormalized; q/k norm, GQA 4:2, head_dim 32, untied
    "qwen3moe": (Qwen3MoeConfig, dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=32,
                                      tie_word_embeddings=False, eos_token_id=1, num_experts=8,
                                      num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=False,
                                      mlp_only_layers=[1])),
    # Mixtral: every layer sparse, 4 experts of intermediate_size (64), top-2 renormalized; GQA 4:2
    "mixtral": (MixtralConfig, dict(intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=False,
                                    eos_token_id=1, num_local_experts=4, num_experts_per_tok=2)),
}


def build_tiny_model(family: str, path: str, seed: int = 0, **overrides):
    """Save a tiny random `family` model to `path`; returns the HF model (fp32, eval)."""
    config_cls, extra = FAMILIES[family]
    cfg = config_cls(**{**TINY, **extra, **overrides})
    cfg.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    return model


def random_prompts(lengths, vocab_size: int = TINY["vocab_size"], seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids (avoiding the low ids used as EOS)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF reference continuation: plain argmax steps with HF's KV cache, never stopping at EOS."""
    out = model(torch.tensor([prompt], device=model.device), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]], device=model.device), use_cache=True, **_cache_kwarg(model, out))
    return tokens


def _cache_kwarg(model, out) -> dict:
    """The KV cache of `out` as the next forward call takes it: transformers >= 5.24 names it
    `cache` (and warns on `past_key_values`), older releases `past_key_values`."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}
