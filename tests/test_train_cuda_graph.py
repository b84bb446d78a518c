"""TrainConfig(cuda_graph=True): the training step as one captured CUDA graph.

On the CPU: the refusals, the captured step's freedom from host syncs (a TorchDispatchMode sees every
``.item()``), the RoPE values of the capture path, and the trainer's graph plumbing (static buffers, learning rate
tensor, warm-up, recapture, checkpoints) with a stand-in graph that re-runs the recorded step on replay. On the
GPU (``cuda`` mark, scripts/gpu_tests.sh): real capture and replay against the eager step."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_train import WindowData, tiny_model
from thrifty import bitnet
from thrifty.models import LlamaForCausalLM, preset
from thrifty.train import CUDA_GRAPH_WARMUP_STEPS, Trainer, TrainConfig, _GraphedStep

# lrs exactly representable in fp32: the graph's fused AdamW reads the lr as fp32, the eager one gets the fp64
# Python float, so only such lrs give the same update bit for bit. Warm-up of 8: the lr changes every step.
LR_CFG = dict(lr=2.0 ** -7, warmup_steps=8, min_lr_ratio=1.0)


@pytest.fixture
def data():
    text = ("The kernel schedules processes and manages memory. Drivers talk to hardware devices. " * 40).encode()
    return WindowData(torch.tensor(list(text)) % 64)


class StandInGraph:
    """A CPU stand-in for a captured step: replay re-runs the recorded step on the same static buffers and writes
    the results into the same output tensors; the recorded backward wrote fresh gradients, so they are dropped
    first (a real replay overwrites its gradient buffers)."""

    def __init__(self, trainer, fn):
        self.trainer, self.fn = trainer, fn
        self.outputs = (torch.zeros(()), torch.zeros(()))
        self.replays = 0

    def replay(self):
        self.trainer.optimizer.zero_grad(set_to_none=True)
        for out, value in zip(self.outputs, self.fn()):
            out.copy_(value)
        self.replays += 1


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """Trainers accept a CPU model with cuda_graph=True and record StandInGraphs (listed in the returned list)."""
    recorded = []

    def record(self, fn):
        graph = StandInGraph(self.trainer, fn)
        recorded.append(graph)
        return graph, graph.outputs

    monkeypatch.setattr(Trainer, "_check_cuda_graph_possible", lambda self: None)
    monkeypatch.setattr(_GraphedStep, "_record", record)
    return recorded


# ----------------------------------------------------------------------------------------------- refusals

def test_cuda_graph_field_is_checked():
    with pytest.raises(TypeError, match="cuda_graph"):
        TrainConfig(cuda_graph=1)


def test_cuda_graph_refuses_a_cpu_model(data):
    with pytest.raises(ValueError, match="cuda_graph: needs every parameter on one CUDA device"):
        Trainer(tiny_model(), data, None, TrainConfig(cuda_graph=True))


def test_cuda_graph_refuses_a_sharded_model(data):
    class OneRankMesh:  # what Trainer reads of a DeviceMesh before the check
        def get_local_rank(self):
            return 0

        def size(self):
            return 1

    model = tiny_model()
    model.thrifty_mesh = OneRankMesh()
    with pytest.raises(ValueError, match="cuda_graph: a sharded model"):
        Trainer(model, data, None, TrainConfig(cuda_graph=True))


def test_cuda_graph_refuses_a_schedule_without_graph_key(data):
    class LrOnly:
        def apply(self, trainer):
            return 1e-3

    with pytest.raises(ValueError, match="schedule: with cuda_graph=True"):
        Trainer(tiny_model(), data, None, TrainConfig(cuda_graph=True), schedule=LrOnly())


def test_cuda_graph_refuses_a_model_without_vocab_size(data):
    model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
    with pytest.raises(ValueError, match="config.vocab_size"):
        Trainer(model, data, None, TrainConfig(cuda_graph=True))


# ----------------------------------------------------------------------------------------------- capture safety

class HostSyncs(TorchDispatchMode):
    """Records the ops that make the host wait for the GPU (or have a data-dependent shape): none may be captured."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in self.SYNCING):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["fp", "b1.58", "a4.8"])
def test_captured_step_has_no_host_sync(monkeypatch, recipe):
    """Trainer._update (forward, loss, backward, clipping) as a capture sees it: no .item(), no data-dependent
    shape. The optimizer's step is left out: on the CPU it reads its tensor lr with .item(), on CUDA (fused,
    capturable) from device memory. BitNet on the CPU takes the reference quantizers; the kernels' launchers only
    do shape arithmetic on the host."""
    import thrifty.models.llama as llama

    model = LlamaForCausalLM(preset("tiny", vocab_size=256)).init_weights(seed=0)
    if recipe != "fp":
        bitnet.convert(model, bitnet.BitNetConfig(recipe=recipe, impl="reference"))
    trainer = Trainer(model, WindowData(torch.arange(4096) % 256), None, TrainConfig(batch_size=2, seq_len=8))
    monkeypatch.setattr(trainer.optimizer, "step", lambda: None)
    batches = [trainer.train_data.batch(2, 8, generator=trainer.generator)]
    with HostSyncs() as eager:  # the detector sees the model's value checks when not capturing
        trainer._update(batches)
    assert "aten._local_scalar_dense.default" in eager.seen
    monkeypatch.setattr(llama, "_capturing", lambda: True)
    with HostSyncs() as captured:
        trainer._update(batches)
    assert captured.seen == []


@pytest.mark.parametrize("shape", [(7,), (3, 7)])
def test_capture_rope_matches_the_table(shape):
    """Under capture RoPE computes cos/sin at the positions (no host read of the largest position): the values
    of the table rows, bit for bit."""
    rope = LlamaForCausalLM(preset("tiny", vocab_size=64)).model.rotary
    positions = torch.randint(0, 900, shape)
    cos, sin = rope._direct_cos_sin(positions)
    rope._last = None
    want_cos, want_sin = rope.cos_sin(positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


# ----------------------------------------------------------------------------------------------- plumbing (CPU)

@pytest.mark.parametrize("grad_accum", [1, 2])
def test_graph_plumbing_matches_eager(data, stand_in_graphs, grad_accum):
    """Warm-up steps eager, then one capture and replays: new batches and the changing lr reach the recorded
    step through the static buffers, so the losses follow the eager trainer's."""
    cfg = dict(steps=10, batch_size=4, seq_len=16, grad_accum=grad_accum, **LR_CFG)
    eager = Trainer(tiny_model(), data, None, TrainConfig(**cfg))
    graphed = Trainer(tiny_model(), data, None, TrainConfig(**cfg, cuda_graph=True))
    paths, losses = [], []
    for _ in range(7):
        a, b = eager.train_step(), graphed.train_step()
        # the eager CPU AdamW is the for-each one, the graph's the fused one: the weights drift by float rounding
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["lr"] == a["lr"]
        paths.append(graphed.last_step_path)
        losses.append(b["loss"])
    assert paths == ["eager"] * CUDA_GRAPH_WARMUP_STEPS + ["cuda_graph"] * (7 - CUDA_GRAPH_WARMUP_STEPS)
    assert len(stand_in_graphs) == 1 and stand_in_graphs[0].replays == 7 - CUDA_GRAPH_WARMUP_STEPS
    assert len(set(losses)) == len(losses)
    assert all(isinstance(g["lr"], torch.Tensor) for g in graphed.optimizer.param_groups)


def test_graph_recaptures_when_weight_decay_changes(data, stand_in_graphs):
    trainer = Trainer(tiny_model(), data, None, TrainConfig(steps=20, batch_size=2, seq_len=8, cuda_graph=True))
    for _ in range(CUDA_GRAPH_WARMUP_STEPS + 2):
        trainer.train_step()
    assert len(stand_in_graphs) == 1 and trainer.last_step_path == "cuda_graph"
    trainer.optimizer.param_groups[0]["weight_decay"] = 0.0
    trainer.train_step()
    assert trainer.last_step_path == "eager"  # warm-up again, then a new capture
    for _ in range(CUDA_GRAPH_WARMUP_STEPS):
        trainer.train_step()
    assert len(stand_in_graphs) == 2 and trainer.last_step_path == "cuda_graph"


def test_two_stage_schedule_recaptures_at_the_switch(data, stand_in_graphs):
    """b1.58 → a4.8 changes the quantizers the graph baked in: TwoStageSchedule.graph_key is the recipe, so the
    switch step runs eagerly and the a4.8 step is captured anew."""
    model = tiny_model()
    bitnet.convert(model, bitnet.BitNetConfig(recipe="b1.58", impl="reference"))
    schedule = bitnet.TwoStageSchedule(stage1_share=0.5, bitnet=bitnet.BitNetConfig(impl="reference"))
    trainer = Trainer(model, data, None, TrainConfig(steps=16, batch_size=2, seq_len=8, cuda_graph=True),
                      schedule=schedule)
    paths = []
    for _ in range(16):
        trainer.train_step()
        paths.append(trainer.last_step_path)
    warm = ["eager"] * CUDA_GRAPH_WARMUP_STEPS
    assert paths == (warm + ["cuda_graph"] * (8 - CUDA_GRAPH_WARMUP_STEPS)) * 2
    assert len(stand_in_graphs) == 2 and bitnet.current_recipe(model) == "a4.8"


def test_graph_mode_checks_each_batch_on_the_host(data, stand_in_graphs):
    class Shifted(WindowData):
        def batch(self, batch_size, seq_len, generator=None):
            inputs, labels = super().batch(batch_size, seq_len, generator)
            return inputs + 64, labels  # ids past the vocabulary

    trainer = Trainer(tiny_model(), Shifted(data.tokens), None,
                      TrainConfig(steps=10, batch_size=2, seq_len=8, cuda_graph=True))
    with pytest.raises(ValueError, match=r"train_data: batch inputs: expected ids in \[0, 64\)"):
        trainer.train_step()

    class Short(WindowData):
        def batch(self, batch_size, seq_len, generator=None):
            return super().batch(batch_size, seq_len - 1, generator)

    trainer = Trainer(tiny_model(), Short(data.tokens), None,
                      TrainConfig(steps=10, batch_size=2, seq_len=8, cuda_graph=True))
    with pytest.raises(ValueError, match=r"cuda_graph replays shape \(2, 8\)"):
        trainer.train_step()


def test_graph_checkpoint_round_trip(tmp_path, data, stand_in_graphs):
    """A checkpoint of a graph-mode trainer resumes in graph mode (new optimizer tensors: warm-up and a new
    capture) on the uninterrupted run's losses bit for bit, and in eager mode (the for-each AdamW on the CPU: to
    float rounding)."""
    cfg = dict(steps=12, batch_size=2, seq_len=8, **LR_CFG)
    a = Trainer(tiny_model(), data, None, TrainConfig(**cfg, cuda_graph=True))
    for _ in range(CUDA_GRAPH_WARMUP_STEPS + 2):
        a.train_step()
    a.save_checkpoint(tmp_path / "ck")
    rest = [a.train_step()["loss"] for _ in range(5)]
    for cuda_graph in (True, False):
        b = Trainer(tiny_model(seed=1), data, None, TrainConfig(**cfg, cuda_graph=cuda_graph))
        b.load_checkpoint(tmp_path / "ck")
        assert b.step == CUDA_GRAPH_WARMUP_STEPS + 2
        resumed = [b.train_step()["loss"] for _ in range(5)]
        assert resumed == rest if cuda_graph else resumed == pytest.approx(rest, rel=1e-6)
    assert len(stand_in_graphs) == 2


# ----------------------------------------------------------------------------------------------- on the GPU

def _cuda_trainer(recipe, data, cuda_graph, **cfg):
    model = LlamaForCausalLM(preset("tiny", vocab_size=64)).init_weights(seed=0).cuda()
    if recipe != "fp":
        bitnet.convert(model, recipe)
    config = TrainConfig(**{**dict(steps=20, batch_size=4, seq_len=64, **LR_CFG), **cfg}, cuda_graph=cuda_graph)
    return Trainer(model, data, None, config)


def _copy_state(src: Trainer, dst: Trainer) -> None:
    """dst's parameters and AdamW state := src's, in place (a captured graph reads those buffers)."""
    with torch.no_grad():
        for p, q in zip(src.model.parameters(), dst.model.parameters()):
            q.copy_(p)
            for key, value in src.optimizer.state[p].items():
                dst.optimizer.state[q][key].copy_(value)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["fp", "a4.8"])
def test_cuda_graph_step_matches_eager(data, recipe):
    """The replayed graph runs the eager step's kernels. From the same weights the forward is deterministic, so
    each step's loss matches to 1e-5 relative (bf16 autocast; bit-identical expected: the same kernels, the RoPE
    values and the cast values are the same; the slack allows a cuBLAS algorithm chosen differently under capture).
    Free-running, the backward's atomics (attention, embedding) let the runs drift: 2e-3 over 6 steps. The
    lr changes every step: a graph that kept its captured lr would update the weights by a different amount."""
    eager, graphed = _cuda_trainer(recipe, data, False), _cuda_trainer(recipe, data, True)
    free_eager, free_graphed = _cuda_trainer(recipe, data, False), _cuda_trainer(recipe, data, True)
    for step in range(CUDA_GRAPH_WARMUP_STEPS + 6):
        if step > 0:
            _copy_state(eager, graphed)
        before = [p.detach().clone() for p in graphed.model.parameters()]
        a, b = eager.train_step(), graphed.train_step()
        assert abs(b["loss"] - a["loss"]) <= 1e-5 * abs(a["loss"]), (step, a, b)
        moved_eager = sum(float((p - q).norm()) for p, q in zip(eager.model.parameters(), before))
        moved_graph = sum(float((p - q).norm()) for p, q in zip(graphed.model.parameters(), before))
        assert moved_graph == pytest.approx(moved_eager, rel=1e-2), step
        fa, fb = free_eager.train_step(), free_graphed.train_step()
        assert abs(fb["loss"] - fa["loss"]) <= 2e-3 * abs(fa["loss"]), (step, fa, fb)
    assert graphed.last_step_path == "cuda_graph" and free_graphed.last_step_path == "cuda_graph"
    assert eager.last_step_path == "eager"


@pytest.mark.cuda
def test_cuda_graph_replays_new_batches_and_lr(data):
    trainer = _cuda_trainer("a4.8", data, True)
    rows = [trainer.train_step() for _ in range(CUDA_GRAPH_WARMUP_STEPS + 4)]
    assert trainer.last_step_path == "cuda_graph"
    replayed = rows[CUDA_GRAPH_WARMUP_STEPS:]
    assert len({r["loss"] for r in replayed}) == len(replayed)  # each replay read its own batch
    assert len({r["lr"] for r in replayed}) == len(replayed)
    assert all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in replayed)
    assert [float(g["lr"]) for g in trainer.optimizer.param_groups] == [rows[-1]["lr"]] * 2
    steps = {float(s["step"]) for s in trainer.optimizer.state.values()}
    assert steps == {float(len(rows))}  # AdamW's counters (on the GPU) advanced once per replay too


@pytest.mark.cuda
def test_cuda_graph_checkpoint_round_trip(tmp_path, data):
    a = _cuda_trainer("a4.8", data, True)
    for _ in range(CUDA_GRAPH_WARMUP_STEPS + 2):
        a.train_step()
    a.save_checkpoint(tmp_path / "ck")
    rest = [a.train_step()["loss"] for _ in range(CUDA_GRAPH_WARMUP_STEPS + 2)]
    for cuda_graph in (True, False):
        b = _cuda_trainer("a4.8", data, cuda_graph)
        b.load_checkpoint(tmp_path / "ck")
        assert all(s["step"].is_cuda for s in b.optimizer.state.values())
        resumed = [b.train_step()["loss"] for _ in range(CUDA_GRAPH_WARMUP_STEPS + 2)]
        assert resumed == pytest.approx(rest, rel=2e-3)  # the backward's atomics: see test above
        assert b.last_step_path == ("cuda_graph" if cuda_graph else "eager")
