"""thrifty.parallel on 2 gloo processes (CPU): the FSDP2 trainer gives the single-process losses (reference
model and transformers Llama; plain loss and cut cross-entropy; lm_head sharded with the norm or alone), a
checkpoint saved on 2 ranks loads on 1, and vocabulary-parallel CCE matches single-process CCE (float64).

Process start-up is the cost here, so one spawn of 2 workers runs every distributed case and writes its
results (JSON + safetensors); the tests compare them with the same computations in this process.
"""

import functools
import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port
from safetensors.torch import load_file, save_file

from thrifty.loss import linear_cross_entropy, lm_loss
from thrifty.models import LlamaConfig, LlamaForCausalLM
from thrifty.train import Trainer, TrainConfig

transformers = pytest.importorskip("transformers")

WORLD = 2
V_VP = 101  # odd: the vocabulary slices are 51 and 50 rows


class WindowData:
    def __init__(self, tokens):
        self.tokens = tokens

    def batch(self, batch_size, seq_len, generator=None):
        starts = torch.randint(0, len(self.tokens) - seq_len - 1, (batch_size,), generator=generator)
        w = self.tokens[starts[:, None] + torch.arange(seq_len + 1)]
        return w[:, :-1], w[:, 1:]

    def iter_eval_batches(self, batch_size, seq_len, max_batches=None):
        g = torch.Generator().manual_seed(123)
        for _ in range(max_batches or 2):
            yield self.batch(batch_size, seq_len, g)


def make_data():
    text = ("The kernel schedules processes and manages memory. Drivers talk to hardware devices. " * 30).encode()
    return WindowData(torch.tensor(list(text)) % 64)


def ref_model(tied=True, cce=False):
    cfg = LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).init_weights(seed=0)
    if cce:
        model.set_loss(functools.partial(lm_loss, impl="reference"))
    return model


def hf_model(cce=False, tied=False):
    from thrifty.loss.hf import patch_causal_lm

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg).float().train()
    return patch_causal_lm(model, impl="reference") if cce else model


def train_cfg(batch_size, steps=3, **kw):
    return TrainConfig(steps=steps, batch_size=batch_size, seq_len=16, lr=3e-3, warmup_steps=1, eval_batches=2, **kw)


def vp_inputs():
    g = torch.Generator().manual_seed(7)
    e = torch.randn(3, 9, 24, generator=g, dtype=torch.float64)
    c = torch.randn(V_VP, 24, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, V_VP, (3, 9), generator=g)
    t[0, :3] = -100
    return e, c, t


VP_KW = dict(shift=True, softcap=8.0, z_loss=1e-3)


# ------------------------------------------------------------------------------------------------ the workers

def _shard_head_alone(model, mesh):
    """A user's own FSDP2 wrapping with lm_head as a unit of its own: its weight is a DTensor in the loss."""
    from torch.distributed.fsdp import fully_shard

    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.thrifty_mesh = mesh
    return model


def _steps(trainer, n):
    return [trainer.train_step()["loss"] for _ in range(n)]


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    from thrifty.parallel import init_distributed, shard_model, vocab_parallel_cross_entropy
    from thrifty.parallel.fsdp import data_parallel_mesh

    device = init_distributed("gloo")  # the CPU even on a GPU box: this is the CI test
    mesh = data_parallel_mesh(device)
    out = Path(out)
    res, tensors = {}, {}
    data = make_data()

    # the reference model, tied embeddings, plain loss: train, evaluate, checkpoint, train on
    t = Trainer(shard_model(ref_model()), data, data, train_cfg(2, steps=5))
    res["ref_plain"] = _steps(t, 3)
    res["ref_plain_val"] = t.evaluate()["val_loss"]
    t.save_checkpoint(out / "ck_ref")
    res["ref_plain_after"] = _steps(t, 2)
    # a checkpoint written by one plain process (fixture) resumes on 2 ranks
    t = Trainer(shard_model(ref_model().init_weights(seed=3)), data, data, train_cfg(2, steps=5))
    t.load_checkpoint(out / "ck_one_sharded")
    res["one_to_two_step"] = t.step
    res["one_to_two_after"] = _steps(t, 2)

    # untied + cut cross-entropy; the [norm, lm_head] unit, then lm_head alone (DTensor at the seam)
    res["ref_cce"] = _steps(Trainer(shard_model(ref_model(tied=False, cce=True)), data, None, train_cfg(2)), 3)
    # mixed precision (bf16 parameters, fp32 reduction), as on GPUs: the seam gets the gathered bf16 weight
    seen = []
    m = ref_model(tied=False)
    m.set_loss(lambda h, w, y: seen.append((type(w).__name__, str(w.dtype))) or lm_loss(h, w, y, impl="reference"))
    res["ref_cce_bf16"] = _steps(Trainer(shard_model(m, mixed_precision_enabled=True), data, None, train_cfg(2)), 3)
    res["ref_cce_bf16_seam"] = sorted(set(seen))
    m = _shard_head_alone(ref_model(tied=False, cce=True), mesh)
    res["ref_cce_alone"] = _steps(Trainer(m, data, None, train_cfg(2)), 3)
    res["ref_cce_alone_ran"] = "_thrifty_head_call" in m.lm_head.__dict__
    try:  # the sharded weight handed straight to the loss: a clear error, not a kernel reading one shard
        linear_cross_entropy(torch.randn(2, 3, 32), m.lm_head.weight, torch.zeros(2, 3, dtype=torch.long))
        res["dtensor_error"] = ""
    except ValueError as err:
        res["dtensor_error"] = str(err)

    # transformers Llama: stock and patched (CCE) with shard_model; patched with lm_head alone
    res["hf_plain"] = _steps(Trainer(shard_model(hf_model()), data, None, train_cfg(2)), 3)
    res["hf_cce"] = _steps(Trainer(shard_model(hf_model(cce=True)), data, None, train_cfg(2)), 3)
    m = hf_model(cce=True, tied=True)  # SmolLM2-style: the head is the embedding (root unit)
    res["hf_tied"] = m.lm_head.weight is m.model.embed_tokens.weight
    res["hf_cce_tied"] = _steps(Trainer(shard_model(m), data, None, train_cfg(2)), 3)
    m = _shard_head_alone(hf_model(cce=True), mesh)
    res["hf_cce_alone"] = _steps(Trainer(m, data, None, train_cfg(2)), 3)
    res["hf_cce_alone_ran"] = "_thrifty_head_call" in m.lm_head.__dict__

    # BitNet a4.8 (reference quantizers on the CPU): converted before sharding, the losses of one process
    from thrifty.bitnet import convert
    from thrifty.bitnet import bitlinear as bitlinear_module
    res["bitnet"] = _steps(Trainer(shard_model(convert(ref_model(), "a4.8")), data, None, train_cfg(2)), 3)

    # what one step communicates (bf16 parameters, fp32 reduction: the CUDA policy), plain vs BitNet, and how
    # many times a step ternarizes each BitLinear weight
    from thrifty.parallel.profiling import CollectiveCounter
    calls = []
    original = bitlinear_module.ref.quantize_weight_ternary
    bitlinear_module.ref.quantize_weight_ternary = lambda w, s=None: calls.append(w.dtype) or original(w, s)
    try:
        for name, model, per_unit in (("plain", ref_model(), 1), ("bitnet", convert(ref_model(), "a4.8"), 1),
                                      ("grouped", ref_model(), "auto")):
            t = Trainer(shard_model(model, mixed_precision_enabled=True, blocks_per_unit=per_unit), data, None,
                        train_cfg(2))
            t.train_step()  # the first step: lazy state out of the way
            calls.clear()
            with CollectiveCounter() as counter:
                t.train_step()
            res[f"bytes_{name}"] = counter.summary()
            res[f"ternary_calls_{name}"] = [str(d) for d in calls]
    finally:
        bitlinear_module.ref.quantize_weight_ternary = original

    # explicit forward prefetch: the next block's all-gather is issued before the current block's compute
    import torch.utils._python_dispatch as pd

    class Order(pd.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seq = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if "allgather" in name or name.startswith(("aten.mm", "aten.addmm", "aten.bmm")):
                self.seq.append("ag" if "allgather" in name else "mm")
            return func(*args, **(kwargs or {}))

    for p in (0, 1):
        m = shard_model(ref_model(tied=False), prefetch=p, blocks_per_unit=1)
        x = data.batch(2, 16)[0]
        with Order() as order:
            m(x)
        res[f"prefetch{p}_order"] = order.seq

    # vocabulary-parallel CCE: float64 reference path, explicit slices and a Shard(0) DTensor
    e, c, tg = vp_inputs()
    lo, hi = (0, 51) if rank == 0 else (51, V_VP)
    e1 = e.clone().requires_grad_()
    c1 = c[lo:hi].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(e1, c1, tg, vocab_start=lo, vocab_size=V_VP, impl="reference", **VP_KW)
    loss.backward()
    res["vp_loss"] = loss.item()
    tensors.update(vp_de=e1.grad, vp_dc=c1.grad)
    e2 = e.clone().requires_grad_()
    c2 = c[lo:hi].clone().requires_grad_()
    vocab_parallel_cross_entropy(e2, c2, tg, vocab_start=lo, vocab_size=V_VP, impl="reference",
                                 reduce_e_grad=False, reduction="sum", **VP_KW).backward()
    tensors["vp_de_partial"] = e2.grad
    from torch.distributed.tensor import Shard, distribute_tensor

    cd = distribute_tensor(c.clone(), mesh, [Shard(0)]).requires_grad_()
    e3 = e.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(e3, cd, tg, impl="reference", **VP_KW)
    loss.backward()
    res["vp_dtensor_loss"] = loss.item()
    tensors["vp_dtensor_dc"] = cd.grad.full_tensor()
    # the fused kernels per rank (Triton interpreter on the CPU), fp32
    if os.environ.get("TRITON_INTERPRET") == "1":
        e4 = e.float().clone().requires_grad_()
        c4 = c[lo:hi].float().clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(e4, c4, tg, vocab_start=lo, vocab_size=V_VP, impl="triton", **VP_KW)
        loss.backward()
        res["vp_triton_loss"] = loss.item()
        tensors.update(vp_triton_de=e4.grad, vp_triton_dc=c4.grad)

    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out / f"tensors{rank}.safetensors"))
    if rank == 0:
        (out / "results.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()



@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    one = _one_process(ref_model(), steps=5)
    _steps(one, 3)
    one.save_checkpoint(out / "ck_one")  # the plain layout (compared in the parent)
    from thrifty.parallel import save_sharded

    save_sharded(out / "ck_one_sharded", one.model, one.optimizer,
                 extra_files={"trainer_state.json": (out / "ck_one" / "trainer_state.json").read_text()})
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=WORLD, start_method="spawn", join=True)
    res = json.loads((out / "results.json").read_text())
    tensors = [load_file(str(out / f"tensors{r}.safetensors")) for r in range(WORLD)]
    return res, tensors, out


# ------------------------------------------------------------------------------------------------ the tests

def _one_process(model, steps=3, **cfg):
    return Trainer(model, make_data(), make_data(), train_cfg(2 * WORLD, steps=steps, **cfg))


def close(a, b, tol=2e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= tol * max(1.0, abs(y)), (a, b)


def test_fsdp_trainer_matches_one_process_reference_model(two_ranks):
    res, _, _ = two_ranks
    t = _one_process(ref_model(), steps=5)
    close(res["ref_plain"], _steps(t, 3))
    close([res["ref_plain_val"]], [t.evaluate()["val_loss"]])
    close(res["ref_cce"], _steps(_one_process(ref_model(tied=False, cce=True)), 3))
    close(res["ref_cce_alone"], _steps(_one_process(ref_model(tied=False, cce=True)), 3))
    close(res["ref_cce_bf16"], res["ref_cce"], tol=5e-3)  # bf16 parameters: rounding, not a different model
    assert res["ref_cce_bf16_seam"] == [["Parameter", "torch.bfloat16"]]  # the unsharded bf16 parameter
    assert res["ref_cce_alone_ran"]  # the loss ran inside the sharded lm_head's all-gather
    assert "c: got a sharded DTensor" in res["dtensor_error"]


def test_fsdp_trainer_matches_one_process_transformers_llama(two_ranks):
    res, _, _ = two_ranks
    close(res["hf_plain"], _steps(_one_process(hf_model()), 3))
    cce = _steps(_one_process(hf_model(cce=True)), 3)
    close(res["hf_cce"], cce)
    close(res["hf_cce_alone"], cce)
    assert res["hf_tied"]
    close(res["hf_cce_tied"], _steps(_one_process(hf_model(cce=True, tied=True)), 3))
    assert res["hf_cce_alone_ran"]


def test_bitnet_under_fsdp_matches_one_process(two_ranks):
    from thrifty.bitnet import convert

    res, _, _ = two_ranks
    # the same gradient sum order as the ranks': one process accumulating WORLD micro-batches of 2 rows
    accum = Trainer(convert(ref_model(), "a4.8"), make_data(), None, train_cfg(2, grad_accum=WORLD))
    close(res["bitnet"], _steps(accum, 3))
    # one batch of 4 rows sums the weight gradients in another order; after an optimizer step a few latent
    # weights sit on the other side of a ternary/INT4 rounding boundary (measured 2e-3 nats at step 3): the
    # quantizers' sensitivity, which plain fp32 training does not have (it matches to 2e-5 above)
    one = _steps(_one_process(convert(ref_model(), "a4.8")), 3)
    close(res["bitnet"][:1], one[:1])
    close(res["bitnet"], one, tol=5e-3)


def _padded(p, world=WORLD):
    """Elements FSDP2 all-gathers / reduce-scatters for a parameter: dim 0 padded to a multiple of world."""
    return -(-p.shape[0] // world) * world * (p.numel() // max(1, p.shape[0]))


def test_bytes_communicated_per_step_plain_and_bitnet(two_ranks):
    """Per step: every parameter all-gathered in bf16 (blocks twice: forward and the backward re-gather; the
    root, which keeps its gathered parameters, once) and reduce-scattered in fp32 once. BitLinear's fp32
    latent weights are cast to bf16 before the gather like every other parameter: BitNet moves exactly the
    plain model's bytes plus its sub-norm weights. Each weight is ternarized once per step, in forward."""
    from thrifty.bitnet import BitLinear, convert

    res, _, _ = two_ranks
    for name, model in (("plain", ref_model()), ("bitnet", convert(ref_model(), "a4.8"))):
        blocks = sum(_padded(p) for p in model.model.layers.parameters())
        root = sum(_padded(p) for n, p in model.named_parameters() if not n.startswith("model.layers."))
        got = res[f"bytes_{name}"]
        assert got["all_gather"]["dtypes"] == {"torch.bfloat16": 2 * (root + 2 * blocks)}, name
        assert got["all_gather"]["calls"] == 1 + 2 * len(model.model.layers), name
        assert got["all_gather"]["rank_bytes"] * WORLD == got["all_gather"]["full_bytes"], name
        assert got["reduce_scatter"]["dtypes"] == {"torch.float32": 4 * (root + blocks)}, name
        assert got["reduce_scatter"]["calls"] == 1 + len(model.model.layers), name
    plain, bitnet = ref_model(), convert(ref_model(), "a4.8")
    extra = sum(_padded(m.norm.weight) for m in bitnet.modules() if isinstance(m, BitLinear) and m.norm is not None)
    assert extra > 0
    assert res["bytes_bitnet"]["all_gather"]["full_bytes"] - res["bytes_plain"]["all_gather"]["full_bytes"] == \
        2 * 2 * extra  # bf16, gathered in forward and again in backward (the sub-norms live in the blocks)
    # blocks_per_unit="auto": the two tiny blocks share one unit (far below UNIT_MIN_PARAMS), the same bytes in
    # one gather per pass and one reduce-scatter instead of one per block
    grouped = res["bytes_grouped"]
    assert (grouped["all_gather"]["calls"], grouped["reduce_scatter"]["calls"]) == (1 + 2, 1 + 1)
    assert grouped["all_gather"]["dtypes"] == res["bytes_plain"]["all_gather"]["dtypes"]
    assert grouped["reduce_scatter"]["dtypes"] == res["bytes_plain"]["reduce_scatter"]["dtypes"]
    n_bitlinear = sum(isinstance(m, BitLinear) for m in bitnet.modules())
    assert res["ternary_calls_bitnet"] == ["torch.bfloat16"] * n_bitlinear  # once each, on the gathered bf16
    assert res["ternary_calls_plain"] == []


def test_forward_prefetch_issues_the_next_all_gather_before_compute(two_ranks):
    res, _, _ = two_ranks
    before = {p: res[f"prefetch{p}_order"].index("mm") for p in (0, 1)}
    assert before == {0: 2, 1: 3}  # root + block 0; with prefetch also block 1, ahead of block 0's matmuls
    assert res["prefetch0_order"].count("ag") == res["prefetch1_order"].count("ag") == 4  # root, 2 blocks, tail


def test_checkpoint_saved_on_two_ranks_loads_on_one(two_ranks, tmp_path):
    from thrifty.parallel import consolidate

    res, _, out = two_ranks
    ck = out / "ck_ref"
    assert sorted(p.name for p in ck.iterdir() if p.suffix == ".safetensors") == [
        "model-rank00000-of00002.safetensors", "model-rank00001-of00002.safetensors",
        "optimizer-rank00000-of00002.safetensors", "optimizer-rank00001-of00002.safetensors"]
    assert not list(ck.glob("*.pt")) and not list(ck.glob("*.bin")) and not list(ck.glob("*.tmp"))
    t = _one_process(ref_model(tied=True).init_weights(seed=5), steps=5)
    t.load_checkpoint(ck)
    assert t.step == 3 and t.tokens_seen == 3 * 2 * WORLD * 16
    close(res["ref_plain_after"], _steps(t, 2))  # weights, AdamW moments and data position all restored
    full = consolidate(ck, tmp_path / "full")
    m = LlamaForCausalLM.from_pretrained(full)
    fresh = _one_process(ref_model(), steps=5)
    fresh.load_checkpoint(ck)
    for (n, p), (_, q) in zip(m.named_parameters(), fresh.model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)


def test_checkpoint_saved_on_one_process_loads_on_two_ranks(two_ranks):
    res, _, out = two_ranks
    t = _one_process(ref_model(), steps=5)
    t.load_checkpoint(out / "ck_one")
    assert res["one_to_two_step"] == 3
    close(res["one_to_two_after"], _steps(t, 2))


def test_corrupt_sharded_checkpoint_is_refused(two_ranks, tmp_path):
    import shutil

    _, _, out = two_ranks
    bad = tmp_path / "bad"
    shutil.copytree(out / "ck_ref", bad)
    shard = bad / "model-rank00001-of00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    model = ref_model()
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="truncated|corrupt"):
        Trainer(model, make_data(), None, train_cfg(4)).load_checkpoint(bad)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # refused before use
    (bad / "sharded_index.json").write_text("{")
    with pytest.raises(ValueError, match="JSON"):
        Trainer(ref_model(), make_data(), None, train_cfg(4)).load_checkpoint(bad)


def test_vocab_parallel_cce_matches_single_process_float64(two_ranks):
    res, tensors, _ = two_ranks
    e, c, t = vp_inputs()
    e = e.requires_grad_()
    c = c.requires_grad_()
    ref = linear_cross_entropy(e, c, t, impl="reference", **VP_KW)
    ref.backward()
    for key in ("vp_loss", "vp_dtensor_loss"):
        assert abs(res[key] - ref.item()) <= 1e-12
    for r in range(WORLD):
        torch.testing.assert_close(tensors[r]["vp_de"], e.grad, rtol=1e-10, atol=1e-12)
    dc = torch.cat([tensors[0]["vp_dc"], tensors[1]["vp_dc"]])  # each rank's rows of dC, no communication
    torch.testing.assert_close(dc, c.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tensors[0]["vp_dtensor_dc"], c.grad, rtol=1e-10, atol=1e-12)
    # without the dE all-reduce each rank holds its slice's share; the shares add up to the full gradient
    e.grad = None
    linear_cross_entropy(e, c, t, impl="reference", reduction="sum", **VP_KW).backward()
    torch.testing.assert_close(tensors[0]["vp_de_partial"] + tensors[1]["vp_de_partial"], e.grad,
                               rtol=1e-10, atol=1e-12)
    assert not torch.allclose(tensors[0]["vp_de_partial"], e.grad)


def test_vocab_parallel_cce_fused_kernels_per_rank(two_ranks):
    res, tensors, _ = two_ranks
    if "vp_triton_loss" not in res:
        pytest.skip("needs TRITON_INTERPRET=1 (the CPU workers run the kernels in the interpreter)")
    e, c, t = vp_inputs()
    e = e.requires_grad_()
    c = c.requires_grad_()
    ref = linear_cross_entropy(e, c, t, impl="reference", **VP_KW)
    ref.backward()
    assert abs(res["vp_triton_loss"] - ref.item()) <= 1e-5 * ref.item()
    torch.testing.assert_close(tensors[0]["vp_triton_de"].double(), e.grad, rtol=1e-4, atol=1e-6)
    dc = torch.cat([tensors[0]["vp_triton_dc"], tensors[1]["vp_triton_dc"]]).double()
    torch.testing.assert_close(dc, c.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (a CPU gloo group)")
@pytest.mark.parametrize("config", [dict(filter_eps="auto"), dict(filter_eps=1e-3, scratch_in_dc=False)])
def test_vocab_parallel_cce_takes_the_kernel_config(config):
    """One rank holding the whole vocabulary: the kernels under a CCEKernelConfig give what linear_cross_entropy
    gives with the same config (the filter's "auto" threshold resolved for the input dtype)."""
    from thrifty.loss import CCEKernelConfig
    from thrifty.parallel import vocab_parallel_cross_entropy

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    cfg = CCEKernelConfig(**config)
    e, c, t = vp_inputs()
    e1, c1 = e.float().requires_grad_(), c.float().requires_grad_()
    e2, c2 = e.float().requires_grad_(), c.float().requires_grad_()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        got = vocab_parallel_cross_entropy(e1, c1, t, vocab_start=0, vocab_size=V_VP, impl="triton", config=cfg,
                                           **VP_KW)
        got.backward()
    finally:
        dist.destroy_process_group()
    want = linear_cross_entropy(e2, c2, t, impl="triton", config=cfg, **VP_KW)
    want.backward()
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()
    torch.testing.assert_close(e1.grad, e2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(c1.grad, c2.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(TypeError, match="config"):
        vocab_parallel_cross_entropy(e1, c1, t, vocab_start=0, vocab_size=V_VP, config={"filter_eps": "auto"})


def test_bad_arguments_get_clear_errors():
    from thrifty.parallel import RankData, shard_model, vocab_parallel_cross_entropy

    with pytest.raises(ValueError, match="rank"):
        RankData(make_data(), 2, 2)
    with pytest.raises(TypeError, match="model"):
        shard_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="block_units"):
        shard_model(ref_model(), block_units="some")
    with pytest.raises(ValueError, match="blocks_per_unit"):
        shard_model(ref_model(), blocks_per_unit=0)
    with pytest.raises(TypeError, match="blocks_per_unit"):
        shard_model(ref_model(), blocks_per_unit="5")
    e, c, t = vp_inputs()
    with pytest.raises(RuntimeError, match="process group"):
        vocab_parallel_cross_entropy(e, c, t, vocab_start=0, vocab_size=V_VP)


def _one_process_checkpoint(path):
    from thrifty.parallel import save_sharded

    model = ref_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    save_sharded(path, model, opt, rank=0, world=1)
    return model, opt


def test_sharded_checkpoint_flipped_byte_and_bad_optimizer_entry_are_refused_before_use(tmp_path, monkeypatch):
    """Once, a flipped byte in a shard's tensor data loaded as other weights (no checksum), and an optimizer
    entry naming no parameter of the model was refused only after the model's weights were overwritten."""
    from thrifty.parallel import checkpoint, load_sharded

    _one_process_checkpoint(tmp_path / "a")
    shard = tmp_path / "a" / "model-rank00000-of00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x10  # inside the last tensor's data: the header still parses
    shard.write_bytes(bytes(raw))
    model = ref_model()
    with pytest.raises(ValueError, match="model-rank00000-of00001.safetensors.*checksum"):
        load_sharded(tmp_path / "a", model)

    _one_process_checkpoint(tmp_path / "b")
    index = checkpoint.read_index(tmp_path / "b")  # files intact; the entry of a model that is not this one
    key = next(k for k in index["optimizer"] if k.endswith("::exp_avg"))
    index["optimizer"]["nope::exp_avg"] = index["optimizer"].pop(key)
    monkeypatch.setattr(checkpoint, "read_index", lambda path: index)
    model = ref_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="unknown parameter nope"):
        load_sharded(tmp_path / "b", model, opt)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # refused before use


def test_kernel_overlap_arithmetic():
    from thrifty.parallel.profiling import kernel_overlap

    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    events = [k("ncclDevKernel_AllGather", 0, 100), k("gemm", 50, 100), k("gemm2", 120, 10),  # 50 µs exposed
              k("ncclDevKernel_ReduceScatter", 300, 40), k("rms", 400, 20),  # all exposed; idle 150-300, 340-400
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 0, "dur": 1},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500}]
    got = kernel_overlap(events)
    assert got["gpu_span_ms"] == pytest.approx(0.420)
    assert got["nccl_ms"] == pytest.approx(0.140) and got["compute_ms"] == pytest.approx(0.120)
    assert got["overlap_ms"] == pytest.approx(0.050) and got["nccl_exposed_ms"] == pytest.approx(0.090)
    assert got["gpu_idle_ms"] == pytest.approx(0.420 - 0.210)
    assert (got["host_syncs"], got["kernels"], got["nccl_kernels"]) == (1, 5, 2)
