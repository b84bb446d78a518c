"""Where the techniques meet: ``thrifty.optimize(model, config)``, ``thrifty.undo``, ``thrifty.describe`` and
their config (:class:`OptimizeConfig`, presets). The technique packages import nothing from here."""

from .apply import describe, optimize, undo
from .config import PRESETS, AttentionConfig, CCEConfig, LowBitKVConfig, OptimizeConfig

__all__ = ["optimize", "undo", "describe", "OptimizeConfig", "AttentionConfig", "CCEConfig", "LowBitKVConfig",
           "PRESETS"]
