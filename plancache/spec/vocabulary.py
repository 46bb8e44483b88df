"""The names FE 1.32 gives data types, enums, scalar types and graph flags, as the spec document spells them."""

from __future__ import annotations

#: ``cudnn.data_type`` names.
DATA_TYPES = ("FLOAT", "DOUBLE", "HALF", "INT8", "INT32", "INT8x4", "UINT8", "UINT8x4", "INT8x32", "BFLOAT16", "INT64",
              "BOOLEAN", "FP8_E4M3", "FP8_E5M2", "FAST_FLOAT_FOR_FP8", "FP8_E8M0", "FP8_E5M3", "FP4_E2M1", "INT4")
#: The torch dtype (attribute name of ``torch``) of each data type that has one.
TORCH_DTYPES = {"HALF": "float16", "BFLOAT16": "bfloat16", "FLOAT": "float32", "DOUBLE": "float64", "INT8": "int8",
                "UINT8": "uint8", "INT32": "int32", "INT64": "int64", "BOOLEAN": "bool", "FP8_E4M3": "float8_e4m3fn",
                "FP8_E5M2": "float8_e5m2", "FP8_E8M0": "float8_e8m0fnu"}
#: Enum types (attributes of the ``cudnn`` module) a param may hold.
ENUM_TYPES = ("attention_implementation", "convolution_mode", "data_type", "diagonal_alignment", "gnn_activation_op",
              "gnn_agg_op", "moe_grouped_matmul_mode", "norm_forward_phase", "reduction_mode", "reshape_mode",
              "scalar_type", "tensor_reordering")
#: ``cudnn.scalar_type`` names: how a ``tensor_scalar`` value is bound (its ``scalar_type``; not a data type).
SCALAR_TYPES = ("RUNTIME_PARAM", "COMPILE_TIME_CONST")
#: Graph-level constructor arguments that are graph content (handle, kernel cache, device properties are not).
GRAPH_FLAGS = ("sm_count", "sm_version", "is_dynamic_shape_enabled", "is_override_shape_enabled",
               "is_cuda_graph_replay_expected")
#: Heuristic modes the autotuner may be restricted to.
HEURISTIC_MODES = ("A", "B", "FALLBACK")
#: Bits of one element of each data type, for the byte limit; vectorized types count their scalar (the lower bound).
DATA_TYPE_BITS = {"FLOAT": 32, "DOUBLE": 64, "HALF": 16, "INT8": 8, "INT32": 32, "INT8x4": 8, "UINT8": 8, "UINT8x4": 8,
                  "INT8x32": 8, "BFLOAT16": 16, "INT64": 64, "BOOLEAN": 8, "FP8_E4M3": 8, "FP8_E5M2": 8,
                  "FAST_FLOAT_FOR_FP8": 8, "FP8_E8M0": 8, "FP8_E5M3": 8, "FP4_E2M1": 4, "INT4": 4}

__all__ = ["DATA_TYPES", "DATA_TYPE_BITS", "ENUM_TYPES", "GRAPH_FLAGS", "HEURISTIC_MODES", "SCALAR_TYPES", "TORCH_DTYPES"]
