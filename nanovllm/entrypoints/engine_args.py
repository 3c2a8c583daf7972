"""Engine flags for the command line: one flag per `Config` field, in vLLM's spelling.

Shared by `nanovllm generate/chat` (entrypoints/cli.py) and the server
(entrypoints/openai/api_server.py), so a new `Config` field gets a flag in both.
A flag that is not given keeps the engine's default (argparse.SUPPRESS).
"""
import argparse
import typing
from dataclasses import MISSING, fields

from nanovllm.config import DEVICES, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, Config

ENGINE_ARG_ALIASES = {"tensor_parallel_size": ["-tp"], "kvcache_block_size": ["--block-size"],
                      "compilation_config": ["-O"]}
ENGINE_ARG_CHOICES = {"device": DEVICES, "dtype": DTYPES, "load_format": LOAD_FORMATS,
                      "kv_cache_dtype": KV_CACHE_DTYPES}
ENGINE_ARG_HELP = {
    "max_model_len": "longest sequence (prompt + output) in tokens; default: the model's context length",
    "max_num_seqs": "most sequences in one step's batch",
    "max_num_batched_tokens": "most tokens computed in one step (chunked prefill splits longer prompts)",
    "tensor_parallel_size": "number of tensor-parallel ranks",
    "device": "where to run; auto: cuda when torch sees a GPU, else cpu",
    "dtype": "weight and activation dtype; auto: the model's on GPU, on CPU bf16 where it is fast, else fp32",
    "load_format": "weights format; auto: .gguf files as GGUF, directories as safetensors",
    "enforce_eager": "disable CUDA graphs and torch.compile",
    "compilation_config": "torch.compile mode (vLLM's -O): 0 eager; 3 compiles the CPU forward pass with "
                          "Inductor (decode steps 5-20%% faster on SmolLM2, tens of seconds more start-up, "
                          "less from its cache on later starts); default: 0",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "kvcache_block_size": "tokens per KV cache block",
    "kv_cache_dtype": "KV cache element type; auto: the model's dtype; fp8 (= fp8_e4m3), fp8_e5m2: "
                      "one byte, with per-layer scales fixed at start-up",
    "num_kvcache_blocks": "fixed number of KV cache blocks (overrides the memory budget)",
    "kv_cache_memory_bytes": "CPU: bytes for the KV cache",
    "gpu_memory_utilization": "GPU: fraction of device memory the engine may use",
    "num_scheduler_steps": "decode steps per scheduling round; default: 16 on one GPU, else 1",
    "async_scheduling": "launch each decode round before the host has seen the previous one's last "
                        "step; default: on with multi-step rounds on a GPU",
    "adaptive_rounds": "shorten multi-step rounds where requests arrive or reach max_tokens, so slots "
                       "change hands sooner (serving); needs num_scheduler_steps > 1",
    "max_prefill_graph_tokens": "GPU: largest prefill or mixed step (tokens) replayed from a CUDA graph; "
                                "0: those steps run eagerly",
    "tokenizer": "an HF tokenizer directory (default: the model's own)",
    "max_n": "largest n (samples per request) accepted",
    "trust_remote_code": "accepted for vLLM compatibility; nothing remote runs",
}


def add_engine_args(group, skip: tuple[str, ...] = ("model",)) -> None:
    """Add a flag for every `Config` field not in `skip` to the argparse `group`."""
    for f in fields(Config):
        if f.name in skip:
            continue
        flags = [f"--{f.name.replace('_', '-')}", *ENGINE_ARG_ALIASES.get(f.name, [])]
        help_text = ENGINE_ARG_HELP.get(f.name, f"engine setting {f.name}")
        if f.default is not MISSING and f.default is not None:
            help_text += f" (default: {f.default})"
        base = _base_type(f.type)
        if base is bool:
            action = "store_true" if f.default is False else argparse.BooleanOptionalAction
            group.add_argument(*flags, dest=f.name, action=action, default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, type=base, choices=ENGINE_ARG_CHOICES.get(f.name),
                               default=argparse.SUPPRESS, help=help_text)


def engine_kwargs(args: argparse.Namespace, skip: tuple[str, ...] = ("model",)) -> dict:
    """The `Config` keyword arguments the user gave on the command line."""
    return {f.name: getattr(args, f.name) for f in fields(Config)
            if f.name not in skip and hasattr(args, f.name)}


def _base_type(annotation) -> type:
    """`int | None` -> int; plain types as they are."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation
