"""A new shape's two plans fetched on the CPU: where the round trip's milliseconds go.

    python bench/new_shape_fetch.py [--pairs 30] [--blob-kib 64] [--out bench/results/new_shape_fetch.json]
    python bench/new_shape_fetch.py --busy-thread [--switch-interval 0.0002]

What PyTorch attention's route asks at a configuration's first call, nothing known ahead: the verified blobs of its
forward and backward (``PlanCache.verified_blobs``), one resolve of two graph keys with the blobs inline. A live
server (in this process, SQLite, loopback) holds a signed plan per spec (fake blobs of ``--blob-kib``); a client
process of its own (``import torch`` first, as a training process has) takes fresh pairs in turn, each asked once
(every ask is the server's first for its keys), for ``--pairs`` rounds of:

- ``answer``: the resolve request sent with a plain httpx client and its answer read whole: the server's work and
  the wire;
- ``resolve``: the same through the client's HTTP layer, as the route sends it: held to its deadline by a helper
  thread, the answer parsed;
- ``verified_blobs``: the whole ask: the disk cache looked up, the host's fetch lock taken, the resolve, the blobs
  decoded and verified (size, sha256, signature, signed statement), their disk writes queued (the plans of other
  shapes not fetched ahead: ``prefetch_siblings=0``);
- ``sibling``: the same ask for a new pair whose plans the client fetched ahead, in the background, when it loaded
  another shape of the same graphs (``PLANCACHE_PREFETCH_SIBLINGS``, the default; :mod:`plancache.client.siblings`),
  timed once that background fetch is done: the kept blobs verified again.

``--busy-thread`` runs a thread of pure-Python arithmetic in the client process throughout, as a program with a
CPU-bound Python thread has: each time the fetching thread gives up the GIL (a socket read, a thread hop, a digest
of a large buffer) it waits for the busy thread to be made to let it go, up to the interpreter's switch interval
(``sys.getswitchinterval()``, 5 ms by default; ``--switch-interval`` sets it in the client process).

Reports the medians (ms) and their differences, the client's parts, and writes ``--out``. Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

WAYS = ("answer", "resolve", "verified_blobs", "sibling")


def child(url: str, token: str, key: str, folder: str, busy: str, switch: str) -> dict[str, list[float]]:
    """Each way's times (ms), one fresh pair of specs per time; the first round warms the connections, uncounted.
    ``busy`` (``1``): with a CPU-bound Python thread running; ``switch``: the switch interval (s; ``-``: left)."""
    import httpx
    import torch  # noqa: F401 - the program's own import

    from plancache.client import PlanCache
    from plancache.protocol import ResolveRequest
    from plancache.spec import parse_spec
    from tests.client_fakes import RecordingBackend

    if switch != "-":
        sys.setswitchinterval(float(switch))
    if busy == "1":
        threading.Thread(target=_spin, daemon=True, name="busy").start()
    specs = [parse_spec(doc) for doc in json.loads((Path(folder) / "specs.json").read_text())]
    pairs = iter([specs[i:i + 2] for i in range(0, len(specs) - 1, 2)])
    kin = [parse_spec(doc) for doc in json.loads((Path(folder) / "siblings.json").read_text())]
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with PlanCache(url, token=token, trusted_keys=key, cache_dir=Path(folder) / f"cache-{os.getpid()}",
                   backend=RecordingBackend(), mode="strict", prefetch_siblings=0) as cache, \
            PlanCache(url, token=token, trusted_keys=key, cache_dir=Path(folder) / f"kin-{os.getpid()}",
                      backend=RecordingBackend(), mode="strict") as ahead, \
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as plain:
        remote, env = cache.context.remote, cache.environment
        assert remote is not None

        def answer(pair: list[Any]) -> None:
            body = ResolveRequest(environment=env, graph_keys=[s.graph_key for s in pair], include_blobs=True)
            got = plain.post("/v1/plans/resolve", content=body.model_dump_json(),
                             headers={"Content-Type": "application/json"})
            assert got.status_code == 200 and len(got.json()["plans"]) == 2, got.text[:500]

        def resolve(pair: list[Any]) -> None:
            got = remote.resolve(env, [s.graph_key for s in pair], deadline=time.monotonic() + cache.context.request_deadline)
            assert len(got.plans) == 2

        def verified(pair: list[Any]) -> None:
            assert len(cache.verified_blobs(pair)) == 2

        def sibling(pair: list[Any]) -> None:
            got = ahead.verified_blobs(pair)
            assert len(got) == 2 and {b.source for b in got.values()} == {"memory"}, got

        ways = {"answer": answer, "resolve": resolve, "verified_blobs": verified, "sibling": sibling}
        kin_pairs = iter([kin[i:i + 4] for i in range(0, len(kin) - 3, 4)])
        for n, pair_set in enumerate(zip(pairs, pairs, pairs, kin_pairs)):
            first, later = pair_set[3][:2], pair_set[3][2:]
            ahead.verified_blobs(first)  # another shape of the same graphs: its siblings fetched in the background
            ahead.siblings.join(60)
            for (way, ask), pair in zip(ways.items(), (*pair_set[:3], later), strict=True):
                t0 = time.perf_counter()
                ask(pair)
                if n:
                    times[way].append((time.perf_counter() - t0) * 1e3)
    return times


def _spin() -> None:
    """Pure-Python arithmetic for ever: a thread that holds the GIL until the interpreter makes it let go."""
    n = 0
    while True:
        n = (n + 1) % 1_000_003


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=30, help="rounds of three fresh pairs each (default 30)")
    parser.add_argument("--blob-kib", type=int, default=64, help="each plan's blob, KiB (default 64)")
    parser.add_argument("--busy-thread", action="store_true", help="a CPU-bound Python thread in the client process")
    parser.add_argument("--switch-interval", type=float, help="the client process's sys.setswitchinterval (s)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    if args.pairs < 1 or args.blob_kib < 1:
        parser.error("--pairs and --blob-kib take a positive number")
    if args.switch_interval is not None and args.switch_interval <= 0:
        parser.error("--switch-interval takes a positive number of seconds")
    sys.path.insert(0, str(ROOT))
    from examples.generate import sdpa_causal
    from plancache.signing import Signer, keygen
    from tests.factories import H200, make_meta
    from tests.live_server import LiveServer

    # a forward-sized pair per sequence length: every spec distinct, none asked for before its turn
    specs = [sdpa_causal(batch=b, heads=16, seq=64 * (i + 1), d=128) for i in range(3 * (args.pairs + 1)) for b in (2, 4)]
    # per round, a forward-sized pair of graphs of their own (heads) at two shapes: one loaded, the other asked after
    kin = [sdpa_causal(batch=b, heads=17 + i, seq=s, d=128) for i in range(args.pairs + 1) for s in (512, 1024)
           for b in (2, 4)]
    with tempfile.TemporaryDirectory(prefix="plancache-new-shape-fetch-") as name:
        folder = Path(name)
        private, public, _ = keygen(folder / "keys", "bench")
        signer = Signer.from_file(private)
        (folder / "specs.json").write_text(json.dumps([s.to_json() for s in specs]))
        (folder / "siblings.json").write_text(json.dumps([s.to_json() for s in kin]))
        with LiveServer(folder / "server", autotune=False) as srv:
            for spec in [*specs, *kin]:
                blob = os.urandom(args.blob_kib * 1024)
                srv.store.put_spec(spec.graph_key, spec.to_json())
                srv.store.publish_plan(make_meta(spec.graph_key, H200, blob, signer), blob)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                   "PYTHONWARNINGS": "ignore"}
            switch = "-" if args.switch_interval is None else repr(args.switch_interval)
            out = subprocess.run([sys.executable, __file__, "--child", srv.url, srv.token("reader"), str(public),
                                  str(folder), "1" if args.busy_thread else "0", switch],
                                 env=env, check=True, capture_output=True, text=True, timeout=600).stdout
    times: dict[str, list[float]] = json.loads(out.strip().splitlines()[-1])
    medians = {way: round(statistics.median(times[way]), 3) for way in WAYS}
    parts = {"server's answer, received": medians["answer"],
             "client's HTTP layer (deadline thread, parsing)": round(medians["resolve"] - medians["answer"], 3),
             "client's checks and disk cache": round(medians["verified_blobs"] - medians["resolve"], 3),
             "a pair fetched ahead with its siblings": medians["sibling"]}
    client = (["a busy Python thread"] if args.busy_thread else []) + (
        [f"switch interval {args.switch_interval * 1e3:g} ms"] if args.switch_interval is not None else [])
    where = f" (client: {', '.join(client)})" if client else ""
    print(f"a new pair of {args.blob_kib} KiB plans{where}, median of {args.pairs}: " +
          ", ".join(f"{way} {ms:.2f} ms" for way, ms in medians.items()))
    for part, ms in parts.items():
        print(f"  {part}: {ms:.2f} ms")
    if args.out:
        args.out.write_text(json.dumps({"pairs": args.pairs, "blob_bytes": args.blob_kib * 1024,
                                        "busy_thread": args.busy_thread, "switch_interval_s": args.switch_interval,
                                        "python": sys.version.split()[0], "cpus": os.cpu_count(),
                                        "median_ms": medians, "parts_ms": parts, "all_ms": times}, indent=1) + "\n")


if __name__ == "__main__":
    main()
