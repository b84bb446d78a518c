"""ShadowKV decode throughput on one GPU: a Llama-3-8B-shaped model (random bf16 weights: decode speed does not
depend on the values) at 60K and 122K context, dense bf16 KV at the largest batch that fits the GPU vs ShadowKV
at the largest batch that fits GPU + pinned host memory (and with fp8 host values), in the shape of the paper's
Table 4 (A100: 80.8 -> 239.5 tok/s at 122K).

Both methods run the same hand-written decode step over thrifty's reference-model modules with static buffers,
captured in one CUDA graph; only the attention differs: dense = thrifty's split-K decode kernel over the whole
KV cache; ShadowKV = ``thrifty.kvcache.decode.kernel_decode_step`` (landmark scores, top-k, reuse plan, key
rebuild, value fetch from pinned host memory, sparse attention). The ShadowKV state is synthetic with the real
shapes (random low-rank factors, landmarks, pinned values): prefill/SVD are not timed, and the selections of
random data give their own hit rate (reported) instead of real text's ~60%.

Also: per-step latency at batch 1 and a breakdown of one layer's ShadowKV attention (scoring, reuse plan,
rebuild, fetch, attention) vs the whole step ("the rest" = everything else).

    THRIFTY_COMMIT=<sha> bash benchmarks/run_on_gpu.sh benchmarks/shadowkv.py
    python benchmarks/shadowkv.py --smoke         # tiny shapes on the CPU (Triton interpreter), no graphs

Per-stage times only (batch 1, one layer's state, no model, no host arena; about a minute), this tree against
another one in the same run (``git archive <old> | tar -x -C .base``, carry ``.base``):

    THRIFTY_COMMIT=<sha> THRIFTY_NO_INSTALL=1 bash benchmarks/run_on_gpu.sh benchmarks/shadowkv.py \
        --stages-only --baseline-src .base/src
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import subprocess
import sys
import time

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from thrifty import bench  # noqa: E402

try:
    from thrifty.bench import capture_graph  # noqa: E402
except ImportError:  # a --baseline-src tree from before bench.capture_graph: its recipe (see there), inline
    def capture_graph(fn, warmup=2, *, repeat=1):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(repeat):
                out = fn()
        return graph, out

try:
    from thrifty.kv.decode_kernel import masked_decode_attention  # noqa: E402
except ImportError:  # a --baseline-src tree from before the KV family's one decode kernel
    from thrifty.kvcache.attention_kernel import decode_attention as masked_decode_attention  # noqa: E402
from thrifty.kvcache import ShadowKVConfig, ShadowKVEngine  # noqa: E402
from thrifty.kvcache import host as hostmem  # noqa: E402
from thrifty.kvcache import reference as ref  # noqa: E402
from thrifty.kvcache.decode import fast_layer, kernel_decode_step  # noqa: E402
from thrifty.kvcache.fill_kernel import fill_slots  # noqa: E402
from thrifty.kvcache.score_kernel import score_and_select  # noqa: E402
from thrifty.models import LlamaConfig, LlamaForCausalLM  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, max_position_embeddings=131072,
                 tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=4096, tie_word_embeddings=False)
PAPER_CFG = dict(rank=160, chunk_size=8, local_chunks=4)  # outlier chunks: --outliers (ShadowKVConfig default)
# Reuse rate of the selections between consecutive steps. Until benchmarks/shadowkv_hit_rate.py has measured it
# on SmolLM2 (real text, the reuse buffer, 2K-8K), the paper's ~60% (arXiv 2410.21465 Fig. 5 right).
DEFAULT_HIT_RATE = 0.6
HIT_RATE_SOURCE = "paper Fig. 5 (~60%); measure with benchmarks/shadowkv_hit_rate.py"


def build_model(shape: dict, device) -> LlamaForCausalLM:
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape))
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.ndim > 1 else p.fill_(1.0)
    return model.eval()


class DecodeStep:
    """One greedy decode step of the whole batch through static buffers; ``attention(layer, q, k, v)`` gets the
    post-RoPE query/key of the new token."""

    def __init__(self, model: LlamaForCausalLM, batch: int, start_pos: int, attention, device):
        c = model.config
        self.model, self.attention = model, attention
        self.B, self.Hq, self.H, self.D = batch, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.full((1,), start_pos, dtype=torch.long, device=device)
        n = start_pos + 1024
        # RoPE cos/sin at positions 0..n-1, as the model's rotary embedding computes them (fp32 products and trig)
        freqs = torch.arange(n, device=device, dtype=torch.float32)[:, None] * model.model.rotary.inv_freq.to(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    @torch.no_grad()
    def __call__(self):
        m = self.model.model
        cos, sin = self.cos[self.pos], self.sin[self.pos]  # (1, D), gathered on the device
        x = m.embed_tokens(self.ids)
        B, Hq, H, D = self.B, self.Hq, self.H, self.D
        for i, layer in enumerate(m.layers):
            a, h = layer.self_attn, layer.input_layernorm(x)
            q = a.q_proj(h).view(B, 1, Hq, D).transpose(1, 2)
            k = a.k_proj(h).view(B, 1, H, D).transpose(1, 2)
            v = a.v_proj(h).view(B, 1, H, D).transpose(1, 2)
            q, k = ref.apply_rope(q, cos, sin).to(x.dtype), ref.apply_rope(k, cos, sin).to(x.dtype)
            o = self.attention(i, q, k, v)
            x = x + a.o_proj(o.transpose(1, 2).reshape(B, 1, Hq * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.model.lm_head(m.norm(x))
        self.ids.copy_(logits.argmax(-1))
        self.pos += 1


class DenseAttention:
    def __init__(self, layers, batch, H, D, context, extra, device, splits):
        N = context + extra
        self.k = [torch.zeros(batch, H, N, D, dtype=torch.bfloat16, device=device) for _ in range(layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.valid = torch.zeros(batch, H, N, dtype=torch.bool, device=device)
        self.valid[:, :, :context] = True
        self.row = torch.full((1,), context, dtype=torch.long, device=device)
        self.splits, self.layers = splits, layers

    def __call__(self, i, q, k, v):
        self.k[i].index_copy_(2, self.row, k)
        self.v[i].index_copy_(2, self.row, v)
        if i == 0:
            self.valid.index_fill_(2, self.row, True)
        out = masked_decode_attention(q, self.k[i], self.v[i], self.valid, q.shape[-1] ** -0.5, splits=self.splits)
        if i == self.layers - 1:
            self.row += 1
        return out


class HostArena:
    """One pinned host buffer for every variant's values (pinned once: registering ~90 GiB takes about a
    minute), handed out as exact-size views. Without an arena (smoke runs, regress.py) each tensor is pinned
    on its own through ``host.pinned_empty`` (also checked against the safe budget)."""

    ALIGN = 256

    def __init__(self, nbytes: int, budget: hostmem.HostBudget):
        self.buf = hostmem.pinned_empty((nbytes,), torch.uint8, what="benchmark host arena", budget=budget)
        self.offset = 0

    def reset(self):
        self.offset = 0

    def take(self, shape, dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start = -(-self.offset // self.ALIGN) * self.ALIGN
        if start + n > self.buf.numel():
            raise MemoryError(f"host arena: {shape} {dtype} needs {n / 2**30:.2f} GiB at offset "
                              f"{start / 2**30:.2f} GiB, past its {self.buf.numel() / 2**30:.2f} GiB")
        self.offset = start + n
        return self.buf[start:start + n].view(dtype).view(shape)


def _host_tensor(shape, dtype, device, arena):
    if arena is not None:
        return arena.take(shape, dtype)
    if device.type == "cuda":
        return hostmem.pinned_empty(shape, dtype, what="benchmark host values").zero_()
    return torch.zeros(shape, dtype=dtype)


def synthetic_state(batch, H, D, T, cfg: ShadowKVConfig, device, host_device, arena=None):
    """A LayerState with the shapes a prefill of T tokens leaves (random contents)."""
    c = cfg.chunk_size
    n_chunks = (T - cfg.local_chunks * c) // c
    local = T - n_chunks * c
    bf = torch.bfloat16
    selectable = torch.ones(batch, H, n_chunks, dtype=torch.bool, device=device)
    outliers = torch.stack([torch.randperm(n_chunks, device=device)[:cfg.outlier_chunks] for _ in range(batch * H)])
    selectable.view(batch * H, n_chunks).scatter_(1, outliers, False)
    nd = cfg.outlier_chunks * c + local
    if cfg.host_values == "fp8":
        values = ref.HostValues(_host_tensor((batch, H, T, D), ref.FP8, device, arena),
                                _host_tensor((batch, H, T), torch.float32, device, arena), bf)
    else:
        values = ref.HostValues(_host_tensor((batch, H, T, D), bf, device, arena), None, bf)
    # the chunk radius beside the landmarks (trees with ShadowKVConfig.radius_weight): what the logits kernel reads
    radius = ({"radius": torch.rand(batch, H, n_chunks, device=device) * D ** 0.5,
               "radius_weight": cfg.radius_weight} if hasattr(cfg, "radius_weight") else {})
    return ref.LayerState(
        **radius,
        lengths=torch.full((batch,), T, device=device), n_chunks=torch.full((batch,), n_chunks, device=device),
        u=torch.randn(batch, T, cfg.rank, dtype=bf, device=device) / T ** 0.5,
        sv=torch.randn(batch, H, cfg.rank, D, dtype=bf, device=device),
        landmarks=torch.randn(batch, H, n_chunks, D, dtype=bf, device=device), chunk_min=None, chunk_max=None,
        keys_exact=None, selectable=selectable, outlier_ids=outliers.view(batch, H, -1),
        dense_k=torch.randn(batch, H, nd, D, dtype=bf, device=device),
        dense_v=torch.randn(batch, H, nd, D, dtype=bf, device=device),
        dense_valid=torch.ones(batch, H, nd, dtype=torch.bool, device=device), values=values,
        gen_k=torch.zeros(batch, H, 0, D, dtype=bf, device=device),
        gen_v=torch.zeros(batch, H, 0, D, dtype=bf, device=device))


class ShadowKVAttention:
    """ShadowKV's kernel path over a synthetic state. ``hit_rate`` (None: whatever random data gives, ~0):
    that fraction of the slots (a fixed random mask) has its fill work dropped after the select kernel, as if
    those chunks had been selected at the previous step too. Selection and attention cost the same either
    way; the fill (key rebuild + value fetch over the host link) scales with the misses."""

    def __init__(self, layers, batch, H, D, context, cfg, device, cos, sin, arena: "HostArena | None" = None,
                 hit_rate: float | None = None):
        self.engine = ShadowKVEngine(cfg, layers, H, D, lambda n, dev: (cos[:n], sin[:n]))
        self.engine.cos, self.engine.sin = cos, sin
        host = torch.device("cpu")
        if arena is not None:
            arena.reset()  # the previous variant's views are gone
        for i in range(layers):
            self.engine.states[i] = synthetic_state(batch, H, D, context, cfg, torch.device(device), host, arena)
        self.hit_mask = None
        if hit_rate is not None:
            K = min(cfg.select_chunks, self.engine.states[0].selectable.shape[-1])
            g = torch.Generator().manual_seed(0)
            self.hit_mask = (torch.rand(batch, H, K, generator=g) < hit_rate).to(device)

    def __call__(self, i, q, k, v):
        if self.hit_mask is None:
            return kernel_decode_step(self.engine, i, q, k, v, q.shape[-1] ** -0.5)
        e, st = self.engine, self.engine.states[i]
        fl = fast_layer(e, i, q.shape[1] // k.shape[1])
        score_and_select(q, k, v, st.landmarks, st.selectable, st.landmarks.shape[-1] ** -0.5, fl, **radius_args(st))
        fl.n_generated += 1
        fl.work.masked_fill_(self.hit_mask, -1)
        fill_slots(fl.work, st.u, st.sv, e.cos, e.sin, st.values.data, st.values.scale, fl.k, fl.v, fl.sel_base,
                   fl.chunk_size)
        return masked_decode_attention(q, fl.k, fl.v, fl.valid, q.shape[-1] ** -0.5)

    def hit_rate(self) -> float:
        return 1.0 - sum(f.last_miss.float().mean().item() for f in self.engine.fast) / len(self.engine.fast)


def gpu_bytes_shadowkv(layers, H, D, T, cfg: ShadowKVConfig, gen: int) -> int:
    c = cfg.chunk_size
    C = (T - cfg.local_chunks * c) // c
    per_layer = (T * cfg.rank * 2 + H * cfg.rank * D * 2 + H * C * D * 2 + H * C  # U, SV, landmarks, selectable
                 + H * C * 4 + 3 * H * cfg.select_chunks * 4  # slot_of, slot_ids, work, miss list
                 + 2 * H * (cfg.outlier_chunks * c + 2 * c * cfg.local_chunks + cfg.sparse_budget + gen) * D * 2)
    return layers * per_layer


def run_graph(step: DecodeStep, steps: int, use_graph: bool) -> float:
    """Seconds per decode step (median over ``steps`` replays)."""
    for _ in range(3):
        step()  # warm-up: compiles kernels, builds the reuse buffers
    if not use_graph:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps
    graph, _ = capture_graph(step, warmup=1)
    t = bench.time_fn(graph.replay, [()], warmup=2, reps=steps, min_reps=3)
    return t.median_ms / 1e3


def graph_ms(fn, reps: int, device) -> float:
    """Milliseconds per call of ``fn`` replayed inside one CUDA graph (``reps`` captured calls): kernel time
    without the host's launch overhead, as in the decode step. Eager timing on the CPU."""
    if device.type != "cuda":
        return bench.time_fn(fn, [()], warmup=1, reps=2, min_reps=1).median_ms
    graph, _ = capture_graph(fn, warmup=1, repeat=reps)
    return bench.time_fn(graph.replay, [()], warmup=2, reps=10, min_reps=3).median_ms / reps


def radius_args(st) -> dict:
    """``score_and_select``'s chunk-radius arguments where the tree has them (older trees: none)."""
    return ({"radius": st.radius, "radius_weight": st.radius_weight}
            if getattr(st, "radius_weight", 0.0) else {})


def layer_breakdown(att: ShadowKVAttention, q, k_new, v_new) -> dict:
    """Milliseconds of each stage of layer 0's ShadowKV attention inside a CUDA graph (after the step ran):
    select = landmark logits + scores/histogram + marks/top-K/reuse plan (3 kernels; where the tree's
    ``score_and_select`` can stop early, also ``select_logits`` = the first kernel alone and ``select_scores`` = the
    first two); fill = key rebuild + value fetch of the slots the last step filled (1 kernel); attention = split-K
    + merge (2 kernels)."""
    e, st = att.engine, att.engine.states[0]
    fl = e.fast[0]
    dev = q.device
    scale = q.shape[-1] ** -0.5
    work = fl.work.clone()  # the fill re-does the last step's work (the select below would leave none: all hits)
    timed = {
        "select": lambda: score_and_select(q, k_new, v_new, st.landmarks, st.selectable, scale, fl,
                                           **radius_args(st)),
        "fill": lambda: fill_slots(work, st.u, st.sv, e.cos, e.sin, st.values.data, st.values.scale, fl.k, fl.v,
                                   fl.sel_base, fl.chunk_size),
        "attention": lambda: masked_decode_attention(q, fl.k, fl.v, fl.valid, scale),
    }
    if "stop_after" in inspect.signature(score_and_select).parameters:  # a tree that can stop early (v4 on)
        for part in ("logits", "scores"):  # the first kernels alone: select_logits <= select_scores <= select
            timed[f"select_{part}"] = functools.partial(score_and_select, q, k_new, v_new, st.landmarks,
                                                        st.selectable, scale, fl, stop_after=part, **radius_args(st))
    out = {name: graph_ms(fn, 20, dev) for name, fn in timed.items()}
    if "select_logits" in out:  # the step's state is the full select's again (the parts left it half done)
        score_and_select(q, k_new, v_new, st.landmarks, st.selectable, scale, fl, **radius_args(st))
    out["fill_rows"] = int((work >= 0).sum()) * fl.chunk_size
    return out


ROWS_MARK = "STAGE_ROWS "  # the line a --rows-only subprocess prints its rows on


def rope_table(n: int, D: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) (n, D) fp32 of the rotate-half RoPE, without building a model."""
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D)
    emb = torch.arange(n, dtype=torch.float32, device=device)[:, None] * inv
    emb = torch.cat((emb, emb), -1)
    return emb.cos(), emb.sin()


def stage_row(shape: dict, T: int, gen: int, hit_rate, device, smoke: bool, outliers: int) -> dict:
    """One layer's ShadowKV stages at batch 1 and context T (``layer_breakdown``), after a few decode steps with
    fresh random queries (so the reuse buffer misses at the rate ``hit_rate`` leaves)."""
    Hq, H = shape["num_attention_heads"], shape["num_key_value_heads"]
    D = shape["hidden_size"] // Hq
    cfg, _ = configs_for(T, gen, smoke, outliers)
    cos, sin = rope_table(T + gen, D, shape["rope_theta"], device)
    att = ShadowKVAttention(1, 1, H, D, T, cfg, device, cos, sin, None, hit_rate)
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=g, device=device, dtype=torch.bfloat16)

    for _ in range(3):
        att(0, rand(1, Hq, 1, D), rand(1, H, 1, D), rand(1, H, 1, D))
    row = {"method": "stages", "context": T, "batch": 1, "hit_rate": att.hit_rate()}  # before the breakdown's hits
    parts = layer_breakdown(att, rand(1, Hq, 1, D), rand(1, H, 1, D), rand(1, H, 1, D))
    row.update({f"{k}_ms_per_layer" if k != "fill_rows" else k: v for k, v in parts.items()})
    del att
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def stage_rows(shape, contexts, gen, hit_rate, device, smoke, outliers) -> list:
    rows = []
    for T in contexts:
        rows.append(stage_row(shape, T, gen, hit_rate, device, smoke, outliers))
        print(rows[-1], flush=True)
    return rows


def baseline_stage_rows(src: str, argv: list) -> list:
    """The same per-stage rows with another tree's thrifty (``src``: its src/ directory), in a subprocess."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    out = subprocess.run([sys.executable, __file__, *argv, "--rows-only"], env=env, capture_output=True, text=True,
                         timeout=540)
    lines = [line for line in out.stdout.splitlines() if line.startswith(ROWS_MARK)]
    if out.returncode != 0 or not lines:
        return [{"method": "stages", "tree": "baseline", "error": out.stderr[-800:]}]
    return [dict(r, tree="baseline") for r in json.loads(lines[-1][len(ROWS_MARK):])]


def stages_main(args, shape, contexts, gen, hit_rate, device) -> None:
    """``--stages-only``: per-stage rows of this tree (and of ``--baseline-src``), one table, one result file."""
    rows = stage_rows(shape, contexts, gen, hit_rate, device, args.smoke, args.outliers)
    if args.rows_only:
        print(ROWS_MARK + json.dumps(rows), flush=True)
        return
    rows = [dict(r, tree="this") for r in rows]
    if args.baseline_src:
        argv = ["--stages-only", "--contexts", *map(str, args.contexts), "--hit-rate", str(args.hit_rate)]
        rows += baseline_stage_rows(args.baseline_src, argv + (["--smoke"] if args.smoke else []))
    summary = {}
    for r in rows:
        if "error" in r:
            continue
        tag = f"{r['context'] // 1024}k" + ("_baseline" if r["tree"] == "baseline" else "")
        for stage in ("select", "fill", "attention", "select_logits", "select_scores"):
            if f"{stage}_ms_per_layer" in r:
                summary[f"{stage}_us_{tag}"] = 1e3 * r[f"{stage}_ms_per_layer"]
    bench.print_table(rows, ["tree", "context", "hit_rate", "fill_rows", "select_ms_per_layer",
                             "select_logits_ms_per_layer", "select_scores_ms_per_layer", "fill_ms_per_layer",
                             "attention_ms_per_layer", "error"])
    bench.write_result("shadowkv_stages", rows, summary,
                       extra={"what": "one layer's ShadowKV stages at batch 1 inside a CUDA graph, synthetic state",
                              "baseline_src": args.baseline_src, "hit_rate": hit_rate, "smoke": args.smoke},
                       results_dir=None if not args.smoke else os.environ.get("TMPDIR", "/tmp"))


def host_seq_bytes(layers, H, D, T, cfg: ShadowKVConfig) -> int:
    return ref.host_bytes_per_sequence(layers, H, D, T, 2, fp8=cfg.host_values == "fp8")


def max_batches(model, layers, H, D, T, gen, cfg_native, cfg_fp8, host_limit: int, device) -> dict:
    """Largest batch per method: dense by GPU memory, ShadowKV by GPU memory and ``host_limit`` pinned bytes.
    ``why`` says which memory capped each one, with the arithmetic."""
    if device.type != "cuda":
        return {"dense": 2, "shadowkv": 2, "shadowkv_fp8": 2, "why": {}}
    free = torch.cuda.mem_get_info()[0] - (4 << 30)  # workspace for activations, graphs, allocator slack
    dense_seq = 2 * layers * H * (T + gen) * D * 2
    out = {"dense": max(free // dense_seq, 0)}
    why = {"dense": f"GPU: {free / 2**30:.1f} GiB free // {dense_seq / 2**30:.2f} GiB KV per sequence"}
    for name, cfg in (("shadowkv", cfg_native), ("shadowkv_fp8", cfg_fp8)):
        gpu_seq, host_seq = gpu_bytes_shadowkv(layers, H, D, T, cfg, gen), host_seq_bytes(layers, H, D, T, cfg)
        by_gpu, by_host = free // gpu_seq, host_limit // host_seq
        out[name] = int(min(by_gpu, by_host))
        why[name] = (f"{'host' if by_host < by_gpu else 'GPU'} caps it: host {host_limit / 2**30:.1f} GiB // "
                     f"{host_seq / 2**30:.2f} GiB per sequence = {by_host}; GPU {free / 2**30:.1f} GiB // "
                     f"{gpu_seq / 2**30:.2f} GiB per sequence = {by_gpu}")
    out["why"] = why
    return out


def host_limit_bytes(host_gib, budget: hostmem.HostBudget) -> int:
    """The pinned bytes the run may use: the safe budget, or ``--host-gib`` when it asks for less. Asking for
    more raises MemoryError with the numbers (the box's OOM killer would end the run without a message)."""
    if host_gib is None:
        return budget.budget
    want = int(host_gib * 2**30)
    budget.check(want, "--host-gib")
    return want


def run_variant(name, batch, cfg, model, T, gen, steps, use_graph, arena, hit_rate, device, backoff) -> dict:
    """One row: the step time of ``name`` at ``batch`` (dense when ``cfg`` is None). With ``backoff``, an
    out-of-memory at the computed cap retries one and two sequences lower (the cap is arithmetic)."""
    c = model.config
    L, H, D = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    tries = [b for b in (batch, batch - 1, batch - 2) if b >= 1] if backoff else [batch]
    row = {}
    for b in tries or [batch]:
        step = att = None
        row = {"method": name, "context": T, "batch": int(b), "setting": f"{name} {T // 1024}K bs{b}"}
        try:
            if b < 1:
                raise RuntimeError("does not fit")
            if cfg is None:
                att = DenseAttention(L, b, H, D, T, gen + 8, device, splits=None)
                step = DecodeStep(model, b, T, att, device)
            else:
                step = DecodeStep(model, b, T, None, device)
                att = ShadowKVAttention(L, b, H, D, T, cfg, device, step.cos, step.sin, arena, hit_rate)
                step.attention = att
            sec = run_graph(step, steps, use_graph)
            row.update(step_ms=sec * 1e3, tokens_per_s=b / sec)
            if cfg is not None:
                row["hit_rate"] = att.hit_rate()
                row["host_gib_per_seq"] = att.engine.host_bytes_per_sequence() / 2**30
                if b == 1:
                    q = torch.randn(1, c.num_attention_heads, 1, D, dtype=torch.bfloat16, device=device)
                    kv = torch.randn(2, 1, H, 1, D, dtype=torch.bfloat16, device=device)
                    parts = layer_breakdown(att, q, kv[0], kv[1])
                    row.update({f"{k}_ms_per_layer" if k != "fill_rows" else k: v for k, v in parts.items()})
                    row["rest_ms"] = row["step_ms"] - L * sum(parts[k] for k in ("select", "fill", "attention"))
            return row
        except torch.OutOfMemoryError as e:
            row["error"] = f"OutOfMemoryError: {e}"[:300]
        except Exception as e:  # a variant that fails stays in the JSON as an error row
            row["error"] = f"{type(e).__name__}: {e}"[:300]
            return row
        finally:
            del step, att
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return row


def configs_for(T: int, gen: int, smoke: bool, outliers: int) -> tuple[ShadowKVConfig, ShadowKVConfig]:
    budget = 32 if smoke else (1024 if T < 100_000 else 2048)  # the paper's 1.56% / 1.67%
    base = dict(PAPER_CFG, outlier_chunks=outliers, sparse_budget=budget, max_generated=gen,
                min_prompt_len=min(T, 4096))
    if smoke:
        base.update(rank=32, outlier_chunks=4)
    return ShadowKVConfig(**base), ShadowKVConfig(**base, host_values="fp8")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--contexts", type=int, nargs="+", default=[61440, 124928])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--host-gib", type=float, default=None,
                    help="pinned host memory to use (default: MemAvailable minus the margin of thrifty.kvcache.host; "
                         "more than that is refused with a MemoryError)")
    ap.add_argument("--hit-rate", type=float, default=DEFAULT_HIT_RATE,
                    help="fraction of selected chunks reused from the previous step (random data gives ~0; real "
                         "text's rate is measured by benchmarks/shadowkv_hit_rate.py); negative: random data's own")
    ap.add_argument("--needle-json", nargs="+", default=None,
                    help="shadowkv_needle results whose accuracies go in the summary (several: pooled over their "
                         "prompts, e.g. two seeds)")
    ap.add_argument("--stages-only", action="store_true",
                    help="only the per-stage times of one layer at batch 1 per context (no model, no host arena)")
    ap.add_argument("--baseline-src", default=None,
                    help="with --stages-only: src/ of another thrifty tree, timed in the same run (a subprocess)")
    ap.add_argument("--outliers", type=int, default=ShadowKVConfig().outlier_chunks,
                    help="outlier chunks per KV head kept exact (default: ShadowKVConfig's)")
    ap.add_argument("--device-tag", default=None, help="file-name tag (default: detect_device())")
    ap.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_src and not args.stages_only:
        raise SystemExit("--baseline-src: only with --stages-only (the full run pins the host arena once)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    use_graph = device.type == "cuda"
    shape = TINY if args.smoke else LLAMA3_8B
    contexts = [384, 640] if args.smoke else args.contexts
    steps = 2 if args.smoke else args.steps
    gen = 2 * steps + 64  # rows for warm-up, capture, replays and the breakdown (the counter is not checked in a graph)
    hit_rate = None if args.hit_rate < 0 else args.hit_rate
    if args.stages_only:
        return stages_main(args, shape, contexts, gen, hit_rate, device)
    budget = hostmem.host_budget()
    host_limit = host_limit_bytes(args.host_gib, budget)
    print(f"host memory: {budget.explain()}; this run may pin {host_limit / 2**30:.1f} GiB", flush=True)
    model = build_model(shape, device)
    cfgm = model.config
    L, H, D = cfgm.num_hidden_layers, cfgm.num_key_value_heads, cfgm.head_dim

    # plan every variant first, so that one pinned arena of exactly the largest need serves them all
    plans = []
    for T in contexts:
        cfg_n, cfg_8 = configs_for(T, gen, args.smoke, args.outliers)
        caps = max_batches(model, L, H, D, T, gen, cfg_n, cfg_8, host_limit, device)
        for name, why in caps["why"].items():
            print(f"max batch {name} at {T}: {caps[name]} ({why})", flush=True)
        plans.append((T, cfg_n, cfg_8, caps))
    need = max((caps[n] * host_seq_bytes(L, H, D, T, cfg) for T, cfg_n, cfg_8, caps in plans
                for n, cfg in (("shadowkv", cfg_n), ("shadowkv_fp8", cfg_8))), default=0)
    arena = None
    if device.type == "cuda" and need > 0:
        t0 = time.perf_counter()
        arena = HostArena(need, budget)
        print(f"pinned host arena: {need / 2**30:.2f} GiB (the largest batch x per-sequence bytes) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)

    rows, summary = [], {}
    for T, cfg_n, cfg_8, caps in plans:
        variants = [("dense", caps["dense"], None), ("dense", 1, None), ("shadowkv", caps["shadowkv"], cfg_n),
                    ("shadowkv", 1, cfg_n), ("shadowkv_fp8", caps["shadowkv_fp8"], cfg_8), ("shadowkv_fp8", 1, cfg_8)]
        results = {}
        for name, batch, cfg in variants:
            row = run_variant(name, batch, cfg, model, T, gen, steps, use_graph, arena, hit_rate, device,
                              backoff=batch > 1 and device.type == "cuda")
            rows.append(row)
            if "error" not in row:
                results[(name, batch == 1)] = row
        tag = "60k" if T < 100_000 else "122k"
        if args.smoke:
            tag = f"{T}"
        dense, skv = results.get(("dense", False)), results.get(("shadowkv", False))
        fp8 = results.get(("shadowkv_fp8", False))
        if dense and skv:
            summary[f"throughput_gain_{tag}"] = skv["tokens_per_s"] / dense["tokens_per_s"]
        if dense and fp8:
            summary[f"throughput_gain_{tag}_fp8"] = fp8["tokens_per_s"] / dense["tokens_per_s"]
        d1, s1 = results.get(("dense", True)), results.get(("shadowkv", True))
        if d1 and s1:
            summary[f"batch1_step_ratio_vs_dense_{tag}"] = s1["step_ms"] / d1["step_ms"]
        f1 = results.get(("shadowkv_fp8", True))
        if d1 and f1:  # fp8 host values halve the value fetch, the largest stage at batch 1
            summary[f"batch1_step_ratio_vs_dense_{tag}_fp8"] = f1["step_ms"] / d1["step_ms"]
        for name in ("dense", "shadowkv", "shadowkv_fp8"):  # the batch that ran (after any back-off)
            ran = results.get((name, False))
            summary[f"max_batch_{name}_{tag}"] = ran["batch"] if ran else 0
    needle, needle_sources = pooled_needle(args.needle_json or [])
    summary.update(needle or {k: None for k in NEEDLE_KEYS})
    bench.print_table(rows, ["method", "context", "batch", "step_ms", "tokens_per_s", "hit_rate", "rest_ms",
                             "select_ms_per_layer", "fill_ms_per_layer", "attention_ms_per_layer", "error"])
    extra = {"model": "Llama-3-8B shape, random bf16 weights (speed does not depend on the values)",
             "state": "synthetic ShadowKV state with the real shapes; prefill not timed",
             "host_budget": budget.explain(), "host_limit_gib": host_limit / 2**30,
             "host_arena_gib": need / 2**30 if arena is not None else 0.0,
             "caps_why": {str(T): caps["why"] for T, _, _, caps in plans},
             "hit_rate": hit_rate, "hit_rate_source": HIT_RATE_SOURCE if hit_rate == DEFAULT_HIT_RATE else "--hit-rate",
             "cuda_graphs": use_graph, "smoke": args.smoke, "outlier_chunks": cfg_n.outlier_chunks,
             "needle_sources": needle_sources}
    bench.write_result("shadowkv", rows, summary, extra=extra, device=args.device_tag,
                       results_dir=None if not args.smoke else os.environ.get("TMPDIR", "/tmp"),
                       plot=dict(x="setting", y="tokens_per_s", hue="method", title="decode tokens/s"))


NEEDLE_KEYS = ("needle_acc_dense", "needle_acc_shadowkv", "needle_acc_quest", "needle_gap_vs_dense_points")


def pooled_needle(paths: list[str]) -> tuple[dict, list[dict]]:
    """The needle summaries of ``paths`` pooled, each weighted by its prompts per method: the headline keys (at
    the reference budget) and the per-budget accuracies and gaps; plus each file's name, commit and seed."""
    runs = [bench.read_result(p) for p in paths]
    if not runs:
        return {}, []
    budgets = {r["summary"]["needle_reference_budget"] for r in runs}
    if len(budgets) != 1:
        raise ValueError(f"--needle-json: the files use different reference budgets {sorted(budgets)}")
    weights = [r["summary"]["trials_per_method"] for r in runs]
    shared = set.intersection(*(set(k for k, v in r["summary"].items() if isinstance(v, float)) for r in runs))
    pooled = {k: sum(w * r["summary"][k] for w, r in zip(weights, runs)) / sum(weights)
              for k in sorted(shared) if k.startswith("needle_acc_") or k.startswith("needle_gap_")}
    pooled["needle_trials_per_method"] = sum(weights)
    sources = [{"file": os.path.basename(p), "commit": r["meta"].get("commit"),
                "seed": r["extra"]["settings"].get("seed"), "trials_per_method": w}
               for p, r, w in zip(paths, runs, weights)]
    return pooled, sources


if __name__ == "__main__":
    main()
