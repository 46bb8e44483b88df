"""Size limits of a spec document, and the check of counts and lengths that runs before the document is modelled.

Sized from real FE graphs (docs/SPEC.md "Limits"): the largest have hundreds of tensors, tens of nodes, rank 5, about
25 ports and 30 params on a node. Counts and lengths are checked before pydantic builds anything.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import SpecError
from ..validation import INT64_MAX

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
MAX_LIST = 64  # items of a list or $tuple value
MAX_DEPTH = 6
MAX_UID = INT64_MAX  # uids, and any other integer
#: A port, param or ``$dict`` key: an identifier.
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
#: An enum member's name.
ENUM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


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



__all__ = [
    "ENUM_NAME", "IDENTIFIER", "MAX_DEPTH", "MAX_DIM", "MAX_ELEMENTS", "MAX_GRAPH_BYTES", "MAX_LIST", "MAX_NAME",
    "MAX_NODES", "MAX_PARAMS", "MAX_PORTS", "MAX_RANK", "MAX_TENSORS", "MAX_UID", "check_sizes",
]
