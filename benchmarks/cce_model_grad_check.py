"""Does the kernel loss give the model the same gradients as the plain loss? The 135m reference model (tied
embeddings), bf16 autocast as in training, one batch: per-parameter cosine similarity of the gradients from
the plain loss (bf16 logits + fp32 CE) and from thrifty's kernels, both against the same model run in fp32 without
autocast with the chunked reference loss (the best estimate of the true gradient). At init and after some
steps of plain training (peakier softmax).

    python benchmarks/cce_model_grad_check.py --preset 135m --batch 16 --seq 1024 --train-steps 40
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json

import torch
import torch.nn.functional as F

from thrifty.loss import CCEKernelConfig, lm_loss
from thrifty.models import LlamaForCausalLM, preset
from thrifty.models.llama import logits_cross_entropy


def grads(model, loss_fn, x, y, autocast):
    model.set_loss(loss_fn)
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast(x.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        loss = model(x, labels=y)
    loss.backward()
    return float(loss), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}


def compare(model, x, y):
    ref_loss, ref = grads(model, functools.partial(lm_loss, impl="reference"), x, y, autocast=False)
    out = {"fp32_reference_loss": ref_loss}
    variants = (("plain", logits_cross_entropy), ("thrifty", functools.partial(lm_loss, impl="triton")),
                ("thrifty_fp32_scratch", functools.partial(lm_loss, impl="triton",
                                                           config=CCEKernelConfig(scratch_in_dc=False))))
    ref_all = torch.cat([r.flatten() for r in ref.values()])
    for name, fn in variants:
        loss, g = grads(model, fn, x, y, autocast=True)
        cos = {n: F.cosine_similarity(g[n].flatten(), ref[n].flatten(), dim=0).item() for n in ref}
        norm = {n: (g[n].norm() / ref[n].norm()).item() for n in ref}
        worst = sorted(cos, key=cos.get)[:3]
        all_cos = F.cosine_similarity(torch.cat([g[n].flatten() for n in ref]), ref_all, dim=0).item()
        out[name] = dict(loss=loss, all_params_cos=all_cos, final_norm_cos=cos["model.norm.weight"],
                         min_cos=min(cos.values()), worst={n: round(cos[n], 6) for n in worst},
                         embed_cos=next(v for n, v in cos.items() if "embed" in n),
                         norm_ratio_range=[min(norm.values()), max(norm.values())])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="135m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--train-steps", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(preset(args.preset)).init_weights(seed=0)
    V = preset(args.preset).vocab_size
    g = torch.Generator().manual_seed(0)
    # a Zipf-like token stream (real text is far from uniform; the model learns the unigram quickly)
    probs = 1.0 / torch.arange(1, V + 1).double() ** 1.1
    ids = torch.multinomial(probs, args.batch * (args.seq + 1) * (args.train_steps + 1), True, generator=g)
    ids = ids.view(args.train_steps + 1, args.batch, args.seq + 1).to(args.device)
    x, y = ids[0, :, :-1], ids[0, :, 1:]
    res = {"init": compare(model, x, y)}
    print("init", json.dumps(res["init"], indent=1), flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model.set_loss(logits_cross_entropy)
    for step in range(args.train_steps):
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = model(ids[step + 1, :, :-1], labels=ids[step + 1, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    res["trained"] = compare(model, x, y)
    print(f"after {args.train_steps} plain steps", json.dumps(res["trained"], indent=1), flush=True)


if __name__ == "__main__":
    main()
