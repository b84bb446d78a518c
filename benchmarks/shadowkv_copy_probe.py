"""Which chunks ShadowKV and Quest pick while the model copies the passkey (issue 27): per layer, answer step and
KV head, is the needle's chunk selected, how much dense attention the query puts on the needle, and where the
needle mass each selector misses sits. Real SmolLM2-135M, ``single`` needle prompts, CPU, reference path.

Each prompt runs densely once, teacher-forced with its answer (``shadowkv_needle_ablation.Capture``); every
layer's post-RoPE q/k/v are kept. Per layer, ``prompt[:-1]`` is compressed by ``reference.compress_prompt`` for
ShadowKV (8 outlier chunks) and for Quest (their 64 tokens as extra budget), and each step's query picks its chunks
with ``reference.select_chunks`` at the sparse budget. The answer " 47291" is 6 tokens (" ", then one per digit):
step j (0..5) is the query at position T0 + j that predicts answer token j + 1, so steps 1..5 predict the digits
(the "copy phase"; the ShadowKV − Quest log-probability gap is on those tokens). Per (prompt, layer, step, KV head):

* ``dense_needle``: dense attention mass (mean over the group's query heads) on the needle's digit tokens in the
  prompt (both occurrences of the key in "The pass key is K. Remember it. K is the pass key.");
* ``dense_target``: the same on the digit this step must produce (step j >= 1: the j-th digit, both occurrences);
* ``<m>_chunks``: fraction of the needle's chunks (token // chunk) that method ``m`` attends (outlier, local or
  selected); ``<m>_target_chunks``: the same for the target digit's chunks;
* ``<m>_needle_kept``: the dense needle mass on tokens ``m`` attends; ``<m>_mass``: the total dense mass it attends;
* ``<m>_rank``: the rank in ``m``'s chunk scores (0 = top; -1 = an outlier, kept exact) of the needle chunk that
  holds the most dense mass of this head (the chunk it reads); selected when the rank is below the picks (64 / 72);
  ``<m>_target_rank``: the same for the target digit's chunk;
* ``<m>_outlier``: fraction of the needle's chunks that are the head's outliers; ``read_outlier_rank``: the read
  chunk's place in the outlier order (lowest min cosine to its mean first); ``read_max_logit`` /
  ``read_mean_logit``: its best exact logit (tokens x the group's query heads) and that query head's mean logit
  over the chunk, i.e. its logit against the landmark;
* ``<m>_needle_p`` / ``<m>_target_p``: the needle's / target's probability in the method's own softmax over what
  it attends, ``<m>_err``: relative L2 error of that attention output against dense (mean over the group), with
  the method's keys (ShadowKV: rebuilt ``U @ SV`` for its picks) and, ``_exactK``, exact keys at the same tokens
  (the difference is the low-rank keys' part; equal for Quest).

``--trials`` / ``--pick`` select prompts of ``shadowkv_needle_ablation.py --answer-logprob`` (same generator and
order); ``--e2e`` adds that prompt's answer log-probability end to end, also with the needle chunks forced into
ShadowKV's picks in chosen heads (``end_to_end``).

    PYTHONPATH=src THRIFTY_DATA=... python benchmarks/shadowkv_copy_probe.py   # 6 prompts, depths 0.3..0.7, ~5 min
    # seed 1, `single` depth 0.3, first trial: the third prompt of the ablation's seed-1 4K run (~1 min)
    python benchmarks/shadowkv_copy_probe.py --seed 1 --depths 0.1 0.3 --trials 2 --pick 2 --outliers 48 --e2e \
        --e2e-outliers 96 176 --device-tag cpu-4k-seed1-d03
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shadowkv_needle_ablation as abl  # noqa: E402

from thrifty import bench  # noqa: E402
from thrifty.data import TokenDataset  # noqa: E402
from thrifty.kvcache import ShadowKVConfig  # noqa: E402

from thrifty.kvcache import reference as R  # noqa: E402
from thrifty.paths import data_dir  # noqa: E402


def paper_config(**kw) -> ShadowKVConfig:
    """A config with the paper's mean-landmark chunk score (``radius_weight=0``): what this script studies (the
    library's default adds a chunk-radius term)."""
    return ShadowKVConfig(radius_weight=0.0, **kw)


METHODS = ("shadowkv", "quest")
FIELDS = ("chunks", "target_chunks", "needle_kept", "target_kept", "mass", "rank", "target_rank", "outlier", "err",
          "err_exactK", "needle_p", "needle_p_exactK", "target_p", "target_p_exactK")


def attended(state, ids, picked, T0, t, c, with_picks=False):
    """(H, t+1) bool: the tokens a method attends at a query at position t (outliers, local, picks, generated);
    ``with_picks``: also the (H, t+1) mask of the selected chunks' tokens (the keys ShadowKV rebuilds)."""
    H = ids.shape[1]
    att = torch.zeros(H, t + 1, dtype=torch.bool)
    pk = torch.zeros(H, t + 1, dtype=torch.bool)
    att[:, int(state.n_chunks[0]) * c:] = True  # local window and the generated tokens
    for h in range(H):
        for cid in state.outlier_ids[0, h].tolist():
            att[h, cid * c:(cid + 1) * c] = True
        for cid, ok in zip(ids[0, h].tolist(), picked[0, h].tolist()):
            if ok:
                pk[h, cid * c:(cid + 1) * c] = True
    att |= pk
    return (att, pk) if with_picks else att


def sparse_attention(qg, keys, values, att, scale):
    """qg (H, G, D), keys/values (H, N, D), att (H, N) -> probabilities (H, G, N) and output (H, G, D)."""
    s = torch.einsum("hgd,hnd->hgn", qg, keys) * scale
    p = s.masked_fill(~att[:, None], float("-inf")).softmax(-1)
    return p, torch.einsum("hgn,hnd->hgd", p, values)


def probe_layer(q_steps, k, v, cos, sin, T0, needle, targets, args):
    """One layer of one prompt -> {field: (A, H) tensor}."""
    H, D = k.shape[1], k.shape[-1]
    G, A, c = q_steps.shape[1] // H, q_steps.shape[2], args.chunk
    npos = torch.tensor(needle)
    nchunks = sorted({p // c for p in needle})
    out = {f: torch.zeros(A, H) for f in ("dense_needle", "dense_target", "read_chunk", "read_outlier_rank",
                                          "read_max_logit", "read_mean_logit")}
    for m in METHODS:
        for f in FIELDS:
            out[f"{m}_{f}"] = torch.zeros(A, H)
    states, cfgs = {}, {}
    rebuilt = {}  # ShadowKV's rebuilt keys (U @ SV, rotated) at every prompt position: what a pick attends
    for m in METHODS:
        var = dict(selector=m, outlier_chunks=args.outliers)
        states[m] = abl.compress(var, k, v, cos, sin, T0, args)
        cfgs[m] = paper_config(rank=args.rank, chunk_size=c, sparse_budget=args.budget,
                                 outlier_chunks=args.outliers, local_chunks=args.local, min_prompt_len=1, selector=m)
        if states[m].u is not None:
            rebuilt[m] = R.rebuild_keys(states[m], torch.arange(T0).expand(1, H, T0), cos, sin)[0].float()
    # the outlier criterion of compress_prompt (lowest min cosine of a chunk's keys to their mean) per chunk
    n = int(states["shadowkv"].n_chunks[0])
    kc = k[0, :, :n * c].float().view(H, n, c, D)
    min_cos = torch.nn.functional.cosine_similarity(kc, kc.mean(2, keepdim=True), dim=-1).amin(-1)  # (H, n)
    for j in range(A):
        t = T0 + j
        q = q_steps[:, :, j:j + 1]
        qg = q[0, :, 0].float().view(H, G, D)
        kk, vv = k[0, :, :t + 1].float(), v[0, :, :t + 1].float()
        pg, od = sparse_attention(qg, kk, vv, torch.ones(H, t + 1, dtype=torch.bool), 1 / math.sqrt(D))
        p = pg.mean(1)  # (H, t+1): the group's mean attention
        tpos = torch.tensor(targets[j]) if targets[j] else None
        tchunks = sorted({x // c for x in targets[j]})
        out["dense_needle"][j] = p[:, npos].sum(-1)
        lg = torch.einsum("hgd,hnd->hgn", qg, kk) / math.sqrt(D)
        for h in range(H):
            # the needle chunk the head reads most: its rank in the outlier order (0 = first outlier), and the
            # best exact logit in it (over the group's query heads) against that query head's mean logit over
            # the chunk (= its logit against the chunk's landmark, the mean key)
            read = max(nchunks, key=lambda cid: float(p[h, cid * c:(cid + 1) * c].sum()))
            out["read_chunk"][j, h] = read
            out["read_outlier_rank"][j, h] = int((min_cos[h] < min_cos[h, read]).sum()) if read < n else -1
            x = lg[h, :, read * c:(read + 1) * c]  # (G, c)
            g = int(x.amax(1).argmax())
            out["read_max_logit"][j, h], out["read_mean_logit"][j, h] = x[g].max(), x[g].mean()
        if tpos is not None:
            out["dense_target"][j] = p[:, tpos].sum(-1)
        for m in METHODS:
            st = states[m]
            ids, picked = R.select_chunks(q, st, cfgs[m])
            att, pk = attended(st, ids, picked, T0, t, c, with_picks=True)
            pa = p * att
            out[f"{m}_mass"][j] = pa.sum(-1)
            out[f"{m}_needle_kept"][j] = pa[:, npos].sum(-1)
            if tpos is not None:
                out[f"{m}_target_kept"][j] = pa[:, tpos].sum(-1)
            # the method's own attention over what it attends: with its keys (rebuilt for ShadowKV's picks) and
            # with exact keys at the same tokens (the low-rank keys' part of the error)
            keys = {"": kk}
            if m in rebuilt:
                kr = torch.cat((rebuilt[m], kk[:, T0:]), 1)
                keys = {"": torch.where(pk[..., None], kr, kk), "_exactK": kk}
            for sfx, kx in keys.items():
                ps, os_ = sparse_attention(qg, kx, vv, att, 1 / math.sqrt(D))
                out[f"{m}_err{sfx}"][j] = ((os_ - od).norm(dim=-1) / od.norm(dim=-1).clamp_min(1e-12)).mean(1)
                out[f"{m}_needle_p{sfx}"][j] = ps[:, :, npos].sum(-1).mean(1)
                if tpos is not None:
                    out[f"{m}_target_p{sfx}"][j] = ps[:, :, tpos].sum(-1).mean(1)
                if len(keys) == 1:  # exact keys already: the same numbers
                    for f in ("err", "needle_p", "target_p"):
                        out[f"{m}_{f}_exactK"][j] = out[f"{m}_{f}"][j]
            scores = R.landmark_scores(q, st)[0]  # (H, C); -1 for outliers
            for h in range(H):
                chunk_att = [bool(att[h, cid * c]) for cid in nchunks]
                out[f"{m}_chunks"][j, h] = sum(chunk_att) / len(chunk_att)
                outl = set(st.outlier_ids[0, h].tolist())
                out[f"{m}_outlier"][j, h] = sum(cid in outl for cid in nchunks) / len(nchunks)
                if tchunks:
                    out[f"{m}_target_chunks"][j, h] = sum(bool(att[h, x * c]) for x in tchunks) / len(tchunks)
                # the needle chunk this head reads most (dense mass), and the target digit's: rank in the scores
                for f, cands in (("rank", nchunks), ("target_rank", tchunks)):
                    if not cands:
                        continue
                    read = max(cands, key=lambda cid: float(p[h, cid * c:(cid + 1) * c].sum()))
                    if not bool(st.selectable[0, h, read]):
                        out[f"{m}_{f}"][j, h] = -1  # outlier (ShadowKV) or local: kept exact
                    else:
                        out[f"{m}_{f}"][j, h] = int((scores[h] > scores[h, read]).sum())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--depths", type=float, nargs="+", default=[0.3, 0.38, 0.46, 0.54, 0.62, 0.7])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--rank", type=int, default=160)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--outliers", type=int, default=8)
    ap.add_argument("--local", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trials", type=int, default=1,
                    help="prompts per depth, generated in the order of shadowkv_needle_ablation.py --tasks single "
                         "(--answer-logprob draws its single prompts first, so its seed's first ones are these)")
    ap.add_argument("--pick", type=int, nargs="+", default=None,
                    help="probe only these prompts (indices in the generation order: depth-major, then trial)")
    ap.add_argument("--e2e", action="store_true",
                    help="also end to end per probed prompt: the answer log-probability through each method's own "
                         "cache (dense, ShadowKV, Quest) and through ShadowKV with the needle chunks forced into the "
                         "picks of chosen heads (within the budget), to confirm where the probe puts the loss")
    ap.add_argument("--e2e-outliers", type=int, nargs="*", default=[],
                    help="--e2e: also ShadowKV and Quest with these outlier chunk counts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device-tag", default="cpu-4k", help="the result file's tag: shadowkv_copy_probe_<tag>.json")
    ap.add_argument("--results-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    model, _, encode = abl.load_smollm2()
    cap = abl.capture_attention(model)
    rot = model.model.rotary_emb
    nl = encode("\n\n")
    filler = TokenDataset(data_dir() / "corpus", "validation").tokens
    rng = random.Random(args.seed)
    per_prompt, prompts, picked_tasks = [], [], []
    t_start = time.time()
    for i, (dep, nt) in enumerate(probe_tasks(encode, filler, args.length, args.depths, args.trials, rng, nl[0])):
        if args.pick is not None and i not in args.pick:
            continue
        ans = encode(" " + nt.answers[0])  # " ", then one token per digit
        digits = encode(nt.answers[0])
        _, T0, cos, sin = abl.prefill_with_answer(model, rot, nt, ans)
        needle = [p for p in abl.needle_positions(nt.input_ids[:, :T0], nt.answers[:1], encode) if p < T0]
        starts = needle[::len(digits)]  # the first digit of each occurrence
        A = len(ans)
        # step j >= 1 predicts digit j (answer token j + 1): its positions in the prompt
        targets = [[]] + [[s + j - 1 for s in starts] for j in range(1, A)]
        layers = {}
        for li in sorted(cap.q):
            layers[li] = probe_layer(cap.q[li][:, :, T0:], cap.k[li], cap.v[li], cos, sin, T0, needle, targets, args)
        per_prompt.append(layers)
        picked_tasks.append(nt)
        prompts.append({"index": i, "depth": dep, "answer": nt.answers[0], "T0": T0, "needle_positions": needle,
                        "needle_chunks": sorted({p // args.chunk for p in needle})})
        print(f"{time.time() - t_start:7.1f}s depth {dep} needle chunks {prompts[-1]['needle_chunks']}", flush=True)
    e2e = []
    if args.e2e:  # after the probe: the caches switch the model's attention implementation
        for nt, pp, pr in zip(picked_tasks, per_prompt, prompts):
            e2e.append(end_to_end(model, encode, nt, pp, pr["needle_chunks"], args))
            print(f"{time.time() - t_start:7.1f}s end to end, prompt {pr['index']}", flush=True)
    report(per_prompt, prompts, args, time.time() - t_start, e2e)


def end_to_end(model, encode, nt, layers, needle_chunks, args, top=3):
    """Teacher-forced answer log-probability of one prompt through each method's own cache (reference path, as
    ``shadowkv_needle_ablation.py --answer-logprob``): dense, ShadowKV, Quest, and ShadowKV with the needle chunks
    forced into the picks (their score set above any softmax score, so they displace the last picks: same
    budget) in every head, in the ``top`` (layer, KV head) pairs by the probe's lost needle mass (together, alone,
    and together at one answer step only). Returns rows {variant, logprob, token_logprob}."""

    from thrifty.kvcache import ShadowKVCache
    from thrifty.kvcache.needle import dense_prefill

    ids = nt.input_ids
    ans = torch.tensor([encode(" " + nt.answers[0])])
    A = ans.shape[1]
    kv = dense_prefill(model, ids[:, :-1], 1)
    inputs = torch.cat((ids[:, -1:], ans[:, :-1]), 1)
    lost = torch.stack([layers[li]["dense_needle"] - layers[li]["shadowkv_needle_kept"]
                        for li in sorted(layers)])[:, 1:].sum(1)  # (L, H), copy phase
    H = lost.shape[1]
    pairs = [(i // H, i % H) for i in lost.flatten().argsort(descending=True)[:top].tolist()]
    name = lambda ps: " ".join(f"L{a}h{b}" for a, b in ps)  # noqa: E731
    variants = [("dense", None, None, None, None), ("shadowkv", "shadowkv", args.outliers, None, None),
                ("quest", "quest", args.outliers, None, None),
                ("shadowkv, needle forced in every head", "shadowkv", args.outliers, "all", None),
                (f"shadowkv, needle forced in {name(pairs)}", "shadowkv", args.outliers, pairs, None)]
    variants += [(f"shadowkv, needle forced in {name([pr])}", "shadowkv", args.outliers, [pr], None) for pr in pairs]
    variants += [(f"shadowkv, needle forced in {name(pairs)} at step {j} only", "shadowkv", args.outliers, pairs, j)
                 for j in range(1, A)]
    for o in args.e2e_outliers:
        variants += [(f"shadowkv O{o}", "shadowkv", o, None, None), (f"quest O{o}", "quest", o, None, None)]
    bases, rows, orig = {}, [], R.landmark_scores
    for vname, sel, outl, force, step in variants:
        if sel is None:
            cache = ShadowKVCache(model, ShadowKVConfig(rank=1, min_prompt_len=ids.shape[1] + 1))
            cache.load_prompt(kv)
        else:
            cfg = paper_config(rank=args.rank, chunk_size=args.chunk, local_chunks=args.local, min_prompt_len=1,
                                 max_generated=32, sparse_budget=args.budget, selector=sel, outlier_chunks=outl)
            if (sel, outl) not in bases:
                bases[sel, outl] = ShadowKVCache(model, cfg, impl="reference")
                bases[sel, outl].load_prompt(kv)
            cache = bases[sel, outl].fork(model, cfg)
        if force is not None:
            layer_of = {id(st): li for li, st in enumerate(cache.engine.states)}

            def forced(q, state, layer_of=layer_of, force=force, step=step):
                sc = orig(q, state)
                li = layer_of.get(id(state))
                if step is not None and state.gen_k.shape[2] - 1 != step:  # decode_step appends, then selects
                    return sc
                for h in range(sc.shape[1]):
                    if force == "all" or (li, h) in force:
                        for cid in needle_chunks:
                            if bool(state.selectable[0, h, cid]):
                                sc[0, h, cid] = 2.0  # above any softmax probability
                return sc

            R.landmark_scores = forced  # select_chunks reads the module attribute
        try:
            lp = []
            for j in range(A):
                logits = model(input_ids=inputs[:, j:j + 1], past_key_values=cache, use_cache=True,
                               logits_to_keep=1).logits[:, -1].float()
                lp.append(float(logits.log_softmax(-1)[0, ans[0, j]]))
        finally:
            R.landmark_scores = orig
        rows.append({"variant": vname, "logprob": sum(lp), "token_logprob": lp})
        del cache
    return rows


def probe_tasks(encode, filler, length, depths, trials, rng, filler_sub):
    """(depth, task) pairs of ``single`` prompts in the order of ``shadowkv_needle_ablation.py --answer-logprob``
    (its ``needle_tasks``: per depth, ``trials`` prompts); all are generated (the same rng draws) whatever
    ``--pick`` keeps. ``--answer-logprob`` draws its ``single`` prompts before the other tasks', so with the same
    seed, depths and trials its first prompts are these."""
    tasks = abl.needle_tasks(encode, filler, length, ["single"], depths, trials, rng, filler_sub)
    return [(d, t) for d, t in zip([d for d in depths for _ in range(trials)], tasks)]


def report(per_prompt, prompts, args, wall, e2e=()):
    """Aggregates into rows per (layer, step), the (layer, head) shares of the lost needle mass, and writes."""
    keys = list(per_prompt[0][0])
    nl = len(per_prompt[0])
    # stacked: field -> (P, L, A, H)
    X = {f: torch.stack([torch.stack([pp[li][f] for li in range(nl)]) for pp in per_prompt]) for f in keys}
    P, NL, A, H = X["dense_needle"].shape
    rows = []
    for li in range(NL):
        for j in range(A):
            r = {"layer": li, "step": j, "predicts": "space" if j == 0 else f"digit {j}"}
            for f in keys:
                x = X[f][:, li, j]
                r[f] = float(x.float().mean()) if not f.endswith("_rank") else float(x.float().median())
            for m in METHODS:
                r[f"{m}_needle_lost"] = r["dense_needle"] - r[f"{m}_needle_kept"]
                r[f"{m}_all_chunks_heads"] = float((X[f"{m}_chunks"][:, li, j] == 1).float().mean())
            rows.append(r)
    copy = slice(1, A)  # steps that predict the digits
    lost = {m: (X["dense_needle"] - X[f"{m}_needle_kept"])[:, :, copy] for m in METHODS}  # (P, L, S, H)
    tot_dense = float(X["dense_needle"][:, :, copy].sum())
    summary = {"prompts": P, "budget_tokens": args.budget, "outlier_chunks": args.outliers,
               "copy_dense_needle_mass_sum": tot_dense}
    lh = {}
    for m in METHODS:
        lm = lost[m].sum((0, 2))  # (L, H)
        summary[f"copy_{m}_needle_kept_frac"] = 1 - float(lm.sum()) / tot_dense
        summary[f"copy_{m}_needle_chunks_frac"] = float(X[f"{m}_chunks"][:, :, copy].mean())
        summary[f"copy_{m}_target_chunks_frac"] = float(X[f"{m}_target_chunks"][:, :, copy].mean())
        flat = lm.flatten()
        order = flat.argsort(descending=True)
        lh[m] = [{"layer": int(i) // H, "head": int(i) % H, "lost": float(flat[i]),
                  "share": float(flat[i] / flat.sum()),
                  "dense": float(X["dense_needle"][:, int(i) // H, copy, int(i) % H].sum())} for i in order[:12]]
        summary[f"copy_{m}_lost_top5_share"] = sum(x["share"] for x in lh[m][:5])
        by_layer = lm.sum(1)
        summary[f"copy_{m}_lost_top3_layers_share"] = float(by_layer.sort(descending=True).values[:3].sum()
                                                            / by_layer.sum())
        lh[f"{m}_by_layer"] = [float(x) for x in by_layer]
    # per-prompt difference, for spread
    extra = {"settings": vars(args), "prompts": prompts, "wall_s": wall, "lost_by_layer_head": lh,
             "commit": bench.git_commit(), "threads": torch.get_num_threads(),
             "per_prompt_copy_needle_kept": {m: [1 - float(lost[m][i].sum() / X["dense_needle"][i, :, copy].sum())
                                                 for i in range(P)] for m in METHODS},
             "arrays_PLAH": {f: X[f].tolist() for f in keys}}
    if e2e:
        extra["end_to_end"] = list(e2e)
    path = bench.write_result("shadowkv_copy_probe", rows, summary, device=args.device_tag, extra=extra,
                              results_dir=args.results_dir)
    print(path)
    for k, v in summary.items():
        print(f"{k:>36} {v}")
    print(tables(bench.read_result(path)))


def tables(doc, reading=0.05):
    """Markdown tables from a result: per layer and per step over the copy phase (steps 1..5), and the (layer,
    KV head) pairs that lose the most needle mass. ``reading``: a layer whose mean dense needle mass in the copy
    phase is at least this reads the needle."""
    X = {f: torch.tensor(v) for f, v in doc["extra"]["arrays_PLAH"].items()}
    P, NL, A, H = X["dense_needle"].shape
    cp = slice(1, A)
    dn = X["dense_needle"][:, :, cp]
    lost = {m: dn - X[f"{m}_needle_kept"][:, :, cp] for m in METHODS}
    out = ["Per layer, copy phase (steps 1-5, queries predicting the 5 digits), mean over prompts, KV heads and "
           "steps; kept = needle mass attended / dense needle mass; share = the layer's part of all needle mass the "
           "method loses; rank = median rank of the needle chunk the head reads most in the method's scores (-1: outlier; picked below 64 SKV / 72 Quest), "
           "over (prompt, step, head):", "",
           "| layer | dense needle mass | needle chunks attended SKV / Quest | all needle chunks, heads SKV / Quest | "
           "needle mass kept SKV / Quest | share of lost SKV / Quest | rank SKV / Quest | total mass SKV / Quest |",
           "|---|---|---|---|---|---|---|---|"]
    for li in range(NL):
        d = float(dn[:, li].sum())
        c = [float(X[f"{m}_chunks"][:, li, cp].mean()) for m in METHODS]
        a = [float((X[f"{m}_chunks"][:, li, cp] == 1).float().mean()) for m in METHODS]
        k = [1 - float(lost[m][:, li].sum()) / d for m in METHODS]
        sh = [float(lost[m][:, li].sum() / lost[m].sum()) for m in METHODS]
        rk = [float(X[f"{m}_rank"][:, li, cp].median()) for m in METHODS]
        ms = [float(X[f"{m}_mass"][:, li, cp].mean()) for m in METHODS]
        bold = "**" if float(dn[:, li].mean()) >= reading else ""
        out.append(f"| {bold}{li}{bold} | {float(dn[:, li].mean()):.3f} | {c[0]:.2f} / {c[1]:.2f} | "
                   f"{a[0]:.2f} / {a[1]:.2f} | {k[0]:.3f} / {k[1]:.3f} | {sh[0]:.3f} / {sh[1]:.3f} | "
                   f"{rk[0]:.0f} / {rk[1]:.0f} | {ms[0]:.3f} / {ms[1]:.3f} |")
    rl = [li for li in range(NL) if float(dn[:, li].mean()) >= reading]
    out += ["", f"Per step, over the reading layers {rl} (mean dense needle mass >= {reading}); target = the digit "
            "the step must produce (both occurrences):", "",
            "| step | predicts | dense needle mass | dense target mass | needle kept SKV / Quest | "
            "target kept SKV / Quest | target chunks attended SKV / Quest |", "|---|---|---|---|---|---|---|"]
    for j in range(A):
        dj = X["dense_needle"][:, rl, j]
        tj = X["dense_target"][:, rl, j]
        k = [float(X[f"{m}_needle_kept"][:, rl, j].sum() / dj.sum()) for m in METHODS]
        kt = [float(X[f"{m}_target_kept"][:, rl, j].sum() / tj.sum().clamp_min(1e-30)) for m in METHODS]
        tc = [float(X[f"{m}_target_chunks"][:, rl, j].mean()) for m in METHODS]
        out.append(f"| {j} | {'space' if j == 0 else f'digit {j}'} | {float(dj.mean()):.3f} | {float(tj.mean()):.3f}"
                   f" | {k[0]:.3f} / {k[1]:.3f} | {kt[0]:.3f} / {kt[1]:.3f} | {tc[0]:.2f} / {tc[1]:.2f} |")
    out += ["", "(Layer, KV head) pairs by the needle mass ShadowKV loses in the copy phase (summed over prompts and "
            "steps 1-5), with Quest's loss on the same pair:", "",
            "| layer | head | dense needle mass | lost SKV | share of SKV's loss | lost Quest | heads where SKV "
            "attends all needle chunks / Quest | median rank SKV / Quest |", "|---|---|---|---|---|---|---|---|"]
    ls = lost["shadowkv"].sum((0, 2))
    for i in ls.flatten().argsort(descending=True)[:10].tolist():
        li, h = i // H, i % H
        a = [float((X[f"{m}_chunks"][:, li, cp, h] == 1).float().mean()) for m in METHODS]
        out.append(f"| {li} | {h} | {float(dn[:, li, :, h].sum()):.2f} | {float(ls[li, h]):.3f} | "
                   f"{float(ls[li, h] / ls.sum()):.3f} | {float(lost['quest'].sum((0, 2))[li, h]):.3f} | "
                   f"{a[0]:.2f} / {a[1]:.2f} | {float(X['shadowkv_rank'][:, li, cp, h].median()):.0f} / "
                   f"{float(X['quest_rank'][:, li, cp, h].median()):.0f} |")
    kp = doc["extra"]["per_prompt_copy_needle_kept"]
    out += ["", "Per prompt, copy-phase needle mass kept (all layers) SKV / Quest: "
            + ", ".join(f"{a:.3f} / {b:.3f}" for a, b in zip(kp["shadowkv"], kp["quest"]))]
    if "shadowkv_needle_p" in X:
        out += ["", detail_tables(X)]
    for i, rows in enumerate(doc["extra"].get("end_to_end", [])):
        out += ["", f"End to end, prompt {doc['extra']['prompts'][i]['index']} (teacher-forced answer "
                "log-probability, nats; per answer token: space, then the digits):", "",
                "| variant | answer log-prob | per token |", "|---|---|---|"]
        out += [f"| {r['variant']} | {r['logprob']:.3f} | " + " ".join(f"{x:.3f}" for x in r["token_logprob"]) + " |"
                for r in rows]
    return "\n".join(out)


def detail_tables(X, top=6):
    """Per step over all layers, then per (layer, KV head, step) for the ``top`` pairs by the needle mass
    ShadowKV loses in the copy phase; summed (mass) or averaged (the rest) over prompts."""
    P, NL, A, H = X["dense_needle"].shape
    S = lambda f, *ix: float(X[f][(slice(None),) + ix].sum())  # noqa: E731
    M = lambda f, *ix: float(X[f][(slice(None),) + ix].float().mean())  # noqa: E731
    out = ["Per step, all layers and KV heads (masses summed over layers and heads; needle p = the needle's "
           "probability in each method's own softmax over what it attends, SKV with its rebuilt keys and with exact "
           "keys at the same tokens; err = relative L2 error of the attention output against dense, mean over query "
           "heads):", "",
           "| step | dense needle mass | lost SKV / Quest | needle p dense / SKV / SKV exact keys / Quest | "
           "err SKV / SKV exact keys / Quest |", "|---|---|---|---|---|"]
    for j in range(A):
        d = S("dense_needle", slice(None), j)
        out.append(f"| {j} | {d:.3f} | {d - S('shadowkv_needle_kept', slice(None), j):.3f} / "
                   f"{d - S('quest_needle_kept', slice(None), j):.3f} | {d:.3f} / "
                   f"{S('shadowkv_needle_p', slice(None), j):.3f} / {S('shadowkv_needle_p_exactK', slice(None), j):.3f}"
                   f" / {S('quest_needle_p', slice(None), j):.3f} | {M('shadowkv_err', slice(None), j):.4f} / "
                   f"{M('shadowkv_err_exactK', slice(None), j):.4f} / {M('quest_err', slice(None), j):.4f} |")
    cp = slice(1, A)
    ls = (X["dense_needle"] - X["shadowkv_needle_kept"])[:, :, cp].sum((0, 2))
    out += ["", f"The {top} (layer, KV head) pairs where ShadowKV loses the most needle mass in the copy phase, per "
            "step: read chunk = the needle chunk the head reads most (dense), with its best exact logit q.k/sqrt(D) "
            "(over tokens and the group's query heads) and that query head's mean logit over the chunk (its logit "
            "against the landmark); rank = the read chunk's rank in the method's scores (-1: "
            "outlier, kept exact; picked below the method's pick count), target rank = the same for the target "
            "digit's chunk; outlier = the needle chunks that are this head's outliers (SKV), (rank) = the read "
            "chunk's place in the outlier order (lowest min cosine first; outlier below the outlier count):", "",
            "| layer | head | step | dense needle / target | needle kept SKV / Quest | target kept SKV / Quest | "
            "read chunk: max / mean logit | rank SKV / Quest | target rank SKV / Quest | outlier (rank) | "
            "needle p SKV / exact keys / Quest | "
            "target p dense / SKV / exact keys / Quest | err SKV / exact keys / Quest |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i in ls.flatten().argsort(descending=True)[:top].tolist():
        li, h = i // H, i % H
        for j in range(1, A):
            ix = (li, j, h)
            out.append(
                f"| {li} | {h} | {j} | {S('dense_needle', *ix):.3f} / {S('dense_target', *ix):.3f} | "
                f"{S('shadowkv_needle_kept', *ix):.3f} / {S('quest_needle_kept', *ix):.3f} | "
                f"{S('shadowkv_target_kept', *ix):.3f} / {S('quest_target_kept', *ix):.3f} | "
                f"{M('read_chunk', *ix):.0f}: {M('read_max_logit', *ix):.1f} / {M('read_mean_logit', *ix):.1f} | "
                f"{M('shadowkv_rank', *ix):.0f} / {M('quest_rank', *ix):.0f} | "
                f"{M('shadowkv_target_rank', *ix):.0f} / {M('quest_target_rank', *ix):.0f} | "
                f"{M('shadowkv_outlier', *ix):.2f} ({M('read_outlier_rank', *ix):.0f}) | "
                f"{S('shadowkv_needle_p', *ix):.3f} / "
                f"{S('shadowkv_needle_p_exactK', *ix):.3f} / {S('quest_needle_p', *ix):.3f} | "
                f"{S('dense_target', *ix):.3f} / {S('shadowkv_target_p', *ix):.3f} / "
                f"{S('shadowkv_target_p_exactK', *ix):.3f} / {S('quest_target_p', *ix):.3f} | "
                f"{M('shadowkv_err', *ix):.3f} / {M('shadowkv_err_exactK', *ix):.3f} / {M('quest_err', *ix):.3f} |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--tables":  # the tables of an existing result
        torch.set_num_threads(1)
        print(tables(bench.read_result(sys.argv[2])))
    else:
        main()
