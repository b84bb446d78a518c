"""Cut Cross-Entropy (arXiv 2411.09009): linear + cross-entropy without materialising the N x V logits.

``linear_cross_entropy`` dispatches to Triton kernels on CUDA and to a chunked PyTorch reference elsewhere;
``CCEKernelConfig`` holds what the kernels may trade (gradient filtering, scratch memory);
``thrifty.loss.hf.patch_causal_lm`` plugs it into a transformers causal LM.
"""

from .cce import CCEKernelConfig, LinearCrossEntropy, linear_cross_entropy, lm_loss

__all__ = ["linear_cross_entropy", "CCEKernelConfig", "LinearCrossEntropy", "lm_loss"]
