"""Probe (issue #32): can cuBLAS logits + one HBM pass beat the fused Triton tiles? Times, on one shape, the
current forward (lse_forward) and backward tile kernel against cuBLAS bf16 x bf16 -> fp32 logit chunks followed
by a row pass (LSE; or the softmax gradient written in place as bf16), plus the plain bf16 matmul ceiling.
Not a benchmark of record: it decides whether the design is worth building."""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from thrifty.loss.backward import _grad_tile_kernel, backward_config
from thrifty.loss.forward import lse_forward


@triton.jit
def _row_lse_kernel(X, TGT, OUT, cols, col0, NV, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = X + row.to(tl.int64) * cols
    tgt = tl.load(TGT + row) - col0
    m = tl.full((BLOCK,), -1.0e30, tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    zt = tl.zeros((BLOCK,), tl.float32)
    for c0 in range(0, cols, BLOCK):
        j = c0 + tl.arange(0, BLOCK)
        x = tl.load(base + j, mask=j < cols, other=-1.0e30)
        zt += tl.where(j == tgt, x, 0.0)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    mm = tl.max(m, axis=0)
    tl.store(OUT + row, mm)
    tl.store(OUT + NV + row, tl.sum(s * tl.exp(m - mm), axis=0))
    tl.store(OUT + 2 * NV + row, tl.sum(zt, axis=0))


@triton.jit
def _row_grad_kernel(X, TGT, LSE, W, cols, col0, BLOCK: tl.constexpr):
    """g = w * (softmax - onehot) of one row of fp32 logits, written as bf16 over the row's own storage (row
    stride 2*cols in bf16 units). The barrier makes every warp's load of a block precede any store into it."""
    row = tl.program_id(0)
    base = X + row.to(tl.int64) * cols
    out = base.to(tl.pointer_type(tl.bfloat16))
    tgt = tl.load(TGT + row) - col0
    lse = tl.load(LSE + row)
    w = tl.load(W + row)
    for c0 in range(0, cols, BLOCK):
        j = c0 + tl.arange(0, BLOCK)
        x = tl.load(base + j, mask=j < cols, other=0.0)
        g = (tl.exp(x - lse) - tl.where(j == tgt, 1.0, 0.0)) * w
        tl.debug_barrier()
        tl.store(out + j, g.to(tl.bfloat16), mask=j < cols)


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2304x256000,4096x128256")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows_out = []
    for shape in args.shapes.split(","):
        D, V = map(int, shape.split("x"))
        N = args.tokens
        torch.manual_seed(0)
        e = (torch.randn(N, D, device=dev) * 0.5).bfloat16()
        c = (torch.randn(V, D, device=dev) * (2.0 / D ** 0.5)).bfloat16()
        tgt = torch.randint(0, V, (N,), device=dev, dtype=torch.int32)
        rows = torch.arange(N, device=dev, dtype=torch.int32)
        flops = 2.0 * N * D * V
        scratch_cols = (V * D * 2) // (N * 4) // 256 * 256  # fp32 logits in dC's bytes
        dc = torch.empty(V, D, device=dev, dtype=torch.bfloat16)
        buf = dc.view(-1).view(torch.float32)
        chunks = [(s, min(scratch_cols, V - s)) for s in range(0, V, scratch_cols)]

        # ceiling: plain bf16 matmul, same chunks, bf16 out
        cb = torch.empty(N, scratch_cols, device=dev, dtype=torch.bfloat16)

        def ceiling():
            for s, cur in chunks:
                torch.mm(e, c[s:s + cur].T, out=cb[:, :cur])
        t_ceil = timed(ceiling)

        def gemm_fp32():
            for s, cur in chunks:
                torch.mm(e, c[s:s + cur].T, out_dtype=torch.float32, out=buf[:N * cur].view(N, cur))
        t_gemm32 = timed(gemm_fp32)

        part = torch.empty(len(chunks), 3, N, device=dev, dtype=torch.float32)

        def fwd_new():
            for k, (s, cur) in enumerate(chunks):
                x = buf[:N * cur].view(N, cur)
                torch.mm(e, c[s:s + cur].T, out_dtype=torch.float32, out=x)
                _row_lse_kernel[(N,)](x, tgt, part[k], cur, s, N, BLOCK=2048, num_warps=8)
            m, ssum, zt = part.unbind(1)
            mx = m.max(0).values
            return mx + torch.log((ssum * torch.exp(m - mx)).sum(0)), zt.sum(0)
        t_fwd_new = timed(fwd_new)
        lse_new, zt_new = fwd_new()

        t_fwd_old = timed(lambda: lse_forward(e, c, None, rows, tgt, None))
        lse_old, zt_old, _ = lse_forward(e, c, None, rows, tgt, None)
        lse_err = (lse_new - lse_old).abs().max().item()
        zt_err = (zt_new - zt_old).abs().max().item()

        w = torch.full((N,), 1.0 / N, device=dev)

        def bwd_tiles_new():
            for s, cur in chunks:
                x = buf[:N * cur].view(N, cur)
                torch.mm(e, c[s:s + cur].T, out_dtype=torch.float32, out=x)
                _row_grad_kernel[(N,)](x, tgt, lse_old, w, cur, s, BLOCK=2048, num_warps=8)
        t_bwd_new = timed(bwd_tiles_new)
        # check the in-place gradient of the last chunk against torch
        s, cur = chunks[-1]
        g_new = buf[:N * cur].view(torch.bfloat16).view(N, 2 * cur)[:, :cur].float()
        z = (e.float() @ c[s:s + cur].float().T)
        g_ref = torch.exp(z - lse_old[:, None])
        hit = (tgt.long() - s)
        ok = (hit >= 0) & (hit < cur)
        g_ref[ok.nonzero().squeeze(1), hit[ok]] -= 1.0
        g_ref *= w[:, None]
        g_cos = torch.nn.functional.cosine_similarity(g_new.flatten(), g_ref.flatten(), dim=0).item()

        cfg = dict(backward_config(False))
        bn, bv, split = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_V"), cfg.pop("SPLIT")
        bd_tile = cfg.pop("BLOCK_D_TILE")
        cfg.pop("BLOCK_D_DC"), cfg.pop("BLOCK_D_DE")
        step = bv * split
        old_cols = (V * D * 2) // (N * 2) // step * step
        old_chunks = [(s, min(old_cols, V - s)) for s in range(0, V, old_cols)]
        gb = dc.view(-1)
        dummy = torch.zeros(4, dtype=torch.int32, device=dev)

        def bwd_tiles_old():
            for s, cur in old_chunks:
                g = gb[:N * cur].view(N, cur)
                _grad_tile_kernel[(triton.cdiv(N, bn), triton.cdiv(cur, step))](
                    e, c, c, rows, tgt, lse_old, w, rows, g, w, dummy, dummy, dummy, dummy, dummy,
                    N, D, e.stride(0), c.stride(0), g.stride(0), s, cur, 1, 1, 1.0, 0.0, 1.0, 0.0, 0.0,
                    HAS_BIAS=False, HAS_SOFTCAP=False, HAS_ORDER=False, FILTER=False, NEED_DBIAS=False,
                    SPLIT=split, LISTS=False, BLOCK_N=bn, BLOCK_V=step, BLOCK_D=bd_tile, **cfg)
        t_bwd_old = timed(bwd_tiles_old)

        row = dict(D=D, V=V, N=N, chunk_cols=scratch_cols, n_chunks=len(chunks),
                   ceiling_ms=t_ceil, ceiling_tflops=flops / t_ceil / 1e9,
                   gemm_fp32_ms=t_gemm32, gemm_fp32_tflops=flops / t_gemm32 / 1e9,
                   fwd_old_ms=t_fwd_old, fwd_new_ms=t_fwd_new, fwd_speedup=t_fwd_old / t_fwd_new,
                   bwd_tiles_old_ms=t_bwd_old, bwd_tiles_new_ms=t_bwd_new, bwd_tiles_speedup=t_bwd_old / t_bwd_new,
                   lse_max_abs_err=lse_err, target_logit_max_abs_err=zt_err, grad_cos_vs_fp32=g_cos)
        print(json.dumps(row), flush=True)
        rows_out.append(row)
        del e, c, dc, buf, cb
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows_out), f, indent=1)


if __name__ == "__main__":
    main()
