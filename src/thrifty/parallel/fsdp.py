"""FSDP2 for thrifty's models: process-group start-up from the torchrun environment, ``shard_model``
(per-block units, the (norm, lm_head) tail, the root), per-rank data, and the cross-rank means the trainer
reports. The classifier call that works on a sharded lm_head (``run_with_gathered_head``, re-exported here)
lives in ``thrifty.loss.gathered_head``: the loss seam needs it, and this package builds on the loss kernels.

Everything here is PyTorch's own engine (``torch.distributed``, ``fully_shard``); thrifty adds only the wiring.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .._checks import check_choice, check_positive_int
from ..loss.gathered_head import run_with_gathered_head  # noqa: F401 (public here too)

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """True in a process started by ``torchrun`` (its environment names the rank and the rendezvous)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def init_distributed(backend: Optional[str] = None) -> torch.device:
    """Joins the process group described by the torchrun environment (once) and returns this rank's device:
    ``cuda:LOCAL_RANK`` with NCCL where there is a GPU, the CPU with gloo otherwise."""
    if not launched_by_torchrun() and not dist.is_initialized():
        raise RuntimeError("init_distributed: no torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                           "MASTER_PORT); launch with `torchrun --nproc-per-node N ...`")
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"))
    return device


def data_parallel_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over every rank of the default group (the FSDP2 shard dimension)."""
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def mixed_precision(device: torch.device, enabled: Optional[bool] = None) -> MixedPrecisionPolicy:
    """bf16 parameters in forward/backward with fp32 gradient reduction on CUDA (the sharded fp32 master copy
    stays fp32 for the optimizer); plain fp32 on the CPU."""
    if enabled is None:
        enabled = device.type == "cuda"
    if not enabled:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _blocks(model: torch.nn.Module):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not hasattr(model, "lm_head") or not hasattr(inner, "norm"):
        raise TypeError(f"model: expected a Llama-family causal LM (.model.layers, .model.norm, .lm_head), "
                        f"got {type(model).__name__}")
    return inner, layers


BLOCK_UNITS = ("auto", "all")


UNIT_MIN_PARAMS = 16_000_000  # ~32 MB of bf16 per gather: NCCL at bus speed, host cost spread over a few blocks


def _unit_groups(blocks, blocks_per_unit):
    """Consecutive runs of blocks, one FSDP2 unit each: ``blocks_per_unit`` blocks, or for "auto" as many as
    reach ``UNIT_MIN_PARAMS`` parameters (a shorter last group joins the one before it)."""
    groups, current, size = [], [], 0
    for block in blocks:
        current.append(block)
        size += sum(p.numel() for p in block.parameters())
        full = len(current) >= blocks_per_unit if blocks_per_unit != "auto" else size >= UNIT_MIN_PARAMS
        if full:
            groups.append(current)
            current, size = [], 0
    if current:
        if groups and blocks_per_unit == "auto":
            groups[-1].extend(current)
        else:
            groups.append(current)
    return groups


def _holds_weight_matrix(block: torch.nn.Module) -> bool:
    """Whether a block keeps a weight matrix (trainable or frozen) as a parameter, i.e. has bytes worth sharding.
    A NeuZip-compressed block keeps its matrices outside the parameters; only its norm vectors remain."""
    return any(p.ndim >= 2 for p in block.parameters())


def shard_model(model: torch.nn.Module, mesh: Optional[DeviceMesh] = None, *,
                mixed_precision_enabled: Optional[bool] = None, prefetch: int = 1,
                block_units: str = "auto", blocks_per_unit="auto") -> torch.nn.Module:
    """Applies FSDP2 in place and returns the model: one unit per group of consecutive decoder blocks
    (resharded after forward), the tail ``[final norm, lm_head]`` as one unit kept unsharded from forward to its backward (the loss reads
    ``lm_head.weight`` right after the norm ran, so it sees the all-gathered weight: no extra gather), and the
    root (embeddings; with tied embeddings the head too, since one parameter cannot live in two units).

    ``prefetch``: in forward, each unit (the root, then every block) issues the all-gathers of the next
    ``prefetch`` units in its pre-forward hook, before its own compute is queued (FSDP2's explicit forward
    prefetch, as torchtitan sets it). 0 leaves FSDP2's implicit order: the next unit's all-gather is issued
    only when the host reaches that unit, so it overlaps compute only while the host runs ahead of the GPU
    (a host-heavy layer such as BitLinear's quantizers narrows that window). Backward keeps FSDP2's own
    one-unit prefetch.

    ``block_units``: "auto" (default) gives a block its own unit only if it holds a weight matrix as a
    parameter; a block with only vectors (norm weights: a NeuZip-compressed block) joins the root unit. A unit
    costs three collectives per step (forward and backward all-gather, reduce-scatter), each a rendezvous of
    all ranks: for a few KiB of norm weights it is waiting, not sharding (NeuZip 1b on 2 H200s, a305afd: 48 such
    collectives, 41-46 ms of exposed NCCL in a 136 ms step for < 1 ms of bytes). "all": every block its own
    unit (the layout before).

    ``blocks_per_unit``: how many consecutive (weight-holding) blocks share one unit. "auto" groups blocks until a
    unit holds at least ``UNIT_MIN_PARAMS`` parameters (one block per unit for blocks that large, e.g. a 1B
    model's; 5 blocks of SmolLM2-135M's 3.5M). Each unit costs host time every step (hooks, copy-in/out of its
    gathers, three collective launches) whatever its size: the 135m step on one H200 is host-bound (GPU busy 53
    of ~220 ms) and 30 one-block units added 80-130 ms per step on 2 GPUs (2fcb084), while their bytes are
    ~7 MB per gather. An int sets the group size (1: a unit per block).

    Works for :class:`thrifty.models.LlamaForCausalLM` and transformers Llama-family ``*ForCausalLM``. The
    model must already be on this rank's device; ``mesh`` defaults to all ranks.
    """
    check_positive_int("prefetch", prefetch, allow_zero=True)
    check_choice("block_units", block_units, BLOCK_UNITS)
    if blocks_per_unit != "auto":
        if isinstance(blocks_per_unit, bool) or not isinstance(blocks_per_unit, int):
            raise TypeError(f"blocks_per_unit: expected 'auto' or an int >= 1, got {blocks_per_unit!r}")
        check_positive_int("blocks_per_unit", blocks_per_unit)
    inner, layers = _blocks(model)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("model: already sharded with fully_shard")
    device = next(model.parameters()).device
    mesh = mesh if mesh is not None else data_parallel_mesh(device)
    mp = mixed_precision(device, mixed_precision_enabled)
    units = []
    sharded = [b for b in layers if block_units == "all" or _holds_weight_matrix(b)]  # the rest stays in the root
    for group in _unit_groups(sharded, blocks_per_unit):
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=mp)
        units.append(group[0])  # a grouped unit's forward starts at its first block
    if model.lm_head.weight is not inner.embed_tokens.weight:
        fully_shard([inner.norm, model.lm_head], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        units.append(inner.norm)  # the tail's forward starts at the norm
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if prefetch:
        for i, unit in enumerate([model] + units[:-1]):
            unit.set_modules_to_forward_prefetch(units[i:i + prefetch])
    model.thrifty_mesh = mesh  # read by the Trainer (rank data, means, sharded checkpoints)
    return model


def mesh_of(model: torch.nn.Module) -> Optional[DeviceMesh]:
    """The data-parallel mesh of a model sharded by :func:`shard_model`, else None."""
    return getattr(model, "thrifty_mesh", None)


# ----------------------------------------------------------------------------------------------- data and means

class RankData:
    """Each rank's share of a dataset: ``batch(b, T, generator)`` draws the global batch of ``world * b``
    windows from the generator (identical on every rank) and keeps this rank's ``b`` rows, so the ranks read
    distinct windows and N ranks x b rows see exactly the windows of one process with N x b rows.

    ``iter_eval_batches`` splits each global evaluation batch into equal row slices; a short last batch loses
    its ``rows mod world`` trailing rows (every rank must run the same forwards: FSDP2 gathers in each)."""

    def __init__(self, data, rank: int, world: int):
        check_positive_int("world", world)
        check_positive_int("rank", rank, allow_zero=True)
        if not 0 <= rank < world:
            raise ValueError(f"rank: expected a value in [0, {world}), got {rank}")
        self.data, self.rank, self.world = data, rank, world

    def batch(self, batch_size, seq_len, generator=None):
        inputs, labels = self.data.batch(batch_size * self.world, seq_len, generator=generator)
        rows = slice(self.rank * batch_size, (self.rank + 1) * batch_size)
        return inputs[rows], labels[rows]

    def iter_eval_batches(self, batch_size, seq_len, max_batches=None):
        for inputs, labels in self.data.iter_eval_batches(batch_size * self.world, seq_len, max_batches):
            per_rank = inputs.shape[0] // self.world
            if per_rank == 0:
                return
            rows = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
            yield inputs[rows], labels[rows]


def rank_data(data, mesh: DeviceMesh):
    """``data`` wrapped as :class:`RankData` for this rank of ``mesh`` (None stays None; no double wrapping)."""
    if data is None or isinstance(data, RankData):
        return data
    return RankData(data, mesh.get_local_rank(), mesh.size())


def mean_over_ranks(value, mesh: DeviceMesh) -> float:
    """The mean of a per-rank scalar over the mesh (each rank's loss is a mean over its equal share)."""
    t = torch.as_tensor(value, dtype=torch.float64).reshape(1)
    device = "cuda" if mesh.device_type == "cuda" else "cpu"
    t = t.to(device)
    dist.all_reduce(t, group=mesh.get_group())
    return float(t) / mesh.size()
