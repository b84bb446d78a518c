"""The Gluon gradient-tile kernel of the CCE backward (``loss/gluon_tile.py``, issue #32).

Gluon has no interpreter: the kernel itself runs only on the GPU box (``cuda`` tests: against the Triton tile
kernel on the same inputs, against a float64 evaluation of the formula, whole-loss gradients against the
reference, the route taken, CUDA-graph capture); its sm_90 compile runs in CI (tests/test_compile_sm90.py). On the
CPU: the routing decisions, the ``tiles`` option, and the backward's wiring of the Gluon route (with a float64
stand-in for the kernel, under the interpreter)."""

import math

import pytest
import torch

from thrifty.loss import CCEKernelConfig, linear_cross_entropy
from thrifty.loss import backward as B
from thrifty.loss import gluon_tile as GT
from thrifty.triton_utils import interpreting

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon tile kernel needs an sm_90 GPU")
BF16 = torch.bfloat16


def tile_reference(e_valid, c_chunk, targets, lse, w, *, v_start, softcap, z_loss, onehot_weight, uniform_weight):
    """The gradient tiles in float64, as the kernels' docstrings define them."""
    z = e_valid.double() @ c_chunk.double().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lse = lse.double()
    g = torch.exp(z - lse[:, None]) * (1.0 + 2.0 * z_loss * lse)[:, None]
    cols = v_start + torch.arange(c_chunk.shape[0], device=z.device)
    g = g - onehot_weight * (cols[None, :] == targets[:, None]).double() - uniform_weight
    if softcap is not None:
        g = g * (1.0 - (z / softcap) ** 2)
    return g * w.double()[:, None]


def fake_grad_tiles(calls):
    """A float64 stand-in for gluon_tile.grad_tiles (the CPU cannot run Gluon) that records its calls."""
    def run(e_valid, c_chunk, targets, lse, w, g_buf, **kw):
        calls.append(dict(nv=e_valid.shape[0], cur=c_chunk.shape[0], **kw))
        g_buf.copy_(tile_reference(e_valid, c_chunk, targets, lse, w, **kw).to(g_buf.dtype))
    return run


# ------------------------------------------------------------------------------------------------ CPU: routing
def _routable(N=64, D=64, V=512, dtype=BF16):
    return torch.randn(N, D).to(dtype), torch.randn(V, D).to(dtype)


def _ok(e, c, **kw):
    args = dict(bias=None, filtering=False, order=None, g_dtype=BF16, tiles="auto")
    args.update(kw)
    return GT.gluon_tiles_ok(e, c, **args)


def test_routing_takes_only_the_dense_bf16_calls(monkeypatch):
    """With the hardware check passing (patched: the CPU has none), each condition alone sends the call back to
    the Triton tile kernel."""
    monkeypatch.setattr(GT, "on_hopper", lambda device: True)
    e, c = _routable()
    assert _ok(e, c)
    assert _ok(e[:, :56].contiguous(), c[:, :56].contiguous())  # D % 8 == 0 is enough
    assert not _ok(e, c, tiles="triton")
    assert not _ok(e, c, bias=torch.zeros(c.shape[0], dtype=BF16))
    assert not _ok(e, c, filtering=True)
    assert not _ok(e, c, order=torch.arange(c.shape[0], dtype=torch.int32))
    assert not _ok(e, c, g_dtype=torch.float32)
    # a softcap routes like the rest (on SOFTCAP_TILE_CONFIG's 64 x 128 tiles): the check does not take it
    for dtype in (torch.float16, torch.float32):
        assert not _ok(*_routable(dtype=dtype), g_dtype=BF16)
    assert not _ok(e, c.float())
    assert not _ok(e[:, :60].contiguous(), c[:, :60].contiguous())  # D % 8 != 0: rows not 16-byte aligned
    assert not _ok(e[:, 1:57], c)  # base address off by 2 bytes
    assert not _ok(e.T.contiguous().T, c)  # column-major rows
    assert _ok(torch.randn(64, 80).to(BF16)[:, :64], c)  # a 160-byte row stride is TMA-ready
    assert not _ok(torch.randn(64, 84).to(BF16)[:, :64], c)  # 168-byte rows are not 16-byte aligned
    monkeypatch.setattr(GT, "on_hopper", lambda device: False)
    assert not _ok(e, c)


def test_on_hopper_needs_a_compiled_sm90_device(monkeypatch):
    assert not GT.on_hopper("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for major, want in ((9, True), (8, False), (10, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, m=major: (m, 0))
        assert GT.on_hopper("cuda") is want
        assert GT.on_hopper(torch.device("cuda", 0)) is want
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not GT.on_hopper("cuda")  # the interpreter cannot run Gluon


def test_tiles_option_is_validated():
    assert CCEKernelConfig().tiles == "auto"
    assert CCEKernelConfig(tiles="triton").tiles == "triton"
    for bad in ("gluon", "Triton", "", None, 1):
        with pytest.raises(ValueError, match="tiles"):
            CCEKernelConfig(tiles=bad)


# ------------------------------------------------------------------- CPU: the backward's wiring of the route
needs_interpreter = pytest.mark.skipif(not interpreting(), reason="CPU wiring test: runs under TRITON_INTERPRET=1")


def _make(N=45, D=24, V=700, ignore_every=4, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(N, D, generator=g) * 2.0).to(BF16).to(device).requires_grad_()
    c = (torch.randn(V, D, generator=g) * 0.5).to(BF16).to(device).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return e, c, t.to(device)


def _grads(e, c, t, **kw):
    e.grad = c.grad = None
    loss = linear_cross_entropy(e, c, t, **kw)
    loss.backward()
    return loss.detach().double(), e.grad.double().clone(), c.grad.double().clone()


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@needs_interpreter
@pytest.mark.parametrize("opts", [{}, dict(z_loss=1e-2, label_smoothing=0.1), dict(softcap=20.0)])
@pytest.mark.parametrize("scratch_in_dc, tile_bytes", [(True, None), (True, 4096), (False, 4096)])
@pytest.mark.parametrize("ignore_every", [0, 4])
def test_backward_routes_tiles_through_the_gluon_call(monkeypatch, opts, scratch_in_dc, tile_bytes, ignore_every):
    """With the route forced on (and the kernel replaced by its float64 formula), the backward hands every
    vocabulary chunk to ``grad_tiles`` (chunk starts, widths, weights, the valid rows when tokens are ignored),
    and the gradients equal the Triton tile kernel's path."""
    e, c, t = _make(ignore_every=ignore_every)
    cfg = CCEKernelConfig(scratch_in_dc=scratch_in_dc)
    if tile_bytes is not None:  # several vocabulary chunks
        for name in ("TAIL_BYTES", "SMALL_TAIL_BYTES", "SEPARATE_BYTES"):
            monkeypatch.setattr(B, name, tile_bytes)
    want = _grads(e, c, t, impl="triton", config=cfg, **opts)
    calls = []
    monkeypatch.setattr(B, "gluon_tiles_ok", lambda *a, **k: k["tiles"] == "auto")
    monkeypatch.setattr(B, "grad_tiles", fake_grad_tiles(calls))
    got = _grads(e, c, t, impl="triton", config=cfg, **opts)
    nv = int((t != -100).sum())
    V = c.shape[0]
    assert calls and all(k["nv"] == nv for k in calls)
    if tile_bytes is not None:
        assert len(calls) > 1
    # every vocabulary row's tiles are made, at most twice (plan_chunks' two-pass ending: dE, then dC)
    times = torch.zeros(V, dtype=torch.int64)
    for k in calls:
        times[k["v_start"]:k["v_start"] + k["cur"]] += 1
    assert times.min() >= 1 and times.max() <= 2
    ls = opts.get("label_smoothing", 0.0)
    assert all(k["onehot_weight"] == 1.0 - ls and k["uniform_weight"] == ls / V for k in calls)
    assert all(k["softcap"] == opts.get("softcap") and k["z_loss"] == opts.get("z_loss", 0.0) for k in calls)
    assert got[0].equal(want[0])
    for a, b in zip(got[1:], want[1:]):
        assert _rel(a, b) < 1e-2, _rel(a, b)
    # tiles="triton" never asks for the Gluon kernel, and the route is decided once per backward
    calls.clear()
    _grads(e, c, t, impl="triton", config=CCEKernelConfig(scratch_in_dc=scratch_in_dc, tiles="triton"), **opts)
    assert not calls


@needs_interpreter
def test_interpreter_backward_keeps_the_triton_tiles():
    """Unpatched, a bf16 backward under the interpreter takes the Triton tile kernel (no Gluon launch)."""
    e, c, t = _make()
    before = GT.launch_count
    _grads(e, c, t, impl="triton")
    assert GT.launch_count == before


# ------------------------------------------------------------------------------------------------- GPU
def _tile_inputs(nv, cur, D, *, v_start=64, seed=0, spread=4.0):
    """bf16 E (nv x D) and C (v_start + cur + 5 rows) with peaky logits (std ~``spread``), targets in the chunk,
    before and after it, and ignored-like -1; lse = the float64 log-sum-exp over the chunk plus a margin (the chunk
    is part of a vocabulary), w: per-row weights around 1/nv."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(nv, D, generator=g).to(BF16)
    c = (torch.randn(v_start + cur + 5, D, generator=g) * (spread / math.sqrt(D))).to(BF16)
    chunk = c[v_start:v_start + cur]
    z = e.double() @ chunk.double().T
    lse = (torch.logsumexp(z, dim=1) + torch.rand(nv, generator=g, dtype=torch.float64)).float()
    targets = torch.randint(v_start, v_start + cur, (nv,), generator=g)
    targets[1::5] = torch.randint(0, c.shape[0], (len(targets[1::5]),), generator=g)
    targets[2::7] = -1
    w = (0.5 + torch.rand(nv, generator=g)) / nv
    dev = "cuda"
    return e.to(dev), c.to(dev), targets.to(dev), lse.to(dev), w.to(dev)


SENTINEL = 12345.0


def _g_view(nv, cur, offset=192):
    """An nv x cur bf16 view with row stride cur at a 64-multiple element offset in a sentinel-filled buffer (as
    the tiles live in dC's free rows)."""
    flat = torch.full((offset + nv * cur + 777, ), SENTINEL, dtype=BF16, device="cuda")
    return flat, flat.as_strided((nv, cur), (cur, 1), offset)


def _triton_tiles(e, c_full, targets, lse, w, g_buf, *, v_start, cur, softcap, z_loss, onehot_weight,
                  uniform_weight):
    """backward._grad_tile_kernel on the same tiles, launched as linear_ce_backward launches it on the dense path."""
    cfg = dict(B.backward_config(False))
    bn, bv, split = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_V"), cfg.pop("SPLIT", 1)
    bd = cfg.pop("BLOCK_D_TILE")
    cfg.pop("BLOCK_D_DC"), cfg.pop("BLOCK_D_DE")
    nv, D = e.shape
    rows = torch.arange(nv, device=e.device, dtype=torch.int64)
    cnt = torch.zeros(4, dtype=torch.int32, device=e.device)
    B._grad_tile_kernel[(-(-nv // bn), -(-cur // (bv * split)))](
        e, c_full, c_full, rows, targets, lse, w, rows, g_buf, w, cnt, cnt, cnt, cnt, cnt,
        nv, D, e.stride(0), c_full.stride(0), g_buf.stride(0), v_start, cur, 1, 1,
        float(softcap or 1.0), float(z_loss), onehot_weight, uniform_weight, 0.0, HAS_BIAS=False,
        HAS_SOFTCAP=softcap is not None, HAS_ORDER=False, FILTER=False, NEED_DBIAS=False, SPLIT=split, LISTS=False,
        BLOCK_N=bn, BLOCK_V=bv * split, BLOCK_D=bd, **cfg)


TILE_SHAPES = [(1, 256, 64), (127, 1000, 576), (300, 4097, 2304), (8200, 2048, 2304), (513, 1531, 4096),
               (129, 257, 200)]
TILE_OPTS = [dict(), dict(softcap=30.0), dict(z_loss=1e-4, label_smoothing=0.1),
             dict(softcap=15.0, z_loss=1e-3, label_smoothing=0.05)]


def _run_both(nv, cur, D, opts, config=None, v_start=64):
    e, c, targets, lse, w = _tile_inputs(nv, cur, D, v_start=v_start)
    V = c.shape[0]
    ls = opts.get("label_smoothing", 0.0)
    kw = dict(v_start=v_start, softcap=opts.get("softcap"), z_loss=opts.get("z_loss", 0.0),
              onehot_weight=1.0 - ls, uniform_weight=ls / V)
    flat_gl, g_gl = _g_view(nv, cur)
    GT.grad_tiles(e, c[v_start:v_start + cur], targets, lse, w, g_gl, config=config, **kw)
    flat_tr, g_tr = _g_view(nv, cur)
    _triton_tiles(e, c, targets, lse, w, g_tr, cur=cur, **kw)
    want = tile_reference(e, c[v_start:v_start + cur], targets, lse, w, **kw)
    torch.cuda.synchronize()
    return flat_gl, g_gl, flat_tr, g_tr, want, w


def _check_tiles(flat_gl, g_gl, flat_tr, g_tr, want, w):
    nv, cur = g_gl.shape
    outside = torch.ones_like(flat_gl, dtype=torch.bool)
    outside[192:192 + nv * cur] = False
    assert (flat_gl[outside] == SENTINEL).all(), "the kernel wrote outside the nv x cur view"
    assert torch.isfinite(g_gl).all()
    got, tri = g_gl.double(), g_tr.double()
    # absolute slack: an fp32 logit error of ~1e-5 moves g by w·p·1e-5 (p <= 1); relative: bf16's rounding
    atol = 1e-5 * w.max().item()
    err_gl = ((got - want).abs() - 2.0 ** -8 * want.abs()).max().item()
    err_tr = ((tri - want).abs() - 2.0 ** -8 * want.abs()).max().item()
    assert err_gl <= atol, (err_gl, atol, err_tr)  # against the float64 formula: within bf16 rounding
    assert ((got - tri).abs() <= 2.0 ** -7 * tri.abs() + atol).all(), (got - tri).abs().max().item()
    # the target columns are where the one-hot lands: the two kernels agree there exactly in sign
    assert (torch.sign(got) == torch.sign(tri))[want.abs() > 10 * atol].all()


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("nv, cur, D", TILE_SHAPES)
@pytest.mark.parametrize("opts", TILE_OPTS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()) or "plain")
def test_gluon_tiles_match_triton_kernel_and_float64(nv, cur, D, opts):
    before = GT.tma_store_count
    _check_tiles(*_run_both(nv, cur, D, opts))
    # the TMA store takes 16-byte aligned rows (here: cur % 8 == 0) without a softcap; the rest store from registers
    assert GT.tma_store_count - before == (cur % 8 == 0 and "softcap" not in opts)


@pytest.mark.cuda
@needs_hopper
def test_gluon_tiles_in_a_cuda_graph():
    """Captured once (descriptors by value, persistent grid), replayed on new contents of the same buffers."""
    nv, cur, D = 700, 3000, 2304
    e, c, targets, lse, w = _tile_inputs(nv, cur, D, v_start=0)
    _, g = _g_view(nv, cur)
    kw = dict(v_start=0, softcap=None, z_loss=0.0, onehot_weight=1.0, uniform_weight=0.0)
    GT.grad_tiles(e, c[:cur], targets, lse, w, g, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        GT.grad_tiles(e, c[:cur], targets, lse, w, g, **kw)
    e2, c2, targets2, lse2, w2 = _tile_inputs(nv, cur, D, v_start=0, seed=1)
    for dst, src in ((e, e2), (c, c2), (targets, targets2), (lse, lse2), (w, w2)):
        dst.copy_(src)
    g.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = tile_reference(e, c[:cur], targets, lse, w, **kw)
    assert ((g.double() - want).abs() <= 2.0 ** -8 * want.abs() + 1e-5 * w.max().item()).all()


def _realistic(N, D, V, ignore_every=0, seed=0):
    """Peaky logits like a trained model's (std ~4 over the vocabulary, a few strong tokens per row), targets
    drawn mostly from each row's likely tokens."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(N, D, generator=g)
    c = torch.randn(V, D, generator=g) * (4.0 / math.sqrt(D))
    strong = torch.randint(0, V, (N, 4), generator=g)
    c[strong[:, 0]] += e * (8.0 / math.sqrt(D)) * 0.5  # each row's first strong token gets a large logit
    t = torch.where(torch.rand(N, generator=g) < 0.5, strong[:, 0], torch.randint(0, V, (N, ), generator=g))
    if ignore_every:
        t[::ignore_every] = -100
    e = e.to(BF16).cuda().requires_grad_()
    c = c.to(BF16).cuda().requires_grad_()
    return e, c, t.cuda()


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("ignore_every, opts", [(0, {}), (7, {}), (5, dict(z_loss=1e-4, label_smoothing=0.1))])
def test_whole_loss_gradients_vs_reference(ignore_every, opts):
    """linear_cross_entropy's loss, dE and dC on the Gluon route against impl="reference": no worse than the
    Triton tile kernel's route (tiles="triton") by more than a little, and both close in absolute terms."""
    e, c, t = _realistic(1000, 2304, 50000, ignore_every)
    before = GT.launch_count
    got = _grads(e, c, t, impl="triton", **opts)
    assert GT.launch_count > before, "the Gluon tile kernel did not run"
    tri = _grads(e, c, t, impl="triton", config=CCEKernelConfig(tiles="triton"), **opts)
    ref = _grads(e, c, t, impl="reference", **opts)
    assert got[0].equal(tri[0])  # same forward
    for a, b, r in zip(got[1:], tri[1:], ref[1:]):
        assert _rel(a, r) <= 1.2 * _rel(b, r) + 1e-4, (_rel(a, r), _rel(b, r))
        assert _rel(a, r) <= 1e-2
        assert _rel(a, b) <= 1e-2


@pytest.mark.cuda
@needs_hopper
def test_backward_takes_the_gluon_route_unless_told_otherwise():
    e, c, t = _realistic(512, 256, 4096, ignore_every=3)
    before = GT.launch_count
    got = _grads(e, c, t)  # impl="auto" on CUDA: the Triton path, Gluon tiles
    assert GT.launch_count > before
    before = GT.launch_count
    tri = _grads(e, c, t, config=CCEKernelConfig(tiles="triton"))
    assert GT.launch_count == before
    for a, b in zip(got[1:], tri[1:]):
        assert _rel(a, b) < 1e-2
    # a softcap (Gemma-2's 30) takes the Gluon tiles too, on SOFTCAP_TILE_CONFIG
    before = GT.launch_count
    got = _grads(e, c, t, softcap=30.0)
    assert GT.launch_count > before
    tri = _grads(e, c, t, softcap=30.0, config=CCEKernelConfig(tiles="triton"))
    for a, b in zip(got[1:], tri[1:]):
        assert _rel(a, b) < 1e-2
    # routes that stay on the Triton tile kernel: a bias, filtering, fp16
    before = GT.launch_count
    b = torch.zeros(c.shape[0], dtype=BF16, device="cuda", requires_grad=True)
    linear_cross_entropy(e, c, t, bias=b).backward()
    linear_cross_entropy(e, c, t, config=CCEKernelConfig(filter_eps="auto")).backward()
    linear_cross_entropy(e.detach().half().requires_grad_(), c.detach().half().requires_grad_(), t).backward()
    assert GT.launch_count == before


# =============================================================================== the forward's Gluon LSE kernel
def lse_reference(e2d, c, rows, targets, softcap, chunk=8192):
    """(lse, target logit, logit sum) of rows ``rows`` of e2d against c in float64, softcap applied first, the
    vocabulary in chunks (no N x V float64 matrix)."""
    e = e2d[rows].double()
    V = c.shape[0]
    m = torch.full((e.shape[0], ), -math.inf, dtype=torch.float64, device=e.device)
    s = torch.zeros_like(m)
    z_t = torch.zeros_like(m)
    z_sum = torch.zeros_like(m)
    for start in range(0, V, chunk):
        z = e @ c[start:start + chunk].double().T
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        m_new = torch.maximum(m, z.max(1).values)
        s = s * torch.exp(m - m_new) + torch.exp(z - m_new[:, None]).sum(1)
        m = m_new
        inside = (targets >= start) & (targets < start + z.shape[1])
        z_t += torch.where(inside, z.gather(1, (targets - start).clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
        z_sum += z.sum(1)
    return m + torch.log(s), z_t, z_sum


# ---------------------------------------------------------------------------------------- CPU: routing, options
def _lse_ok(e, c, **kw):
    args = dict(bias=None, nv=e.shape[0], forward="auto")
    args.update(kw)
    return GT.gluon_lse_ok(e, c, **args)


def test_lse_routing_takes_only_bf16_unbiased_calls(monkeypatch):
    """With the hardware check passing (patched) and 132 SMs, each condition alone keeps forward.py's paths."""
    monkeypatch.setattr(GT, "on_hopper", lambda device: True)
    monkeypatch.setattr(GT, "sm_count", lambda device: 132)
    e, c = _routable(N=64, D=64, V=4096)
    assert _lse_ok(e, c)
    assert _lse_ok(e, c, nv=40)  # ignored tokens: the valid rows are gathered
    for forward in ("gemm", "fused"):
        assert not _lse_ok(e, c, forward=forward)
    assert not _lse_ok(e, c, bias=torch.zeros(c.shape[0], dtype=BF16))
    assert not _lse_ok(e, c, nv=0)
    for dtype in (torch.float16, torch.float32):
        assert not _lse_ok(*_routable(N=64, D=64, V=4096, dtype=dtype))
    assert not _lse_ok(e, c.float())
    assert not _lse_ok(e[:, :60].contiguous(), c[:, :60].contiguous())  # D % 8 != 0
    assert not _lse_ok(e, c[:, 1:57])  # C's base off by 2 bytes
    odd_rows = torch.randn(64, 84).to(BF16)[:, :64]  # 168-byte rows: not TMA-ready ...
    assert not _lse_ok(odd_rows, c)
    assert _lse_ok(odd_rows, c, nv=40)  # ... unless the valid rows are gathered into a contiguous copy
    monkeypatch.setattr(GT, "on_hopper", lambda device: False)
    assert not _lse_ok(e, c)


def test_lse_partial_buffer_stays_within_the_classifier_size(monkeypatch):
    """One slot per program, 4 fp32 per row: 17.3 MB at 132 SMs and 8192 rows; a call whose partials (twice,
    plus the gathered rows) would pass the classifier's bytes keeps the old forward (its dC is that size)."""
    monkeypatch.setattr(GT, "on_hopper", lambda device: True)
    monkeypatch.setattr(GT, "sm_count", lambda device: 132)
    assert GT.lse_partial_bytes(8192, 256000, "cuda") == 132 * 4 * 8192 * 4 == 17_301_504
    assert GT.lse_programs(100, 300, "cuda") == 2  # fewer tiles (128 x 256) than SMs: one program per tile
    assert GT.lse_partial_bytes(100, 300, "cuda") == 2 * 4 * 100 * 4
    # 8192 rows at D=64: 2 x 17.3 MB of partials against 128 B x V of classifier
    e = torch.empty(8192, 64, dtype=BF16)
    assert not _lse_ok(e, torch.empty(1000, 64, dtype=BF16))
    assert _lse_ok(e, torch.empty(270_336, 64, dtype=BF16))  # 34.6 MB of classifier: just enough
    assert not _lse_ok(e, torch.empty(270_335, 64, dtype=BF16))
    big_e = torch.empty(8192, 2304, dtype=BF16)
    assert _lse_ok(big_e, torch.empty(256000, 2304, dtype=BF16), nv=8000)  # the shape, ignored rows


def test_forward_option_is_validated():
    assert CCEKernelConfig().forward == "auto"
    for value in ("auto", "gemm", "fused"):
        assert CCEKernelConfig(forward=value).forward == value
    for bad in ("gluon", "Gemm", "", None, 1):
        with pytest.raises(ValueError, match="forward"):
            CCEKernelConfig(forward=bad)


def test_kernel_configs_are_validated_before_any_launch():
    """Unknown keys (the removed ping-pong schedule's ``pingpong`` among them) and row blocks the wgmma layout
    cannot hold are refused, naming ``config``, by both kernels' entry points."""
    e, c = _routable(N=8, D=64, V=256)
    rows = torch.arange(8)
    assert GT.tile_config(None) == GT.TILE_CONFIG and GT.tile_config(dict(stages=3))["stages"] == 3
    for bad in (dict(pingpong=True), dict(block_m=32), dict(block_m=256), dict(block_m=96)):
        with pytest.raises(ValueError, match="config"):
            GT.lse_forward_gluon(e, c, rows, rows, None, config=bad)
        with pytest.raises(ValueError, match="config"):
            GT.grad_tiles(e, c, rows, e[:, 0].float(), e[:, 0].float(), e[:, :8], v_start=0, softcap=None,
                          z_loss=0.0, onehot_weight=1.0, uniform_weight=0.0, config=bad)


def fake_lse_forward_gluon(calls):
    """A float64 stand-in for gluon_tile.lse_forward_gluon (the CPU cannot run Gluon) that records its calls."""
    def run(e2d, c, rows, targets, softcap, config=None):
        calls.append(dict(nv=rows.numel(), V=c.shape[0], softcap=softcap))
        return tuple(x.float() for x in lse_reference(e2d, c, rows, targets, softcap))
    return run


@needs_interpreter
@pytest.mark.parametrize("opts", [{}, dict(softcap=3.0, z_loss=1e-2, label_smoothing=0.1)])
@pytest.mark.parametrize("ignore_every", [0, 4])
def test_forward_routes_the_lse_through_the_gluon_call(monkeypatch, opts, ignore_every):
    """With the hardware check forced on (and the kernel replaced by its float64 statistics), a bf16 call's
    forward hands the whole vocabulary to ``lse_forward_gluon`` once, allocates no GEMM scratch (the backward
    allocates dC itself), and the loss and gradients equal forward="gemm"'s; "gemm", "fused" and a bias never
    ask for it."""
    from thrifty.loss import cce

    e, c, t = _make(ignore_every=ignore_every)
    want = _grads(e, c, t, impl="triton", config=CCEKernelConfig(forward="gemm"), **opts)
    calls, scratch, handed = [], [], []
    monkeypatch.setattr(GT, "on_hopper", lambda device: True)
    monkeypatch.setattr(B, "gluon_tiles_ok", lambda *a, **k: False)  # the backward keeps the Triton tiles
    monkeypatch.setattr(GT, "lse_forward_gluon", fake_lse_forward_gluon(calls))
    real_scratch, real_backward = cce._gemm_forward_scratch, B.linear_ce_backward
    monkeypatch.setattr(cce, "_gemm_forward_scratch", lambda *a: scratch.append(1) or real_scratch(*a))
    monkeypatch.setattr(B, "linear_ce_backward", lambda *a, **k: handed.append(k["dc"]) or real_backward(*a, **k))
    got = _grads(e, c, t, impl="triton", **opts)
    nv = int((t != -100).sum())
    assert calls == [dict(nv=nv, V=c.shape[0], softcap=opts.get("softcap"))]
    assert not scratch and handed == [None]
    assert _rel(got[0], want[0]) < 1e-6
    for a, b in zip(got[1:], want[1:]):
        assert _rel(a, b) < 1e-2, _rel(a, b)
    calls.clear()
    for cfg in (CCEKernelConfig(forward="gemm"), CCEKernelConfig(forward="fused")):
        _grads(e, c, t, impl="triton", config=cfg, **opts)
    e.grad = c.grad = None
    linear_cross_entropy(e, c, t, bias=torch.zeros(c.shape[0], dtype=BF16), impl="triton", **opts).backward()
    assert not calls
    assert len(scratch) == 2  # "gemm" and the bias call took the GEMM forward's scratch (the interpreter's rule)


@needs_interpreter
def test_interpreter_forward_keeps_the_old_paths():
    """Unpatched, a bf16 forward under the interpreter takes no Gluon launch."""
    e, c, t = _make()
    before = GT.lse_launch_count
    _grads(e, c, t, impl="triton")
    assert GT.lse_launch_count == before


# ------------------------------------------------------------------------------------------------------ GPU
def _lse_inputs(N, nv, V, D, seed=0):
    """bf16 E (N rows, nv of them valid, in a scattered order) and C with peaky logits (std ~4), targets of the
    valid rows: from each row's likely tokens, uniform, and the last column V - 1."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(N, D, generator=g).to(BF16)
    c = (torch.randn(V, D, generator=g) * (4.0 / math.sqrt(D))).to(BF16)
    rows = torch.randperm(N, generator=g)[:nv].sort().values if nv < N else torch.arange(N)
    targets = torch.randint(0, V, (nv, ), generator=g)
    targets[::3] = V - 1
    return e.cuda(), c.cuda(), rows.cuda(), targets.cuda()


def lse_tolerance(name, ref, V):
    """fp32 logits of D bf16 products: |error| ~ 1e-6 of the logits' size; the logit sum adds V of them."""
    return (1e-4 if name != "z_sum" else 1e-6 * V + 1e-3) + 2e-6 * ref.abs()


LSE_SHAPES = [(1, 1, 1000, 64), (200, 127, 4097, 200), (300, 300, 50000, 2304), (9000, 8200, 128256, 4096),
              (127, 127, 128256, 2304), (8200, 8200, 4097, 64), (400, 300, 1000, 4096), (130, 129, 50000, 200)]


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("N, nv, V, D", LSE_SHAPES)
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_gluon_lse_matches_fused_kernel_and_float64(N, nv, V, D, softcap):
    """lse, target logit and logit sum against float64 within fp32 accumulation error, and no worse than the fused
    Triton kernel's by more than a little; two launches give the same bits (fixed tiles per slot, fixed merge)."""
    from thrifty.loss.forward import lse_forward

    e, c, rows, targets = _lse_inputs(N, nv, V, D)
    before = GT.lse_launch_count
    got = GT.lse_forward_gluon(e, c, rows, targets, softcap)
    assert GT.lse_launch_count == before + 1
    again = GT.lse_forward_gluon(e, c, rows, targets, softcap)
    fused = lse_forward(e, c, None, rows, targets, softcap)
    ref = lse_reference(e, c, rows, targets, softcap)
    for name, g, a, f, r in zip(("lse", "z_t", "z_sum"), got, again, fused, ref):
        assert g.dtype == torch.float32 and g.shape == (nv, )
        assert torch.equal(g, a), name
        tol = lse_tolerance(name, r, V)
        err_g, err_f = (g.double() - r).abs(), (f.double() - r).abs()
        assert (err_g <= tol).all(), (name, err_g.max().item(), err_f.max().item())
        assert err_g.max() <= 2 * err_f.max() + tol.min(), (name, err_g.max().item(), err_f.max().item())


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("ignore_every, opts", [(0, {}), (7, dict(softcap=30.0, z_loss=1e-4,
                                                                  label_smoothing=0.1))])
def test_whole_loss_with_the_gluon_forward_vs_reference(ignore_every, opts):
    """linear_cross_entropy's loss, dE and dC with the Gluon LSE forward (and Gluon tiles) against
    impl="reference" and against forward="gemm"."""
    e, c, t = _realistic(1000, 2304, 50000, ignore_every)
    before = GT.lse_launch_count
    got = _grads(e, c, t, impl="triton", **opts)
    assert GT.lse_launch_count == before + 1, "the Gluon LSE kernel did not run"
    gemm = _grads(e, c, t, impl="triton", config=CCEKernelConfig(forward="gemm"), **opts)
    assert GT.lse_launch_count == before + 1
    ref = _grads(e, c, t, impl="reference", **opts)
    assert abs(got[0] - ref[0]) <= 1e-5 * abs(ref[0]) + 1e-6, (got[0].item(), ref[0].item())
    assert abs(got[0] - gemm[0]) <= 1e-5 * abs(gemm[0]) + 1e-6
    for a, b, r in zip(got[1:], gemm[1:], ref[1:]):
        assert _rel(a, r) <= 1.2 * _rel(b, r) + 1e-4, (_rel(a, r), _rel(b, r))
        assert _rel(a, r) <= 1e-2


@pytest.mark.cuda
@needs_hopper
def test_forward_takes_the_gluon_route_unless_told_otherwise():
    """A bf16 training forward on sm_90 takes the Gluon LSE kernel; forward="gemm" / "fused", a bias and fp16
    do not; a no-grad call does too (it needs no scratch)."""
    e, c, t = _realistic(512, 2304, 8192, ignore_every=3)
    before = GT.lse_launch_count
    _grads(e, c, t)  # impl="auto" on CUDA: the Triton path
    assert GT.lse_launch_count == before + 1
    with torch.no_grad():
        linear_cross_entropy(e, c, t)
    assert GT.lse_launch_count == before + 2
    before = GT.lse_launch_count
    for cfg in (CCEKernelConfig(forward="gemm"), CCEKernelConfig(forward="fused")):
        _grads(e, c, t, config=cfg)
    b = torch.zeros(c.shape[0], dtype=BF16, device="cuda", requires_grad=True)
    linear_cross_entropy(e, c, t, bias=b).backward()
    linear_cross_entropy(e.detach().half().requires_grad_(), c.detach().half().requires_grad_(), t).backward()
    assert GT.lse_launch_count == before


@pytest.mark.cuda
@needs_hopper
def test_gluon_lse_in_a_cuda_graph():
    """Captured once (descriptors by value, persistent grid, the partial buffer from the graph's pool), replayed
    on new contents of the same inputs."""
    N, nv, V, D = 700, 600, 30000, 2304
    e, c, rows, targets = _lse_inputs(N, nv, V, D)
    GT.lse_forward_gluon(e, c, rows, targets, None)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = GT.lse_forward_gluon(e, c, rows, targets, None)
    e2, c2, _, targets2 = _lse_inputs(N, nv, V, D, seed=1)
    for dst, src in ((e, e2), (c, c2), (targets, targets2)):
        dst.copy_(src)
    graph.replay()
    eager = GT.lse_forward_gluon(e, c, rows, targets, None)
    torch.cuda.synchronize()
    for name, g, want, r in zip(("lse", "z_t", "z_sum"), out, eager, lse_reference(e, c, rows, targets, None)):
        assert torch.equal(g, want), name  # the replay read the new contents: the same bits as a fresh launch
        assert ((g.double() - r).abs() <= lse_tolerance(name, r, V)).all(), name
