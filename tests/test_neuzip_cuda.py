"""NeuZip on the GPU: the Triton decoder equals the CPU reference bit for bit (run on the GPU box)."""

import pytest
import torch

from thrifty.neuzip import compress
from thrifty.neuzip import reference as R

pytestmark = pytest.mark.cuda


def _bits(x):
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 1000, R.GROUP * 256 * 3 + 17, R.GROUP * 64 * 16, 4096 * 1024])
@pytest.mark.parametrize("steps", R.LANE_STEPS)
def test_triton_gpu_equals_reference(dtype, n, steps):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 0.02).to(dtype)
    x[n // 2:] = torch.exp(torch.randn(n - n // 2, generator=g) * 8).to(dtype)  # long codes too
    if n > 4:
        x[:4] = float("nan")  # NaN bits must survive too
    c = compress(x, steps=steps)
    ref = c.decompress(impl="reference")
    assert torch.equal(_bits(ref), _bits(x))
    gpu = c.to("cuda")
    launches = [{}, {"groups_per_prog": 1, "num_warps": 1}, {"groups_per_prog": 4, "num_warps": 4},
                {"groups_per_prog": 1, "num_warps": 2}, {"asm": False}, {"asm": False, "groups_per_prog": 1},
                {"kernel": "v2", "small_table": gpu._table("cuda", "small")}, {"kernel": "v1"}]
    launches += [{"small": True}, {"small": True, "asm": False, "groups_per_prog": 1}, {"table16": False}]
    for launch in launches:
        out = torch.empty(x.shape, dtype=dtype, device="cuda")
        assert gpu.decompress(out=out, impl="triton", **launch) is out
        assert torch.equal(_bits(out.cpu()), _bits(ref))


@pytest.mark.parametrize("k", [0, 1, 3])
def test_triton_gpu_lossy_equals_reference(k):
    x = (torch.randn(300_001) * 0.02).bfloat16()
    c = compress(x, k)
    gpu = c.to("cuda")
    ref = _bits(c.decompress(impl="reference"))
    for launch in ({}, {"asm": False}, {"table16": False}, {"small": True}, {"kernel": "v2"}):
        assert torch.equal(_bits(gpu.decompress(**launch).cpu()), ref)


@pytest.mark.parametrize("steps", R.LANE_STEPS)
def test_triton_gpu_special_values(steps):
    """All-zero, denormal, inf/NaN patterns and single elements, every dtype, on the GPU."""
    for dtype, pat in ((torch.bfloat16, [0, 0x8000, 1, 0x807F, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x7FA5]),
                       (torch.float16, [0, 0x8000, 1, 0x83FF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x7D5A])):
        sp = torch.tensor(pat, dtype=torch.int32).to(torch.int16).view(dtype)
        for x in (torch.zeros(100_003, dtype=dtype), sp.repeat(10_007), sp[4:5], sp[2:3].repeat(R.GROUP * steps)):
            c = compress(x, steps=steps)
            for launch in ({}, {"asm": False}, {"groups_per_prog": 1}, {"small": True}, {"table16": False}):
                assert torch.equal(_bits(c.to("cuda").decompress(**launch).cpu()), _bits(x))
    raw = torch.tensor([0, -2**31, 1, -2**31 + 0x7FFFFF, 0x7F800000, -8388608, 0x7FC00000, 0x7F800001, -1, 0x7FA5A5A5],
                       dtype=torch.int32)
    for x in (raw.view(torch.float32).repeat(10_007), torch.zeros(1)):
        c = compress(x, steps=steps)
        for launch in ({}, {"small": True}, {"asm": False}):
            assert torch.equal(_bits(c.to("cuda").decompress(**launch).cpu()), _bits(x))
