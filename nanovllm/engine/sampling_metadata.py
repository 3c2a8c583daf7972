"""The sampler's inputs and outputs, translated between sequences and tensors.

`SamplingMetadata.build(seqs, ...)` turns the SamplingParams and token histories
of one step's sampling sequences into batched tensors (one row per sequence);
an option that no row uses stays None, so the sampler skips it.
`ModelRunnerOutput` carries the results back as plain Python values keyed by
sequence: the sampled tokens, their logprobs, and prompt logprobs.
"""
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import LogprobsTensors, SamplerOutput, gather_logprobs
from nanovllm.sampling_params import MAX_LOGPROBS
from nanovllm.structured_outputs.backend import BITS_PER_WORD, fill_bitmasks

_MASK64 = (1 << 64) - 1

# One position's logprobs: token ids (the chosen one first, then the top k),
# their logprobs, and the chosen token's rank.
TokenLogprobs = tuple[list[int], list[float], int]


def step_seed(seed: int, position: int) -> int:
    """Seed of a seeded request's draw for the token at `position` (splitmix64 of both).

    It depends on nothing else, so a rerun, other requests in the batch, or a
    preemption and recompute never change the request's draws.
    """
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class SamplingMetadata:
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None = None   # [num_seqs] float32 (1.0 on greedy rows)
    is_greedy: torch.Tensor | None = None     # [num_seqs] bool; None when no row is greedy
    top_k: torch.Tensor | None = None         # [num_seqs] int64 (vocab size where off)
    max_top_k: int = 0
    top_p: torch.Tensor | None = None         # [num_seqs] float32 (1.0 where off)
    min_p: torch.Tensor | None = None         # [num_seqs] float32 (0.0 where off)
    seeds: dict[int, int] = field(default_factory=dict)  # row -> seed of this step's draw
    output_counts: torch.Tensor | None = None  # [num_seqs, vocab] float32, occurrences in the output
    prompt_mask: torch.Tensor | None = None    # [num_seqs, vocab] bool, token is in the prompt
    repetition_penalties: torch.Tensor | None = None  # [num_seqs] float32
    frequency_penalties: torch.Tensor | None = None   # [num_seqs] float32
    presence_penalties: torch.Tensor | None = None    # [num_seqs] float32
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    allowed_tokens: torch.Tensor | None = None  # [num_seqs, vocab] bool: False = never sampled
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, biases
    max_num_logprobs: int | None = None        # largest `logprobs` of a row; None: no row wants them
    # structured outputs: [num_seqs, ceil(vocab / 32)] int32, bit j of word i allows token 32 i + j
    # (every bit set in free rows); None when no row is constrained this step
    token_bitmask: torch.Tensor | None = None

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> "SamplingMetadata":
        params = [seq.sampling_params for seq in seqs]
        greedy = [p.greedy for p in params]
        metadata = cls(all_greedy=all(greedy), all_random=not any(greedy))
        if not metadata.all_greedy:
            metadata._add_random(seqs, greedy, vocab_size, device)
        if any(p.has_penalties for p in params):
            metadata._add_penalties(seqs, vocab_size, device)
        metadata.banned_tokens = _banned_tokens(seqs, device)
        metadata.allowed_tokens = _allowed_tokens(seqs, vocab_size, device)
        metadata.logit_bias = _logit_bias(seqs, device)
        metadata.token_bitmask = fill_token_bitmask(seqs, vocab_size, device)
        metadata.max_num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        return metadata

    @classmethod
    def worst_case(cls, num_seqs: int, vocab_size: int, device: torch.device) -> "SamplingMetadata":
        """Every option on in every row: a start-up warm-up with it shows the sampler's peak memory."""
        def full(value, dtype=torch.float32):
            return torch.full((num_seqs,), value, dtype=dtype, device=device)
        zeros = torch.zeros(num_seqs, vocab_size, device=device)
        return cls(all_greedy=False, all_random=False, temperature=full(0.5), is_greedy=full(False, torch.bool),
                   top_k=full(vocab_size - 1, torch.int64), max_top_k=vocab_size - 1, top_p=full(0.9),
                   min_p=full(0.01), output_counts=zeros, prompt_mask=zeros.bool(), repetition_penalties=full(1.1),
                   frequency_penalties=full(0.1), presence_penalties=full(0.1), max_num_logprobs=MAX_LOGPROBS,
                   allowed_tokens=zeros.bool().logical_not_(),
                   token_bitmask=torch.full((num_seqs, -(-vocab_size // BITS_PER_WORD)), -1, dtype=torch.int32,
                                            device=device))

    def _add_random(self, seqs: list[Sequence], greedy: list[bool], vocab_size: int,
                    device: torch.device) -> None:
        # Per row: temperature, top_p, min_p, top_k; greedy rows get neutral values.
        rows = [(1.0, 1.0, 0.0, vocab_size) if g else
                (p.temperature, p.top_p, p.min_p, min(p.top_k or vocab_size, vocab_size))
                for p, g in zip((seq.sampling_params for seq in seqs), greedy)]
        temperature, top_p, min_p, top_k = zip(*rows)
        floats = _tensor([temperature, top_p, min_p], torch.float32, device)  # [3, num_seqs], one copy
        self.temperature = floats[0]
        self.top_p = floats[1] if any(p < 1.0 for p in top_p) else None
        self.min_p = floats[2] if any(p > 0.0 for p in min_p) else None
        if any(k < vocab_size for k in top_k):
            self.top_k = _tensor(top_k, torch.int64, device)
            self.max_top_k = max(k for k in top_k if k < vocab_size)
        if not self.all_random:
            self.is_greedy = _tensor(greedy, torch.bool, device)
        self.seeds = {row: step_seed(seq.sampling_params.seed, seq.num_tokens) for row, seq in enumerate(seqs)
                      if seq.sampling_params.seed is not None and not greedy[row]}

    def row_seeds(self, num_rows: int, base: int, mask: int, device: torch.device) -> torch.Tensor:
        """One int64 seed per row for a fused draw: a seeded row's own (`& mask`), `base + row`
        for the others.  # [num_rows]"""
        seeds = [base + row for row in range(num_rows)]
        for row, seed in self.seeds.items():
            seeds[row] = seed & mask
        return _tensor(seeds, torch.int64, device)

    def advance_seeds(self, seqs: list[Sequence], step: int) -> None:
        """Seeds of decode step `step` of a multi-step round (positions `step` tokens further)."""
        self.seeds = {row: step_seed(seqs[row].sampling_params.seed, seqs[row].num_tokens + step)
                      for row in self.seeds}

    def _add_penalties(self, seqs: list[Sequence], vocab_size: int, device: torch.device) -> None:
        params = [seq.sampling_params for seq in seqs]
        rows, token_ids, in_prompt = _flat_token_ids([seq if p.has_penalties else None
                                                      for seq, p in zip(seqs, params)])
        # pinned on a GPU: a copy from pageable memory would make the host wait for the device
        prompt = _to_device(torch.stack([rows[in_prompt], token_ids[in_prompt]]), device)    # [2, num_prompt_tokens]
        output = _to_device(torch.stack([rows[~in_prompt], token_ids[~in_prompt]]), device)  # [2, num_output_tokens]
        self.prompt_mask = torch.zeros(len(seqs), vocab_size, dtype=torch.bool, device=device)
        self.prompt_mask[prompt[0], prompt[1]] = True
        self.output_counts = torch.zeros(len(seqs), vocab_size, dtype=torch.float32, device=device)
        ones = torch.ones(output.shape[1], dtype=torch.float32, device=device)
        self.output_counts.index_put_((output[0], output[1]), ones, accumulate=True)
        penalties = _tensor([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                             [p.presence_penalty for p in params]], torch.float32, device)  # [3, num_seqs]
        self.repetition_penalties, self.frequency_penalties, self.presence_penalties = penalties


def _flat_token_ids(seqs: list[Sequence | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every token of the given sequences (None: skip that row), flat, built with numpy.

    Returns row [n] int64, token id [n] int64, and whether the token is in its prompt [n] bool.
    """
    present = [(row, seq) for row, seq in enumerate(seqs) if seq is not None]
    lengths = np.array([seq.num_tokens for _, seq in present], dtype=np.int64)
    total = int(lengths.sum())
    token_ids = np.fromiter(chain.from_iterable(seq.token_ids for _, seq in present), np.int64, count=total)
    rows = np.repeat(np.array([row for row, _ in present], dtype=np.int64), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    prompt_lengths = np.repeat(np.array([seq.num_prompt_tokens for _, seq in present], dtype=np.int64), lengths)
    in_prompt = (np.arange(total) - starts) < prompt_lengths
    return torch.from_numpy(rows), torch.from_numpy(token_ids), torch.from_numpy(in_prompt)


def _banned_tokens(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """min_tokens: the stop tokens (EOS, stop_token_ids) of rows that have not reached it."""
    rows, cols = [], []
    for row, seq in enumerate(seqs):
        params = seq.sampling_params
        if seq.num_completion_tokens < params.min_tokens:
            stop_ids = sorted(params.all_stop_token_ids)
            rows += [row] * len(stop_ids)
            cols += stop_ids
    if not rows:
        return None
    return _tensor(rows, torch.int64, device), _tensor(cols, torch.int64, device)


def _allowed_tokens(seqs: list[Sequence], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """allowed_token_ids: per row, the tokens it may sample (every token in rows without the option)."""
    rows = [row for row, seq in enumerate(seqs) if seq.sampling_params.allowed_token_ids is not None]
    if not rows:
        return None
    allowed = torch.ones(len(seqs), vocab_size, dtype=torch.bool, device=device)  # [num_seqs, vocab]
    allowed[_tensor(rows, torch.int64, device)] = False
    ids = [seqs[row].sampling_params.allowed_token_ids for row in rows]
    allowed[_tensor([row for row, row_ids in zip(rows, ids) for _ in row_ids], torch.int64, device),
            _tensor([t for row_ids in ids for t in row_ids], torch.int64, device)] = True
    return allowed


def _logit_bias(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """logit_bias: (rows, token ids, biases), one entry per biased token of a row."""
    entries = [(row, token_id, bias) for row, seq in enumerate(seqs)
               for token_id, bias in (seq.sampling_params.logit_bias or {}).items()]
    if not entries:
        return None
    rows, token_ids, biases = zip(*entries)
    return (_tensor(rows, torch.int64, device), _tensor(token_ids, torch.int64, device),
            _tensor(biases, torch.float32, device))


def samples_under_grammar(seq: Sequence) -> bool:
    """Whether `seq`'s next token is sampled under its grammar: it has one, its grammar is
    not done, and the sequence has not finished."""
    return seq.grammar is not None and not seq.is_finished and seq.grammar.is_active


def fill_token_bitmask(seqs: list[Sequence], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """Structured outputs: the tokens each constrained row may sample next, from its matcher
    as it stands; every token in free rows, in rows whose grammar is done, and in rows of
    sequences that finished (a multi-step round computes them and drops their tokens)."""
    rows = [row for row, seq in enumerate(seqs) if samples_under_grammar(seq)]
    if not rows:
        return None
    words = -(-vocab_size // BITS_PER_WORD)
    # Only the constrained rows are filled on the host, into memory nothing touches first
    # (xgrammar writes every word of a row); the free rows are set on the device. A
    # torch.full of the whole batch here was a parallel CPU op, whose OpenMP threads then
    # spun through the fill and took the cores from xgrammar's threads.
    pin = device.type == "cuda"  # filled in pinned memory, copied without a sync
    filled = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=pin)  # [num_rows, words]
    fill_bitmasks([seqs[row].grammar.matcher for row in rows], filled, list(range(len(rows))))
    filled = filled.to(device, non_blocking=pin)
    if len(rows) == len(seqs):
        return filled
    bitmask = torch.full((len(seqs), words), -1, dtype=torch.int32, device=device)  # [num_seqs, words]
    bitmask[_tensor(rows, torch.int64, device)] = filled
    return bitmask


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, through pinned memory on a GPU (no host wait)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


# ---- results back to sequences ------------------------------------------------

@dataclass
class ModelRunnerOutput:
    sampled_token_ids: list[int | None]   # per scheduled sequence; None: it is mid-prompt
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)  # seq_id -> sampled token's
    # seq_id -> (prompt index of the first entry, one entry per prompt token from there)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)

    @classmethod
    def empty(cls, num_seqs: int) -> "ModelRunnerOutput":
        return cls([None] * num_seqs)

    def add_samples(self, rows: list[int], seqs: list[Sequence], output: SamplerOutput) -> None:
        """Record the sampler's output for `seqs`, which are scheduled rows `rows`."""
        for row, token_id in zip(rows, output.token_ids.tolist()):
            self.sampled_token_ids[row] = token_id
        if output.logprobs is None:
            return
        for seq, entry in zip(seqs, _to_lists(output.logprobs)):
            k = seq.sampling_params.logprobs
            if k is not None:
                self.logprobs[seq.seq_id] = (entry[0][:k + 1], entry[1][:k + 1], entry[2])


def _to_lists(t: LogprobsTensors) -> list[TokenLogprobs]:
    return list(zip(t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist()))


def compute_prompt_logprobs(seqs: list[Sequence], hidden: torch.Tensor,
                            to_logits) -> dict[int, tuple[int, list[TokenLogprobs]]]:
    """Logprobs of the prompt tokens computed this step, for sequences that asked for them.

    hidden: [num_tokens, hidden_size], the step's flat batch (sequences in order,
    `num_scheduled_tokens` rows each). The row at prompt position p predicts token p + 1.
    """
    rows, targets, owners, offset = [], [], [], 0
    for seq in seqs:
        start, k = seq.num_computed_tokens, seq.sampling_params.prompt_logprobs
        end = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1)
        if k is not None and end > start:
            rows += range(offset, offset + end - start)
            targets += seq.token_ids[start + 1:end + 1]
            owners.append((seq, start + 1, end - start, k))
        offset += seq.num_scheduled_tokens
    if not rows:
        return {}
    logits = to_logits(hidden[torch.tensor(rows, device=hidden.device)])  # [num_rows, vocab]
    if logits is None:  # a tensor-parallel rank other than 0
        return {}
    max_k = max(owner[3] for owner in owners)
    entries = _to_lists(gather_logprobs(torch.log_softmax(logits.float(), -1),
                                        torch.tensor(targets, device=logits.device), max_k))
    result, i = {}, 0
    for seq, first, count, k in owners:
        result[seq.seq_id] = (first, [(ids[:k + 1], lps[:k + 1], rank) for ids, lps, rank in entries[i:i + count]])
        i += count
    return result
