"""The mixture-of-experts block of Qwen3-MoE and Mixtral: router, experts, combine.

`SparseMoeBlock` replaces a decoder layer's MLP: its router (`gate`, a replicated
linear layer) scores every expert for each token, and `FusedMoE` routes each token to
its top-k experts, runs them and sums their outputs weighted by the routing weights.
On CUDA tensors routing and experts run the Triton kernels of `kernels/fused_moe.py`;
elsewhere the plain torch path of `kernels/moe_torch.py` (the reference).

Weights: one packed tensor per layer, whatever the checkpoint's layout: `w13_weight`
[E, 2 * I, H] (each expert's gate rows, then its up rows) and `w2_weight` [E, H, I].
`weight_loader` takes HF's per-expert tensors (`experts.N.gate_proj/up_proj/down_proj`,
Mixtral's `experts.N.w1/w3/w2`) and whole-layer ones with a leading expert dimension
(transformers 5's `experts.gate_up_proj` / `experts.down_proj`, GGUF's `*_exps`).

Tensor parallelism (as vLLM's default): every rank holds a slice of every expert's
intermediate dimension (I = moe_intermediate_size / tp_size), the router is
replicated, and the partial sums are all-reduced once after the block. Expert
parallelism would give each rank a range of whole experts instead: the place for it
is `expert_start` / `num_local_experts` (all experts on every rank today), which the
loader already honours.

Quantized experts: the weights are created and applied by the layer's `quant_method`, a
`FusedMoEMethod` (layers/quantization): `UnquantizedFusedMoEMethod` (dense weights in the
model's dtype) unless the engine's quantization config names one of its own
(`get_moe_method`); a config without one refuses the model rather than load it dense.
"""
import re

import torch
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear, read_shard, read_whole
from nanovllm.layers.quantization import FusedMoEMethod, get_moe_method
from nanovllm.model_config import ModelConfig
from nanovllm.utils.parallel import all_reduce, divide, get_tp_rank, get_tp_size

# checkpoint projection name -> the part of the packed weights it fills
PROJECTIONS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down",
               "gate_up_proj": "gate_up"}
# one expert's tensor (HF hub layout) or a whole layer's (leading expert dimension)
_PER_EXPERT_RE = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")
_WHOLE_LAYER_RE = re.compile(r"(.*\.experts)\.(\w+?)(?:\.weight)?")


def map_expert_name(name: str) -> tuple[str, tuple[str, int | None]] | None:
    """Checkpoint tensor name -> (packed parameter name, (part, expert or None for all)),
    or None when `name` is no expert tensor."""
    if (m := _PER_EXPERT_RE.fullmatch(name)) and m.group(3) in PROJECTIONS:
        prefix, expert, part = m.group(1), int(m.group(2)), PROJECTIONS[m.group(3)]
    elif (m := _WHOLE_LAYER_RE.fullmatch(name)) and m.group(2) in PROJECTIONS:
        prefix, expert, part = m.group(1), None, PROJECTIONS[m.group(2)]
    else:
        return None
    return f"{prefix}.{'w2' if part == 'down' else 'w13'}_weight", (part, expert)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [num_tokens, E] -> (weights [num_tokens, top_k] float32, ids [num_tokens, top_k])."""
    if router_logits.is_cuda:
        from nanovllm.kernels import fused_moe
        return fused_moe.route(router_logits, top_k, renormalize)
    from nanovllm.kernels import moe_torch
    return moe_torch.route(router_logits, top_k, renormalize)


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """Dense expert weights in the model's dtype, multiplied by the fused kernel (GPU) or
    the torch reference (CPU)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int,
                       params_dtype: torch.dtype) -> None:
        """Registers `w13_weight` [E, 2 * I, H] and `w2_weight` [E, H, I] (I: this rank's share)."""
        for name, shape in (("w13_weight", (num_experts, 2 * intermediate_size, hidden_size)),
                            ("w2_weight", (num_experts, hidden_size, intermediate_size))):
            param = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
            param.weight_loader = layer.weight_loader
            layer.register_parameter(name, param)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, H] -> [num_tokens, H]: this rank's partial sum over the token's experts."""
        if x.is_cuda:
            from nanovllm.kernels import fused_moe
            return fused_moe.fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
        from nanovllm.kernels import moe_torch
        return moe_torch.fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.top_k, self.renormalize = top_k, renormalize
        self.intermediate_size = divide(intermediate_size, self.tp_size, "moe_intermediate_size")  # per rank
        # expert parallelism's place: this rank holds experts [expert_start, expert_start + num_local_experts)
        self.expert_start, self.num_local_experts = 0, num_experts
        self.quant_method = get_moe_method(self) or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self, self.num_local_experts, hidden_size, self.intermediate_size,
                                         torch.get_default_dtype())

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, H], router_logits: [num_tokens, E] -> [num_tokens, H]"""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = self.quant_method.apply(self, x, topk_weights, topk_ids)
        return all_reduce(out) if self.tp_size > 1 else out

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: tuple[str, int | None]) -> None:
        """Copy this rank's slice of checkpoint tensor `loaded` into `param`.

        shard_id: (part, expert): part "gate" / "up" ([I_full, H]), "gate_up" ([2 * I_full, H]),
        "down" ([H, I_full]); expert None: `loaded` holds every expert along a leading dimension.
        """
        part, expert = shard_id
        if expert is None:
            self._load_all_experts(param, loaded, part)
        elif self.expert_start <= expert < self.expert_start + self.num_local_experts:
            self._load_part(param[expert - self.expert_start], loaded, part, dim_offset=0)

    def _load_all_experts(self, param: nn.Parameter, loaded, part: str) -> None:
        experts = read_shard(loaded, 0, self.expert_start, self.num_local_experts)
        if experts.shape[0] != self.num_local_experts:
            raise ValueError(f"expert tensor has {experts.shape[0]} experts, the model "
                             f"{self.expert_start + self.num_local_experts}")
        self._load_part(param, experts, part, dim_offset=1)

    def _load_part(self, dest: torch.Tensor, loaded, part: str, dim_offset: int) -> None:
        """dest: w13 or w2 of one expert ([2I, H] / [H, I]) or of all (a leading E dimension)."""
        size, start = self.intermediate_size, self.tp_rank * self.intermediate_size
        if part == "gate_up":  # gate rows, then up rows: each half split over the ranks on its own
            whole = read_whole(loaded)
            half = whole.shape[dim_offset] // 2
            self._load_part(dest, whole.narrow(dim_offset, 0, half), "gate", dim_offset)
            self._load_part(dest, whole.narrow(dim_offset, half, half), "up", dim_offset)
        elif part == "down":
            dest.copy_(read_shard(loaded, 1 + dim_offset, start, size))
        else:
            rows = dest.narrow(dim_offset, 0 if part == "gate" else size, size)
            rows.copy_(read_shard(loaded, dim_offset, start, size))


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP as experts: the router (`gate`) then `experts` (route, run, combine)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, cfg.norm_topk_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))
