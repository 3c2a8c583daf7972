"""Weight loading: HF safetensors directories, GGUF files, or dummy (random) weights.

All formats end in `load_named_weights(model, named_tensors)`: checkpoint names
are mapped onto the model's parameters (fused tensors split by the model's
`split_checkpoint_tensor`, packed q/k/v and gate/up through its
`packed_modules_mapping`, experts into one tensor per layer through its
`map_expert_name`), and each parameter's `weight_loader` copies in
this rank's shard. Safetensors tensors arrive as lazy slices, so a rank reads only
its own rows (of a fused tensor, the whole tensor: it is split before sharding).
"""
import glob
import os
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.linear import read_whole

# Checkpoint tensors that hold nothing the engine needs (computed at load instead).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DUMMY_WEIGHT_RANGE = 1e-3  # uniform(-r, r): small enough that activations stay finite in bf16


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, object]]:
    """(name, lazy slice) for every tensor of every *.safetensors file in `model_dir`."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(path, "pt", "cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_named_weights(model: nn.Module, named_tensors: Iterable[tuple[str, object]]) -> None:
    params = dict(model.named_parameters())
    tied = getattr(model.lm_head, "weight", None) is getattr(model.model.embed_tokens, "weight", None)
    loaded = set()
    for name, tensor in (part for named in named_tensors for part in model.split_checkpoint_tensor(*named)):
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        param_name, shard_id = _map_name(model, name)
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[param_name]
        if shard_id is None:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)
        loaded.add(param_name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def default_weight_loader(param: nn.Parameter, loaded) -> None:
    param.data.copy_(read_whole(loaded))


def _map_name(model: nn.Module, name: str) -> tuple[str, object]:
    if (expert := getattr(model, "map_expert_name", None)) and (mapped := expert(name)) is not None:
        return mapped  # experts packed per layer (layers/fused_moe.py)
    for fragment, (packed, shard_id) in model.packed_modules_mapping.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{packed}."), shard_id
    return name, None


def load_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes, drawn on the parameters' device; norms stay 1
    so activations keep their scale."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        values = torch.rand(param.shape, generator=generators[param.device], device=param.device)
        param.data.copy_(values * 2 - 1).mul_(DUMMY_WEIGHT_RANGE)
