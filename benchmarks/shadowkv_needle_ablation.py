"""Where ShadowKV loses needle retrieval against Quest and dense (issue 27, item 3): a per-layer proxy on the
real SmolLM2-135M and the needle prompts of ``shadowkv_needle.py`` (same generator and seed).

Each prompt is run densely once, teacher-forced with its correct answer; the post-RoPE queries, keys and values
of every layer are captured at the answer steps (the last prompt token and the answer tokens but the last),
i.e. the queries a sparse cache would see on the right path. Each variant then compresses ``prompt[:-1]`` with
the reference (``reference.compress_prompt``) and decodes those queries with the reference's pieces; per
(layer, query head, step):

* ``mass``: the dense attention mass of the tokens the variant attends (outliers + local + selected + generated);
* ``needle``: the same restricted to the needle's answer tokens (the digits of the asked key), weighted by the
  dense mass on them: the fraction of the needle attention that reaches the variant;
* ``err``: relative L2 error of the attention output against dense attention (selection + low-rank keys).

This is a proxy, not accuracy: each layer sees dense inputs (no error compounding). It is used because the
needle accuracy has a standard error of ~2.6 points at 336 prompts (the GPU run), far above what 2 CPU cores
can run per variant, while the proxy resolves differences of a fraction of a point on a few dozen prompts.

    PYTHONPATH=src THRIFTY_DATA=... python benchmarks/shadowkv_needle_ablation.py --lengths 2048 4096 --trials 4

``--per-layer``: ShadowKV against Quest per layer on ``single`` prompts (depth 0.5) at one budget: the dense mass each
attends, the output error with exact keys (pure selection), and the prompt tokens Quest attends and ShadowKV does
not, by the dense mass lost.

``--answer-logprob``: end to end, each method's own cache (dense, ShadowKV and Quest at ``--budgets``, both with 48
outlier chunks at the last budget) decodes the last prompt token and the answer teacher-forced; the summed
log-probability of the answer tokens per prompt (continuous, so less noisy than greedy accuracy), and per
answer token. ``--methods`` keeps only the named methods (``dense``, ``shadowkv@512``, ``quest_O48@512``, ...);
``<method>/c<k>`` adds that method with landmark chunks of k tokens, the same outlier and local tokens
(``shadowkv_O48@512/c4``: 96 outlier chunks and 8 local chunks of 4; ``--chunk`` stays every other method's).
``--tf32`` adds ``shadowkv_tf32@<budget>`` per budget and the full-budget pair ``shadowkv_full@all`` /
``shadowkv_full_tf32@all``: the reference path with the inputs of its matmuls rounded to TF32, as the Triton
kernels compute them on a GPU for an fp32 model (``tl.dot`` on fp32 defaults to TF32 on tensor cores): the
landmark logits, the key rebuild ``U @ SV`` and both attention products. The GPU needle run measures ShadowKV on
the kernels and dense / Quest in fp32, so this estimates what that asymmetry costs.

The runs in NOTES.md ("Needle retrieval: where ShadowKV loses against Quest"), one process per length:

    python benchmarks/shadowkv_needle_ablation.py --lengths 2048 --trials 2 --variants quest shadowkv \
        shadowkv_r192 shadowkv_boundsel shadowkv_oraclesel shadowkv_maxlogit shadowkv_sink shadowkv_scale128 \
        shadowkv_O0 quest_O0 shadowkv_O48 quest_O48 --out benchmarks/results/shadowkv_needle_cpu-ablation-2k.json
    python benchmarks/shadowkv_needle_ablation.py --per-layer --lengths 2048 4096 --trials 1 --budgets 512 \
        --out benchmarks/results/shadowkv_needle_cpu-ablation-layers.json
    python benchmarks/shadowkv_needle_ablation.py --answer-logprob --lengths 2048 --trials 2 --budgets 256 512 \
        --out benchmarks/results/shadowkv_needle_cpu-ablation-logprob-2k.json

The audit against the paper and the public code (FINDINGS.md): TF32 emulation, per-token log-probabilities, rank 192:

    python benchmarks/shadowkv_needle_ablation.py --answer-logprob --lengths 4096 --trials 2 --budgets 512 --tf32 \
        --methods dense shadowkv@512 shadowkv_tf32@512 quest@512 shadowkv_full@all shadowkv_full_tf32@all \
        --out benchmarks/results/shadowkv_needle_cpu-ablation-tf32-4k.json
    python benchmarks/shadowkv_needle_ablation.py --answer-logprob --lengths 4096 --trials 2 --budgets 512 --rank 192 \
        --tf32 --methods shadowkv@512 shadowkv_full@all --out benchmarks/results/shadowkv_needle_cpu-ablation-r192-4k.json

Landmark chunk 4 against 8 (NOTES.md, "Needle retrieval: landmark chunk 4 (CPU proxy)"), seeds 0 and 1:

    python benchmarks/shadowkv_needle_ablation.py --answer-logprob --lengths 4096 --trials 2 --budgets 512 \
        --methods dense shadowkv_O48@512 shadowkv_O48@512/c4 quest_O48@512 --seed 0 \
        --out benchmarks/results/shadowkv_needle_cpu-ablation-logprob-4k-c4.json

Chunk scorers with a few bytes of metadata beside the mean landmark (NOTES.md, "Needle retrieval: chunk scorers
beside the mean landmark (CPU proxy)"; :data:`META_SCORERS`, bytes in :data:`META_BYTES`): ``radius`` (ball
bound, one scalar per chunk: logit (q.m + lam ||q|| r) / sqrt(D)), ``maha`` (the same ball in a per-head whitened
metric), ``far`` (the chunk's key farthest from its mean as a second landmark, max of the two logits) and
``far8`` (that key in fp8 e4m3). Per-layer variants ``shadowkv_rad<lam>``, ``shadowkv_maha<lam>`` (lam 0.1, 0.25,
0.5, 1), ``shadowkv_far``, ``shadowkv_far8``; end to end ``<shadowkv method>+<scorer>`` in ``--methods``, the
scorer spelled ``rad<lam>``, ``maha<lam>``, ``far`` or ``far8`` (``shadowkv@256+rad0.25``), seeds 0 and 1
(``-seed1``), and seed 2 with the two best lam only (``-rad-seed2``):

    python benchmarks/shadowkv_needle_ablation.py --answer-logprob --lengths 4096 --trials 2 --budgets 256 512 \
        --outliers 96 --methods dense shadowkv@256 shadowkv@512 quest@256 quest@512 shadowkv@256+rad0.1 \
        shadowkv@256+rad0.25 ... shadowkv@512+far8 --seed 0 \
        --out benchmarks/results/shadowkv_needle_cpu-ablation-logprob-4k-o96-scorers.json

Outlier choice, group aggregation and a softer radius beside the ball scorer (NOTES.md, "Needle retrieval: outlier
choice and group aggregation with the radius (CPU proxy)"): options after commas in the scorer spec
(:data:`SPEC_OPTIONS`, documented above :func:`parse_spec`), e.g. ``shadowkv@256+rad0.5,orad`` (outliers = the
chunks with the largest radius), ``,orel`` (largest radius / landmark norm), ``,ohalf`` (half min cosine, half
largest radius), ``,owin`` / ``,owinh`` (all / half of the outliers by the attention mass of the last
:data:`WINDOW` prompt queries, SnapKV's observation window, ``reference.window_mass``; the queries from
``needle.dense_prefill(..., window=WINDOW)``), ``,gsum`` / ``,glogit`` (sum of the group's softmaxes / max of its logits instead of the
max of its softmaxes), ``,r2`` (radius = mean of the two largest key-to-landmark distances). A method with an
outlier option gets its own compression (same SVD, other outlier chunks); the others fork the library's.
Seeds 0 and 1 with every option at both budgets (``-outgroup{,-seed1}``), then seeds 2 and 3 held out with the
best ones (``-outgroup-seed2``: ohalf, orel, owinh, r2, orel+r2; ``-outgroup-seed3``: ohalf, orel, owinh):

    python benchmarks/shadowkv_needle_ablation.py --answer-logprob --lengths 4096 --trials 2 --budgets 256 512 \
        --outliers 96 --methods dense quest@256 quest@512 shadowkv@256+rad0.5 shadowkv@256+rad0.5,orad ... \
        shadowkv@512+rad0.5,owinh shadowkv@256+rad0.75 --seed 0 \
        --out benchmarks/results/shadowkv_needle_cpu-ablation-logprob-4k-o96-outgroup.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

import torch

from thrifty.data import TokenDataset
from thrifty.kvcache import ShadowKVConfig

from thrifty.kvcache import reference as R
from thrifty.kvcache.needle import make_needle_task
from thrifty.paths import data_dir


def paper_config(**kw) -> ShadowKVConfig:
    """A config with the paper's mean-landmark chunk score (``radius_weight=0``): what this script studies (the
    library's default adds a chunk-radius term; the script's ``+rad<λ>`` methods add it themselves)."""
    return ShadowKVConfig(radius_weight=0.0, outlier_radius_share=0.0, **kw)


# variant name -> (selector of the compression, overrides, scorer, keys)
#   scorer: "landmark" (ShadowKV's), "bound" (Quest's min/max bound), "oracle" (max exact q.k in the chunk)
#   group: "max_softmax" (the paper's code: softmax per query head, max over the group), "max_logit",
#          "sum_softmax"
#   keys: "lowrank" (U @ SV at the config's rank) or "exact"


def variants(args):
    O = args.outliers
    v = {
        "quest": dict(selector="quest", outlier_chunks=O),
        "shadowkv": dict(selector="shadowkv", outlier_chunks=O),
        "shadowkv_r192": dict(selector="shadowkv", outlier_chunks=O, rank=192),
        "shadowkv_exactK": dict(selector="shadowkv", outlier_chunks=O, keys="exact"),
        "shadowkv_boundsel": dict(selector="shadowkv", outlier_chunks=O, scorer="bound"),
        "shadowkv_oraclesel": dict(selector="shadowkv", outlier_chunks=O, scorer="oracle"),
        "shadowkv_maxlogit": dict(selector="shadowkv", outlier_chunks=O, group="max_logit"),
        "shadowkv_sumsoftmax": dict(selector="shadowkv", outlier_chunks=O, group="sum_softmax"),
        "shadowkv_O0": dict(selector="shadowkv", outlier_chunks=0),
        "quest_O0": dict(selector="quest", outlier_chunks=0),
        "shadowkv_O16": dict(selector="shadowkv", outlier_chunks=16),
        "quest_O16": dict(selector="quest", outlier_chunks=16),
        "shadowkv_O48": dict(selector="shadowkv", outlier_chunks=48),
        "quest_O48": dict(selector="quest", outlier_chunks=48),
        "quest_landmarksel": dict(selector="quest", outlier_chunks=O, scorer="landmark"),
        # chunk 0 (the attention sink) forced into the selection (inside the budget): diagnosis only
        "shadowkv_sink": dict(selector="shadowkv", outlier_chunks=O, force_sink=True),
        # the public code divides the landmark logits by sqrt(128) whatever the head dim (here 64)
        "shadowkv_scale128": dict(selector="shadowkv", outlier_chunks=O, logit_dim=128),
        "shadowkv_far": dict(selector="shadowkv", outlier_chunks=O, scorer="far"),
        "shadowkv_far8": dict(selector="shadowkv", outlier_chunks=O, scorer="far8"),
    }
    for lam in (0.1, 0.25, 0.5, 1.0):  # shadowkv_rad0.5, shadowkv_maha0.25, ... (META_SCORERS)
        v[f"shadowkv_rad{lam:g}"] = dict(selector="shadowkv", outlier_chunks=O, scorer="radius", lam=lam)
        v[f"shadowkv_maha{lam:g}"] = dict(selector="shadowkv", outlier_chunks=O, scorer="maha", lam=lam)
    if args.variants:
        v = {k: v[k] for k in args.variants}
    return v


class Capture:
    """An attention function that records post-RoPE q/k/v of every layer and runs SDPA."""

    def __init__(self):
        self.q, self.k, self.v = {}, {}, {}

    def __call__(self, module, query, key, value, attention_mask, **kw):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        i = module.layer_idx
        self.q[i], self.k[i], self.v[i] = query.detach(), key.detach(), value.detach()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


def chunk_scores(q, state, k_post_c, scorer, group, logit_dim=None, lam=None):
    """(B, H, C) scores like reference.landmark_scores, with a choice of chunk logit and group aggregation.
    ``scorer`` in :data:`META_SCORERS` (``lam``: their weight) scores from the chunk means plus the per-chunk
    metadata of :func:`chunk_meta`, computed here from the exact post-RoPE keys ``k_post_c``."""
    B, Hq, _, D = q.shape
    H = state.selectable.shape[1]
    qg = q[:, :, 0].float().view(B, H, Hq // H, D)
    if scorer == "landmark":
        lm = k_post_c.mean(3)
        logits = torch.einsum("bhgd,bhcd->bhgc", qg, lm) / math.sqrt(logit_dim or D)
    elif scorer in META_SCORERS:
        lm = k_post_c.mean(3)
        logits = meta_logits(qg, lm, chunk_meta(k_post_c.float(), lm, state.n_chunks), scorer, lam)
    elif scorer == "bound":
        lo = qg[:, :, :, None] * k_post_c.amin(3)[:, :, None]
        hi = qg[:, :, :, None] * k_post_c.amax(3)[:, :, None]
        logits = torch.maximum(lo, hi).sum(-1) / math.sqrt(D)
    else:  # oracle: the best exact logit in the chunk
        logits = torch.einsum("bhgd,bhcnd->bhgcn", qg, k_post_c).amax(-1) / math.sqrt(D)
    sel = state.selectable[:, :, None]
    if group == "max_logit":
        return logits.masked_fill(~sel, float("-inf")).amax(2).masked_fill(~state.selectable, -1e30)
    probs = logits.masked_fill(~sel, float("-inf")).softmax(-1)
    probs = torch.where(sel, probs, -1.0)
    return probs.amax(2) if group == "max_softmax" else probs.sum(2)


# Scorers that add per-chunk metadata to the mean landmark (2D bytes per chunk per KV head in bf16; D = 64 on
# SmolLM2, 128 on the Llama-3-8B shape). The extra bytes per chunk per KV head, stored as the kernels would:
#   radius  r_c = max_i ||k_i - m_c|| (one bf16 scalar, +2 B): logit (q.m_c + lam ||q|| r_c) / sqrt(D); lam = 1 is an
#           upper bound of max_i q.k_i (Cauchy-Schwarz), smaller lam a softer push towards spread chunks.
#   maha    the same ball in a per-head whitened metric: sigma_h (D,) = per-channel RMS of k_i - m_c over the head's
#           chunks (per head, not per chunk: D fp32 per head), r_c = max_i ||(k_i - m_c) / sigma||, logit
#           (q.m_c + lam ||q * sigma|| r_c) / sqrt(D); lam = 1 is again an upper bound (+2 B per chunk).
#   far     k_far = the chunk's key farthest from m_c, a second landmark: logit max(q.m_c, q.k_far) / sqrt(D)
#           (+2D B in bf16: the landmark read doubles).
#   far8    far with k_far rounded to fp8 e4m3 with one fp32 scale per vector (amax / 448): +D + 4 B (+50%).
META_SCORERS = ("radius", "maha", "far", "far8")
META_BYTES = {"radius": lambda D: 2, "maha": lambda D: 2, "far": lambda D: 2 * D, "far8": lambda D: D + 4}


def fp8_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded through float8_e4m3fn with one scale per vector (last dim): amax / 448, fp32."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0
    return (x / s).to(torch.float8_e4m3fn).float() * s


def chunk_meta(keys_c: torch.Tensor, means: torch.Tensor, n_chunks: torch.Tensor) -> dict:
    """Per-chunk metadata of the META_SCORERS from post-RoPE keys (B, H, C, c, D) and their means (B, H, C, D);
    ``n_chunks`` (B,) the real chunks (sigma is taken over those)."""
    keys_c, means = keys_c.float(), means.float()
    dev = keys_c - means[:, :, :, None]  # (B, H, C, c, D)
    dn = dev.norm(dim=-1)  # (B, H, C, c)
    far = dn.argmax(-1)
    k_far = keys_c.gather(3, far[..., None, None].expand(*far.shape, 1, keys_c.shape[-1]))[:, :, :, 0]
    C = keys_c.shape[2]
    real = (torch.arange(C, device=keys_c.device)[None, :] < n_chunks.to(keys_c.device)[:, None]).float()
    w = real[:, None, :, None, None]
    var = (dev.square() * w).sum((2, 3)) / (w.sum((2, 3)) * keys_c.shape[3]).clamp_min(1)  # (B, H, D)
    sigma = var.sqrt().clamp_min(1e-6)
    r_maha = (dev / sigma[:, :, None, None]).norm(dim=-1).amax(-1)
    top2 = dn.topk(min(2, dn.shape[-1]), dim=-1).values.mean(-1)
    return {"radius": dn.amax(-1), "radius2": top2, "mnorm": means.norm(dim=-1), "k_far": k_far,
            "k_far8": fp8_round(k_far), "sigma": sigma, "r_maha": r_maha}


def meta_logits(qg: torch.Tensor, lm: torch.Tensor, meta: dict, scorer: str, lam) -> torch.Tensor:
    """(B, H, G, C) chunk logits of a META_SCORERS scorer: qg (B, H, G, D) fp32, lm (B, H, C, D) the means."""
    D = qg.shape[-1]
    base = torch.einsum("bhgd,bhcd->bhgc", qg, lm.float())
    if scorer == "radius":
        base = base + lam * qg.norm(dim=-1, keepdim=True) * meta["radius"][:, :, None]
    elif scorer == "maha":
        qs = (qg * meta["sigma"][:, :, None]).norm(dim=-1, keepdim=True)
        base = base + lam * qs * meta["r_maha"][:, :, None]
    else:
        kf = meta["k_far" if scorer == "far" else "k_far8"]
        base = torch.maximum(base, torch.einsum("bhgd,bhcd->bhgc", qg, kf))
    return base / math.sqrt(D)


def parse_scorer(spec: str) -> tuple[str, float | None]:
    """``rad0.5`` -> ("radius", 0.5), ``maha1`` -> ("maha", 1.0), ``far`` / ``far8`` -> (name, None)."""
    for prefix, name in (("rad", "radius"), ("maha", "maha")):
        if spec.startswith(prefix):
            return name, float(spec[len(prefix):])
    if spec in ("far", "far8"):
        return spec, None
    raise ValueError(f"scorer: expected rad<lam>, maha<lam>, far or far8, got {spec!r}")


# Options of a ``+<scorer>`` spec, after commas (``shadowkv@256+rad0.5,orad,gsum``):
#   outlier choice (at compression; the same number of outlier chunks, the radius scorers' metadata unchanged):
#     orad   the chunks with the largest radius r (the least trustworthy ball scores) instead of the lowest min
#            cosine to the landmark;
#     orel   the largest r / ||m|| (the radius relative to the landmark's norm);
#     ohalf  half by the lowest min cosine, the other half by the largest r among the rest;
#     owin / owinh  the chunks with the largest attention mass from the last WINDOW prompt queries (SnapKV's
#            observation window: softmax over the prompt per query head, summed over the window and the KV head's
#            group), all of them / half of them (the other half by the lowest min cosine first). Needs the window
#            queries at prefill (captured here by hooks on q_proj), no metadata and nothing per step.
#   group aggregation (per KV head, over its G query heads): gsum  sum of the per-head softmaxes instead of their max;
#     glogit  max of the logits, then one softmax.
#   radius: r2  the mean of the two largest key-to-landmark distances instead of the largest (same 2 bytes).
OUTLIER_RULES = ("orad", "orel", "ohalf", "owin", "owinh")
SPEC_OPTIONS = OUTLIER_RULES + ("gsum", "glogit", "r2")
WINDOW = 32


def parse_spec(spec: str) -> tuple[str, float | None, tuple[str, ...]]:
    """``rad0.5,orad,gsum`` -> ("radius", 0.5, ("orad", "gsum")): :func:`parse_scorer` plus :data:`SPEC_OPTIONS`."""
    head, *opts = spec.split(",")
    scorer, lam = parse_scorer(head)
    bad = [o for o in opts if o not in SPEC_OPTIONS]
    if bad or sum(o in OUTLIER_RULES for o in opts) > 1 or ("gsum" in opts and "glogit" in opts):
        raise ValueError(f"scorer options: expected at most one of {OUTLIER_RULES}, one of gsum/glogit and r2, "
                         f"got {spec!r}")
    if "r2" in opts and scorer != "radius":
        raise ValueError(f"scorer options: r2 applies to rad<lam>, got {spec!r}")
    return scorer, lam, tuple(opts)


def outlier_rule(spec: str) -> str:
    """The outlier rule of a spec (``mincos``: the library's)."""
    return next((o for o in parse_spec(spec)[2] if o in OUTLIER_RULES), "mincos")


def choose_outliers(rule: str, keys_c, means, radius, chunk_real, O: int, window_mass=None) -> torch.Tensor:
    """(B, H, O) outlier chunk ids by ``rule`` (:data:`OUTLIER_RULES` or ``mincos``, the library's). keys_c
    (B, H, C, c, D) fp32, means (B, H, C, D), radius (B, H, C), chunk_real (B, C); window_mass (B, H, C) for
    owin/owinh."""
    B, H, C = radius.shape
    real = chunk_real[:, None].expand(B, H, C)
    min_cos = torch.nn.functional.cosine_similarity(keys_c, means[:, :, :, None], dim=-1).amin(-1)
    low_first = {"mincos": min_cos, "orad": -radius, "orel": -radius / means.norm(dim=-1).clamp_min(1e-12),
                 "owin": None if window_mass is None else -window_mass}
    if rule in low_first:
        return low_first[rule].masked_fill(~real, float("inf")).topk(O, dim=-1, largest=False).indices
    second = -radius if rule == "ohalf" else -window_mass
    first = min_cos.masked_fill(~real, float("inf")).topk(O // 2, dim=-1, largest=False).indices
    rest = second.masked_fill(~real, float("inf")).scatter(2, first, float("inf"))
    return torch.cat((first, rest.topk(O - O // 2, dim=-1, largest=False).indices), 2)


def reselect_outliers(st, k_post, v, lengths, config, radius, rule, window_mass=None) -> None:
    """Replaces ``st``'s outlier chunks (ids, selectable, exact tokens) by those of ``rule``, as
    ``reference.compress_prompt`` lays them out (outlier tokens, then the local window)."""
    B, H, C = st.selectable.shape
    c, dev = config.chunk_size, k_post.device
    n_chunks = st.n_chunks
    chunk_real = torch.arange(C, device=dev)[None, :] < n_chunks[:, None]
    k = k_post[:, :, :C * c].float()
    if k.shape[2] < C * c:
        k = torch.nn.functional.pad(k, (0, 0, 0, C * c - k.shape[2]))
    keys_c = k.view(B, H, C, c, -1)
    O = min(config.kept_outlier_chunks, C)
    ids = choose_outliers(rule, keys_c, keys_c.mean(3), radius, chunk_real, O, window_mass)
    real = chunk_real[:, None].expand(B, H, C)
    out_real = real.gather(2, ids)
    selectable = real.clone()
    selectable.scatter_(2, ids, False)
    out_pos = (ids[..., None] * c + torch.arange(c, device=dev)).flatten(2)
    out_valid = out_real[..., None].expand(-1, -1, -1, c).flatten(2)
    N_out = out_pos.shape[2]  # the local window's exact tokens (after the outliers') are unchanged: kept
    dense_k = torch.cat((R.gather_tokens(k_post, out_pos), st.dense_k[:, :, N_out:]), 2)
    dense_v = torch.cat((R.gather_tokens(v, out_pos), st.dense_v[:, :, N_out:]), 2)
    valid = torch.cat((out_valid, st.dense_valid[:, :, N_out:]), 2)
    st.outlier_ids, st.selectable, st.dense_k, st.dense_v, st.dense_valid = ids, selectable, dense_k, dense_v, valid


class MetaReference:
    """End to end (``--answer-logprob``): ``R.compress_prompt`` wrapped for the whole run so that every ShadowKV
    layer state gets its :func:`chunk_meta` (from the exact post-RoPE keys, as a prefill would compute it), kept
    beside the state by the identity of its landmark tensor (forks share it); within ``scoring(spec)``,
    ``R.landmark_scores`` scores with that scorer (the reference's softmax per query head and max over the group).
    The library is not changed."""

    def __init__(self):
        self.meta = {}  # id(landmarks) -> (landmarks, meta): the tensor is held so that its id stays unique
        self.outlier_rule = "mincos"  # set around a compression: the outliers of that rule (OUTLIER_RULES)
        self.window_q = {}  # id(prompt keys of a layer) -> (keys, window queries (B, Hq, w, D)): owin / owinh

    def __enter__(self):
        self.saved = R.compress_prompt

        def compress_prompt(k_post, v, lengths, cos, sin, config, **kw):
            st = self.saved(k_post, v, lengths, cos, sin, config, **kw)
            if st.landmarks is not None:
                B, H, _, D = k_post.shape
                C, c = st.landmarks.shape[2], config.chunk_size
                k = k_post[:, :, :C * c].float()
                if k.shape[2] < C * c:
                    k = torch.nn.functional.pad(k, (0, 0, 0, C * c - k.shape[2]))
                self.meta[id(st.landmarks)] = (st.landmarks, chunk_meta(k.view(B, H, C, c, D), st.landmarks,
                                                                        st.n_chunks))
                if self.outlier_rule != "mincos":
                    wm = None
                    if self.outlier_rule in ("owin", "owinh"):
                        kk, qw = self.window_q[id(k_post)]
                        assert kk is k_post
                        wm = R.window_mass(qw, k_post, lengths, C, c)
                    reselect_outliers(st, k_post, v, lengths, config, self.meta[id(st.landmarks)][1]["radius"],
                                      self.outlier_rule, wm)
            return st

        R.compress_prompt = compress_prompt
        return self

    def __exit__(self, *exc):
        R.compress_prompt = self.saved
        self.meta.clear()
        return False

    @contextlib.contextmanager
    def scoring(self, spec: str):
        scorer, lam, opts = parse_spec(spec)
        saved = R.landmark_scores

        def landmark_scores(q, state):
            if state.landmarks is None:
                return saved(q, state)
            lm, meta = self.meta[id(state.landmarks)]
            assert lm is state.landmarks
            B, Hq, _, D = q.shape
            H = state.selectable.shape[1]
            qg = q[:, :, 0].float().view(B, H, Hq // H, D)
            if "r2" in opts:
                meta = {**meta, "radius": meta["radius2"]}
            logits = meta_logits(qg, state.landmarks, meta, scorer, lam)
            sel = state.selectable[:, :, None]
            if "glogit" in opts:  # max of the logits over the group, one softmax (monotone: scores >= 0 stay picks)
                logits = logits.masked_fill(~sel, float("-inf")).amax(2, keepdim=True)
            probs = logits.masked_fill(~sel, float("-inf")).softmax(-1)
            probs = torch.where(sel, probs, -1.0)
            probs = torch.where(probs.isnan(), -1.0, probs)
            if "gsum" in opts:
                return torch.where(state.selectable, probs.clamp_min(0).sum(2), -1.0)
            return probs.amax(2)

        R.landmark_scores = landmark_scores
        try:
            yield
        finally:
            R.landmark_scores = saved


_SVD = {}
_low_rank = R.low_rank_keys


def _cached_low_rank(k_pre, lengths, rank):
    """The SVD of a layer's keys is shared by the variants of one rank (the captured k is the cache key)."""
    key = (_SVD.get("layer"), rank)
    if key not in _SVD:
        _SVD[key] = _low_rank(k_pre, lengths, rank)
    return _SVD[key]


def tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to TF32 (10 mantissa bits, round to nearest, ties away from zero: ``cvt.rna.tf32.f32``)."""
    i = x.float().contiguous().view(torch.int32)
    return ((i + 0x1000) & -0x2000).view(torch.float32)


class TF32Reference:
    """Within the block, the reference decode path rounds the inputs of its matmuls to TF32, as the Triton path
    does on tensor cores for fp32 tensors: landmark logits (q, landmarks), key rebuild (U rows, SV) and
    attention (q, keys; probabilities, values). Everything else (softmax, RoPE, accumulation) stays fp32."""

    names = ("landmark_scores", "rebuild_keys", "attend")

    def __enter__(self):
        from dataclasses import replace as dc_replace

        self.saved = {n: getattr(R, n) for n in self.names}
        orig = dict(self.saved)

        def landmark_scores(q, state):
            if state.landmarks is None:
                return orig["landmark_scores"](q, state)
            return orig["landmark_scores"](tf32(q), dc_replace(state, landmarks=tf32(state.landmarks)))

        def rebuild_keys(state, positions, cos, sin):
            if state.keys_exact is not None:
                return orig["rebuild_keys"](state, positions, cos, sin)
            return orig["rebuild_keys"](dc_replace(state, u=tf32(state.u), sv=tf32(state.sv)), positions, cos, sin)

        def attend(q, keys, values, valid, scale):
            B, Hq, _, D = q.shape
            H = keys.shape[1]
            qg = tf32(q).view(B, H, Hq // H, D)
            s = torch.einsum("bhgd,bhnd->bhgn", qg, tf32(keys)) * scale
            p = s.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1)
            out = torch.einsum("bhgn,bhnd->bhgd", tf32(p), tf32(values))
            return out.reshape(B, Hq, 1, D).to(q.dtype)

        R.landmark_scores, R.rebuild_keys, R.attend = landmark_scores, rebuild_keys, attend
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(R, n, f)
        return False


def compress(var, k, v, cos, sin, T0, args):
    cfg = paper_config(rank=var.get("rank", args.rank), chunk_size=args.chunk, sparse_budget=args.chunk,
                         outlier_chunks=var["outlier_chunks"], local_chunks=args.local, min_prompt_len=1,
                         selector=var["selector"])
    return R.compress_prompt(k[:, :, :T0], v[:, :, :T0], torch.tensor([T0]), cos[:T0], sin[:T0], cfg)


def run_layer(var, state, q_steps, k, v, cos, sin, T0, args, budget, needle_pos):
    """One layer, one sequence. q_steps (1, Hq, A, D) post-RoPE at positions T0..T0+A-1; k/v (1, H, T0+A, D)."""
    cfg = paper_config(rank=var.get("rank", args.rank), chunk_size=args.chunk, sparse_budget=budget,
                         outlier_chunks=var["outlier_chunks"], local_chunks=args.local, min_prompt_len=1,
                         selector=var["selector"])
    state.gen_k, state.gen_v = state.gen_k[:, :, :0], state.gen_v[:, :, :0]
    c, C = cfg.chunk_size, state.selectable.shape[-1]
    k_post_c = k[:, :, :C * c].float().view(1, k.shape[1], C, c, -1)
    scorer = var.get("scorer", "landmark" if cfg.selector == "shadowkv" else "bound")
    group = var.get("group", "max_softmax")
    H, Hq, A, D = k.shape[1], q_steps.shape[1], q_steps.shape[2], q_steps.shape[3]
    G = Hq // H
    out = {"mass": [], "needle_num": 0.0, "needle_den": 0.0, "err": [], "sink": []}
    # the dense-side token positions of outliers + local
    dense_pos = torch.cat(((state.outlier_ids[..., None] * c + torch.arange(c)).flatten(2),
                           torch.arange(int(state.n_chunks[0]) * c, T0).expand(1, H, -1)), 2)  # (1, H, N)
    for j in range(A):
        t = T0 + j  # position of this query; keys 0..t
        R.append_generated(state, k[:, :, t:t + 1], v[:, :, t:t + 1])
        q = q_steps[:, :, j:j + 1]
        scores = chunk_scores(q, state, k_post_c, scorer, group, var.get("logit_dim"), var.get("lam"))
        if var.get("force_sink"):
            scores[..., 0] = torch.where(state.selectable[..., 0], 1e30, scores[..., 0])
        K = min(cfg.select_chunks, C)
        top = scores.topk(K, dim=-1)
        ids, picked = top.indices, top.values > (-1 if group != "max_logit" else -1e29)
        pos = R.chunk_positions(ids, c)
        pos_valid = picked[..., None].expand(-1, -1, -1, c).flatten(2)
        if var.get("keys") == "exact" or state.keys_exact is not None:
            k_sel = k[:, :, :T0].gather(2, pos[..., None].expand(-1, -1, -1, k.shape[-1]))  # keys at pos
        else:
            k_sel = R.rebuild_keys(state, pos, cos, sin)
        v_sel = state.values.gather(pos)
        o = R.attend_parts(q, state, k_sel, v_sel, pos_valid, 1 / math.sqrt(D))
        # dense reference
        s = torch.einsum("hgd,hnd->hgn", q[0, :, 0].float().view(H, G, D), k[0, :, :t + 1].float()) / math.sqrt(D)
        p = s.softmax(-1)  # (H, G, t+1)
        od = torch.einsum("hgn,hnd->hgd", p, v[0, :, :t + 1].float()).reshape(Hq, D)
        err = (o[0, :, 0].float() - od).norm(dim=-1) / od.norm(dim=-1).clamp_min(1e-12)
        att = torch.zeros(H, t + 1, dtype=torch.bool)
        att[:, T0:] = True
        att.scatter_(1, dense_pos[0].clamp_max(t), torch.ones_like(dense_pos[0], dtype=torch.bool))
        sp = torch.where(pos_valid[0], pos[0], 0)
        att.scatter_(1, sp, pos_valid[0] | att.gather(1, sp))
        mass = (p * att[:, None]).sum(-1)  # (H, G)
        npos = torch.tensor(needle_pos)
        pn = p[:, :, npos]
        out["needle_num"] += float((pn * att[:, None, npos]).sum())
        out["needle_den"] += float(pn.sum())
        out["mass"].append(mass.flatten())
        out["err"].append(err)
        out["sink"].append(att[:, 0].float())
    return out


def needle_positions(ids, answers, encode):
    """Token positions of the asked answer's digits inside the prompt (every occurrence)."""
    ids = ids[0].tolist()
    pos = []
    for a in answers:
        pat = encode(a)
        for i in range(len(ids) - len(pat) + 1):
            if ids[i:i + len(pat)] == pat:
                pos += range(i, i + len(pat))
    return sorted(set(pos))


def load_smollm2():
    """(model, tokenizer, encode): the real SmolLM2-135M (converted once by ``thrifty.pretrained``), fp32, eval."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from thrifty.pretrained import ensure_converted

    d = ensure_converted()
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return model, tok, lambda s: tok.encode(s).ids


def capture_attention(model) -> "Capture":
    """Registers a :class:`Capture` as the attention (with SDPA's mask builder) under the name "capture" and
    switches ``model`` to it (transformers' public setter: the model and its submodels)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    cap = Capture()
    AttentionInterface.register("capture", cap)
    AttentionMaskInterface.register("capture", sdpa_mask)
    model.set_attn_implementation("capture")
    return cap


def prefill_with_answer(model, rot, nt, ans):
    """One dense pass over the prompt and the answer teacher-forced (all but its last token), captured; returns
    (ids, T0, cos, sin): T0 = the compressed prompt's length (prompt[:-1]), the rotary tables of every position."""
    full = torch.cat((nt.input_ids, torch.tensor([ans[:-1]])), 1)
    T0 = nt.input_ids.shape[1] - 1
    model(input_ids=full, use_cache=False, logits_to_keep=1)
    cos, sin = rot(full.new_zeros(1, 1, 1, dtype=torch.float32), torch.arange(full.shape[1])[None])
    return full, T0, cos[0], sin[0]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--tasks", nargs="+", default=["single", "multikey"])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--rank", type=int, default=160)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--outliers", type=int, default=8)
    ap.add_argument("--local", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/shadowkv_needle_cpu-ablation.json")
    ap.add_argument("--per-layer", action="store_true", help="the per-layer comparison of ShadowKV and Quest")
    ap.add_argument("--answer-logprob", action="store_true",
                    help="end to end: teacher-forced log-probability of the answer through each method's cache")
    ap.add_argument("--prefill-batch", type=int, default=6)
    ap.add_argument("--methods", nargs="+", default=None,
                    help="--answer-logprob: keep only these methods (e.g. dense shadowkv@512 quest@512)")
    ap.add_argument("--tf32", action="store_true",
                    help="--answer-logprob: add ShadowKV with the GPU kernels' TF32 matmuls emulated")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    model, tok, encode = load_smollm2()
    if args.answer_logprob:
        return answer_logprob(model, encode, args)
    R.low_rank_keys = _cached_low_rank  # this process only: the variants of one rank share a layer's SVD
    cap = capture_attention(model)
    rot = model.model.rotary_emb
    nl = encode("\n\n")
    filler = TokenDataset(data_dir() / "corpus", "validation").tokens
    rng = random.Random(args.seed)
    if args.per_layer:
        return per_layer(model, cap, rot, tok, encode, filler, nl, rng, args)
    vars_ = variants(args)
    acc = {}  # (variant, budget, length) -> sums
    t_start = time.time()
    n_prompts = 0
    for n in args.lengths:
        for task in args.tasks:
            for dep in (args.depths if task == "single" else [None]):
                for _ in range(args.trials):
                    nt = make_needle_task(task, encode, filler, n, rng.random() if dep is None else dep, rng,
                                          filler_sub=nl[0])
                    ans = encode(" " + nt.answers[0])
                    _, T0, cos, sin = prefill_with_answer(model, rot, nt, ans)
                    npos = [p for p in needle_positions(nt.input_ids[:, :T0], nt.answers[:1], encode)]
                    npos = [p for p in npos if p < T0]
                    n_prompts += 1
                    _SVD.clear()
                    for li in sorted(cap.q):
                        _SVD["layer"] = li
                        q = cap.q[li][:, :, T0:]  # queries at T0 .. L-1
                        k, v = cap.k[li], cap.v[li]
                        for name, var in vars_.items():
                            st = compress(var, k, v, cos, sin, T0, args)
                            for b in args.budgets:
                                r = run_layer(var, st, q, k, v, cos, sin, T0, args, b, npos)
                                a = acc.setdefault((name, b, n), {"mass": 0.0, "err": 0.0, "cnt": 0, "nn": 0.0,
                                                                  "nd": 0.0, "sink": 0.0, "scnt": 0,
                                                                  "layer_needle": {}})
                                m = torch.stack(r["mass"])
                                e = torch.stack(r["err"])
                                a["mass"] += float(m.sum())
                                a["err"] += float(e.sum())
                                a["cnt"] += m.numel()
                                a["nn"] += r["needle_num"]
                                a["nd"] += r["needle_den"]
                                s = torch.stack(r["sink"])
                                a["sink"] += float(s.sum())
                                a["scnt"] += s.numel()
                                ln = a["layer_needle"].setdefault(li, [0.0, 0.0])
                                ln[0] += r["needle_num"]
                                ln[1] += r["needle_den"]
                    print(f"{time.time() - t_start:7.1f}s  L={n} {task} depth={dep} prompts={n_prompts}", flush=True)
                    write(acc, args, n_prompts, t_start)
    write(acc, args, n_prompts, t_start, final=True)


def per_layer(model, cap, rot, tok, encode, filler, nl, rng, args):
    """Per layer: dense mass attended by ShadowKV and by Quest at the first answer step, the output error of
    attention restricted to each one's token set with exact keys, and the tokens ShadowKV loses."""
    import collections

    b = args.budgets[0]
    out = {"settings": vars(args), "budget": b, "prompts": []}
    for n in args.lengths:
        for _ in range(args.trials):
            nt = make_needle_task("single", encode, filler, n, 0.5, rng, filler_sub=nl[0])
            T0 = nt.input_ids.shape[1] - 1
            model(input_ids=nt.input_ids, use_cache=False, logits_to_keep=1)
            cos, sin = rot(torch.zeros(1), torch.arange(T0 + 1)[None])
            cos, sin = cos[0], sin[0]
            ids = nt.input_ids[0].tolist()
            lost, layers = collections.Counter(), []
            for li in sorted(cap.q):
                q, k, v = cap.q[li][:, :, T0:T0 + 1], cap.k[li], cap.v[li]
                H, D = k.shape[1], k.shape[-1]
                G = q.shape[1] // H
                sets = {}
                for name in ("shadowkv", "quest"):
                    var = dict(selector=name, outlier_chunks=args.outliers)
                    _SVD["layer"] = (len(out["prompts"]), li)
                    st = compress(var, k, v, cos, sin, T0, args)
                    cfg = paper_config(chunk_size=args.chunk, sparse_budget=b, outlier_chunks=args.outliers,
                                         local_chunks=args.local, selector=name)
                    C, c = st.selectable.shape[-1], args.chunk
                    kc = k[:, :, :C * c].float().view(1, H, C, c, D)
                    sc = chunk_scores(q, st, kc, "landmark" if name == "shadowkv" else "bound", "max_softmax")
                    top = sc.topk(min(cfg.select_chunks, C), -1).indices
                    att = torch.zeros(H, T0 + 1, dtype=torch.bool)
                    att[:, int(st.n_chunks[0]) * c:] = True
                    for h in range(H):
                        for cid in st.outlier_ids[0, h].tolist() + top[0, h].tolist():
                            att[h, cid * c:(cid + 1) * c] = True
                    sets[name] = att
                p = (torch.einsum("hgd,hnd->hgn", q[0, :, 0].float().view(H, G, D), k[0].float())
                     / math.sqrt(D)).softmax(-1)
                od = torch.einsum("hgn,hnd->hgd", p, v[0].float())

                def err(att):
                    pa = p * att[:, None]
                    o = torch.einsum("hgn,hnd->hgd", pa / pa.sum(-1, keepdim=True), v[0].float())
                    return float(((o - od).norm(dim=-1) / od.norm(dim=-1)).mean())

                layers.append({"layer": li, "mass_shadowkv": float((p * sets["shadowkv"][:, None]).sum(-1).mean()),
                               "mass_quest": float((p * sets["quest"][:, None]).sum(-1).mean()),
                               "mass_token0": float(p[:, :, 0].mean()),
                               "err_shadowkv_exact_keys": err(sets["shadowkv"]), "err_quest": err(sets["quest"])})
                pm = (p * (sets["quest"] & ~sets["shadowkv"])[:, None]).mean(1).sum(0)
                for t in pm.topk(5).indices.tolist():
                    lost[tok.decode([ids[t]])] += float(pm[t])
            out["prompts"].append({"length": n, "layers": layers, "lost_mass_by_token": dict(lost.most_common(10))})
            print(f"L={n}: layer, mass shadowkv/quest, err shadowkv/quest (exact keys)")
            for r in layers:
                print(f"  {r['layer']:2d}  {r['mass_shadowkv']:.3f} {r['mass_quest']:.3f}  "
                      f"{r['err_shadowkv_exact_keys']:.3f} {r['err_quest']:.3f}")
            print("  lost mass by token:", {k: round(v, 3) for k, v in lost.most_common(8)}, flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1))


def answer_logprob(model, encode, args):
    """Each method decodes the last prompt token and the answer teacher-forced through its own cache (as
    ``needle.evaluate_batch`` does, greedy replaced by the right answer); per prompt the summed log-probability of
    the answer tokens and whether every answer token is the argmax (exact match under teacher forcing).
    ``<method>+<scorer>`` in ``--methods`` (a ShadowKV method, e.g. ``shadowkv@256+rad0.5``) decodes that method's
    cache with the chunk scorer of :func:`parse_scorer` (:class:`MetaReference`)."""
    nl = encode("\n\n")
    filler = TokenDataset(data_dir() / "corpus", "validation").tokens
    rng = random.Random(args.seed)
    common = dict(rank=args.rank, chunk_size=args.chunk, local_chunks=args.local, min_prompt_len=1, max_generated=32)
    methods = {"dense": None}
    for b in args.budgets:
        for sel in ("shadowkv", "quest"):
            methods[f"{sel}@{b}"] = paper_config(sparse_budget=b, selector=sel, outlier_chunks=args.outliers,
                                                   **common)
    for sel in ("shadowkv", "quest"):
        methods[f"{sel}_O48@{args.budgets[-1]}"] = paper_config(sparse_budget=args.budgets[-1], selector=sel,
                                                                  outlier_chunks=48, **common)
    tf32_methods = set()
    if args.tf32:
        full = -(-max(args.lengths) // args.chunk) * args.chunk  # a budget that selects every chunk
        for b in args.budgets:
            methods[f"shadowkv_tf32@{b}"] = methods[f"shadowkv@{b}"]
            tf32_methods.add(f"shadowkv_tf32@{b}")
        methods["shadowkv_full@all"] = paper_config(sparse_budget=full, selector="shadowkv",
                                                      outlier_chunks=args.outliers, **common)
        methods["shadowkv_full_tf32@all"] = methods["shadowkv_full@all"]
        tf32_methods.add("shadowkv_full_tf32@all")
    scorer_methods = {}  # "<method>+<scorer>" -> scorer spec (META_SCORERS)
    if args.methods:
        methods.update(chunk_methods(methods, args.methods))
        tf32_methods |= {m for m in args.methods if m.partition("/c")[0] in tf32_methods}
        for m in args.methods:
            base, sep, spec = m.partition("+")
            if sep and methods.get(base) is not None and methods[base].selector == "shadowkv":
                parse_spec(spec)  # refuse a bad spec before the run
                methods[m], scorer_methods[m] = methods[base], spec
        methods = {m: c for m, c in methods.items() if m in args.methods}
    res = {m: {"logprob": [], "exact": [], "length": [], "token_logprob": []} for m in methods}
    t_start = time.time()
    meta = MetaReference()
    with (meta if scorer_methods else contextlib.nullcontext()):
        answer_logprob_runs(model, encode, args, methods, tf32_methods, scorer_methods, meta, res, filler, rng, nl,
                            t_start)


def answer_logprob_runs(model, encode, args, methods, tf32_methods, scorer_methods, meta, res, filler, rng, nl,
                        t_start):
    from thrifty.kvcache import ShadowKVCache
    from thrifty.kvcache.needle import dense_prefill

    for n in args.lengths:
        tasks = needle_tasks(encode, filler, n, args.tasks, args.depths, args.trials, rng, nl[0])
        for i in range(0, len(tasks), args.prefill_batch):
            meta.meta.clear()
            batch = tasks[i:i + args.prefill_batch]
            ids = torch.cat([t.input_ids for t in batch])
            ans = torch.tensor([encode(" " + t.answers[0]) for t in batch])  # (B, A): same digit count
            rules = {outlier_rule(spec) for spec in scorer_methods.values()}
            if rules & {"owin", "owinh"}:
                kv, window_q = dense_prefill(model, ids[:, :-1], args.prefill_batch, window=WINDOW)
                meta.window_q = {id(k): (k, q) for (k, _), q in zip(kv, window_q)}
            else:
                kv = dense_prefill(model, ids[:, :-1], args.prefill_batch)
            inputs = torch.cat((ids[:, -1:], ans[:, :-1]), 1)
            bases = {}
            for name, cfg in methods.items():
                if cfg is None:
                    cache = ShadowKVCache(model, ShadowKVConfig(rank=1, min_prompt_len=ids.shape[1] + 1))
                    cache.load_prompt(kv)
                else:
                    rule = outlier_rule(scorer_methods[name]) if name in scorer_methods else "mincos"
                    key = (cfg.selector, cfg.outlier_chunks, cfg.chunk_size, cfg.local_chunks, rule)
                    if key not in bases:
                        bases[key] = ShadowKVCache(model, replace(cfg, min_prompt_len=1), impl="reference")
                        meta.outlier_rule = rule
                        try:
                            bases[key].load_prompt(kv)
                        finally:
                            meta.outlier_rule = "mincos"
                    cache = bases[key].fork(model, cfg)
                lp = torch.zeros(len(batch))
                tok_lp = torch.zeros(len(batch), ans.shape[1])
                ok = torch.ones(len(batch), dtype=torch.bool)
                with (TF32Reference() if name in tf32_methods else contextlib.nullcontext()), \
                        (meta.scoring(scorer_methods[name]) if name in scorer_methods else contextlib.nullcontext()):
                    for j in range(ans.shape[1]):
                        logits = model(input_ids=inputs[:, j:j + 1], past_key_values=cache, use_cache=True,
                                       logits_to_keep=1).logits[:, -1].float()
                        tok_lp[:, j] = logits.log_softmax(-1).gather(1, ans[:, j:j + 1])[:, 0]
                        ok &= logits.argmax(-1) == ans[:, j]
                lp += tok_lp.sum(1)
                res[name]["token_logprob"] += tok_lp.tolist()
                res[name]["logprob"] += lp.tolist()
                res[name]["exact"] += ok.float().tolist()
                res[name]["length"] += [n] * len(batch)
                del cache
            print(f"{time.time() - t_start:7.1f}s L={n} prompts {i + len(batch)}/{len(tasks)}", flush=True)
            summary = {}
            for m, r in res.items():
                for L in args.lengths:
                    sel = [i for i, x in enumerate(r["length"]) if x == L]
                    if sel:
                        summary[f"{m}_{L}"] = {"logprob": mean([r["logprob"][i] for i in sel]),
                                               "logprob_first": mean([r["token_logprob"][i][0] for i in sel]),
                                               "exact": mean([r["exact"][i] for i in sel]), "n": len(sel)}
            Path(args.out).write_text(json.dumps({"settings": vars(args), "summary": summary, "per_prompt": res,
                                                  "wall_s": time.time() - t_start}, indent=1))
    for k, v in summary.items():
        print(f"{k:>24} logprob {v['logprob']:8.3f} (first token {v['logprob_first']:8.3f}) exact {v['exact']:.3f} "
              f"n {v['n']}")


def needle_tasks(encode, filler, length, tasks, depths, trials, rng, filler_sub):
    """The prompts of ``--answer-logprob`` at one length, in its order: per task, per depth (``single``; one random
    depth per prompt for the other tasks), ``trials`` each."""
    return [make_needle_task(task, encode, filler, length, rng.random() if d is None else d, rng,
                             filler_sub=filler_sub)
            for task in tasks for d in (depths if task == "single" else [None]) for _ in range(trials)]


def chunk_methods(methods, names):
    """``<method>/c<k>`` in ``names`` (``--methods``): that method with landmark chunks of k tokens and the same
    number of outlier and local tokens (e.g. ``shadowkv_O48@512/c4``: 96 outlier chunks of 4 and 8 local
    chunks against 48 and 4 of 8); the budget in tokens is unchanged. Returns the new name -> config entries."""
    out = {}
    for name in names:
        base, sep, k = name.partition("/c")
        if not sep or methods.get(base) is None:
            continue
        cfg, k = methods[base], int(k)
        o, loc = cfg.outlier_chunks * cfg.chunk_size, cfg.local_chunks * cfg.chunk_size
        if o % k or loc % k:
            raise ValueError(f"--methods {name}: {o} outlier and {loc} local tokens are not whole chunks of {k}")
        out[name] = replace(cfg, chunk_size=k, outlier_chunks=o // k, local_chunks=loc // k)
    return out


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def write(acc, args, n_prompts, t_start, final=False):
    rows = []
    for (name, b, n), a in sorted(acc.items(), key=lambda x: (x[0][2], x[0][1], x[0][0])):
        rows.append({"variant": name, "budget": b, "length": n, "mass": a["mass"] / a["cnt"],
                     "needle": a["nn"] / max(a["nd"], 1e-30), "err": a["err"] / a["cnt"],
                     "sink_kept": a["sink"] / max(a["scnt"], 1),
                     "needle_by_layer": {li: x[0] / max(x[1], 1e-30) for li, x in a["layer_needle"].items()}})
    from thrifty import bench

    meta = {"commit": bench.git_commit(), "threads": torch.get_num_threads()}
    Path(args.out).write_text(json.dumps({"settings": vars(args), "prompts": n_prompts, "wall_s": time.time() - t_start,
                                          "meta": meta, "rows": rows}, indent=1))
    if final:
        for r in rows:
            print(f"{r['variant']:>22} b{r['budget']:<5} L{r['length']:<5} mass {r['mass']:.4f} needle "
                  f"{r['needle']:.4f} err {r['err']:.4f} sink {r['sink_kept']:.2f}")


if __name__ == "__main__":
    main()
