"""plancache's route for ``F.scaled_dot_product_attention`` on the GPU, per variant (tests/sdpa_route_gpu_child.py).

A normal-mode process runs every variant: each configuration misses, is built locally and registered; every
registered miss is autotuned here from its document alone and published signed; a fresh strict-mode process
(``CUDA_CACHE_DISABLE=1``) then serves every variant from the server through the route, forward and backward,
against a float32 reference, with a CUDA-graph replay equal to eager and a block under ``torch.compile``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_util import requires_gpu, tune_misses
from tests.live_server import LiveServer

pytestmark = [pytest.mark.gpu, requires_gpu]

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 2e-2  # bfloat16/float16 outputs and gradients, normalised max error
#: Variants served by the route: each must load its forward and backward plans and run both through it (dropout:
#: compared with torch's own cuDNN kernels drawing from the same generator state, not with float32 math).
SERVED = ("causal", "no_mask_fp16", "bshd_layout", "gqa", "additive_bias", "bool_padding_mask",
          "padding_per_batch", "causal_lower_right", "scale", "dropout", "cuda_graph_replay", "compiled_block",
          "steady_steps", "queued_steps", "causal_other_shape")


#: Variants torch's flash kernel can run (no bias, as many key as query heads): a flash pin serves them by flash.
FLASH_TAKES = ("causal", "no_mask_fp16", "bshd_layout", "scale", "cuda_graph_replay", "compiled_block",
               "steady_steps", "queued_steps", "causal_other_shape")

#: Variants that run causal's configuration again, its plans loaded by ``causal`` before them: nothing to load.
AGAIN = ("cuda_graph_replay", "compiled_block", "steady_steps", "queued_steps")
#: Variants of another shape of an earlier one's graphs: their plans came with its, fetched ahead (siblings).
SIBLINGS = ("causal_other_shape",)

#: What a variant reports beside its errors against the reference: not errors, not held to :data:`TOLERANCE`.
REPORTED = ("generator", "host_over_spin")


def child(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
    env.update(CUDA_CACHE_DISABLE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tests.sdpa_route_gpu_child", *args], capture_output=True, text=True,
                          timeout=500, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(run: dict, what: str, *, strict: bool, native: str | None = None) -> None:
    """Every variant ran through the route, and every output and gradient is within tolerance: all failures in one
    message. ``native``: the kernel pinned (flash: for the variants of :data:`FLASH_TAKES`, the others by their
    plans; cudnn_aten: dropout by torch's own op, counted as such), or ``fastest``: each call by its plan or by the
    native kernel its record measured faster, never by torch's kernel for a reason."""
    bad = []
    for name, got in run["variants"].items():
        route = got["route"]
        if "error" in got:
            bad.append(f"{name}: {got['error']}")
            continue
        errors = {out: err for out, err in got["errors"].items() if out not in REPORTED}
        if name == "dropout" and native == "cudnn_aten":
            if route.get("fwd_aten:dropout", 0) < 1 or route.get("fwd", 0):
                bad.append(f"{name}: expected torch's own op (dropout), got {route}")
            bad += [f"{name} {out}: error {err}" for out, err in errors.items() if not err <= TOLERANCE]
            continue
        pinned = native in ("cudnn_aten", "flash") and (native != "flash" or name in FLASH_TAKES)
        for way in ("fwd", "bwd"):
            plans, natives = route.get(way, 0), sum(n for k, n in route.items() if k.startswith(f"{way}_native:"))
            if pinned:
                ok = route.get(f"{way}_native:{native}", 0) >= 1 and plans == 0
            elif native == "fastest":
                ok = plans + natives >= 1
            else:
                ok = plans >= 1 and natives == 0
            if not ok:
                bad.append(f"{name}: {way} not run as {native or 'plan'} asks: {route}")
        if any(k.startswith(("fwd_aten", "bwd_aten")) for k in route):
            bad.append(f"{name}: left to torch's kernel: {route}")
        if strict and not pinned and name in SIBLINGS and (route.get("load:memory", 0) < 2 or route.get("load:server")):
            bad.append(f"{name}: forward and backward plans not fetched ahead with causal's: {route}")
        elif strict and not pinned and name not in AGAIN + SIBLINGS and route.get("load:server", 0) < 2:
            bad.append(f"{name}: forward and backward plans not loaded from the server: {route}")
        bad += [f"{name} {out}: error {err}" for out, err in errors.items() if not err <= TOLERANCE]
    assert not bad, f"{what}:\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from plancache.signing import Signer, keygen

    root = tmp_path_factory.mktemp("sdpa_route")
    priv, _, _ = keygen(root / "keys")
    signer = Signer.from_file(priv)
    with LiveServer(root / "server") as srv:
        normal = child("--server", srv.url, "--token", srv.token("reader"), "--trusted", str(root / "keys"),
                       "--cache", str(root / "c0"), "--mode", "normal")
        tuned, failed = tune_misses(srv, root, signer)
        yield srv, root, normal, tuned, failed


def test_a_normal_process_runs_every_variant_through_the_route_and_registers_its_graphs(fleet):
    srv, _, normal, tuned, failed = fleet
    check(normal, "normal", strict=False)
    assert failed == {}, f"graphs that could not be tuned: {failed}"
    assert tuned >= 2 * 9, f"every served variant registers a forward and a backward graph ({tuned} tuned)"
    checks = {r.graph_key[:12]: r.numerics_check for r in srv.store.list_plans(limit=500)}
    assert set(checks.values()) == {"reference"}, f"every graph, dropout too, checked against float32: {checks}"
    print(f"\nnormal: {tuned} attention graphs registered and tuned; route {normal['variants']}")


def test_a_fresh_strict_process_serves_every_variant_from_the_server(fleet, tmp_path):
    srv, root, _, tuned, _ = fleet
    strict = child("--server", srv.url, "--token", srv.token("reader"), "--trusted", str(root / "keys"),
                   "--cache", str(tmp_path / "cache"), "--mode", "strict")
    check(strict, "strict", strict=True)
    stats = strict["stats"]
    assert stats["rejects"] == {} and stats["hits"].get("heuristic", 0) == 0 and stats["hits"].get("server") == tuned
    for name in SERVED:
        print(f"{name}: route {strict['variants'][name]['route']} errors {strict['variants'][name].get('errors')}")


@pytest.mark.parametrize("attention", ["fastest", "cudnn_aten", "flash"])
def test_native_kernels_measured_or_pinned_serve_every_variant_with_reference_numerics(fleet, tmp_path, attention):
    """What the worker measured (``fastest``) or a pin: each call runs the plan or the native kernel the choice names,
    through plancache.gpu.native, forward and backward within tolerance of float32; and the records of the tuned
    attention graphs state torch's kernels' medians beside the winner's."""
    srv, root, _, _, _ = fleet
    run = child("--server", srv.url, "--token", srv.token("reader"), "--trusted", str(root / "keys"),
                "--cache", str(tmp_path / "cache"), "--mode", "strict", "--attention", attention)
    check(run, attention, strict=True, native=attention)
    records = [r for r in srv.store.list_plans(limit=500)
               if "_dropout_n" not in json.dumps(srv.store.get_spec(r.graph_key))]  # torch's kernels: no dropout
    measured = [r.native_median_ms for r in records if r.native_median_ms]
    assert len(measured) == len(records), f"records without native timings: {len(records) - len(measured)}"
    assert all("cudnn_aten" in m for m in measured), measured
    print(f"\n{attention}: " + ", ".join(f"{n}: {g['route']}" for n, g in run["variants"].items()))


def test_the_cpp_steady_path_serves_every_variant_from_its_second_call(fleet, tmp_path):
    """The route as installed by default (``attention_cpp`` ``auto``) takes the extension built here, and every
    variant's second call (eager, replayed or compiled) is served by the C++ kernels with float32-reference numerics
    (dropout: equal to torch's own kernel drawing from the same generator state; a boolean mask: converted by the
    Python route on the way). Steps at the same addresses replay the launches captured there, forward and backward,
    with the first step's output exactly; steps whose graph is still queued behind a spin kernel do not wait for it;
    no capture fails."""
    srv, root, _, _, _ = fleet
    run = child("--server", srv.url, "--token", srv.token("reader"), "--trusted", str(root / "keys"),
                "--cache", str(tmp_path / "cache"), "--mode", "strict", "--cpp")
    assert run["cpp_unavailable"] == 0, f"the extension did not build or load: {run['cpp_error']}"
    assert run["loader_used"], "no training forward's backward plan loaded on the route's loader thread"
    check(run, "cpp", strict=False)
    bad = []
    for name, got in run["variants"].items():
        route = got["route"]
        if min(route.get("cpp:fwd", 0), route.get("cpp:bwd", 0)) < 1:
            bad.append(f"{name}: not served by the C++ kernels at its second call: {route}")
        if any(k.endswith("_cpp_refused") for k in route):
            bad.append(f"{name}: the extension refused a plan: {route}")
        if route.get("cpp:capture_failed", 0):
            bad.append(f"{name}: a capture of the plan's launches failed: {route}")
    steady = run["variants"]["steady_steps"]
    for way in ("fwd", "bwd"):
        if steady["route"].get(f"cpp:{way}_replayed", 0) < 2:
            bad.append(f"steady_steps: the {way} steps at repeated addresses were not replayed: {steady['route']}")
    if steady["errors"]["repeat_out"] != 0.0:
        bad.append(f"steady_steps: a replayed step's output differs from the first step's: {steady['errors']}")
    queued = run["variants"]["queued_steps"]["errors"]
    if not queued["host_over_spin"] < 0.5:
        bad.append(f"queued_steps: steps behind a spin kernel waited for the GPU (host / spin time "
                   f"{queued['host_over_spin']:.2f})")
    assert not bad, "\n".join(bad)
    print("\ncpp: " + ", ".join(f"{n}: {g['route']}" for n, g in run["variants"].items()))
