"""torch.compile of the CPU forward pass (vLLM's `compilation_config` mode 3 on the CPU).

On the CPU every small op of a decode step (residual add, RMSNorm, RoPE, SiLU-and-mul, the
casts around the int4 products) is a dispatch of its own: ~20 a layer. Inductor fuses what
lies between the products into a few C++ loops a layer. The products and the attention stay
opaque calls (layers/opaque_ops.py): they choose their kernel by the row count at run time.

One graph serves every batch size: the token dimension of the inputs is marked unbacked
(`mark_unbacked`), so Dynamo neither specializes on it nor on the sizes 0 and 1, and the
graph is compiled once, at start-up (`warm_up`), on a one-token step; afterwards
recompiling is an error (`fail_on_recompile`), not a silent stall of seconds. The graph's
guards are not evaluated on each call (`skip_guard_eval_unsafe`): with one graph there is
nothing for them to choose between, and what they check (the dtypes and layout of the
model's tensors, the inputs' dtype) does not change after start-up.

Compile time: Dynamo traces the whole model in Python each time an engine starts; Inductor's
compiled code is cached on disk (torch's FX graph / AOTAutograd caches, under
`torch._inductor.config.cache_dir`: /tmp/torchinductor_<user> unless TORCHINDUCTOR_CACHE_DIR
says otherwise), so a second process skips the C++ compilation. benchmarks/RESULTS.md
("B2 CPU, round 5") has both figures and the gain per step.
"""
import itertools

import torch
from torch import nn

from nanovllm.layers import opaque_ops
from nanovllm.layers.fused_moe import SparseMoeBlock

_ids = itertools.count()
COMPILE_MODE = 3
# The mode a CPU engine runs when compilation_config is not given.
DEFAULT_CPU_MODE = 0


def resolve_compilation_mode(mode: int | None, enforce_eager: bool, device: torch.device, tp_size: int,
                             model: nn.Module) -> int:
    """The compilation mode an engine runs: `mode` (Config.compilation_config) where given, else
    DEFAULT_CPU_MODE on a CPU that can run it and 0 elsewhere. A mode 3 the engine cannot run
    is a ValueError naming why."""
    if enforce_eager:
        return 0
    why_not = _why_not_compiled(device, tp_size, model)
    if mode is None:
        return DEFAULT_CPU_MODE if why_not is None else 0
    if mode == COMPILE_MODE and why_not is not None:
        raise ValueError(f"compilation_config mode {COMPILE_MODE} compiles the CPU forward pass: {why_not}")
    return mode


def _why_not_compiled(device: torch.device, tp_size: int, model: nn.Module) -> str | None:
    if device.type != "cpu":
        return f"device {device.type!r} runs its own kernels and CUDA graphs (use mode 0)"
    if tp_size > 1:
        return f"not with tensor_parallel_size={tp_size} (its all-reduces run between the layers' ops)"
    if any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        return "not for mixture-of-experts models"
    return None


class CompiledForward:
    """`model.forward(input_ids, positions)` compiled by Inductor, one graph for every token count."""

    def __init__(self, model: nn.Module):
        self._prefix = f"model{next(_ids)}"
        opaque_ops.register_layers(model, self._prefix)
        self._compiled = torch.compile(model.forward, fullgraph=True)
        self._warm = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden [num_tokens, hidden]."""
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        if not self._warm:
            return self._compiled(input_ids, positions)
        with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
            return self._compiled(input_ids, positions)

    def warm_up(self, step) -> None:
        """Compile now: `step()` runs one forward pass through this object (inside its context)."""
        step()
        self._warm = True

    def close(self) -> None:
        opaque_ops.unregister_layers(self._prefix)
