"""A ready plan: checked execution by tensor name, and CUDA-graph capture.

Rules of :meth:`Plan.capture` (frozen pointers): a captured graph replays the exact device
addresses it was captured with. To run it on new data, copy the data into the captured tensors
(``X.copy_(new)``) and ``replay()``; never rebind a name to another tensor, and never resize or
free the captured tensors (the graph object keeps them, and its workspace, alive). Pass-by-value
scalars are frozen at their captured values too: capture again to change them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .backend import Backend, BuiltPlanLike

if TYPE_CHECKING:
    from ..protocol import PlanRecord
    from ..spec import GraphSpec

#: Device pointers handed to cuDNN must be aligned to this many bytes (the alignment plans are built for).
ALIGNMENT = 16
#: The tensors of a call, by name or by canonical uid.
Tensors = Mapping[str, Any] | Mapping[int, Any]


def _torch() -> Any:
    import torch

    return torch


@dataclass(frozen=True)
class _Expect:
    """What the plan needs of one named tensor."""

    name: str
    uid: int
    role: str
    dims: tuple[int, ...] | None
    strides: tuple[int, ...] | None
    dtype: Any
    pass_by_value: bool

    def check(self, value: Any, device: Any, torch: Any) -> Any:
        """The value to hand to cuDNN, or a ``ValueError``/``TypeError`` naming the tensor and the mismatch."""
        where = f"{self.role} tensor {self.name or self.uid!r}"
        if self.pass_by_value:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return torch.full(self.dims or (1,), float(value), dtype=self.dtype or torch.float32)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where} is a pass-by-value scalar: give a float or a CPU tensor, not {type(value).__name__}")
            if value.device.type != "cpu" or value.numel() != 1 or (self.dtype is not None and value.dtype != self.dtype):
                raise ValueError(f"{where} is a pass-by-value scalar: it must be a one-element {self.dtype} CPU tensor, "
                                 f"got {tuple(value.shape)} {value.dtype} on {value.device}")
            return value
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} must be a torch.Tensor, not {type(value).__name__}")
        if self.dims is None or self.strides is None:
            raise ValueError(f"{where}: the loaded plan does not tell its dims and strides, so the tensor cannot be "
                             "checked and the plan is not run (give the tensor's dims and strides in the graph)")
        if self.dtype is not None and value.dtype != self.dtype:
            raise ValueError(f"{where}: dtype {value.dtype}, the plan needs {self.dtype}")
        if tuple(value.shape) != self.dims:
            raise ValueError(f"{where}: shape {tuple(value.shape)}, the plan needs {self.dims}")
        strides = value.stride()
        if len(strides) != len(self.strides) or any(
                d != 1 and s != want for d, s, want in zip(self.dims, strides, self.strides)):
            raise ValueError(f"{where}: strides {tuple(strides)}, the plan was built for {self.strides} "
                             f"(another memory layout; build it with torch.empty_strided or the matching memory_format)")
        if value.device != device:
            raise ValueError(f"{where} is on {value.device}, the plan runs on {device}")
        if value.data_ptr() % ALIGNMENT:
            raise ValueError(f"{where}: data pointer is not {ALIGNMENT}-byte aligned (a view at an odd offset?)")
        return value


class Plan:
    """A cuDNN plan for one spec, ready to run on the backend's device.

    ``source`` says where it came from: ``disk``, ``server``, ``rebuild`` (the tuned engine config
    rebuilt locally) or ``heuristic`` (a local heuristic build). Executions of plans of one
    :class:`~plancache.client.PlanCache` are serialized on its cuDNN handle; the plan keeps one
    workspace per stream it ran on, so give your own ``workspace`` to run one plan on several
    streams at the same time. ``record``: the verified record it was loaded or rebuilt from (what the worker
    measured), None for a local heuristic build.
    """

    def __init__(self, spec: GraphSpec, graph_key: str, built: BuiltPlanLike, backend: Backend, *, source: str,
                 lock: threading.Lock, record: PlanRecord | None = None) -> None:
        self.spec = spec
        self.graph_key = graph_key
        self.source = source
        self.record = record
        self._built = built
        self._backend = backend
        self._lock = lock
        self._expect: dict[int, _Expect] | None = None
        self._workspaces: dict[int, Any] = {}

    @property
    def workspace_size(self) -> int:
        return int(self._built.workspace_size)

    @property
    def engine_id(self) -> int | None:
        return self._built.engine_id

    @property
    def knobs(self) -> dict[str, int]:
        return dict(self._built.knobs)

    @property
    def plan_name(self) -> str:
        return self._built.plan_name

    @property
    def graph(self) -> Any:
        """The built ``cudnn.pygraph`` (for :meth:`PlanCache.build`, the caller's own graph)."""
        return getattr(self._built, "graph", None)

    def named_as(self, spec: GraphSpec) -> Plan:
        """This plan for ``spec``, a document of the same graph key: itself, or, where ``spec`` names its tensors
        otherwise (names are not part of the key), the same loaded plan taking ``spec``'s names."""
        if spec is self.spec or spec.canonical_document().io_names() == self.spec.canonical_document().io_names():
            return self
        return Plan(spec, self.graph_key, self._built, self._backend, source=self.source, lock=self._lock,
                    record=self.record)

    def tensor_names(self) -> list[str]:
        """The names :meth:`execute` takes: the graph's inputs, then its outputs (unnamed tensors go by uid)."""
        return [e.name for e in self._expectations(_torch()).values() if e.name]

    def __repr__(self) -> str:
        return (f"Plan({self.spec.name or self.graph_key[:12]!r}, source={self.source!r}, "
                f"engine_id={self.engine_id}, workspace={self.workspace_size})")

    # ------------------------------------------------------------ checks

    def _expectations(self, torch: Any) -> dict[int, _Expect]:
        """What the plan needs of each non-virtual tensor, by canonical uid: the dims and strides the spec
        assigns, else those of the loaded plan (:meth:`BuiltPlanLike.layouts`, where FE inferred them);
        None where neither tells, which :meth:`_Expect.check` refuses."""
        if self._expect is None:
            from ..spec import TORCH_DTYPES

            doc = self.spec.canonical_document()
            names = {u: n for n, u in doc.io_names().items()}
            real: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None
            expect = {}
            for role, tensors in (("input", doc.input_tensors()), ("output", doc.output_tensors())):
                for t in tensors:
                    dims = tuple(t.dim) if (role == "input" or t.dim_assigned) and t.dim else None
                    strides = tuple(t.stride) if (role == "input" or t.stride_assigned) and t.stride else None
                    if (dims is None or strides is None) and not t.is_pass_by_value:
                        real = self._built.layouts() if real is None else real
                        if t.uid in real:
                            dims, strides = dims or real[t.uid][0], strides or real[t.uid][1]
                    dtype = TORCH_DTYPES.get(doc.data_type_of(t))
                    expect[t.uid] = _Expect(names.get(t.uid, ""), t.uid, role, dims, strides,
                                            getattr(torch, dtype) if dtype else None, t.is_pass_by_value)
            self._expect = expect
        return self._expect

    def _bind(self, tensors: Tensors | None, named: dict[str, Any], torch: Any) -> dict[int, Any]:
        expect = self._expectations(torch)
        by_name = {e.name: u for u, e in expect.items() if e.name}
        listing = ", ".join(e.name or f"uid {u}" for u, e in expect.items())
        given: dict[int, Any] = {}
        for key, value in [*(tensors or {}).items(), *named.items()]:
            if isinstance(key, int) and not isinstance(key, bool) and key in expect:
                uid: int | None = key
            else:
                uid = by_name.get(key) if isinstance(key, str) else None
            if uid is None:
                raise ValueError(f"unknown tensor {key!r}: this plan takes {listing}")
            if uid in given:
                raise ValueError(f"tensor {key!r} is given twice")
            given[uid] = value
        missing = [u for u in expect if u not in given]
        if missing:
            e = expect[missing[0]]
            raise ValueError(f"missing {e.role} tensor {e.name or e.uid!r}: this plan takes {listing}")
        device = self._backend.device
        return {u: e.check(given[u], device, torch) for u, e in expect.items()}

    def _check_workspace(self, workspace: Any, torch: Any) -> Any:
        if not isinstance(workspace, torch.Tensor):
            raise TypeError(f"workspace must be a torch.Tensor, not {type(workspace).__name__}")
        nbytes = workspace.numel() * workspace.element_size()
        if nbytes < self.workspace_size:
            raise ValueError(f"workspace has {nbytes} bytes, the plan needs {self.workspace_size}")
        if workspace.device != self._backend.device or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous tensor on {self._backend.device}")
        return workspace

    def _stream_of(self, stream: Any) -> Any:
        if stream is None:
            return self._backend.current_stream()
        dev = getattr(stream, "device", None)
        if dev is not None and dev != self._backend.device:
            raise ValueError(f"stream is on {dev}, the plan runs on {self._backend.device}")
        return stream

    # ------------------------------------------------------------ running

    def execute(self, tensors: Tensors | None = None, /, *, workspace: Any = None, stream: Any = None,
                **named: Any) -> None:
        """Launch the plan on ``stream`` (default: the caller's current torch stream on the plan's device, which need
        not be the thread's current device) — asynchronous, like torch ops.

        Tensors are given by name, as keywords (``X=x, W=w, Y=y``), or in a mapping by name or by uid
        (for names that are not identifiers, or unnamed tensors). Every input and output is required; each is checked
        before the launch against the spec and, for what the spec leaves to FE, the loaded plan's own layout (dtype,
        shape, strides of non-unit dims, device, 16-byte alignment: together the bytes the plan reads or writes), with
        a ``ValueError``/``TypeError`` naming the tensor. Pass-by-value scalars may be python
        floats or one-element float32 CPU tensors. ``workspace``: your own (at least
        :attr:`workspace_size` bytes, used on ``stream``: keep it alive until that work is done, as torch asks of a
        tensor used on a stream other than its own); otherwise the plan's, allocated once on each stream it runs on
        and reused there.
        """
        torch = _torch()
        pack = self._bind(tensors, named, torch)
        run_on = self._stream_of(stream)
        if workspace is not None:
            ws = self._check_workspace(workspace, torch)
        else:
            key = id(run_on) if not hasattr(run_on, "cuda_stream") else int(run_on.cuda_stream)
            ws = self._workspaces.get(key)
            if ws is None:  # allocated on the stream it runs on: its memory is never handed to another stream early
                ws = self._workspaces[key] = self._backend.new_workspace(self.workspace_size, run_on)
        with self._lock, self._backend.on_device():  # launched on the plan's device, whichever is current here
            self._backend.set_stream(run_on)
            self._built.execute(pack, ws, self._backend.handle)

    def capture(self, tensors: Tensors | None = None, /, *, workspace: Any = None, warmup: int = 2,
                **named: Any) -> Any:
        """Capture one execution into a ``torch.cuda.CUDAGraph`` and return it; ``graph.replay()`` re-runs it
        on the caller's current stream.

        The tensors are checked like :meth:`execute`. The plan runs ``warmup`` times on a side stream, then
        once under capture on that stream, with the cuDNN handle's stream set to it; the handle is pointed
        back at the caller's stream afterwards. The graph replays on the same pointers: to feed new data,
        copy it into the captured tensors (``tensor.copy_(new)``), never rebind; scalars stay at their
        captured values. The graph keeps the tensors and a workspace of its own alive (``graph.plancache_keepalive``).
        """
        torch = _torch()
        pack = self._bind(tensors, named, torch)
        caller = self._backend.current_stream()
        ws = self._check_workspace(workspace, torch) if workspace is not None else \
            self._backend.new_workspace(self.workspace_size, caller)  # the stream its replays run on
        device = self._backend.device
        handle = self._backend.handle
        with self._backend.on_device(), self._lock:
            side = torch.cuda.Stream(device=device)
            side.wait_stream(caller)
            try:
                # The handle points at the capture stream before capture begins (no cuDNN stream calls under capture).
                self._backend.set_stream(side)
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        self._built.execute(pack, ws, handle)
                caller.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    self._built.execute(pack, ws, handle)
            finally:
                self._backend.set_stream(caller)
        graph.plancache_keepalive = (pack, ws)
        return graph
