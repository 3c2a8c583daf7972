"""The fused sampling kernels with a grammar bitmask (structured outputs).

Runs natively on a GPU, or in a child process under Triton's interpreter
(tests/triton_interpreter.py). A masked token is never drawn; greedy rows take the argmax
of the allowed tokens; free rows (all bits set) draw as without a mask.
"""
import pytest
import torch

from triton_interpreter import HAS_TRITON, RUN_HERE, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
CHILD_TIMEOUT_S = 300
DEVICE = "cuda" if HAS_CUDA else "cpu"
NUM_DRAWS = 20_000 if HAS_CUDA else 200  # the interpreter runs a program in ~20 ms
FREQ_TOLERANCE = 4.5 * (0.25 / NUM_DRAWS) ** 0.5


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="the kernel runs in this process")
def test_masked_sampling_kernel_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """allowed: [rows, vocab] bool -> [rows, ceil(vocab / 32)] int32 words."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def _draw(sampling, logits, temperature, bitmask, seeds):
    n = logits.shape[0]
    temperature = torch.as_tensor(temperature, dtype=torch.float32).expand(n).contiguous()
    return sampling.sample_rows(logits.to(DEVICE), temperature.to(DEVICE),
                                torch.as_tensor(seeds, dtype=torch.int64).to(DEVICE), bitmask.to(DEVICE)).cpu()


@needs_kernels
def test_greedy_rows_take_the_argmax_of_allowed_tokens(sampling):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 70, generator=gen)
    allowed = torch.rand(4, 70, generator=gen) < 0.3
    allowed[3] = True  # a free row
    tokens = _draw(sampling, logits, 0.0, _bitmask(allowed), range(4))
    assert torch.equal(tokens, logits.masked_fill(~allowed, float("-inf")).argmax(-1))


@needs_kernels
def test_sampled_frequencies_follow_the_masked_softmax():
    from nanovllm.kernels import triton_sampling as sampling
    vocab, temperature = 40, 0.9
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(4))
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[1, 5, 6, 33, 39]] = True  # words 0 and 1, the last one past a word boundary
    masked = logits.masked_fill(~allowed, float("-inf"))
    tokens = _draw(sampling, logits.expand(NUM_DRAWS, vocab), temperature,
                   _bitmask(allowed.expand(NUM_DRAWS, vocab)), range(NUM_DRAWS))
    freq = torch.bincount(tokens, minlength=vocab).double() / NUM_DRAWS
    expected = torch.softmax(masked.double() / temperature, -1)
    assert freq[~allowed].sum() == 0
    assert (freq - expected).abs().max().item() < FREQ_TOLERANCE


@needs_kernels
def test_free_rows_draw_as_without_a_mask(sampling):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    everything = _bitmask(torch.ones(6, 50, dtype=torch.bool))
    with_mask = _draw(sampling, logits, 1.0, everything, range(6))
    without = sampling.sample_rows(logits.to(DEVICE), torch.ones(6, device=DEVICE),
                                   torch.arange(6, device=DEVICE)).cpu()
    assert torch.equal(with_mask, without)
