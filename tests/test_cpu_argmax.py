"""The CPU's two-pass argmax (kernels/cpu_argmax.py) gives torch's argmax exactly: random rows,
ties across and within chunks (the lowest index wins), NaN and -inf rows, vocabularies only a
small chunk divides, a strided view, and sizes it leaves to torch; both its C++ kernel (fp32,
bf16, fp16) and, without one, its torch ops."""
import pytest
import torch

from nanovllm.kernels import cpu_argmax
from nanovllm.kernels.cpu_argmax import argmax_rows
from nanovllm.utils import cpp_compiler


@pytest.fixture(params=["cpp", "torch"], autouse=True)
def kernel(request, monkeypatch):
    """Each test with the C++ kernel (where a compiler is found) and with the torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_argmax, "_build", lambda dtype: None)
    elif not cpp_compiler.cpp_compiler_found():
        pytest.skip("no C++ compiler found")
    return request.param


@pytest.mark.parametrize("vocab", [49152, 151936, 32000, 8192 * 3 + 128])
def test_equals_torch_argmax_on_random_rows(vocab):
    x = torch.randn(7, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(argmax_rows(x), x.argmax(-1))


def test_ties_and_special_values_go_where_torch_puts_them():
    vocab = 16384
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(0))
    x[0, [5000, 3000, 12000]] = 50.0          # tie across chunks: the lowest index
    x[1, [2049, 2050]] = 50.0                  # tie inside one chunk
    x[2] = float("-inf")                       # all -inf: index 0
    x[3, [9000, 100]] = float("nan")           # NaN beats everything: the first NaN
    x[4, vocab - 1] = float("inf")             # the last column
    x[5] = 1.0                                 # all equal
    expected = x.argmax(-1)
    assert expected.tolist()[:3] == [3000, 2049, 0]
    assert torch.equal(argmax_rows(x), expected)


def test_strided_and_unusual_shapes():
    x = torch.randn(4, 2 * 16384, generator=torch.Generator().manual_seed(1))
    view = x[:, ::2]                            # not unit stride: torch's argmax
    assert torch.equal(argmax_rows(view), view.argmax(-1))
    sliced = x[1:3]                             # a contiguous slice of rows
    assert torch.equal(argmax_rows(sliced), sliced.argmax(-1))
    odd = torch.randn(3, 10007)                 # no chunk divides it
    assert torch.equal(argmax_rows(odd), odd.argmax(-1))
    one = torch.randn(1, 49152)
    assert torch.equal(argmax_rows(one), one.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_dtype_with_ties_and_nan(kernel, dtype):
    x = torch.randn(9, 49152 + 5, generator=torch.Generator().manual_seed(2)).to(dtype)  # (+5: a vector tail)
    x[0, [7, 40000]] = 30.0
    x[1, [49152 + 4, 11]] = float("nan")
    x[2, 49152 + 3] = float("inf")
    x[3] = -0.0
    x[3, 100] = 0.0  # equal to -0.0: index 0 wins
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    if kernel == "cpp":
        assert cpu_argmax._build(dtype) is not None
