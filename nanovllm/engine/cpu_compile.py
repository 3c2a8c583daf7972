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

Compile time: Dynamo traces one group of layers (CompiledForward) in Python each time an engine
starts; Inductor's compiled code is cached on disk (torch's FX graph / AOTAutograd caches, in
/tmp/torchinductor_<user> unless TORCHINDUCTOR_CACHE_DIR says otherwise), so a later process
skips the lowering and the C++ compilation: on SmolLM2, ~36 s with an empty cache, ~5 s from it,
for a decode step 5-20% faster (benchmarks/RESULTS.md "B2 CPU, round 5", where the whole-model
graph and one layer a graph are measured too). Hence DEFAULT_CPU_MODE: eager; a server (`nanovllm
serve`), which runs long enough to repay the compile time, compiles where that measured faster
(server_default_mode: not on CPUs with fast bf16 since the C++ small ops, round 15).
"""

import warnings

import torch
from torch import nn

from nanovllm.layers import opaque_ops
from nanovllm.layers.fused_moe import SparseMoeBlock
from nanovllm.models.decoder import run_decoder_layers
from nanovllm.utils import cpp_compiler
from nanovllm.utils.device import cpu_has_fast_bf16

COMPILE_MODE = 3
# The mode a CPU engine runs when compilation_config is not given: eager, as the compile time
# outweighs the gain for a short run (the README's first command).
DEFAULT_CPU_MODE = 0
# The mode `nanovllm serve` runs a CPU engine in when compilation_config is not given, by the CPU's
# kind (server_default_mode). Where bf16 is fast (AVX512-BF16, AMX: the engine runs bf16) eager, since
# the C++ small ops and paged decode kernel of kernels/ run only eagerly: on the 2-core AVX512-BF16
# machine, two threads, B2's serving run, eager served 256.1-282.2 tok/s against 226.4-242.5 compiled
# (TPOT 35.7-40.6 against 39.7-50.3 ms, three alternating pairs) and started in 6-8 s against 14
# (benchmarks/RESULTS.md "B2 CPU, round 15"; round 10, before those kernels, had compiled ahead:
# 165-174 against 143-145 tok/s). Elsewhere (AVX2: fp32) compiled, as last measured there (round 5's
# decode steps, 0.80-0.92x eager's at 1-16 rows; not measured since the C++ small ops).
SERVER_MODE_FAST_BF16 = 0
SERVER_MODE_OTHER_CPUS = COMPILE_MODE
# Decoder layers per compiled graph: the graph's call costs ~60-100 us of Python a step
# (Dynamo, AOTAutograd and Inductor's wrappers), its compilation grows with its layers.
LAYERS_PER_GRAPH = 10


def resolve_compilation_mode(mode: int | None, enforce_eager: bool, device: torch.device, tp_size: int,
                             model: nn.Module) -> int:
    """The compilation mode an engine runs: `mode` (Config.compilation_config) where given, else
    DEFAULT_CPU_MODE on a CPU that can run it and 0 elsewhere. A mode 3 the engine cannot run
    is a ValueError naming why."""
    if enforce_eager:
        return 0
    why_not = _why_not_compiled(device, tp_size, model)
    if mode is None:
        mode = DEFAULT_CPU_MODE if why_not is None else 0
        return 0 if mode == COMPILE_MODE and _why_no_compiler() else mode
    if mode == COMPILE_MODE:
        why_not = why_not or _why_no_compiler()
        if why_not is not None:
            raise ValueError(f"compilation_config mode {COMPILE_MODE} compiles the CPU forward pass: {why_not}")
    return mode


def _why_not_compiled(device: torch.device, tp_size: int, model: nn.Module) -> str | None:
    return _why_not(device, tp_size, any(isinstance(m, SparseMoeBlock) for m in model.modules()))


def _why_not(device: torch.device, tp_size: int, has_experts: bool) -> str | None:
    if device.type != "cpu":
        return f"device {device.type!r} runs its own kernels and CUDA graphs (use mode 0)"
    if tp_size > 1:
        return f"not with tensor_parallel_size={tp_size} (its all-reduces run between the layers' ops)"
    if has_experts:
        return "not for mixture-of-experts models"
    return None


def _why_no_compiler() -> str | None:
    """Why Inductor could not build compiled CPU code here (no C++ compiler), or None. Asked only
    where a compiled engine is about to start: the search imports Inductor (~1 s)."""
    if not cpp_compiler.cpp_compiler_found():
        return "no C++ compiler found (Inductor builds the compiled CPU code with one: install g++ or set CXX)"
    return None


def server_compilation_mode(model: str | None, engine_kwargs: dict) -> int | None:
    """The compilation_config a server's engine gets: the one given (or eager with enforce_eager),
    else COMPILE_MODE where server_default_mode() asks for it and the engine can run it (on the
    CPU, one rank, no experts: read from the model's config before the engine loads it; a C++
    compiler for Inductor), else None (the engine's own default)."""
    if engine_kwargs.get("compilation_config") is not None or engine_kwargs.get("enforce_eager"):
        return engine_kwargs.get("compilation_config")
    if server_default_mode() != COMPILE_MODE:
        return None  # the engine's own default (eager)
    from nanovllm.engine.model_source import ModelSource, resolve_model
    from nanovllm.utils.device import resolve_device
    device = resolve_device(engine_kwargs.get("device", "auto"))
    source = ModelSource.resolve(resolve_model(model), engine_kwargs.get("load_format", "auto"))
    has_experts = source.model_config().num_experts > 0
    if _why_not(device, engine_kwargs.get("tensor_parallel_size", 1), has_experts) is None and not _why_no_compiler():
        return COMPILE_MODE
    return None


def server_default_mode() -> int:
    """The compilation mode a CPU server's engine gets when none is given, by the CPU's kind."""
    return SERVER_MODE_FAST_BF16 if cpu_has_fast_bf16() else SERVER_MODE_OTHER_CPUS


class CompiledForward:
    """`model.forward(input_ids, positions)` with its decoder layers compiled by Inductor, in
    groups of LAYERS_PER_GRAPH.

    The unit compiled is a group of decoder layers, not the model: the groups differ only in
    their tensors (their products' and attention's keys among them, layers/opaque_ops.py), so
    one graph serves every group (a shorter last group is a second graph), and Dynamo traces and
    Inductor compiles LAYERS_PER_GRAPH layers instead of the whole stack. The first layer gets a
    zero residual instead of None (x + 0 is x), so that its group is the same graph as the
    others. The token embedding and the final norm, one op each, stay eager.
    """

    def __init__(self, model: nn.Module, layers_per_graph: int | None = None):
        self.model = model
        opaque_ops.register_layers(model)
        layers, size = model.model.layers, layers_per_graph or LAYERS_PER_GRAPH
        self._groups = [tuple(layers[i:i + size]) for i in range(0, len(layers), size)]
        self._compiled = torch.compile(run_decoder_layers, fullgraph=True)
        self._stance = None  # after warm-up: no recompiling, no guard evaluation

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden [num_tokens, hidden]."""
        if self._stance is None:
            return self.model(input_ids, positions, self._run_layers)
        with torch.compiler.set_stance(self._stance, skip_guard_eval_unsafe=True):
            return self.model(input_ids, positions, self._run_layers)

    def _run_layers(self, layers, positions: torch.Tensor, hidden: torch.Tensor, residual: None):
        residual = torch.zeros_like(hidden)
        for group in self._groups:
            if self._stance is None:  # compiling: no graph specialized on the token count
                for t in (positions, hidden, residual):
                    torch._dynamo.decorators.mark_unbacked(t, 0)
            hidden, residual = self._compiled(group, positions, hidden, residual)
        return hidden, residual

    def warm_up(self, step) -> None:
        """Compile now: `step()` runs one forward pass through this object (inside its context)."""
        with warnings.catch_warnings():  # raised by torch's own modules that Inductor imports
            warnings.filterwarnings("ignore", message=".*torch.jit.script_method.* is deprecated",
                                    category=DeprecationWarning)
            step()
        self._stance = "fail_on_recompile"

    def close(self) -> None:
        opaque_ops.unregister_layers(self.model)
