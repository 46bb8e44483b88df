"""What importing the client costs a process: wall time of fresh interpreters, and ``-X importtime``'s figure.

    python bench/import_cost.py [--runs 15] [--out FILE]

For each statement (``import plancache.client``, ``from plancache.client import PlanCache``, the hook, ...) runs
``--runs`` fresh interpreters (bytecode compiled by a first, untimed run) and reports the median wall time, the
median of ``python -c pass`` subtracted, and the median cumulative import time ``-X importtime`` gives the
statement's top-level modules. Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

STATEMENTS = {
    "pass": "pass",
    "import plancache.client": "import plancache.client",
    "from plancache.client import PlanCache": "from plancache.client import PlanCache",
    "import plancache.client.hook": "import plancache.client.hook",
    "import plancache.torch": "import plancache.torch",
    "import httpx": "import httpx",
}


def wall(statement: str) -> float:
    """Seconds a fresh interpreter takes to run ``statement`` and exit."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - t0


def import_time(statement: str) -> float:
    """Seconds ``-X importtime`` counts for the modules ``statement`` imports (the sum of its top-level entries past
    the interpreter's own start-up, ``site`` and what it imports)."""
    base = _top_level(subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], check=True,
                                     capture_output=True, text=True).stderr)
    lines = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], check=True, capture_output=True,
                           text=True).stderr
    return sum(us for name, us in _top_level(lines).items() if name not in base) / 1e6


def _top_level(stderr: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for line in stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and not parts[2].startswith("  ") and parts[1].strip().isdigit():
            found[parts[2].strip()] = int(parts[1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    for statement in STATEMENTS.values():
        wall(statement)  # compiles the bytecode
    rows: dict[str, dict[str, float]] = {}
    for label, statement in STATEMENTS.items():
        walls = [wall(statement) for _ in range(args.runs)]
        imports = [import_time(statement) for _ in range(args.runs)] if statement != "pass" else [0.0]
        rows[label] = {"wall_ms": round(statistics.median(walls) * 1000, 1),
                       "import_ms": round(statistics.median(imports) * 1000, 1)}
    floor = rows["pass"]["wall_ms"]
    for label, row in rows.items():
        row["wall_over_pass_ms"] = round(row["wall_ms"] - floor, 1)
        print(f"{label:42} wall {row['wall_ms']:7.1f} ms  (+{row['wall_over_pass_ms']:6.1f} over pass)"
              f"  importtime {row['import_ms']:7.1f} ms")
    if args.out:
        args.out.write_text(json.dumps({"host": platform.node(), "python": platform.python_version(),
                                        "runs": args.runs, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
