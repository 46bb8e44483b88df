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


def loaded_engine_id(graph: object) -> int | None:
    """The engine id of the plan a pygraph holds after ``deserialize``, read back from cuDNN (not from the plan's
    record): the C++ graph's ``(engine_id, knobs)`` of its one plan, else the ``eng<ID>`` prefix of its plan name;
    None where cuDNN tells neither."""
    import re

    for ask in (lambda: int(graph.get_engine_and_knobs_at_index(0)[0]),  # type: ignore[attr-defined]
                lambda: int(re.match(r"eng(\d+)", str(graph.get_plan_name_at_index(0))).group(1))):  # type: ignore[attr-defined,union-attr]
        try:
            return ask()
        except Exception:  # noqa: BLE001 - this FE or this plan does not answer that question
            continue
    return None
