"""Build, rebuild, deserialize and run cuDNN plans of a graph spec or of a user's own pygraph (needs a GPU)."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import cudnn
import torch

from ..environment import require_device
from ..errors import DynamicShapesUnsupported, InsufficientGpuMemory, TuningError
from ..spec import GraphSpec, parse_spec
from . import families, reference
from .fegraph import decode, graph_layouts

log = logging.getLogger(__name__)

#: cuDNN heuristic modes by the names specs use.
HEURISTIC_MODES = {"A": cudnn.heur_mode.A, "B": cudnn.heur_mode.B, "FALLBACK": cudnn.heur_mode.FALLBACK}

#: Headroom kept free on the device on top of what a spec needs (allocator slack, cuDNN internals).
MEMORY_HEADROOM_BYTES = 512 * 1024 * 1024


def require_gpu(device: int = 0) -> torch.device:
    """``cuda:<device>``; :class:`GpuUnavailable` when this process sees no such device."""
    require_device(device)
    return torch.device("cuda", device)


def create_handle(device: int = 0) -> Any:
    """A ``cudnn.Handle`` bound to ``device`` (made the calling thread's current device while it is created: a
    handle belongs to the device current at its creation).

    The first handle of a process pays cuDNN's one-time start-up (0.1 s alone on an H200, about 2 s when 16
    processes start at once) and FE's binding holds the GIL for all of it, so a thread creating it stops every
    other thread of the process. Where the cuDNN library FE loaded is the only one in the process, the handle
    is created through its C entry point instead, which releases the GIL (see :func:`_backend_handle`)."""
    with torch.cuda.device(require_gpu(device)):
        raw = _backend_handle()
        if raw is None:
            return cudnn.create_handle()
        return cudnn.Handle(raw, device, 0)  # a new handle runs on the default stream, as FE's would


def _backend_handle() -> int | None:
    """``cudnnCreate`` called through ctypes (which releases the GIL) on the process's one ``libcudnn.so``, the
    library FE dlopened; None (FE creates the handle) off Linux, when no single cuDNN library is mapped (a handle
    from one copy must never reach another) or when the call fails."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            path = loaded_cudnn(maps)
    except OSError:
        return None
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)  # the copy already loaded, never a new one
    except OSError:
        return None
    raw = ctypes.c_void_p()
    status = lib.cudnnCreate(ctypes.byref(raw))
    if status != 0 or not raw.value:
        log.debug("cudnnCreate returned status %s; creating the handle through FE", status)
        return None
    return int(raw.value)


def loaded_cudnn(maps: Iterable[str]) -> str | None:
    """The file of the one cuDNN library (``libcudnn.so*``, not its sub-libraries) in a ``/proc/PID/maps``
    listing, or None when there is none or more than one."""
    files = set()
    for line in maps:
        fields = line.split(None, 5)
        if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libcudnn.so"):
            files.add(os.path.realpath(fields[5].strip()))
    return files.pop() if len(files) == 1 else None


def create_kernel_cache() -> Any:
    """A kernel cache shared by the dynamic-shape builds of one shape family."""
    return cudnn.create_kernel_cache()


def knobs_to_public(knobs: dict[Any, int]) -> dict[str, int]:
    """``{cudnn.knob_type: int}`` → ``{name: int}``, sorted, for JSON."""
    named = {getattr(k, "name", str(k)): int(v) for k, v in knobs.items()}
    return dict(sorted(named.items()))


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
    workspace_size: int
    engine_id: int | None = None
    knobs: dict[str, int] = field(default_factory=dict)
    plan_name: str = ""

    def execute(self, tensors: dict[int, Any], workspace: torch.Tensor | None, handle: Any) -> None:
        """Run the plan; ``tensors`` by canonical uid (no checking here — :class:`plancache.client.Plan` checks)."""
        self.graph.execute(tensors, workspace, handle=handle)

    def serialize(self) -> bytes:
        return bytes(self.graph.serialize(as_bytes=True))

    def layouts(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Dims and strides of the spec's non-virtual tensors as the loaded graph holds them: the lowered cuDNN
        graph's (a blob's own, after cuDNN's layout inference; a blob loaded into an empty graph has no other),
        else FE's Python IR's (a python-engine plan); a tensor neither tells is left out."""
        lowered = getattr(self.graph, "_lowered_graph", None)
        ir = getattr(self.graph, "_tensor_by_uid", None) or {}
        out = {}
        for doc in self.spec.input_tensors() + self.spec.output_tensors():
            dims: Any = None
            strides: Any = None
            if lowered is not None:
                try:
                    t = lowered.query_tensor_attributes_of_uid(doc.uid)
                    dims, strides = t.get_dim(), t.get_stride()
                except Exception:  # noqa: BLE001 - cuDNN's graph does not hold this uid: the IR may
                    pass
            if not dims and doc.uid in ir:
                dims, strides = ir[doc.uid].dim, ir[doc.uid].stride
            if dims and strides and len(dims) == len(strides):
                out[doc.uid] = (tuple(int(d) for d in dims), tuple(int(s) for s in strides))
        return out


def plan_identity(graph: Any, index: int) -> tuple[int | None, dict[str, int], str]:
    """``(engine_id, knobs, plan name)`` of candidate ``index`` (None / {} where the backend exposes none)."""
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


def canonical(spec: GraphSpec | dict[str, Any]) -> GraphSpec:
    """The document with canonical uids: the form every GPU path builds, feeds and checks (a graph decoded
    from it, and a user's graph after :func:`~plancache.gpu.fegraph.canonicalize_uids`, carry these uids)."""
    return parse_spec(spec).canonical_document()


def apply_constraints(graph: Any, spec: GraphSpec) -> None:
    """Bar plans the spec's tuning constraints exclude (workspace cap, deterministic-only)."""
    if spec.tuning.max_workspace_bytes is not None:
        graph.deselect_workspace_greater_than(spec.tuning.max_workspace_bytes)
    if spec.tuning.deterministic_only:
        graph.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])


def prepare(g: Any, spec: GraphSpec, modes: list[str]) -> None:
    """Validate and lower ``g``, list the candidate plans of heuristic ``modes``, apply the spec's constraints."""
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([HEURISTIC_MODES[m] for m in modes])
    apply_constraints(g, spec)
    g.check_support()


def build_heuristic(spec: GraphSpec, handle: Any, *, kernel_cache: Any = None, graph: Any = None) -> BuiltPlan:
    """The local build: heuristic modes A then FALLBACK, the first plan that builds.

    ``graph``: the user's own (unbuilt) pygraph of ``spec`` to build in place; otherwise the spec's
    document is decoded. With ``kernel_cache`` the graph is built with dynamic shapes enabled, sharing
    compiled kernels with the other shapes of its family; a graph outside the kernel-cache-safe families
    (:mod:`plancache.gpu.families`) raises :class:`DynamicShapesUnsupported` instead."""
    spec = canonical(spec)
    if kernel_cache is not None:
        if graph is not None:
            raise DynamicShapesUnsupported("a user's own graph is built with the dynamic-shape setting it was made with")
        if not families.kernel_cache_safe(spec):
            raise DynamicShapesUnsupported("dynamic-shape builds from a kernel cache are verified only for "
                                           "convolution and pointwise graphs")
    g = graph if graph is not None else decode(spec, handle=handle, kernel_cache=kernel_cache,
                                               dynamic_shapes=kernel_cache is not None)
    prepare(g, spec, ["A", "FALLBACK"])
    g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
    # The walk selects the first plan that builds; pygraph keeps that index privately.
    engine_id, knobs, name = plan_identity(g, getattr(g, "_plan_index", 0))
    return BuiltPlan(spec, g, int(g.get_workspace_size()), engine_id, knobs, name)


def build_engine_config(spec: GraphSpec, handle: Any, engine_id: int, knobs: dict[str, int], *,
                        graph: Any = None) -> BuiltPlan:
    """Rebuild exactly one recorded ``(engine_id, knobs)`` (milliseconds instead of a heuristic walk)."""
    spec = canonical(spec)
    g = graph if graph is not None else decode(spec, handle=handle)
    if not g._is_validated:  # a caller's graph may come part-way through FE's pipeline (plancache.client.hook)
        g.validate()
    g.build_operation_graph()
    g.create_execution_plan(int(engine_id), knobs_from_public(knobs))
    index = g.get_execution_plan_count() - 1
    g.build_plan_at_index(index)
    _, _, name = plan_identity(g, index)
    return BuiltPlan(spec, g, int(g.get_workspace_size()), int(engine_id), dict(knobs), name)


def deserialize_plan(spec: GraphSpec, blob: bytes, handle: Any, *, engine_id: int | None = None,
                     knobs: dict[str, int] | None = None, plan_name: str = "", device_property: Any = None,
                     graph: Any = None) -> BuiltPlan:
    """Load a serialized plan. Only call this on a blob whose digest (and signature) verified:
    deserializing loads native GPU code. ``graph``: the user's own pygraph (canonical uids, see
    :func:`plancache.gpu.fegraph.canonicalize_uids`) to load it into, which then runs with the user's
    own tensors; otherwise an empty graph holds it. With ``device_property``
    (``cudnn.create_device_properties``) a load into an empty graph skips the device warm-up."""
    spec = canonical(spec)
    if graph is not None:
        g = graph
    else:
        g = cudnn.pygraph(device_property=device_property) if device_property is not None else cudnn.pygraph()
    g.deserialize(handle, bytes(blob))
    return BuiltPlan(spec, g, int(g.get_workspace_size()), engine_id, dict(knobs or {}), plan_name)


def check_memory(spec: GraphSpec, *, device: int = 0) -> int:
    """Refuse, before allocating anything, a spec that needs more memory than the device has free."""
    spec = canonical(spec)
    dev = require_gpu(device)
    need = reference.required_bytes(spec)
    free, total = torch.cuda.mem_get_info(dev)
    if need + MEMORY_HEADROOM_BYTES > free:
        raise InsufficientGpuMemory(
            f"spec needs ~{need / 2**30:.2f} GiB of device memory (+{MEMORY_HEADROOM_BYTES / 2**30:.1f} GiB headroom); "
            f"device {device} has {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB")
    return need


def check_pack(spec: GraphSpec, pack: dict[int, torch.Tensor]) -> None:
    """Refuse a variant pack that would make the native execute read a wrong pointer: every non-virtual
    tensor of the (canonical) spec needs a buffer, pass-by-value scalars on the host, the rest on a GPU."""
    for t in spec.input_tensors() + spec.output_tensors():
        buf = pack.get(t.uid)
        label = f"tensor uid {t.uid} ({t.name!r})" if t.name else f"tensor uid {t.uid}"
        if buf is None:
            raise TuningError(f"the variant pack has no buffer for {label}")
        if (buf.device.type == "cpu") != t.is_pass_by_value:
            where = "host" if t.is_pass_by_value else "GPU"
            raise TuningError(f"{label} must be a {where} tensor, got one on {buf.device}")


def _execute(plan: BuiltPlan, handle: Any, device: torch.device, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    spec = plan.spec
    layouts = {t.uid: (list(t.dim), list(t.stride)) for t in spec.canonical_document().output_tensors()}
    layouts.update(plan_layouts(plan))
    outputs = reference.allocate_outputs(spec, device, layouts)
    ws = torch.empty(max(plan.workspace_size, 1), dtype=torch.uint8, device=device)
    cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
    pack = {**inputs, **outputs}
    check_pack(spec, pack)
    plan.execute(pack, ws, handle)
    torch.cuda.synchronize(device)
    return outputs


def expected_outputs(spec: GraphSpec, inputs: dict[int, torch.Tensor], handle: Any,
                     device: torch.device) -> tuple[dict[int, torch.Tensor], str]:
    """What the graph's outputs must be, and how that was decided: ``reference`` (the float32 torch
    reference of every node; an attention node's dropout is the elements cuDNN drops, :func:`draw_dropout`, and the
    saved ``o`` of a dropout backward is rewritten in ``inputs`` to match) or, for a graph some node of which no
    reference covers, ``cross-check:fallback`` / ``cross-check:heuristic`` (the outputs of cuDNN's FALLBACK plan,
    else its heuristic choice)."""
    spec = canonical(spec)
    if not families.uncovered(spec):
        drops = draw_dropout(spec, inputs, handle, device) if families.dropout_nodes(spec) else None
        if drops:
            reference.redraw_saved_attention(spec, inputs, drops)
        return reference.reference_outputs(spec, inputs, dropout=drops), "reference"
    built = _plain_plan(spec, handle)
    if built is None:
        raise TuningError(f"no reference covers {', '.join(families.uncovered(spec))} and no FALLBACK or heuristic "
                          "plan builds to cross-check against")
    plan, label = built
    out = _execute(plan, handle, device, inputs)
    return {u: t.to(torch.float32) for u, t in out.items()}, f"cross-check:{label}"


def _plain_plan(spec: GraphSpec, handle: Any) -> tuple[BuiltPlan, str] | None:
    """cuDNN's FALLBACK plan of ``spec``, else its heuristic choice, and which (``fallback`` / ``heuristic``); None
    when neither builds."""
    for mode, label in (("FALLBACK", "fallback"), ("A", "heuristic")):
        g = decode(spec, handle=handle)
        try:
            prepare(g, spec, [mode])
            g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
        except Exception:  # noqa: BLE001 - no plan of this mode builds: try the next
            continue
        return BuiltPlan(spec, g, int(g.get_workspace_size())), label
    return None


#: The largest dropout dump :func:`draw_dropout` reads for one attention node (b·h·s_q·s_kv float32 elements).
DROPOUT_DUMP_BYTES = 2 << 30
#: How far the share of elements a dump drops may be from p, in standard deviations of that share.
DROPOUT_SIGMAS = 6.0


def draw_dropout(spec: GraphSpec, inputs: dict[int, torch.Tensor], handle: Any,
                 device: torch.device) -> dict[int, torch.Tensor]:
    """What cuDNN drops at each attention node with dropout (:func:`plancache.gpu.families.dropout_nodes`) from the
    seed and offset ``inputs`` bind, by node index: the multiplier of each probability (0 dropped, 1/(1-p) kept,
    :attr:`plancache.gpu.families.NodeCall.dropout`).

    The node's :func:`~plancache.gpu.families.dropout_probe` is built as cuDNN's FALLBACK plan (else its heuristic
    choice) and run once on ``inputs``. Its dump is read in whichever form (a 0/1 mask, kept elements as 1/(1-p), or
    the uniform draws kept at >= p or below 1 - p) makes the probe's own O and Stats agree with the float32 reference
    given those kept elements, and the share dropped among the visible elements must be within
    :data:`DROPOUT_SIGMAS` standard deviations of p. A candidate plan then passes only if it drops the same elements:
    a forward and a backward plan of one seed and offset must agree, or training is silently wrong."""
    out: dict[int, torch.Tensor] = {}
    for idx in families.dropout_nodes(spec):
        where = families.node_label(spec, spec.nodes[idx])
        probe = families.dropout_probe(spec, idx)
        dims = probe.spec.tensor(probe.dump_uid).dim
        if math.prod(dims) * 4 > DROPOUT_DUMP_BYTES:
            raise TuningError(f"{where}: its dropout cannot be checked: the dump of {dims} elements is over "
                              f"{DROPOUT_DUMP_BYTES >> 30} GiB")
        built = _plain_plan(probe.spec, handle)
        if built is None:
            raise TuningError(f"{where}: no FALLBACK or heuristic plan of its dropout probe builds")
        bound = {t.uid: inputs[t.uid] for t in probe.spec.input_tensors()}
        got = _execute(built[0], handle, device, bound)
        out[idx] = _read_dropout(probe, bound, got, where)
    return out


def _read_dropout(probe: families.DropoutProbe, inputs: dict[int, torch.Tensor], got: dict[int, torch.Tensor],
                  where: str) -> torch.Tensor:
    """The multiplier a probe's dump stands for (:func:`draw_dropout`), or TuningError saying why none fits. Only
    the visible elements of the dump are read: cuDNN skips the tiles a mask hides whole, which leave the dump
    unwritten there (garbage, NaN included, measured on an H100); a hidden element's multiplier is 1/(1-p), which
    its zero probability makes moot."""
    dump, p = got[probe.dump_uid].to(torch.float32), probe.p
    node = probe.checked.nodes[0]
    geo = families.attention_geometry(probe.checked, node, {port: inputs[u] for port, u in node.inputs.items()})
    visible = geo.keep(dump.device).expand_as(dump)
    outputs = {u: t for u, t in got.items() if u != probe.dump_uid}
    tolerance = {t.uid: reference.tolerance(probe.checked, t) for t in probe.checked.output_tensors()}
    tried = []
    for form, kept in _dropout_forms(dump[visible], p):
        multiplier = torch.full_like(dump, 1 / (1 - p)).masked_scatter_(visible, kept.to(torch.float32) / (1 - p))
        ref = reference.reference_outputs(probe.checked, inputs, dropout={0: multiplier})
        errs = reference.output_errors(probe.checked, outputs, ref, inputs=inputs)
        if (why := reference.first_mismatch(errs, tolerance, "reference")) is not None:
            tried.append(f"{form}: {why}")
            continue
        n = kept.numel()
        dropped = 1.0 - float(kept.float().mean()) if n else p
        if n and abs(dropped - p) > DROPOUT_SIGMAS * math.sqrt(p * (1 - p) / n) + 1.0 / n:
            raise TuningError(f"{where}: cuDNN's dropout drops {dropped:.4f} of {n} visible elements, not p = {p}")
        return multiplier
    raise TuningError(f"{where}: no reading of cuDNN's dropout dump agrees with its own output "
                      f"({'; '.join(tried) or 'its visible elements are in none of the forms read'})")


def _dropout_forms(dump: torch.Tensor, p: float) -> list[tuple[str, torch.Tensor]]:
    """The kept elements each form cuDNN may dump its dropout in would mean (``dump``: the visible elements), the
    plausible ones first."""
    zero = dump == 0
    forms = []
    if bool((zero | ((dump - 1).abs() < 1e-6)).all()):
        forms.append(("a 0/1 mask", ~zero))
    if bool((zero | ((dump * (1 - p) - 1).abs() < 1e-3)).all()):
        forms.append(("kept elements as 1/(1-p)", ~zero))
    if bool(((dump >= 0) & (dump <= 1)).all()):
        forms += [("uniform draws kept at >= p", dump >= p), ("uniform draws kept below 1 - p", dump < 1 - p)]
    return forms


def run_and_check(plan: BuiltPlan, handle: Any, device: torch.device, *, seed: int) -> tuple[float, str]:
    """Execute ``plan`` once on fresh random inputs and compare it with :func:`expected_outputs`;
    return the worst normalised error and the check applied."""
    spec = plan.spec
    inputs = reference.make_inputs(spec, device, seed=seed)
    expected, check = expected_outputs(spec, inputs, handle, device)  # first: it may rewrite a dropout's saved o
    outputs = _execute(plan, handle, device, inputs)
    return reference.compare_outputs(spec, outputs, expected, inputs=inputs), check


def plan_layouts(plan: BuiltPlan) -> dict[int, tuple[list[int], list[int]]]:
    """Real layouts of the plan's tensors where its graph knows them (a decoded or user graph; not a bare blob)."""
    try:
        return graph_layouts(plan.graph)
    except AttributeError:
        return {}


def verify_plan(spec: GraphSpec, blob: bytes, *, device: int = 0, seed: int = 12345) -> float:
    """Deserialize ``blob`` in this process into the decoded graph, run it on fresh inputs and check it
    (:func:`run_and_check`); return the error."""
    spec = canonical(spec)
    dev = require_gpu(device)
    with torch.cuda.device(dev):
        handle = create_handle(device)
        plan = deserialize_plan(spec, blob, handle, graph=decode(spec, handle=handle))
        err, _ = run_and_check(plan, handle, dev, seed=seed)
    if not math.isfinite(err):
        raise TuningError("deserialized plan produced non-finite output")
    return err
