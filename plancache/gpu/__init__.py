"""The GPU core: decode specs into cudnn.pygraph, build, autotune, check numerics, serialize, deserialize.

Importing this package imports torch and nvidia-cudnn-frontend; building needs a CUDA GPU.
"""

from .autotune import TunedPlan, autotune
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

__all__ = [
    "BuiltPlan", "TunedPlan", "allocate_outputs", "autotune", "build_engine_config", "build_heuristic",
    "canonicalize_uids", "check_memory", "compare_outputs", "create_handle", "create_kernel_cache", "decode",
    "deserialize_plan", "expected_outputs", "make_inputs", "output_errors", "reference_outputs", "verify_plan",
]
