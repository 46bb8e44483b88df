"""The graph spec: a canonical, versioned JSON document of a ``cudnn.pygraph``, and its graph key.

Everything here is plain Python: the server validates and keys documents without nvidia-cudnn-frontend or a GPU.
The package's modules, one job each:

* :mod:`~plancache.spec.vocabulary` -- the names FE gives data types, enums and graph flags;
* :mod:`~plancache.spec.nodes` -- every node type, declared once: input roles, params, output shapes;
* :mod:`~plancache.spec.limits` -- size limits, checked before a document is modelled;
* :mod:`~plancache.spec.document` -- the document's model and validation (:func:`parse_spec`);
* :mod:`~plancache.spec.keys` -- its canonical form and graph key;
* :mod:`~plancache.spec.axes` -- a graph at another batch size or sequence length, and its sibling key;
* :mod:`~plancache.spec.pygraph` -- :func:`from_pygraph`, which reads a user's graph (it needs FE because the graph
  does);
* :mod:`~plancache.spec.builder` -- :class:`SpecBuilder`, which writes one with the cudnn method names and no FE.
"""

from __future__ import annotations

from .builder import SpecBuilder, TensorRef, channels_last_strides, contiguous_strides
from .document import GraphSpec, TuningSpec, graph_key, parse_spec
from .pygraph import from_pygraph

# not the surface: names the client imports from here
from .pygraph import is_pygraph as is_pygraph  # noqa: I001
from .vocabulary import TORCH_DTYPES as TORCH_DTYPES

__all__ = [
    "GraphSpec", "SpecBuilder", "TensorRef", "TuningSpec", "channels_last_strides", "contiguous_strides", "from_pygraph",
    "graph_key", "parse_spec",
]
