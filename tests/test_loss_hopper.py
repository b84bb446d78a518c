"""thrifty.loss path="hopper" (issue #32): the persistent TMA forward kernel (forward_tma.py) against float64 and
against the default kernels -- under the interpreter on the CPU (host TMA descriptors run there), natively on
CUDA (``cuda``-marked, at GPU tile sizes). Every test checks that the Hopper kernel really ran (its counter)."""

import pytest
import torch

from thrifty.loss import linear_cross_entropy
from thrifty.loss import forward_tma

from test_loss import DEVICE, GRAD_TOL, HAVE_KERNELS, assert_close, loss_and_grads, make, needs_kernels, oracle, rel


def _run_hopper(e, c, b, t, programs=None, **opts):
    before = forward_tma.STATS["tma"]
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton", path="hopper",
                         kernel_config=dict(hopper=dict(programs=programs)), **opts)
    assert forward_tma.STATS["tma"] == before + 1, "path='hopper' did not run the TMA forward kernel"
    return got


# (N, D, V, ignore_every): odd N, odd V, a vocabulary smaller than one tile, several row blocks (interpreter
# tiles are 16 x 32), ignored tokens; programs: one per SM (capped at the tile count) or a few, so that a
# program's range spans row blocks and a row block is split over programs
SHAPES = [(37, 40, 300, 5), (45, 24, 333, 4), (1, 24, 7, 0), (67, 32, 257, 0)]


@needs_kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("programs", [None, 3])
def test_hopper_path_matches_float64(shape, programs):
    N, D, V, ignore_every = shape
    e, c, b, t = make(N, D, V, dtype=torch.bfloat16, ignore_every=ignore_every, device=DEVICE)
    got = _run_hopper(e, c, b, t, programs=programs)
    assert_close(got, oracle(e, c, b, t), 1e-4 if DEVICE == "cpu" else 2e-3, GRAD_TOL[torch.bfloat16])


@needs_kernels
@pytest.mark.parametrize("opts", [dict(softcap=4.0), dict(label_smoothing=0.1), dict(z_loss=1e-2),
                                  dict(reduction="none"),
                                  dict(softcap=3.0, label_smoothing=0.2, z_loss=1e-3, bias=True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hopper_path_options_match_float64(opts, dtype):
    opts = dict(opts)
    e, c, b, t = make(37, 40, 300, dtype=dtype, bias=opts.pop("bias", False), device=DEVICE)
    got = _run_hopper(e, c, b, t, programs=4, **opts)
    assert_close(got, oracle(e, c, b, t, **opts), 1e-4 if DEVICE == "cpu" else 2e-3, GRAD_TOL[dtype])


@needs_kernels
def test_hopper_forward_equals_default_forward():
    """Same products, fp32 sums in another order: the per-token losses agree to fp32 rounding."""
    e, c, b, t = make(45, 24, 333, dtype=torch.bfloat16, bias=True, device=DEVICE, ignore_every=3)
    kw = dict(bias=b, impl="triton", reduction="none", softcap=5.0)
    want = linear_cross_entropy(e, c, t, **kw).detach()
    got = linear_cross_entropy(e, c, t, path="hopper", kernel_config=dict(hopper=dict(programs=5)), **kw).detach()
    assert rel(got.double(), want.double()) < 1e-5


@needs_kernels
@pytest.mark.parametrize("dtype, D", [(torch.float32, 40), (torch.bfloat16, 33)])
def test_hopper_path_falls_back_where_tma_does_not_apply(dtype, D):
    """fp32 (exact IEEE dots) and rows TMA cannot describe (33 bf16 = 66 bytes, not a multiple of 16) run the
    default forward kernel, counted as a fallback, with the same results."""
    e, c, b, t = make(37, D, 300, dtype=dtype, device=DEVICE)
    before = dict(forward_tma.STATS)
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton", path="hopper")
    assert forward_tma.STATS == dict(before, fallback=before["fallback"] + 1)
    assert_close(got, oracle(e, c, b, t), 1e-4 if dtype == torch.float32 or DEVICE == "cpu" else 2e-3, GRAD_TOL[dtype])


def test_bad_path_and_hopper_config_raise_naming_the_argument():
    e, c, b, t = make(10, 16, 50)
    with pytest.raises(ValueError, match="path"):
        linear_cross_entropy(e, c, t, impl="reference", path="fast")
    with pytest.raises(TypeError, match="path"):
        linear_cross_entropy(e, c, t, impl="reference", path=1)
    if HAVE_KERNELS:  # the config is checked in the kernels' dispatch
        with pytest.raises(ValueError, match="hopper"):
            e16, c16 = e.detach().bfloat16().to(DEVICE), c.detach().bfloat16().to(DEVICE)
            linear_cross_entropy(e16, c16, t.to(DEVICE), impl="triton", path="hopper",
                                 kernel_config=dict(hopper=dict(BLOCK_M=64)))


@pytest.mark.cuda
@pytest.mark.parametrize("N, D, V, ignore_every, programs", [
    (300, 64, 1000, 0, None), (1001, 128, 5001, 7, None), (4097, 256, 32003, 5, None), (4097, 256, 32003, 5, 7),
    (129, 2304, 2561, 3, None)])
def test_hopper_path_on_cuda_matches_float64_and_default(N, D, V, ignore_every, programs):
    e, c, b, t = make(N, D, V, dtype=torch.bfloat16, ignore_every=ignore_every, device="cuda")
    got = _run_hopper(e, c, b, t, programs=programs)
    assert_close(got, oracle(e, c, b, t), 2e-3, 2e-2)
    default = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton")
    assert rel(got[0], default[0]) < 1e-5
