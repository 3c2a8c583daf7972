"""Decode K/V mirrors for the CPU attention backend: each layer's gathered K/V kept from one
decode step to the next and grown by one row per sequence, instead of gathered afresh.

A CPU decode step reads every sequence's whole context from the paged cache; gathering it
(`cpu_attn._gather`, one copy of the batch's live K/V per layer and step) cost about as
much as the attention itself. Between two decode steps of the same batch the context only
grows by the token each sequence just stored, so a layer's mirror keeps last step's gather
in `[kv_heads, num_seqs, capacity, d]` buffers (the layout SDPA reads, in the query's dtype:
an fp8 cache is dequantized once per row, not once per step) and appends that row.

A mirror is used only when the step is its last step grown by one: the same rows in the
same order, each `seq_lens_k` one more, the same blocks under every position it holds, and
room in its capacity (`MIRROR_SLACK_TOKENS` past the longest context when it was built).
Anything else rebuilds it from the paged cache. A layer call that attends without the
batched decode path (a prefill step, a mixed step with one decode) may have stored into
blocks that a sequence of the mirror held before it ended: it invalidates that layer's
mirror (`invalidate`), so no later step can match rows written since. (A mixed step's
decodes update the mirror to its own decode rows, so rows of sequences that ended are gone
from it before the next step compares.) Mirrors are per cache tensor and dropped with it.

Memory: a mirror holds a second copy of its layer's live K/V, with padding to the longest
context and the slack; it is not built when that would exceed the layer's own paged cache
bytes (the decode gather then runs every step, as without mirrors).
"""
import math
import weakref
from dataclasses import dataclass

import torch

from nanovllm.kernels import kv_quant
from nanovllm.kernels.step_memo import once_per_step

MIRROR_SLACK_TOKENS = 64  # capacity beyond the longest context at a (re)build: one rebuild per 64 steps

_mirrors: dict = {}  # {id(k_cache): Mirror}; an engine steps its caches from one thread at a time


@dataclass
class Mirror:
    cache: weakref.ref          # the layer's k_cache (id() alone could be reused by a later cache)
    k: torch.Tensor             # [kv_heads, num_seqs, capacity, d]
    v: torch.Tensor             # [kv_heads, num_seqs, capacity, d]
    block_tables: torch.Tensor | None  # the step it holds (None: invalidated); [num_seqs, max_blocks]
    seq_lens_k: torch.Tensor | None    # [num_seqs]


def invalidate(k_cache: torch.Tensor) -> None:
    """The mirror of this layer holds nothing valid any more (its buffers are kept for the rebuild)."""
    mirror = _mirror_of(k_cache)
    if mirror is not None:
        mirror.block_tables = mirror.seq_lens_k = None


def _mirror_of(k_cache: torch.Tensor) -> Mirror | None:
    mirror = _mirrors.get(id(k_cache))
    return mirror if mirror is not None and mirror.cache() is k_cache else None


def lookup(k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens_k: torch.Tensor) -> Mirror | None:
    """This layer's mirror if this step is its last step grown by one, else None."""
    mirror = _mirror_of(k_cache)
    if mirror is None or mirror.block_tables is None:
        return None
    grown = once_per_step("mirror_grown", (mirror.block_tables, mirror.seq_lens_k, block_tables, seq_lens_k,
                                           mirror.k.shape[2], k_cache.shape[1]),
                          lambda: _grown_by_one(mirror, block_tables, seq_lens_k, k_cache.shape[1]))
    return mirror if grown else None


def _grown_by_one(mirror: Mirror, block_tables: torch.Tensor, seq_lens_k: torch.Tensor, block_size: int) -> bool:
    old_tables, old_lens = mirror.block_tables, mirror.seq_lens_k
    if len(seq_lens_k) != len(old_lens) or not torch.equal(seq_lens_k, old_lens + 1):
        return False
    if int(seq_lens_k.max()) > mirror.k.shape[2] or block_tables.shape[1] < old_tables.shape[1]:
        return False
    held = torch.arange(old_tables.shape[1]) < (old_lens[:, None] + block_size - 1) // block_size
    return torch.equal(block_tables[:, :old_tables.shape[1]][held], old_tables[held])


def build(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          block_tables: torch.Tensor, seq_lens_k: torch.Tensor) -> Mirror | None:
    """A mirror of this step's gathered k, v ([kv_heads, num_seqs, len, d], zero past each
    sequence's length), in the layer's old buffers where they are large enough; None (and
    no mirror) when it would take more memory than the layer's paged cache."""
    kv_heads, num_seqs, width, d = k.shape
    # (the gather's width is the block tables': whole blocks, and as wide as their padding)
    shape = (kv_heads, num_seqs, max(width, int(seq_lens_k.max()) + MIRROR_SLACK_TOKENS), d)
    old = _mirrors.pop(id(k_cache), None)
    if 2 * math.prod(shape) * k.element_size() > _cache_bytes(k_cache, v_cache):
        return None
    if (old is not None and old.cache() is k_cache and old.k.dtype == k.dtype and old.k.numel() >= math.prod(shape)
            and old.k.is_inference() == torch.is_inference_mode_enabled()):
        bufs = [b.view(-1)[:math.prod(shape)].view(shape) for b in (old.k, old.v)]
    else:
        bufs = [k.new_empty(shape), v.new_empty(shape)]
    for buf, src in zip(bufs, (k, v)):
        buf[:, :, :width].copy_(src)
        buf[:, :, width:].zero_()
    key = id(k_cache)
    mirror = Mirror(weakref.ref(k_cache, lambda _: _mirrors.pop(key, None)), bufs[0], bufs[1],
                    *_snapshot(block_tables, seq_lens_k))
    _mirrors[key] = mirror
    return mirror


def append(mirror: Mirror, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens_k: torch.Tensor, scales: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
    """Copy each sequence's newest row (position seq_lens_k - 1, stored this step) from the
    paged cache into the mirror, which then holds this step."""
    slots, rows = _newest_rows(block_tables, seq_lens_k, k_cache.shape[1], mirror.k.shape[2])
    for buf, cache, scale in ((mirror.k, k_cache, scales[0]), (mirror.v, v_cache, scales[1])):
        new = kv_quant.as_bytes(cache).view(-1, *cache.shape[2:])[slots]  # [num_seqs, kv_heads, d]
        if kv_quant.is_fp8(cache.dtype):
            new = kv_quant.dequantize(new.view(cache.dtype), scale, buf.dtype)
        buf.view(buf.shape[0], -1, buf.shape[3]).index_copy_(1, rows, new.transpose(0, 1))
    mirror.block_tables, mirror.seq_lens_k = _snapshot(block_tables, seq_lens_k)


def _newest_rows(block_tables: torch.Tensor, seq_lens_k: torch.Tensor, block_size: int,
                 capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of each sequence's newest position [num_seqs] and their rows in the mirror's
    flattened [num_seqs * capacity] dimension; once per step."""
    def compute():
        positions = seq_lens_k.long() - 1
        seqs = torch.arange(len(positions))
        slots = block_tables[seqs, positions // block_size].long() * block_size + positions % block_size
        return slots, seqs * capacity + positions
    return once_per_step("mirror_rows", (block_tables, seq_lens_k, block_size, capacity), compute)


def _snapshot(block_tables: torch.Tensor, seq_lens_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the step's tables and lengths (once per step: every layer's mirror shares them)."""
    return once_per_step("mirror_snapshot", (block_tables, seq_lens_k),
                         lambda: (block_tables.clone(), seq_lens_k.clone()))


def _cache_bytes(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    return k_cache.numel() * k_cache.element_size() + v_cache.numel() * v_cache.element_size()
