"""Helpers every thrifty Triton kernel uses, so that one kernel source runs on the GPU and, at small sizes,
under the Triton interpreter on the CPU (``TRITON_INTERPRET=1``, how CI checks kernels).

Interpreter pitfall handled here: a ``tl.dot`` on bfloat16 operands returns garbage in the interpreter
(numpy has no bfloat16), while fp32/fp16/int8/fp8 are exact. Kernels call :func:`mma` instead of
``tl.dot``; under the interpreter it upcasts bfloat16 operands to float32, which is exact (every bf16 value
is an fp32 value) and matches what the tensor cores compute (bf16 products, fp32 accumulation).

The interpreter is chosen when ``triton.jit`` runs, i.e. when a kernel module is imported: set
``TRITON_INTERPRET=1`` before importing thrifty's kernels (``tests/conftest.py`` does so on CPU machines).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a hard dependency, but keep imports cheap to diagnose
    HAVE_TRITON = False


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_available(device: torch.device | str) -> bool:
    """True when a Triton kernel can run on tensors of ``device``: CUDA, or any device under the interpreter."""
    if not HAVE_TRITON:
        return False
    device = torch.device(device)
    return device.type == "cuda" or (interpreting() and device.type == "cpu")


if HAVE_TRITON:
    if interpreting():

        @triton.jit
        def mma(a, b, acc):
            """``acc + a @ b`` with fp32 accumulation; bf16 upcast because the interpreter's bf16 dot is wrong."""
            if a.dtype == tl.bfloat16:
                a = a.to(tl.float32)
            if b.dtype == tl.bfloat16:
                b = b.to(tl.float32)
            return tl.dot(a, b, acc)

    else:

        @triton.jit
        def mma(a, b, acc):
            """``acc + a @ b`` with fp32 accumulation on the tensor cores."""
            return tl.dot(a, b, acc)
