"""The spec document (schema 2, ``docs/SPEC.md``): its model, its validation and its views.

The document records what FE's pure-Python IR holds: the graph context (data types), graph flags, every tensor (uid,
dims, strides, data type, virtual / pass-by-value flags, ragged offsets, ...) and every node (node type, port → tensor
uid, params). Enums are written by name; a param value is JSON, or one of the typed forms
``{"$enum": TYPE, "name": NAME}``, ``{"$tensor": UID}``, ``{"$tuple": [...]}``, ``{"$dict": {...}}``. The server
validates a document (structure, enum spellings, size limits) without nvidia-cudnn-frontend or a GPU; full validation
happens where FE lowers it (:mod:`plancache.gpu.fegraph`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from .. import SPEC_SCHEMA_VERSION
from ..canonical import canonical_json
from ..errors import SpecError
from ..validation import StrictModel, validation_message
from . import keys
from .limits import (
    ENUM_NAME,
    IDENTIFIER,
    MAX_DEPTH,
    MAX_DIM,
    MAX_ELEMENTS,
    MAX_GRAPH_BYTES,
    MAX_LIST,
    MAX_NAME,
    MAX_NODES,
    MAX_PARAMS,
    MAX_PORTS,
    MAX_RANK,
    MAX_TENSORS,
    MAX_UID,
    check_sizes,
)
from .nodes import NODE_TYPES, kind_of
from .vocabulary import DATA_TYPE_BITS, DATA_TYPES, ENUM_TYPES, HEURISTIC_MODES, SCALAR_TYPES


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
            if not isinstance(value["name"], str) or not ENUM_NAME.match(value["name"]):
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
                if not IDENTIFIER.match(k):
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
            if t.reordering_type is not None and not ENUM_NAME.match(t.reordering_type):
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
                    if not IDENTIFIER.match(port):
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
                if not IDENTIFIER.match(key):
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
        if node is not None and any(node.outputs.get(port) == t.uid for port in kind_of(node.type).float_outputs):
            return "FLOAT"
        ctx = self.context
        dt = (ctx.intermediate_data_type or ctx.io_data_type) if t.is_virtual else ctx.io_data_type
        return dt or "FLOAT"

    # ----------------------------------------------------------- canonical form and key

    def canonical_uids(self) -> dict[int, int]:
        """uid → canonical uid (:func:`plancache.spec.keys.canonical_uids`)."""
        return keys.canonical_uids(self)

    def canonical(self) -> dict[str, Any]:
        """The key-relevant content (:mod:`plancache.spec.keys`)."""
        return keys.canonical_form(self)

    def canonical_json(self) -> str:
        return canonical_json(self.canonical())

    @property
    def graph_key(self) -> str:
        """sha256 over the schema version and the canonical JSON of this document (64 hex chars), worked out once
        (a spec is frozen; :meth:`model_copy` with ``update`` makes a new one; a nested list or tensor changed in
        place is not seen: change a copy)."""
        if self._key is None:
            self._key = keys.graph_key(self)
        return self._key

    def canonical_document(self) -> GraphSpec:
        """This document with canonical uids and tensors in uid order (what workers build), names and flags kept."""
        if self._canonical is None:
            doc = keys.canonical_layout(self)
            self._canonical = self if doc is None else parse_spec(doc)
        return self._canonical

    def to_json(self) -> dict[str, Any]:
        """The full document (names included), as written to files and sent to the server."""
        return self.model_dump(by_alias=True, mode="json")


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


def graph_key(spec: GraphSpec | dict[str, Any] | str | bytes, *, fresh: bool = False) -> str:
    """sha256 over the schema version and the canonical JSON of the spec (64 hex chars); a spec's own is worked out
    once (:attr:`GraphSpec.graph_key`). ``fresh``: from the document's content now, for checking a key against a
    document that came from elsewhere."""
    s = parse_spec(spec)
    if not fresh:
        return s.graph_key
    return keys.graph_key(s)


__all__ = ["Context", "GraphFlags", "GraphSpec", "NodeDoc", "TensorDoc", "TuningSpec", "graph_key", "parse_spec",
           "storage_elements"]
