"""Two-stage BitNet training (a4.8 §3, 2B4T §3.1): W1.58A8 first, then the 4-bit recipe, one optimizer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .._checks import check_choice, check_range
from .recipes import RECIPES, BitNetConfig, convert, current_recipe

BITNET_RECIPES = tuple(name for name, spec in RECIPES.items() if spec is not None)


@dataclass
class TwoStageSchedule:
    """Recipe, learning rate and weight decay as functions of the step, for :class:`thrifty.train.Trainer`
    (``Trainer(..., schedule=TwoStageSchedule(...))``).

    * stage 1 (the first ``stage1_share`` of the steps, i.e. of the tokens): ``stage1_recipe`` (W1.58A8),
      weight decay ``TrainConfig.weight_decay`` (paper: 0.1);
    * stage 2 (the rest): ``stage2_recipe`` (a4.8) — the same parameters and optimizer moments, only the
      activation quantizers change — and weight decay 0.
    * learning rate: linear warm-up to the peak ``TrainConfig.lr``, cosine decay over stage 1 to the stage-2 peak
      ``lr · stage2_lr_ratio`` (a4.8 Table 7: 1.5e-3 → 1e-3 at 700M, ratio 2/3), then cosine over stage 2 down to
      ``lr · stage2_lr_ratio · min_lr_ratio``. 1-bit models want a high peak: the paper's is ~6× its fp
      baseline's.

    The stage is a function of the step, so a checkpoint written in stage 2 resumes in stage 2: the first step
    after loading switches the freshly built stage-1 model to the stage-2 quantizers. ``stage1_share = 1`` is a
    single-stage run of ``stage1_recipe``.
    """

    stage1_share: float = 0.95
    stage1_recipe: str = "b1.58"
    stage2_recipe: str = "a4.8"
    stage2_lr_ratio: float = 2.0 / 3.0
    bitnet: BitNetConfig = field(default_factory=BitNetConfig)

    def __post_init__(self):
        check_range("stage1_share", self.stage1_share, 0.0, 1.0, lo_open=True)
        check_choice("stage1_recipe", self.stage1_recipe, BITNET_RECIPES)
        check_choice("stage2_recipe", self.stage2_recipe, BITNET_RECIPES)
        check_range("stage2_lr_ratio", self.stage2_lr_ratio, 0.0, 1.0, lo_open=True)
        if not isinstance(self.bitnet, BitNetConfig):
            raise TypeError(f"bitnet: expected a BitNetConfig, got {type(self.bitnet).__name__}")

    def switch_step(self, total_steps: int) -> int:
        return min(total_steps, max(1, round(self.stage1_share * total_steps)))

    def stage(self, step: int, total_steps: int) -> int:
        return 1 if step < self.switch_step(total_steps) else 2

    def recipe(self, step: int, total_steps: int) -> str:
        return self.stage1_recipe if self.stage(step, total_steps) == 1 else self.stage2_recipe

    def lr(self, step: int, cfg) -> float:
        peak, switch = cfg.lr, self.switch_step(cfg.steps)
        lr2 = peak * self.stage2_lr_ratio
        if step < cfg.warmup_steps:
            return peak * (step + 1) / cfg.warmup_steps
        if step < switch:
            return _cosine(peak, lr2, step - cfg.warmup_steps, switch - cfg.warmup_steps)
        return _cosine(lr2, lr2 * cfg.min_lr_ratio, step - switch, cfg.steps - switch)

    def weight_decay(self, step: int, cfg) -> float:
        return cfg.weight_decay if self.stage(step, cfg.steps) == 1 else 0.0

    def graph_key(self, step: int, cfg) -> str:
        """What :meth:`apply` sets on the model at ``step`` (the recipe; the weight decay the Trainer reads from the
        optimizer itself): a change makes a ``cuda_graph`` Trainer capture its step again."""
        return self.recipe(step, cfg.steps)

    def apply(self, trainer) -> float:
        """Puts ``trainer``'s model and optimizer in the state of ``trainer.step``; returns its learning rate."""
        model, cfg, step = trainer.model, trainer.cfg, trainer.step
        recipe = self.recipe(step, cfg.steps)
        have = current_recipe(model)
        if have == "fp":
            raise ValueError("model: convert it to the stage-1 recipe (thrifty.bitnet.convert) before building the "
                             "Trainer, so the optimizer holds the BitLinear parameters")
        if have != recipe:
            convert(model, replace(self.bitnet, recipe=recipe))
        wd = self.weight_decay(step, cfg)
        for group in trainer.optimizer.param_groups:
            if group["weight_decay"] > 0 or group.get("bitnet_decays"):
                group["bitnet_decays"] = True  # remembers which groups decay once stage 2 has zeroed them
                group["weight_decay"] = wd
        return self.lr(step, cfg)


def _cosine(start: float, end: float, step: int, span: int) -> float:
    progress = min(1.0, max(0, step) / max(1, span))
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))
