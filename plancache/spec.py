"""The graph spec: a canonical, versioned JSON document of a ``cudnn.pygraph``, and its graph key.

The document (schema 2, see ``docs/SPEC.md``) records what FE's pure-Python IR holds: the
graph context (data types), graph flags, every tensor (uid, dims, strides, data type,
virtual / pass-by-value flags, ragged offsets, ...) and every node (node type, port → tensor
uid, params). Enums are written by name; a param value is JSON, or one of the typed forms
``{"$enum": TYPE, "name": NAME}``, ``{"$tensor": UID}``, ``{"$tuple": [...]}``, ``{"$dict": {...}}``.

Everything here is plain Python: the server validates (structure, enum spellings, size
limits) and keys documents without nvidia-cudnn-frontend or a GPU. :func:`from_pygraph`
reads a user's graph (it needs FE only because the graph does); :class:`SpecBuilder` writes
one with the cudnn method names and no FE at all; full validation happens where FE lowers
the document (:mod:`plancache.gpu.fegraph`).

The graph key is the sha256 of the canonical form, in which the same computation always
reads the same: names (graph, tensor, node) and the ``uid_assigned`` flag are dropped;
auto-assigned uids are renumbered in graph order (user-assigned uids are kept: code executes
with them); unset data types are filled as FE fills them; a param equal to its default is
dropped (``stride=[1, 1]`` reads as no stride); inferred (not user-set, not pushed) dims and
strides of node outputs are dropped. Dims, strides, dtypes, params, masks and baked-in
scale values stay, so anything that changes the computation changes the key.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from . import SPEC_SCHEMA_VERSION
from .canonical import canonical_json
from .errors import SpecError, UnsupportedGraph
from .validation import INT64_MAX, StrictModel, validation_message

# ------------------------------------------------------------------ the vocabulary (FE 1.32)

#: ``cudnn.data_type`` names.
DATA_TYPES = ("FLOAT", "DOUBLE", "HALF", "INT8", "INT32", "INT8x4", "UINT8", "UINT8x4", "INT8x32", "BFLOAT16", "INT64",
              "BOOLEAN", "FP8_E4M3", "FP8_E5M2", "FAST_FLOAT_FOR_FP8", "FP8_E8M0", "FP8_E5M3", "FP4_E2M1", "INT4")
#: The torch dtype (attribute name of ``torch``) of each data type that has one.
TORCH_DTYPES = {"HALF": "float16", "BFLOAT16": "bfloat16", "FLOAT": "float32", "DOUBLE": "float64", "INT8": "int8",
                "UINT8": "uint8", "INT32": "int32", "INT64": "int64", "BOOLEAN": "bool", "FP8_E4M3": "float8_e4m3fn",
                "FP8_E5M2": "float8_e5m2", "FP8_E8M0": "float8_e8m0fnu"}
#: ``cudnn.graph_types.NodeType`` names.
NODE_TYPES = (
    "COMPOSITE", "CONV_FPROP", "CONV_DGRAD", "CONV_WGRAD", "GENSTATS", "RESHAPE", "SLICE", "CONCATENATE", "TRANSPOSE",
    "ROPE", "ROPE_BWD", "MOE_GROUPED_MATMUL_BWD", "MATMUL", "MATMUL_FP8", "POINTWISE", "REDUCTION", "RMSNORM",
    "RMSNORM_BWD", "LAYERNORM", "LAYERNORM_BWD", "ADALAYERNORM", "ADALAYERNORM_BWD", "INSTANCENORM", "INSTANCENORM_BWD",
    "BATCHNORM", "BATCHNORM_INFERENCE", "BATCHNORM_BWD", "SDPA", "SDPA_BWD", "SDPA_FP8", "SDPA_FP8_BWD", "SDPA_MXFP8",
    "SDPA_MXFP8_BWD", "GDN", "GDN_BWD", "KDA", "KDA_BWD", "GDN2", "GDN2_BWD", "MOE_GROUPED_MATMUL",
    "BLOCK_SCALE_QUANTIZE", "BLOCK_SCALE_DEQUANTIZE", "GDP", "GDP_BWD", "GDN_SUMMARY", "KDA_SUMMARY", "GDN2_SUMMARY",
    "GDP_SUMMARY", "GDN_SUMMARY_BWD", "KDA_SUMMARY_BWD", "GDN2_SUMMARY_BWD", "GDP_SUMMARY_BWD", "MAMBA2", "MAMBA2_BWD",
    "MAMBA2_SUMMARY", "MAMBA2_SUMMARY_BWD")
#: Enum types (attributes of the ``cudnn`` module) a param may hold.
ENUM_TYPES = ("attention_implementation", "convolution_mode", "data_type", "diagonal_alignment", "gnn_activation_op",
              "gnn_agg_op", "moe_grouped_matmul_mode", "norm_forward_phase", "reduction_mode", "reshape_mode",
              "scalar_type", "tensor_reordering")
#: ``cudnn.scalar_type`` names: how a ``tensor_scalar`` value is bound (its ``scalar_type``; not a data type).
SCALAR_TYPES = ("RUNTIME_PARAM", "COMPILE_TIME_CONST")
#: Node types whose output dims FE pushes to the backend even when the user did not set them.
PUSHED_OUTPUT_DIMS = frozenset({"CONV_DGRAD", "CONV_WGRAD", "MOE_GROUPED_MATMUL_BWD", "REDUCTION", "RESHAPE"})
#: Node types whose ``Stats`` output FE types FLOAT when unset.
FLOAT_STATS = frozenset({"SDPA", "SDPA_FP8", "SDPA_MXFP8"})
#: Graph-level constructor arguments that are graph content (handle, kernel cache, device properties are not).
GRAPH_FLAGS = ("sm_count", "sm_version", "is_dynamic_shape_enabled", "is_override_shape_enabled",
               "is_cuda_graph_replay_expected")
#: Heuristic modes the autotuner may be restricted to.
HEURISTIC_MODES = ("A", "B", "FALLBACK")

_CONV = ("CONV_FPROP", "CONV_DGRAD", "CONV_WGRAD")
_SDPA = ("SDPA", "SDPA_BWD", "SDPA_FP8", "SDPA_FP8_BWD", "SDPA_MXFP8", "SDPA_MXFP8_BWD")
_FALSE_FLAGS = ("use_alibi_mask", "use_padding_mask", "use_causal_mask", "use_causal_mask_bottom_right",
                "attn_scale_prefolded", "is_inference", "use_deterministic_algorithm", "generate_stats")
#: Params whose value equals this default are dropped from the canonical form (``"zeros"``/``"ones"``:
#: a list of 0s / 1s of any length). Only defaults of the cuDNN bindings are listed.
PARAM_DEFAULTS: dict[str, dict[str, Any]] = {
    **{t: {"padding": "zeros", "pre_padding": "zeros", "post_padding": "zeros", "stride": "ones", "dilation": "ones",
           "convolution_mode": {"$enum": "convolution_mode", "name": "CROSS_CORRELATION"}} for t in _CONV},
    "MATMUL": {"padding": 0.0},
    **{t: {**{f: False for f in _FALSE_FLAGS if t != "SDPA" or f != "generate_stats"},
           "diagonal_alignment": {"$enum": "diagonal_alignment", "name": "TOP_LEFT"}} for t in _SDPA},
}

# ------------------------------------------------------------------ limits
# Sized from real FE graphs (docs/SPEC.md "Limits"): the largest have hundreds of tensors, tens of nodes, rank
# 5, about 25 ports and 30 params on a node. Counts and lengths are checked before pydantic builds anything.

MAX_RANK = 8  # cuDNN's CUDNN_DIM_MAX
MAX_TENSORS = 1024
MAX_NODES = 512
MAX_PORTS = 64  # inputs, and outputs, of one node
MAX_PARAMS = 64  # params of one node, entries of a $dict
MAX_NAME = 256  # graph, tensor and node names; string values
MAX_DIM = 1 << 40  # dims and strides
# Sized from the memory of the largest GPU a graph runs on (docs/SPEC.md "Limits"): an H200 holds 141 GB (2^37.04
# bytes), so no tensor of a graph it runs has more than 2^38.04 elements (FP4, half a byte each) nor a graph more
# than 2^37.04 bytes of tensors. Both limits leave room for larger GPUs (4 and 7.8 times that).
MAX_ELEMENTS = 1 << 40  # elements of one tensor (the product of its dims)
MAX_GRAPH_BYTES = 1 << 40  # bytes of the graph's non-virtual tensors (1 TiB), laid out as their strides say
#: Bits of one element of each data type, for the byte limit; vectorized types count their scalar (the lower bound).
DATA_TYPE_BITS = {"FLOAT": 32, "DOUBLE": 64, "HALF": 16, "INT8": 8, "INT32": 32, "INT8x4": 8, "UINT8": 8, "UINT8x4": 8,
                  "INT8x32": 8, "BFLOAT16": 16, "INT64": 64, "BOOLEAN": 8, "FP8_E4M3": 8, "FP8_E5M2": 8,
                  "FAST_FLOAT_FOR_FP8": 8, "FP8_E8M0": 8, "FP8_E5M3": 8, "FP4_E2M1": 4, "INT4": 4}
MAX_LIST = 64  # items of a list or $tuple value
MAX_DEPTH = 6
MAX_UID = INT64_MAX  # uids, and any other integer
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_ENUM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class _Strict(StrictModel):
    """A model of the spec document: JSON types exactly (no ``"1"`` for 1)."""

    model_config = ConfigDict(strict=True)


class TuningSpec(_Strict):
    """Constraints on which execution plans the autotuner may pick (part of the key)."""

    heuristic_modes: list[str] = Field(default_factory=lambda: list(HEURISTIC_MODES), min_length=1, max_length=3)
    max_workspace_bytes: int | None = Field(default=None, ge=0, le=1 << 48)
    deterministic_only: bool = False

    @model_validator(mode="after")
    def _modes(self) -> TuningSpec:
        bad = [m for m in self.heuristic_modes if m not in HEURISTIC_MODES]
        if bad:
            raise ValueError(f"unknown heuristic mode {bad[0]!r}; known: {', '.join(HEURISTIC_MODES)}")
        return self


class Context(_Strict):
    io_data_type: str | None = None
    intermediate_data_type: str | None = None
    compute_data_type: str | None = None


class GraphFlags(_Strict):
    sm_count: int | None = Field(default=None, ge=1, le=1 << 20)
    sm_version: int | None = Field(default=None, ge=1, le=10_000)
    is_dynamic_shape_enabled: bool = False
    is_override_shape_enabled: bool = False
    is_cuda_graph_replay_expected: bool = False


class TensorDoc(_Strict):
    """One tensor of the IR (``cudnn.graph_types.Tensor``)."""

    uid: int = Field(ge=0, le=MAX_UID)
    name: str = Field(default="", max_length=MAX_NAME)
    data_type: str | None = None
    dim: list[int] = Field(default_factory=list, max_length=MAX_RANK)
    stride: list[int] = Field(default_factory=list, max_length=MAX_RANK)
    is_virtual: bool = False
    is_pass_by_value: bool = False
    pass_by_value: int | float | None = None
    uid_assigned: bool = False
    dim_assigned: bool = False
    stride_assigned: bool = False
    reordering_type: str | None = None
    ragged_offset: int | None = Field(default=None, ge=0, le=MAX_UID)
    ragged_offset_multiplier: int = Field(default=1, ge=1, le=1 << 32)
    alignment_value: int = Field(default=1, ge=1, le=1 << 32)
    scalar_type: str | None = None


class NodeDoc(_Strict):
    """One node of the IR (``cudnn.nodes.Node``)."""

    name: str = Field(default="", max_length=MAX_NAME)
    type: str
    compute_data_type: str | None = None
    inputs: dict[str, int] = Field(default_factory=dict, max_length=MAX_PORTS)
    outputs: dict[str, int] = Field(min_length=1, max_length=MAX_PORTS)
    params: dict[str, Any] = Field(default_factory=dict, max_length=MAX_PARAMS)


def _check_enum_name(kind: str, value: str | None, allowed: Iterable[str], where: str) -> None:
    if value is not None and value not in allowed:
        raise SpecError(f"{where}: unknown {kind} {value!r}")


def _check_value(value: Any, where: str, uids: set[int], depth: int = 0) -> None:
    """A param value: JSON scalars and lists, or one of the typed forms; bounded in size and depth."""
    if depth > MAX_DEPTH:
        raise SpecError(f"{where}: nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, str)):
        if isinstance(value, str) and len(value) > MAX_NAME:
            raise SpecError(f"{where}: string longer than {MAX_NAME}")
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800"): the UTF-8 of the key cannot hold it
                raise SpecError(f"{where}: string {value[:40]!r} is not valid Unicode (a lone surrogate)") from None
        return
    if isinstance(value, int):
        if abs(value) > MAX_UID:
            raise SpecError(f"{where}: integer {value} out of range")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SpecError(f"{where}: {value} is not a finite number")
        return
    if isinstance(value, list):
        if len(value) > MAX_LIST:
            raise SpecError(f"{where}: list longer than {MAX_LIST}")
        for i, v in enumerate(value):
            _check_value(v, f"{where}[{i}]", uids, depth + 1)
        return
    if isinstance(value, dict):
        keys = set(value)
        if keys == {"$enum", "name"}:
            if value["$enum"] not in ENUM_TYPES:
                raise SpecError(f"{where}: {value['$enum']!r} is not a cudnn enum type this schema knows "
                                f"({', '.join(ENUM_TYPES)})")
            if not isinstance(value["name"], str) or not _ENUM_NAME.match(value["name"]):
                raise SpecError(f"{where}: enum name {value['name']!r} is not a valid name")
            return
        if keys == {"$tensor"}:
            if not isinstance(value["$tensor"], int) or value["$tensor"] not in uids:
                raise SpecError(f"{where}: names tensor uid {value['$tensor']!r}, which the graph does not have")
            return
        if keys == {"$tuple"} and isinstance(value["$tuple"], list):
            _check_value(value["$tuple"], where, uids, depth)
            return
        if keys == {"$dict"} and isinstance(value["$dict"], dict):
            if len(value["$dict"]) > MAX_PARAMS:
                raise SpecError(f"{where}: more than {MAX_PARAMS} entries")
            for k, v in value["$dict"].items():
                if not _IDENT.match(k):
                    raise SpecError(f"{where}: key {k!r} is not an identifier")
                _check_value(v, f"{where}.{k}", uids, depth + 1)
            return
        raise SpecError(f"{where}: unknown value form with keys {sorted(keys)}; expected $enum, $tensor, $tuple or $dict")
    raise SpecError(f"{where}: a {type(value).__name__} cannot be stored")


class GraphSpec(_Strict):
    """A cuDNN FE graph as a JSON document. Make one with :func:`from_pygraph`, :class:`SpecBuilder` or
    :func:`parse_spec`."""

    schema_version: int = Field(default=SPEC_SCHEMA_VERSION, alias="schema")
    name: str = Field(default="", max_length=MAX_NAME, description="cosmetic; not part of the key")
    context: Context = Field(default_factory=Context)
    graph: GraphFlags = Field(default_factory=GraphFlags)
    tensors: list[TensorDoc] = Field(min_length=1, max_length=MAX_TENSORS)
    nodes: list[NodeDoc] = Field(min_length=1, max_length=MAX_NODES)
    tuning: TuningSpec = Field(default_factory=TuningSpec)

    # a document is not changed once made (its key and canonical form are worked out once): change a copy
    model_config = ConfigDict(populate_by_name=True, frozen=True)
    _by_uid: dict[int, TensorDoc] = PrivateAttr(default_factory=dict)
    _producer: dict[int, int] = PrivateAttr(default_factory=dict)
    _canonical: GraphSpec | None = PrivateAttr(default=None)
    _key: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _validate_graph(self) -> GraphSpec:
        if self.schema_version != SPEC_SCHEMA_VERSION:
            raise SpecError(f"schema version {self.schema_version} is not supported (this is {SPEC_SCHEMA_VERSION})")
        for field in ("io_data_type", "intermediate_data_type", "compute_data_type"):
            _check_enum_name("data type", getattr(self.context, field), DATA_TYPES, f"context.{field}")
        by_uid: dict[int, TensorDoc] = {}
        for t in self.tensors:
            where = f"tensor {t.name or t.uid!r}"
            if t.uid in by_uid:
                raise SpecError(f"{where}: uid {t.uid} is used twice")
            by_uid[t.uid] = t
            _check_enum_name("data type", t.data_type, DATA_TYPES, where)
            _check_enum_name("scalar type", t.scalar_type, SCALAR_TYPES, where)
            if t.reordering_type is not None and not _ENUM_NAME.match(t.reordering_type):
                raise SpecError(f"{where}: reordering type {t.reordering_type!r} is not a valid name")
            if t.stride and t.dim and len(t.stride) != len(t.dim):
                raise SpecError(f"{where}: {len(t.dim)} dims but {len(t.stride)} strides")
            if any(not 0 <= d <= MAX_DIM for d in t.dim) or any(not 0 <= s <= MAX_DIM for s in t.stride):
                raise SpecError(f"{where}: dims {t.dim} / strides {t.stride} out of range [0, 2^40]")
            if math.prod(t.dim) > MAX_ELEMENTS:
                raise SpecError(f"{where}: dims {t.dim} make {math.prod(t.dim)} elements, over the limit of 2^40 "
                                "elements per tensor")
            if t.pass_by_value is not None and isinstance(t.pass_by_value, float) and not math.isfinite(t.pass_by_value):
                raise SpecError(f"{where}: embedded value {t.pass_by_value} is not finite")
            if isinstance(t.pass_by_value, int) and abs(t.pass_by_value) > MAX_UID:
                raise SpecError(f"{where}: embedded value out of range (a 64-bit integer)")
            if t.is_virtual and t.is_pass_by_value:
                raise SpecError(f"{where}: a tensor cannot be both virtual and pass-by-value")
        for t in self.tensors:
            if t.ragged_offset is not None and t.ragged_offset not in by_uid:
                raise SpecError(f"tensor {t.name or t.uid!r}: ragged offset uid {t.ragged_offset} is not a tensor of the graph")
        producer: dict[int, int] = {}
        uids = set(by_uid)
        for i, node in enumerate(self.nodes):
            where = f"node {i} ({node.name or node.type})"
            if node.type not in NODE_TYPES:
                raise SpecError(f"{where}: unknown node type {node.type!r}")
            _check_enum_name("data type", node.compute_data_type, DATA_TYPES, where)
            for kind, ports in (("input", node.inputs), ("output", node.outputs)):
                for port, uid in ports.items():
                    if not _IDENT.match(port):
                        raise SpecError(f"{where}: {kind} port {port!r} is not an identifier")
                    if uid not in by_uid:
                        raise SpecError(f"{where}: {kind} {port!r} names tensor uid {uid}, which the graph does not have")
            for port, uid in node.inputs.items():
                t = by_uid[uid]
                if uid in producer:
                    continue
                if t.is_virtual:
                    raise SpecError(f"{where}: input {port!r} is virtual tensor {t.name or uid!r}, "
                                    "not produced by an earlier node")
                if uid in (u for n in self.nodes[i:] for u in n.outputs.values()):
                    raise SpecError(f"{where}: input {port!r} reads tensor {t.name or uid!r} before the node that produces it")
            for port, uid in node.outputs.items():
                if uid in producer:
                    raise SpecError(f"{where}: output {port!r} tensor {by_uid[uid].name or uid!r} is already produced "
                                    f"by node {producer[uid]}")
                if by_uid[uid].is_pass_by_value:
                    raise SpecError(f"{where}: output {port!r} cannot be a pass-by-value tensor")
                producer[uid] = i
            for key, value in node.params.items():
                if not _IDENT.match(key):
                    raise SpecError(f"{where}: param name {key!r} is not an identifier")
                _check_value(value, f"{where} param {key!r}", uids)
        for t in self.tensors:
            if t.uid in producer:
                continue
            if t.is_virtual:
                raise SpecError(f"tensor {t.name or t.uid!r} is virtual but no node produces it")
            if not t.dim:
                raise SpecError(f"tensor {t.name or t.uid!r} is a graph input without dims")
        if not any(not by_uid[u].is_virtual for u in producer):
            raise SpecError("the graph has no output: mark a node output with set_output(True)")
        self._by_uid, self._producer = by_uid, producer
        self._check_bytes()
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> GraphSpec:
        """A copy; with ``update``, the document with those fields replaced, validated as a new one (pydantic's copy
        would keep this spec's key, canonical form and uid index for content that is no longer theirs). A spec is
        frozen: this is how one is changed."""
        if not update:
            return super().model_copy(deep=deep)
        return type(self).model_validate({**{name: getattr(self, name) for name in type(self).model_fields},
                                          **update})

    def _check_bytes(self) -> None:
        """Refuse a graph whose non-virtual tensors (those with dims) need more than :data:`MAX_GRAPH_BYTES`."""
        sizes = {t.uid: (storage_elements(t.dim, t.stride) if t.stride else math.prod(t.dim))
                 * DATA_TYPE_BITS[self.data_type_of(t)] // 8 for t in self.tensors if t.dim and not t.is_virtual}
        total = sum(sizes.values())
        if total > MAX_GRAPH_BYTES:
            largest = self._by_uid[max(sizes, key=lambda u: sizes[u])]
            raise SpecError(f"the graph's tensors need {total} bytes ({total / 2**40:.1f} TiB), over the limit of "
                            f"2^40 bytes (1 TiB); the largest is tensor {largest.name or largest.uid!r} "
                            f"(dims {largest.dim}, {sizes[largest.uid]} bytes)")

    # ----------------------------------------------------------- views

    def tensor(self, uid: int) -> TensorDoc:
        return self._by_uid[uid]

    def producer(self, uid: int) -> NodeDoc | None:
        """The node that writes tensor ``uid`` (None for a graph input)."""
        i = self._producer.get(uid)
        return None if i is None else self.nodes[i]

    def input_tensors(self) -> list[TensorDoc]:
        """Non-virtual tensors no node produces: what execute reads (pass-by-value scalars included)."""
        return [t for t in self.tensors if t.uid not in self._producer]

    def output_tensors(self) -> list[TensorDoc]:
        """Non-virtual tensors a node produces: what execute writes."""
        return [t for t in self.tensors if t.uid in self._producer and not t.is_virtual]

    def io_names(self) -> dict[str, int]:
        """Names of the graph's non-virtual tensors → uids (a tensor without a name, or whose name is
        shared, is reachable by uid only)."""
        names: dict[str, int] = {}
        shared: set[str] = set()
        for t in self.input_tensors() + self.output_tensors():
            if not t.name:
                continue
            if t.name in names:
                shared.add(t.name)
            names[t.name] = t.uid
        return {n: u for n, u in names.items() if n not in shared}

    def data_type_of(self, t: TensorDoc) -> str:
        """The tensor's data type, filled as FE fills an unset one."""
        if t.data_type is not None:
            return t.data_type
        node = self.producer(t.uid)
        if node is not None and node.type in FLOAT_STATS and node.outputs.get("Stats") == t.uid:
            return "FLOAT"
        ctx = self.context
        dt = (ctx.intermediate_data_type or ctx.io_data_type) if t.is_virtual else ctx.io_data_type
        return dt or "FLOAT"

    # ----------------------------------------------------------- canonical form and key

    def canonical_uids(self) -> dict[int, int]:
        """uid → canonical uid: user-assigned uids stay; the rest are numbered in graph order (node by node,
        input ports then output ports, each by port name; a tensor's ragged offset before the tensor), skipping
        the user-assigned ones."""
        fixed = {t.uid for t in self.tensors if t.uid_assigned}
        order: list[int] = []
        seen: set[int] = set()

        def visit(uid: int) -> None:
            if uid in seen:
                return
            seen.add(uid)
            ragged = self._by_uid[uid].ragged_offset
            if ragged is not None:
                visit(ragged)
            order.append(uid)

        for node in self.nodes:
            for ports in (node.inputs, node.outputs):
                for port in sorted(ports):
                    visit(ports[port])
            for uid in _param_tensors(node.params):
                visit(uid)
        for t in self.tensors:
            visit(t.uid)
        mapping, nxt = {}, 1
        for uid in order:
            if uid in fixed:
                mapping[uid] = uid
                continue
            while nxt in fixed:
                nxt += 1
            mapping[uid] = nxt
            nxt += 1
        return mapping

    def canonical(self) -> dict[str, Any]:
        """The key-relevant content (see the module docstring)."""
        remap = self.canonical_uids()
        ctx = self.context
        io = ctx.io_data_type
        tensors = []
        for t in sorted(self.tensors, key=lambda t: remap[t.uid]):
            node = self.producer(t.uid)
            keep_dim = node is None or t.dim_assigned or node.type in PUSHED_OUTPUT_DIMS
            keep_stride = node is None or t.stride_assigned
            tensors.append({
                "uid": remap[t.uid], "data_type": self.data_type_of(t),
                "dim": t.dim if keep_dim else None, "stride": t.stride if keep_stride else None,
                "is_virtual": t.is_virtual, "is_pass_by_value": t.is_pass_by_value, "pass_by_value": t.pass_by_value,
                "reordering_type": t.reordering_type,
                "ragged_offset": None if t.ragged_offset is None else remap[t.ragged_offset],
                "ragged_offset_multiplier": t.ragged_offset_multiplier, "alignment_value": t.alignment_value,
                "scalar_type": t.scalar_type,
            })
        nodes = [{
            "type": n.type,
            "compute_data_type": n.compute_data_type or ctx.compute_data_type or io,
            "inputs": {p: remap[u] for p, u in n.inputs.items()},
            "outputs": {p: remap[u] for p, u in n.outputs.items()},
            "params": _canonical_params(n.type, n.params, remap),
        } for n in self.nodes]
        return {
            "schema": self.schema_version,
            "context": {"io_data_type": io, "intermediate_data_type": ctx.intermediate_data_type or io,
                        "compute_data_type": ctx.compute_data_type or io},
            "graph": self.graph.model_dump(),
            "tensors": tensors,
            "nodes": nodes,
            "tuning": self.tuning.model_dump(),
        }

    def canonical_json(self) -> str:
        return canonical_json(self.canonical())

    @property
    def graph_key(self) -> str:
        """sha256 over the schema version and the canonical JSON of this document (64 hex chars), worked out once
        (a spec is frozen; :meth:`model_copy` with ``update`` makes a new one; a nested list or tensor changed in
        place is not seen: change a copy)."""
        if self._key is None:
            self._key = graph_key(self, fresh=True)
        return self._key

    def canonical_document(self) -> GraphSpec:
        """This document with canonical uids and tensors in uid order (what workers build), names and flags kept."""
        if self._canonical is not None:
            return self._canonical
        remap = self.canonical_uids()
        uids = [t.uid for t in self.tensors]
        # ports in the order the key reads them (sorted): FE lowers a POINTWISE node's inputs by position, in the
        # order its dict holds them, so a document listing IN_1 before IN_0 would build b - a under a - b's key
        ports_sorted = all(list(ports) == sorted(ports) for n in self.nodes for ports in (n.inputs, n.outputs))
        if all(k == v for k, v in remap.items()) and uids == sorted(uids) and ports_sorted:
            self._canonical = self
            return self
        doc = self.to_json()
        for t in doc["tensors"]:
            t["uid"] = remap[t["uid"]]
            if t.get("ragged_offset") is not None:
                t["ragged_offset"] = remap[t["ragged_offset"]]
        for n in doc["nodes"]:
            for section in ("inputs", "outputs"):
                n[section] = {p: remap[n[section][p]] for p in sorted(n[section])}
            n["params"] = _map_tensors(n["params"], remap)
        doc["tensors"].sort(key=lambda t: t["uid"])
        self._canonical = parse_spec(doc)
        return self._canonical

    def to_json(self) -> dict[str, Any]:
        """The full document (names included), as written to files and sent to the server."""
        return self.model_dump(by_alias=True, mode="json")


def _param_tensors(value: Any) -> list[int]:
    if isinstance(value, dict):
        if "$tensor" in value:
            return [value["$tensor"]]
        return [u for v in value.values() for u in _param_tensors(v)]
    if isinstance(value, list):
        return [u for v in value for u in _param_tensors(v)]
    return []


def _map_tensors(value: Any, remap: dict[int, int]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$tensor"}:
            return {"$tensor": remap[value["$tensor"]]}
        return {k: _map_tensors(v, remap) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, remap) for v in value]
    return value


def _is_default(value: Any, default: Any) -> bool:
    if default == "zeros":
        return isinstance(value, list) and all(v == 0 for v in value)
    if default == "ones":
        return isinstance(value, list) and all(v == 1 for v in value)
    return value == default and type(value) is type(default)


def _canonical_params(node_type: str, params: dict[str, Any], remap: dict[int, int]) -> dict[str, Any]:
    out = {k: _map_tensors(v, remap) for k, v in params.items() if v is not None}
    if node_type in _CONV and "padding" not in out and out.get("pre_padding") == out.get("post_padding") is not None:
        out["padding"] = out.pop("pre_padding")
        out.pop("post_padding")
    defaults = PARAM_DEFAULTS.get(node_type, {})
    return {k: v for k, v in out.items() if not (k in defaults and _is_default(v, defaults[k]))}


# ------------------------------------------------------------------ parsing and keys


def storage_elements(dims: tuple[int, ...] | list[int], strides: tuple[int, ...] | list[int]) -> int:
    """Elements a strided tensor spans in memory."""
    if any(d == 0 for d in dims):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(dims, strides))


def parse_spec(obj: GraphSpec | dict[str, Any] | str | bytes) -> GraphSpec:
    """Validate a spec given as a model, a dict or JSON text; raise :class:`SpecError` naming the problem."""
    if isinstance(obj, GraphSpec):
        return obj
    try:
        if isinstance(obj, (str, bytes)):
            try:
                obj = json.loads(obj)
            except ValueError as exc:  # also an integer over Python's digit limit
                raise SpecError(f"spec is not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(obj, dict):
            raise SpecError(f"a spec must be a JSON object, not {type(obj).__name__}")
        if obj.get("schema") == 1:
            raise SpecError("schema 1 (plancache's earlier op-list format) is no longer read: write the graph again "
                            "with plancache.spec.SpecBuilder (the same method names) or from_pygraph and use its "
                            "schema-2 document, spec.to_json() (docs/SPEC.md)")
        check_sizes(obj)
        return GraphSpec.model_validate(obj)
    except json.JSONDecodeError as exc:
        raise SpecError(f"spec is not valid JSON: {exc}") from None
    except RecursionError:
        raise SpecError("spec is nested too deeply") from None
    except ValidationError as exc:
        raise SpecError(f"invalid spec: {validation_message(exc.errors())}") from None


def _count(where: str, value: Any, limit: int) -> None:
    if isinstance(value, (list, dict)) and len(value) > limit:
        raise SpecError(f"{where}: {len(value)} entries; the limit is {limit}")


def _length(where: str, value: Any, limit: int = MAX_NAME) -> None:
    if isinstance(value, str) and len(value) > limit:
        raise SpecError(f"{where}: {len(value)} characters; the limit is {limit}")


def check_sizes(doc: dict[str, Any]) -> None:
    """Refuse a document over a count or length limit before it is validated, so that a huge one costs a look
    at its top level, not a model per item: tensors, nodes, ports, params, names, rank."""
    _length("name", doc.get("name"))
    tensors, nodes = doc.get("tensors"), doc.get("nodes")
    _count("tensors", tensors, MAX_TENSORS)
    _count("nodes", nodes, MAX_NODES)
    if isinstance(tensors, list):
        for i, t in enumerate(tensors):
            if isinstance(t, dict):
                _length(f"tensors[{i}].name", t.get("name"))
                _count(f"tensors[{i}].dim", t.get("dim"), MAX_RANK)
                _count(f"tensors[{i}].stride", t.get("stride"), MAX_RANK)
    for i, n in enumerate(nodes if isinstance(nodes, list) else ()):
        if not isinstance(n, dict):
            continue
        _length(f"nodes[{i}].name", n.get("name"))
        for section in ("inputs", "outputs"):
            ports = n.get(section)
            _count(f"nodes[{i}].{section}", ports, MAX_PORTS)
            for port, tensor in (ports.items() if isinstance(ports, dict) else ()):
                _length(f"nodes[{i}].{section}: a port name", port)
                _length(f"nodes[{i}].{section}[{str(port)[:40]!r}]", tensor)
        _count(f"nodes[{i}].params", n.get("params"), MAX_PARAMS)


def graph_key(spec: GraphSpec | dict[str, Any] | str | bytes, *, fresh: bool = False) -> str:
    """sha256 over the schema version and the canonical JSON of the spec (64 hex chars); a spec's own is worked out
    once (:attr:`GraphSpec.graph_key`). ``fresh``: from the document's content now, for checking a key against a
    document that came from elsewhere."""
    s = parse_spec(spec)
    if not fresh:
        return s.graph_key
    return hashlib.sha256(f"plancache-graphspec/v{SPEC_SCHEMA_VERSION}\n{s.canonical_json()}".encode()).hexdigest()


# ------------------------------------------------------------------ from a user's pygraph


def _enum_name(value: Any, where: str) -> str | None:
    if value is None:
        return None
    name = getattr(value, "name", None)
    if not isinstance(name, str) or not type(value).__module__.startswith("cudnn"):
        if type(value).__module__ == "torch":  # FE accepts torch dtypes where it takes data types
            from cudnn.datatypes import _torch_to_cudnn_data_type

            return _enum_name(_torch_to_cudnn_data_type(value), where)
        raise UnsupportedGraph(f"{where}: {value!r} is not a cudnn enum")
    return name


def _encode_value(value: Any, where: str) -> Any:
    from cudnn.graph_types import Tensor

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Tensor):
        return {"$tensor": value.uid}
    t = type(value)
    if hasattr(t, "__members__") and isinstance(getattr(value, "name", None), str):
        if not t.__module__.startswith("cudnn"):
            raise UnsupportedGraph(f"{where} holds {t.__module__}.{t.__qualname__}, an enum outside cudnn")
        return {"$enum": t.__qualname__, "name": value.name}
    if isinstance(value, (list, tuple)):
        items = [_encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else {"$tuple": items}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"$dict": {k: _encode_value(v, f"{where}.{k}") for k, v in value.items()}}
    raise UnsupportedGraph(f"{where} holds a {t.__module__}.{t.__qualname__}, which a graph spec cannot represent "
                           "(callbacks such as score_mod cannot be cached)")


def is_pygraph(obj: Any) -> bool:
    """Whether ``obj`` looks like a ``cudnn.pygraph`` (checked without importing cudnn)."""
    return hasattr(obj, "_nodes") and hasattr(obj, "_tensor_by_uid") and hasattr(obj, "_context")


def from_pygraph(graph: Any, *, tuning: TuningSpec | None = None, name: str | None = None) -> GraphSpec:
    """The spec of a user's ``cudnn.pygraph`` (constructed, not yet built), with ``.graph_key`` and ``.to_json()``.

    Reads FE 1.32's pure-Python IR; raises :class:`UnsupportedGraph` naming what cannot be represented."""
    for attr in ("_nodes", "_tensor_by_uid", "_context", "_cpp_graph_kwargs"):
        if not hasattr(graph, attr):
            raise UnsupportedGraph(f"{type(graph).__name__} is not a cudnn.pygraph of FE 1.32 (no {attr}); "
                                   "plancache reads FE's Python IR")
    if getattr(graph, "_lowered_graph", None) is not None or getattr(graph, "_planning_done", False):
        raise UnsupportedGraph("the graph is already lowered or built; hand it to plancache before build()")
    kwargs = graph._cpp_graph_kwargs
    unknown = sorted(set(kwargs) - set(GRAPH_FLAGS) - {"name", "handle", "kernel_cache", "device_property",
                                                        "cuda_graph_retention"})
    if unknown:
        raise UnsupportedGraph(f"graph argument(s) {', '.join(unknown)} are not part of the spec schema")
    ctx = graph._context
    tensors = []
    for t in graph._tensor_by_uid.values():
        where = f"tensor {t.name!r}"
        tensors.append({
            "uid": int(t.uid), "name": str(t.name or ""), "data_type": _enum_name(t.data_type, where),
            "dim": [int(d) for d in (t.dim or [])], "stride": [int(s) for s in (t.stride or [])],
            "is_virtual": bool(t.is_virtual), "is_pass_by_value": bool(t.is_pass_by_value),
            "pass_by_value": t.pass_by_value, "uid_assigned": bool(t.uid_assigned),
            "dim_assigned": bool(t.dim_assigned), "stride_assigned": bool(t.stride_assigned),
            "reordering_type": _enum_name(t.reordering_type, where),
            "ragged_offset": None if t.ragged_offset is None else int(t.ragged_offset.uid),
            "ragged_offset_multiplier": int(t.ragged_offset_multiplier or 1),
            "alignment_value": int(t.alignment_value or 1), "scalar_type": _enum_name(t.scalar_type, where),
        })
    nodes = []
    for n in graph._nodes:
        where = f"node {n.name!r}"
        nodes.append({
            "name": str(n.name), "type": n.node_type.name,
            "compute_data_type": _enum_name(n.compute_data_type, where),
            "inputs": {p: int(t.uid) for p, t in n.inputs.items() if t is not None},
            "outputs": {p: int(t.uid) for p, t in n.outputs.items() if t is not None},
            "params": {k: _encode_value(v, f"{where} param {k!r}") for k, v in n.params.items()},
        })
    doc = {
        "schema": SPEC_SCHEMA_VERSION,
        "name": str(name if name is not None else kwargs.get("name", "")),
        "context": {f: _enum_name(getattr(ctx, f), f"context.{f}")
                    for f in ("io_data_type", "intermediate_data_type", "compute_data_type")},
        "graph": {**{k: kwargs[k] for k in ("sm_count", "sm_version", "is_dynamic_shape_enabled",
                                            "is_override_shape_enabled") if k in kwargs},
                  "is_cuda_graph_replay_expected": bool(getattr(graph, "is_cuda_graph_replay_expected", False))},
        "tensors": tensors,
        "nodes": nodes,
        "tuning": (tuning or TuningSpec()).model_dump(),
    }
    try:
        return parse_spec(doc)
    except UnsupportedGraph:
        raise
    except SpecError as exc:  # FE built it, the schema cannot hold it: a graph the spec cannot represent
        raise UnsupportedGraph(exc.message) from None


# ------------------------------------------------------------------ the builder

#: The data types :class:`SpecBuilder` takes, by their torch names.
DType = Literal["float16", "bfloat16", "float32", "int32", "int64"]
_FE_DTYPE = {torch_name: fe for fe, torch_name in TORCH_DTYPES.items() if torch_name in get_args(DType)}
Dims = tuple[int, ...]
#: An op's shape rule: (op, input dims by argument, other arguments) → (output dims, the node's FE params);
#: a ValueError says what is wrong with the call.
Lower = Callable[[str, dict[str, Dims], dict[str, Any]], tuple[Dims, dict[str, Any]]]


def contiguous_strides(dims: list[int] | tuple[int, ...]) -> list[int]:
    """Row-major strides for ``dims``."""
    strides, acc = [], 1
    for d in reversed(dims):
        strides.append(acc)
        acc *= d
    return strides[::-1]


def channels_last_strides(dims: list[int] | tuple[int, ...]) -> list[int]:
    """NHWC-style strides for logical N, C, spatial... dims."""
    n, c, *spatial = dims
    strides = [0] * len(dims)
    strides[1] = 1
    acc = c
    for i in range(len(spatial) - 1, -1, -1):
        strides[2 + i] = acc
        acc *= spatial[i]
    strides[0] = acc
    return strides


def _broadcast(a: Dims, b: Dims) -> Dims | None:
    if len(a) != len(b):
        return None
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def _ints(label: str, values: Any, lo: int, length: int | None = None) -> list[int]:
    """``values`` as a list of integers in [lo, MAX_DIM], of rank 1..MAX_RANK (or exactly ``length``)."""
    if not isinstance(values, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{label} {values!r} must be a list of integers")
    if length is None and not 1 <= len(values) <= MAX_RANK or length is not None and len(values) != length:
        raise ValueError(f"{label} {list(values)} needs {length or f'1 to {MAX_RANK}'} values")
    if any(not lo <= v <= MAX_DIM for v in values):
        raise ValueError(f"{label} {list(values)} must all be in [{lo}, 2^40]")
    return list(values)


def _number(label: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{label} {value!r} must be a finite number")
    return float(value)


def _conv(op: str, dims: dict[str, Dims], args: dict[str, Any]) -> tuple[Dims, dict[str, Any]]:
    x, w = dims["image"], dims["weight"]
    if len(x) < 4 or len(x) != len(w):
        raise ValueError(f"image {x} and weight {w} must both have rank >= 4 and equal rank")
    spatial = len(x) - 2
    params = {label: [lo] * spatial if args[label] is None else _ints(label, args[label], lo, spatial)
              for label, lo in (("padding", 0), ("stride", 1), ("dilation", 1))}
    if w[1] != x[1]:
        raise ValueError(f"weight input channels {w[1]} != image channels {x[1]} (grouped conv is not supported)")
    pad, stride, dil = params["padding"], params["stride"], params["dilation"]
    out = [x[0], w[0]]
    for i in range(spatial):
        size = (x[2 + i] + 2 * pad[i] - dil[i] * (w[2 + i] - 1) - 1) // stride[i] + 1
        if size < 1:
            raise ValueError(f"spatial dim {i}: filter {w[2 + i]} does not fit image {x[2 + i]} with padding {pad[i]}")
        out.append(size)
    return tuple(out), params


def _matmul(op: str, dims: dict[str, Dims], args: dict[str, Any]) -> tuple[Dims, dict[str, Any]]:
    a, b = dims["A"], dims["B"]
    if len(a) < 3 or len(a) != len(b):
        raise ValueError(f"A {a} and B {b} must have equal rank >= 3 (batch, M, K) @ (batch, K, N)")
    if a[-1] != b[-2]:
        raise ValueError(f"A {a} and B {b}: inner dims {a[-1]} != {b[-2]}")
    batch = _broadcast(a[:-2], b[:-2])
    if batch is None:
        raise ValueError(f"batch dims of A {a[:-2]} and B {b[:-2]} do not broadcast")
    return batch + (a[-2], b[-1]), {"padding": 0.0}


def _pointwise(onto_first: bool) -> Lower:
    """A POINTWISE node of mode ``op``: one input, or two that broadcast (onto the first's shape, or to a
    common one); its other arguments (a relu slope, a swish beta) become params."""

    def lower(op: str, dims: dict[str, Dims], args: dict[str, Any]) -> tuple[Dims, dict[str, Any]]:
        (first, a), *rest = dims.items()
        out = a
        for second, b in rest:
            both = _broadcast(a, b)
            if both is None or onto_first and both != a:
                raise ValueError(f"{second} {b} does not broadcast to {first} {a}")
            out = both
        return out, {"mode": op, **{k: _number(k, v) for k, v in args.items() if v is not None}}

    return lower


_REDUCTION_MODES = {"AMAX": "AMAX", "SUM": "ADD"}  # the builder's name → cudnn.reduction_mode


def _reduction(op: str, dims: dict[str, Dims], args: dict[str, Any]) -> tuple[Dims, dict[str, Any]]:
    x, mode = dims["input"], args["mode"]
    if mode not in _REDUCTION_MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(_REDUCTION_MODES)}")
    out = _ints("reduction dims", args["dims"], 1)
    if len(out) != len(x) or any(o not in (1, i) for o, i in zip(out, x)):
        raise ValueError(f"reduction dims {out} must match input {x} with 1 on reduced axes")
    return tuple(out), {"mode": {"$enum": "reduction_mode", "name": _REDUCTION_MODES[mode]}}


def _sdpa(op: str, dims: dict[str, Dims], args: dict[str, Any]) -> tuple[Dims, dict[str, Any]]:
    q, k, v = dims["q"], dims["k"], dims["v"]
    if not (len(q) == len(k) == len(v) == 4):
        raise ValueError(f"q {q}, k {k}, v {v} must all be 4-D (batch, heads, seq, head_dim)")
    if not (q[0] == k[0] == v[0]):
        raise ValueError(f"batch sizes differ: q {q[0]}, k {k[0]}, v {v[0]}")
    if k[1] != v[1] or q[1] % k[1]:
        raise ValueError(f"heads: q {q[1]} must be a multiple of k/v heads {k[1]}/{v[1]} (GQA), k and v equal")
    if k[2] != v[2]:
        raise ValueError(f"k seq {k[2]} != v seq {v[2]}")
    if q[3] != k[3]:
        raise ValueError(f"q head_dim {q[3]} != k head_dim {k[3]}")
    if not isinstance(args["causal"], bool):
        raise ValueError(f"causal {args['causal']!r} must be True or False")
    scale = args["attn_scale"]
    params: dict[str, Any] = {"generate_stats": False,
                              "attn_scale": q[3] ** -0.5 if scale is None else _number("attn_scale", scale)}
    if args["causal"]:
        params.update(diagonal_alignment={"$enum": "diagonal_alignment", "name": "TOP_LEFT"},
                      diagonal_band_right_bound=0)
    return (q[0], q[1], q[2], v[3]), params


@dataclass(frozen=True)
class _Op:
    """One op of the builder: the FE node it writes and its shape rule."""

    node_type: str
    #: builder argument → the FE input port it feeds, in call order
    inputs: dict[str, str]
    output: str
    lower: Lower
    #: whether an output of this op defaults to float32 (else the graph's io_data_type)
    float32_output: bool = False


_ONTO, _BROADCAST = _pointwise(onto_first=True), _pointwise(onto_first=False)
_UNARY = {"input": "IN_0"}
#: Every op of :class:`SpecBuilder`, declared once.
_OPS: dict[str, _Op] = {
    "conv_fprop": _Op("CONV_FPROP", {"image": "image", "weight": "weight"}, "Y", _conv),
    "matmul": _Op("MATMUL", {"A": "A", "B": "B"}, "C", _matmul),
    "bias": _Op("POINTWISE", {"input": "IN_0", "bias": "IN_1"}, "OUT_0", _ONTO),
    "scale": _Op("POINTWISE", {"input": "IN_0", "scale": "IN_1"}, "OUT_0", _ONTO),
    "add": _Op("POINTWISE", {"a": "IN_0", "b": "IN_1"}, "OUT_0", _BROADCAST),
    "mul": _Op("POINTWISE", {"a": "IN_0", "b": "IN_1"}, "OUT_0", _BROADCAST),
    **{op: _Op("POINTWISE", _UNARY, "OUT_0", _ONTO) for op in ("relu", "gelu", "sigmoid", "tanh", "swish")},
    "reduction": _Op("REDUCTION", {"input": "input"}, "OUT_0", _reduction, float32_output=True),
    "sdpa": _Op("SDPA", {"q": "q", "k": "k", "v": "v"}, "O", _sdpa),
}


@dataclass
class _Tensor:
    """A tensor of a builder: an input, or the output of node ``node``."""

    name: str
    dims: Dims
    strides: Dims | None  # None: an op output's, row-major unless set
    dtype: str | None  # None: an op output's, by its op
    pass_by_value: bool = False
    node: int | None = None
    output: bool = False


@dataclass(frozen=True)
class _Node:
    op: str
    name: str
    inputs: tuple[_Tensor, ...]
    output: _Tensor
    params: dict[str, Any]


def _check_layout(where: str, dims: Dims, strides: Any) -> Dims:
    """``strides`` checked for ``dims``: as many, none negative, and no two elements at one address."""
    try:
        checked = tuple(_ints("strides", strides, 0, len(dims)))
    except ValueError as exc:
        raise SpecError(f"{where}: {exc}") from None
    reach = 1
    for s, d in sorted((s, d) for s, d in zip(checked, dims) if d > 1):  # strides of non-unit dims must nest
        if s < reach:
            raise SpecError(f"{where}: strides {list(checked)} make elements of dims {list(dims)} overlap")
        reach = s * d
    return checked


def _data_type(where: str, value: Any) -> str:
    if value not in _FE_DTYPE:
        raise SpecError(f"{where}: data type {value!r} is not one of {', '.join(_FE_DTYPE)}")
    return str(value)


class TensorRef:
    """A tensor handle returned by the builder; mirrors the cudnn tensor setters for outputs."""

    def __init__(self, builder: SpecBuilder, tensor: _Tensor) -> None:
        self._b, self._t = builder, tensor

    @property
    def name(self) -> str:
        return self._t.name

    def set_output(self, is_output: bool = True) -> TensorRef:
        self._op_output("set_output").output = bool(is_output)
        return self

    def set_name(self, name: str) -> TensorRef:
        self._b._rename(self._op_output("set_name"), name)
        return self

    def set_dim(self, dims: list[int]) -> TensorRef:
        t = self._op_output("set_dim")
        if list(dims) != list(t.dims):
            raise SpecError(f"tensor {t.name!r}: set_dim {list(dims)}, but {self._b._nodes[t.node or 0].op} gives "
                            f"{list(t.dims)}")
        return self

    def set_stride(self, strides: list[int]) -> TensorRef:
        t = self._op_output("set_stride")
        t.strides = _check_layout(f"tensor {t.name!r}", t.dims, strides)
        return self

    def set_data_type(self, dtype: DType) -> TensorRef:
        t = self._op_output("set_data_type")
        t.dtype = _data_type(f"tensor {t.name!r}", dtype)
        return self

    def _op_output(self, setter: str) -> _Tensor:
        if self._t.node is None:
            raise SpecError(f"tensor {self._t.name!r} is an input; {setter} is for op outputs")
        return self._t

    def __repr__(self) -> str:
        return f"TensorRef({self.name!r})"


class SpecBuilder:
    """Write a graph document with the cudnn.pygraph method names you know::

        b = SpecBuilder(io_data_type="bfloat16")
        X = b.tensor("X", dim=[32, 128, 56, 56], stride=channels_last_strides([32, 128, 56, 56]))
        ...
        Y = b.relu(b.bias(b.conv_fprop(X, W, padding=[1, 1]), B))
        Y.set_output(True).set_name("Y")
        spec = b.build()

    Each call is checked as it is made (shapes inferred, layouts and arguments checked); a
    :class:`~plancache.errors.SpecError` names the node or tensor at fault.
    """

    def __init__(self, io_data_type: DType, intermediate_data_type: DType = "float32",
                 compute_data_type: DType = "float32", name: str = "", tuning: TuningSpec | None = None) -> None:
        self._io = _data_type("io_data_type", io_data_type)
        self._context = {"io_data_type": _FE_DTYPE[self._io],
                         "intermediate_data_type": _FE_DTYPE[_data_type("intermediate_data_type", intermediate_data_type)],
                         "compute_data_type": _FE_DTYPE[_data_type("compute_data_type", compute_data_type)]}
        self._name, self._tuning = name, tuning or TuningSpec()
        self._tensors: dict[str, _Tensor] = {}
        self._nodes: list[_Node] = []

    # inputs
    def tensor(self, name: str, dim: list[int], stride: list[int] | None = None, data_type: DType | None = None,
               is_pass_by_value: bool = False) -> TensorRef:
        where = f"tensor {name!r}"
        try:
            dims = tuple(_ints("dims", dim, 1))
        except ValueError as exc:
            raise SpecError(f"{where}: {exc}") from None
        strides = _check_layout(where, dims, contiguous_strides(dims) if stride is None else stride)
        dtype = _data_type(where, data_type or ("float32" if is_pass_by_value else self._io))
        if is_pass_by_value and (any(d != 1 for d in dims) or dtype != "float32"):
            raise SpecError(f"{where}: a pass-by-value scalar must be float32 with all dims 1")
        return TensorRef(self, self._add(_Tensor(name, dims, strides, dtype, bool(is_pass_by_value))))

    def tensor_like(self, tensor: Any, name: str, is_pass_by_value: bool | None = None) -> TensorRef:
        """An input shaped like a torch tensor (dims, strides, dtype). As in cudnn, a CPU tensor becomes
        pass-by-value unless ``is_pass_by_value`` says otherwise."""
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _FE_DTYPE:
            raise SpecError(f"tensor_like({name!r}): unsupported dtype {tensor.dtype}")
        by_value = str(tensor.device) == "cpu" if is_pass_by_value is None else is_pass_by_value
        return self.tensor(name, list(tensor.shape), list(tensor.stride()), cast(DType, dtype), is_pass_by_value=by_value)

    # ops
    def conv_fprop(self, image: TensorRef, weight: TensorRef, padding: list[int] | None = None,
                   stride: list[int] | None = None, dilation: list[int] | None = None, name: str | None = None) -> TensorRef:
        return self._op("conv_fprop", {"image": image, "weight": weight},
                        {"padding": padding, "stride": stride, "dilation": dilation}, name)

    def matmul(self, A: TensorRef, B: TensorRef, name: str | None = None) -> TensorRef:  # noqa: N803
        return self._op("matmul", {"A": A, "B": B}, {}, name)

    def bias(self, input: TensorRef, bias: TensorRef, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("bias", {"input": input, "bias": bias}, {}, name)

    def scale(self, input: TensorRef, scale: TensorRef, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("scale", {"input": input, "scale": scale}, {}, name)

    def add(self, a: TensorRef, b: TensorRef, name: str | None = None) -> TensorRef:
        return self._op("add", {"a": a, "b": b}, {}, name)

    def mul(self, a: TensorRef, b: TensorRef, name: str | None = None) -> TensorRef:
        return self._op("mul", {"a": a, "b": b}, {}, name)

    def relu(self, input: TensorRef, negative_slope: float | None = None, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("relu", {"input": input}, {"negative_slope": negative_slope}, name)

    def gelu(self, input: TensorRef, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("gelu", {"input": input}, {}, name)

    def sigmoid(self, input: TensorRef, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("sigmoid", {"input": input}, {}, name)

    def tanh(self, input: TensorRef, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("tanh", {"input": input}, {}, name)

    def swish(self, input: TensorRef, swish_beta: float | None = None, name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("swish", {"input": input}, {"swish_beta": swish_beta}, name)

    def reduction(self, input: TensorRef, mode: Literal["AMAX", "SUM"], dims: list[int], name: str | None = None) -> TensorRef:  # noqa: A002
        return self._op("reduction", {"input": input}, {"mode": mode, "dims": dims}, name)

    def sdpa(self, q: TensorRef, k: TensorRef, v: TensorRef, attn_scale: float | None = None,
             causal: bool = False, name: str | None = None) -> TensorRef:
        return self._op("sdpa", {"q": q, "k": k, "v": v}, {"attn_scale": attn_scale, "causal": causal}, name)

    def build(self) -> GraphSpec:
        """The schema-2 document of the graph: outputs are the tensors marked with ``set_output(True)``;
        every input must be used and every other op output consumed."""
        if not any(t.output for t in self._tensors.values()):
            raise SpecError("no tensor is marked as an output (call .set_output(True))")
        consumed = {id(t) for n in self._nodes for t in n.inputs}
        for t in self._tensors.values():
            if id(t) not in consumed and not t.output:
                raise SpecError(f"input tensor {t.name!r} is not used by any node" if t.node is None else
                                f"tensor {t.name!r} is neither used by a node nor marked with set_output(True)")
        # uids: inputs and outputs by name, then the virtual tensors in graph order
        order = sorted((t for t in self._tensors.values() if t.node is None or t.output), key=lambda t: t.name)
        order += [n.output for n in self._nodes if not n.output.output]
        uid = {id(t): i for i, t in enumerate(order, 1)}
        tensors = []
        for t in order:
            op = None if t.node is None else _OPS[self._nodes[t.node].op]
            virtual = op is not None and not t.output
            dtype = t.dtype or ("float32" if op is not None and op.float32_output else self._io)
            tensors.append({
                "uid": uid[id(t)], "name": t.name, "data_type": None if virtual else _FE_DTYPE[dtype],
                "dim": list(t.dims), "stride": list(t.strides or contiguous_strides(t.dims)), "is_virtual": virtual,
                "is_pass_by_value": t.pass_by_value, "uid_assigned": not virtual,
                "dim_assigned": not virtual or op is not None and op.node_type in PUSHED_OUTPUT_DIMS,
                "stride_assigned": not virtual,
            })
        nodes = [{
            "name": n.name, "type": _OPS[n.op].node_type, "compute_data_type": self._context["compute_data_type"],
            "inputs": {port: uid[id(t)] for port, t in zip(_OPS[n.op].inputs.values(), n.inputs)},
            "outputs": {_OPS[n.op].output: uid[id(n.output)]}, "params": n.params,
        } for n in self._nodes]
        return parse_spec({"schema": SPEC_SCHEMA_VERSION, "name": self._name, "context": self._context,
                           "tensors": tensors, "nodes": nodes, "tuning": self._tuning.model_dump()})

    def _add(self, t: _Tensor) -> _Tensor:
        self._check_new(t.name)
        self._tensors[t.name] = t
        return t

    def _check_new(self, name: str) -> None:
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
            raise SpecError(f"tensor name {str(name)[:40]!r}: 1 to {MAX_NAME} characters")
        if name in self._tensors:
            raise SpecError(f"tensor {name!r} is already defined")

    def _op(self, op: str, operands: dict[str, TensorRef], args: dict[str, Any], name: str | None) -> TensorRef:
        spec, index = _OPS[op], len(self._nodes)
        node_name = name or f"{op}_{index}"
        where = f"node {index} ({node_name})"
        inputs = []
        for arg, ref in operands.items():
            if not isinstance(ref, TensorRef) or ref._b is not self:
                raise SpecError(f"{where}: {arg} is not a tensor of this SpecBuilder")
            if ref._t.pass_by_value and not (spec.node_type == "POINTWISE" and len(spec.inputs) == 2):
                raise SpecError(f"{where}: pass-by-value tensor {ref.name!r} can only feed bias, scale, add or mul")
            inputs.append(ref._t)
        try:
            dims, params = spec.lower(op, {arg: t.dims for arg, t in zip(operands, inputs)}, args)
        except ValueError as exc:
            raise SpecError(f"{where}: {exc}") from None
        out = self._add(_Tensor(f"{node_name}.{'output' if spec.output == 'OUT_0' else spec.output}", dims, None, None,
                                node=index))
        self._nodes.append(_Node(op, node_name, tuple(inputs), out, params))
        return TensorRef(self, out)

    def _rename(self, t: _Tensor, name: str) -> None:
        if name != t.name:
            self._check_new(name)
            del self._tensors[t.name]
            t.name = name
            self._tensors[name] = t


__all__ = [
    "GraphSpec", "SpecBuilder", "TensorRef", "TuningSpec", "channels_last_strides", "contiguous_strides", "from_pygraph",
    "graph_key", "parse_spec",
]
