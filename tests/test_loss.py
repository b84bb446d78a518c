"""thrifty.loss: the chunked reference against float64 naive CE, the options, the errors, and the Triton kernels
(under the interpreter on CPU, natively on CUDA) against float64."""

import pytest
import torch
import torch.nn.functional as F

from thrifty.loss import CCEKernelConfig, LinearCrossEntropy, linear_cross_entropy, lm_loss
from thrifty.loss.reference import linear_cross_entropy as reference_lce, naive_linear_cross_entropy
from thrifty.triton_utils import interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAVE_KERNELS = interpreting() or torch.cuda.is_available()
needs_kernels = pytest.mark.skipif(not HAVE_KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")


def make(N=37, D=40, V=300, dtype=torch.float32, bias=False, ignore_every=5, seed=0, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(N, D, generator=g) * scale).to(dtype).to(device).requires_grad_()
    c = (torch.randn(V, D, generator=g) * 0.5).to(dtype).to(device).requires_grad_()
    b = (torch.randn(V, generator=g)).to(dtype).to(device).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return e, c, b, t.to(device)


def loss_and_grads(fn, e, c, b, t, **kw):
    for x in (e, c, b):
        if x is not None:
            x.grad = None
    loss = fn(e, c, t, bias=b, **kw)
    (loss.sum() if loss.ndim else loss).backward()
    grads = [x.grad.detach().double().clone() if x is not None else None for x in (e, c, b)]
    return loss.detach().double(), grads


def oracle(e, c, b, t, **kw):
    return loss_and_grads(lambda *a, **k: naive_linear_cross_entropy(*a, dtype=torch.float64, **k), e, c, b, t, **kw)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_close(got, want, loss_tol, grad_tol):
    (l1, g1), (l2, g2) = got, want
    assert torch.isfinite(l1).all()
    assert rel(l1, l2) <= loss_tol, (l1, l2)
    for a, b_ in zip(g1, g2):
        if b_ is not None:
            assert rel(a, b_) <= grad_tol, rel(a, b_)


OPTIONS = [{}, dict(softcap=4.0), dict(label_smoothing=0.1), dict(z_loss=1e-2), dict(reduction="sum"),
           dict(reduction="none"), dict(softcap=3.0, label_smoothing=0.2, z_loss=1e-3, bias=True)]


# ---------------------------------------------------------------- the reference (spec) vs float64

@pytest.mark.parametrize("shape", [(37, 40, 300), (1, 24, 7), (64, 33, 129)])
@pytest.mark.parametrize("opts", OPTIONS)
def test_reference_matches_float64(shape, opts):
    opts = dict(opts)
    N, D, V = shape
    e, c, b, t = make(N, D, V, bias=opts.pop("bias", False))
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="reference", **opts)
    assert_close(got, oracle(e, c, b, t, **opts), 1e-6, 1e-5)


def test_reference_chunking_does_not_change_the_result():
    e, c, b, t = make(50, 24, 70, bias=True)
    one = loss_and_grads(lambda *a, **k: __import__("thrifty.loss.reference", fromlist=["x"]).linear_cross_entropy(
        *a, chunk_size=1000, **k), e, c, b, t)
    many = loss_and_grads(lambda *a, **k: __import__("thrifty.loss.reference", fromlist=["x"]).linear_cross_entropy(
        *a, chunk_size=7, **k), e, c, b, t)
    assert_close(many, one, 1e-6, 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_accumulates_in_fp32(dtype):
    e, c, b, t = make(33, 40, 260, dtype=dtype)
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="reference")
    assert_close(got, oracle(e, c, b, t), 1e-5, 1e-2)  # grads are rounded to the input dtype, nothing more


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch has no F.linear_cross_entropy")
@pytest.mark.parametrize("opts", [{}, dict(reduction="sum"), dict(label_smoothing=0.1), dict(reduction="none")])
def test_matches_torch_native_linear_cross_entropy(opts):
    e, c, b, t = make(29, 24, 100, bias=True)
    native = lambda e_, c_, t_, bias=None, **k: F.linear_cross_entropy(  # noqa: E731
        e_, c_, t_, linear_bias=bias, ignore_index=-100, **k)
    want = loss_and_grads(native, e, c, b, t, **opts)
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="reference", **opts)
    assert_close(got, want, 1e-5, 1e-5)


def test_torch_impl_is_the_naive_path():
    e, c, b, t = make(20, 16, 50)
    assert_close(loss_and_grads(linear_cross_entropy, e, c, b, t, impl="torch"), oracle(e, c, b, t), 1e-6, 1e-5)


# ---------------------------------------------------------------- options and conventions

def test_shift_is_the_causal_lm_shift():
    g = torch.Generator().manual_seed(1)
    e = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    c = torch.randn(40, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (2, 9), generator=g)
    t[0, 3] = -100
    got = linear_cross_entropy(e, c, t, shift=True, impl="reference")
    want = F.cross_entropy((e[:, :-1] @ c.T).reshape(-1, 40), t[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(got, want)
    none = linear_cross_entropy(e, c, t, shift=True, reduction="none", impl="reference")
    assert none.shape == (2, 9) and (none[:, -1] == 0).all() and none[0, 2] == 0


def test_reduction_none_shape_and_zeros_at_ignored():
    e, c, b, t = make(4 * 6, 16, 50)
    e3, t3 = e.detach().view(4, 6, 16), t.view(4, 6)
    out = linear_cross_entropy(e3, c, t3, reduction="none", impl="reference")
    assert out.shape == (4, 6) and out.dtype == torch.float32
    assert (out[t3 == -100] == 0).all() and (out[t3 != -100] > 0).all()


@pytest.mark.parametrize("impl", ["reference", "torch"] + (["triton"] if HAVE_KERNELS else []))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(impl, reduction):
    e, c, b, t = make(10, 16, 40, bias=True, device=DEVICE)
    t = torch.full_like(t, -100)
    loss, (de, dc, db) = loss_and_grads(linear_cross_entropy, e, c, b, t, impl=impl, reduction=reduction)
    assert (loss == 0).all()  # mean over no token is 0 by definition here (torch gives NaN)
    assert (de == 0).all() and (dc == 0).all() and (db == 0).all()


def test_custom_ignore_index_and_module_and_loss_seam():
    e, c, b, t = make(30, 16, 50, ignore_every=0)
    t[::3] = 7  # token 7 is the ignored one
    want = oracle(e, c, b, torch.where(t == 7, -100, t))
    got = loss_and_grads(lambda *a, bias=None: LinearCrossEntropy(ignore_index=7, impl="reference")(*a, bias), e, c, b, t)
    assert_close(got, want, 1e-6, 1e-5)
    hidden, labels = e.detach().view(5, 6, 16), t.view(5, 6).clone()
    labels[labels == 7] = -100
    torch.testing.assert_close(lm_loss(hidden, c, labels), want[0].float())


def test_nan_in_e_gives_nan_loss():
    e, c, b, t = make(12, 16, 40, ignore_every=0)
    e.data[3, 5] = float("nan")
    for impl in ["reference", "torch"] + (["triton"] if HAVE_KERNELS and DEVICE == "cpu" else []):
        assert torch.isnan(linear_cross_entropy(e, c, t, impl=impl))
        assert torch.isfinite(linear_cross_entropy(e, c, t, reduction="none", impl=impl)[torch.arange(12) != 3]).all()


# ---------------------------------------------------------------- errors name the argument

@pytest.mark.parametrize("bad, exc, name", [
    (lambda e, c, t: (e, c[:, :-1], t), ValueError, "c"),
    (lambda e, c, t: (e, c, t[:-1]), ValueError, "targets"),
    (lambda e, c, t: (e, c, t.float()), TypeError, "targets"),
    (lambda e, c, t: (e, c, torch.where(t == -100, 50, t)), ValueError, "targets"),
    (lambda e, c, t: (e, c, torch.where(t == -100, -3, t)), ValueError, "targets"),
    (lambda e, c, t: (e, c.double(), t), TypeError, "c"),
    (lambda e, c, t: (e, c.to("meta"), t), ValueError, "device"),
    (lambda e, c, t: (e.to("meta"), c.to("meta"), t.to("meta")), ValueError, "e: .*meta"),  # was autocast's error
    (lambda e, c, t: (e[0], c, t[0]), ValueError, "e"),
])
def test_bad_inputs_raise_naming_the_argument(bad, exc, name):
    e, c, b, t = make(10, 16, 50)
    with pytest.raises(exc, match=name):
        linear_cross_entropy(*bad(e.detach(), c.detach(), t), impl="reference")


def test_bad_options_raise():
    e, c, b, t = make(10, 16, 50)
    for kw, name in [(dict(reduction="avg"), "reduction"), (dict(softcap=0.0), "softcap"), (dict(impl="cuda"), "impl"),
                     (dict(label_smoothing=1.5), "label_smoothing"), (dict(bias=torch.zeros(3)), "bias")]:
        with pytest.raises(ValueError, match=name):
            linear_cross_entropy(e, c, t, **kw)


@pytest.mark.skipif(interpreting() or torch.cuda.is_available(), reason="only without kernels")
def test_triton_without_kernels_is_a_clear_error():
    e, c, b, t = make(10, 16, 50)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        linear_cross_entropy(e, c, t, impl="triton")


# ---------------------------------------------------------------- the kernels vs float64

GRAD_TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}  # bf16 gradient-tile buffer


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opts", OPTIONS)
def test_kernels_match_float64(dtype, opts):
    opts = dict(opts)
    e, c, b, t = make(37, 40, 300, dtype=dtype, bias=opts.pop("bias", False), device=DEVICE)
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton", **opts)
    assert_close(got, oracle(e, c, b, t, **opts), 1e-4 if dtype == torch.float32 or DEVICE == "cpu" else 2e-3,
                 GRAD_TOL[dtype])


class _Spy:
    """Counts the calls of the two forward paths (thrifty.loss.forward.lse_forward / lse_forward_gemm)."""

    def __init__(self, monkeypatch):
        from thrifty.loss import forward

        self.calls = {"fused": 0, "gemm": 0}
        for name, key in (("lse_forward", "fused"), ("lse_forward_gemm", "gemm")):
            real = getattr(forward, name)
            monkeypatch.setattr(forward, name, self._wrap(real, key))

    def _wrap(self, real, key):
        def counted(*a, **k):
            self.calls[key] += 1
            return real(*a, **k)
        return counted


def _gemm_forward_case(monkeypatch, N, D, V, dtype, opts, chunked):
    """Loss and gradients of a training call against float64 and against the fused forward's loss; the GEMM
    forward must have run (the chunk rule of thrifty.loss.forward), in several chunks when ``chunked``.
    ``CCEKernelConfig(forward="gemm")``: that rule without the Gluon LSE route, which "auto" takes first on sm_90
    for bf16 (tests/test_cce_gluon.py)."""
    from thrifty.loss import CCEKernelConfig
    from thrifty.loss.forward import gemm_chunk_cols, gemm_min_cols, gemm_min_d

    gemm = CCEKernelConfig(forward="gemm")

    opts = dict(opts)
    spy = _Spy(monkeypatch)
    e, c, b, t = make(N, D, V, dtype=dtype, bias=opts.pop("bias", False), device=DEVICE, ignore_every=4)
    cols = gemm_chunk_cols(V * D * e.element_size(), int((t != -100).sum()), V)
    assert (cols < V) == chunked and (cols == V or cols >= gemm_min_cols(interpreting()))
    assert D >= gemm_min_d(interpreting())
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton", reduction="none", config=gemm, **opts)
    assert spy.calls == {"fused": 0, "gemm": 1}
    assert_close(got, oracle(e, c, b, t, reduction="none", **opts), 1e-4 if dtype == torch.float32 else 2e-3,
                 GRAD_TOL[dtype])
    with torch.no_grad():
        fused = linear_cross_entropy(e, c, t, bias=b, impl="triton", reduction="none", config=gemm, **opts)
    assert spy.calls == {"fused": 1, "gemm": 1}
    assert torch.allclose(got[0], fused.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not interpreting(), reason="interpreter sizes: on CUDA these chunks are below gemm_min_cols")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, opts, chunked", [
    ((53, 33, 517), dict(softcap=3.0, label_smoothing=0.1, z_loss=1e-3, bias=True), True),
    ((77, 40, 1000), {}, True), ((7, 16, 97), dict(bias=True), False)])
def test_gemm_forward_runs_for_training_and_matches_float64(monkeypatch, dtype, shape, opts, chunked):
    """With dC wanted, the forward's logits come from GEMM chunks in dC's bytes."""
    _gemm_forward_case(monkeypatch, *shape, dtype, opts, chunked)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, opts", [(torch.bfloat16, {}), (torch.bfloat16, dict(softcap=30.0, bias=True)),
                                         (torch.float16, {}), (torch.float32, dict(label_smoothing=0.1))])
def test_cuda_gemm_forward_in_chunks_matches_float64(monkeypatch, dtype, opts):
    """The GEMM forward at a size where it runs on the GPU (D >= gemm_min_d; 16-bit: 4 chunks of 10880 columns,
    fp32: 2 of 21824), for each input dtype cuBLAS is asked for fp32 logits of."""
    _gemm_forward_case(monkeypatch, 4096, 2048, 32768, dtype, opts, True)


@pytest.mark.cuda
def test_cuda_small_hidden_sizes_keep_the_fused_forward(monkeypatch):
    """Below gemm_min_d the fused forward runs even for training calls (the GEMM path measured slower there);
    forward="gemm": the rule without the Gluon LSE route that "auto" takes first on sm_90."""
    from thrifty.loss import CCEKernelConfig

    spy = _Spy(monkeypatch)
    e, c, b, t = make(8192, 576, 49152, dtype=torch.bfloat16, device=DEVICE)
    linear_cross_entropy(e, c, t, impl="triton", config=CCEKernelConfig(forward="gemm")).backward()
    assert spy.calls == {"fused": 1, "gemm": 0} and c.grad is not None


@needs_kernels
def test_fused_forward_when_the_classifier_gets_no_gradient(monkeypatch):
    """A frozen classifier (no dC to lend its bytes) keeps the fused forward, whose extra memory is a few
    partials per row. With a classifier gradient and ``CCEKernelConfig(forward="fused")`` (benchmarks/cce.py's
    thrifty_fused_fwd rows), the fused forward runs and the backward allocates dC itself; with forward="gemm" (the
    default's rule where the Gluon LSE route does not apply: the interpreter, or not sm_90) the GEMM forward runs
    (the interpreter takes it at every size)."""
    from thrifty.loss import CCEKernelConfig

    spy = _Spy(monkeypatch)
    e, c, b, t = make(30, 24, 200, dtype=torch.bfloat16, device=DEVICE)
    c.requires_grad_(False)
    linear_cross_entropy(e, c, t, impl="triton", config=CCEKernelConfig(forward="gemm")).backward()
    assert spy.calls == {"fused": 1, "gemm": 0} and e.grad is not None
    c.requires_grad_(True)
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton", config=CCEKernelConfig(forward="fused"))
    assert spy.calls == {"fused": 2, "gemm": 0}
    assert_close(got, oracle(e, c, b, t), 1e-4 if DEVICE == "cpu" else 2e-3, GRAD_TOL[torch.bfloat16])
    if interpreting():
        again = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton",
                               config=CCEKernelConfig(forward="gemm"))
        assert spy.calls == {"fused": 2, "gemm": 1}
        assert_close(again, got, 1e-5, GRAD_TOL[torch.bfloat16])


def _force_backward(monkeypatch, tile_bytes=None, dense_above=None):
    """Backward paths at test sizes, through thrifty.loss.backward's constants: ``tile_bytes`` for every
    gradient-tile buffer outside dC (so that several vocabulary chunks run), ``dense_above`` 0.0 (cuBLAS GEMMs
    for every chunk) or 2.0 (the sparse Triton GEMMs)."""
    from thrifty.loss import backward

    if tile_bytes is not None:
        for name in ("TAIL_BYTES", "SMALL_TAIL_BYTES", "SEPARATE_BYTES"):
            monkeypatch.setattr(backward, name, tile_bytes)
    if dense_above is not None:
        monkeypatch.setattr(backward, "DENSE_ABOVE", dense_above)


@needs_kernels
@pytest.mark.parametrize("filter_eps", [None, "auto", 1e-3])
@pytest.mark.parametrize("dense_above", [0.0, 2.0])  # cuBLAS GEMMs for every chunk / the sparse Triton ones
@pytest.mark.parametrize("dtype, ignore_every", [(torch.bfloat16, 4), (torch.float32, 0), (torch.float32, 4)])
def test_kernels_filtering_sorting_and_chunking(monkeypatch, filter_eps, dtype, dense_above, ignore_every):
    """Exact and filtered (vocabulary sorted) backward over several chunks; fp32 inputs accumulate dE in place
    (checked once per GEMM path, with a threshold that filters)."""
    if dtype == torch.float32 and filter_eps != 1e-3:
        pytest.skip("in-place dE accumulation: checked once per path")
    # peaky logits (scale 3) so that filtering really skips tiles; tiny chunks so several vocabulary chunks run
    e, c, b, t = make(45, 24, 333, dtype=dtype, scale=3.0, bias=True, device=DEVICE, seed=3,
                      ignore_every=ignore_every)
    _force_backward(monkeypatch, tile_bytes=45 * 64 * 2, dense_above=dense_above)
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton",
                         config=CCEKernelConfig(filter_eps=filter_eps))
    assert_close(got, oracle(e, c, b, t), 1e-4, 3e-2 if filter_eps == 1e-3 else 2e-2)


@pytest.mark.parametrize("nv, D, V, buf, acc", [(45, 24, 333, 64, True), (45, 24, 333, 32, False), (34, 24, 333, 64, True),
                                                (45, 24, 7, 64, True), (8, 40, 301, 32, True), (8192, 2304, 256000, 512, True),
                                                (8192, 576, 49152, 512, True), (8192, 576, 49152, 512, False)])
def test_in_place_plan_keeps_scratch_in_free_rows_of_dc(nv, D, V, buf, acc):
    """The schedule that puts gradient tiles (and the fp32 dE accumulator) into dC's rows not yet written:
    "both" chunks tile [0, r) in order; with an accumulator, "de" chunks (separate buffer) then "dc" chunks
    each tile [r, V), the flush comes right before the first "dc" chunk, so every dE contribution is summed in
    fp32; every scratch region lies after the rows written so far and, before the flush, before the
    accumulator."""
    from thrifty.loss.backward import ALIGN, plan_chunks, recomputed_fraction

    step = 32
    plan, acc_off = plan_chunks(V, D, nv, step, buf, 2 * nv * D if acc else 0)
    modes = [p[4] for p in plan]
    both = [p for p in plan if p[4] == "both"]
    r = both[-1][0] + both[-1][1] if both else 0
    for mode, begin in (("both", 0), ("de", r), ("dc", r)):
        part = [p for p in plan if p[4] == mode]
        if mode == "both" or acc_off is not None:
            assert part and part[0][0] == begin and all(a[0] + a[1] == b[0] for a, b in zip(part, part[1:]))
            assert part[-1][0] + part[-1][1] == (r if mode == "both" else V)
        else:
            assert not part
    assert modes == sorted(modes, key=["both", "de", "dc"].index)  # all "both", then all "de", then all "dc"
    assert [p[3] for p in plan] == [p[4] == "dc" and (i == 0 or plan[i - 1][4] != "dc") for i, p in enumerate(plan)]
    if not acc:
        assert acc_off is None
    flushed = acc_off is None
    for s, cur, g_off, flush, mode in plan:
        flushed = flushed or flush
        assert cur > 0 and (cur % step == 0 or s + cur == V)
        if g_off is None:
            assert cur <= buf
        else:
            assert mode != "de" and g_off % ALIGN == 0 and g_off >= (s + cur) * D
            assert g_off + nv * cur <= (V * D if flushed else acc_off)
        if not flushed:
            assert mode == "de" or (s + cur) * D <= acc_off
    if V > 1000:  # the real shapes use dC's rows for most of the vocabulary
        assert sum(p[1] for p in plan if p[2] is not None) > 0.8 * V
    if (nv, D, V) == (8192, 2304, 256000) and acc:  # the 256k benchmark shape: a small second pass
        assert 0 < recomputed_fraction(plan, V) < 0.1


@needs_kernels
@pytest.mark.parametrize("N, D, V, ignore_every, dtype, dense_above", [
    (45, 24, 333, 0, torch.bfloat16, 0.0),  # fp32 dE accumulator in dC, flushed, then in place; tail buffer; odd V
    (45, 24, 333, 4, torch.bfloat16, 2.0),  # ignored tokens (compact dE spread at the end) + the sparse GEMMs
    (8, 40, 301, 0, torch.float32, 0.0),  # fp32 in place throughout; one chunk spans most of V
    (45, 24, 7, 3, torch.bfloat16, 0.0),  # V smaller than one chunk: no room in dC, the separate buffer only
])
def test_kernels_scratch_in_dc(monkeypatch, N, D, V, ignore_every, dtype, dense_above):
    e, c, b, t = make(N, D, V, dtype=dtype, scale=3.0, device=DEVICE, seed=5, ignore_every=ignore_every)
    _force_backward(monkeypatch, tile_bytes=N * 64 * 2, dense_above=dense_above)
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton")
    assert_close(got, oracle(e, c, b, t), 1e-4, 2e-2)
    sep = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton",
                         config=CCEKernelConfig(scratch_in_dc=False))
    assert_close(got, sep, 1e-6, 1e-2)  # same maths; only the dE rounding schedule differs


@needs_kernels
@pytest.mark.parametrize("ignore_every, bias, dense_above", [(0, True, 0.0), (5, False, 0.0), (0, False, 2.0)])
def test_kernels_two_pass_ending_sums_all_of_de_in_fp32(monkeypatch, ignore_every, bias, dense_above):
    """Where dC's free rows run out before the accumulator's, the rest of the vocabulary is done as dE only,
    then (after the flush) recomputed for dC only: dE is the fp32 sum over the whole vocabulary, as with a
    separate fp32 scratch (only the summation order differs, so at most one bf16 step apart), and dC and the
    bias gradient are each computed once."""
    from thrifty.loss.backward import backward_config, plan_chunks, recomputed_fraction
    N, D, V = 16, 24, 333
    e, c, b, t = make(N, D, V, dtype=torch.bfloat16, scale=3.0, bias=bias, device=DEVICE, seed=7,
                      ignore_every=ignore_every)
    nv = int((t != -100).sum())
    cfg = backward_config(True)
    step = cfg["BLOCK_V"] * cfg["SPLIT"]
    plan, acc_off = plan_chunks(V, D, nv, step, 32, 2 * nv * D)
    assert acc_off is not None and 0 < recomputed_fraction(plan, V) <= 0.25  # this case takes the two passes
    _force_backward(monkeypatch, tile_bytes=nv * 32 * 2, dense_above=dense_above)
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton")
    sep = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton",
                         config=CCEKernelConfig(scratch_in_dc=False))
    assert_close(got, oracle(e, c, b, t), 1e-4, 2e-2)
    (_, (de, dc, db)), (_, (de_s, dc_s, db_s)) = got, sep
    assert ((de - de_s).abs() <= de_s.abs() * 2 ** -7 + 1e-12).all()  # one bf16 rounding of the same fp32 sum
    assert rel(dc, dc_s) < 1e-6
    if bias:
        assert rel(db, db_s) < 1e-6


@pytest.mark.parametrize("nv, D, V, left, in_dc", [
    (8192, 2304, 256000, 1152, True),  # even D: right half in dC, 4.1% recomputed (whole: 7.3%)
    (8192, 4096, 128256, 2048, True),  # 7.4% (whole: 13.8%)
    (16384, 4096, 128256, 2048, True),  # 13.8% (whole: 26.5%, over MAX_RECOMPUTED)
    (8192, 576, 49152, 288, False),  # not even the half fits: separate right half (nv x 288 fp32)
    (8192, 2305, 256000, 0, True),  # odd D: no half fits dE's rows, the whole accumulator in dC
    (16384, 577, 49152, 0, False),  # odd D, too many tokens: the whole accumulator separate
])
def test_in_dc_plan_splits_the_accumulator_for_even_d(nv, D, V, left, in_dc):
    """With an fp32 dE accumulator the in-dC schedule keeps, for even D, the accumulator's left half in dE's own
    bytes and its right half in dC's last rows; for odd D the whole accumulator in dC. Either is taken only when
    its two-pass ending recomputes at most MAX_RECOMPUTED of the vocabulary, else the part not in dE is
    separate (acc_off None). The split recomputes less than the whole would have."""
    from thrifty.loss.backward import MAX_RECOMPUTED, in_dc_plan, plan_chunks, recomputed_fraction

    step, buf = 256, max(256, (8 << 20) // (2 * nv) // 256 * 256)
    plan, acc_off, got_left = in_dc_plan(V, D, nv, step, buf, True)
    assert (got_left, acc_off is not None) == (left, in_dc)
    assert recomputed_fraction(plan, V) <= MAX_RECOMPUTED
    if acc_off is not None:
        assert (plan, acc_off) == plan_chunks(V, D, nv, step, buf, 2 * nv * (D - left))
        assert acc_off + 2 * nv * (D - left) <= V * D
        if left:
            whole, whole_off = plan_chunks(V, D, nv, step, buf, 2 * nv * D)
            assert whole_off is None or recomputed_fraction(whole, V) > recomputed_fraction(plan, V)
    assert in_dc_plan(V, D, nv, step, buf, False)[1:] == (None, 0)  # fp32 inputs: no accumulator


@needs_kernels
@pytest.mark.parametrize("nv, D", [(1, 2), (7, 24), (33, 40), (5, 2304), (6, 7)])
def test_split_accumulator_rounds_in_place_into_de(nv, D):
    """The fp32 accumulator whose left half shares dE's bytes is rounded into dE row by row in place: every
    element is its fp32 value rounded once, and the rows after the compact ones are untouched."""
    from thrifty.loss.backward import _FP32Accumulator

    gen = torch.Generator().manual_seed(nv * 1000 + D)
    left = D // 2 if D % 2 == 0 else 0
    want = (torch.randn(nv, D, generator=gen) * 3).to(DEVICE)
    de = torch.full((nv + 3, D), 7.0, dtype=torch.bfloat16, device=DEVICE)
    right = torch.empty(nv, D - left, dtype=torch.float32, device=DEVICE)
    acc = _FP32Accumulator(de[:nv], right, left)
    for part, col in acc.parts:
        part.copy_(want[:, col:col + part.shape[1]])
    acc.round_into_de()
    nearest = want.to(torch.bfloat16)
    if interpreting():  # Triton 3.6's interpreter stores fp32 -> bf16 by truncation; the GPU rounds to nearest
        toward_zero = (want.cpu().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        assert ((de[:nv] == nearest) | (de[:nv] == toward_zero.to(DEVICE))).all()
    else:
        assert torch.equal(de[:nv], nearest)
    assert (de[nv:] == 7.0).all()


@needs_kernels
@pytest.mark.parametrize("N, ignore_every, dtype, dense_above, in_dc", [
    (30, 0, torch.bfloat16, 0.0, True),  # right half in dC's last rows (cuBLAS GEMMs per half)
    (34, 6, torch.bfloat16, 2.0, True),  # ignored tokens + the sparse GEMMs, launched per half
    (30, 0, torch.float16, 0.0, True),  # fp16: bf16 tiles, so the sparse GEMMs
    (45, 0, torch.bfloat16, 0.0, False),  # not even the half fits: separate right half
    (45, 5, torch.bfloat16, 2.0, False),
])
def test_kernels_split_accumulator_sums_all_of_de_in_fp32(monkeypatch, N, ignore_every, dtype, dense_above, in_dc):
    """Where dC cannot host the whole fp32 dE accumulator (too many tokens for the vocabulary), its left half
    lives in dE's own bytes: dE is still the fp32 sum over the whole vocabulary rounded once (as with the
    separate scratch of scratch_in_dc=False: at most one 16-bit step apart), dC is computed once."""
    from thrifty.loss.backward import backward_config, in_dc_plan
    D, V = 24, 333
    e, c, b, t = make(N, D, V, dtype=dtype, scale=3.0, device=DEVICE, seed=13, ignore_every=ignore_every)
    nv = int((t != -100).sum())
    cfg = backward_config(True)
    _, acc_off, left = in_dc_plan(V, D, nv, cfg["BLOCK_V"] * cfg["SPLIT"], 32, True)
    assert (left, acc_off is not None) == (D // 2, in_dc)
    _force_backward(monkeypatch, tile_bytes=nv * 32 * 2, dense_above=dense_above)
    from thrifty.loss import backward
    rounded = []  # (left columns, storage of the right half) of each accumulator the backward rounds
    plain = backward._FP32Accumulator.round_into_de
    monkeypatch.setattr(backward._FP32Accumulator, "round_into_de",
                        lambda acc: (rounded.append((acc.left, acc.right.untyped_storage().data_ptr())), plain(acc)))
    got = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton")
    dc_storage = c.grad.untyped_storage().data_ptr()  # autograd keeps the backward's dC buffer as c.grad
    assert rounded == [(D // 2, dc_storage)] if in_dc else len(rounded) == 1 and rounded[0][0] == D // 2
    sep = loss_and_grads(linear_cross_entropy, e, c, b, t, impl="triton",
                         config=CCEKernelConfig(scratch_in_dc=False))
    assert_close(got, oracle(e, c, b, t), 1e-4, 2e-2)
    (_, (de, dc, _)), (_, (de_s, dc_s, _)) = got, sep
    step = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert ((de - de_s).abs() <= de_s.abs() * step + 1e-12).all()  # one rounding of the same fp32 sum
    assert rel(dc, dc_s) < 1e-6


@pytest.mark.cuda
def test_cuda_many_tokens_for_the_vocabulary_stay_near_the_memory_bound():
    """16384 tokens, D=4096, V=128256 (issue #32's largest Llama-3 row): the whole fp32 dE accumulator would
    recompute 26.5% of the vocabulary in dC, so before the split it took a separate 256 MiB buffer. Now the
    peak over the inputs stays within 16 MiB of dE + dC, and dE is the fp32 sum rounded once. A first call runs
    before the measured one: cuBLAS takes its 32 MiB workspace from the caching allocator once per process and
    stream (measured on the H100: 40.7 MiB over the bound cold, 8.7 MiB warm)."""
    torch.manual_seed(0)
    N, D, V = 16384, 4096, 128256
    e = (torch.randn(N, D, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    c = (torch.randn(V, D, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    linear_cross_entropy(e, c, t).backward()
    e.grad = c.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    linear_cross_entropy(e, c, t).backward()
    torch.cuda.synchronize()
    bound = (N + V) * D * 2
    assert torch.cuda.max_memory_allocated() - before - bound <= 16 * 2 ** 20
    de, dc = e.grad.clone(), c.grad.clone()
    e.grad = c.grad = None
    linear_cross_entropy(e, c, t, config=CCEKernelConfig(scratch_in_dc=False)).backward()
    # cuBLAS sums the split's two column halves of dE, and the recomputed vocabulary rows of dC, in another fp32
    # order than the whole accumulator does, so a few elements round to the neighbouring bf16 value: both
    # results are held to float64 by norm, the split no less accurate
    e64, c64 = (x.detach().double().requires_grad_() for x in (e, c))
    reference_lce(e64, c64, t, chunk_size=1024).backward()  # the chunked spec: no N x V float64 matrix
    want_de, want_dc = e64.grad, c64.grad
    for name, split, whole, want in (("dE", de, e.grad, want_de), ("dC", dc, c.grad, want_dc)):
        err_split, err_whole = rel(split.double(), want), rel(whole.double(), want)
        assert err_split < 2 ** -8 and err_split <= 1.01 * err_whole + 1e-7, (name, err_split, err_whole)


@needs_kernels
def test_kernel_shift_and_3d_input():
    e, c, b, t = make(4 * 9, 24, 100, dtype=torch.float32, device=DEVICE)
    e3 = e.detach().view(4, 9, 24).requires_grad_()
    t3 = t.view(4, 9)
    got = loss_and_grads(linear_cross_entropy, e3, c, None, t3, impl="triton", shift=True)
    want = oracle(e3, c, None, t3, shift=True)
    assert_close(got, want, 1e-5, 1e-3)


@pytest.mark.cuda
def test_auto_picks_triton_on_cuda():
    e, c, b, t = make(300, 64, 1000, dtype=torch.bfloat16, device="cuda")
    assert_close(loss_and_grads(linear_cross_entropy, e, c, b, t), oracle(e, c, b, t), 2e-3, 2e-2)


def test_loss_seam_in_the_reference_model_matches_plain_loss():
    models = pytest.importorskip("thrifty.models.llama")
    presets = pytest.importorskip("thrifty.models.presets")
    cfg = presets.preset("tiny", vocab_size=500)
    torch.manual_seed(0)
    plain = models.LlamaForCausalLM(cfg).init_weights(seed=0)
    cut = models.LlamaForCausalLM(cfg, loss=lm_loss).init_weights(seed=0)
    ids = torch.randint(0, 500, (2, 33))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    labels[0, :4] = -100
    a, b = plain(ids, labels=labels), cut(ids, labels=labels)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    a.backward()
    b.backward()
    for (name, p), q in zip(plain.named_parameters(), cut.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("impl", ["reference"] + (["triton"] if HAVE_KERNELS else []))
def test_autocast_fp32_master_weight_with_bf16_hidden(impl):
    """A trainer under autocast hands an fp32 lm_head weight; the loss runs at bf16 and grads keep their dtype."""
    e, c, b, t = make(30, 24, 90, device=DEVICE)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        loss = linear_cross_entropy(e.bfloat16(), c, t, impl=impl)
    loss.backward()
    assert c.grad.dtype == torch.float32 and e.grad.dtype == torch.float32
    e16, c16 = e.detach().bfloat16().requires_grad_(), c.detach().bfloat16().requires_grad_()
    want = oracle(e16, c16, None, t)
    assert rel(loss.detach().double(), want[0]) < 1e-4
    assert rel(c.grad.double(), want[1][1]) < 2e-2
