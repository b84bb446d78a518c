"""Host time of one call at tiny sizes (GPU work negligible), FastLauncher's direct launches on and off in the same
process, SDPA beside; then a cProfile of the attention call. Writes benchmarks/results/host_overhead_<device>.json.
Usage on the GPU box: PYTHONPATH=src python3 benchmarks/host_overhead.py"""

from __future__ import annotations

import cProfile
import io
import os
import pstats

import torch
import torch.nn.functional as F

from thrifty import bench, compress
from thrifty.attention import sage_attention
from thrifty.attention.attn_kernel import quantize_inputs, sage_forward_triton
from thrifty.triton_utils import fast_launch_enabled


def per_call_us(fn, n=2000):
    """Host microseconds per call over ``n`` back-to-back calls, synchronized once at the end."""
    return bench.host_us_per_call(fn, calls=n, warmup=50, device="cuda")


def main():
    dev = "cuda"
    q, k, v = (torch.randn(1, 8, 128, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    packed = compress((torch.randn(4096) * 0.02).to(torch.bfloat16)).to(dev)
    out = torch.empty(4096, dtype=torch.bfloat16, device=dev)
    cases = [("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
             ("sage_attention", lambda: sage_attention(q, k, v, causal=True)),
             ("sage_forward_triton", lambda: sage_forward_triton(q, k, v, causal=True, sm_scale=0.125)),
             ("quantize_inputs", lambda: quantize_inputs(q, k, v, sm_scale=0.125)),
             ("neuzip decompress 4k", lambda: packed.decompress(out=out)),
             ("torch.empty", lambda: torch.empty(8, 128, 64, device=dev))]
    print(f"host us per call   {'direct':>8s} {'triton':>8s}   (fast_launch_enabled: {fast_launch_enabled()})")
    rows = []
    for name, fn in cases:
        on = per_call_us(fn)
        os.environ["THRIFTY_FAST_LAUNCH"] = "0"
        off = per_call_us(fn)
        del os.environ["THRIFTY_FAST_LAUNCH"]
        print(f"  {name:22s} {on:8.1f} {off:8.1f}")
        rows.append(dict(call=name, us_direct=on, us_triton_path=off))
    bench.write_result("host_overhead", rows, {f"{r['call'].split()[0]}_us_direct": r["us_direct"] for r in rows},
                       extra={"shape": "q,k,v (1, 8, 128, 64) bf16, causal; neuzip: 4096 bf16 weights",
                              "timing": "host clock over 2000 back-to-back calls, synchronized at the end"})
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        sage_attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    print(text.getvalue()[:5000])


if __name__ == "__main__":
    main()
