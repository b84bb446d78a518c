"""``NeuZipConfig``: the options of ``compress_model`` (codec mode, mantissa bits, steps, decoder, vocab, code
reuse), checked when built so a driver (``thrifty.optimize``) can pass them whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .._checks import check_bool, check_choice, check_impl
from . import reference as R

MODES = ("lossless", "lossy")


@dataclass
class NeuZipConfig:
    """Everything ``compress_model`` takes; validated here so a driver (``thrifty.optimize``) can pass it whole.

    mode: "lossless" (bit-exact, trainable) or "lossy" (bf16 weights rounded to ``mantissa_bits`` = 0, 1, 3;
    7 keeps every bf16 bit, the paper's "7-bit (lossless)"). steps: symbols per lane of the codec (64, 128,
    256). impl: decoder ("auto": the block kernel on CUDA, the NumPy reference on CPU). vocab: also code the
    input embedding and the lm_head (serving only: no weight gradient; see ``vocab.py``), so the whole model
    shrinks, not only its blocks.

    reuse_code: LOMO training with the Triton encoder (``impl`` "triton", or "auto" on CUDA) re-encodes each
    block with the code of its previous encode while that code still has a code for every exponent that occurs;
    else, or once the coded bits grew 1% past the code's fresh build, it builds a new one. The codes it builds
    are single-symbol codes covering every exponent from 0 to two octaves above the block's largest (AdamW
    takes weights near zero to new small exponents every step). Why: a step barely moves the exponent
    histogram, and the host Huffman build plus the decode tables were ~13 of a re-encode's ~14 ms per
    1B-class block (the re-encode alone, reusing: 1.4 ms against 9.7 ms, H200). Still lossless (the weights
    decode bit for bit); the streams are ~0.4% longer and not byte-identical to a fresh encode. False: a fresh
    reference code every step."""

    mode: str = "lossless"
    mantissa_bits: Optional[int] = None
    steps: int = R.STEPS
    impl: str = "auto"
    vocab: bool = False
    reuse_code: bool = True

    def __post_init__(self):
        check_choice("mode", self.mode, MODES)
        k = self.mantissa_bits
        if k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise TypeError(f"mantissa_bits: expected None or an int, got {type(k).__name__}")
        if self.mode == "lossless" and k not in (None, 7):
            raise ValueError(f"mantissa_bits: lossless mode keeps every mantissa bit, got {k} (use mode='lossy')")
        if self.mode == "lossy" and k not in R.LOSSY_MANTISSA_BITS:
            raise ValueError(f"mantissa_bits: lossy mode needs one of {list(R.LOSSY_MANTISSA_BITS)}, got {k!r}")
        R.check_steps(self.steps)
        check_impl(self.impl)
        check_bool("vocab", self.vocab)
        check_bool("reuse_code", self.reuse_code)

    @property
    def kept_bits(self) -> Optional[int]:
        """Mantissa bits the codec keeps: None = every bit (lossless, or lossy k=7)."""
        return None if self.mode == "lossless" or self.mantissa_bits == 7 else self.mantissa_bits
