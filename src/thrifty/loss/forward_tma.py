"""Hopper forward (issue #32, ``path="hopper"``): the same per-row statistics as ``forward._lse_forward_kernel``
(log-sum-exp, target logit, logit sum), computed by a persistent kernel that reads E and C through TMA
descriptors and balances its work exactly over the SMs.

Why this kernel and not the default one (NOTES.md "Hopper path (issue #32)"):

* Wave quantisation. The default grid is (row blocks, vocabulary splits): at N=8192, V=256k it launches 576
  programs of 111 tiles (plus 64 of one tile) on 132 SMs, i.e. 4.36 waves run in 5 rounds -- 13% of the
  forward is idle SMs. Here ``P`` = #SMs programs each take a contiguous range of the flattened
  (row block, vocabulary tile) space of exactly floor/ceil(T/P) tiles; a range may span row blocks, so each
  program writes one partial per row block it touched (``segments``) and a small torch merge combines them.
* TMA (``cp.async.bulk.tensor``) instead of per-thread pointer loads: no address arithmetic or row gather in
  the main loop (ignored tokens are gathered once on the host: an nv x D copy that lives only during the
  forward, far below the backward's dE + dC peak), and the out-of-range rows / vocabulary entries of edge tiles
  arrive as zeros, so the loads carry no masks.
* One flattened (tile x D-step) loop (``tl.range(flatten=True)``): the software pipeline keeps loading the next
  tile's first D-steps while the current tile's softmax epilogue runs, instead of draining at every tile.

The contract is unchanged: every logit is computed in fp32 from the same bf16/fp16 products, no N x V buffer.
fp32 inputs (exact IEEE dots, not tf32) and shapes TMA cannot describe stay on the default kernel
(``supports``); ``STATS`` counts which kernel ran so tests and the benchmark can tell.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..triton_utils import interpreting, mma, sm_count
from .forward import NEG_BIG, _tanh

STATS = {"tma": 0, "fallback": 0}  # launches of this kernel / hopper-path calls that ran the default kernel


@triton.jit
def _logits_tma(e_desc, c_desc, r0, v0, D, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 (BLOCK_N x BLOCK_V) logits of rows [r0, +BLOCK_N) against vocabulary [v0, +BLOCK_V); TMA zero-fills
    rows and columns past the tensors' ends, so they come out 0 (masked by the caller)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        a = e_desc.load([r0, d0])
        b = c_desc.load([v0, d0])
        acc = mma(a, b.T, acc)
    return acc


@triton.jit
def _lse_forward_tma_kernel(e_desc, c_desc, BIAS, TGT, OUT, NV, V, D, n_vt, n_tiles, segs, softcap,
                            HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program p reduces tiles [p*T//P, (p+1)*T//P) of the row-major (row block, vocabulary tile) order and writes
    (max, sum of exp, target logit, logit sum) per row of every row block it touched to OUT[p, rb - rb_first]."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    t_lo = (pid.to(tl.int64) * n_tiles // n_prog).to(tl.int32)
    t_hi = ((pid + 1).to(tl.int64) * n_tiles // n_prog).to(tl.int32)
    rb_first = t_lo // n_vt
    offs_n = tl.arange(0, BLOCK_N)
    offs_v = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_N,), NEG_BIG, tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    z_t = tl.zeros((BLOCK_N,), tl.float32)
    z_sum = tl.zeros((BLOCK_N,), tl.float32)
    # flatten: one pipelined loop over (tile, D-step), so TMA loads of the next tile's first D-steps are in
    # flight during this tile's epilogue (checked in the sm_90 TTGIR: one scf.for, async wgmma, pendings=1).
    # warp_specialize=True is not used: on sm_90 Triton 3.6 only tags the loop (no producer partition, no
    # setmaxnreg; identical PTX), so the epilogue still runs in the MMA warps -- NOTES.md, Hopper path.
    for t in tl.range(t_lo, t_hi, flatten=True):
        rb = t // n_vt
        vt = t - rb * n_vt
        # a new row block starts fresh statistics (selects, not a branch: the loop stays one pipelined body)
        fresh = (vt == 0) | (t == t_lo)
        m = tl.where(fresh, NEG_BIG, m)
        s = tl.where(fresh, 0.0, s)
        z_t = tl.where(fresh, 0.0, z_t)
        z_sum = tl.where(fresh, 0.0, z_sum)
        z = _logits_tma(e_desc, c_desc, rb * BLOCK_N, vt * BLOCK_V, D, BLOCK_N, BLOCK_V, BLOCK_D)
        r = rb * BLOCK_N + offs_n
        row_mask = r < NV
        cols = vt * BLOCK_V + offs_v
        col_mask = cols < V
        if HAS_BIAS:
            z += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_SOFTCAP:
            z = softcap * _tanh(z / softcap)
        tgt = tl.load(TGT + r, mask=row_mask, other=-1)
        z_t += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        z_sum += tl.sum(tl.where(col_mask[None, :], z, 0.0), axis=1)
        z = tl.where(col_mask[None, :], z, NEG_BIG)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m = m_new
        # the row block ends here (its last tile, or this program's last): its partial goes out (masked store)
        last = (vt == n_vt - 1) | (t == t_hi - 1)
        out = OUT + ((pid * segs + rb - rb_first) * 4) * BLOCK_N + offs_n
        keep = row_mask & last
        tl.store(out, m, mask=keep)
        tl.store(out + BLOCK_N, s, mask=keep)
        tl.store(out + 2 * BLOCK_N, z_t, mask=keep)
        tl.store(out + 3 * BLOCK_N, z_sum, mask=keep)


def tma_config(interp: bool) -> dict:
    """Tiles of the default kernel's best measured config (128 x 256 x 64, 8 warps = two wgmma warpgroups of
    64 x 256), 4 stages (48 KiB of E/C per stage: 197 KB of shared memory of the 227 KiB, 255 registers and no
    spills in ptxas for sm_90a). ``programs``: None = one per SM (tests set small counts to exercise ranges that
    span row blocks)."""
    if interp:
        return dict(BLOCK_N=16, BLOCK_V=32, BLOCK_D=16, num_warps=4, num_stages=1, programs=None)
    return dict(BLOCK_N=128, BLOCK_V=256, BLOCK_D=64, num_warps=8, num_stages=4, programs=None)


def supports(e2d: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether this kernel can run the call: 16-bit inputs (fp32 keeps the default kernel's exact IEEE dots),
    a Hopper-or-newer GPU (TMA) or the interpreter, and rows TMA can describe (16-byte strides and bases)."""
    if e2d.dtype not in (torch.bfloat16, torch.float16) or c.dtype != e2d.dtype:
        return False
    if not interpreting() and (e2d.device.type != "cuda" or torch.cuda.get_device_capability(e2d.device)[0] < 9):
        return False
    el = e2d.element_size()
    return all(x.stride(1) == 1 and (x.stride(0) * el) % 16 == 0 and x.data_ptr() % 16 == 0 for x in (e2d, c))


def _partition(nv: int, V: int, cfg: dict, device) -> tuple:
    """(programs, tiles per row block, total tiles, segment slots per program)."""
    n_vt = triton.cdiv(V, cfg["BLOCK_V"])
    n_tiles = triton.cdiv(nv, cfg["BLOCK_N"]) * n_vt
    sms = sm_count(device.index if device.type == "cuda" else None)
    programs = max(1, min(cfg["programs"] or sms, n_tiles))
    per = triton.cdiv(n_tiles, programs)
    segs = (per - 1) // n_vt + 2  # a range of `per` tiles touches at most this many row blocks
    return programs, n_vt, n_tiles, segs


def _merge(out: torch.Tensor, nv: int, n_vt: int, n_tiles: int, block_n: int):
    """(lse, target logit, logit sum) per valid row from the per-(program, row block) partials. Slots a program
    did not write (garbage) are sent to a dummy row nv, dropped at the end. All on the device, no sync."""
    programs, segs = out.shape[0], out.shape[1]
    dev = out.device
    p = torch.arange(programs, device=dev)
    t_lo, t_hi = p * n_tiles // programs, (p + 1) * n_tiles // programs
    rb = (t_lo // n_vt)[:, None] + torch.arange(segs, device=dev)
    used = (rb <= ((t_hi - 1) // n_vt)[:, None]) & (t_hi > t_lo)[:, None]
    row = rb[:, :, None] * block_n + torch.arange(block_n, device=dev)
    row = torch.where(used[:, :, None] & (row < nv), row, nv).reshape(-1)
    m, s, z_t, z_sum = (x.reshape(-1) for x in out.unbind(2))
    m_max = torch.full((nv + 1,), float("-inf"), device=dev).scatter_reduce_(0, row, m, "amax")
    total = torch.zeros(nv + 1, device=dev).index_add_(0, row, s * torch.exp(m - m_max[row]))
    lse = m_max + torch.log(total)
    zt = torch.zeros(nv + 1, device=dev).index_add_(0, row, z_t)
    zs = torch.zeros(nv + 1, device=dev).index_add_(0, row, z_sum)
    return lse[:nv], zt[:nv], zs[:nv]


def lse_forward_tma(e2d, c, bias, rows, targets, softcap, config=None):
    """``forward.lse_forward``'s results, (lse, target logit, logit sum) fp32 of shape (Nv,), on this kernel."""
    cfg = {**tma_config(interpreting()), **(config or {})}
    nv, V, D = rows.numel(), c.shape[0], c.shape[1]
    # the valid rows, contiguous for TMA: a view when no token is ignored (rows == arange(N)), else one gather
    ev = e2d if nv == e2d.shape[0] else e2d.index_select(0, rows)
    bn, bv, bd = cfg["BLOCK_N"], cfg["BLOCK_V"], cfg["BLOCK_D"]
    programs, n_vt, n_tiles, segs = _partition(nv, V, cfg, e2d.device)
    out = torch.empty(programs, segs, 4, bn, dtype=torch.float32, device=e2d.device)
    e_desc = TensorDescriptor(ev, list(ev.shape), list(ev.stride()), [bn, bd])
    c_desc = TensorDescriptor(c, list(c.shape), list(c.stride()), [bv, bd])
    STATS["tma"] += 1
    _lse_forward_tma_kernel[(programs,)](
        e_desc, c_desc, c if bias is None else bias, targets, out, nv, V, D, n_vt, n_tiles, segs,
        float(softcap or 1.0), HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
        BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return _merge(out, nv, n_vt, n_tiles, bn)
