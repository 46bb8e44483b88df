"""The client's start-up on the CPU, timed from the spawn of the process: what plancache adds to ``import torch``.

    python bench/startup_cpu.py [--runs 9] [--out bench/results/startup_cpu.json]

A live server (in this process, SQLite, loopback) holds a signed plan per graph of the 49-graph workload (fake blobs
of 64 KiB). Each run is a fresh interpreter, timed from just before the parent starts it (bytecode compiled by a
first, untimed run of each case):

- ``floor``: ``import torch`` and reading the 49 blobs from one file (on a GPU the floor also starts CUDA and
  deserializes: ``bench/burst.py``);
- ``plancache``: ``import torch``, then the client as a program uses it: import, parse the 49 specs,
  ``PlanCache(...)`` (strict mode, trusted key, an empty disk cache) with a backend that "deserializes" without a GPU
  (no GPU, nothing of cuDNN), ``prefetch``, ``plan`` of each; the child also reports when each phase ended;
- the same two with ``gc.freeze()`` right after ``import torch`` (``*_frozen``): after torch's ~170,000 objects,
  any 8,000 or so new long-lived ones make CPython's next collection a full one, which walks all of torch's.

Reports medians and each phase's median end (from the spawn), and writes ``--out``. Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

CASES = ("floor", "plancache", "floor_frozen", "plancache_frozen")


def child(case: str, url: str, token: str, key: str, folder: str, spawned: float) -> dict[str, Any]:
    """One start-up; seconds from ``spawned`` at the end of each phase."""
    import torch  # noqa: F401 - the program's own import, in every case

    if case.endswith("_frozen"):
        import gc

        gc.freeze()
    ends: dict[str, float] = {"torch": time.time() - spawned}
    work = Path(folder)
    if case.startswith("floor"):
        blobs = (work / "blobs.bin").read_bytes()
        ends["ready"] = time.time() - spawned
        assert len(blobs) > 0
        return ends
    from plancache.client import PlanCache
    from plancache.environment import Environment
    from plancache.spec import parse_spec

    ends["imports"] = time.time() - spawned
    specs = [parse_spec(s) for s in json.loads((work / "specs.json").read_text())]
    ends["parse"] = time.time() - spawned

    class Loaded:
        """A "deserialized" plan: what the client keeps of one."""

        def __init__(self, spec: Any, engine_id: int | None, knobs: dict[str, int], plan_name: str, graph: Any):
            self.spec, self.engine_id, self.knobs, self.plan_name, self.graph = spec, engine_id, knobs, plan_name, graph
            self.workspace_size, self.kernel_cache, self.how = 0, None, "deserialized"

    class CpuBackend:
        """Loads plans without a GPU: the client's work without cuDNN's."""

        device, handle = "cpu", None

        def __init__(self) -> None:
            self.env = Environment.model_validate_json((work / "environment.json").read_text())

        def environment(self) -> Environment:
            return self.env

        def deserialize(self, spec: Any, blob: bytes, *, engine_id: int | None, knobs: dict[str, int],
                        plan_name: str, graph: Any = None) -> Loaded:
            return Loaded(spec, engine_id, knobs, plan_name, graph)

    with PlanCache(url, token=token, trusted_keys=key, cache_dir=work / f"cache-{os.getpid()}", backend=CpuBackend(),
                   mode="strict") as cache:
        ends["init"] = time.time() - spawned
        cache.prefetch(specs)
        ends["prefetch"] = time.time() - spawned
        assert all(cache.plan(s).source == "server" for s in specs)
        ends["ready"] = time.time() - spawned
    return ends


def run(case: str, url: str, token: str, key: Path, folder: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "ignore"}
    spawned = time.time()
    out = subprocess.run([sys.executable, __file__, "--child", case, url, token, str(key), str(folder), repr(spawned)],
                         env=env, check=True, capture_output=True, text=True, timeout=120).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case, url, token, key, folder, spawned = args.child
        print(json.dumps(child(case, url, token, key, folder, float(spawned))))
        return
    sys.path.insert(0, str(ROOT))
    from bench.workload import workload
    from plancache.signing import Signer, keygen
    from tests.factories import H200, make_meta
    from tests.live_server import LiveServer

    specs = workload()
    with tempfile.TemporaryDirectory(prefix="plancache-startup-cpu-") as name:
        folder = Path(name)
        private, public, _ = keygen(folder / "keys", "bench")
        signer = Signer.from_file(private)
        (folder / "specs.json").write_text(json.dumps([s.to_json() for s in specs]))
        (folder / "environment.json").write_text(H200.model_dump_json())
        blobs = [(s.graph_key.encode() * 1025)[:64 * 1024] for s in specs]
        (folder / "blobs.bin").write_bytes(b"".join(blobs))
        with LiveServer(folder / "server") as srv:
            for spec, blob in zip(specs, blobs, strict=True):
                srv.store.put_spec(spec.graph_key, spec.to_json())
                srv.store.publish_plan(make_meta(spec.graph_key, H200, blob, signer), blob)
            token = srv.token("reader")
            for case in CASES:  # compiles the bytecode; the server's answers warm
                run(case, srv.url, token, public, folder)
            runs: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
            for _ in range(args.runs):
                for case in CASES:
                    runs[case].append(run(case, srv.url, token, public, folder))
    summary = {case: {phase: round(statistics.median(r[phase] for r in rows), 4) for phase in rows[0]}
               for case, rows in runs.items()}
    for case, phases in summary.items():
        print(f"{case:17s} " + "  ".join(f"{p} {s * 1000:.0f} ms" for p, s in phases.items()))
    for frozen in ("", "_frozen"):
        floor, client = summary[f"floor{frozen}"]["ready"], summary[f"plancache{frozen}"]["ready"]
        print(f"plancache{frozen}: {client / floor:.2f}x the floor, {(client - floor) * 1000:.0f} ms over it")
    if args.out:
        args.out.write_text(json.dumps({"graphs": len(specs), "blob_bytes": len(blobs[0]), "runs": args.runs,
                                        "python": sys.version.split()[0], "cpus": os.cpu_count(),
                                        "summary": summary, "all": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
