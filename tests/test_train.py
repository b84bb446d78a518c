"""The trainer: loss goes down, schedule shape, checkpoints resume bit-exactly, bad config rejected."""

import pytest
import torch

from thrifty.models import LlamaConfig, LlamaForCausalLM
from thrifty.train import Trainer, TrainConfig, lr_at


class WindowData:
    """Random windows of one token stream (the duck type the trainer reads; thrifty.data.TokenDataset is one)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def batch(self, batch_size, seq_len, generator=None):
        starts = torch.randint(0, len(self.tokens) - seq_len - 1, (batch_size,), generator=generator)
        idx = starts[:, None] + torch.arange(seq_len + 1)
        w = self.tokens[idx]
        return w[:, :-1], w[:, 1:]

    def iter_eval_batches(self, batch_size, seq_len, max_batches=None):
        g = torch.Generator().manual_seed(123)
        for _ in range(max_batches or 2):
            yield self.batch(batch_size, seq_len, g)


def tiny_model(seed=0):
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).init_weights(seed=seed)


@pytest.fixture
def data():
    text = ("The kernel schedules processes and manages memory. Drivers talk to hardware devices. " * 40).encode()
    return WindowData(torch.tensor(list(text)) % 64)


def test_loss_goes_down(data):
    cfg = TrainConfig(steps=80, batch_size=8, seq_len=32, lr=5e-3, warmup_steps=3, eval_batches=2)
    trainer = Trainer(tiny_model(), data, data, cfg)
    hist = trainer.fit(progress=False)
    assert hist[-1]["loss"] < 0.6 * hist[0]["loss"]
    assert hist[-1]["val_ppl"] < 64 and hist[-1]["tokens_per_s"] > 0


def test_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lr_at(100, cfg) == pytest.approx(1e-4)


def test_checkpoint_resume_is_exact(tmp_path, data):
    cfg = TrainConfig(steps=5, batch_size=4, seq_len=16, lr=1e-3, warmup_steps=1)
    a = Trainer(tiny_model(), data, None, cfg)
    for _ in range(3):
        a.train_step()
    a.save_checkpoint(tmp_path / "ck")
    rest_a = [a.train_step()["loss"] for _ in range(2)]
    b = Trainer(tiny_model(seed=9), data, None, cfg)
    b.load_checkpoint(tmp_path / "ck")
    assert b.step == 3
    rest_b = [b.train_step()["loss"] for _ in range(2)]
    assert rest_a == rest_b
    assert not list(tmp_path.glob("**/*.pt")) and not list(tmp_path.glob("**/*.bin"))


def test_bad_config_and_inputs(tmp_path, data):
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0.0)
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="autocast"):
        TrainConfig(autocast="fp8")
    with pytest.raises(TypeError, match="train_data"):
        Trainer(tiny_model(), [1, 2, 3])
    with pytest.raises(ValueError, match="path"):
        Trainer(tiny_model(), data).load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="data"):
        Trainer(tiny_model(), data).evaluate()
