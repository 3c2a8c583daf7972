"""Sampler: turns the logits of a batch into next tokens, as batched tensor ops.

Every transform is a small pure function over the whole batch, applied in vLLM's
order: raw logprobs (kept for the `logprobs` option) -> grammar bitmask (structured
outputs) -> allowed tokens -> banned
tokens (min_tokens) -> logit bias -> penalties -> [greedy argmax] -> temperature ->
min_p -> top_k -> top_p -> random draw. Rows whose option is off get a neutral value
(top_k = vocab, top_p = 1, min_p = 0, every token allowed), so requests with different
options share one batch; an option no row uses is skipped (its tensor is None),
and an all-greedy batch is one argmax.

The random draw is by inverse CDF: one uniform U per row picks the first token whose
cumulative probability exceeds U times the row's total (`inverse_cdf`). Seeded rows draw
their U from a generator seeded per (request seed, position), so their draws depend on
nothing else in the batch; the other rows share one batched draw from the global RNG.
(It replaced the Gumbel-max race argmax(p / E), E ~ Exp(1) per token: on the CPU torch's
`exponential_` took 17 ms for 16 rows of a 49,152-token vocabulary, a sixth of SmolLM2's
16-row decode step; the inverse CDF ~1 ms; benchmarks/RESULTS.md "B2 CPU, round 9".) On a GPU,
a batch with no top-k/top-p/min-p row draws with two fused Triton launches instead
(kernels/triton_sampling.py: inverse CDF of softmax(logits / T), one uniform from
Philox keyed by a seed per row); that draw reads the grammar bitmask itself, so
constrained and free rows share it, greedy batches included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from nanovllm.kernels.cpu_argmax import CHUNKS, argmax_rows

if TYPE_CHECKING:  # sampling_metadata imports this module
    from nanovllm.engine.sampling_metadata import SamplingMetadata

MAX_SEED = (1 << 62) - 1  # fused draws' row seeds: base + row stays inside int64
TOP_P_CANDIDATES = 256    # the most likely tokens a CPU row's top-p set is looked for among first
TOP_P_MARGIN = 1e-5       # the candidates' mass must pass top_p by more than float32 sums' rounding


@dataclass
class LogprobsTensors:
    """Raw logprobs of one token per row: column 0 is the chosen token, then the top k."""
    token_ids: torch.Tensor  # [num_rows, 1 + k] int64
    logprobs: torch.Tensor   # [num_rows, 1 + k] float32
    ranks: torch.Tensor      # [num_rows] int64, rank of column 0's token (1 = most likely)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor           # [num_seqs] int64
    logprobs: LogprobsTensors | None  # when some row asked for logprobs


class Sampler(nn.Module):
    def __init__(self):
        super().__init__()
        self._generators: dict[torch.device, torch.Generator] = {}

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [num_seqs, vocab] -> the sampled token of each row (and its logprobs).

        Transforms work in float32 (`.float()` is free on float32 logits); the fused GPU
        draw reads bf16 logits as they are.
        """
        raw_logprobs = None if metadata.max_num_logprobs is None else torch.log_softmax(logits.float(), -1)
        if metadata.token_bitmask is not None and not self.fuses(logits, metadata):
            logits = apply_token_bitmask(logits.float(), metadata.token_bitmask)
        if metadata.allowed_tokens is not None:
            logits = apply_allowed_tokens(logits.float(), metadata.allowed_tokens)
        if metadata.banned_tokens is not None:
            logits = apply_banned_tokens(logits.float(), *metadata.banned_tokens)
        if metadata.logit_bias is not None:
            logits = apply_logit_bias(logits.float(), *metadata.logit_bias)
        if metadata.output_counts is not None:
            logits = apply_penalties(logits.float(), metadata)
        token_ids = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, token_ids, metadata.max_num_logprobs)
        return SamplerOutput(token_ids, logprobs)

    @staticmethod
    def fuses(logits: torch.Tensor, metadata: SamplingMetadata) -> bool:
        """Whether the fused GPU draw samples this batch (it applies the grammar bitmask too)."""
        return (logits.is_cuda and metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
                and not (metadata.all_greedy and metadata.token_bitmask is None))

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if self.fuses(logits, metadata):
            return self.fused_sample(logits, metadata)
        if metadata.all_greedy:
            return argmax_rows(logits)
        logits = logits.float()
        greedy = None if metadata.all_random else argmax_rows(logits)
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None:
            logits = apply_top_k(logits, metadata.top_k, metadata.max_top_k)
        if metadata.top_p is not None:
            logits = apply_top_p(logits, metadata.top_p)
        sampled = self.random_sample(torch.softmax(logits, -1), metadata.seeds)
        return sampled if greedy is None else torch.where(metadata.is_greedy, greedy, sampled)

    def fused_sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature and greedy rows in two launches (kernels/triton_sampling.py). Seeded rows
        use their per-position seed; the others get fresh ones from the global RNG."""
        from nanovllm.kernels.triton_sampling import sample_rows
        temperature = metadata.temperature
        if temperature is None:  # all greedy (a constrained batch)
            temperature = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        elif metadata.is_greedy is not None:
            temperature = temperature.masked_fill(metadata.is_greedy, 0.0)
        base = int(torch.randint(MAX_SEED, (1,)))  # the CPU generator: no device sync
        seeds = metadata.row_seeds(logits.shape[0], base, MAX_SEED, logits.device)
        return sample_rows(logits, temperature, seeds, metadata.token_bitmask)

    def random_sample(self, probs: torch.Tensor, seeds: dict[int, int]) -> torch.Tensor:
        """probs: [num_seqs, vocab]; seeds: row -> seed of its draw -> token ids [num_seqs]."""
        uniforms = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)  # unseeded rows
        generator = self._generator(probs.device)
        for row, seed in seeds.items():
            generator.manual_seed(seed)
            uniforms[row] = torch.rand(1, dtype=torch.float64, generator=generator, device=probs.device)
        return inverse_cdf(probs, uniforms)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """bitmask: [num_seqs, ceil(vocab / 32)] int32, bit j of word i allows token 32 i + j
    -> logits with every token not allowed at -inf. On a CPU, xgrammar's kernel (which made
    the bitmask, so it is installed) does it in one pass: ~3x faster than the torch ops at
    batch 64 x 152k (benchmarks/RESULTS.md)."""
    if logits.device.type == "cpu":
        from nanovllm.structured_outputs.backend import apply_token_bitmask_inplace
        logits = logits.clone()
        apply_token_bitmask_inplace(logits, bitmask)
        return logits
    return apply_token_bitmask_torch(logits, bitmask)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """apply_token_bitmask in torch ops (GPU rows that the fused draw does not take)."""
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1                        # [num_seqs, words, 32]
    allowed = bits.flatten(1)[:, :vocab_size].bool()                    # [num_seqs, vocab]
    return logits.masked_fill(~allowed, float("-inf"))


def apply_allowed_tokens(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """allowed: [num_seqs, vocab] bool -> logits with every token not allowed at -inf."""
    return logits.masked_fill(~allowed, float("-inf"))


def apply_banned_tokens(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Mask (rows[i], cols[i]) to -inf: stop tokens of sequences still below min_tokens."""
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     biases: torch.Tensor) -> torch.Tensor:
    """Add biases[i] to logit (rows[i], cols[i]): the logit_bias option."""
    logits = logits.clone()
    logits.index_put_((rows, cols), biases, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties."""
    counts = metadata.output_counts                          # [num_seqs, vocab]
    seen = metadata.prompt_mask | (counts > 0)               # [num_seqs, vocab]
    rep = metadata.repetition_penalties.unsqueeze(1)         # [num_seqs, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * counts
    return logits - metadata.presence_penalties.unsqueeze(1) * (counts > 0)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = torch.softmax(logits, -1)                                  # [num_seqs, vocab]
    threshold = probs.amax(-1, keepdim=True) * min_p.unsqueeze(1)      # [num_seqs, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th are kept, as in HF).

    top_k: [num_seqs], the vocabulary size where off; max_top_k: the largest k of a row that uses it.
    """
    vocab_size = logits.shape[-1]
    values = logits.topk(max_top_k, -1).values                          # [num_seqs, max_top_k]
    kth = values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))  # [num_seqs, 1]
    kth = kth.masked_fill((top_k >= vocab_size).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p.

    On the CPU each row's set is looked for among its TOP_P_CANDIDATES most likely tokens first
    (`topk`: 3 ms for 16 rows of a 49,152-token vocabulary, against 60 ms to sort them;
    benchmarks/RESULTS.md "B2 CPU, round 9"): where the candidates hold more than top_p of the
    row's probability, every other token is dropped, and a candidate is kept while the more likely
    ones hold less than top_p. Rows whose candidates hold less sort the whole row; rows with
    top_p = 1 keep every token; on a GPU (where checking the candidates' mass would wait for the
    device) every row is sorted.
    """
    if logits.is_cuda or logits.shape[-1] <= TOP_P_CANDIDATES:
        return top_p_by_sort(logits, top_p)
    top_probs, top_ids = torch.softmax(logits, -1).topk(TOP_P_CANDIDATES, -1)  # [num_seqs, k], most likely first
    more_likely = top_probs.cumsum(-1) - top_probs                      # [num_seqs, k]
    covered = more_likely[:, -1] + top_probs[:, -1] > top_p + TOP_P_MARGIN  # [num_seqs]
    kept = logits.gather(1, top_ids).masked_fill(more_likely >= top_p.unsqueeze(1), float("-inf"))
    out = torch.where(covered.unsqueeze(1), torch.full_like(logits, float("-inf")).scatter_(1, top_ids, kept), logits)
    rest = (~covered & (top_p < 1)).nonzero().squeeze(1)               # rows the candidates do not settle
    if len(rest):
        out[rest] = top_p_by_sort(logits[rest], top_p[rest])
    return out


def top_p_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`apply_top_p` over the whole sorted vocabulary (as HF's TopPLogitsWarper)."""
    sorted_logits, order = logits.sort(-1)                             # ascending
    cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)           # [num_seqs, vocab]
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False                                                # always keep the top token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row whose cumulative probability first exceeds uniforms x the row's total.

    probs: [rows, vocab] >= 0; uniforms: [rows] float64 in [0, 1) -> token ids [rows] int64.
    In two steps, so that no token's mass is lost to float32 rounding of a long running sum and
    no [rows, vocab] float64 matrix is made (converting one took most of the draw's time): the
    chunk holding the target mass, from the chunks' masses (each a float32 sum, accumulated in
    float64); then the token inside that chunk, from its own float64 running sum. A token of
    probability 0 is never drawn: the target is below the row's total, and a target at or past
    the chunk's total as its running sum rounds it takes its last token of positive probability.
    """
    rows, vocab = probs.shape
    chunk = next((c for c in CHUNKS if vocab % c == 0), vocab)
    chunks = probs.view(rows, vocab // chunk, chunk)                        # [rows, n, chunk]
    cumulative = chunks.sum(-1).double().cumsum(-1)                         # [rows, n]
    total = cumulative[:, -1:]
    below_total = total.nextafter(torch.zeros_like(total))
    target = torch.minimum(uniforms.unsqueeze(1) * total, below_total)   # [rows, 1]
    picked = torch.searchsorted(cumulative, target, right=True)             # [rows, 1]: the chunk
    picked.clamp_max_(vocab // chunk - 1)                                   # (a NaN row's)
    before = torch.where(picked > 0, cumulative.gather(1, (picked - 1).clamp_min(0)), 0.0)
    inside = chunks[torch.arange(rows, device=probs.device), picked.squeeze(1)]  # [rows, chunk]
    index = torch.searchsorted(inside.cumsum(-1, dtype=torch.float64), target - before, right=True)
    last = chunk - 1 - (inside.flip(-1) > 0).int().argmax(-1, keepdim=True)  # its last positive token
    return (picked * chunk + torch.minimum(index, last)).squeeze(1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """logprobs: [num_rows, vocab]; token_ids: [num_rows] -> their logprobs, ranks and the top k."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))                # [num_rows, 1]
    ranks = (logprobs > chosen).sum(-1) + 1                            # [num_rows]
    top = logprobs.topk(k, -1)                                         # [num_rows, k]
    ids = torch.cat([token_ids.unsqueeze(1), top.indices], 1)
    return LogprobsTensors(ids, torch.cat([chosen, top.values], 1), ranks)
