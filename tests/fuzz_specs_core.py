"""Fuzz specs of the techniques on main: attention, loss, NeuZip (tensors, files, CLI), model, trainer, checks.
See tests/fuzz_registry.py for what each kind asserts and how to add a technique."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from fuzz_registry import (FLOAT_DTYPES, ArgSpec, FileSpec, NumericSpec, assert_matches, raw_bits, same_bits,
                           special_values, tensors)
from thrifty.attention import SageConfig, exact_attention, load_plan, sage_attention, sage_seam
from thrifty.loss import CCEKernelConfig, LinearCrossEntropy, linear_cross_entropy
from thrifty.models import LlamaForCausalLM, generate
from thrifty.models.llama import LlamaConfig
from thrifty.neuzip import CompressedTensor, compress, load, save
from thrifty.neuzip import reference as NZ
from thrifty.neuzip.format import _DTYPE_NAMES
from thrifty.train import Trainer, TrainConfig
from thrifty.triton_utils import interpreting

NAN, INF = math.nan, math.inf


def _tmpdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="thrifty-fuzz-"))


# ------------------------------------------------------------------------------------------------ attention
def _qkv(shape=(1, 2, 4, 8), hkv=2):
    B, H, S, D = shape
    return dict(q=torch.randn(B, H, S, D), k=torch.randn(B, hkv, S, D), v=torch.randn(B, hkv, S, D))


ATTENTION_ARGS = ArgSpec(
    "attention.sage_attention", sage_attention, valid=_qkv,
    bad={"sm_scale": [NAN, INF, -INF, -1.0, 0.0, "0.1"], "config": [{"qk_bits": 4}, 4], "qk_bits": [4],
         "impl": ["cuda"], "layout": ["bhds"], "q": [torch.zeros(1, 2, 4, 8, dtype=torch.int64), [[1.0]],
                                                    torch.randn(1, 0, 4, 8), torch.randn(1, 2, 4, 0)],
         "k": [torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 4)], "v": [torch.randn(1, 2, 5, 8)]},
    mention={"q": "q"})


SEAM_ARGS = ArgSpec("attention.sage_seam", lambda **kw: sage_seam(**kw), valid=dict,
                    bad={"config": [{"qk_bits": 4}], "impl": ["gpu"], "pv": ["fp8"], "foo": [1]})
SAGE_CONFIG_ARGS = ArgSpec(
    "attention.SageConfig", SageConfig, valid=dict,
    bad={"qk_bits": [5, None, "8"], "pv": ["fp4", None], "smooth_k": [1, None], "smooth_q": ["yes", 0],
         "smooth_v": [None, "no"]})


def _plan_file(content) -> Path:
    path = _tmpdir() / "plan.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


PLAN_ARGS = ArgSpec(
    "attention.load_plan", lambda path: load_plan(path),
    valid=lambda: dict(path=_plan_file({"format": "thrifty.sage_plan/1", "layers": {"0": 4}})),
    bad={"path": [_plan_file("{bad"), _plan_file({"format": "thrifty.sage_plan/1"}), _plan_file([1]),
                  _plan_file({"format": "thrifty.sage_plan/1", "layers": {"a": 4}}), _tmpdir() / "missing.json",
                  _plan_file({"format": "thrifty.sage_plan/1", "layers": {"0": 5}})]},
    mention={"path": ".json"})  # the message names the file


def _bad_rows(q, k, v, causal):
    """(B, H, Sq): the rows that see a non-finite input (an independent formulation of the contract)."""
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    g = H // k.shape[1]
    visible = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal:
        visible = torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + (Sk - Sq)
    bad_kv = (~torch.isfinite(k) | ~torch.isfinite(v)).any(-1).repeat_interleave(g, dim=1)  # (B, H, Sk)
    return (~torch.isfinite(q)).any(-1) | (visible & bad_kv[:, :, None, :]).any(-1)


@st.composite
def attention_inputs(draw, head_dims=(8, 16), max_len=9, batch=(0, 2)):
    B = draw(st.integers(1, batch[1]))
    hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    sq, sk = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    empty = draw(st.sampled_from(["", "", "", "", "", "batch", "queries", "keys"]))  # 3 in 8: a zero size
    B, sq, sk = (0 if empty == "batch" else B), (0 if empty == "queries" else sq), (0 if empty == "keys" else sk)
    D = draw(st.sampled_from(head_dims))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    # ±max is left out: scores of such inputs overflow fp32 (documented); NaN, ±inf, ±0, subnormals are in
    pool = [v for v in special_values(dtype) if abs(v) != torch.finfo(dtype).max]
    mk = lambda s: tensors((B, s[0], s[1], D), dtype, allowed_specials=pool, strided=False)  # noqa: E731
    q, k, v = draw(mk((hkv * group, sq))), draw(mk((hkv, sk))), draw(mk((hkv, sk)))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    if layout == "bshd":  # (B, S, H, D) views of the same values: non-contiguous
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    config = SageConfig(qk_bits=draw(st.sampled_from([8, 4])), smooth_k=draw(st.booleans()))
    return dict(q=q, k=k, v=v, causal=draw(st.booleans()), layout=layout, config=config, return_lse=True)


def _check_attention(a, result):
    out, lse = result
    q, k, v = a["q"], a["k"], a["v"]
    if a["layout"] == "bshd":
        q, k, v, out = (x.transpose(1, 2) for x in (q, k, v, out))
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    bad = _bad_rows(q, k, v, a["causal"])
    assert out[bad].isnan().all() and lse[bad].isnan().all(), "a row that sees NaN/inf is not NaN"
    good = ~bad
    assert out[good].isfinite().all() and not lse[good].isnan().any(), "NaN/inf in a row that sees none"
    zero = lambda x: torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype))  # noqa: E731
    ref = exact_attention(zero(q), zero(k), zero(v), causal=a["causal"], dtype=torch.float64)
    vmax = float(zero(v).abs().max()) if v.numel() else 0.0
    # int8/int4 Q·K and fp8 P·V: a loose bound (accuracy has its own tests); catches zeros and garbage
    tol = (0.1 if a["config"].qk_bits == 8 else 0.35) * vmax + 1e-6
    assert_matches(out.double(), ref.double(), rtol=0.02, atol=tol, where=good)


ATTENTION_REFERENCE = NumericSpec(
    "attention.reference", attention_inputs(), lambda a: sage_attention(**a, impl="reference"), _check_attention)
ATTENTION_KERNEL = NumericSpec(
    "attention.triton", attention_inputs(head_dims=(64,), max_len=20, batch=(0, 1)),
    lambda a: sage_attention(**a, impl="triton"), _check_attention, max_examples=8)


# ------------------------------------------------------------------------------------------------------ loss
def _loss_valid():
    return dict(e=torch.randn(4, 8), c=torch.randn(16, 8), targets=torch.randint(0, 16, (4,)))


LOSS_ARGS = ArgSpec(
    "loss.linear_cross_entropy", linear_cross_entropy, valid=_loss_valid,
    bad={"label_smoothing": [NAN, INF, -0.1, 1.5], "z_loss": [NAN, INF, -1.0], "softcap": [NAN, INF, 0.0, -1.0],
         "reduction": ["avg"], "ignore_index": [1.5, True], "impl": ["gpu"], "shift": ["yes"],
         "e": [torch.randn(4, 9), torch.zeros(4, 8, dtype=torch.int32)], "c": [torch.randn(16, 8).double()],
         "targets": [torch.randint(0, 16, (5,)), torch.full((4,), 99)], "config": [{"filter_eps": "auto"}, "auto"]})
LOSS_MODULE_ARGS = ArgSpec(
    "loss.LinearCrossEntropy", LinearCrossEntropy, valid=dict,
    bad={"label_smoothing": [NAN, 2.0], "z_loss": [NAN, -1.0], "softcap": [NAN, 0.0], "reduction": ["avg"],
         "impl": ["gpu"], "ignore_index": [0.5], "config": [{}]})
LOSS_CONFIG_ARGS = ArgSpec(
    "loss.CCEKernelConfig", CCEKernelConfig, valid=dict,
    bad={"filter_eps": ["x", True, 0.0, -1e-3, NAN, INF], "scratch_in_dc": [1, None, "yes"],
         "forward": ["gluon", "Gemm", "", None, 1], "tiles": ["gluon", "Triton", "", None, 1]})


@st.composite
def loss_inputs(draw):
    N, D, V = draw(st.integers(0, 6)), draw(st.integers(1, 8)), draw(st.integers(1, 12))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16)))
    pool = [NAN, INF, -INF, -0.0, 1e-40 if dtype == torch.float32 else 1e-39]
    e = draw(tensors((N, D), dtype, allowed_specials=pool))
    c = draw(tensors((V, D), dtype, allowed_specials=pool))
    targets = torch.tensor(draw(st.lists(st.sampled_from([-100, *range(V)]), min_size=N, max_size=N)),
                           dtype=torch.int64)
    return dict(e=e, c=c, targets=targets, impl=draw(st.sampled_from(["reference", "torch"])))


def _check_loss(a, out):
    e, c, t = a["e"].double(), a["c"].double(), a["targets"]
    ref = F.cross_entropy(e @ c.T, t, reduction="none", ignore_index=-100) if len(t) else torch.zeros(0)
    assert out.shape == ref.shape
    bad = ~ref.isfinite()
    assert not out[bad].isfinite().any(), "a finite loss where the float64 reference is NaN/inf"
    tol = 1e-4 if a["e"].dtype == torch.float32 else 0.05
    assert_matches(out, ref, rtol=tol, atol=tol, where=~bad)


LOSS = NumericSpec("loss.linear_cross_entropy", loss_inputs(),
                   lambda a: linear_cross_entropy(a["e"], a["c"], a["targets"], reduction="none", impl=a["impl"]),
                   _check_loss)


# ---------------------------------------------------------------------------------------------------- neuzip
NEUZIP_ARGS = ArgSpec(
    "neuzip.compress", compress, valid=lambda: dict(tensor=torch.randn(8, dtype=torch.bfloat16)),
    bad={"tensor": [torch.arange(4), [1.0], torch.randn(3).double()], "mantissa_bits": [2, 1.5, True, 8],
         "steps": [32, 64.0, "64"]})


def _save_args():
    return dict(path=_tmpdir() / "x.nz", entries={"a": torch.randn(3)})


NEUZIP_SAVE_ARGS = ArgSpec(
    "neuzip.save", save, valid=_save_args,
    bad={"entries": [{"a::b": torch.randn(3)}, {1: torch.randn(3)}, {"a": 3}, [torch.randn(3)]],
         "path": [_tmpdir() / "missing-folder" / "x.nz", _tmpdir()]})

_SHAPES = st.sampled_from([(), (0,), (1,), (7,), (3, 5), (2, 0, 3), (65,), (4, 33), (130,)])


@st.composite
def neuzip_inputs(draw, impls=("reference",)):
    dtype = draw(st.sampled_from(list(NZ.DTYPES)))
    shape = draw(_SHAPES)
    x = draw(raw_bits(dtype, shape))
    if x.ndim == 2 and draw(st.booleans()):
        x = x.t()  # a non-contiguous input
    return dict(tensor=x, steps=draw(st.sampled_from(NZ.LANE_STEPS)), impl=draw(st.sampled_from(impls)))


def _check_bit_exact(a, out):
    assert same_bits(out, a["tensor"].contiguous()), "not bit-exact"


NEUZIP_ROUND_TRIP = NumericSpec(
    "neuzip.round_trip", neuzip_inputs(),
    lambda a: compress(a["tensor"], steps=a["steps"]).decompress(impl=a["impl"]), _check_bit_exact)
NEUZIP_KERNEL = NumericSpec(
    "neuzip.round_trip.triton", neuzip_inputs(("triton",)),
    lambda a: compress(a["tensor"], steps=a["steps"]).decompress(impl=a["impl"]),
    NEUZIP_ROUND_TRIP.check, max_examples=3)


@st.composite
def lossy_inputs(draw):
    shape = draw(_SHAPES)
    return dict(x=draw(raw_bits(torch.bfloat16, shape)), k=draw(st.sampled_from([0, 1, 3, 7])))


def _run_lossy(a):
    try:
        return compress(a["x"], a["k"]).decompress(impl="reference")
    except ValueError as err:  # k = 0 has no mantissa bit for a NaN: a clear error, by name
        assert a["k"] == 0 and a["x"].isnan().any() and "mantissa_bits" in str(err)
        return None


def _check_lossy(a, out):
    if out is not None:
        assert same_bits(out, NZ.round_mantissa(a["x"], a["k"]) if a["k"] < 7 else a["x"])
        assert torch.equal(out.isnan(), a["x"].isnan()), "NaN lost or made"


NEUZIP_LOSSY = NumericSpec("neuzip.lossy", lossy_inputs(), _run_lossy, _check_lossy)


@st.composite
def neuzip_entries(draw):
    entries = {}
    for i in range(draw(st.integers(0, 4))):
        shape = draw(st.sampled_from([(), (0,), (3,), (2, 3), (70,)]))
        if draw(st.booleans()):
            dtype = draw(st.sampled_from(list(NZ.DTYPES)))
            entries[f"t{i}.w"] = compress(draw(raw_bits(dtype, shape)), steps=draw(st.sampled_from(NZ.LANE_STEPS)))
        else:
            dtype = draw(st.sampled_from(sorted(_DTYPE_NAMES.values(), key=str)))
            size = torch.empty((), dtype=dtype).element_size()
            data = draw(raw_bits(torch.uint8, (math.prod(shape) * size,)))
            entries[f"t{i}.p"] = (data.view(dtype) if data.numel() else torch.empty(0, dtype=dtype)).reshape(shape)
    return entries


def _same_entries(a, b):
    if set(a) != set(b):
        return False
    for name, x in a.items():
        y = b[name]
        if isinstance(x, CompressedTensor):
            if not (isinstance(y, CompressedTensor) and y.crc32() == x.crc32()
                    and same_bits(y.decompress(impl="reference"), x.decompress(impl="reference"))):
                return False
        elif not (isinstance(y, torch.Tensor) and same_bits(x, y)):
            return False
    return True


NEUZIP_FILE = FileSpec("neuzip.file", neuzip_entries(), lambda e, p: save(p, e), load, _same_entries)


# ----------------------------------------------------------------------------------------------- neuzip CLI
@st.composite
def safetensors_models(draw):
    """{name: tensor}: codable floats, and what is stored raw (any dtype, empty, 0-d)."""
    out = {}
    for i in range(draw(st.integers(1, 4))):
        shape = draw(st.sampled_from([(), (0,), (5,), (3, 4), (0, 2)]))
        dtype = draw(st.sampled_from([*NZ.DTYPES, torch.float8_e4m3fn, torch.uint16, torch.int64, torch.bool]))
        size = torch.empty((), dtype=dtype).element_size()
        data = draw(raw_bits(torch.uint8, (math.prod(shape) * size,)))
        t = data.view(dtype) if data.numel() else torch.empty(0, dtype=dtype)
        if dtype == torch.bool:
            t = (data % 2).bool()
        out[f"layer{i}.weight"] = t.reshape(shape)
    return out


def _cli_write(model, path):
    from safetensors.torch import save_file

    from thrifty.cli import main

    src = path.parent / (path.name + ".in.safetensors")
    save_file(model, str(src))
    assert main(["compress", str(src), str(path)]) == 0


def _cli_read(path):
    import contextlib
    import io

    from safetensors.torch import load_file

    from thrifty.cli import main

    out = path.parent / (path.name + ".out.safetensors")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["decompress", str(path), str(out)])
    if rc == 2:  # a user error: one line on stderr, no traceback
        lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("thrifty")]
        assert len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
        raise ValueError(lines[0])
    assert rc == 0
    return load_file(str(out))


NEUZIP_CLI = FileSpec("cli.neuzip", safetensors_models(), _cli_write, _cli_read,
                      lambda a, b: set(a) == set(b) and all(same_bits(a[k], b[k]) for k in a), max_examples=15)


# ------------------------------------------------------------------------------------------ model and config
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1)
LLAMA_CONFIG_ARGS = ArgSpec(
    "models.LlamaConfig", LlamaConfig, valid=lambda: dict(TINY),
    bad={"rope_theta": [NAN, INF, 0.0, -1.0, "1e4"], "rms_norm_eps": [NAN, INF, 0.0, -1e-5],
         "head_dim": [0, -2, 3, 2.0], "vocab_size": [0, -1, 1.5], "hidden_size": [0, 33.0],
         "num_key_value_heads": [3, 0], "num_attention_heads": [0], "tie_word_embeddings": ["yes", 1],
         "max_position_embeddings": [0], "intermediate_size": [-1], "num_hidden_layers": [0]})
TRAIN_CONFIG_ARGS = ArgSpec(
    "train.TrainConfig", TrainConfig, valid=dict,
    bad={"grad_clip": [NAN, INF, -1.0], "lr": [NAN, 0.0, 2.0], "min_lr_ratio": [NAN, 1.5],
         "weight_decay": [NAN, -0.1], "betas": [(2.0,), (NAN, 0.9), (0.9, 1.0), "ab", (0.9, -0.1)],
         "seed": [-1, 1.5, "a"], "checkpoint_dir": [3], "extra": [3], "steps": [0, 1.5], "batch_size": [0],
         "seq_len": [-4], "grad_accum": [0], "warmup_steps": [-1], "eval_every": [-1], "eval_batches": [0],
         "checkpoint_every": [-1], "autocast": ["fp16"], "cuda_graph": [1, "yes", None]},
    mention={"betas": "betas"})


def _model():
    return LlamaForCausalLM(LlamaConfig(**TINY)).init_weights(seed=0)


MODEL_ARGS = ArgSpec(
    "models.forward", lambda input_ids, model=None, **kw: (model or _model())(input_ids, **kw),
    valid=lambda: dict(input_ids=torch.zeros(1, 3, dtype=torch.long)),
    bad={"input_ids": [torch.zeros(0, 3, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long),
                       torch.full((1, 3), 64), torch.full((1, 3), -1), torch.zeros(1, 3), torch.zeros(3, dtype=torch.long)],
         "labels": [torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3)]})
MODEL_POSITION_ARGS = ArgSpec(
    "models.forward.positions", lambda model=None, **kw: (model or _model())(torch.zeros(1, 3, dtype=torch.long), **kw),
    valid=lambda: dict(positions=torch.arange(3)),
    bad={"positions": [torch.arange(5), torch.arange(3.0), torch.tensor([-1, 0, 1]), torch.zeros(2, 3, dtype=torch.long)],
         "logits_to_keep": [-1, 1.5]})
GENERATE_ARGS = ArgSpec(
    "models.generate", lambda **kw: generate(_model(), **kw),
    valid=lambda: dict(input_ids=torch.zeros(1, 2, dtype=torch.long), max_new_tokens=1),
    bad={"temperature": [NAN, INF, -1.0], "max_new_tokens": [0, 1.5], "input_ids": [torch.zeros(2, dtype=torch.long)],
         "eos_token_id": [-5, 1.5]})


# ----------------------------------------------------------------------------------------------- checkpoints
class _Data:
    def batch(self, b, s, generator=None):
        x = torch.randint(0, 64, (b, s + 1), generator=generator)
        return x[:, :-1], x[:, 1:]


def _trainer(seed):
    torch.manual_seed(seed)
    return Trainer(LlamaForCausalLM(LlamaConfig(**TINY)).init_weights(seed=seed), _Data(),
                   config=TrainConfig(steps=1, batch_size=1, seq_len=4, seed=seed))


def _checkpoint_write(seed, path):
    t = _trainer(seed)
    t.train_step()
    t.save_checkpoint(path)


def _trainer_state(t):
    opt = {f"{i}.{k}": v.clone() for i, s in enumerate(t.optimizer.state.values()) for k, v in s.items()}
    return {**{k: v.clone() for k, v in t.model.state_dict().items()}, **opt, "step": torch.tensor(t.step)}


def _checkpoint_read(path):
    t = _trainer(12345)
    before = _trainer_state(t)
    try:
        t.load_checkpoint(path)
    except ValueError:
        after = _trainer_state(t)  # refused: nothing may have changed
        assert set(after) == set(before) and all(torch.equal(before[k], after[k]) for k in before)
        raise
    return _trainer_state(t)


def _checkpoint_same(seed, state):
    d = _tmpdir()
    _checkpoint_write(seed, d)
    t = _trainer(12345)
    t.load_checkpoint(d)
    ref = _trainer_state(t)
    return set(ref) == set(state) and all(torch.equal(ref[k], state[k]) for k in ref)


CHECKPOINT = FileSpec("train.checkpoint", st.integers(0, 3), _checkpoint_write, _checkpoint_read,
                      _checkpoint_same, max_examples=12,
                      targets=lambda path: [path / n for n in ("model.safetensors", "optimizer.safetensors",
                                                               "trainer_state.json")])


def _pretrained_write(seed, path):
    LlamaForCausalLM(LlamaConfig(**TINY)).init_weights(seed=seed).save_pretrained(path)


def _pretrained_same(seed, model):
    ref = LlamaForCausalLM(LlamaConfig(**TINY)).init_weights(seed=seed).state_dict()
    return all(torch.equal(ref[k], v) for k, v in model.state_dict().items())


# config.json is HF's hand-editable file (no checksum; parsed and range-checked): only the weights are damaged
PRETRAINED = FileSpec("models.from_pretrained", st.integers(0, 3), _pretrained_write,
                      LlamaForCausalLM.from_pretrained, _pretrained_same, max_examples=12,
                      targets=lambda path: [path / "model.safetensors"])


SPECS = [SEAM_ARGS, SAGE_CONFIG_ARGS, PLAN_ARGS, MODEL_POSITION_ARGS, ATTENTION_ARGS, ATTENTION_REFERENCE,
         ATTENTION_KERNEL, LOSS_ARGS, LOSS_MODULE_ARGS, LOSS_CONFIG_ARGS, LOSS, NEUZIP_ARGS,
         NEUZIP_SAVE_ARGS, NEUZIP_ROUND_TRIP, NEUZIP_KERNEL, NEUZIP_LOSSY, NEUZIP_FILE, NEUZIP_CLI,
         LLAMA_CONFIG_ARGS, TRAIN_CONFIG_ARGS, MODEL_ARGS, GENERATE_ARGS, CHECKPOINT, PRETRAINED]
if not (interpreting() or torch.cuda.is_available()):
    SPECS = [s for s in SPECS if s not in (ATTENTION_KERNEL, NEUZIP_KERNEL)]
