"""A ready plan: checked execution by tensor name, and CUDA-graph capture.

Rules of :meth:`Plan.capture` (frozen pointers): a captured graph replays the exact device
addresses it was captured with. To run it on new data, copy the data into the captured tensors
(``X.copy_(new)``) and ``replay()``; never rebind a name to another tensor, and never resize or
free the captured tensors (the graph object keeps them, and its workspace, alive). Pass-by-value
scalars are frozen at their captured values too: capture again to change them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..spec import GraphSpec
from .backend import Backend, BuiltPlanLike

#: Device pointers handed to cuDNN must be aligned to this many bytes (the alignment plans are built for).
ALIGNMENT = 16


def _torch() -> Any:
    import torch

    return torch


@dataclass(frozen=True)
class _Expect:
    """What the plan needs of one named tensor."""

    name: str
    role: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: Any
    pass_by_value: bool

    def check(self, value: Any, device: Any, torch: Any) -> Any:
        """The value to hand to cuDNN, or a ``ValueError``/``TypeError`` naming the tensor and the mismatch."""
        where = f"{self.role} tensor {self.name!r}"
        if self.pass_by_value:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return torch.full(self.dims, float(value), dtype=torch.float32)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where} is a pass-by-value scalar: give a float or a CPU tensor, not {type(value).__name__}")
            if value.device.type != "cpu" or value.numel() != 1 or value.dtype != torch.float32:
                raise ValueError(f"{where} is a pass-by-value scalar: it must be a one-element float32 CPU tensor, "
                                 f"got {tuple(value.shape)} {value.dtype} on {value.device}")
            return value
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} must be a torch.Tensor, not {type(value).__name__}")
        if value.dtype != self.dtype:
            raise ValueError(f"{where}: dtype {value.dtype}, the plan needs {self.dtype}")
        if tuple(value.shape) != self.dims:
            raise ValueError(f"{where}: shape {tuple(value.shape)}, the plan needs {self.dims}")
        strides = value.stride()
        if any(d != 1 and s != want for d, s, want in zip(self.dims, strides, self.strides)):
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
    streams at the same time.
    """

    def __init__(self, spec: GraphSpec, graph_key: str, built: BuiltPlanLike, backend: Backend, *, source: str,
                 lock: threading.Lock) -> None:
        self.spec = spec
        self.graph_key = graph_key
        self.source = source
        self._built = built
        self._backend = backend
        self._lock = lock
        self._expect: dict[str, _Expect] | None = None
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

    def tensor_names(self) -> list[str]:
        """The names :meth:`execute` takes: the spec's inputs, then its outputs."""
        return list(self.spec.tensors) + list(self.spec.outputs)

    def __repr__(self) -> str:
        return (f"Plan({self.spec.name or self.graph_key[:12]!r}, source={self.source!r}, "
                f"engine_id={self.engine_id}, workspace={self.workspace_size})")

    # ------------------------------------------------------------ checks

    def _expectations(self, torch: Any) -> dict[str, _Expect]:
        if self._expect is None:
            infos = self.spec.tensor_infos()
            roles = [(n, "input") for n in self.spec.tensors] + [(n, "output") for n in self.spec.outputs]
            self._expect = {
                n: _Expect(n, role, infos[n].dims, infos[n].strides, getattr(torch, infos[n].dtype), infos[n].pass_by_value)
                for n, role in roles
            }
        return self._expect

    def _bind(self, tensors: dict[str, Any] | None, named: dict[str, Any], torch: Any) -> dict[str, Any]:
        given = dict(tensors or {})
        twice = sorted(given.keys() & named.keys())
        if twice:
            raise ValueError(f"tensor {twice[0]!r} is given twice (in the mapping and as a keyword)")
        given.update(named)
        expect = self._expectations(torch)
        extra = sorted(given.keys() - expect.keys())
        if extra:
            raise ValueError(f"unknown tensor {extra[0]!r}: this plan takes {', '.join(expect)}")
        missing = [n for n in expect if n not in given]
        if missing:
            raise ValueError(f"missing {expect[missing[0]].role} tensor {missing[0]!r}: this plan takes {', '.join(expect)}")
        device = self._backend.device
        return {n: e.check(given[n], device, torch) for n, e in expect.items()}

    def _check_workspace(self, workspace: Any, torch: Any) -> Any:
        if not isinstance(workspace, torch.Tensor):
            raise TypeError(f"workspace must be a torch.Tensor, not {type(workspace).__name__}")
        nbytes = workspace.numel() * workspace.element_size()
        if nbytes < self.workspace_size:
            raise ValueError(f"workspace has {nbytes} bytes, the plan needs {self.workspace_size}")
        if workspace.device != self._backend.device or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous tensor on {self._backend.device}")
        return workspace

    def _new_workspace(self, torch: Any) -> Any:
        return torch.empty(max(self.workspace_size, 1), dtype=torch.uint8, device=self._backend.device)

    def _stream_of(self, stream: Any) -> Any:
        if stream is None:
            return self._backend.current_stream()
        dev = getattr(stream, "device", None)
        if dev is not None and dev != self._backend.device:
            raise ValueError(f"stream is on {dev}, the plan runs on {self._backend.device}")
        return stream

    # ------------------------------------------------------------ running

    def execute(self, tensors: dict[str, Any] | None = None, /, *, workspace: Any = None, stream: Any = None,
                **named: Any) -> None:
        """Launch the plan on ``stream`` (default: the caller's current torch stream) — asynchronous, like torch ops.

        Tensors are given by spec name, as keywords (``X=x, W=w, Y=y``) or in a mapping (for names
        that are not identifiers). Every input and output is required; each is checked against the
        spec (dtype, shape, strides of non-unit dims, device, 16-byte alignment) before the launch,
        with a ``ValueError``/``TypeError`` naming the tensor. Pass-by-value scalars may be python
        floats or one-element float32 CPU tensors. ``workspace``: your own (at least
        :attr:`workspace_size` bytes); otherwise the plan's, allocated once per stream and reused.
        """
        torch = _torch()
        pack = self._bind(tensors, named, torch)
        run_on = self._stream_of(stream)
        if workspace is not None:
            ws = self._check_workspace(workspace, torch)
        else:
            key = id(run_on) if not hasattr(run_on, "cuda_stream") else int(run_on.cuda_stream)
            ws = self._workspaces.get(key)
            if ws is None:
                ws = self._workspaces[key] = self._new_workspace(torch)
        with self._lock:
            self._backend.set_stream(run_on)
            self._built.execute(pack, ws, self._backend.handle)

    def capture(self, tensors: dict[str, Any] | None = None, /, *, workspace: Any = None, warmup: int = 2,
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
        ws = self._check_workspace(workspace, torch) if workspace is not None else self._new_workspace(torch)
        device = self._backend.device
        handle = self._backend.handle
        with torch.cuda.device(device), self._lock:
            caller = self._backend.current_stream()
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
