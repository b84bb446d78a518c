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
@pytest.mark.parametrize("opts", [{}, dict(softcap=3.0, z_loss=1e-2, label_smoothing=0.1)])
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
    _check_tiles(*_run_both(nv, cur, D, opts))


@pytest.mark.cuda
@needs_hopper
@pytest.mark.parametrize("nv, cur, D", [(1, 256, 64), (300, 4097, 2304), (1000, 2048, 4096)])
@pytest.mark.parametrize("opts", [dict(), dict(softcap=30.0, z_loss=1e-4, label_smoothing=0.1)])
def test_cooperative_form_matches_too(nv, cur, D, opts):
    """The cooperative form (both warpgroups on one 128 x 256 tile; the GPU session times it against the
    default)."""
    _check_tiles(*_run_both(nv, cur, D, opts, config=GT.COOPERATIVE_CONFIG))


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
@pytest.mark.parametrize("ignore_every, opts", [(0, {}), (7, {}), (5, dict(softcap=30.0, z_loss=1e-4,
                                                                             label_smoothing=0.1))])
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
    # routes that stay on the Triton tile kernel: a bias, filtering, fp16
    before = GT.launch_count
    b = torch.zeros(c.shape[0], dtype=BF16, device="cuda", requires_grad=True)
    linear_cross_entropy(e, c, t, bias=b).backward()
    linear_cross_entropy(e, c, t, config=CCEKernelConfig(filter_eps="auto")).backward()
    linear_cross_entropy(e.detach().half().requires_grad_(), c.detach().half().requires_grad_(), t).backward()
    assert GT.launch_count == before
