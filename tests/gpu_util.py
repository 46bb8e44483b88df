"""Skip helpers for tests that need a CUDA GPU with cuDNN and nvidia-cudnn-frontend, and the tuning of a live
server's misses that GPU tests and benchmarks share."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here, or None when they can."""
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    if importlib.util.find_spec("cudnn") is None:
        return "nvidia-cudnn-frontend is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    try:
        import cudnn

        cudnn.backend_version()
    except Exception as exc:  # the cuDNN library itself is missing or broken
        return f"cuDNN backend unavailable: {exc}"
    return None


_REASON = gpu_skip_reason()
#: Apply to every GPU test together with ``@pytest.mark.gpu``.
requires_gpu = pytest.mark.skipif(_REASON is not None, reason=f"GPU test: {_REASON}")


def loaded_engine_id(graph: object) -> int | None:
    """The engine id of the plan a pygraph holds after ``deserialize``, read back from cuDNN (not from the plan's
    record): the graph's ``(engine_id, knobs)`` of its one plan where FE tells it, else the ``engineId`` of the
    execution plan cuDNN describes when the loaded graph is serialized again (FE 1.32 tells neither the engine nor
    the plan name of a deserialized graph); None where cuDNN tells neither (a python-engine plan)."""
    import re

    try:
        return int(graph.get_engine_and_knobs_at_index(0)[0])  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - FE 1.32 answers nothing for a deserialized graph
        pass
    try:
        found = re.search(rb'"engineId":(\d+)', bytes(graph.serialize(as_bytes=True)))  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - this graph cannot be serialized again
        return None
    return int(found.group(1)) if found else None


def tune_misses(srv: Any, root: Path, signer: Any) -> tuple[int, dict[str, str]]:
    """Autotune every miss a live server recorded from its spec alone and publish each winner signed by
    ``signer``: all of them in one process (``tests.fe_ops_gpu_child --tune``), then each one it left (a crash
    takes the rest of its list down, a failure leaves its own) in a process of its own, where a crash stays and its
    error is read. How many were tuned, and why each other one was not (by graph key)."""
    from plancache.protocol import PlanMeta

    root = Path(root)
    failed: dict[str, str] = {}
    paths: dict[str, Path] = {}
    (root / "specs").mkdir(parents=True, exist_ok=True)
    for miss in srv.store.list_misses(limit=500):
        doc = srv.store.get_spec(miss.graph_key)
        if doc is None:
            failed[miss.graph_key] = "the miss was recorded without its spec"
            continue
        paths[miss.graph_key] = root / "specs" / f"{miss.graph_key}.json"
        paths[miss.graph_key].write_text(json.dumps(doc))
        (root / f"{miss.graph_key}.meta.json").unlink(missing_ok=True)  # an earlier call's: tuned again
    if paths:
        _tune(root, list(paths.values()))
    tuned = 0
    for key, path in paths.items():
        meta_path = root / f"{key}.meta.json"
        if not meta_path.exists():
            proc = _tune(root, [path])
            if proc.returncode != 0 or not meta_path.exists():
                failed[key] = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:600]
                continue
        meta = PlanMeta.model_validate_json(meta_path.read_text())
        srv.store.publish_plan(signer.sign(meta), (root / f"{key}.blob").read_bytes())
        tuned += 1
    return tuned, failed


def _tune(out: Path, specs: list[Path], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``tests.fe_ops_gpu_child --tune`` of ``specs`` into ``out``, in one fresh process; one that runs past
    ``timeout`` seconds is killed and answered as a failure (what it finished is in ``out``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "tests.fe_ops_gpu_child", "--tune", str(out), *map(str, specs)]
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, -9, "", f"tuning did not end within {timeout:.0f} s")


def median_ms(fn: Any, n: int = 50, warmup: int = 10) -> float:
    """The median of ``n`` CUDA-event timings of ``fn()`` after ``warmup`` calls, in milliseconds."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def captured(fn: Any, warmup: int = 3) -> tuple[Any, Any]:
    """``fn()`` captured in a ``torch.cuda.CUDAGraph`` after ``warmup`` calls on a side stream: the graph, and what
    the captured call returned (the tensors its replays write). A backward in ``fn`` needs leaves no eager step
    used: those hold gradient accumulators on the default stream, which a capture cannot wait on
    (``cudaErrorStreamCaptureImplicit``)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def run_fresh(argv: list[str], settings: dict[str, str] | None = None, timeout: float = 900) -> dict[str, Any]:
    """A benchmark's child in a fresh process (``CUDA_CACHE_DISABLE=1``; ``settings`` its only ``PLANCACHE_*``
    variables): the JSON object of its last line of output, or SystemExit with the end of its stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")} | (settings or {})
    env.update(CUDA_CACHE_DISABLE="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    if proc.returncode != 0:  # nanobind's report of leaks at exit would hide the error
        lines = [line for line in proc.stderr.splitlines() if "nanobind" not in line and "leaked" not in line]
        raise SystemExit(f"bench child {argv[:3]} failed:\n" + "\n".join(lines[-40:]))
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result
