"""Skip helpers for tests that need a CUDA GPU with cuDNN and nvidia-cudnn-frontend."""

from __future__ import annotations

import importlib.util

import pytest


def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here, or None when they can."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if importlib.util.find_spec("cudnn") is None:
        return "nvidia-cudnn-frontend is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    try:
        import cudnn

        cudnn.backend_version()
    except Exception as exc:  # the cuDNN library itself is missing or broken
        return f"cuDNN backend unavailable: {exc}"
    return None


_REASON = gpu_skip_reason()
#: Apply to every GPU test together with ``@pytest.mark.gpu``.
requires_gpu = pytest.mark.skipif(_REASON is not None, reason=f"GPU test: {_REASON}")
