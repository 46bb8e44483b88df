"""The GPU side of the client, behind a small protocol so the plan ladder can be tested without a GPU.

:class:`GpuBackend` is the default: a thin adapter over :mod:`plancache.gpu` (imported on
construction; it needs torch, nvidia-cudnn-frontend and a CUDA device) and
:func:`plancache.environment.detect`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import GpuUnavailable

if TYPE_CHECKING:
    from ..environment import Environment
    from ..spec import GraphSpec

log = logging.getLogger("plancache.client")

_threads = threading.local()  # .devices: the devices whose primary CUDA context this thread made current


class BuiltPlanLike(Protocol):
    """What the client needs of a built plan (:class:`plancache.gpu.BuiltPlan`)."""

    workspace_size: int
    engine_id: int | None
    knobs: dict[str, int]
    plan_name: str

    def execute(self, tensors: dict[int, Any], workspace: Any, handle: Any) -> None: ...

    def layouts(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Dims and strides of the plan's non-virtual tensors by canonical uid, as the loaded graph holds them
        (outputs whose layout FE inferred included); a tensor the graph cannot tell is left out."""
        ...


class Backend(Protocol):
    """Builds and loads plans on one device and binds its cuDNN handle to streams."""

    #: The torch device the plans run on (tensors given to ``Plan.execute`` must live there).
    device: Any
    @property
    def handle(self) -> Any:
        """The cuDNN handle every plan of this backend executes with."""

    def environment(self) -> Environment: ...

    def for_device(self, device: int) -> Backend:
        """A backend of the same kind on CUDA device ``device`` (the hook serves each device from its own cache)."""
        ...

    def deserialize(self, spec: GraphSpec, blob: bytes, *, engine_id: int | None, knobs: dict[str, int],
                    plan_name: str, graph: Any = None) -> BuiltPlanLike:
        """Load a serialized plan (into the caller's own ``graph`` when given). Called only with a verified blob."""
        ...

    def build_engine_config(self, spec: GraphSpec, engine_id: int, knobs: dict[str, int], *,
                            graph: Any = None) -> BuiltPlanLike: ...

    def build_heuristic(self, spec: GraphSpec, kernel_cache: Any, *, graph: Any = None) -> BuiltPlanLike: ...

    def prepare_graph(self, graph: Any, spec: GraphSpec) -> None:
        """Make a caller's unbuilt pygraph bind to plans built from ``spec``'s canonical document."""
        ...

    def create_kernel_cache(self) -> Any: ...

    def current_stream(self) -> Any:
        """The caller's current stream on :attr:`device`."""
        ...

    def new_workspace(self, nbytes: int, stream: Any) -> Any:
        """A uint8 tensor of ``nbytes`` (one at least) on :attr:`device`, allocated on ``stream``: the caching
        allocator hands its memory to other work only once the work queued on ``stream`` is done."""
        ...

    def set_stream(self, stream: Any) -> None:
        """Point :attr:`handle` at ``stream`` (a no-op when it already is)."""
        ...

    def new_handle(self) -> Any:
        """A new cuDNN handle on :attr:`device`, for a thread of its own (made where it is called)."""
        ...

    def on_device(self) -> AbstractContextManager[Any]:
        """:attr:`device` made the calling thread's current CUDA device inside the block, its context current (cuDNN
        launches on the current device, whichever device the handle and stream belong to)."""
        ...


class GpuBackend:
    """The real backend: :mod:`plancache.gpu` on CUDA device ``device`` (an ordinal of this process). Its handle,
    device properties, loads, builds and launches are all made on that device, never on the thread's current one,
    so caches on several devices of one process stay apart.

    cuDNN's one-time start-up (the handle, then the device properties: 60-145 ms on an H200) runs on a thread
    started here, so it overlaps the client's first server round trip; the first use of :attr:`handle` waits
    for it (and raises what it raised)."""

    def __init__(self, device: int = 0) -> None:
        try:
            import cudnn
            import torch
        except ModuleNotFoundError as exc:
            raise GpuUnavailable(f"PlanCache runs plans on the GPU with torch and nvidia-cudnn-frontend, and {exc.name} "
                                 "is not installed: pip install 'plancache[gpu]'") from None

        from .. import gpu
        from ..environment import detect

        self._gpu, self._torch, self._cudnn = gpu, torch, cudnn
        self._env = detect(device)  # GpuUnavailable for a device this process does not see
        self.device = torch.device("cuda", device)
        self._stream_id: int | None = None
        starter = ThreadPoolExecutor(1, thread_name_prefix="plancache-cudnn-start")
        self._native: Future[tuple[Any, Any]] = starter.submit(self._start)
        starter.shutdown(wait=False)

    def _start(self) -> tuple[Any, Any]:
        """The cuDNN handle, and device properties (None where unavailable)."""
        handle = self._gpu.create_handle(self.device.index)
        try:  # deserializing through device properties skips the device warm-up (1.5-4x cheaper)
            with self.on_device():
                return handle, self._cudnn.create_device_properties(self.device.index)
        except Exception as exc:  # noqa: BLE001 - only an optimisation; the handle path always works
            log.info("cudnn.create_device_properties unavailable (%s); deserializing through the handle", exc)
            return handle, None

    @property
    def handle(self) -> Any:
        """The cuDNN handle every plan of this backend runs with."""
        return self._native.result()[0]

    @property
    def _device_property(self) -> Any:
        return self._native.result()[1]

    def environment(self) -> Environment:
        return self._env

    def for_device(self, device: int) -> GpuBackend:
        return GpuBackend(device)

    def _handle_for(self, graph: Any) -> Any:
        """A caller's graph made with ``handle=`` keeps it; otherwise the backend's handle."""
        return getattr(graph, "_handle", None) or self.handle

    def deserialize(self, spec: GraphSpec, blob: bytes, *, engine_id: int | None, knobs: dict[str, int],
                    plan_name: str, graph: Any = None) -> Any:
        with self.on_device():
            return self._gpu.deserialize_plan(spec, blob, self._handle_for(graph), engine_id=engine_id, knobs=knobs,
                                              plan_name=plan_name, device_property=self._device_property, graph=graph)

    def build_engine_config(self, spec: GraphSpec, engine_id: int, knobs: dict[str, int], *, graph: Any = None) -> Any:
        with self.on_device():
            return self._gpu.build_engine_config(spec, self._handle_for(graph), engine_id, knobs, graph=graph)

    def build_heuristic(self, spec: GraphSpec, kernel_cache: Any, *, graph: Any = None) -> Any:
        with self.on_device():
            return self._gpu.build_heuristic(spec, self._handle_for(graph), kernel_cache=kernel_cache, graph=graph)

    def prepare_graph(self, graph: Any, spec: GraphSpec) -> None:
        self._gpu.canonicalize_uids(graph, spec)

    def create_kernel_cache(self) -> Any:
        return self._gpu.create_kernel_cache()

    def current_stream(self) -> Any:
        return self._torch.cuda.current_stream(self.device)

    def new_workspace(self, nbytes: int, stream: Any) -> Any:
        torch = self._torch
        with torch.cuda.stream(stream):
            return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The device's primary context is made current once per thread: torch's device guard switches only between
        ordinals, so a thread that made no CUDA call of its own (the warm start's) has no context current, and
        cuDNN's driver calls fail there with CUDA_ERROR_INVALID_CONTEXT (loading a plan whose kernel was compiled at
        run time, as FE's norm ops' tuned plans are)."""
        with self._torch.cuda.device(self.device):
            devices = _threads.__dict__.setdefault("devices", set())
            if self.device.index not in devices:
                self._torch.cuda.set_device(self.device)  # cudaSetDevice: binds the primary context
                devices.add(self.device.index)
            yield

    def new_handle(self) -> Any:
        return self._gpu.create_handle(self.device.index)

    def set_stream(self, stream: Any) -> None:
        sid = int(stream.cuda_stream)
        if sid != self._stream_id:
            self._cudnn.set_stream(self.handle, sid)
            self._stream_id = sid
