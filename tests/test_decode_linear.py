"""The few-row linear kernel (decode matmuls, float32 and bfloat16) against float64, and where it is used."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.layers import decode_linear
from pdserve.engine.layers.decode_linear import KERNEL_MAX_ROWS, decode_linear_kernel, kernel_applies
from pdserve.engine.layers.base import linear
from tests.threads import torch_threads

pytestmark = pytest.mark.skipif(not decode_linear.build_kernel(), reason="no C++ compiler: float32 layers use torch's GEMM")


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 7, 11, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("out_features,in_features", [(1, 16), (5, 32), (47, 64), (48, 128), (50, 176), (301, 768)])
def test_kernel_matches_float64_for_every_tile_shape(num_rows, out_features, in_features):
    """Row tiles of 8, 4 and 1-3 rows (11 = 8 + 3, 7 = 4 + 3), output features mod 3, 6 and 8 (and the one-row remainder), work
    items of 48 features and a partial last one; 2 threads give the 1-thread bits."""
    g = torch.Generator().manual_seed(num_rows * 1000 + out_features)
    x = torch.randn(num_rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    assert kernel_applies(x, weight)
    got = decode_linear_kernel(x, weight)
    assert got.dtype == torch.float32 and got.shape == (num_rows, out_features)
    want = x.double() @ weight.double().T
    tol = 1e-6 * (x.double().abs() @ weight.double().abs().T) + 1e-6
    assert ((got.double() - want).abs() <= tol).all()
    with torch_threads(2):
        assert torch.equal(decode_linear_kernel(x, weight), got)


def test_a_rows_bits_do_not_depend_on_the_other_rows():
    """Each output has its own accumulator and a fixed summation order: row 0 alone, or among
    3, 4 or 16 rows, has the same bits."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(KERNEL_MAX_ROWS, 256, generator=g)
    weight = torch.randn(100, 256, generator=g)
    alone = decode_linear_kernel(x[:1], weight)
    for num_rows in (3, 4, KERNEL_MAX_ROWS):
        assert torch.equal(decode_linear_kernel(x[:num_rows], weight)[:1], alone)


def test_decode_sized_calls_take_the_kernel_and_others_torch():
    weight = torch.randn(32, 64)
    assert kernel_applies(torch.ones(1, 64), weight)
    assert kernel_applies(torch.ones(KERNEL_MAX_ROWS, 64), weight)
    assert not kernel_applies(torch.ones(KERNEL_MAX_ROWS + 1, 64), weight)  # prefill: MKL's GEMM
    assert not kernel_applies(torch.ones(0, 64), weight)
    assert not kernel_applies(torch.ones(2, 40), torch.ones(32, 40))  # K not a multiple of 16
    assert kernel_applies(torch.ones(2, 64, dtype=torch.bfloat16), weight.bfloat16())
    assert not kernel_applies(torch.ones(2, 48, dtype=torch.bfloat16), torch.ones(32, 48, dtype=torch.bfloat16))
    assert not kernel_applies(torch.ones(2, 64), weight.bfloat16())  # mixed dtypes
    with pytest.raises(RuntimeError, match="refused K=40"):  # the kernel checks too
        decode_linear_kernel(torch.ones(2, 40), torch.ones(32, 40))
    # layers.linear: the same values either way, with the bias and leading dimensions kept
    bias = torch.randn(32)
    for shape in ((3, 64), (2, 5, 64), (KERNEL_MAX_ROWS + 4, 64), (2, 40)):
        x = torch.randn(*shape)
        w = weight if shape[-1] == 64 else torch.randn(32, 40)
        torch.testing.assert_close(linear(x, w, bias), torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_rows", [1, 3, 4, 9, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("out_features,in_features", [(1, 32), (47, 64), (301, 768)])
def test_bfloat16_kernel_matches_float64_within_one_rounding(num_rows, out_features, in_features):
    """bfloat16 in and out, float32 accumulation: within a bfloat16 rounding (2^-8 relative) of the
    float64 product of the same bfloat16 values, plus float32 accumulation error; rows independent."""
    g = torch.Generator().manual_seed(num_rows * 100 + out_features)
    x = torch.randn(num_rows, in_features, generator=g).bfloat16()
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    assert kernel_applies(x, weight)
    got = decode_linear_kernel(x, weight)
    assert got.dtype == torch.bfloat16 and got.shape == (num_rows, out_features)
    want = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * scale + 1e-6).all()
    assert torch.equal(decode_linear_kernel(x[:1], weight), got[:1])
