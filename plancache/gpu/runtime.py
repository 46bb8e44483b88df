"""Build, rebuild, deserialize and run cuDNN plans for a spec (needs a GPU)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import cudnn
import torch

from ..errors import DynamicShapesUnsupported, GpuUnavailable, InsufficientGpuMemory, TuningError
from ..spec import GraphSpec, parse_spec
from . import reference
from .lowering import HEURISTIC_MODES, lower

#: Ops whose dynamic-shape builds from a shared kernel cache were verified correct on the H200 (cuDNN 9.19).
#: SDPA is left out: a causal SDPA built from a kernel cache filled at another sequence length gave wrong
#: output (normalised error 0.99, seq 256 after 1024); cuDNN's cuBLASLt engine declines matmul epilogues.
KERNEL_CACHE_OPS = frozenset({"conv_fprop", "bias", "scale", "add", "mul", "relu", "gelu", "sigmoid", "tanh", "swish"})

#: Headroom kept free on the device on top of what a spec needs (allocator slack, cuDNN internals).
MEMORY_HEADROOM_BYTES = 512 * 1024 * 1024


def require_gpu(device: int = 0) -> torch.device:
    if not torch.cuda.is_available():
        raise GpuUnavailable("torch sees no CUDA device")
    if device >= torch.cuda.device_count():
        raise GpuUnavailable(f"CUDA device {device} does not exist ({torch.cuda.device_count()} visible)")
    return torch.device("cuda", device)


def create_handle(device: int = 0) -> Any:
    """A cuDNN handle bound to ``device``."""
    with torch.cuda.device(require_gpu(device)):
        return cudnn.create_handle()


def create_kernel_cache() -> Any:
    """A kernel cache shared by the dynamic-shape builds of one shape family."""
    return cudnn.create_kernel_cache()


def knobs_to_public(knobs: dict[Any, int]) -> dict[str, int]:
    """``{cudnn.knob_type: int}`` → ``{name: int}``, sorted, for JSON."""
    return {getattr(k, "name", str(k)): int(v) for k, v in sorted(knobs.items(), key=lambda kv: getattr(kv[0], "name", str(kv[0])))}


def knobs_from_public(knobs: dict[str, int]) -> dict[Any, int]:
    try:
        return {cudnn.knob_type.__members__[k]: int(v) for k, v in knobs.items()}
    except KeyError as exc:
        raise TuningError(f"unknown cuDNN knob {exc.args[0]!r}") from None


@dataclass
class BuiltPlan:
    """A cuDNN graph with one selected, ready plan."""

    spec: GraphSpec
    graph: Any
    uids: dict[str, int]
    workspace_size: int
    engine_id: int | None = None
    knobs: dict[str, int] = field(default_factory=dict)
    plan_name: str = ""

    def execute(self, tensors: dict[str, Any], workspace: torch.Tensor | None, handle: Any) -> None:
        """Run the plan; ``tensors`` by spec name (no checking here — :class:`plancache.client.Plan` checks)."""
        pack = {self.uids[name]: value for name, value in tensors.items()}
        self.graph.execute(pack, workspace, handle=handle)

    def serialize(self) -> bytes:
        return bytes(self.graph.serialize(as_bytes=True))


def _plan_identity(graph: Any, index: int) -> tuple[int | None, dict[str, int], str]:
    try:
        engine_id, knobs = graph.get_engine_and_knobs_at_index(index)
        engine_id, public = int(engine_id), knobs_to_public(knobs)
    except (NotImplementedError, RuntimeError, AttributeError):
        engine_id, public = None, {}
    try:
        name = str(graph.get_plan_name_at_index(index))
    except (RuntimeError, AttributeError):
        name = ""
    return engine_id, public, name


def apply_constraints(graph: Any, spec: GraphSpec) -> None:
    """Bar plans the spec's tuning constraints exclude (workspace cap, deterministic-only)."""
    if spec.tuning.max_workspace_bytes is not None:
        graph.deselect_workspace_greater_than(spec.tuning.max_workspace_bytes)
    if spec.tuning.deterministic_only:
        graph.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])


def supports_kernel_cache(spec: GraphSpec) -> bool:
    """Whether ``spec`` may be built with dynamic shapes from a shared kernel cache (see :data:`KERNEL_CACHE_OPS`)."""
    return all(n.op in KERNEL_CACHE_OPS for n in spec.nodes)


def build_heuristic(spec: GraphSpec, handle: Any, *, kernel_cache: Any = None) -> BuiltPlan:
    """The local build: heuristic modes A then FALLBACK, the first plan that builds.

    With ``kernel_cache`` the graph is built with dynamic shapes enabled, sharing compiled
    kernels with the other shapes of its family; a graph outside :data:`KERNEL_CACHE_OPS`
    raises :class:`DynamicShapesUnsupported` instead (build it without a cache)."""
    spec = parse_spec(spec)
    if kernel_cache is not None and not supports_kernel_cache(spec):
        ops = sorted({n.op for n in spec.nodes} - KERNEL_CACHE_OPS)
        raise DynamicShapesUnsupported(f"dynamic-shape builds from a kernel cache are not verified for {', '.join(ops)}")
    low = lower(spec, handle=handle, kernel_cache=kernel_cache, dynamic_shapes=kernel_cache is not None)
    g = low.graph
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([HEURISTIC_MODES["A"], HEURISTIC_MODES["FALLBACK"]])
    apply_constraints(g, spec)
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
    # The walk selects the first plan that builds; pygraph keeps that index privately.
    engine_id, knobs, name = _plan_identity(g, getattr(g, "_plan_index", 0))
    return BuiltPlan(spec, g, low.uids, int(g.get_workspace_size()), engine_id, knobs, name)


def build_engine_config(spec: GraphSpec, handle: Any, engine_id: int, knobs: dict[str, int]) -> BuiltPlan:
    """Rebuild exactly one recorded ``(engine_id, knobs)`` (milliseconds instead of a heuristic walk)."""
    spec = parse_spec(spec)
    low = lower(spec, handle=handle)
    g = low.graph
    g.validate()
    g.build_operation_graph()
    g.create_execution_plan(int(engine_id), knobs_from_public(knobs))
    index = g.get_execution_plan_count() - 1
    g.build_plan_at_index(index)
    _, _, name = _plan_identity(g, index)
    return BuiltPlan(spec, g, low.uids, int(g.get_workspace_size()), int(engine_id), dict(knobs), name)


def deserialize_plan(spec: GraphSpec, blob: bytes, handle: Any, *, engine_id: int | None = None,
                     knobs: dict[str, int] | None = None, plan_name: str = "", device_property: Any = None) -> BuiltPlan:
    """Load a serialized plan. Only call this on a blob whose digest (and signature) verified:
    deserializing loads native GPU code. With ``device_property`` (``cudnn.create_device_properties``)
    the load skips the device warm-up."""
    spec = parse_spec(spec)
    g = cudnn.pygraph(device_property=device_property) if device_property is not None else cudnn.pygraph()
    g.deserialize(handle, bytes(blob))
    return BuiltPlan(spec, g, spec.uids(), int(g.get_workspace_size()), engine_id, dict(knobs or {}), plan_name)


def required_bytes(spec: GraphSpec) -> int:
    """Device bytes the spec's tensors plus the float32 reference need (workspace excluded)."""
    plan_tensors = sum(reference.tensor_bytes(i) for i in spec.tensor_infos().values() if not i.virtual and not i.pass_by_value)
    return plan_tensors + reference.reference_scratch_bytes(spec)


def check_memory(spec: GraphSpec, *, device: int = 0) -> int:
    """Refuse, before allocating anything, a spec that needs more memory than the device has free."""
    spec = parse_spec(spec)
    dev = require_gpu(device)
    need = required_bytes(spec)
    free, total = torch.cuda.mem_get_info(dev)
    if need + MEMORY_HEADROOM_BYTES > free:
        raise InsufficientGpuMemory(
            f"spec needs ~{need / 2**30:.2f} GiB of device memory (+{MEMORY_HEADROOM_BYTES / 2**30:.1f} GiB headroom); "
            f"device {device} has {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB")
    return need


def run_and_check(plan: BuiltPlan, handle: Any, device: torch.device, *, seed: int) -> float:
    """Execute ``plan`` once on fresh random inputs and compare with the reference; return the error."""
    spec = plan.spec
    inputs = reference.make_inputs(spec, device, seed=seed)
    outputs = reference.allocate_outputs(spec, device)
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device=device)
    cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
    plan.execute({**inputs, **outputs}, ws, handle)
    torch.cuda.synchronize(device)
    ref = reference.reference_outputs(spec, inputs)
    return reference.compare_outputs(spec, outputs, ref)


def verify_plan(spec: GraphSpec, blob: bytes, *, device: int = 0, seed: int = 12345) -> float:
    """Deserialize ``blob`` in this process, run it on fresh inputs and check it against the reference."""
    spec = parse_spec(spec)
    dev = require_gpu(device)
    with torch.cuda.device(dev):
        handle = cudnn.create_handle()
        plan = deserialize_plan(spec, blob, handle)
        err = run_and_check(plan, handle, dev, seed=seed)
    if not math.isfinite(err):
        raise TuningError("deserialized plan produced non-finite output")
    return err
