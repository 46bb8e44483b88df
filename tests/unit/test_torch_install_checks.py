"""``plancache.torch.install()`` on a machine that cannot serve cuDNN builds raises :class:`GpuUnavailable` saying
what is missing and what to do, before anything is installed (on any install: torch is never imported here)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

import plancache.torch
from plancache.errors import GpuUnavailable


def test_without_torch_or_fe_install_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(GpuUnavailable, match=r"needs torch and nvidia-cudnn-frontend .*pip install 'plancache\[gpu\]'"):
        plancache.torch.install()
    assert plancache.torch.sdpa_stats() == {}


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("torch", "cudnn")), reason="needs the gpu extra")
def test_without_a_cuda_device_install_says_so_and_installs_nothing(monkeypatch):
    import cudnn
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    build = cudnn.pygraph.build_plans
    with pytest.raises(GpuUnavailable) as caught:
        plancache.torch.install()
    message = str(caught.value)
    assert message.startswith("plancache.torch.install() serves cuDNN builds on a CUDA GPU, and torch sees no CUDA "
                              "device; CUDA_VISIBLE_DEVICES=''") and "leave install() out" in message, message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert cudnn.pygraph.build_plans is build and plancache.torch.sdpa_stats() == {}
