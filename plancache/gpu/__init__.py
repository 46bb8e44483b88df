"""The GPU core: decode specs into cudnn.pygraph, build, autotune, check numerics, serialize, deserialize.

Importing this package imports torch and nvidia-cudnn-frontend; building needs a CUDA GPU. The tuning modules
(:mod:`.tune`, its builder processes and timing) load on first use of :func:`autotune` or :class:`TunedPlan`: a
client that only loads and builds plans (:class:`plancache.client.GpuBackend`) never imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .fegraph import canonicalize_uids, decode
from .reference import allocate_outputs, compare_outputs, make_inputs, output_errors, reference_outputs
from .runtime import (
    BuiltPlan,
    build_engine_config,
    build_heuristic,
    check_memory,
    create_handle,
    create_kernel_cache,
    deserialize_plan,
    expected_outputs,
    verify_plan,
)

if TYPE_CHECKING:
    from .tune import TunedPlan, autotune

__all__ = [
    "BuiltPlan", "TunedPlan", "allocate_outputs", "autotune", "build_engine_config", "build_heuristic",
    "canonicalize_uids", "check_memory", "compare_outputs", "create_handle", "create_kernel_cache", "decode",
    "deserialize_plan", "expected_outputs", "make_inputs", "output_errors", "reference_outputs", "verify_plan",
]

_TUNING = ("TunedPlan", "autotune")


def __getattr__(name: str) -> Any:
    if name in _TUNING:
        from . import tune

        return getattr(tune, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
