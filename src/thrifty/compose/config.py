"""The one configuration of :func:`thrifty.optimize`: which techniques go on a model, with which options.

Every field is checked when the config is built, and so is every pair of techniques, so a bad combination fails
before the model is touched. Each technique keeps its own validated config class (``BitNetConfig``,
``NeuZipConfig``, ``ShadowKVConfig``); the two small ones below cover what had loose keywords.

Which techniques go together, and why (the table of the README says the same):

* BitNet and NeuZip: refused. NeuZip entropy-codes the weights of ``nn.Linear`` layers and replaces them with
  layers holding no weight; a BitLinear quantizes its latent weight to ternary on every forward, so compressing
  it would either drop the quantizer or code a weight that is never used as such.
* packed BitNet (``pack_bitnet``, the "serve-bitnet" preset) and NeuZip: refused. NeuZip codes ``nn.Linear``
  weights; packed ternary weights are already 2 bits each, in layers NeuZip does not code.
* packed BitNet and BitNet conversion (``bitnet``) in one call: refused. Packing serves the ternary weights a
  BitNet model learned; converting a full-precision model and packing it at once would serve ternary weights
  that were never trained (``thrifty.bitnet.convert`` says what that does to a pretrained model's perplexity).
* packed BitNet while training: refused; a packed layer holds 2-bit codes, which have no gradient.
* lossy NeuZip while training: refused; the dropped mantissa bits cannot be re-encoded after an update.
* ShadowKV and the int8 KV cache: refused; both are the cache of ``generate``, one per call.
* everything else composes: BitNet/NeuZip/packed BitNet change the linear layers, CCE the loss of the forward,
  quantized attention the attention function, the KV cache only ``generate``.

Packing needs a model with BitLinear layers (built or converted with BitNet, then trained). A model that
``thrifty.optimize`` put BitNet on (e.g. "train-bitnet") goes straight to serving: optimize it with
``pack_bitnet`` and the techniques of that first call are taken off but its BitLinears, which stay (after
training they are the model), and get packed; ``thrifty.undo`` then gives back that BitLinear model.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from .._checks import check_bool, check_choice, check_impl, check_range

if TYPE_CHECKING:  # the technique packages are imported on first use, so `import thrifty` stays cheap
    from ..bitnet import BitNetConfig
    from ..kvcache import ShadowKVConfig
    from ..neuzip import NeuZipConfig
    from ..optim import LomoConfig

IMPL_ENV = "THRIFTY_IMPL"  # overrides OptimizeConfig.impl when set (e.g. THRIFTY_IMPL=reference on a CI box)


@dataclass(frozen=True)
class AttentionConfig:
    """Quantized attention (SageAttention2). qk_bits: 8 or 4 for every layer; plan: {layer index: 4 or 8} from
    :func:`thrifty.attention.calibrate` (overrides qk_bits per layer); pv: "fp8" or "fp16" P·V. Each layer runs
    ``SageConfig(qk_bits=..., pv=...)`` (smoothing at its defaults); a :class:`thrifty.attention.SageConfig` goes
    to ``sage_attention(config=...)``, ``sage_seam`` or ``enable_hf`` directly."""

    qk_bits: int = 8
    pv: str = "fp8"
    plan: Optional[dict] = None

    def __post_init__(self):
        check_choice("qk_bits", self.qk_bits, (4, 8))
        check_choice("pv", self.pv, ("fp8", "fp16"))
        if self.plan is not None:
            from ..attention import check_plan
            check_plan(self.plan)

    def bits_of(self, layer: int) -> int:
        return (self.plan or {}).get(layer, self.qk_bits)


@dataclass(frozen=True)
class CCEConfig:
    """Cut cross-entropy in the model's loss: the logits of a training step with labels are never materialised.
    The fields are :func:`thrifty.loss.linear_cross_entropy`'s arguments of the same names; its kernels run with
    their defaults (exact gradients, scratch in dC's free rows). A :class:`thrifty.loss.CCEKernelConfig` goes to
    ``linear_cross_entropy(config=...)`` or ``thrifty.loss.hf.patch_causal_lm(model, config=...)`` directly."""

    z_loss: float = 0.0
    label_smoothing: float = 0.0
    softcap: Optional[float] = None

    def __post_init__(self):
        check_range("z_loss", self.z_loss, 0.0, float("inf"))
        check_range("label_smoothing", self.label_smoothing, 0.0, 1.0)
        if self.softcap is not None:
            check_range("softcap", self.softcap, 0.0, float("inf"), lo_open=True)

    def loss_options(self) -> dict:
        return dict(z_loss=self.z_loss, label_smoothing=self.label_smoothing, softcap=self.softcap)


@dataclass(frozen=True)
class LowBitKVConfig:
    """The int8 KV cache of ``generate`` (half the bytes of bf16); read by the decode kernel under quantized
    attention. A transformers Cache on a transformers model, a :class:`thrifty.kv.QuantizedKVCache` (the model's
    ``thrifty_cache_factory``) on thrifty's reference model."""

    bits: int = 8

    def __post_init__(self):
        from ..kv.quantized import check_bits
        check_bits(self.bits)


def _shadowkv_config():
    from ..kvcache import ShadowKVConfig
    return ShadowKVConfig


def _bitnet_config():
    from ..bitnet import BitNetConfig
    return BitNetConfig


def _neuzip_config():
    from ..neuzip import NeuZipConfig
    return NeuZipConfig


def _lomo_config():
    from ..optim import LomoConfig
    return LomoConfig


@dataclass(frozen=True)
class OptimizeConfig:
    """What :func:`thrifty.optimize` puts on a model; ``None`` leaves a technique off.

    attention: an :class:`AttentionConfig` (``True`` for its defaults).
    bitnet: a ``thrifty.bitnet.BitNetConfig`` or a recipe name ("b1.58", "a4.8", ...).
    neuzip: a ``thrifty.neuzip.NeuZipConfig`` or "lossless".
    cce: a :class:`CCEConfig` (``True`` for its defaults).
    kv_cache: a ``thrifty.ShadowKVConfig``, a :class:`LowBitKVConfig`, or "shadowkv" / "int8".
    pack_bitnet: serve the model's trained BitLinear layers packed: each becomes a 2-bit
    ``thrifty.bitnet.PackedBitLinear`` (its BitLinear's output on the same input up to fp32 rounding; 2 bits per
    weight, rows padded to a multiple of 256 weights), and sibling projections (q/k/v, gate/up) are stacked into
    one layer each. Inference only; needs BitLinear layers (see above).
    training: the model will be trained: refuses what cannot train (lossy NeuZip) and trains a NeuZip model
    through the fused optimizer (``lomo``, default ``LomoConfig()``: compressed weights have no ``.grad``).
    skip_layers: decoder layer indices kept in full precision by BitNet and quantized attention (e.g. the first
    and last).
    impl: "auto" (Triton kernels on CUDA, references elsewhere), "triton" or "reference", for every technique;
    the ``THRIFTY_IMPL`` environment variable overrides it.
    """

    attention: Union[AttentionConfig, bool, None] = None
    bitnet: Union["BitNetConfig", str, None] = None
    neuzip: Union["NeuZipConfig", str, None] = None
    cce: Union[CCEConfig, bool, None] = None
    kv_cache: Union["ShadowKVConfig", LowBitKVConfig, str, None] = None
    pack_bitnet: bool = False
    training: bool = False
    skip_layers: tuple = ()
    lomo: Optional["LomoConfig"] = None
    impl: str = "auto"

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        set_("attention", _coerce("attention", self.attention, AttentionConfig, {True: AttentionConfig}))
        set_("cce", _coerce("cce", self.cce, CCEConfig, {True: CCEConfig}))
        set_("bitnet", _coerce_bitnet(self.bitnet))
        set_("neuzip", _coerce("neuzip", self.neuzip, _neuzip_config(),
                               {"lossless": lambda: _neuzip_config()(mode="lossless")}))
        set_("kv_cache", _coerce_kv(self.kv_cache))
        check_bool("pack_bitnet", self.pack_bitnet)
        check_bool("training", self.training)
        set_("skip_layers", _coerce_layers(self.skip_layers))
        check_impl(self.impl)
        if self.lomo is not None and not isinstance(self.lomo, _lomo_config()):
            raise TypeError(f"lomo: expected None or a thrifty.optim.LomoConfig, got {type(self.lomo).__name__}")
        _check_combinations(self)

    @property
    def techniques(self) -> tuple:
        """Names of the techniques switched on, in the order optimize applies them."""
        return tuple(n for n in APPLY_ORDER if getattr(self, n) is not None and getattr(self, n) is not False)

    def resolved_impl(self) -> str:
        """``impl``, or the ``THRIFTY_IMPL`` environment variable when set."""
        env = os.environ.get(IMPL_ENV)
        if env:
            check_impl(env, name=IMPL_ENV)
            return env
        return self.impl

    @classmethod
    def preset(cls, name: str, **overrides) -> "OptimizeConfig":
        """A named preset (see :data:`PRESETS`), fields replaced by ``overrides``."""
        check_choice("preset", name, tuple(PRESETS))
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"overrides: unknown OptimizeConfig field(s) {unknown}")
        return cls(**{**_presets()[name](), **overrides})


# weights first (they replace linear modules), then the loss of the forward, the attention function, generate
APPLY_ORDER = ("bitnet", "pack_bitnet", "neuzip", "cce", "attention", "kv_cache")


def _coerce(name, value, cls, shorthands):
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, (bool, str)) and value in shorthands and value is not False:
        return shorthands[value]()
    raise TypeError(f"{name}: expected None, a {cls.__name__} or one of {list(shorthands)}, got {value!r}")


def _coerce_bitnet(value):
    cls = _bitnet_config()
    if isinstance(value, str):
        value = cls(recipe=value)  # validates the recipe name
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"bitnet: expected None, a recipe name or a BitNetConfig, got {value!r}")
    if value is not None and not value.is_bitnet:
        raise ValueError("bitnet: recipe 'fp' converts nothing; leave bitnet=None")
    return value


def _coerce_kv(value):
    shadow = _shadowkv_config()
    named = {"shadowkv": shadow, "int8": LowBitKVConfig}
    if isinstance(value, str):
        check_choice("kv_cache", value, tuple(named))
        return named[value]()
    if value is not None and not isinstance(value, (shadow, LowBitKVConfig)):
        raise TypeError(f"kv_cache: expected None, a ShadowKVConfig, a LowBitKVConfig or one of {list(named)}, "
                        f"got {value!r}")
    return value


def _coerce_layers(value) -> tuple:
    if not isinstance(value, (tuple, list)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                       for i in value):
        raise TypeError(f"skip_layers: expected a tuple of layer indices >= 0, got {value!r}")
    return tuple(sorted(set(value)))


def _check_combinations(cfg: OptimizeConfig) -> None:
    if cfg.pack_bitnet:
        _check_pack_combinations(cfg)
    if cfg.bitnet is not None and cfg.neuzip is not None:
        raise ValueError("bitnet, neuzip: cannot go together. NeuZip codes nn.Linear weights and replaces the "
                         "layers with weightless ones; BitNet's BitLinear re-quantizes its latent weight to ternary "
                         "on every forward, so one would undo the other. Use BitNet to train, NeuZip to store a "
                         "full-precision model")
    if cfg.neuzip is not None and cfg.training and cfg.neuzip.kept_bits is not None:
        raise ValueError(f"neuzip: lossy NeuZip (mantissa_bits={cfg.neuzip.mantissa_bits}) cannot train: the "
                         "dropped mantissa bits cannot be re-encoded after an update; use 'lossless' or training=False")
    if cfg.lomo is not None and not (cfg.neuzip is not None and cfg.training):
        raise ValueError("lomo: only used to train a NeuZip-compressed model (neuzip set and training=True)")
    if cfg.skip_layers and cfg.bitnet is None and cfg.attention is None:
        raise ValueError("skip_layers: only BitNet and quantized attention lower a layer's precision; neither is on")
    if cfg.neuzip is not None and cfg.neuzip.kept_bits is not None and cfg.skip_layers:
        raise ValueError("skip_layers: lossy NeuZip rounds every block; it has no per-layer skip")
    plan = cfg.attention.plan if cfg.attention is not None else None
    clash = sorted(set(plan or ()) & set(cfg.skip_layers))
    if clash:
        raise ValueError(f"skip_layers: layers {clash} are both skipped and given bits in attention.plan")


def _check_pack_combinations(cfg: OptimizeConfig) -> None:
    if cfg.training:
        raise ValueError("pack_bitnet: packed layers are for inference: their 2-bit ternary codes have no gradient. "
                         "Train with BitLinear layers (the \"train-bitnet\" preset), then serve with pack_bitnet "
                         "(the \"serve-bitnet\" preset)")
    if cfg.bitnet is not None:
        raise ValueError("bitnet, pack_bitnet: cannot go together. pack_bitnet serves the ternary weights a BitNet "
                         "model has learned; converting full-precision layers and packing them in one call would "
                         "serve ternary weights nobody trained. Train with the \"train-bitnet\" preset (or "
                         "thrifty.bitnet.convert + training) first, then optimize with \"serve-bitnet\"")
    if cfg.neuzip is not None:
        raise ValueError("neuzip, pack_bitnet: cannot go together. NeuZip entropy-codes nn.Linear weights; packed "
                         "ternary weights are already 2 bits each and are not nn.Linear weights. NeuZip is for "
                         "full-precision models")


def _presets() -> dict:
    shadow = _shadowkv_config()
    bitnet = _bitnet_config()
    neuzip = _neuzip_config()
    return {
        # training memory: no logits (CCE), weights stored lossless-compressed, quantized attention forward
        "train-memory": lambda: dict(cce=CCEConfig(), neuzip=neuzip(mode="lossless"), attention=AttentionConfig(),
                                     training=True),
        # BitNet a4.8 training with CCE (the LM head stays full precision in BitNet: CCE works on it unchanged)
        "train-bitnet": lambda: dict(bitnet=bitnet(recipe="a4.8"), cce=CCEConfig(), training=True),
        # long prompts: quantized prefill, ShadowKV decode (paper defaults: compressed from 4K tokens)
        "serve-long-context": lambda: dict(attention=AttentionConfig(), kv_cache=shadow()),
        # small footprint: 3-bit-mantissa NeuZip weights (bf16 models), int8 KV cache, quantized attention
        "serve-small": lambda: dict(neuzip=neuzip(mode="lossy", mantissa_bits=3), kv_cache=LowBitKVConfig(),
                                    attention=AttentionConfig()),
        # a trained BitNet model (e.g. after "train-bitnet"): 2-bit packed ternary layers, stacked q/k/v and gate/up
        "serve-bitnet": lambda: dict(pack_bitnet=True),
    }


PRESETS = ("train-memory", "train-bitnet", "serve-long-context", "serve-small", "serve-bitnet")
