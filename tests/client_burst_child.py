"""A start-up burst on the CPU (tests and ``bench/host_fetch.py``): :func:`burst` starts client processes, each
making a :class:`~plancache.client.PlanCache` with :class:`~tests.client_fakes.RecordingBackend` (verifies and
"deserializes" without a GPU), and releases them at the same instant to prefetch the same specs.

A child (``python -m tests.client_burst_child SERVER_URL TOKEN TRUSTED_KEY_FILE CACHE_DIR SPECS_JSON [DEADLINE]``)
prints ``ready``, waits for a line on stdin, prefetches in strict mode and prints one JSON line: when it started and
finished (``time.time()``), its hits by step and its remote errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.together import run_together

ROOT = Path(__file__).resolve().parents[1]


def burst(n: int, url: str, token: str, keys: Path, cache_dirs: list[Path], specs_file: Path,
          deadline: float | None = None, released: Callable[[], object] | None = None) -> list[dict]:
    """Run ``n`` children (child ``i`` on ``cache_dirs[i % len(cache_dirs)]``), release them together once all are
    ready (then call ``released``, if given), and return their JSON lines."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    children = [subprocess.Popen([sys.executable, "-m", "tests.client_burst_child", url, token, str(keys),
                                  str(cache_dirs[i % len(cache_dirs)]), str(specs_file),
                                  *([str(deadline)] if deadline else [])],
                                 cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for i in range(n)]
    return run_together(children, "a burst child", timeout=120, released=released)


def main(argv: list[str]) -> None:
    url, token, keys, cache_dir, specs_file = argv[:5]
    deadline = float(argv[5]) if len(argv) > 5 else None
    from plancache.client import PlanCache
    from plancache.spec import parse_spec
    from tests.client_fakes import RecordingBackend

    specs = [parse_spec(s) for s in json.loads(Path(specs_file).read_text())]
    with PlanCache(url, token=token, trusted_keys=keys, cache_dir=cache_dir, backend=RecordingBackend(),
                   mode="strict", request_deadline=deadline) as cache:
        print("ready", flush=True)
        sys.stdin.readline()
        started = time.time()
        cache.prefetch(specs)
        done = time.time()
        stats = cache.stats()
    print(json.dumps({"started": started, "done": done, "hits": stats.hits, "remote_errors": stats.remote_errors}),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
