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
  holds the most dense mass of this head (the chunk it reads); selected when the rank is below the picks (64 / 72).

    PYTHONPATH=src THRIFTY_DATA=... python benchmarks/shadowkv_copy_probe.py   # 6 prompts, depths 0.3..0.7, ~5 min
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
from thrifty.kvcache.needle import make_needle_task  # noqa: E402
from thrifty.paths import data_dir  # noqa: E402

METHODS = ("shadowkv", "quest")
FIELDS = ("chunks", "target_chunks", "needle_kept", "target_kept", "mass", "rank")


def attended(state, ids, picked, T0, t, c):
    """(H, t+1) bool: the tokens a method attends at a query at position t (outliers, local, picks, generated)."""
    H = ids.shape[1]
    att = torch.zeros(H, t + 1, dtype=torch.bool)
    att[:, int(state.n_chunks[0]) * c:] = True  # local window and the generated tokens
    for h in range(H):
        for cid in state.outlier_ids[0, h].tolist():
            att[h, cid * c:(cid + 1) * c] = True
        for cid, ok in zip(ids[0, h].tolist(), picked[0, h].tolist()):
            if ok:
                att[h, cid * c:(cid + 1) * c] = True
    return att


def probe_layer(q_steps, k, v, cos, sin, T0, needle, targets, args):
    """One layer of one prompt -> {field: (A, H) tensor}."""
    H, D = k.shape[1], k.shape[-1]
    G, A, c = q_steps.shape[1] // H, q_steps.shape[2], args.chunk
    npos = torch.tensor(needle)
    nchunks = sorted({p // c for p in needle})
    out = {"dense_needle": torch.zeros(A, H), "dense_target": torch.zeros(A, H)}
    for m in METHODS:
        for f in FIELDS:
            out[f"{m}_{f}"] = torch.zeros(A, H)
    states, cfgs = {}, {}
    for m in METHODS:
        var = dict(selector=m, outlier_chunks=args.outliers)
        states[m] = abl.compress(var, k, v, cos, sin, T0, args)
        cfgs[m] = ShadowKVConfig(rank=args.rank, chunk_size=c, sparse_budget=args.budget,
                                 outlier_chunks=args.outliers, local_chunks=args.local, min_prompt_len=1, selector=m)
    for j in range(A):
        t = T0 + j
        q = q_steps[:, :, j:j + 1]
        s = torch.einsum("hgd,hnd->hgn", q[0, :, 0].float().view(H, G, D), k[0, :, :t + 1].float()) / math.sqrt(D)
        p = s.softmax(-1).mean(1)  # (H, t+1): the group's mean attention
        tpos = torch.tensor(targets[j]) if targets[j] else None
        tchunks = sorted({x // c for x in targets[j]})
        out["dense_needle"][j] = p[:, npos].sum(-1)
        if tpos is not None:
            out["dense_target"][j] = p[:, tpos].sum(-1)
        for m in METHODS:
            st = states[m]
            ids, picked = R.select_chunks(q, st, cfgs[m])
            att = attended(st, ids, picked, T0, t, c)
            pa = p * att
            out[f"{m}_mass"][j] = pa.sum(-1)
            out[f"{m}_needle_kept"][j] = pa[:, npos].sum(-1)
            if tpos is not None:
                out[f"{m}_target_kept"][j] = pa[:, tpos].sum(-1)
            scores = R.landmark_scores(q, st)[0]  # (H, C); -1 for outliers
            for h in range(H):
                chunk_att = [bool(att[h, cid * c]) for cid in nchunks]
                out[f"{m}_chunks"][j, h] = sum(chunk_att) / len(chunk_att)
                if tchunks:
                    out[f"{m}_target_chunks"][j, h] = sum(bool(att[h, x * c]) for x in tchunks) / len(tchunks)
                # the needle chunk this head reads most (dense mass): its rank in the method's scores
                read = max(nchunks, key=lambda cid: float(p[h, cid * c:(cid + 1) * c].sum()))
                if not bool(st.selectable[0, h, read]):
                    out[f"{m}_rank"][j, h] = -1  # outlier (ShadowKV) or local: kept exact
                else:
                    out[f"{m}_rank"][j, h] = int((scores[h] > scores[h, read]).sum())
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
    per_prompt, prompts = [], []
    t_start = time.time()
    for dep in args.depths:
        nt = make_needle_task("single", encode, filler, args.length, dep, rng, filler_sub=nl[0])
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
        prompts.append({"depth": dep, "answer": nt.answers[0], "T0": T0, "needle_positions": needle,
                        "needle_chunks": sorted({p // args.chunk for p in needle})})
        print(f"{time.time() - t_start:7.1f}s depth {dep} needle chunks {prompts[-1]['needle_chunks']}", flush=True)
    report(per_prompt, prompts, args, time.time() - t_start)


def report(per_prompt, prompts, args, wall):
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
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--tables":  # the tables of an existing result
        torch.set_num_threads(1)
        print(tables(bench.read_result(sys.argv[2])))
    else:
        main()
