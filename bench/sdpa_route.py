"""PyTorch attention through plancache's route against torch's own kernels (needs a GPU and the server stack).

    python bench/sdpa_route.py            # writes bench/results/sdpa_route.json and prints the tables
    python bench/sdpa_route.py --local    # no server: the route's plans built locally (host cost only)

One run, fresh processes with ``CUDA_CACHE_DISABLE=1``:

1. ``capture``: plancache installed in normal mode against a live server runs every configuration below once,
   untimed, through the route: each graph misses, FE builds it and its spec is registered; every registered miss
   is then autotuned (all in one process; one that fails or crashes it, and those a crash left, again in a
   process each) and published signed.
2. ``kernels``: a fresh strict-mode process. Attention forward + backward alone, bf16, at four shapes: flash, torch's
   own cuDNN (ATen) and plancache's route (every plan from the server): the shape's first call (synchronised wall
   time; for the route, with its preparing of the plans apart), eager (the backends taking turns for 15 rounds,
   each a median of 20 CUDA-event timings after 5 warm-ups; a backend's figure the median of its rounds) and
   replayed as a CUDA graph (median of 50 replays of one captured forward + backward); the route's host time per
   call and per eager step (``time.perf_counter`` around 50 calls queued behind a spin kernel, so the host never
   waits on the GPU unless the call itself does); the route's worst normalised error against a float32 reference.
3. ``block``: a fresh strict-mode process. LayerNorm -> QKV -> attention (causal) -> projection + residual, forward
   and backward, at four shapes: the first step of each shape (synchronised wall time) with each backend, the
   route's after a first shape of the process, with how much of it the route spent preparing its plans (writing,
   keying, loading), and with torch's own cuDNN and with flash each in a process of its own (flash's: the first
   step's other first launches, which every backend pays at a new shape); then the shape's steady step for flash,
   torch's cuDNN and the route, the backends taking turns as in 2.
4. ``block_warm``: a fresh strict-mode process with a warm start from the capture file step 1 wrote
   (``PLANCACHE_WARM``): the route's plans fetched and loaded into its C++ steady path in the background at
   install, then the block's first and steady steps of each shape as in 3.
5. ``block_cpp``: a fresh strict-mode process with the route's steady path in C++ (``attention_cpp``, the route as
   installed by default where its extension is built): the block's first and steady steps of each shape as in 3.
   Its first shape's plans come from the server, and with them, in the background, those of the other shapes of
   the same graphs (``PLANCACHE_PREFETCH_SIBLINGS``, on by default: :mod:`plancache.client.siblings`), so its later
   shapes' first steps find their plans in memory. ``block_cold``: the same with that off
   (``PLANCACHE_PREFETCH_SIBLINGS=0``), each new shape's plans fetched at its first call, nothing known ahead.
   Steps 2 and 3 measure it too (``plancache_cpp``, the ``C++`` columns), after the route with its steady path in
   Python (``plancache``, ``attention_cpp=False``, the ``py route`` columns) in the same process, whose first
   calls there find the plans verified already.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(2, 16, 1024, 128), (8, 16, 4096, 128), (16, 32, 512, 64), (1, 8, 8192, 128)]
BLOCK_HEADS, BLOCK_DIM = 16, 128
BLOCK_SHAPES = [(2, 512), (2, 1024), (4, 2048), (1, 4096)]  # (batch, sequence); the first warms the process
#: The route first: its block's first steps are a new process's. ``plancache_cpp``: the route with its C++ steady path.
BACKENDS = ("plancache", "plancache_cpp", "flash", "aten_cudnn")
ROUTES = ("plancache", "plancache_cpp")
#: Steady timings: the backends take turns, each round a median of 20 steps; a backend's figure is its rounds' median.
ROUNDS = 15
SPIN_CYCLES = 400_000_000  # a spin kernel of about 0.2 s ahead of each host timing (50 calls take far less)


def _backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION if name == "flash" else SDPBackend.CUDNN_ATTENTION])


def _route(name: str, cache: Any) -> None:
    """The route as backend ``name`` runs it (``plancache``, ``plancache_cpp``), or off for torch's own kernels."""
    from plancache.client import sdpa

    if name in ROUTES:
        sdpa.install(cache, cpp=name == "plancache_cpp")
        if name == "plancache_cpp" and sdpa.stats().get("cpp_unavailable"):
            raise SystemExit("the route's C++ steady path is unavailable here (the log says why)")
    else:
        sdpa.uninstall()


def _error(got: Any, want: Any) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6))


def kernels(cache: Any) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from plancache.client import sdpa

    out: dict[str, Any] = {}
    for shape in SHAPES:
        q, k, v, do = _inputs(shape)
        step = _step(q, k, v, do)
        row: dict[str, Any] = {}
        outputs: dict[str, tuple[Any, ...]] = {}
        for name in BACKENDS:
            _route(name, cache)
            with _backend(name):
                before = sdpa.stats()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()  # the shape's first forward + backward in this process: plans prepared, kernels loaded
                torch.cuda.synchronize()
                first = {"first_ms": (time.perf_counter() - t0) * 1e3}
                if name in ROUTES:  # of which the route's preparing of both plans (writing, keying, loading)
                    first["first_prepare_ms"] = (sdpa.stats()["prepare_seconds"] - before["prepare_seconds"]) * 1e3
                # the capture gets leaves of its own: ones an eager step used hold autograd's gradient accumulators
                # on the default stream, which a captured backward cannot wait on (cudaErrorStreamCaptureImplicit)
                fresh = (t.detach().clone().requires_grad_() for t in (q, k, v))
                row[name] = {**first, **_graphed(_step(*fresh, do))}
                # the host cost of a whole step; and of torch's cuDNN kernels, or of the route's, per call
                row[name]["host_us"] = _host_us(q, k, v, do, ("step",) if name == "flash" else ("fwd", "bwd", "step"))
                if name in ROUTES:
                    after = sdpa.stats()
                    row[name]["served"] = _delta(before, after)
                    row[name]["prepare_ms"] = (after["prepare_seconds"] - before["prepare_seconds"]) * 1e3
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    outputs[name] = (o, *torch.autograd.grad(o, (q, k, v), do))
        for name, (ms, rounds, _) in _interleaved(cache, BACKENDS, step).items():
            row[name].update(eager_ms=ms, eager_rounds_ms=rounds)
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
        ref_grads = torch.autograd.grad(ref, (qf, kf, vf), do.float())
        for name, got in outputs.items():
            row[name]["error"] = max(_error(g, r) for g, r in zip(got, (ref, *ref_grads)))
        _route("", cache)
        out["x".join(map(str, shape))] = row
    return out


def _inputs(shape: tuple[int, ...]) -> tuple[Any, ...]:
    """A kernel shape's random bf16 ``q``, ``k``, ``v`` (leaves that require grad) and ``do``, seeded by the shape."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    q, k, v, do = (torch.randn(*shape, device="cuda", generator=gen).bfloat16() for _ in range(4))
    return (*(t.requires_grad_() for t in (q, k, v)), do)


def _step(q: Any, k: Any, v: Any, do: Any) -> Any:
    """Attention forward + backward, causal, as one callable."""
    import torch
    import torch.nn.functional as F

    def step() -> None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), do)
    return step


def _graphed(step: Any) -> dict[str, Any]:
    """``graphed_ms``: the median replay of ``step`` captured in a CUDA graph; or ``graphed_error``, why the capture
    failed (the row keeps its eager figures, and the next backend is measured)."""
    import torch

    from tests.gpu_util import captured, median_ms

    try:
        return {"graphed_ms": median_ms(captured(step)[0].replay)}
    except RuntimeError as exc:  # torch.AcceleratorError (a failed capture) is one
        torch.cuda.synchronize()
        return {"graphed_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def _host_us(q: Any, k: Any, v: Any, do: Any, which: tuple[str, ...] = ("fwd", "bwd", "step")) -> dict[str, float]:
    """Host microseconds per forward call, per backward call and per whole eager step (forward + backward through
    autograd) of the kernels installed now, each behind a spin kernel long enough that the host never waits on the
    GPU: a figure above the GPU's own time per call means the call itself waited for the GPU."""
    import torch

    leaves = (q, k, v)
    q, k, v = (t.detach() for t in leaves)
    fwd = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False) \
        if "bwd" in which else None
    calls: dict[str, Any] = {
        "fwd": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False),
        "bwd": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do, q, k, v, *fwd[:2], *fwd[6:8], None, None, None, q.shape[2], k.shape[2], 0.0, True),
        "step": _step(*leaves, do),
    }
    results = {}
    for name in which:
        call = calls[name]
        call()
        n = 50
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        results[name] = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
    return results


def capture(cache: Any) -> None:
    """Every configuration of steps 2 to 5 once through the route, untimed: each of its graphs misses once."""
    _route("plancache", cache)
    for shape in SHAPES:
        _step(*_inputs(shape))()
    block(cache, ("plancache",), steady=False)


def block(cache: Any, backends: tuple[str, ...], steady: bool = True) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    hidden = BLOCK_HEADS * BLOCK_DIM
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_qkv = (torch.randn(hidden, 3 * hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16().requires_grad_()
    w_o = (torch.randn(hidden, hidden, device="cuda", generator=gen) * hidden ** -0.5).bfloat16().requires_grad_()
    ln = torch.nn.LayerNorm(hidden, device="cuda", dtype=torch.bfloat16)

    def step(x: Any, dy: Any) -> None:
        b, s, _ = x.shape
        q, k, v = (ln(x) @ w_qkv).view(b, s, 3, BLOCK_HEADS, BLOCK_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = x + o.transpose(1, 2).reshape(b, s, hidden) @ w_o
        y.backward(dy)

    from plancache.client import sdpa

    out: dict[str, Any] = {}
    for b, s in BLOCK_SHAPES:
        g2 = torch.Generator(device="cuda").manual_seed(s)
        x = torch.randn(b, s, hidden, device="cuda", generator=g2).bfloat16().requires_grad_()
        dy = torch.randn(b, s, hidden, device="cuda", generator=g2).bfloat16()
        rows: dict[str, Any] = {}
        for name in backends:  # the shape's first step with each backend
            _route(name, cache)
            with _backend(name):
                before, loads = sdpa.stats(), cache.stats()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(x, dy)
                torch.cuda.synchronize()
                rows[name] = {"first_ms": (time.perf_counter() - t0) * 1e3}
                if name in ROUTES:  # where the first step's time went: the route preparing its plans
                    after, loaded = sdpa.stats(), cache.stats()
                    rows[name]["prepare_ms"] = (after["prepare_seconds"] - before["prepare_seconds"]) * 1e3
                    rows[name]["load_ms"] = (loaded.load_seconds - loads.load_seconds) * 1e3
                    rows[name]["deserialize_ms"] = (loaded.deserialize_seconds - loads.deserialize_seconds) * 1e3
                    rows[name]["served"] = _delta(before, after)
        if steady:
            for name, (ms, rounds, served) in _interleaved(cache, backends, partial(step, x, dy)).items():
                rows[name].update(steady_ms=ms, steady_rounds_ms=rounds)
                if name in ROUTES:  # who served the steady steps (cpp:fwd / cpp:bwd for the C++ path)
                    rows[name]["steady_served"] = served
        out[f"{b}x{s}"] = rows
    _route("", cache)
    return out


def _interleaved(cache: Any, backends: tuple[str, ...], step: Any) -> dict[str, tuple[float, list[float], dict[str, float]]]:
    """``step()`` timed with each backend in turn, for :data:`ROUNDS` rounds of a median of 20 CUDA-event timings
    after 5 warm-ups: per backend the median of its rounds, the rounds, and the route's counters that moved across
    them. Taking turns, the backends meet the same drift of the GPU's clocks and of the host's load; one after the
    other, the later ones met another GPU. The last backend's route stays on: switching to the route already on is
    a no-op, so a process timing one backend keeps what its warm start loaded."""
    import statistics

    from plancache.client import sdpa
    from tests.gpu_util import median_ms

    rounds: dict[str, list[float]] = {name: [] for name in backends}
    served: dict[str, dict[str, float]] = {name: {} for name in backends}
    for _ in range(ROUNDS):
        for name in backends:
            _route(name, cache)
            with _backend(name):
                before = sdpa.stats()
                rounds[name].append(median_ms(step, n=20, warmup=5))
                for key, n in _delta(before, sdpa.stats()).items():
                    served[name][key] = served[name].get(key, 0) + n
    return {name: (statistics.median(got), got, served[name]) for name, got in rounds.items()}


def _warm_gpu(seconds: float = 2.0) -> None:
    """Matrix products for ``seconds``, so that the first backend timed meets the GPU at the clocks the later ones
    do (a fresh process's first timings otherwise run while the clocks ramp up)."""
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The route's counters that moved between two ``sdpa.stats()`` (the route's are gone once it is off)."""
    return {k: after[k] - before.get(k, 0) for k in after if k != "prepare_seconds" and after[k] != before.get(k, 0)}


def child(what: str, server: str, token: str | None, trusted: str | None, cache_dir: str | None, mode: str) -> None:
    t_start = time.perf_counter()
    import torch

    import plancache.torch
    from plancache.client import PlanCache

    cache = PlanCache(server, token=token, trusted_keys=trusted or [], cache_dir=cache_dir, mode=mode)
    # the route is switched on and off per backend below; a warm start loads into the C++ steady path
    plancache.torch.install(cache, attention_cpp=what == "block_warm")
    torch.cuda.synchronize()
    _warm_gpu()
    result: dict[str, Any] = {"what": what, "import_ms": (time.perf_counter() - t_start) * 1e3,
                              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if what == "capture":
        capture(cache)
    if what == "kernels":
        result["kernels"] = kernels(cache)
    if what == "block":
        result["block"] = block(cache, BACKENDS)
    if what == "block_aten":
        result["block"] = block(cache, ("aten_cudnn",))
    if what == "block_flash":
        result["block"] = block(cache, ("flash",), steady=False)
    if what == "block_warm":
        result["block"] = block(cache, ("plancache_cpp",))
    if what == "block_cpp":
        result["block"] = block(cache, ("plancache_cpp",))
    result["stats"] = cache.stats().as_dict()
    cache.close()
    print(json.dumps(result))


def _run(*args: str, settings: dict[str, str] | None = None) -> dict[str, Any]:
    from tests.gpu_util import run_fresh

    return run_fresh([str(Path(__file__)), *args], settings)


def _tables(results: dict[str, Any]) -> None:
    nan = float("nan")
    kern = results["kernels"]["kernels"]
    print(f"{'shape (b,h,s,d) causal':>24} | {'flash':>7} {'ATen cuDNN':>11} {'py route':>10} {'ratio':>6} "
          f"{'C++':>7} {'ratio':>6} | {'graphed: flash':>15} {'ATen':>7} {'py route':>10} {'ratio':>6} {'C++':>7} "
          f"{'ratio':>6} | {'host us fwd/bwd: route':>23} {'C++':>13} {'ATen':>13} | "
          f"{'host us/step: flash':>20} {'ATen':>6} {'route':>6} {'C++':>6} | {'error':>8} {'C++':>8}")
    for shape, row in kern.items():
        f, a, p, c = row["flash"], row["aten_cudnn"], row["plancache"], row.get("plancache_cpp", {})
        fg, ag, pg, cg = (r.get("graphed_ms", nan) for r in (f, a, p, c))
        fh, ah, ph, ch = (r.get("host_us", {}) for r in (f, a, p, c))
        ce = c.get("eager_ms", nan)
        print(f"{shape:>24} | {f['eager_ms']:>7.3f} {a['eager_ms']:>11.3f} {p['eager_ms']:>10.3f} "
              f"{p['eager_ms'] / a['eager_ms']:>6.2f} {ce:>7.3f} {ce / a['eager_ms']:>6.2f} | "
              f"{fg:>15.3f} {ag:>7.3f} {pg:>10.3f} {pg / ag:>6.2f} {cg:>7.3f} {cg / ag:>6.2f} | "
              f"{ph.get('fwd', nan):>11.1f}/{ph.get('bwd', nan):<11.1f} {ch.get('fwd', nan):>6.1f}/"
              f"{ch.get('bwd', nan):<6.1f} {ah.get('fwd', nan):>6.1f}/{ah.get('bwd', nan):<6.1f} | "
              f"{fh.get('step', nan):>20.1f} {ah.get('step', nan):>6.1f} {ph.get('step', nan):>6.1f} "
              f"{ch.get('step', nan):>6.1f} | {p['error']:>8.1e} {c.get('error', nan):>8.1e}")
    print(f"{'first call (ms)':>24} | {'flash':>7} {'ATen cuDNN':>11} {'py route':>10} {'preparing':>10}")
    for shape, row in kern.items():
        f, a, p = row["flash"], row["aten_cudnn"], row["plancache"]
        print(f"{shape:>24} | {f.get('first_ms', nan):>7.1f} {a.get('first_ms', nan):>11.1f} "
              f"{p.get('first_ms', nan):>10.1f} {p.get('first_prepare_ms', nan):>10.1f}")
    blk = results["block"]["block"]
    first_aten = results.get("block_aten", {}).get("block", {})
    first_flash = results.get("block_flash", {}).get("block", {})
    warm = results.get("block_warm", {}).get("block", {})
    first_cpp = results.get("block_cpp", {}).get("block", {})
    first_cold = results.get("block_cold", {}).get("block", {})
    print(f"{'block (b, s)':>14} | {'steady: flash':>13} {'ATen cuDNN':>11} {'py route':>10} {'vs best':>8} "
          f"{'C++':>7} {'vs best':>8} | {'first step: py route':>22} {'preparing':>10} {'warm, C++':>11} "
          f"{'preparing':>10} {'C++':>7} {'nothing ahead':>14} {'ATen cuDNN':>11} {'flash':>7} | served")
    for shape, row in blk.items():
        best = min(row["flash"]["steady_ms"], row["aten_cudnn"]["steady_ms"])
        aten_first = first_aten.get(shape, {}).get("aten_cudnn", {}).get("first_ms", nan)
        flash_first = first_flash.get(shape, {}).get("flash", {}).get("first_ms", nan)
        route, cpp = row["plancache"], row.get("plancache_cpp", {})
        warmed = warm.get(shape, {}).get("plancache_cpp", {})
        cpp_first = first_cpp.get(shape, {}).get("plancache_cpp", {}).get("first_ms", nan)
        cold_first = first_cold.get(shape, {}).get("plancache_cpp", {}).get("first_ms", nan)
        print(f"{shape:>14} | {row['flash']['steady_ms']:>13.3f} {row['aten_cudnn']['steady_ms']:>11.3f} "
              f"{route['steady_ms']:>10.3f} {route['steady_ms'] / best:>8.2f} {cpp.get('steady_ms', nan):>7.3f} "
              f"{cpp.get('steady_ms', nan) / best:>8.2f} | "
              f"{route['first_ms']:>22.1f} {route.get('prepare_ms', nan):>10.1f} "
              f"{warmed.get('first_ms', nan):>11.1f} {warmed.get('prepare_ms', nan):>10.1f} {cpp_first:>7.1f} "
              f"{cold_first:>14.1f} "
              f"{aten_first:>11.1f} {flash_first:>7.1f} | {route.get('served', {})} {cpp.get('served', '')} "
              f"steady: {cpp.get('steady_served', '')}")
    for shape, row in kern.items():
        for name, got in row.items():
            if isinstance(got, dict) and "graphed_error" in got:
                print(f"{shape} {name}: CUDA-graph capture failed: {got['graphed_error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--server", default="")
    parser.add_argument("--token")
    parser.add_argument("--trusted")
    parser.add_argument("--cache")
    parser.add_argument("--mode", default="normal")
    parser.add_argument("--local", action="store_true", help="no server: the route's plans built locally")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sdpa_route.json")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.server, args.token, args.trusted, args.cache, args.mode)
    results: dict[str, Any] = {}
    if args.local:
        results["kernels"] = _run("--child", "kernels")
        results["block"] = _run("--child", "block")
        results["block_aten"] = _run("--child", "block_aten")
        results["block_flash"] = _run("--child", "block_flash")
        results["block_cpp"] = _run("--child", "block_cpp")
    else:
        import tempfile

        from plancache.signing import Signer, keygen
        from tests.gpu_util import tune_misses
        from tests.live_server import LiveServer

        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            priv, _, _ = keygen(root / "keys")
            signer = Signer.from_file(priv)
            with LiveServer(root / "server") as srv:
                common = ["--server", srv.url, "--token", srv.token("reader"), "--trusted", str(root / "keys")]
                capture = str(root / "capture.json")
                _run("--child", "capture", *common, "--cache", str(root / "c0"),
                     settings={"PLANCACHE_CAPTURE": capture})
                t0 = time.perf_counter()
                tuned, failed = tune_misses(srv, root, signer)
                for key, why in failed.items():
                    print(f"tuning {key[:12]} failed: {why}")
                results["tuning"] = {"graphs": tuned, "seconds": time.perf_counter() - t0}
                for what in ("kernels", "block"):
                    results[what] = _run("--child", what, *common, "--cache", str(root / what), "--mode", "strict")
                results["block_warm"] = _run("--child", "block_warm", *common, "--cache", str(root / "warm"),
                                             "--mode", "strict", settings={"PLANCACHE_WARM": capture})
                results["block_cpp"] = _run("--child", "block_cpp", *common, "--cache", str(root / "cpp"),
                                            "--mode", "strict")
                results["block_cold"] = _run("--child", "block_cpp", *common, "--cache", str(root / "cold"),
                                             "--mode", "strict", settings={"PLANCACHE_PREFETCH_SIBLINGS": "0"})
                results["block_aten"] = _run("--child", "block_aten")
                results["block_flash"] = _run("--child", "block_flash")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    _tables(results)


if __name__ == "__main__":
    main()
