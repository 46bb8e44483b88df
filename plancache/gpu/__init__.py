"""The GPU core: lower specs onto cudnn.pygraph, build, autotune, serialize, deserialize, verify.

Importing this package imports torch and nvidia-cudnn-frontend; building needs a CUDA GPU.
"""

from .autotune import TunedPlan, autotune
from .reference import allocate_outputs, compare_outputs, make_inputs, output_errors, reference_outputs
from .runtime import (
    BuiltPlan,
    build_engine_config,
    build_heuristic,
    check_memory,
    create_handle,
    create_kernel_cache,
    deserialize_plan,
    required_bytes,
    supports_kernel_cache,
    verify_plan,
)

__all__ = [
    "BuiltPlan", "TunedPlan", "allocate_outputs", "autotune", "build_engine_config", "build_heuristic", "check_memory",
    "compare_outputs", "create_handle", "create_kernel_cache", "deserialize_plan", "make_inputs", "output_errors",
    "reference_outputs", "required_bytes", "supports_kernel_cache", "verify_plan",
]
