"""The host-side arrays of one step, and their trip to the device.

Built with numpy from the scheduled sequences. Decode-only steps (one token per
sequence, the common case in a busy engine) take a short path with no per-token
loops, and with a few sequences one in Python lists; the general path handles
prefill chunks over cached prefixes too.
`StagingBuffer` sends a step's arrays to the GPU in one host-to-device copy.
"""
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence

# Decode-only steps of up to this many sequences build their arrays from Python lists
# (`_few_decode_rows`): numpy's cost per call, not the arithmetic, is what a few rows pay, and
# in an engine's step (the weights having just streamed through the caches) the ~20 numpy calls
# of the general path took ~0.22 ms at one sequence on the 2-core AVX512 VM, against ~30 us
# measured alone (benchmarks/RESULTS.md "One-sequence decode steps: host time").
LIST_PATH_MAX_SEQS = 8
ALIGN_BYTES = 256  # each array starts as aligned as its own allocation would (Triton specializes on 16)


@dataclass
class StepInputs:
    input_ids: np.ndarray      # [num_tokens] int64
    positions: np.ndarray      # [num_tokens] int64
    slot_mapping: np.ndarray   # [num_tokens] int64
    cu_seqlens_q: np.ndarray   # [num_seqs + 1] int32
    seq_lens_k: np.ndarray     # [num_seqs] int32
    block_tables: np.ndarray   # [num_seqs, max_blocks] int32, -1 padded
    sampling: list[int]        # indices of the sequences whose last token is sampled
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_seqlen_q == 1

    @property
    def logits_indices(self) -> np.ndarray:
        """Rows of the flat batch whose logits are sampled.  # [num_sampled]"""
        return self.cu_seqlens_q[1:][self.sampling].astype(np.int64) - 1


def build_step_inputs(seqs: list[Sequence], block_size: int, num_pending: int = 0) -> StepInputs:
    """The arrays of one step of `seqs`, each computing its `num_scheduled_tokens`.

    `num_pending` (decode only): tokens each sequence has sampled on the device that the
    host has not seen yet (a chained decode round). Positions, slots and lengths count
    them; the input ids, unknown here, are zeros for the device to fill in.
    """
    if len(seqs) <= LIST_PATH_MAX_SEQS and all(s.num_scheduled_tokens == 1 for s in seqs):
        return _few_decode_rows(seqs, block_size, num_pending)
    starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs)) + num_pending
    q_lens = np.fromiter((s.num_scheduled_tokens for s in seqs), np.int64, len(seqs))
    ends = starts + q_lens
    tables = block_tables(seqs)
    assert not num_pending or q_lens.max() == 1, "only decode steps run ahead of the host"
    if q_lens.max() == 1:
        input_ids = (np.zeros(len(seqs), np.int64) if num_pending else
                     np.fromiter((s.token_ids[s.num_computed_tokens] for s in seqs), np.int64, len(seqs)))
        positions = starts
        rows = np.arange(len(seqs))
    else:
        flat_ids: list[int] = []  # list slices joined at C speed, then one conversion
        for s in seqs:
            flat_ids += s.token_ids[s.num_computed_tokens:s.num_computed_tokens + s.num_scheduled_tokens]
        input_ids = np.array(flat_ids, np.int64)
        rows = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(int(q_lens.sum())) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens) + starts[rows]
    slots = tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    cu_q = np.zeros(len(seqs) + 1, np.int32)
    np.cumsum(q_lens, out=cu_q[1:])
    sampling = [i for i, s in enumerate(seqs) if ends[i] == s.num_tokens + num_pending]
    return StepInputs(input_ids, positions, slots, cu_q, ends.astype(np.int32), tables, sampling,
                      int(q_lens.max()), int(ends.max()))


def _few_decode_rows(seqs: list[Sequence], block_size: int, num_pending: int) -> StepInputs:
    """`build_step_inputs` for a decode-only step of a few sequences, in Python lists made into
    arrays at the end: the same arrays, from 6 numpy calls instead of ~20 (module docstring)."""
    positions = [s.num_computed_tokens + num_pending for s in seqs]
    input_ids = [0] * len(seqs) if num_pending else [s.token_ids[s.num_computed_tokens] for s in seqs]
    slots = [s.block_table[p // block_size] * block_size + p % block_size for s, p in zip(seqs, positions)]
    lens = [p + 1 for p in positions]  # each sequence's context, this token included
    sampling = [i for i, (s, n) in enumerate(zip(seqs, lens)) if n == s.num_tokens + num_pending]
    return StepInputs(np.array(input_ids, np.int64), np.array(positions, np.int64), np.array(slots, np.int64),
                      np.arange(len(seqs) + 1, dtype=np.int32), np.array(lens, np.int32), block_tables(seqs),
                      sampling, 1, max(lens))


def block_tables(seqs: list[Sequence]) -> np.ndarray:
    width = max(len(s.block_table) for s in seqs)
    tables = np.full((len(seqs), width), -1, np.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_table)] = s.block_table
    return tables


class StagingBuffer:
    """Sends several numpy arrays to a CUDA device in one copy from pinned memory.

    A step's arrays are packed into one pinned byte buffer (kept and grown as needed),
    copied to the device in one non-blocking transfer, and handed back as typed views
    of the device bytes. Separate copies each cost a pinned allocation and a launch, and
    the GPU, idle at that point of a round, waited for each in turn. The buffer is
    reused only once the previous transfer out of it has finished.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._pinned = torch.empty(0, dtype=torch.uint8, pin_memory=True)
        self._copied: torch.cuda.Event | None = None

    def to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        offsets, end = [], 0
        for array in arrays:
            offsets.append(end)
            end += -(-array.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        if self._copied is not None:
            self._copied.synchronize()
        if end > self._pinned.numel():
            self._pinned = torch.empty(2 * end, dtype=torch.uint8, pin_memory=True)
        host = self._pinned.numpy()
        for array, offset in zip(arrays, offsets):
            host[offset:offset + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        device_bytes = self._pinned[:end].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return [device_bytes[offset:offset + array.nbytes].view(_TORCH_DTYPES[array.dtype]).view(array.shape)
                for array, offset in zip(arrays, offsets)]


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
