"""The interpreter helper: kernels run on the CPU under TRITON_INTERPRET=1, and `mma` fixes bf16 dots."""

import pytest
import torch
import triton
import triton.language as tl

from thrifty.triton_utils import HAVE_TRITON, interpreting, kernels_available, mma, sm_count

pytestmark = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs CUDA or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, USE_MMA: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):  # loop bounded by a runtime argument: needs numpy < 2.4 in the interpreter
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :],
                    mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)
        b = tl.load(b_ptr + (k0 + rk)[:, None] * N + rn[None, :],
                    mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        if USE_MMA:
            acc = mma(a, b, acc)
        else:
            acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


def _run(a, b, use_mma):
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(M, 16), triton.cdiv(N, 16))
    _matmul_kernel[grid](a, b, c, M, N, K, USE_MMA=use_mma, BM=16, BN=16, BK=16)
    return c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(16, 16, 16), (33, 47, 70), (5, 130, 19)])
def test_mma_matches_float64(dtype, shape):
    M, N, K = shape
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    a = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(K, N, generator=g).to(dtype).to(DEVICE)
    expected = a.double() @ b.double()
    got = _run(a, b, use_mma=True).double()
    # fp32 accumulation of exactly-representable products: error is fp32 summation rounding only
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4 * K**0.5)


@pytest.mark.skipif(not interpreting(), reason="documents an interpreter-only defect")
def test_plain_bf16_dot_is_wrong_in_interpreter():
    """The pitfall the helper exists for: if this starts passing, Triton fixed it and `mma` can drop the upcast."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 32, generator=g).bfloat16()
    b = torch.randn(32, 32, generator=g).bfloat16()
    expected = a.double() @ b.double()
    raw = _run(a, b, use_mma=False).double()
    assert not torch.allclose(raw, expected, rtol=1e-2, atol=1e-2)
    assert torch.allclose(_run(a, b, use_mma=True).double(), expected, rtol=1e-5, atol=1e-3)


def test_kernels_available_names_devices():
    assert HAVE_TRITON and kernels_available("cuda")  # CUDA tensors: whenever Triton is there (imported above)
    assert kernels_available("cpu") == interpreting()


def test_launch_hook_detection():
    """Triton 3.6's launch hooks are a HookChain, never None: only a chain with calls counts as a hook
    (FastLauncher steps aside for profilers then, and only then)."""
    from triton.knobs import HookChain

    from thrifty.triton_utils import _hook_set
    chain = HookChain()
    assert not _hook_set(None) and not _hook_set(chain)
    chain.add(print)
    assert _hook_set(chain) and _hook_set(print)


def test_fast_launcher_key_separates_what_triton_specializes_on():
    """Arguments that Triton compiles differently for must give different keys (else a cached kernel of
    another specialization would be launched)."""
    from thrifty.triton_utils import FastLauncher
    spec = FastLauncher._spec
    assert len({spec(1), spec(2), spec(16), spec(2 ** 31), spec(True), spec(False), spec(1.0)}) == 7
    x = torch.zeros(8, dtype=torch.float32)
    assert spec(x) != spec(x.to(torch.float16)) and spec(x) != spec(x[1:])  # dtype, 16-byte alignment
    assert spec(torch.nn.Parameter(x)) == spec(x)


def test_sm_count_forms_agree():
    """Every form of a device gives one count; the CPU (interpreter) gets the H100's 132."""
    assert sm_count(None) == sm_count("cpu") == sm_count(torch.device("cpu")) == 132
    if torch.cuda.is_available():
        i = torch.cuda.current_device()
        n = torch.cuda.get_device_properties(i).multi_processor_count
        assert sm_count(i) == sm_count(f"cuda:{i}") == sm_count(torch.device("cuda")) == n
