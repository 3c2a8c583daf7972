"""Mixture of experts in plain torch: the CPU path and the reference of the Triton kernel.

Routing follows HF transformers' Qwen3-MoE and Mixtral routers: a float32 softmax over
the router logits, the top-k probabilities, renormalized to sum 1 when asked.
The experts then run one at a time over the tokens routed to them (only the experts
that some token picked), each token's outputs weighted and summed:

    out[t] = sum_j  w[t, j] * down_e( silu(gate_e(x[t])) * up_e(x[t]) ),  e = ids[t, j]

Weights are packed per layer: `w13` [E, 2 * I, H] holds each expert's gate rows then
its up rows, `w2` [E, H, I] its down projection (I: this rank's share of the
intermediate size under tensor parallelism).
"""
import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [num_tokens, E] -> (weights [num_tokens, top_k] float32,
    expert ids [num_tokens, top_k] int64), highest probability first."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, H]; w13: [E, 2 * I, H]; w2: [E, H, I]; topk_weights/ids: [num_tokens, k]
    -> [num_tokens, H] in x's dtype (each expert's output weighted in float32, as HF does)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.flatten()  # [num_tokens * k]: pair p is token p // k, slot p % k
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // topk_ids.shape[1]
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)  # [count, I] each
        y = F.linear(F.silu(gate) * up, w2[expert])  # [count, H]
        out.index_add_(0, tokens, y.float() * topk_weights.flatten()[pairs, None])
    return out.to(x.dtype)
