"""L2 prefetch of the weights a decode step is about to multiply by (Hopper and later): an
experiment, measured by bench_l2_prefetch.py (no gain; RESULTS.md "B1").

A decode step's matrix products have few rows, so each one is a stream of its weights
(4-12 MiB a product for Qwen3-0.6B) that starts cold: the product's first tiles wait
the full memory latency, and a small product ends before it has enough bytes in
flight to reach the memory bandwidth. `WeightPrefetch` asks the memory system, in one
tiny launch, to bring a list of weight tensors into L2 with bulk prefetches
(`cp.async.bulk.prefetch.L2`, fire-and-forget: the launch ends as soon as the requests
are issued), so the products that follow read most of their weights from L2.
"""
import torch
import triton
import triton.language as tl

CHUNK_BYTES = 16 << 10  # bytes per bulk prefetch request
CHUNKS_PER_PROGRAM = 32  # one warp, one request per lane


def supported(device: torch.device) -> bool:
    """Bulk prefetches need compute capability 9.0 (Hopper) or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def _prefetch_l2_kernel(table_ptr, num_chunks, BLOCK: tl.constexpr):
    """Each lane issues one bulk L2 prefetch of a table row (address, bytes)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < num_chunks
    addr = tl.load(table_ptr + 2 * idx, mask=mask, other=0)
    nbytes = tl.load(table_ptr + 2 * idx + 1, mask=mask, other=0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


class WeightPrefetch:
    """One launch that prefetches `tensors` into L2; built once, safe to capture in graphs
    (the tensors' storage must not move afterwards)."""

    def __init__(self, tensors: list[torch.Tensor], chunk_bytes: int = CHUNK_BYTES):
        assert chunk_bytes % 16 == 0
        rows = []
        for t in tensors:
            assert t.is_cuda and t.is_contiguous()
            start, nbytes = t.data_ptr(), t.numel() * t.element_size()
            assert start % 16 == 0
            nbytes -= nbytes % 16  # bulk requests move multiples of 16 bytes
            rows += [(start + off, min(chunk_bytes, nbytes - off)) for off in range(0, nbytes, chunk_bytes)]
        self.num_chunks = len(rows)
        self.table = torch.tensor(rows, dtype=torch.int64, device=tensors[0].device)  # [chunks, 2]
        self.nbytes = sum(n for _, n in rows)

    def __call__(self) -> None:
        grid = (triton.cdiv(self.num_chunks, CHUNKS_PER_PROGRAM),)
        _prefetch_l2_kernel[grid](self.table, self.num_chunks, BLOCK=CHUNKS_PER_PROGRAM, num_warps=1)
