"""The fused MoE kernels (`kernels/fused_moe.py`) against the torch path (`kernels/moe_torch.py`).

Runs natively on a GPU (bf16 included). Without one, the file re-runs itself in a child
process with `TRITON_INTERPRET=1` (tests/triton_interpreter.py), at tiny sizes, in fp32
and fp16 (the interpreter gets bf16 dots wrong). Routings: random, experts that get no
token, one expert that gets every pair, a single token, and every tile config of the table.
"""
import pytest
import torch

from nanovllm.kernels import moe_torch
from triton_interpreter import HAS_TRITON, RUN_HERE, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
CHILD_TIMEOUT_S = 300
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
# tiny: hidden 64 and intermediate 48 (not a multiple of the 32- and 64-wide tiles: edges masked)
E, HIDDEN, INTER, TOP_K = 8, 64, 48, 3


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="kernels run in this process")
def test_fused_moe_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


def _weights(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * INTER, HIDDEN, generator=gen) / HIDDEN ** 0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(E, HIDDEN, INTER, generator=gen) / INTER ** 0.5).to(dtype).to(DEVICE)
    return w13, w2


def _routing(kind: str, num_tokens: int, seed=0) -> torch.Tensor:
    """[num_tokens, TOP_K] distinct expert ids per token."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        ids = torch.rand(num_tokens, E, generator=gen).argsort(dim=1)[:, :TOP_K]
    elif kind == "some-experts-idle":  # experts 0, 2, 4, 6 only
        ids = (torch.rand(num_tokens, E // 2, generator=gen).argsort(dim=1)[:, :TOP_K]) * 2
    else:  # "one-expert-takes-all": expert 5 in every token's first slot, the rest from 0 and 1
        ids = torch.stack([torch.full((num_tokens,), 5), torch.zeros(num_tokens, dtype=torch.long),
                           torch.ones(num_tokens, dtype=torch.long)], dim=1)
    return ids.to(DEVICE)


def _close(a, b, dtype):
    torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "some-experts-idle", "one-expert-takes-all"])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_fused_experts_match_the_torch_path(dtype, kind, num_tokens):
    from nanovllm.kernels import fused_moe
    w13, w2 = _weights(dtype)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    ids = _routing(kind, num_tokens)
    weights = torch.rand(num_tokens, TOP_K, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    expected = moe_torch.fused_experts(x, w13, w2, weights, ids)
    got = fused_moe.fused_experts(x, w13, w2, weights, ids.to(torch.int32))
    _close(got, expected, dtype)


@needs_kernels
@pytest.mark.parametrize("config_row", range(4))
def test_every_tile_config_of_the_table(config_row):
    from nanovllm.kernels import fused_moe
    _, config = fused_moe.TILE_CONFIGS[config_row]
    w13, w2 = _weights(torch.float32)
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids = _routing("random", 21, seed=4)
    weights = torch.rand(21, TOP_K, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    got = fused_moe.fused_experts(x, w13, w2, weights, ids.to(torch.int32), config=config)
    _close(got, moe_torch.fused_experts(x, w13, w2, weights, ids), torch.float32)


@needs_kernels
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("num_tokens", [37, 700])  # 700: pairs and blocks over several of the kernel's chunks
def test_align_sorts_pairs_by_expert_in_padded_blocks(block_m, num_tokens):
    from nanovllm.kernels import fused_moe
    ids = _routing("some-experts-idle", num_tokens, seed=6)
    sorted_ids, expert_ids, num_padded = fused_moe.moe_align_block_size(ids, E, block_m)
    flat, pairs = ids.flatten().cpu(), ids.numel()
    used = sorted_ids[:int(num_padded)].cpu()
    assert sorted(used[used < pairs].tolist()) == list(range(pairs))  # every pair once
    blocks = used.view(-1, block_m)
    for block, expert in zip(blocks, expert_ids.cpu()):
        real = block[block < pairs]
        assert (flat[real.long()] == expert).all()
        assert real.tolist() == sorted(real.tolist())  # stable: an expert's pairs in pair order
    counts = torch.bincount(flat, minlength=E)
    assert int(num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())


@needs_kernels
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_experts, top_k", [(8, 3), (6, 2), (128, 8)])
def test_route_matches_the_torch_path(renormalize, num_experts, top_k):
    from nanovllm.kernels import fused_moe
    logits = torch.randn(7, num_experts, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    weights, ids = fused_moe.route(logits, top_k, renormalize)
    ref_weights, ref_ids = moe_torch.route(logits, top_k, renormalize)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
