"""Random sampling in one pass over the logits, for the GPU: the Gumbel-max trick in Triton.

argmax(logits / T + G), with G = -log(-log U) and U uniform, draws a token with
probability softmax(logits / T): the distribution the torch sampler draws from with
argmax(p / E), E ~ Exp(1) (E = -log U). The torch path writes the whole
[num_seqs, vocab] matrix about seven times (float copy, temperature, softmax, noise,
clamp, divide, argmax); this kernel reads the logits once, in their own dtype.

Each program scans one chunk of one row and keeps the best (score, index) per lane;
a tiny torch reduction over the chunks finishes the argmax. Rows with temperature 0
are greedy: plain argmax, ties to the lowest index as torch's. Each row draws U from
Philox keyed by its own seed and the token index (`tl.rand(seed, column)`), so a
row's draw depends only on its seed: seeded requests are reproducible whatever else
is in the batch, and unseeded rows get fresh seeds from the caller each step.
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024        # columns a program handles at once
MAX_CHUNK = 8192    # columns per program: a 152k vocabulary is 19 programs per row
TINY = tl.constexpr(1.1754943508222875e-38)  # smallest normal float32: keeps log(U) finite


@triton.jit
def _gumbel_max_kernel(logits_ptr, stride, temperature_ptr, seed_ptr, best_score_ptr, best_index_ptr,
                       vocab_size, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk): the best score of the chunk's columns and its lowest index."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seed_ptr + row)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_index = tl.zeros((BLOCK,), tl.int32)
    for offset in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + offset + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(logits_ptr + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.maximum(tl.rand(seed, cols), TINY)
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x * inv_t + gumbel)
        better = score > best  # strict: a lane keeps its lowest index among equal scores
        best = tl.where(better, score, best)
        best_index = tl.where(better, cols, best_index)
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
    block = min(BLOCK, triton.next_power_of_2(vocab_size))
    chunk = min(MAX_CHUNK, triton.cdiv(vocab_size, block) * block)
    num_chunks = triton.cdiv(vocab_size, chunk)
    best_score = torch.empty(num_seqs, num_chunks, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(num_seqs, num_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_max_kernel[(num_seqs, num_chunks)](
        logits, logits.stride(0), temperature, seeds, best_score, best_index, vocab_size, num_chunks,
        CHUNK=chunk, BLOCK=block)
    winner = best_score.argmax(1, keepdim=True)  # first chunk among equals: the lowest index
    return best_index.gather(1, winner).squeeze(1).long()
