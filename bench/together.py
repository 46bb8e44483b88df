"""Child processes released at the same instant: what the start-up benchmarks share to start many at once."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any


def run_together(procs: list[subprocess.Popen[str]], what: str, *, timeout: float = 600,
                 released: Callable[[], object] | None = None) -> list[dict[str, Any]]:
    """Wait until every child printed ``ready`` (its imports and CUDA context done), send each ``go`` at once (then
    call ``released``, if given), and return the JSON object each prints last, in order; RuntimeError naming ``what``
    when one fails."""
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    if released is not None:
        released()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"{what} failed ({p.returncode})")
        results.append(dict(json.loads(out.strip().splitlines()[-1])))
    return results
