"""What hashing a blob on every read costs a folder store: ``FolderBlobs.get`` (read and sha256) against reading the
same file without hashing, page cache warm.

    python bench/blob_read.py [--runs 30] [--out FILE]

For a 150 KiB and a 64 MiB blob (the typical plan and the largest a server accepts) reports the fastest and the
median seconds of each way over ``--runs`` reads (the fastest is the cost on an idle machine) and the difference.
Needs no GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from plancache.blobs import FolderBlobs

SIZES = {"150 KiB": 150 * 1024, "64 MiB": 64 * 1024 * 1024}


def seconds(read: Callable[[], object], runs: int) -> tuple[float, float]:
    """The fastest and the median seconds of ``runs`` calls of ``read``."""
    read()  # warm the page cache
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        read()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results: dict[str, object] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                  "load_average": os.getloadavg()[0], "runs": args.runs}
    with tempfile.TemporaryDirectory() as folder:
        store = FolderBlobs(Path(folder))
        for name, size in SIZES.items():
            data = os.urandom(size)
            digest = hashlib.sha256(data).hexdigest()
            store.put(digest, data)
            plain = seconds(store.path(digest).read_bytes, args.runs)
            checked = seconds(lambda d=digest: store.get(d), args.runs)
            results[name] = {f"{how}_{stat}_ms": value * 1e3 for how, pair in (("read", plain), ("read_and_hash", checked))
                             for stat, value in zip(("min", "median"), pair)}
            for stat, i in (("fastest", 0), ("median", 1)):
                print(f"{name:>8} {stat:>7}: read {plain[i] * 1e3:8.3f} ms, read and hash {checked[i] * 1e3:8.3f} ms "
                      f"(+{(checked[i] - plain[i]) * 1e3:.3f} ms)")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
