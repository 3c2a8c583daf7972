"""Random sampling in one pass over the logits, for the GPU: the Gumbel-max trick in Triton.

argmax(logits / T + G), with G = -log(-log U) and U uniform, draws a token with
probability softmax(logits / T): the distribution the torch sampler draws from with
argmax(p / E), E ~ Exp(1) (E = -log U). The torch path writes the whole
[num_seqs, vocab] matrix about seven times (float copy, temperature, softmax, noise,
clamp, divide, argmax); this kernel reads the logits once, in their own dtype.

Each program scans one chunk of one row and keeps the best (score, index) per lane;
a tiny torch reduction over the chunks finishes the argmax. Rows with temperature 0
are greedy: plain argmax, ties to the lowest index as torch's. Each row draws U from
Philox keyed by its own seed and the token index (one Philox counter per four
columns), so a row's draw depends only on its seed: seeded requests are reproducible whatever else
is in the batch, and unseeded rows get fresh seeds from the caller each step.
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024        # columns a program handles at once
MAX_CHUNK = 8192    # columns per program: a 152k vocabulary is 19 programs per row
MIN_BLOCK = 4       # four quarters of at least one lane
TINY = tl.constexpr(1.1754943508222875e-38)  # smallest normal float32: keeps log(U) finite


@triton.jit
def _take_better(best, best_index, logits_row_ptr, cols, u, vocab_size, greedy, inv_t):
    """Fold one block of columns, with their uniforms `u`, into the running best per lane."""
    x = tl.load(logits_row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    gumbel = -tl.log(-tl.log(tl.maximum(u, TINY)))
    score = tl.where(greedy, x, x * inv_t + gumbel)
    better = score > best  # strict: a lane keeps its lowest index among equal scores
    return tl.where(better, score, best), tl.where(better, cols, best_index)


@triton.jit
def _gumbel_max_kernel(logits_ptr, stride, temperature_ptr, seed_ptr, best_score_ptr, best_index_ptr,
                       vocab_size, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk): the best score of the chunk's columns and its lowest index.

    One Philox call yields four uniforms (`tl.rand4x`), one for each quarter of a block
    of columns: the random bits, not the memory traffic, bound this kernel otherwise."""
    QUARTER: tl.constexpr = BLOCK // 4
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seed_ptr + row)
    logits_row_ptr = logits_ptr + row * stride
    best = tl.full((QUARTER,), float("-inf"), tl.float32)
    best_index = tl.zeros((QUARTER,), tl.int32)
    lanes = tl.arange(0, QUARTER)
    for offset in range(0, CHUNK, BLOCK):
        base = chunk * CHUNK + offset  # a multiple of 4: counters base / 4 + lane are this block's own
        u0, u1, u2, u3 = tl.rand4x(seed, base // 4 + lanes)
        best, best_index = _take_better(best, best_index, logits_row_ptr, base + lanes, u0,
                                        vocab_size, greedy, inv_t)
        best, best_index = _take_better(best, best_index, logits_row_ptr, base + QUARTER + lanes, u1,
                                        vocab_size, greedy, inv_t)
        best, best_index = _take_better(best, best_index, logits_row_ptr, base + 2 * QUARTER + lanes, u2,
                                        vocab_size, greedy, inv_t)
        best, best_index = _take_better(best, best_index, logits_row_ptr, base + 3 * QUARTER + lanes, u3,
                                        vocab_size, greedy, inv_t)
    top = tl.max(best, axis=0)
    index = tl.min(tl.where(best == top, best_index, vocab_size), axis=0)
    out = row * num_chunks + chunk
    tl.store(best_score_ptr + out, top)
    tl.store(best_index_ptr + out, tl.minimum(index, vocab_size - 1))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """logits: [num_seqs, vocab] (any float dtype, rows may be strided); temperature: [num_seqs]
    float32, 0 for greedy rows; seeds: [num_seqs] int64 -> sampled token ids [num_seqs] int64."""
    assert logits.stride(1) == 1 and temperature.dtype == torch.float32 and seeds.dtype == torch.int64
    num_seqs, vocab_size = logits.shape
    block = max(MIN_BLOCK, min(BLOCK, triton.next_power_of_2(vocab_size)))
    chunk = min(MAX_CHUNK, triton.cdiv(vocab_size, block) * block)
    num_chunks = triton.cdiv(vocab_size, chunk)
    best_score = torch.empty(num_seqs, num_chunks, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(num_seqs, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_max_kernel[(num_seqs, num_chunks)](
        logits, logits.stride(0), temperature, seeds, best_score, best_index, vocab_size, num_chunks,
        CHUNK=chunk, BLOCK=block)
    winner = best_score.argmax(1, keepdim=True)  # first chunk among equals: the lowest index
    return best_index.gather(1, winner).squeeze(1).long()
