"""Run in a fresh process by tests/integration/test_multi_gpu.py (two CUDA devices); prints one JSON line.

``tune``: autotune a spec on ``--device`` (builder processes included) and write the blob and the unsigned record
into ``--out``. ``client``: a ``PlanCache(device=N)`` loads the specs from a server, executes and captures each plan
on device N with the thread's current device left at 0, and checks it against the float32 reference.
``pair``: two caches, on devices 0 and 1, in this one process, load the same specs and run each plan on its own
device, refusing the other's tensors. Each reports which devices this process holds a CUDA context on.
``hook``: the hook installed with a cache on device 0 (``--mode``), FE's own ``rms_norm`` forward and backward on
``cuda:1`` tensors with the current device left at 0: which caches served it, and its numerics.
``observe``: hold device ``--device``, print its free memory, then the lowest free memory seen every 20 ms until a
line arrives on stdin (what the other processes took from that device meanwhile).

usage: python -m tests.multi_gpu_child tune --device N --out DIR SPEC.json
       python -m tests.multi_gpu_child client --device N --cache DIR --server URL --token T --trusted PUB SPEC.json...
       python -m tests.multi_gpu_child pair --cache DIR --server URL --token T --trusted PUB SPEC.json...
       python -m tests.multi_gpu_child hook --mode M --cache DIR --server URL --token T --trusted PUB
       python -m tests.multi_gpu_child observe --device N
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from plancache import gpu
from plancache.client import Plan, PlanCache
from plancache.spec import GraphSpec, parse_spec


def contexts() -> list[int]:
    """The devices (ordinals of this process) holding an active primary CUDA context of this process."""
    lib = ctypes.CDLL("libcuda.so.1")
    held = []
    for ordinal in range(torch.cuda.device_count()):
        dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert lib.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
        assert lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
        if active.value:
            held.append(ordinal)
    return held


def _check(plan: Plan, device: int, seed: int, *, other: bool = False) -> dict[str, Any]:
    """Run ``plan`` eagerly and from a CUDA graph on fresh inputs on ``device``; the errors of both against the
    reference, and (``other``) the refusal of its inputs moved to the other device."""
    dev = torch.device("cuda", device)
    spec = plan.spec.canonical_document()
    inputs = gpu.make_inputs(spec, dev, seed=seed)
    outputs = gpu.allocate_outputs(spec, dev)
    plan.execute({**inputs, **outputs})
    torch.cuda.synchronize(dev)
    with torch.cuda.device(dev):
        handle = gpu.create_handle(device)
        expected, check = gpu.expected_outputs(spec, inputs, handle, dev)
    eager = gpu.output_errors(spec, outputs, expected, inputs=inputs)
    graph = plan.capture({**inputs, **outputs})
    fresh = gpu.make_inputs(spec, dev, seed=seed + 1)
    for uid, t in fresh.items():
        if t.is_cuda:  # scalars stay at their captured values
            inputs[uid].copy_(t)
    for t in outputs.values():
        t.fill_(float("nan") if t.dtype.is_floating_point else -1)
    with torch.cuda.device(dev):
        graph.replay()
    torch.cuda.synchronize(dev)
    with torch.cuda.device(dev):
        expected, _ = gpu.expected_outputs(spec, inputs, handle, dev)
    replay = gpu.output_errors(spec, outputs, expected, inputs=inputs)
    refused = ""
    if other:
        elsewhere = torch.device("cuda", 1 - device)
        try:
            plan.execute({**{u: t.to(elsewhere) if t.is_cuda else t for u, t in inputs.items()}, **outputs})
        except ValueError as exc:
            refused = str(exc)
    return {"eager": eager, "replay": replay, "check": check, "other_device_refused": refused}


def _cache(args: argparse.Namespace, device: int, folder: str) -> PlanCache:
    return PlanCache(args.server, token=args.token, trusted_keys=[args.trusted], cache_dir=Path(args.cache) / folder,
                     mode="strict", device=device)


def tune(args: argparse.Namespace) -> dict[str, Any]:
    from plancache.environment import detect
    from plancache.worker import GpuTuner

    spec = parse_spec(Path(args.specs[0]).read_text()).canonical_document()
    with GpuTuner(args.device, warmup=2, repeats=5, build_processes=2) as tuner:
        env = tuner.environment()
        tuned = tuner.tune(spec)
        round_trip = tuner.verify(spec, tuned.blob)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "blob").write_bytes(tuned.blob)
    (out / "meta.json").write_text(tuned.to_meta(spec.graph_key, "multi-gpu-test").model_dump_json())
    props = torch.cuda.get_device_properties(args.device)
    return {"environment": env.model_dump(), "detected": detect(args.device).model_dump(), "uuid": str(props.uuid),
            "max_abs_err": tuned.max_abs_err, "round_trip_error": round_trip, "contexts": contexts(),
            "allocated": {d: torch.cuda.memory_allocated(d) for d in range(torch.cuda.device_count())}}


def client(args: argparse.Namespace) -> dict[str, Any]:
    specs = [parse_spec(Path(p).read_text()) for p in args.specs]
    pc = _cache(args, args.device, "one")
    plans = pc.prefetch(specs)
    results = {s.graph_key: {"source": plans[s.graph_key].source, **_check(plans[s.graph_key], args.device, n)}
               for n, s in enumerate(specs)}
    return {"plans": results, "current_device": torch.cuda.current_device(), "contexts": contexts(),
            "environment": pc.environment.model_dump()}


def pair(args: argparse.Namespace) -> dict[str, Any]:
    specs: list[GraphSpec] = [parse_spec(Path(p).read_text()) for p in args.specs]
    caches = [_cache(args, 0, "zero"), _cache(args, 1, "one")]
    loaded: list[dict[str, Plan]] = [{}, {}]
    threads = [threading.Thread(target=lambda n=n: loaded[n].update(caches[n].prefetch(specs))) for n in (0, 1)]
    for t in threads:  # both caches load at once, each on its own device
        t.start()
    for t in threads:
        t.join()
    results: dict[str, Any] = {}
    for n, s in enumerate(specs):
        p0, p1 = loaded[0][s.graph_key], loaded[1][s.graph_key]
        results[s.graph_key] = {"distinct": p0 is not p1 and p0.graph is not p1.graph,
                                "devices": [str(p0._backend.device), str(p1._backend.device)],
                                "sources": [p0.source, p1.source],
                                "zero": _check(p0, 0, 10 * n, other=True), "one": _check(p1, 1, 10 * n + 5, other=True)}
    return {"plans": results, "handles_distinct": caches[0]._backend.handle is not caches[1]._backend.handle,
            "contexts": contexts()}


def hook(args: argparse.Namespace) -> dict[str, Any]:
    from cudnn.ops.norm import rms_norm

    from plancache.client import hook as fe_hook

    cache = PlanCache(args.server, token=args.token, trusted_keys=[args.trusted], cache_dir=args.cache, mode=args.mode,
                      device=0)
    dev = torch.device("cuda", 1)
    with fe_hook.installed(cache):
        g = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(256, 512, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
        w = (1 + 0.1 * torch.randn(512, device=dev, generator=g)).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(256, 512, device=dev, generator=g).to(torch.bfloat16)
        y = rms_norm(x, w, None, 1e-5)
        y.backward(dy)
        torch.cuda.synchronize(dev)
        caches = {str(d): c.stats().as_dict() for d, c in fe_hook.caches().items()}
    xf, wf = (t.detach().float().requires_grad_() for t in (x, w))
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * wf
    ref.backward(dy.float())
    assert x.grad is not None and xf.grad is not None

    def err(out: torch.Tensor, want: torch.Tensor) -> float:
        return float((out.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))

    return {"caches": caches, "errors": {"Y": err(y.detach(), ref.detach()), "dX": err(x.grad, xf.grad)},
            "current_device": torch.cuda.current_device()}


def observe(args: argparse.Namespace) -> None:
    dev = torch.device("cuda", args.device)
    torch.cuda.init()
    free0, _ = torch.cuda.mem_get_info(dev)  # after this process's own context on the device
    print(json.dumps({"free": free0}), flush=True)
    lowest = free0
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    while not stop.wait(0.02):
        lowest = min(lowest, torch.cuda.mem_get_info(dev)[0])
    print(json.dumps({"free": free0, "lowest": lowest}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tune")
    t.add_argument("--device", type=int, required=True)
    t.add_argument("--out", required=True)
    t.add_argument("specs", nargs=1)
    for name in ("client", "pair"):
        c = sub.add_parser(name)
        if name == "client":
            c.add_argument("--device", type=int, required=True)
        for option in ("--cache", "--server", "--token", "--trusted"):
            c.add_argument(option, required=True)
        c.add_argument("specs", nargs="+")
    h = sub.add_parser("hook")
    for option in ("--mode", "--cache", "--server", "--token", "--trusted"):
        h.add_argument(option, required=True)
    o = sub.add_parser("observe")
    o.add_argument("--device", type=int, required=True)
    args = parser.parse_args()
    if args.cmd == "observe":
        observe(args)
        return
    print(json.dumps({"tune": tune, "client": client, "pair": pair, "hook": hook}[args.cmd](args), default=str))


if __name__ == "__main__":
    main()
