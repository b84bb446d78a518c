"""The host path of an attention call: FastLauncher's keyed launches (a caller's signature of the call in
place of per-argument keys) exercised on the CPU with a fake driver and a fake compiled kernel; the
signature covers what the launches specialize on. Host time itself is measured by benchmarks, not here."""

import pytest
import torch

from thrifty.triton_utils import FastLauncher

from fake_triton import FakeJit, allow_direct_launches


@pytest.fixture
def direct(monkeypatch):
    """FastLauncher's direct path on a CPU: no interpreter flag, no hooks, a fake driver."""
    allow_direct_launches(monkeypatch)
    jit = FakeJit(["x", "n", "BLOCK"])
    launcher = FastLauncher(jit)
    launcher.interpreted = False
    return launcher, jit


def test_keyed_launch_skips_the_binder_after_the_first_call(direct):
    launcher, jit = direct
    x = torch.empty(64)
    launcher.keyed(("shape", 64), (4,), x, 64, BLOCK=16, num_warps=4, num_stages=2)
    assert jit.compiles == 1 and jit.kernel.runs == []
    for _ in range(3):
        launcher.keyed(("shape", 64), (4,), x, 64, BLOCK=16, num_warps=4, num_stages=2)
    assert jit.compiles == 1 and len(jit.kernel.runs) == 3
    grid_x, grid_y, grid_z, stream, *rest = jit.kernel.runs[-1]
    assert (grid_x, grid_y, grid_z, stream) == (4, 1, 1, "stream") and rest[-3:] == [x, 64, 16]
    # a new signature with the same per-argument key: found by the per-argument cache, no compile
    launcher.keyed(("another", 1), (4,), x, 64, BLOCK=16, num_warps=4, num_stages=2)
    assert jit.compiles == 1 and len(jit.kernel.runs) == 4
    # a different constexpr: Triton's path again
    launcher.keyed(("shape", 64, "block 32"), (4,), x, 64, BLOCK=32, num_warps=4, num_stages=2)
    assert jit.compiles == 2


def test_attention_signature_changes_with_what_launches_specialize_on(monkeypatch):
    """sage_forward_triton's signature: a new stride, dtype, flag or misaligned input gives a new one."""
    from thrifty.attention import attn_kernel
    seen = []
    monkeypatch.setattr(attn_kernel, "quantize_inputs", lambda *a, **kw: seen.append(kw["sig"]) or 1 / 0)
    q = torch.randn(1, 2, 40, 64)
    k = v = torch.randn(1, 1, 40, 64)
    calls = [dict(q=q), dict(q=q.clone()), dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)),
             dict(q=q.half()), dict(q=q, causal=False),
             dict(q=torch.randn(1, 2, 40 * 64 + 1)[..., 1:].view(1, 2, 40, 64))]  # misaligned by 4 bytes
    for c in calls:
        with pytest.raises(ZeroDivisionError):
            attn_kernel.sage_forward_triton(c["q"], k, v, causal=c.get("causal", True), sm_scale=0.125)
    assert seen[0] == seen[1] and len(set(seen)) == len(seen) - 1


class RecordingJit(FakeJit):
    """A FakeJit that records the keyword arguments of each compile-and-launch."""

    def __init__(self):
        super().__init__(["x", "n", "BLOCK"])
        self.options = []

    def __getitem__(self, grid):
        launch = super().__getitem__(grid)
        return lambda *args, **kw: self.options.append(kw) or launch(*args, **kw)


def test_num_stages_none_leaves_triton_its_default(direct):
    """Gluon kernels pipeline by hand and take no num_stages: ``num_stages=None`` is not passed to the launch."""
    jit = RecordingJit()
    launcher = FastLauncher(jit)
    launcher.interpreted = False
    launcher.keyed(("gluon", 8), (2,), torch.empty(8), 8, BLOCK=8, num_warps=4, num_stages=None)
    launcher.keyed(("triton", 8), (2,), torch.empty(8), 8, BLOCK=8, num_warps=4, num_stages=3)
    assert jit.options == [dict(BLOCK=8, num_warps=4), dict(BLOCK=8, num_warps=4, num_stages=3)]
