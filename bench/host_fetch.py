"""One fetch per host, on the CPU: N client processes start at the same instant and prefetch the 49-graph workload.

    python bench/host_fetch.py [--processes 8] [--rounds 3] [--out bench/results/host_fetch.json]

A live server (in this process, SQLite, loopback) holds a signed plan per workload graph (fake blobs of 64 KiB); each
client runs :class:`~plancache.client.PlanCache` with the fake GPU backend (verifies and "deserializes" without a
GPU; ``tests/client_burst_child.py``), strict mode, an empty disk cache. Two cases, ``--rounds`` times each:

- ``shared``: every process on one cache folder (``PLANCACHE_CACHE_DIR`` of one host): the first asks the server,
  the others wait for its disk writes and read them (``plancache/client/cache.py``, "One fetch per host");
- ``separate``: each process on its own folder: each asks the server (the behaviour before host coordination).

Reports the server's resolve requests per burst and the start-up spread: from the release of the burst to each
process's plans being ready (first, p50, max).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workload import workload  # noqa: E402
from plancache.signing import Signer, keygen  # noqa: E402
from tests.client_burst_child import burst  # noqa: E402
from tests.factories import H200, make_meta  # noqa: E402
from tests.live_server import LiveServer  # noqa: E402

BLOB_BYTES = 64 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    specs = workload()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        private, public, _ = keygen(tmp / "keys", "bench")
        signer = Signer.from_file(private)
        specs_file = tmp / "specs.json"
        specs_file.write_text(json.dumps([s.to_json() for s in specs]))
        rows: dict[str, list[dict[str, float]]] = {"shared": [], "separate": []}
        with LiveServer(tmp / "server") as srv:
            for spec in specs:
                blob = (spec.graph_key.encode() * (BLOB_BYTES // 64 + 1))[:BLOB_BYTES]
                srv.store.put_spec(spec.graph_key, spec.to_json())
                srv.store.publish_plan(make_meta(spec.graph_key, H200, blob, signer), blob)
            token = srv.token("reader")
            for r in range(args.rounds):
                for case in rows:
                    folders = ([tmp / f"{case}{r}"] if case == "shared" else
                               [tmp / f"{case}{r}-{i}" for i in range(args.processes)])
                    before = srv.requests["/v1/plans/resolve"]
                    results = burst(args.processes, srv.url, token, public, folders, specs_file)
                    start = min(x["started"] for x in results)
                    ready = sorted(x["done"] - start for x in results)
                    rows[case].append({"resolves": srv.requests["/v1/plans/resolve"] - before,
                                       "first_s": round(ready[0], 3), "p50_s": round(statistics.median(ready), 3),
                                       "max_s": round(ready[-1], 3),
                                       "server_hits": sum(x["hits"].get("server", 0) for x in results),
                                       "disk_hits": sum(x["hits"].get("disk", 0) for x in results)})
                    print(case, rows[case][-1], flush=True)
    summary = {case: {"resolves_per_burst": statistics.median(x["resolves"] for x in runs),
                      "ready_first_s": statistics.median(x["first_s"] for x in runs),
                      "ready_p50_s": statistics.median(x["p50_s"] for x in runs),
                      "ready_max_s": statistics.median(x["max_s"] for x in runs)} for case, runs in rows.items()}
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"processes": args.processes, "graphs": len(specs), "blob_bytes": BLOB_BYTES,
                                        "summary": summary, "rounds": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
