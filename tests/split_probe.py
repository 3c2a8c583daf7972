"""A Triton probe of the split-KV tile shares (kernels/triton_paged_tiles.py), for the tests: which tiles
each split covers, and which split `split_of_last_key` names. Imported only where triton is."""
import triton
import triton.language as tl

from nanovllm.kernels.triton_paged_tiles import split_of_last_key, split_tile_range


@triton.jit
def splits_kernel(out_ptr, kv_end, num_splits, BLOCK_N: tl.constexpr):
    """out [2 * num_splits + 1]: each split's (tile_begin, tile_end), then split_of_last_key."""
    split = tl.program_id(0)
    tile_begin, _, _, tile_end = split_tile_range(kv_end, 0, split, num_splits, BLOCK_N)
    tl.store(out_ptr + 2 * split, tile_begin)
    tl.store(out_ptr + 2 * split + 1, tile_end)
    tl.store(out_ptr + 2 * num_splits, split_of_last_key(kv_end, num_splits, BLOCK_N))
