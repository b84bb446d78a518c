"""NeuZip on the GPU: the Triton decoder equals the CPU reference bit for bit (run on the GPU box)."""

import numpy as np
import pytest
import torch

from thrifty.neuzip import compress
from thrifty.neuzip import reference as R

pytestmark = pytest.mark.cuda


def _bits(x):
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def _data(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 0.02).to(dtype)
    x[n // 2:] = torch.exp(torch.randn(n - n // 2, generator=g) * 8).to(dtype)  # long codes too
    if n > 4:
        x[:4] = float("nan")  # NaN bits must survive too
    return x


def _variants(x, launches, **kw):
    """(compressed x, launches to check): single symbols with every launch variant, and pair symbols (chosen
    per tensor by default; forced here wherever <= 4096 pairs occur) with the one pair kernel's launch."""
    out = [(compress(x, pairs=False, **kw), launches)]
    try:
        out.append((compress(x, pairs=True, **kw), [{}]))
    except ValueError as e:
        if "distinct pairs" not in str(e):
            raise
    return out


def _check(x, launches, **kw):
    for c, variants in _variants(x, launches, **kw):
        _check_one(c, x, variants)


def _check_one(c, x, launches):
    ref = c.decompress(impl="reference")
    assert torch.equal(_bits(ref), _bits(x))
    gpu = c.to("cuda")
    for launch in launches:
        if launch.get("kernel") == "v2":
            launch = dict(launch, small_table=gpu._table("cuda", "small"))
        out = torch.empty(x.shape, dtype=x.dtype, device="cuda")
        assert gpu.decompress(out=out, impl="triton", **launch) is out
        assert torch.equal(_bits(out.cpu()), _bits(ref)), launch


# every launch variant on bf16; the core ones on the other dtypes (each variant x dtype x lane length compiles)
ALL_LAUNCHES = [{}, {"groups_per_prog": 1, "num_warps": 1}, {"groups_per_prog": 4, "num_warps": 4},
                {"groups_per_prog": 1, "num_warps": 2}, {"asm": False}, {"asm": False, "groups_per_prog": 1},
                {"kernel": "v2"}, {"kernel": "v1"}, {"small": True},
                {"small": True, "asm": False, "groups_per_prog": 1}, {"table16": False}]
CORE_LAUNCHES = [{}, {"groups_per_prog": 1, "num_warps": 2}, {"asm": False}, {"kernel": "v2"}, {"kernel": "v1"},
                 {"small": True}]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 1000, R.GROUP * 256 * 3 + 17, R.GROUP * 64 * 16])
@pytest.mark.parametrize("steps", R.LANE_STEPS)
def test_triton_gpu_equals_reference(dtype, n, steps):
    x = _data(n, dtype)
    _check(x, ALL_LAUNCHES if dtype == torch.bfloat16 else CORE_LAUNCHES, steps=steps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_gpu_large(dtype):
    """4M elements (many full programs), default lane length."""
    x = _data(4096 * 1024, dtype)
    _check(x, [{}, {"asm": False}, {"kernel": "v2"}])


@pytest.mark.parametrize("steps", R.LANE_STEPS)
def test_triton_gpu_worst_case_lanes(steps):
    """Lanes of only 12-bit codes (192 units, the most a uint8 lane length holds), then a mixed group."""
    from thrifty.neuzip.tensor import _from_streams

    lengths = np.zeros(256, np.uint8)
    lengths[:13] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 12]  # a complete prefix code
    n = R.GROUP * steps * 2 + 100
    sym = np.full(n, 12, np.uint8)
    sym[R.GROUP * steps:] = np.random.default_rng(steps).choice([0, 11, 12], n - R.GROUP * steps)
    words, lane_len, offs = R.encode_symbols(sym, lengths, steps)
    assert lane_len[:R.GROUP].tolist() == [192] * R.GROUP
    s = R.Streams(words, lane_len, offs, np.zeros(n, np.uint8), lengths, np.zeros(256, np.int64), steps)
    y = torch.from_numpy(sym.astype(np.int16) << 7).view(torch.bfloat16)
    _check_one(_from_streams(s, y, None), y, [{}, {"groups_per_prog": 1}, {"asm": False}, {"kernel": "v2"},
                                              {"kernel": "v1"}])


@pytest.mark.parametrize("k", [0, 1, 3])
def test_triton_gpu_lossy_equals_reference(k):
    x = (torch.randn(300_001) * 0.02).bfloat16()
    ref = _bits(R.round_mantissa(x, k))
    for c, launches in _variants(x, ({}, {"asm": False}, {"table16": False}, {"small": True}, {"kernel": "v2"}),
                                 mantissa_bits=k):
        gpu = c.to("cuda")
        assert torch.equal(_bits(c.decompress(impl="reference")), ref)
        for launch in launches:
            assert torch.equal(_bits(gpu.decompress(**launch).cpu()), ref)


@pytest.mark.parametrize("steps", R.LANE_STEPS)
def test_triton_gpu_special_values(steps):
    """All-zero, denormal, inf/NaN patterns and single elements, every dtype, on the GPU."""
    for dtype, pat in ((torch.bfloat16, [0, 0x8000, 1, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x7FA5]),
                       (torch.float16, [0, 0x8000, 1, 0x83FF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x7D5A])):
        sp = torch.tensor(pat, dtype=torch.int32).to(torch.int16).view(dtype)
        for x in (torch.zeros(100_003, dtype=dtype), sp.repeat(10_007), sp[4:5], sp[2:3].repeat(R.GROUP * steps)):
            for c, launches in _variants(x, ({}, {"asm": False}, {"groups_per_prog": 1}, {"small": True},
                                             {"table16": False}), steps=steps):
                for launch in launches:
                    assert torch.equal(_bits(c.to("cuda").decompress(**launch).cpu()), _bits(x))
    raw = torch.tensor([0, -2**31, 1, -2**31 + 0x7FFFFF, 0x7F800000, -8388608, 0x7FC00000, 0x7F800001, -1, 0x7FA5A5A5],
                       dtype=torch.int32)
    for x in (raw.view(torch.float32).repeat(10_007), torch.zeros(1)):
        for c, launches in _variants(x, ({}, {"small": True}, {"asm": False}), steps=steps):
            for launch in launches:
                assert torch.equal(_bits(c.to("cuda").decompress(**launch).cpu()), _bits(x))
