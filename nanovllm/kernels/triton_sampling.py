"""Random sampling for the GPU, by inverse CDF over the logits, in Triton.

A row with temperature T draws token i with probability softmax(logits / T)_i: the torch
sampler's distribution, without writing any [num_seqs, vocab] matrix. Two launches:

1. `_chunk_stats_kernel`, one program per (row, chunk of columns): the chunk's maximum of
   logits / T, the sum of exp(logits / T - that maximum), and its first argmax. One pass
   over the logits in their own dtype; two exp2 per element (its term, and the rescale of
   its lane's running sum to the lane's new maximum).
2. `_pick_kernel`, one program per row: the row's maximum and total mass from the chunk
   stats; a uniform U from Philox keyed by the row's seed picks the mass U x total; the
   chunk that holds it is found from the chunks' cumulative masses, and only that chunk is
   scanned again for the token. Greedy rows (temperature 0) take the first chunk argmax:
   ties go to the lowest index, as torch's argmax.

With a grammar bitmask (structured outputs: int32 words, bit j of word i allows token
32 i + j), both passes read a column's bit beside its logit and treat a disallowed token
as -inf, so constrained and free rows share the launches (free rows' words are all ones).

Each row's U depends only on its seed, so seeded requests are reproducible whatever else
is in the batch; unseeded rows get fresh seeds from the caller each step. (It replaced a
Gumbel-max kernel, argmax(logits / T + G): that needed two logarithms and a share of a
Philox call per element, and its random bits, not memory, bound it.)

Compiled variants: one of each kernel per logits dtype (the model's, or float32 once a
penalty, bias or token mask has been applied) and vocabulary size; the batch size is only
the grid. engine/warmup.py's sampling profiles reach both dtypes at start-up.
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024        # columns a program handles at once
MAX_CHUNK = 8192    # columns per program of the first pass: a 152k vocabulary is 19 chunks a row
LOG2E = tl.constexpr(1.4426950408889634)
TINY = tl.constexpr(1.1754943508222875e-38)  # smallest normal float32


@triton.jit
def _inverse(temperature, greedy):
    """1 / T, 1 for greedy rows; at least the smallest normal float32, so that a huge T (1e38
    passes validation) scales a -inf logit to -inf, not to -inf x 0 = NaN."""
    return tl.maximum(1.0 / tl.where(greedy, 1.0, temperature), TINY)


@triton.jit
def _scaled(logits_row_ptr, cols, vocab_size, greedy, inv_t, mask_row_ptr, HAS_MASK: tl.constexpr):
    """logits / T of some columns of a row in float32 (-inf past the vocabulary and where the
    row's bitmask clears the token); greedy rows unscaled."""
    inside = cols < vocab_size
    x = tl.load(logits_row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        words = tl.load(mask_row_ptr + cols // 32, mask=inside, other=0)
        x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
    return tl.where(greedy, x, x * inv_t)


@triton.jit
def _chunk_stats_kernel(logits_ptr, stride, temperature_ptr, max_ptr, mass_ptr, argmax_ptr,
                        vocab_size, num_chunks, mask_ptr, mask_stride,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    """Program (row, chunk): max of z = logits / T over the chunk, sum of exp(z - max), first argmax."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inv_t = _inverse(temperature, greedy)
    logits_row_ptr = logits_ptr + row * stride
    mask_row_ptr = mask_ptr + row * mask_stride
    lanes = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)   # running max per lane
    mass = tl.zeros((BLOCK,), tl.float32)                 # sum of exp(z - best) per lane
    best_index = tl.zeros((BLOCK,), tl.int32)
    for offset in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + offset + lanes
        z = _scaled(logits_row_ptr, cols, vocab_size, greedy, inv_t, mask_row_ptr, HAS_MASK)
        new_best = tl.maximum(best, z)
        safe = tl.where(new_best == float("-inf"), 0.0, new_best)  # all -inf so far: no mass, no NaN
        mass = mass * tl.exp2((best - safe) * LOG2E) + tl.exp2((z - safe) * LOG2E)
        best_index = tl.where(z > best, cols, best_index)  # strict: a lane keeps its lowest index
        best = new_best
    top = tl.max(best, axis=0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, top)
    tl.store(mass_ptr + out, tl.sum(mass * tl.exp2((best - safe_top) * LOG2E), axis=0))
    # clamped: a NaN maximum (the interpreter's maximum keeps NaN; the GPU's drops it) matches no lane
    tl.store(argmax_ptr + out, tl.minimum(tl.min(tl.where(best == top, best_index, vocab_size), axis=0),
                                          vocab_size - 1))


@triton.jit
def _pick_kernel(logits_ptr, stride, temperature_ptr, seed_ptr, max_ptr, mass_ptr, argmax_ptr, out_ptr,
                 vocab_size, num_chunks, mask_ptr, mask_stride, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 CHUNKS_PAD: tl.constexpr, HAS_MASK: tl.constexpr):
    """Program per row: greedy rows take the first chunk argmax; the others the token where the
    cumulative mass passes U x total, U uniform from the row's seed."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inv_t = _inverse(temperature, greedy)
    chunks = tl.arange(0, CHUNKS_PAD)
    ok = chunks < num_chunks
    stats = row * num_chunks + chunks
    top = tl.load(max_ptr + stats, mask=ok, other=float("-inf"))         # [CHUNKS_PAD]
    row_top = tl.max(top, axis=0)
    if greedy:
        first = tl.minimum(tl.min(tl.where(top == row_top, chunks, CHUNKS_PAD), axis=0), num_chunks - 1)
        token = tl.load(argmax_ptr + row * num_chunks + first)
    else:
        weight = tl.load(mass_ptr + stats, mask=ok, other=0.0) * tl.exp2((top - row_top) * LOG2E)
        weight = tl.where(ok & (top > float("-inf")), weight, 0.0)       # [CHUNKS_PAD] mass scaled to row_top
        below = tl.cumsum(weight, axis=0)
        target = tl.rand(tl.load(seed_ptr + row), tl.full((), 0, tl.int32)) * tl.sum(weight, axis=0)
        last = tl.max(tl.where(weight > 0.0, chunks, 0), axis=0)
        chosen = tl.minimum(tl.sum((below <= target).to(tl.int32), axis=0), last)
        left = target - tl.sum(tl.where(chunks == chosen, below - weight, 0.0), axis=0)  # mass to go in it
        logits_row_ptr = logits_ptr + row * stride
        mask_row_ptr = mask_ptr + row * mask_stride
        lanes = tl.arange(0, BLOCK)
        seen = tl.zeros((), tl.float32)
        token = tl.full((), -1, tl.int32)
        fallback = tl.load(argmax_ptr + row * num_chunks + chosen)  # the chunk's top token: p > 0 if weight > 0
        for offset in range(0, CHUNK, BLOCK):
            cols = chosen * CHUNK + offset + lanes
            z = _scaled(logits_row_ptr, cols, vocab_size, greedy, inv_t, mask_row_ptr, HAS_MASK)
            p = tl.exp2((z - row_top) * LOG2E)
            passed = (seen + tl.cumsum(p, axis=0) > left) & (p > 0.0)
            hit = tl.min(tl.where(passed, cols, vocab_size), axis=0)
            token = tl.where((token < 0) & (hit < vocab_size), hit, token)
            fallback = tl.maximum(fallback, tl.max(tl.where(p > 0.0, cols, 0), axis=0))
            seen += tl.sum(p, axis=0)
        token = tl.where(token < 0, fallback, token)  # float rounding left the mass short of `left`
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [num_seqs, vocab] (any float dtype, rows may be strided); temperature: [num_seqs]
    float32, 0 for greedy rows; seeds: [num_seqs] int64; bitmask: None or [num_seqs,
    ceil(vocab / 32)] int32, the tokens each row may draw -> sampled token ids [num_seqs] int64."""
    assert logits.stride(1) == 1 and temperature.dtype == torch.float32 and seeds.dtype == torch.int64
    assert bitmask is None or (bitmask.dtype == torch.int32 and bitmask.stride(1) == 1
                               and bitmask.shape == (logits.shape[0], triton.cdiv(logits.shape[1], 32)))
    num_seqs, vocab_size = logits.shape
    block = min(BLOCK, triton.next_power_of_2(vocab_size))
    chunk = min(MAX_CHUNK, triton.cdiv(vocab_size, block) * block)
    num_chunks = triton.cdiv(vocab_size, chunk)
    top = torch.empty(num_seqs, num_chunks, dtype=torch.float32, device=logits.device)
    mass = torch.empty_like(top)
    argmax = torch.empty(num_seqs, num_chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(num_seqs, dtype=torch.int64, device=logits.device)
    has_mask = bitmask is not None
    mask, mask_stride = (bitmask, bitmask.stride(0)) if has_mask else (seeds, 0)  # unread without a mask
    _chunk_stats_kernel[(num_seqs, num_chunks)](
        logits, logits.stride(0), temperature, top, mass, argmax, vocab_size, num_chunks, mask, mask_stride,
        CHUNK=chunk, BLOCK=block, HAS_MASK=has_mask)
    _pick_kernel[(num_seqs,)](
        logits, logits.stride(0), temperature, seeds, top, mass, argmax, tokens, vocab_size, num_chunks,
        mask, mask_stride, CHUNK=chunk, BLOCK=block, CHUNKS_PAD=max(2, triton.next_power_of_2(num_chunks)),
        HAS_MASK=has_mask)
    return tokens
