"""The inverse-CDF sampling kernels (`kernels/triton_sampling.py`).

Runs natively on a GPU. Without one, the file re-runs itself in a child process with
`TRITON_INTERPRET=1` set from the start (tests/triton_interpreter.py). The exact-result
tests also run with tiny chunks, so that a row spans several programs and loop iterations.
"""
import pytest
import torch

from triton_interpreter import HAS_TRITON, RUN_HERE, needs_kernels, rerun_under_interpreter

HAS_CUDA = torch.cuda.is_available()
CHILD_TIMEOUT_S = 300
DEVICE = "cuda" if HAS_CUDA else "cpu"
# The interpreter runs a program in about 20 ms: fewer draws there. The draws use fixed
# seeds, so the outcome is the same on every run; a frequency's standard deviation is at
# most sqrt(0.25 / NUM_DRAWS), and the bound is 4.5 of them (0.016 on a GPU, 0.09 here).
NUM_DRAWS = 20_000 if HAS_CUDA else 600
FREQ_TOLERANCE = 4.5 * (0.25 / NUM_DRAWS) ** 0.5
# a run-time value, not a compiled variant: one of them is enough for the interpreter
FREQ_TEMPERATURES = [0.6, 1.7] if HAS_CUDA else [1.7]


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="the kernel runs in this process")
def test_sampling_kernel_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


def _draw(sampling, logits, temperature, seeds):
    n = logits.shape[0]
    temperature = torch.as_tensor(temperature, dtype=torch.float32).expand(n).contiguous()
    return sampling.sample_rows(logits.to(DEVICE), temperature.to(DEVICE),
                                torch.as_tensor(seeds, dtype=torch.int64).to(DEVICE)).cpu()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_take_the_first_argmax_of_strided_rows(sampling, dtype):
    wide = torch.randn(6, 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    wide[1, [3, 9, 17]] = 50.0  # a three-way tie: the lowest index wins, as with torch.argmax
    wide[2, :] = -1.0           # a row that is all ties
    logits = wide[:, :19]       # rows strided, as the LM head's padded-vocab view gives
    tokens = _draw(sampling, logits, 0.0, range(6))
    assert torch.equal(tokens, logits.float().argmax(-1))
    assert tokens[1] == 3 and tokens[2] == 0


@needs_kernels
@pytest.mark.parametrize("temperature", FREQ_TEMPERATURES)
def test_frequencies_match_the_softmax(temperature):
    from nanovllm.kernels import triton_sampling as sampling
    vocab = 12
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    logits[5] = float("-inf")  # a banned token is never drawn
    tokens = _draw(sampling, logits.expand(NUM_DRAWS, vocab), temperature, range(NUM_DRAWS))
    freq = torch.bincount(tokens, minlength=vocab).double() / NUM_DRAWS
    expected = torch.softmax(logits.double() / temperature, -1)
    assert freq[5] == 0
    assert (freq - expected).abs().max().item() < FREQ_TOLERANCE
    assert (expected > 0.05).sum() >= 3  # a real distribution, not a forced choice


@needs_kernels
def test_a_rows_draw_depends_only_on_its_seed(sampling):
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(5)) * 0.3  # flat: draws vary
    seeds = list(range(100, 108))
    alone = [int(_draw(sampling, logits[i:i + 1], 1.0, [seeds[i]])) for i in range(8)]
    assert len(set(alone)) > 3  # different seeds, different draws
    mixed = _draw(sampling, logits.flip(0), 1.0, seeds[::-1]).tolist()[::-1]
    assert mixed == alone  # same seed, same draw, wherever the row sits in the batch
    other_seeds = _draw(sampling, logits, 1.0, [s + 1000 for s in seeds]).tolist()
    assert other_seeds != alone


@needs_kernels
def test_mixed_greedy_and_random_rows(sampling):
    logits = torch.randn(10, 30, generator=torch.Generator().manual_seed(7)) * 0.3
    temperature = torch.tensor([0.0, 1.0] * 5)
    tokens = _draw(sampling, logits, temperature, range(10))
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))
    draws = {tuple(_draw(sampling, logits, temperature, range(s, s + 10))[1::2].tolist()) for s in range(0, 30, 10)}
    assert len(draws) > 1  # the random rows really are random
