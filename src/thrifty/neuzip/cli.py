"""``thrifty compress MODEL.safetensors OUT [--mantissa-bits k]``, ``thrifty decompress IN OUT.safetensors`` and
``thrifty eval MODEL_OR_CHECKPOINT`` (validation perplexity of any model, NeuZip-compressed or not).

Entry points: :func:`compress_main`, :func:`decompress_main` and :func:`eval_main` (argv lists, return an exit
code); :func:`main` dispatches them for ``python -m thrifty.neuzip.cli``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from .._io import atomic_path, check_output_path


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _user_error(cmd: str, err: Exception) -> int:
    print(f"thrifty {cmd}: {err}", file=sys.stderr)
    return 2


def _same_bits(a, b) -> bool:
    """Bit-for-bit equality (NaN payloads and -0.0 included), any dtype."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    import torch

    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _restores(ct, t, mantissa_bits) -> bool:
    """Does ``ct`` decode (reference decoder) to ``t``, or to ``t`` rounded to ``mantissa_bits``?"""
    from . import reference as R

    want = t if mantissa_bits in (None, 7) else R.round_mantissa(t, mantissa_bits)
    return _same_bits(ct.decompress(impl="reference"), want)


def compress_main(argv=None) -> int:
    import torch
    from safetensors.torch import load_file
    from tqdm import tqdm

    from . import format as F
    from . import reference as R
    from .tensor import compress

    p = argparse.ArgumentParser(prog="thrifty compress", description="NeuZip-compress a safetensors model")
    p.add_argument("model", type=Path, help="input .safetensors")
    p.add_argument("out", type=Path, help="output file (neuzip, safetensors container)")
    p.add_argument("--mantissa-bits", type=int, default=None, choices=(0, 1, 3, 7),
                   help="lossy: keep k mantissa bits of bf16 tensors (7 = lossless); default lossless")
    p.add_argument("--steps", type=int, default=R.STEPS, choices=R.LANE_STEPS,
                   help=f"symbols per lane (shorter: faster GPU decode, more metadata); default {R.STEPS}")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_output_path("out", args.out, args.model)
    except ValueError as err:
        return _user_error("compress", err)
    try:
        tensors = load_file(str(args.model))
    except Exception as err:
        print(f"thrifty compress: cannot read {args.model}: {err}", file=sys.stderr)
        return 2
    entries, before, after = {}, 0, 0
    counts = np.zeros(256, np.int64)
    coded_bits = coded_symbols = 0
    for name, t in tqdm(tensors.items(), desc="compress", unit="tensor"):
        before += t.numel() * t.element_size()
        if t.dtype in R.DTYPES and t.numel() > 0:
            k = args.mantissa_bits if t.dtype == torch.bfloat16 else None
            try:
                ct = compress(t, k, steps=args.steps)
            except ValueError as err:  # e.g. NaNs with --mantissa-bits 0
                print(f"thrifty compress: tensor {name!r}: {err}", file=sys.stderr)
                return 2
            if not _restores(ct, t, k):  # never report success for a tensor that would not come back
                print(f"thrifty compress: tensor {name!r} does not decode to its input; stored uncompressed",
                      file=sys.stderr)
                entries[name] = t
                after += t.numel() * t.element_size()
                continue
            entries[name] = ct
            after += ct.nbytes
            coded_bits += ct.symbol_bits * ct.numel
            coded_symbols += ct.numel
            counts += np.bincount(R.split_symbols(R._uint_view(t), t.dtype)[0], minlength=256)
        else:  # integer buffers, float64, float8, empty: stored as is (any dtype safetensors holds)
            entries[name] = t
            after += t.numel() * t.element_size()
    try:  # writes a temporary file, reads it back, compares, renames: no partial or unrestorable output
        F.save(args.out, entries)
    except (ValueError, TypeError) as err:  # e.g. a tensor name the format cannot hold
        return _user_error("compress", err)
    seconds = time.perf_counter() - t0
    file_bytes = args.out.stat().st_size
    print(f"tensors: {len(entries)}  before: {_mb(before)}  after: {_mb(after)} (file {_mb(file_bytes)}, "
          f"ratio {after / max(before, 1):.4f})")
    if coded_symbols:
        print(f"bits per exponent: {coded_bits / coded_symbols:.3f} coded vs {R.entropy_bits(counts):.3f} "
              f"Shannon entropy (all tensors pooled)")
    print(f"time: {seconds:.1f} s")
    return 0


def decompress_main(argv=None) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    from ..triton_utils import interpreting
    from tqdm import tqdm

    from . import format as F
    from .tensor import CompressedTensor

    p = argparse.ArgumentParser(prog="thrifty decompress", description="Decompress a NeuZip file to safetensors")
    p.add_argument("input", type=Path, help="file written by `thrifty compress`")
    p.add_argument("out", type=Path, help="output .safetensors")
    p.add_argument("--impl", default="auto", choices=("auto", "triton", "reference"))
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        check_output_path("out", args.out, args.input)
        if args.impl == "triton" and not (torch.cuda.is_available() or interpreting()):
            raise ValueError("--impl triton: needs a CUDA GPU; use --impl reference (or auto)")
        # the Triton decoder runs where the streams are: on the GPU when there is one
        entries = F.load(args.input, device="cuda" if args.impl == "triton" and torch.cuda.is_available() else "cpu")
    except (OSError, ValueError) as err:
        print(f"thrifty decompress: {err}", file=sys.stderr)
        return 2
    out, before, after = {}, 0, 0
    for name, e in tqdm(entries.items(), desc="decompress", unit="tensor"):
        if isinstance(e, CompressedTensor):
            before += e.nbytes
            out[name] = e.decompress(impl=args.impl).cpu().contiguous()
        else:
            before += e.numel() * e.element_size()
            out[name] = e
        after += out[name].numel() * out[name].element_size()
    with atomic_path(args.out) as tmp:  # read back and compared before it replaces anything
        save_file(out, str(tmp))
        back = load_file(str(tmp))
        if set(back) != set(out) or any(not _same_bits(back[n], t) for n, t in out.items()):
            raise RuntimeError(f"{args.out}: the written file does not read back as decoded; nothing was written")
    print(f"tensors: {len(out)}  compressed: {_mb(before)}  decompressed: {_mb(after)}  "
          f"time: {time.perf_counter() - t0:.1f} s")
    return 0


def validation_perplexity(model, dataset, batch_size: int, seq_len: int, max_batches: int, device) -> dict:
    """Mean token loss and perplexity over the first ``max_batches`` validation windows (deterministic), for
    thrifty's LlamaForCausalLM (``labels=``) or any transformers causal LM (logits; labels already shifted)."""
    import math

    import torch
    import torch.nn.functional as F

    from ..models import LlamaForCausalLM

    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, labels in dataset.iter_eval_batches(batch_size, seq_len, max_batches):
            inputs, labels = inputs.to(device), labels.to(device)
            if isinstance(model, LlamaForCausalLM):
                loss = model(inputs, labels=labels)
            else:
                logits = model(input_ids=inputs).logits
                loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
            n = int((labels != -100).sum())
            total, tokens = total + float(loss) * n, tokens + n
    loss = total / max(tokens, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": tokens}


def load_any_model(path: Path, device, dtype=None):
    """A NeuZip checkpoint (``save_compressed``), a HF/thrifty checkpoint folder (config.json + safetensors), or
    ``smollm2`` (the real pretrained model; Q4_1-dequantized, so its weight statistics are not a bf16 model's)."""
    import torch

    from ..models import LlamaForCausalLM
    from .model import is_compressed_checkpoint, load_compressed

    if str(path) == "smollm2":
        from .. import pretrained

        path = pretrained.ensure_converted()
    if is_compressed_checkpoint(path):
        return load_compressed(path, device=device)
    return LlamaForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, device=device)


def eval_main(argv=None) -> int:
    import torch

    from ..data.locate import corpus_path as _corpus
    from ..data.locate import resolve_device as _device
    from ..data import TokenDataset
    from .model import compress_model

    p = argparse.ArgumentParser(prog="thrifty eval", description="Validation perplexity of a model on the corpus")
    p.add_argument("model", help="checkpoint folder (NeuZip, thrifty or HF Llama layout) or 'smollm2'")
    p.add_argument("--corpus", default=None, help="a folder of text files instead of the Debian corpus")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                   help="weights of an uncompressed model (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--neuzip", default=None, choices=("lossless", "0", "1", "3", "7"),
                   help="compress an uncompressed model first: lossless, or lossy k mantissa bits (bf16)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args(argv)
    try:
        for flag, n in (("--batches", args.batches), ("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
            if n < 1:  # --batches 0 would print a perplexity of 1.0 over no tokens
                raise ValueError(f"{flag}: expected an int >= 1, got {n}")
        device = _device(args.device)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" or args.neuzip not in (None, "lossless") else torch.float32
        model = load_any_model(Path(args.model), device, dtype)
        if args.neuzip is not None:
            if getattr(model, "neuzip", None) is not None:
                raise ValueError("--neuzip: the checkpoint is already compressed")
            mode = "lossless" if args.neuzip == "lossless" else "lossy"
            compress_model(model, mode, None if mode == "lossless" else int(args.neuzip))
        val = TokenDataset(_corpus(args.corpus, reuse=True), "validation")
    except (OSError, ValueError) as err:
        print(f"thrifty eval: {err}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    r = validation_perplexity(model, val, args.batch_size, args.seq_len, args.batches, device)
    state = getattr(model, "neuzip", None)
    weights = "uncompressed"
    if state is not None:
        lossy = f" k={state.config.mantissa_bits}" if state.config.mode == "lossy" else ""
        weights = f"NeuZip {state.config.mode}{lossy}, block weights {state.memory()['ratio_vs_bf16']:.3f}x bf16"
    print(f"model: {args.model} ({weights}, {next(model.parameters()).dtype}, {device})")
    print(f"validation: {r['val_tokens']:,} tokens  loss {r['val_loss']:.4f}  perplexity {r['val_ppl']:.3f}  "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mains = {"compress": compress_main, "decompress": decompress_main, "eval": eval_main}
    if not argv or argv[0] not in mains:
        print("usage: python -m thrifty.neuzip.cli {compress,decompress,eval} ...", file=sys.stderr)
        return 2
    return mains[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
