"""A small trainer for the reference model: AdamW, warm-up + cosine schedule, gradient clipping, bf16 autocast
on GPU, evaluation perplexity, safetensors checkpoints (model, optimizer, trainer state; never pickle).

Data is any object with ``batch(batch_size, seq_len, generator) -> (inputs, labels)`` (labels aligned to
inputs, i.e. already shifted) and ``iter_eval_batches(batch_size, seq_len, max_batches)``, as
:class:`thrifty.data.TokenDataset` provides.

Several GPUs: under ``torchrun``, shard the model with :func:`thrifty.parallel.shard_model` (FSDP2) first; the
trainer then gives each rank its rows of every batch, averages losses over ranks and writes sharded
checkpoints (thrifty/parallel/NOTES.md). ``batch_size`` is per rank.

One GPU, ``TrainConfig(cuda_graph=True)``: the whole step (forward, backward, clipping, AdamW) replays as one
CUDA graph, so the host's Python and kernel launches stop setting the step time (see :class:`Trainer`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from ._checks import check_bool, check_choice, check_positive_int, check_range, check_token_ids
from ._graphs import capture

# Eager steps before a capture (PyTorch's whole-network recipe runs a few): Triton compiles, cuBLAS workspaces and
# the optimizer's lazily built state all happen outside the graph. They are real training steps.
CUDA_GRAPH_WARMUP_STEPS = 3


@dataclass
class TrainConfig:
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 256
    grad_accum: int = 1
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 0          # 0: only at the end
    eval_batches: int = 8
    checkpoint_every: int = 0    # 0: only at the end, when checkpoint_dir is set
    checkpoint_dir: Optional[str] = None
    autocast: str = "auto"       # "auto" = bf16 on CUDA, fp32 elsewhere; or "bf16" / "none"
    seed: int = 0
    cuda_graph: bool = False     # the step as one captured CUDA graph (one GPU; see Trainer)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_batches"):
            check_positive_int(name, getattr(self, name))
        for name in ("warmup_steps", "eval_every", "checkpoint_every"):
            check_positive_int(name, getattr(self, name), allow_zero=True)
        check_range("lr", self.lr, 0.0, 1.0, lo_open=True)
        check_range("min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_range("weight_decay", self.weight_decay, 0.0, 10.0)
        check_range("grad_clip", self.grad_clip, 0.0, 1e9)
        check_choice("autocast", self.autocast, ("auto", "bf16", "none"))
        check_bool("cuda_graph", self.cuda_graph)
        _check_config_extras(self)


def _check_config_extras(cfg: "TrainConfig") -> None:
    """The fields the first checks do not cover: AdamW's betas, the seed, the folder, ``extra``."""
    if not isinstance(cfg.betas, (tuple, list)) or len(cfg.betas) != 2:
        raise ValueError(f"betas: expected a pair (beta1, beta2), got {cfg.betas!r}")
    for i, b in enumerate(cfg.betas):
        check_range(f"betas[{i}]", b, 0.0, 1.0, hi_open=True)
    check_positive_int("seed", cfg.seed, allow_zero=True)
    if cfg.checkpoint_dir is not None and not isinstance(cfg.checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir: expected None or a path, got {type(cfg.checkpoint_dir).__name__}")
    if not isinstance(cfg.extra, dict):
        raise TypeError(f"extra: expected a dict, got {type(cfg.extra).__name__}")


def _state_crc(state: dict) -> int:
    """CRC32 of the trainer state's canonical JSON (a flipped digit in "step" would otherwise load silently)."""
    import zlib

    return zlib.crc32(json.dumps(state, sort_keys=True).encode())


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """AdamW training of ``model`` on ``train_data``; :meth:`fit` runs ``config.steps`` steps.

    **CUDA-graph step** (``TrainConfig(cuda_graph=True)``, model on one GPU): the first
    ``CUDA_GRAPH_WARMUP_STEPS`` steps run eagerly on a side stream, then the step (forward + loss + backward of
    every micro-batch, gradient clipping, AdamW) is captured once with ``torch.cuda.graph`` and replayed: each step
    the host only draws the batches, checks their ids, copies them into the graph's input buffers, writes the
    learning rate into a GPU tensor and replays. The eager step of the 30m preset is host-bound on the H200 (host
    44 ms fp / 67 ms a4.8 vs GPU busy 25.5 / 28.4 ms per step), so its step-time ratios follow the host CPU; the
    graph's follow the GPU. Same kernels as the eager step, so the same losses (the learning rate is read as fp32;
    the eager kernel takes it in fp64). ``last_step_path`` says which ran ("eager" or "cuda_graph").

    What a graph bakes in and how it stays right:

    * AdamW is fused and capturable (step counters on the GPU) with a tensor learning rate per group, refilled
      before each replay; the gradients are the graph's own buffers (they hold the last step's after a replay).
    * The model skips its value checks under capture (a host sync cannot be captured); the trainer checks each
      batch's shape and ids on the host before copying it in.
    * A recapture (after fresh warm-up steps) follows any change of the optimizer's other hyper-parameters (weight
      decay, betas, ...), of the batch geometry or clipping in the config, of ``schedule.graph_key(step, config)``
      (a schedule must have one with ``cuda_graph``: TwoStageSchedule's is its recipe, so the b1.58 → a4.8 switch
      recaptures) and :meth:`load_checkpoint` (new optimizer state tensors). Anything else changed by hand between
      steps that the graph baked in (BitLinear settings, ``set_strength``, swapped seams): call
      :meth:`reset_cuda_graph`.
    * Refused with a ValueError: a model not on CUDA, a sharded (FSDP2) model, a model without
      ``config.vocab_size`` (the ids check needs it), a schedule without ``graph_key``.
    """

    def __init__(self, model: torch.nn.Module, train_data, val_data=None, config: Optional[TrainConfig] = None,
                 schedule=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if not hasattr(train_data, "batch"):
            raise TypeError(f"train_data: expected an object with .batch(batch_size, seq_len, generator), "
                            f"got {type(train_data).__name__}")
        if config is not None and not isinstance(config, TrainConfig):
            raise TypeError(f"config: expected a TrainConfig, got {type(config).__name__}")
        if next(model.parameters(), None) is None:
            raise ValueError("model: has no parameters to train")
        self.mesh = getattr(model, "thrifty_mesh", None)  # set by thrifty.parallel.shard_model (FSDP2)
        if self.mesh is not None:  # each rank reads its own rows of every global batch
            from .parallel import rank_data
            train_data, val_data = rank_data(train_data, self.mesh), rank_data(val_data, self.mesh)
        self.model, self.train_data, self.val_data = model, train_data, val_data
        self.cfg = config or TrainConfig()
        self.device = next(model.parameters()).device
        # optional: an object whose apply(trainer) sets the model/optimizer state of self.step and returns the LR
        # (thrifty.bitnet.TwoStageSchedule: recipe switch and weight decay per stage)
        self.schedule = schedule
        if self.cfg.cuda_graph:
            self._check_cuda_graph_possible()
        self.optimizer = self._make_optimizer()
        self.step = 0
        self.tokens_seen = 0
        self.history: list[dict] = []
        self.generator = torch.Generator().manual_seed(self.cfg.seed)
        self.last_step_path: Optional[str] = None  # "eager" or "cuda_graph": how the last train_step ran
        self._graph = _GraphedStep(self) if self.cfg.cuda_graph else None

    def _check_cuda_graph_possible(self) -> None:
        """cuda_graph=True where a captured step would be impossible or wrong: refused, never run eagerly instead."""
        if self.mesh is not None:
            raise ValueError("cuda_graph: a sharded model (thrifty.parallel.shard_model, FSDP2) is not supported; "
                             "set cuda_graph=False")
        if _vocab_size(self.model) is None:
            raise ValueError("cuda_graph: the model has no config.vocab_size; the trainer checks each batch's ids "
                             "against it on the host (inside a graph an id out of range would fault the GPU)")
        if self.schedule is not None and not callable(getattr(self.schedule, "graph_key", None)):
            raise ValueError("schedule: with cuda_graph=True a schedule needs graph_key(step, config), a value that "
                             "changes whenever apply() changes the model (the trainer then recaptures the step); "
                             f"{type(self.schedule).__name__} has none")
        if self.device.type != "cuda" or any(p.device != self.device for p in self.model.parameters()):
            raise ValueError(f"cuda_graph: needs every parameter on one CUDA device, got the model on {self.device}; "
                             "set cuda_graph=False")

    def _make_optimizer(self):
        # decay matrices only; norms (1-D) keep their scale
        decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        if not self.cfg.cuda_graph:
            fused = self.device.type == "cuda"
            return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=self.cfg.betas, fused=fused)
        # a replay runs the captured kernels with their captured arguments: the learning rate must be read from
        # GPU memory (a tensor per group, refilled before each replay; fp32, what the fused kernel reads), and the
        # step counters must live on the GPU (capturable)
        for group in groups:
            group["lr"] = torch.tensor(self.cfg.lr, dtype=torch.float32, device=self.device)
        optimizer = torch.optim.AdamW(groups, lr=self.cfg.lr, betas=self.cfg.betas, fused=True, capturable=True)
        optimizer._warned_capturable_if_run_uncaptured = True  # the warm-up steps run uncaptured on purpose
        return optimizer

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # in place: a captured step reads this memory
            else:
                group["lr"] = lr

    def _autocast(self):
        use = self.cfg.autocast == "bf16" or (self.cfg.autocast == "auto" and self.device.type == "cuda")
        # no cast cache with graphs (as torch.cuda.make_graphed_callables demands): the same values, recast per use
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use,
                              cache_enabled=not self.cfg.cuda_graph)

    def train_step(self) -> dict:
        cfg = self.cfg
        self.model.train()
        lr = self.schedule.apply(self) if self.schedule is not None else lr_at(self.step, cfg)
        self._set_lr(lr)
        batches = [self.train_data.batch(cfg.batch_size, cfg.seq_len, generator=self.generator)
                   for _ in range(cfg.grad_accum)]
        total, norm = self._graph.step(batches) if self._graph is not None else self._eager_step(batches)
        self.step += 1
        self.tokens_seen += cfg.grad_accum * cfg.batch_size * cfg.seq_len * (self.mesh.size() if self.mesh else 1)
        return {"step": self.step, "loss": self._mean(total), "grad_norm": float(norm), "lr": lr}

    def _eager_step(self, batches):
        total, norm = self._update(batches)
        self.optimizer.zero_grad(set_to_none=True)
        self.last_step_path = "eager"
        return total, norm

    def _update(self, batches):
        """Forward + backward of every micro-batch, gradient clipping, AdamW: the step a CUDA graph captures (no
        host sync: ``clip_grad_norm_`` without ``error_if_nonfinite``). Returns (the summed micro-batch losses, the
        gradient norm) as device tensors; the gradients are left for the caller."""
        total = None
        for inputs, labels in batches:
            inputs, labels = inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
            with self._autocast():
                loss = self._loss(inputs, labels) / self.cfg.grad_accum
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip or float("inf"))
        self.optimizer.step()
        return total, norm

    def reset_cuda_graph(self) -> None:
        """Drops the captured step (``cuda_graph``): the next steps warm up eagerly and capture again. Call it after
        changing by hand anything the graph baked in (BitLinear settings, ``set_strength``, a swapped seam)."""
        if self._graph is not None:
            self._graph.reset()

    def _graph_key(self) -> tuple:
        """What a captured step bakes in besides the tensors it reads, and may change between steps: the
        optimizer's hyper-parameters but the learning rate (Python numbers the fused AdamW kernel gets as
        arguments), the config's batch geometry and clipping, and the schedule's ``graph_key`` (the module
        settings its apply() chose, e.g. TwoStageSchedule's recipe). A change recaptures."""
        cfg = self.cfg
        groups = tuple((g["weight_decay"], tuple(g["betas"]), g["eps"], g["amsgrad"], g["maximize"])
                       for g in self.optimizer.param_groups)
        stage = self.schedule.graph_key(self.step, cfg) if self.schedule is not None else None
        return groups, stage, (cfg.batch_size, cfg.seq_len, cfg.grad_accum, cfg.grad_clip, cfg.autocast)

    @torch.no_grad()
    def evaluate(self, data=None, max_batches: Optional[int] = None) -> dict:
        """Mean token loss and perplexity over the validation split, read in order (deterministic)."""
        data = data if data is not None else self.val_data
        if data is None:
            raise ValueError("data: no validation data given to the Trainer or to evaluate()")
        if self.mesh is not None:
            from .parallel import rank_data
            data = rank_data(data, self.mesh)
        self.model.eval()
        losses = []
        for inputs, labels in data.iter_eval_batches(self.cfg.batch_size, self.cfg.seq_len,
                                                    max_batches or self.cfg.eval_batches):
            with self._autocast():
                losses.append(float(self._loss(inputs.to(self.device), labels.to(self.device))))
        if not losses:
            raise ValueError("data: iter_eval_batches yielded no batch (validation split too short?)")
        loss = self._mean(sum(losses) / len(losses))
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_batches": len(losses)}

    def fit(self, progress: bool = True) -> list[dict]:
        cfg = self.cfg
        # redrawn ~10 times a second on a terminal; every 30 s in a log file (a redraw there is a new line)
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not progress, desc="train", unit="step",
                   mininterval=0.1 if sys.stderr.isatty() else 30.0)
        start, start_tokens = time.perf_counter(), self.tokens_seen
        while self.step < cfg.steps:
            row = self.train_step()
            row["tokens_per_s"] = (self.tokens_seen - start_tokens) / (time.perf_counter() - start)
            last = self.step == cfg.steps
            if self.val_data is not None and ((cfg.eval_every and self.step % cfg.eval_every == 0) or last):
                row.update(self.evaluate())
            if cfg.checkpoint_dir and ((cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or last):
                self.save_checkpoint(cfg.checkpoint_dir)
            self.history.append(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.2e}")
            bar.update(1)
        bar.close()
        return self.history

    # ------------------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path) -> Path:
        """model.safetensors (+config.json), optimizer.safetensors, trainer_state.json."""
        from safetensors.torch import save_file

        from ._io import atomic_path, crc_metadata

        path = Path(path)
        if path.exists() and not path.is_dir():
            raise ValueError(f"path: {path} is a file; a checkpoint is a folder")
        if self.mesh is not None:
            return self._save_sharded(path)
        if hasattr(self.model, "save_pretrained"):
            self.model.save_pretrained(path)
        else:
            path.mkdir(parents=True, exist_ok=True)
            state = {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}
            with atomic_path(path / "model.safetensors") as tmp:
                save_file(state, str(tmp), metadata=crc_metadata(state))
        names = {id(p): n for n, p in self.model.named_parameters()}
        opt = {}
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                opt[f"{names[id(p)]}::{key}"] = value.detach().contiguous().cpu().reshape(value.shape)
        with atomic_path(path / "optimizer.safetensors") as tmp:
            save_file(opt, str(tmp), metadata=crc_metadata(opt))
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "config": asdict(self.cfg),
                 "generator_state": self.generator.get_state().tolist(), "history": self.history}
        state = json.loads(json.dumps(state, default=str))  # default=str: a Path in the config
        state["crc32"] = _state_crc(state)
        with atomic_path(path / "trainer_state.json") as tmp:
            tmp.write_text(json.dumps(state))
        return path

    def load_checkpoint(self, path) -> None:
        """Restores model weights, optimizer moments and the step counter from :meth:`save_checkpoint`.

        Every file is read and checked first (present, parseable, names, shapes and dtypes matching this
        model and optimizer); only then is anything changed, so a damaged checkpoint leaves the trainer as it
        was. Errors are ValueError naming the file."""
        from .parallel.checkpoint import is_sharded_checkpoint

        if is_sharded_checkpoint(Path(path)):
            return self._load_sharded(Path(path))
        weights, opt, meta, gen_state = self._read_checkpoint(Path(path))
        self.model.load_state_dict(weights, strict=False)
        params = dict(self.model.named_parameters())
        for key, value in opt.items():
            name, field_name = key.split("::")
            state = self.optimizer.state[params[name]]
            state[field_name] = value.cpu() if field_name == "step" and not self.optimizer.defaults.get("fused") \
                else value
        self.step, self.tokens_seen, self.history = meta["step"], meta["tokens_seen"], meta["history"]
        self.generator.set_state(gen_state)
        self.reset_cuda_graph()  # the optimizer's state tensors are new: a captured step reads the old ones

    def _read_checkpoint(self, path: Path):
        """(weights, optimizer state, trainer state, generator state), all checked; touches nothing."""
        from ._io import check_state_matches, read_json, read_safetensors

        if not path.is_dir():
            raise ValueError(f"path: {path} is not a folder; not a thrifty checkpoint")
        for name in ("model.safetensors", "optimizer.safetensors", "trainer_state.json"):
            if not (path / name).is_file():
                raise ValueError(f"path: {path} has no {name}; not a thrifty checkpoint")
        meta = read_json(path / "trainer_state.json", "trainer state")
        where = path / "trainer_state.json"
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: corrupted trainer state (not a JSON object)")
        if "crc32" in meta and meta["crc32"] != _state_crc({k: v for k, v in meta.items() if k != "crc32"}):
            raise ValueError(f"{where}: checksum mismatch (file corrupted)")
        for key, kind in (("step", int), ("tokens_seen", int), ("history", list), ("generator_state", list)):
            if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
                raise ValueError(f"{where}: corrupted trainer state ({key!r} missing or not a {kind.__name__})")
        if meta["step"] < 0 or meta["tokens_seen"] < 0:
            raise ValueError(f"{where}: corrupted trainer state (negative step or token count)")
        try:
            gen_state = torch.tensor(meta["generator_state"], dtype=torch.uint8)
            torch.Generator().set_state(gen_state)  # on a scratch generator: is the state usable?
        except (TypeError, ValueError, RuntimeError, OverflowError) as err:
            raise ValueError(f"{where}: corrupted generator state ({err})") from None
        expected = {k: v for k, v in self.model.state_dict().items()}
        weights = read_safetensors(path / "model.safetensors", self.device)
        tied = getattr(getattr(self.model, "config", None), "tie_word_embeddings", False)
        check_state_matches(path / "model.safetensors", weights, expected,
                            optional=("lm_head.weight",) if tied else ())
        opt = read_safetensors(path / "optimizer.safetensors", self.device)
        params = dict(self.model.named_parameters())
        for key, value in opt.items():
            name, _, field_name = key.partition("::")
            p = params.get(name)
            ok = p is not None and (value.ndim == 0 if field_name == "step" else
                                    field_name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
                                    and value.shape == p.shape and value.dtype == p.dtype)
            if not ok:
                raise ValueError(f"{path / 'optimizer.safetensors'}: entry {key!r} "
                                 f"({value.dtype} {tuple(value.shape)}) does not match this model's optimizer")
        return weights, opt, meta, gen_state

    def _loss(self, inputs, labels):
        """The model's mean token loss. A transformers model gets the (already shifted) labels as
        ``shift_labels``, so it does not shift them again."""
        if hasattr(getattr(self.model, "config", None), "to_json_string"):
            labels = labels.contiguous()  # HF views the labels flat
            return self.model(input_ids=inputs, labels=labels, shift_labels=labels).loss
        return self.model(inputs, labels=labels)

    # ------------------------------------------------------------------------------------- several ranks (FSDP2)

    def _mean(self, value) -> float:
        """A per-rank mean as the mean over all ranks (each rank averages an equal share of the batch)."""
        if self.mesh is None:
            return float(value)
        from .parallel import mean_over_ranks
        return mean_over_ranks(value, self.mesh)

    def _save_sharded(self, path: Path) -> Path:
        """Per-rank safetensors shards + index (thrifty.parallel.checkpoint); loads on any number of ranks."""
        from .parallel import save_sharded

        state = {"step": self.step, "tokens_seen": self.tokens_seen, "config": asdict(self.cfg),
                 "generator_state": self.generator.get_state().tolist(), "history": self.history}
        extra = {"trainer_state.json": json.dumps(state)}
        config = getattr(self.model, "config", None)
        if hasattr(config, "to_hf"):
            extra["config.json"] = json.dumps(config.to_hf(), indent=1)
        elif hasattr(config, "to_json_string"):
            extra["config.json"] = config.to_json_string()
        return save_sharded(path, self.model, self.optimizer, rank=self.mesh.get_local_rank(),
                            world=self.mesh.size(), extra_files=extra)

    def _load_sharded(self, path: Path) -> None:
        from .parallel import load_sharded

        if not (path / "trainer_state.json").is_file():
            raise ValueError(f"path: {path} has no trainer_state.json; not a thrifty checkpoint")
        meta = json.loads((path / "trainer_state.json").read_text())
        load_sharded(path, self.model, self.optimizer)
        self.step, self.tokens_seen, self.history = meta["step"], meta["tokens_seen"], meta["history"]
        self.generator.set_state(torch.tensor(meta["generator_state"], dtype=torch.uint8))


# ------------------------------------------------------------------------------------------ CUDA-graph step

def _vocab_size(model) -> Optional[int]:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


class _GraphedStep:
    """The trainer's step as one CUDA graph (PyTorch's "whole-network capture", torch.cuda docs "CUDA Graphs"):
    warm-up steps run eagerly on a side stream, then :meth:`Trainer._update` on static input buffers is captured
    once and replayed every step. :meth:`reset` (a changed :meth:`Trainer._graph_key`, a loaded checkpoint) starts
    over with warm-up steps."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.stream = torch.cuda.Stream(trainer.device) if trainer.device.type == "cuda" else None
        self.key = None
        self.reset()

    def reset(self) -> None:
        self.graph = None
        self.inputs: list[tuple] = []  # (inputs, labels) buffers on the GPU, one pair per micro-batch
        self.outputs = None  # (summed loss, grad norm): tensors the replay rewrites
        self.warmup_left = CUDA_GRAPH_WARMUP_STEPS
        # the captured backward writes the gradients into buffers of its own: none may exist when it is recorded
        self.trainer.optimizer.zero_grad(set_to_none=True)

    def step(self, batches: list) -> tuple:
        """(summed loss, grad norm) of one training step on ``batches`` (CPU or GPU tensors)."""
        key = self.trainer._graph_key()
        if key != self.key:
            self.reset()
            self.key = key
        self._check(batches)
        if self.warmup_left > 0:
            self.warmup_left -= 1
            with self._on_side_stream():
                return self.trainer._eager_step(batches)
        if self.graph is None:
            self._capture(batches)
        for buffers, batch in zip(self.inputs, batches):
            for buffer, values in zip(buffers, batch):
                buffer.copy_(values, non_blocking=True)
        self.graph.replay()
        self.trainer.last_step_path = "cuda_graph"
        return self.outputs

    def _check(self, batches: list) -> None:
        """What the model checks eagerly and skips under capture, here on the host before the copy: a replay
        reads buffers of the captured shape, and an id out of range would fault inside the graph."""
        cfg, vocab = self.trainer.cfg, _vocab_size(self.trainer.model)
        for inputs, labels in batches:
            for name, t in (("inputs", inputs), ("labels", labels)):
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != (cfg.batch_size, cfg.seq_len):
                    got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"train_data: batch {name} {got}, cuda_graph replays shape "
                                     f"({cfg.batch_size}, {cfg.seq_len}) (batch_size, seq_len)")
                if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                    raise TypeError(f"train_data: batch {name} of dtype {t.dtype}, expected integer token ids")
            check_token_ids("train_data: batch inputs", inputs, vocab)

    @contextlib.contextmanager
    def _on_side_stream(self):
        """Warm-up steps on the side stream the capture uses, as PyTorch's recipe does (lazy per-stream set-up such
        as cuBLAS workspaces happens there, outside the graph). The main stream waits for them before going on."""
        if self.stream is None:  # a CPU stand-in for a graph (tests only: __init__ refuses a CPU model)
            yield
            return
        main = torch.cuda.current_stream(self.trainer.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            yield
        main.wait_stream(self.stream)

    def _capture(self, batches: list) -> None:
        t = self.trainer
        self.inputs = [tuple(torch.empty(x.shape, dtype=x.dtype, device=t.device) for x in batch)
                       for batch in batches]
        t.optimizer.zero_grad(set_to_none=True)
        try:
            self.graph, self.outputs = self._record(lambda: t._update(self.inputs))
        except Exception as err:
            self.graph = None
            raise RuntimeError(
                f"cuda_graph: capturing the training step failed ({type(err).__name__}: {err}). A host sync "
                "(.item(), int(tensor), .cpu(), a data-dependent shape) in the model's forward or backward cannot be "
                "captured; remove it or set cuda_graph=False") from err

    def _record(self, fn):
        """(graph, fn's outputs): ``fn`` captured on the side stream, not run."""
        return capture(fn, warmup=0, stream=self.stream)
