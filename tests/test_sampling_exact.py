"""Adversarial checks of kernels/triton_sampling.py::sample_rows against an exact inverse CDF:
each row's uniform U is recomputed (the same tl.rand call), and the token must be the first
whose float64 cumulative softmax(logits / T) passes U x total (rows within a hair of a
boundary are skipped). Runs under Triton's interpreter without a GPU."""
import pytest
import torch

from triton_interpreter import HAS_TRITON, RUN_HERE, needs_kernels, rerun_under_interpreter

CHILD_TIMEOUT_S = 900
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
NEG_INF = float("-inf")
# (dtype, vocab): every pair on a GPU; under the interpreter (a program in ~20 ms) each
# dtype once and each size once: 19 leaves a partial tile (3 tiny chunks, the last short),
# 64 fills them (8 tiny chunks, two loop iterations each)
DTYPE_VOCABS = ([(d, v) for d in (torch.float32, torch.bfloat16) for v in (19, 64)] if HAS_CUDA
                else [(torch.float32, 19), (torch.bfloat16, 64)])
REPS = 8 if HAS_CUDA else 4  # seeds (so uniforms) per adversarial row


@pytest.mark.skipif(RUN_HERE or not HAS_TRITON, reason="the kernel runs in this process")
def test_exact_sampling_under_triton_interpreter():
    rerun_under_interpreter(__file__, CHILD_TIMEOUT_S)


def _uniforms(seeds):
    import triton
    import triton.language as tl

    @triton.jit
    def k(seed_ptr, out_ptr):
        row = tl.program_id(0)
        tl.store(out_ptr + row, tl.rand(tl.load(seed_ptr + row), tl.full((), 0, tl.int32)))
    out = torch.empty(len(seeds), dtype=torch.float32, device=DEVICE)
    k[(len(seeds),)](torch.as_tensor(seeds, dtype=torch.int64, device=DEVICE), out)
    return out.cpu().double()


def _with(row, values):
    """`row` with the columns of `values` ({col: logit}) set."""
    row = row.clone()
    for col, value in values.items():
        row[col] = value
    return row


def _cases(vocab, gen):
    """Adversarial rows: logits [num_cases, vocab] and their temperatures [num_cases]."""
    cases = [(torch.randn(vocab, generator=gen) * 3, t) for t in (1.0, 0.6, 1e-4, 100.0, 1e4)]  # plain
    no_mass, flat = torch.full((vocab,), NEG_INF), torch.zeros(vocab)
    cases += [
        (_with(no_mass, {vocab - 2: 0.5}), 1.0),                 # one finite
        (_with(no_mass, {3: -1e30}), 0.7),                       # one finite, very negative
        (_with(no_mass, {1: 2.0, vocab - 1: 2.0}), 1.0),         # two, far apart
        (flat, 1.0),                                             # flat
        (_with(flat, {vocab // 2: 60.0}), 1.0),                  # very peaked
        (_with(torch.randn(vocab, generator=gen), dict.fromkeys(range(0, vocab, 3), NEG_INF)), 1.3),  # banned
        (_with(torch.randn(vocab, generator=gen) * 0.01, {5: 8.0, 5 + 8: 8.0}), 1e-4),  # tiny T, tie across chunks
        (_with(torch.full((vocab,), -30.0), {0: 30.0, vocab - 1: 29.0}), 1.0),  # mass only at both ends
    ]
    return torch.stack([row for row, _ in cases]), torch.tensor([t for _, t in cases], dtype=torch.float32)


@needs_kernels
@pytest.mark.parametrize("dtype,vocab", DTYPE_VOCABS, ids=lambda v: str(v).removeprefix("torch."))
def test_tokens_are_the_exact_inverse_cdf(sampling, vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    base, temps = _cases(vocab, gen)
    logits = base.repeat(REPS, 1).to(dtype)
    temps = temps.repeat(REPS)
    seeds = list(range(1000, 1000 + logits.shape[0]))
    tokens = sampling.sample_rows(logits.to(DEVICE), temps.to(DEVICE),
                                  torch.tensor(seeds, dtype=torch.int64, device=DEVICE)).cpu()
    u = _uniforms(seeds)
    z = (logits.float() * (1.0 / temps)[:, None]).double()  # as the kernel: float32 x * (1 / T)
    p = torch.softmax(z, -1)
    cdf = p.cumsum(-1)
    checked = 0
    for r in range(logits.shape[0]):
        tok = int(tokens[r])
        assert 0 <= tok < vocab
        assert p[r, tok] > 0, (r, tok)  # never a token of probability 0 (-inf logit)
        target = u[r] * cdf[r, -1]
        if (cdf[r] - target).abs().min() < 1e-5:
            continue
        expected = int((cdf[r] <= target).sum())
        assert tok == expected, (r, tok, expected, float(u[r]))
        checked += 1
    assert checked > 0.8 * logits.shape[0]


@needs_kernels
@pytest.mark.parametrize("vocab", [19, 37])
def test_greedy_edge_rows(sampling, vocab):
    rows = [torch.full((vocab,), float("-inf")), torch.full((vocab,), float("-inf")), torch.zeros(vocab)]
    rows[1][vocab - 1] = -5.0
    rows[2][[9, 17]] = 1.0
    logits = torch.stack(rows)
    tokens = sampling.sample_rows(logits.to(DEVICE), torch.zeros(3, device=DEVICE),
                                  torch.arange(3, device=DEVICE)).cpu()
    assert tokens.tolist() == [0, vocab - 1, 9]
    # an all -inf row under sampling: a valid index, no crash
    tokens = sampling.sample_rows(logits[:1].to(DEVICE), torch.ones(1, device=DEVICE),
                                  torch.arange(1, device=DEVICE)).cpu()
    assert 0 <= int(tokens[0]) < vocab


@needs_kernels
def test_nan_rows_give_valid_indices(sampling):
    vocab = 37
    x = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    x[0, 5] = float("nan")
    x[1, :] = float("nan")
    x[2, 30] = float("inf")
    x[3, :] = float("nan")
    x[3, 11] = 1.0
    for t in (0.0, 1.0):
        tokens = sampling.sample_rows(x.to(DEVICE), torch.full((4,), t, device=DEVICE),
                                      torch.arange(4, device=DEVICE)).cpu()
        assert ((tokens >= 0) & (tokens < vocab)).all(), (t, tokens)


@needs_kernels
@pytest.mark.parametrize("temperature", [1e38, float("inf")])  # 1e300 from the request: inf in float32
def test_huge_temperature_is_uniform_not_nan(sampling, temperature):
    """SamplingParams accepts any finite temperature: 1 / T may round to 0 (or a subnormal);
    banned tokens and the columns past the vocabulary must still never be drawn, and the
    draw stays spread over the others (a NaN mass would pin every draw to one token)."""
    vocab, n = 37, 48
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 5
    logits[:, 4] = float("-inf")
    tokens = sampling.sample_rows(logits.to(DEVICE), torch.full((n,), temperature, device=DEVICE),
                                  torch.arange(n, device=DEVICE)).cpu()
    assert ((tokens >= 0) & (tokens < vocab) & (tokens != 4)).all()
    assert len(set(tokens.tolist())) > 10
