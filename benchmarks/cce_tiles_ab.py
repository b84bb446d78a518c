"""The CCE backward's Gluon gradient tiles, old vs new in one process (issue #32): the tiles stored by TMA from a
shared-memory buffer per warpgroup (``TILE_CONFIG``, 3 ring stages) against the stores from registers on 4 stages
(the layout before) and on 3 (the stage count alone).

Two measurements per arm, in alternating rounds (min of the round medians):
* the tile kernel alone, ms per full vocabulary (``gluon_tile.grad_tiles`` over 32768-column chunks), beside a
  cuBLAS bf16 product of the same size;
* loss+grad of ``linear_cross_entropy`` (forward, then backward for E and C), the arm's tile config put in
  ``gluon_tile.TILE_CONFIG`` for the call; dE and dC compared with the first arm's bit for bit.

Random bf16 E ~ N(0, 1), C ~ N(0, (4/sqrt(D))^2), uniform targets (the dense path's time does not depend on
the logits). Writes ``cce_tiles_ab_<device>.json`` and a PNG.

    PYTHONPATH=src python benchmarks/cce_tiles_ab.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from thrifty import bench
from thrifty.loss import gluon_tile as GT
from thrifty.loss import linear_cross_entropy

CHUNK = 32768


def arms() -> dict:
    base = dict(GT.TILE_CONFIG)
    return {"tma_store_s3": base, "reg_store_s4": dict(base, tma_store=False, stages=4),
            "reg_store_s3": dict(base, tma_store=False, stages=3)}


def inputs(N: int, D: int, V: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    e = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    c = (torch.randn(V, D, device="cuda", generator=g) * (4.0 / D ** 0.5)).bfloat16()
    t = torch.randint(0, V, (N, ), device="cuda", generator=g)
    return e, c, t


def tiles_fn(e, c, t, cfg):
    """The tile kernel over the whole vocabulary (32768-column chunks into one reused buffer)."""
    N, V = e.shape[0], c.shape[0]
    lse = torch.full((N, ), 12.0, device="cuda")
    w = torch.full((N, ), 1.0 / N, device="cuda")
    g = torch.empty(N, CHUNK, dtype=torch.bfloat16, device="cuda")

    def run():
        for s in range(0, V, CHUNK):
            GT.grad_tiles(e, c[s:s + CHUNK], t, lse, w, g[:, :min(CHUNK, V - s)], v_start=s, softcap=None,
                          z_loss=0.0, onehot_weight=1.0, uniform_weight=0.0, config=cfg)
    return run


def loss_grad_fn(e, c, t, cfg):
    e_, c_ = e.detach().requires_grad_(), c.detach().requires_grad_()

    def run():
        saved = GT.TILE_CONFIG
        GT.TILE_CONFIG = cfg
        try:
            e_.grad = c_.grad = None
            linear_cross_entropy(e_, c_, t).backward()
        finally:
            GT.TILE_CONFIG = saved
        return e_.grad, c_.grad
    return run


def timed(fn, reps: int) -> float:
    return bench.time_fn(fn, warmup=2, reps=reps).median_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2304x256000,4096x128256", help="DxV list")
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per arm and round")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rate = 2 * 8192 ** 3 / (bench.time_fn(lambda: a @ a, warmup=3, reps=20).median_ms * 1e-3) / 1e12
    del a
    print(f"bf16 matmul 8192^3: {rate:.0f} TFLOP/s", flush=True)
    rows, arm_cfgs = [], arms()
    for shape in args.shapes.split(","):
        D, V = map(int, shape.split("x"))
        for N in map(int, args.tokens.split(",")):
            e, c, t = inputs(N, D, V)
            cublas = timed(lambda: e @ c[:CHUNK].T, args.reps) * V / CHUNK
            kernel = {name: [] for name in arm_cfgs}
            full = {name: [] for name in arm_cfgs}
            ran_tma = {}
            for _ in range(args.rounds):
                for name, cfg in arm_cfgs.items():
                    before = GT.tma_store_count
                    kernel[name].append(timed(tiles_fn(e, c, t, cfg), args.reps))
                    full[name].append(timed(loss_grad_fn(e, c, t, cfg), args.reps))
                    ran_tma[name] = GT.tma_store_count > before
            grads = {name: loss_grad_fn(e, c, t, cfg)() for name, cfg in arm_cfgs.items()}
            ref_de, ref_dc = grads["tma_store_s3"]
            for name, cfg in arm_cfgs.items():
                de, dc = grads[name]
                rows.append(dict(shape=f"D={D} V={V}", tokens=N, case=f"{V // 1000}k/{N}", arm=name,
                                 tma_store=cfg["tma_store"], stages=cfg["stages"], tma_store_ran=ran_tma[name],
                                 tiles_ms=min(kernel[name]), loss_grad_ms=min(full[name]),
                                 tiles_round_medians=kernel[name], loss_grad_round_medians=full[name],
                                 cublas_same_size_ms=cublas, de_equal=bool(torch.equal(de, ref_de)),
                                 dc_equal=bool(torch.equal(dc, ref_dc))))
                r = rows[-1]
                print(f"{r['case']:>10} {name:>13}: tiles {r['tiles_ms']:7.2f} ms (cuBLAS {cublas:6.2f})  "
                      f"loss+grad {r['loss_grad_ms']:7.2f} ms  tma ran {r['tma_store_ran']}  "
                      f"grads equal {r['de_equal']}/{r['dc_equal']}", flush=True)
            del e, c, t, grads
            torch.cuda.empty_cache()
    by = {(r["case"], r["arm"]): r for r in rows}
    cases = list(dict.fromkeys(r["case"] for r in rows))

    def ratios(key):
        return [by[(k, "reg_store_s4")][key] / by[(k, "tma_store_s3")][key] for k in cases]

    summary = dict(tiles_speedup_vs_reg_store_s4_min=min(ratios("tiles_ms")),
                   tiles_speedup_vs_reg_store_s4_max=max(ratios("tiles_ms")),
                   loss_grad_speedup_vs_reg_store_s4_min=min(ratios("loss_grad_ms")),
                   loss_grad_speedup_vs_reg_store_s4_max=max(ratios("loss_grad_ms")),
                   loss_grad_speedup_vs_reg_store_s4_median=statistics.median(ratios("loss_grad_ms")),
                   grads_bit_identical=all(r["de_equal"] and r["dc_equal"] for r in rows),
                   tma_store_ran=all(r["tma_store_ran"] == r["tma_store"] for r in rows),
                   bf16_matmul_tflops=rate)
    print(summary, flush=True)
    path = bench.write_result(
        "cce_tiles_ab", rows, summary, results_dir=args.out,
        extra=dict(what=__doc__.split("\n\n")[0], rounds=args.rounds, reps=args.reps, chunk=CHUNK,
                   arms={k: dict(v) for k, v in arm_cfgs.items()}),
        plot=dict(x="case", y="loss_grad_ms", hue="arm", ylabel="loss+grad ms (lower is better)",
                  title="CCE backward tiles: TMA store vs register stores"))
    print(path)


if __name__ == "__main__":
    main()
