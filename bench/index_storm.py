"""Start-up storms from the signed static index (``plancache index publish``) against today's API path.

    python bench/index_storm.py [--blobs] [--s3 | --static http.server|asyncio] [--rates 32,128,512]
                                [--api-rates 32,128,512] [--duration 5] [--plans N] [--shard-plans 64] [--set]
                                [--out FILE]
    python bench/index_storm.py --generator wrk [--static nginx|asyncio|http.server] [--connections 1,2,4,8]
                                [--server-core 0 --generator-core 1] [--blobs] [--duration 5] [--out FILE]

The 49-graph workload (``bench/workload.py``, 64 KiB blobs) is stored and signed as in ``bench/storm.py`` (SQLite),
and published as a static index into a folder (or, with ``--s3``, a bucket of moto's S3 server), with ``--plans`` more
signed records of other graph keys beside them (a larger store: more shards; their blobs are not written), and with
``--set`` the workload's keys as a named set, whose shard a start-up reads instead of prefix shards. The folder is
served by a plain static file server (``bench/static_server.py``: Python's ``http.server``, threads, keep-alive; or
``--static asyncio``, a small event-loop one), moto serves the bucket. A start-up from the index is what a fresh
client process GETs: the environment's root, the shards of its 49 keys and, with ``--blobs``, the 49 blobs, on new
keep-alive connections (one, then up to 8 at once for shards and blobs, as the client), each answer's status and
length checked (read by its Content-Length, no HTTP library: the generator shares the servers' cores); the client's
own work (parsing, signature checks) is per host and left out, as ``bench/storm.py`` leaves it out. The API path is
``bench/storm.py``'s start-up against one ``plancache serve`` process on the same store: one resolve of the 49 keys,
records only without ``--blobs`` (the blobs from elsewhere: the index path's GETs of root and shards stand against
it), blobs inline with ``--blobs``. The API server runs during the index storms too, idle: its CPU seconds then are
reported (goal 0), and the static server's and the load generator's per start-up. Per rate: p50/p99/max from the
scheduled arrival to the last byte, failures; then the highest rate with p99 <= 1 s and no failure for each path, and
their ratio.

With ``--generator wrk`` (``apt-get install wrk nginx-light``) both paths are driven by ``wrk`` instead
(``bench/wrk_storm.py``: C, closed loop, each start-up's GETs in order on a connection of its own), at each of
``--connections`` concurrent start-ups, the folder served by nginx (one worker) or ``--static``; each step reports
start-ups/s, p50/p99 per start-up, the CPU per start-up of wrk and the server, the API server's CPU seconds during the
index steps, and each core's idle, software-interrupt and busy shares (which of them saturates).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench import wrk_storm  # noqa: E402
from bench.load_server import ENV, HOST, database, free_port, server  # noqa: E402
from bench.report import percentile  # noqa: E402
from bench.storm import (  # noqa: E402
    DEADLINE_S,
    FETCH_AT_ONCE,
    P99_GOAL_S,
    TIMEOUT_S,
    cpu_seconds,
    moto_bucket,
    seed,
    server_pid,
)
from bench.storm import storm as api_storm  # noqa: E402
from plancache.blobs.base import shard  # noqa: E402
from plancache.index import FolderTarget, ObjectTarget, build_index, root_path  # noqa: E402
from plancache.protocol import PlanRecord  # noqa: E402
from plancache.signing import Signer  # noqa: E402
from plancache.store import open_store  # noqa: E402
from tests.factories import make_record  # noqa: E402


def publish(url: str, keys: list[str], signer: Signer, target: FolderTarget | ObjectTarget, extra: int,
            shard_plans: int, named: bool) -> None:
    """The index of the store's plans on ``ENV`` (and ``extra`` more signed records, blobs not written) in ``target``;
    ``named``: the workload's keys are also the set ``workload``."""
    with open_store(url) as store:
        records = [r for _, r in store.plan_records(ENV, keys).values()]
        for r in records:
            target.blobs.put(r.blob_sha256, store.get_blob(r.blob_sha256) or b"")
    filler = [make_record(os.urandom(32).hex(), ENV, os.urandom(16), signer) for _ in range(extra)]
    root, shards = build_index(ENV, [*records, *filler], signer, version=1, shard_plans=shard_plans,
                               sets={"workload": keys} if named else None)
    for name, data in shards.items():
        target.write(name, data)
    target.write(root_path(ENV.env_id), root)


def start_up_paths(get: Any, keys: list[str], prefix: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(root and shards, blobs)`` a start-up of ``keys`` GETs, as ``(path, size)``; ``get(name)`` reads a file."""
    root = json.loads(get(root_path(ENV.env_id)))
    length = root["header"]["prefix_length"]
    named = [ref for ref in root["shards"] if ref.get("set") == "workload"]
    wanted = {k[:length] for k in keys}
    meta = [(f"{prefix}/{root_path(ENV.env_id)}", len(get(root_path(ENV.env_id))))]
    records: list[PlanRecord] = []
    for ref in named or [ref for ref in root["shards"] if "set" not in ref]:
        if named or ref["prefix"] in wanted:
            name = f"index/{ENV.env_id}/shards/{ref['sha256']}.json"
            meta.append((f"{prefix}/{name}", ref["size"]))
            records += [PlanRecord.model_validate(p) for p in json.loads(get(name))["plans"] if p["graph_key"] in keys]
    assert len(records) == len(keys), "every key is in the index"
    return meta, [(f"{prefix}/{shard(r.blob_sha256)}", r.blob_size) for r in records]


class Connection:
    """One keep-alive connection of a start-up (plain HTTP/1.1), opened again when the server closes it. An answer is
    read by its ``Content-Length`` (the servers here send one; a chunked answer counts as a failure): the generator
    shares the servers' cores, so it parses no more than it must."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.head = (f"Host: {host}:{port}\r\nAccept: */*\r\nAccept-Encoding: identity\r\n"
                     f"User-Agent: python-httpx/{httpx.__version__}\r\n\r\n").encode()

    async def get_all(self, paths: list[tuple[str, int]]) -> bool:
        """GET each of ``paths`` in turn; True when each answer is 200 of its size."""
        for path, size in paths:
            if self.streams is None:
                self.streams = await asyncio.open_connection(self.host, self.port)
            reader, writer = self.streams
            writer.write(b"GET " + path.encode() + b" HTTP/1.1\r\n" + self.head)
            try:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            except asyncio.IncompleteReadError:
                return False
            lines = head.split("\r\n")
            fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
            length = fields.get("content-length", "").strip()
            if lines[0].split(" ")[1:2] != ["200"] or not length.isdigit() or int(length) != size:
                return False
            await reader.readexactly(size)
            if "close" in fields.get("connection", "") or lines[0].startswith("http/1.0"):
                self.close()
        return True

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


async def lanes(pool: list[Connection], paths: list[tuple[str, int]]) -> bool:
    """``paths`` over up to :data:`FETCH_AT_ONCE` connections of ``pool`` at once (kept alive, as httpx keeps them)."""
    parts = [paths[i::FETCH_AT_ONCE] for i in range(min(FETCH_AT_ONCE, len(paths)))]
    return all(await asyncio.gather(*(conn.get_all(part) for conn, part in zip(pool, parts))))


async def index_start_up(host: str, port: int, meta: list[tuple[str, int]], blobs: list[tuple[str, int]]) -> bool:
    """The root, then the shards, then the blobs, each step over connections kept alive from the one before."""
    pool = [Connection(host, port) for _ in range(FETCH_AT_ONCE)]
    try:
        async with asyncio.timeout(TIMEOUT_S):
            return (await pool[0].get_all(meta[:1]) and await lanes(pool, meta[1:])
                    and (not blobs or await lanes(pool, blobs)))
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return False
    finally:
        for conn in pool:
            conn.close()


async def index_storm(host: str, port: int, meta: list[tuple[str, int]], blobs: list[tuple[str, int]], rate: float,
                      duration: float) -> dict[str, Any]:
    """Index start-ups arriving at ``rate`` for ``duration`` seconds (open loop)."""
    t0 = time.perf_counter() + 0.05
    latencies: list[float] = []
    failed = 0

    async def one(at: float) -> None:
        nonlocal failed
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        ok = await index_start_up(host, port, meta, blobs)
        latencies.append(time.perf_counter() - at)
        failed += not ok

    n = max(1, int(rate * duration))
    await asyncio.gather(*(one(t0 + i / rate) for i in range(n)))
    latencies.sort()
    late = sum(x > DEADLINE_S for x in latencies)
    return {"rate": rate, "start_ups": n, "p50_s": round(percentile(latencies, 0.5), 3),
            "p99_s": round(percentile(latencies, 0.99), 3), "max_s": round(latencies[-1], 3), "failed": failed,
            "later_than_deadline": late, "fallbacks": failed + late}


@contextlib.contextmanager
def static_server(folder: Path, kind: str) -> Iterator[tuple[str, int]]:
    """``bench/static_server.py`` serving ``folder``: ``(base URL, pid)``."""
    flags = ["--asyncio"] if kind == "asyncio" else []
    with server([str(ROOT / "bench" / "static_server.py"), str(folder), *flags], dict(os.environ),
                f"/{root_path(ENV.env_id)}") as base:
        pid = int(subprocess.check_output(["pgrep", "-n", "-f", f"static_server.py {folder}"]).split()[0])
        yield base, pid


def public_read(endpoint: str, bucket: str) -> None:
    """Let anyone GET the bucket's objects (a bucket policy), as a bucket serving an index to a fleet does."""
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
                                                      "Resource": f"arn:aws:s3:::{bucket}/*"}]}
    httpx.put(f"{endpoint}/{bucket}?policy", content=json.dumps(policy), timeout=10).raise_for_status()


def sustained(rows: list[dict[str, Any]]) -> float | None:
    return max((r["rate"] for r in rows if r["p99_s"] <= P99_GOAL_S and not r["fallbacks"]), default=None)


def pin(pid: int, core: str) -> None:
    """Every thread of ``pid`` on the cores ``core`` (none when empty)."""
    if core:
        subprocess.run(["taskset", "-a", "-p", "-c", core, str(pid)], check=True, stdout=subprocess.DEVNULL)


def wrk_storms(args: argparse.Namespace, env: dict[str, str], folder: Path, meta: list[tuple[str, int]],
               blobs: list[tuple[str, int]], keys: list[str], token: str) -> dict[str, Any]:
    """Index and API storms from ``wrk`` (:mod:`bench.wrk_storm`) at each of ``--connections``: the index's GETs from
    nginx (or ``--static``), the API's records-only (or inline, with ``--blobs``) resolve from one ``plancache serve``;
    each server idle while the other path runs (its CPU seconds then reported); their CPU seconds per start-up."""
    steps = [(path, size, 0) for path, size in [*meta, *blobs]]
    index_lua = wrk_storm.script(steps)
    body = json.dumps({"environment": ENV.model_dump(), "graph_keys": keys, "include_blobs": args.blobs})
    api_lua = wrk_storm.script([("/v1/plans/resolve", -1, 0 if args.blobs else len(keys))], "POST", body,
                               {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    steps_of = [int(c) for c in args.connections.split(",")]
    out: dict[str, Any] = {"generator": "wrk (closed loop, one start-up per connection at a time)",
                           "server_cores": args.server_core or "any", "generator_cores": args.generator_core or "any",
                           "static_server": "nginx (1 worker)" if args.static == "nginx" else args.static}
    with server(["-m", "plancache", "serve"], env, "/readyz") as api, \
            (wrk_storm.nginx(folder, free_port()) if args.static == "nginx"
             else static_server(folder, args.static)) as static:
        api_pid = server_pid(api)
        pin(api_pid, args.server_core)
        base, static_pid = static
        pin(static_pid, args.server_core)
        wrk_storm.run(base, index_lua, 2, 1, args.generator_core)  # warm-up
        rows = []
        for c in steps_of:
            a0, s0 = cpu_seconds(api_pid), cpu_seconds(static_pid)
            row = wrk_storm.run(base, index_lua, c, args.duration, args.generator_core)
            n = max(1, row["start_ups"])
            row["api_server_cpu_s"] = round(cpu_seconds(api_pid) - a0, 3)
            row["static_server_cpu_s_per_start_up"] = round((cpu_seconds(static_pid) - s0) / n, 6)
            row["static_server_core_busy"] = round((cpu_seconds(static_pid) - s0) / args.duration, 2)
            row["load_after"] = [round(x, 2) for x in os.getloadavg()]
            rows.append(row)
            print("index", row, flush=True)
        out["index"] = rows
        wrk_storm.run(api, api_lua, 2, 1, args.generator_core)  # warm-up
        rows = []
        for c in steps_of:
            a0, s0 = cpu_seconds(api_pid), cpu_seconds(static_pid)
            row = wrk_storm.run(api, api_lua, c, args.duration, args.generator_core)
            n = max(1, row["start_ups"])
            row["api_server_cpu_s_per_start_up"] = round((cpu_seconds(api_pid) - a0) / n, 6)
            row["api_server_core_busy"] = round((cpu_seconds(api_pid) - a0) / args.duration, 2)
            row["static_server_cpu_s"] = round(cpu_seconds(static_pid) - s0, 3)
            row["load_after"] = [round(x, 2) for x in os.getloadavg()]
            rows.append(row)
            print("api", row, flush=True)
        out["api"] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blobs", action="store_true", help="start-ups fetch the 49 blobs too (API: inline)")
    parser.add_argument("--s3", action="store_true", help="the index in a bucket of moto's S3 server, not a folder")
    parser.add_argument("--static", choices=("http.server", "asyncio", "nginx"), default="http.server",
                        help="the static file server of the folder (bench/static_server.py, or Debian's nginx)")
    parser.add_argument("--generator", choices=("asyncio", "wrk"), default="asyncio",
                        help="asyncio: open loop at --rates (Python); wrk: closed loop at --connections "
                             "(bench/wrk_storm.py)")
    parser.add_argument("--connections", default="1,2,4,8,16,32,64", help="wrk: concurrent start-ups per step")
    parser.add_argument("--server-core", default="", help="wrk: pin the servers to these cores (taskset -c)")
    parser.add_argument("--generator-core", default="", help="wrk: pin wrk to these cores")
    parser.add_argument("--rates", default="32,128,512")
    parser.add_argument("--api-rates", default="32,128,512")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--plans", type=int, default=0, help="signed records of other keys in the index")
    parser.add_argument("--shard-plans", type=int, default=64)
    parser.add_argument("--set", action="store_true", help="publish the workload as a named set; start-ups read it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.generator == "wrk" and args.s3 or args.static == "nginx" and args.generator != "wrk":
        parser.error("--generator wrk serves the index from a folder (no --s3); --static nginx needs --generator wrk")
    load = os.getloadavg()
    with database(None) as (_, url), tempfile.TemporaryDirectory() as tmp, \
            (moto_bucket() if args.s3 else contextlib.nullcontext(("", {}))) as (bucket_url, aws):
        os.environ.update(aws)
        if args.s3:
            public_read(aws["AWS_ENDPOINT_URL"], bucket_url.removeprefix("s3://").split("/")[0])
        keys, token = seed(url, Path(tmp) / "keys")
        signer = Signer.from_file(Path(tmp) / "keys" / "storm.key")
        folder = Path(tmp) / "pub"
        target = ObjectTarget(bucket_url) if args.s3 else FolderTarget(folder)
        publish(url, keys, signer, target, args.plans, args.shard_plans, args.set)

        def read(name: str) -> bytes:
            data = target.read(name, 1 << 30)
            assert data is not None
            return data

        prefix = "/" + bucket_url.removeprefix("s3://") if args.s3 else ""
        meta, blobs = start_up_paths(read, keys, prefix)
        blobs = blobs if args.blobs else []
        env = {**os.environ, "PLANCACHE_DATABASE_URL": url, "PLANCACHE_ADMIN_TOKEN": secrets.token_urlsafe(24)}
        env.pop("PLANCACHE_OPEN_READS", None)
        result: dict[str, Any] = {"blobs": args.blobs, "store": "s3 (moto)" if args.s3 else f"folder ({args.static})",
                                  "graphs": len(keys), "index_plans": len(keys) + args.plans, "named_set": args.set,
                                  "root_bytes": meta[0][1],
                                  "shards_read": len(meta) - 1, "index_bytes_read": sum(n for _, n in meta),
                                  "gets_per_start_up": len(meta) + len(blobs), "duration_s": args.duration,
                                  "load_before": [round(x, 2) for x in load]}
        if args.generator == "wrk":
            result.update(wrk_storms(args, env, folder, meta, blobs, keys, token))
        else:
            with server(["-m", "plancache", "serve"], env, "/readyz") as api, \
                    (contextlib.nullcontext((aws["AWS_ENDPOINT_URL"], None)) if args.s3 else static_server(folder, args.static)) \
                    as (static, static_pid):
                api_pid = server_pid(api)
                host, port = HOST, int(static.rsplit(":", 1)[1])
                asyncio.run(index_storm(host, port, meta, blobs, 4, 1))  # warm-up
                rows = []
                for rate in map(float, args.rates.split(",")):
                    cpu0, s0 = cpu_seconds(api_pid), cpu_seconds(static_pid) if static_pid else 0.0
                    g0 = time.process_time()
                    row = asyncio.run(index_storm(host, port, meta, blobs, rate, args.duration))
                    row["api_server_cpu_s"] = round(cpu_seconds(api_pid) - cpu0, 3)
                    row["generator_cpu_s_per_start_up"] = round((time.process_time() - g0) / row["start_ups"], 5)
                    if static_pid:
                        row["static_server_cpu_s_per_start_up"] = round((cpu_seconds(static_pid) - s0) / row["start_ups"], 5)
                    rows.append(row)
                    print("index", row, flush=True)
                result["index"] = rows
                run = {"inline": args.blobs, "fetch": args.blobs}
                asyncio.run(api_storm([api], token, keys, 2, 1, **run))  # warm-up
                rows = []
                for rate in map(float, args.api_rates.split(",")):
                    cpu0, g0 = cpu_seconds(api_pid), time.process_time()
                    row = asyncio.run(api_storm([api], token, keys, rate, args.duration, **run))
                    row["api_server_cpu_s_per_start_up"] = round((cpu_seconds(api_pid) - cpu0) / row["start_ups"], 5)
                    row["generator_cpu_s_per_start_up"] = round((time.process_time() - g0) / row["start_ups"], 5)
                    rows.append(row)
                    print("api", row, flush=True)
                result["api"] = rows
    result["index_sustained_per_s"], result["api_sustained_per_s"] = sustained(result["index"]), sustained(result["api"])
    if result["index_sustained_per_s"] and result["api_sustained_per_s"]:
        result["ratio"] = round(result["index_sustained_per_s"] / result["api_sustained_per_s"], 1)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "load_after": os.getloadavg()}
    print(json.dumps({k: v for k, v in result.items() if k not in ("index", "api")}))
    if args.out:
        merged = json.loads(args.out.read_text()) if args.out.exists() else {}
        where = ("s3" if args.s3 else args.static) + ("+wrk" if args.generator == "wrk" else "")
        where += "+pinned" if args.generator == "wrk" and (args.server_core or args.generator_core) else ""
        shards = "set" if args.set else "prefix"
        merged[f"{where}/{'blobs' if args.blobs else 'records'}/{len(keys) + args.plans}-plans/{shards}"] = result
        args.out.write_text(json.dumps(merged, indent=2) + "\n")


if __name__ == "__main__":
    main()
