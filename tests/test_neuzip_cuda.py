"""NeuZip on the GPU: the Triton decoder equals the CPU reference bit for bit (run on the GPU box)."""

import pytest
import torch

from thrifty.neuzip import compress
from thrifty.neuzip import reference as R

pytestmark = pytest.mark.cuda


def _bits(x):
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 1000, R.GROUP * R.STEPS * 3 + 17, 4096 * 1024])
def test_triton_gpu_equals_reference(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 0.02).to(dtype)
    x[n // 2:] = torch.exp(torch.randn(n - n // 2, generator=g) * 8).to(dtype)  # long codes too
    if n > 4:
        x[:4] = float("nan")  # NaN bits must survive too
    c = compress(x)
    ref = c.decompress(impl="reference")
    assert torch.equal(_bits(ref), _bits(x))
    gpu = c.to("cuda")
    for launch in ({}, {"groups_per_prog": 1, "num_warps": 1}, {"groups_per_prog": 4, "num_warps": 4},
                   {"small_table": gpu._table("cuda")[1]}, {"pipelined": False}):
        out = torch.empty(x.shape, dtype=dtype, device="cuda")
        assert gpu.decompress(out=out, impl="triton", **launch) is out
        assert torch.equal(_bits(out.cpu()), _bits(ref))


@pytest.mark.parametrize("k", [0, 1, 3])
def test_triton_gpu_lossy_equals_reference(k):
    x = (torch.randn(300_001) * 0.02).bfloat16()
    c = compress(x, k)
    assert torch.equal(_bits(c.to("cuda").decompress().cpu()), _bits(c.decompress(impl="reference")))
