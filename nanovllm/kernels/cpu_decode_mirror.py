"""Decode K/V mirrors for the CPU attention backend: each layer's gathered K/V kept from one
decode step to the next and grown by one row per sequence, instead of gathered afresh.

Used by the torch-only decode path only: where a C++ compiler is found, decode steps run the
kernel of kernels/cpu_paged_decode.py over the paged cache itself, faster than a step over a
mirror (benchmarks/RESULTS.md "B2 CPU, round 12"). Without a compiler a step over the mirrors
still costs 0.4-0.8x of one that gathers (same section), so they stay.

A CPU decode step reads every sequence's whole context from the paged cache; gathering it
(`cpu_attn._gather`, one copy of the batch's live K/V per layer and step) cost about as
much as the attention itself. Between two decode steps of the same batch the context only
grows by the token each sequence just stored, so a layer's mirror keeps last step's gather
in `[kv_heads, num_seqs, capacity, d]` buffers (the layout SDPA reads, in the query's dtype:
an fp8 cache is dequantized once per row, not once per step) and appends that row.

A mirror is used only when the step is its last step grown by one: the same rows in the
same order, each `seq_lens_k` one more, the same blocks under every position it holds, and
room in its capacity (`MIRROR_SLACK_TOKENS` past the longest context when it was built).
Otherwise the step gathers from the paged cache, and the mirror is filled from that gather
only if the step grew the one before (a batch that lasts: where the batch changes every
step, as a server's may, no step pays for a copy it would not reuse).

A layer call that attends without the batched decode path (a prefill step, a mixed step
with one decode) may have stored into blocks that a sequence of the mirror held before it
ended: it invalidates that layer's mirror (`invalidate`), so no later step can match rows
written since. (Every batched decode call notes its own rows, a mixed step's decodes too,
so rows of sequences that ended are gone from the note before the next step compares.)
Mirrors are per cache tensor and dropped with it.

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
    block_tables: torch.Tensor | None  # the last decode step seen (None: invalidated); [num_seqs, max_blocks]
    seq_lens_k: torch.Tensor | None    # [num_seqs]
    k: torch.Tensor | None = None      # [kv_heads, num_seqs, capacity, d], kept for reuse when not `held`
    v: torch.Tensor | None = None
    held: bool = False                 # k, v hold that step's K/V


def invalidate(k_cache: torch.Tensor) -> None:
    """The mirror of this layer holds nothing valid any more (its buffers are kept for the rebuild)."""
    mirror = _mirror_of(k_cache)
    if mirror is not None:
        mirror.block_tables = mirror.seq_lens_k = None
        mirror.held = False


def _mirror_of(k_cache: torch.Tensor) -> Mirror | None:
    mirror = _mirrors.get(id(k_cache))
    return mirror if mirror is not None and mirror.cache() is k_cache else None


def lookup(k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens_k: torch.Tensor) -> Mirror | None:
    """This layer's mirror if it holds the last step, this step grew it by one and it has room."""
    mirror = _mirror_of(k_cache)
    if mirror is None or not mirror.held or not _grew(mirror, block_tables, seq_lens_k, k_cache.shape[1]):
        return None
    return mirror if longest(seq_lens_k) <= mirror.k.shape[2] else None


def _grew(mirror: Mirror, block_tables: torch.Tensor, seq_lens_k: torch.Tensor, block_size: int) -> bool:
    """This step is the mirror's last step grown by one token per sequence (once per step)."""
    if mirror.block_tables is None:
        return False
    return once_per_step("mirror_grew", (mirror.block_tables, mirror.seq_lens_k, block_tables, seq_lens_k, block_size),
                         lambda: _grown_by_one(mirror.block_tables, mirror.seq_lens_k, block_tables, seq_lens_k,
                                               block_size))


def _grown_by_one(old_tables: torch.Tensor, old_lens: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens_k: torch.Tensor, block_size: int) -> bool:
    if len(seq_lens_k) != len(old_lens) or not torch.equal(seq_lens_k, old_lens + 1):
        return False
    if block_tables.shape[1] < old_tables.shape[1]:
        return False
    held = torch.arange(old_tables.shape[1]) < (old_lens[:, None] + block_size - 1) // block_size
    return torch.equal(block_tables[:, :old_tables.shape[1]][held], old_tables[held])


def remember(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             block_tables: torch.Tensor, seq_lens_k: torch.Tensor) -> Mirror | None:
    """After a step that gathered k, v ([kv_heads, num_seqs, len, d], zero past each sequence's
    length): the layer's mirror holding them if this step grew the last one (a batch that lasts:
    a batch that changes every step pays no copy), else None with this step noted.

    A mirror is not built where it would take more memory than the layer's paged cache."""
    mirror = _mirror_of(k_cache)
    if mirror is None:
        key = id(k_cache)
        mirror = Mirror(weakref.ref(k_cache, lambda _: _mirrors.pop(key, None)), None, None)
        _mirrors[key] = mirror
    grew = _grew(mirror, block_tables, seq_lens_k, k_cache.shape[1])
    mirror.block_tables, mirror.seq_lens_k = _snapshot(block_tables, seq_lens_k)
    mirror.held = grew and _fill(mirror, k_cache, v_cache, k, v, longest(seq_lens_k) + MIRROR_SLACK_TOKENS)
    return mirror if mirror.held else None


def _fill(mirror: Mirror, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          capacity: int) -> bool:
    """Copy k, v into the mirror's buffers (the old ones where large enough), zero past them;
    False (buffers dropped) where they would outgrow the layer's paged cache."""
    kv_heads, num_seqs, width, d = k.shape
    shape = (kv_heads, num_seqs, max(width, capacity), d)  # (the gather is whole blocks, as wide as the tables)
    if 2 * math.prod(shape) * k.element_size() > _cache_bytes(k_cache, v_cache):
        mirror.k = mirror.v = None
        return False
    old = mirror.k
    if (old is None or old.dtype != k.dtype or old.numel() < math.prod(shape)
            or old.is_inference() != torch.is_inference_mode_enabled()):
        mirror.k = mirror.v = None  # (the old buffers go before the new ones are made)
        mirror.k, mirror.v = k.new_empty(shape), v.new_empty(shape)
    else:
        mirror.k, mirror.v = (b.view(-1)[:math.prod(shape)].view(shape) for b in (mirror.k, mirror.v))
    for buf, src in ((mirror.k, k), (mirror.v, v)):
        buf[:, :, :width].copy_(src)
        buf[:, :, width:].zero_()
    return True


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


def longest(seq_lens_k: torch.Tensor) -> int:
    """The step's longest context (once per step)."""
    return once_per_step("longest", (seq_lens_k,), lambda: int(seq_lens_k.max()))


def _cache_bytes(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    return k_cache.numel() * k_cache.element_size() + v_cache.numel() * v_cache.element_size()
