"""The 16-bit TopK + INT8 kernel (``bitnet.topk_kernel``, two keys per int32 word) against ``reference.py``: the same
values (``torch.equal``: a kept value that rounds to code 0 is +0 in the kernel, as in ``quant_kernel``, where the
reference's ``torch.round`` keeps −0), under TRITON_INTERPRET=1 on the CPU: every launch shape (several rows per
one-warp program, one warp per row, several warps per row), odd widths, ties, zeros, non-finite rows, the
sub-norm."""

import pytest
import torch

from thrifty.bitnet import quant_kernel as QK, reference as ref, topk_kernel as TK
from thrifty.triton_utils import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available("cpu") and not torch.cuda.is_available(),
                                reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.bfloat16, torch.float16)
# (rows, width): 1-3 rows per program at small widths (3 and 5 rows leave a program part empty), one warp at
# 130..2048 features, 2 and 3+ warps per row above
SHAPES = [(3, 1), (5, 2), (3, 3), (5, 33), (4, 130), (3, 257), (5, 384), (2, 1000), (2, 2049), (1, 4097)]


def rows_like_activations(n, d, dtype, seed):
    """Gaussian rows of different scales (one per row), with the special rows the kernel must get right."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g).mul(4).add(0.05)
    if n > 1 and d > 1:
        x[1, : d // 2 + 1] = -x[1, 0]  # more than half the row tied at one magnitude, both signs
        x[1, 1::3] = x[1, 0]
    if n > 2:
        x[2] = 0.0
    return x.to(dtype).to(DEVICE)


def test_launch_shapes_cover_every_path():
    """The SHAPES above reach every launch configuration: grouped rows, one warp, several warps."""
    configs = {(TK.launch_config(d)["ROWS"] > 1, TK.launch_config(d)["num_warps"]) for _, d in SHAPES}
    assert {(True, 1), (False, 1), (False, 2), (False, 4)} <= configs
    for d in (1, 384, 2048, 2049, 4096, 16384):
        cfg = TK.launch_config(d)
        assert cfg["PAIRS"] * 2 >= d and cfg["PAIRS"] // (32 * cfg["num_warps"]) <= TK.WORDS_PER_LANE


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_int8_is_the_reference_bit_for_bit(dtype):
    for i, (n, d) in enumerate(SHAPES):
        x = rows_like_activations(n, d, dtype, seed=i)
        for ratio in (0.5, 0.3):
            got = QK.quantize_rows(x, "topk_int8", topk_ratio=ratio)
            want = ref.quantize_topk_int8(x, ratio)
            assert torch.equal(got, want), (dtype, n, d, ratio)
            kept = got.ne(0).sum(-1)
            assert (kept <= ref.topk_count(d, ratio)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_magnitudes_and_non_finite_rows(dtype):
    info = torch.finfo(dtype)
    d = 77
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(3))
    x[0] *= info.tiny  # subnormal and tiny normal keys
    x[1] = x[1].sign() * info.max  # the largest key everywhere: all tied
    x[2, 5] = float("inf")
    x[3, 70] = float("nan")
    x[4, 0] = -float("inf")
    x = x.to(dtype).to(DEVICE)
    got = QK.quantize_rows(x, "topk_int8")
    want = ref.quantize_topk_int8(x)
    assert torch.equal(got[[0, 1, 5]], want[[0, 1, 5]])
    assert got[2:5].isnan().all() and want[2:5].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_sub_norm_rows_match_the_reference_on_the_kernels_normed_input(dtype):
    """With the sub-norm: the reference quantizer of exactly the row the kernel normalized (its 1/RMS, the
    casts BitLinear makes), bit for bit; and 1/RMS itself against float64."""
    for i, (n, d) in enumerate(SHAPES[3:]):
        x = rows_like_activations(n, d, dtype, seed=20 + i)
        x[2:] += 0.5  # no all-zero row: its 1/RMS is 1/sqrt(eps), not a rounding question
        w = (torch.rand(d, generator=torch.Generator().manual_seed(i)) + 0.5).to(DEVICE)
        got, rstd = QK._launch(x, "topk_int8", 1.0, 0.5, w, 1e-5, dtype)
        normed = ((x.float() * rstd[:, None]).to(dtype).float() * w).to(dtype)
        assert torch.equal(got, ref.quantize_topk_int8(normed)), (dtype, n, d)
        want_rstd = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-5)
        assert torch.allclose(rstd.double(), want_rstd, rtol=1e-6, atol=0)


def test_output_dtype_and_strided_rows():
    """fp32 output of a bf16 input (what a caller may ask) and rows with a stride longer than the width."""
    wide = rows_like_activations(4, 160, torch.bfloat16, seed=9)
    x = wide[:, :130]
    assert x.stride(0) == 160
    got = QK.quantize_rows(x, "topk_int8", out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, ref.quantize_topk_int8(x.float()))  # the fp32 values, not rounded to bf16
