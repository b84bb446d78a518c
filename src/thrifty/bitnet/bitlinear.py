"""BitLinear: ternary weights, quantized activations, optional sub-layer RMSNorm, straight-through estimator."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import check_bool, check_choice, check_impl, check_positive_int, check_range, check_tensor
from ..triton_utils import kernels_available
from ..layers import RMSNorm
from . import reference as ref

FUSED_KINDS = ("int8", "int4", "topk_int8")
# Read once: the kernels were jitted for the interpreter or the GPU when quant_kernel was imported, and the
# checks per forward (an environment read and a torch.device each) were ~10 µs of host time per BitLinear call.
_TRITON = kernels_available("cuda")
_KERNELS_ON_CPU = kernels_available("cpu")
_QK = None


def _quant_kernel():
    """thrifty.bitnet.quant_kernel, imported on first use (it needs Triton), then from a global: an import
    statement per forward is a few µs of host time."""
    global _QK
    if _QK is None:
        from . import quant_kernel

        _QK = quant_kernel
    return _QK


def _blend(x: torch.Tensor, q: torch.Tensor, strength: float) -> torch.Tensor:
    """x + λ(q − x), exactly q at λ = 1 and exactly x at λ = 0."""
    if strength == 1.0:
        return q
    if strength == 0.0:
        return x
    return x + strength * (q - x)


class BitLinear(nn.Module):
    """``y = Q_a(norm(x)) · Q_w(W)ᵀ (+ b)``: a drop-in for ``nn.Linear`` in BitNet b1.58 / a4.8.

    * ``W`` is the fp32 latent weight; every forward re-quantizes it to absmean ternary (one α per tensor, or per
      sub-matrix given by ``weight_splits`` for a fused projection such as q|k|v).
    * ``activation``: the input quantizer, ``"int8"`` (absmax), ``"int4"`` (absmean), ``"fp4"`` (E2M1 MinMax),
      ``"topk_int8"`` (TopK-``topk_ratio`` per token, then INT8) or ``"none"``.
    * ``sub_norm``: an RMSNorm (with weight) on the input before it is quantized. BitNet needs every quantized
      input normalized; in the Llama block the pre-attention/pre-MLP norms already normalize the q/k/v and
      gate/up inputs, so only the attention-output and FFN-down projections carry their own (the placement of
      the paper's Figure 1, microsoft/BitNet's ``attn_sub_norm``/``ffn_sub_norm`` and HF's BitNet model).
    * ``strength`` λ in [0, 1] blends every change into the plain linear: input ``x + λ(Q(x) − x)``, weight
      ``W + λ(Q(W) − W)``, sub-norm ``x + λ(norm(x) − x)``. 1 is BitNet; ramp it from 0 when converting a
      pretrained full-precision model (see :func:`thrifty.bitnet.convert`).
    * ``impl``: ``"auto"`` runs the Triton kernels on CUDA: the sub-norm and the INT8/INT4/TopK quantizer as one
      kernel (backward: the STE's identity, through one RMSNorm-backward kernel when there is a norm), and the
      ternary weight as one reduction + one kernel; both are written in the matmul's dtype (bf16 under
      autocast). ``"triton"`` runs them wherever Triton runs (also on the CPU under ``TRITON_INTERPRET=1``),
      ``"reference"`` never. The reference runs instead for λ < 1, FP4 and over-long rows. ``last_path`` records
      which one the last forward's input took ("triton", "reference" or "none").
    """

    def __init__(self, in_features: int, out_features: int, *, activation: str = "int8", bias: bool = False,
                 sub_norm: bool = False, norm_eps: float = 1e-5, weight_splits: Optional[Sequence[int]] = None,
                 beta_scale: float = 1.0, topk_ratio: float = 0.5, strength: float = 1.0, impl: str = "auto",
                 device=None):
        super().__init__()
        check_positive_int("in_features", in_features)
        check_positive_int("out_features", out_features)
        check_bool("bias", bias)
        check_bool("sub_norm", sub_norm)
        check_range("norm_eps", norm_eps, 0.0, 1.0, lo_open=True)
        if weight_splits is not None:
            if not isinstance(weight_splits, (list, tuple)):
                raise TypeError(f"weight_splits: expected a sequence of ints, got {type(weight_splits).__name__}")
            weight_splits = tuple(weight_splits)
            for s in weight_splits:
                check_positive_int("weight_splits", s)
            if sum(weight_splits) != out_features:
                raise ValueError(f"weight_splits: expected sizes adding up to out_features={out_features}, "
                                 f"got {list(weight_splits)}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.norm = RMSNorm(in_features, norm_eps).to(device) if sub_norm else None
        self.weight_splits = weight_splits
        for name, value in (("activation", activation), ("beta_scale", beta_scale), ("topk_ratio", topk_ratio),
                            ("strength", strength), ("impl", impl)):
            if value is None:  # configure() reads None as "unchanged"; here there is nothing to keep
                raise TypeError(f"{name}: expected a value, got None")
        self.configure(activation=activation, beta_scale=beta_scale, topk_ratio=topk_ratio, strength=strength,
                       impl=impl)
        self.last_path: Optional[str] = None
        self.shared_input: Optional[SharedInput] = None  # set by convert() on q/k/v and on gate/up
        nn.init.normal_(self.weight, std=0.02)

    def configure(self, *, activation: Optional[str] = None, beta_scale: Optional[float] = None,
                  topk_ratio: Optional[float] = None, strength: Optional[float] = None,
                  impl: Optional[str] = None) -> "BitLinear":
        """Changes the quantization settings in place (parameters untouched: the optimizer state stays valid)."""
        if activation is not None:
            check_choice("activation", activation, ref.ACTIVATIONS)
            self.activation = activation
        if beta_scale is not None:
            check_range("beta_scale", beta_scale, 0.0, 1e3, lo_open=True)
            self.beta_scale = float(beta_scale)
        if topk_ratio is not None:
            check_range("topk_ratio", topk_ratio, 0.0, 1.0, lo_open=True)
            self.topk_ratio = float(topk_ratio)
        if strength is not None:
            check_range("strength", strength, 0.0, 1.0)
            self.strength = float(strength)
        if impl is not None:
            self.impl = check_impl(impl)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "BitLinear":
        """A BitLinear holding a copy of ``linear``'s weight (and bias) as the fp32 latent weight."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                  device=linear.weight.device, **kwargs)
        with torch.no_grad():
            new.weight.copy_(linear.weight.float())
            if linear.bias is not None:
                new.bias.copy_(linear.bias.float())
        new.source_dtype = linear.weight.dtype  # the fp32 latent copy is exact: revert() casts back bit for bit
        return new

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation!r}, "
                f"sub_norm={self.norm is not None}, strength={self.strength}")

    # ------------------------------------------------------------------------------------------------ forward

    def _use_kernels(self, x: torch.Tensor) -> bool:
        if self.impl == "auto":
            return x.is_cuda
        if self.impl == "triton":
            if not (_TRITON and x.is_cuda) and not (_KERNELS_ON_CPU and x.device.type == "cpu"):
                raise ValueError(f"impl: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU), got {x.device}")
            return True
        return False

    def _matmul_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype F.linear computes in: autocast's, else the input's."""
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            return x
        return _blend(x, self.norm(x).to(x.dtype), self.strength)

    def _quantized_input(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The (sub-normed) quantized input with the STE gradient (and the λ blend), in ``out_dtype``. Sibling
        projections reading the same tensor (q/k/v, gate/up) share one quantization through ``shared_input``."""
        key = (self.activation, self.beta_scale, self.topk_ratio, self.strength, self.impl, out_dtype,
               torch.is_grad_enabled())
        hit = self.shared_input.lookup(x, key) if self.shared_input is not None else None
        if hit is not None:
            q, self.last_path = hit
            return q
        q = self._quantize(x, out_dtype)
        if self.shared_input is not None:
            self.shared_input.store(x, key, q, self.last_path)
        return q

    def _quantize(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        QK = _quant_kernel()
        if self.activation == "none":
            self.last_path = "none"
            return self._normed(x).to(out_dtype)
        exact = self.strength == 1.0
        if self._use_kernels(x) and QK.supports(self.activation, x.shape[-1]) and x.dtype in QK.KEYS and exact:
            self.last_path = "triton"
            weight = self.norm.weight if self.norm is not None else None
            eps = self.norm.eps if self.norm is not None else 0.0
            return QK.FusedQuantizeSTE.apply(x, weight, self.activation, self.beta_scale, self.topk_ratio, eps,
                                             out_dtype)
        self.last_path = "reference"
        xn = self._normed(x)
        q = ref.quantize_activation(xn.detach(), self.activation, beta_scale=self.beta_scale,
                                    topk_ratio=self.topk_ratio)
        return ref.ste(xn, _blend(xn.detach(), q, self.strength)).to(out_dtype)

    def quantized_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The ternary weight with the STE gradient (and the λ blend), in ``dtype`` (default the weight's)."""
        w = self.weight
        if self.strength == 1.0 and self._use_kernels(w):
            return _quant_kernel().TernaryWeightSTE.apply(w, self.weight_splits, dtype or w.dtype)
        q = ref.quantize_weight_ternary(w.detach(), self.weight_splits)
        return ref.ste(w, _blend(w.detach(), q, self.strength)).to(dtype or w.dtype)

    @torch.no_grad()
    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the matmul sees for input ``x`` (sub-norm and quantizer applied), without gradients; used by the
        sparsity measurement."""
        return self._quantized_input(x, self._matmul_dtype(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x, min_ndim=1, floating=True)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected {self.in_features} features in the last dimension, got shape "
                             f"{tuple(x.shape)}")
        dtype = self._matmul_dtype(x)
        xq = self._quantized_input(x, dtype)
        w = self.quantized_weight(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(xq, w, bias)


class SharedInput:
    """One quantized input for the sibling projections that read the same tensor (q/k/v, gate/up): the first
    quantizes, the others reuse it while the tensor is the same object, unmodified (``_version``), quantized with
    the same settings. The entry is dropped once every sibling has used it, so no activation outlives its
    forward here. Lives on the modules (set by :func:`thrifty.bitnet.convert`), never in process-wide state."""

    def __init__(self, members: int):
        check_positive_int("members", members)
        self.members = members
        self._entry: Optional[list] = None  # [x, x._version, key, q, path, uses left]

    def lookup(self, x: torch.Tensor, key: tuple):
        e = self._entry
        if e is None or e[0] is not x or e[1] != x._version or e[2] != key:
            return None
        e[5] -= 1
        if e[5] <= 0:
            self._entry = None
        return e[3], e[4]

    def store(self, x: torch.Tensor, key: tuple, q: torch.Tensor, path: str) -> None:
        self._entry = [x, x._version, key, q, path, self.members - 1] if self.members > 1 else None

    def __deepcopy__(self, memo):  # a copied model gets its own, empty cache
        return SharedInput(self.members)

    def __getstate__(self):  # nor is a cached activation pickled with the model
        return {"members": self.members, "_entry": None}
