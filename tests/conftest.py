"""Test set-up. On a machine without CUDA, Triton kernels run in the interpreter: the variable must be set
before any kernel module is imported (``triton.jit`` reads it at decoration time)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run scripts/gpu_tests.sh on the GPU box)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
