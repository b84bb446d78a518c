"""BitNet a4.8 under FSDP2 with the GPU's mixed precision (bf16 parameters, fp32 reduction, bf16 autocast), on 2
gloo processes: the 2-rank steps equal one process's steps on the same global batch when that process
accumulates the ranks' micro-batches (multi_gpu.py's loss reference since issue #33); one batch of all rows does
not, by bf16 gradient rounding that the ternary/INT4/INT8 codes amplify (recorded, not asserted).

Both references are shard_model on a world of one (a rank-0 group), as multi_gpu.py's 1-GPU runs: FSDP2 casts
their parameters to bf16 too, so every run ternarizes the same bf16 weights (asserted).
"""

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import free_port

from thrifty.models import LlamaConfig, LlamaForCausalLM
from thrifty.train import TrainConfig, Trainer

STEPS, B, T, LR = 6, 2, 32, 1e-3


class Tokens:
    def batch(self, batch_size, seq_len, generator=None):
        w = torch.randint(0, 256, (batch_size, seq_len + 1), generator=generator)
        return w[:, :-1], w[:, 1:]


def _run(mesh, batch, accum, seen):
    from thrifty.bitnet import BitLinear, convert
    from thrifty.parallel import shard_model

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = convert(LlamaForCausalLM(cfg).init_weights(seed=0), "a4.8")
    for m in model.modules():
        if isinstance(m, BitLinear):
            m.register_forward_pre_hook(lambda mod, args: seen.add(str(mod.weight.dtype)))
    shard_model(model, mesh, mixed_precision_enabled=True)
    tc = TrainConfig(steps=STEPS, batch_size=batch, seq_len=T, lr=LR, warmup_steps=0, min_lr_ratio=1.0, seed=0,
                     grad_accum=accum, autocast="bf16")
    t = Trainer(model, Tokens(), None, tc)
    return [t.train_step()["loss"] for _ in range(STEPS)]


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    from torch.distributed.device_mesh import DeviceMesh

    from thrifty.parallel.fsdp import data_parallel_mesh

    seen = {"two": set(), "accum": set(), "one_batch": set()}
    res = {"two": _run(data_parallel_mesh(torch.device("cpu")), B, 1, seen["two"])}
    solo = [dist.new_group([r]) for r in range(2)]  # every rank takes part in creating each group
    if rank == 0:
        mesh = DeviceMesh.from_group(solo[0], "cpu")
        res["accum"] = _run(mesh, B, 2, seen["accum"])  # 2 micro-batches of B rows: the ranks' rows, in order
        res["one_batch"] = _run(mesh, 2 * B, 1, seen["one_batch"])  # the pre-#33 reference
        res["seen"] = {k: sorted(v) for k, v in seen.items()}
        (out / "res.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()



def test_bitnet_bf16_two_ranks_equal_one_process_accumulating_their_micro_batches(tmp_path):
    mp.start_processes(_worker, args=(free_port(), tmp_path), nprocs=2, start_method="spawn", join=True)
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["seen"] == {k: ["torch.bfloat16"] for k in ("two", "accum", "one_batch")}  # same ternarized dtype
    accum = max(abs(a - b) for a, b in zip(res["two"], res["accum"]))
    one_batch = max(abs(a - b) for a, b in zip(res["two"], res["one_batch"]))
    print(f"max |loss diff| over {STEPS} steps: accumulating reference {accum:.2e}, one-batch reference {one_batch:.2e}")
    assert abs(res["two"][0] - res["one_batch"][0]) < 1e-5  # equal weights: equal quantization, equal loss
    assert accum <= 1e-4, (res["two"], res["accum"])
