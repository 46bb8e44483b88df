"""A start-up storm against one server process (or ``--servers`` replicas): how many client start-ups a second it
sustains.

    python bench/storm.py [--database-url postgresql+psycopg://…] [--blobs inline|server|presigned] [--resolve-only]
                          [--rates 2,4,8,16,32] [--duration 10] [--servers N] [--out FILE]

A real ``plancache serve`` (uvicorn, one process) on a fresh SQLite file or Postgres database (``bench/load_server.py``
makes both) holds a signed plan for each graph of the 49-graph workload (``bench/workload.py``, 64 KiB blobs). A
start-up is what a fresh client process sends the server: a new connection and one ``POST /v1/plans/resolve`` of the
49 keys, the answer read whole, and, per ``--blobs``: ``inline`` the blobs come in the answer (base64);
``server`` records only, then each blob from its ``blob_url`` on the server (``/v1/blobs``, 8 at a time, as the
client); ``presigned`` the blobs are in a bucket of moto's S3 server (a subprocess; ``PLANCACHE_BLOB_STORE=s3://…``)
and each is GET from the presigned URL of the answer on a connection of its own without the token, 8 at a time.
``--resolve-only`` leaves the blob GETs out (what the API server itself serves when the bytes come from elsewhere:
moto is a single Python process, far slower than S3). The client's own work -- imports, signature checks,
deserializing -- is per host and not the server's, so it is left out (``bench/host_fetch.py`` runs real clients),
and the load generator, which shares the server's cores, does as little as it can: the resolve goes out through h11
on a bare asyncio connection with the headers httpx sends (an httpx client per start-up cost the generator 5 ms of
CPU, more than the server's share), an answer is counted (its ``blob_b64`` or ``blob_url`` strings), parsed only
when its URLs are fetched (httpx), and a fetched blob's size is checked. The server's CPU seconds
(user + system, from ``/proc``) per start-up are reported per rate: what a start-up costs the API server whoever
serves the bytes. With ``--out``, the results of each database and mode are merged into the file, and plotted
next to it (``.png``) when matplotlib is there.
Start-ups arrive open-loop at each ``--rates`` value (per second) for ``--duration`` seconds; latency runs from a
start-up's scheduled arrival to its last byte, so queueing counts. Reports per rate: p50/p99/max, and the start-ups
that would fall back to local builds (an answer other than 200, or later than ``PLANCACHE_REQUEST_DEADLINE``, 5 s);
then the highest rate with p99 ≤ 1 s and the lowest rate with a fallback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import h11  # noqa: E402
import httpx  # noqa: E402

from bench.load_server import ENV, database, free_port, server  # noqa: E402
from bench.report import percentile, pyplot  # noqa: E402
from bench.workload import workload  # noqa: E402
from plancache.http import tls_verification  # noqa: E402
from plancache.signing import Signer, keygen  # noqa: E402
from plancache.store import open_store  # noqa: E402
from tests.factories import make_meta  # noqa: E402

BLOB_BYTES = 64 * 1024
DEADLINE_S = 5.0  # PLANCACHE_REQUEST_DEADLINE's default: past it a client builds locally
P99_GOAL_S = 1.0
TIMEOUT_S = 30.0
#: Blob GETs one start-up has in flight at once (``plancache.client.steps.FETCH_THREADS``).
FETCH_AT_ONCE = 8
MODES = ("inline", "server", "presigned")


@contextlib.contextmanager
def moto_bucket() -> Iterator[tuple[str, dict[str, str]]]:
    """moto's S3 server in a subprocess with a fresh bucket: ``(s3://bucket/blobs, AWS_* environment)``."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    aws = {"AWS_ACCESS_KEY_ID": "storm", "AWS_SECRET_ACCESS_KEY": "storm", "AWS_REGION": "us-east-1",
           "AWS_ALLOW_HTTP": "true", "AWS_ENDPOINT_URL": endpoint}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                httpx.get(endpoint, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        bucket = f"storm-{uuid.uuid4().hex[:12]}"
        httpx.put(f"{endpoint}/{bucket}", timeout=10).raise_for_status()
        yield f"s3://{bucket}/blobs", aws
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pid(base: str) -> int:
    """The ``plancache serve`` child of this process serving ``base``."""
    me, port = os.getpid(), base.rsplit(":", 1)[1].encode() + b"\x00"
    for pid in Path(f"/proc/{me}/task/{me}/children").read_text().split():
        if Path(f"/proc/{pid}/cmdline").read_bytes().endswith(b"plancache\x00serve\x00--port\x00" + port):
            return int(pid)
    raise SystemExit("no plancache serve child process found")


def seed(url: str, keys_dir: Path, blob_store: str | None = None) -> tuple[list[str], str]:
    """The workload's specs and signed plans in the store at ``url``; returns the graph keys and a reader token."""
    private, _, _ = keygen(keys_dir, "storm")
    signer = Signer.from_file(private)
    keys = []
    with open_store(url, create=True, blob_store=blob_store) as store:
        for spec in workload():
            blob = hashlib.sha256(spec.graph_key.encode()).digest() * (BLOB_BYTES // 32)
            store.put_spec(spec.graph_key, spec.to_json())
            store.publish_plan(make_meta(spec.graph_key, ENV, blob, signer), blob)
            keys.append(spec.graph_key)
        token, _ = store.create_token("storm-reader", "reader")
    return keys, token


def resolve_request(base: str, token: str, body: dict[str, Any]) -> tuple[h11.Request, bytes]:
    """A fresh client's resolve request of ``body`` to ``base`` and its payload, headers as httpx sends them."""
    payload = json.dumps(body).encode()
    request = h11.Request(method="POST", target="/v1/plans/resolve", headers=[
        ("Host", base.split("://", 1)[1]), ("Accept", "*/*"), ("Accept-Encoding", "gzip, deflate"),
        ("Connection", "keep-alive"), ("User-Agent", f"python-httpx/{httpx.__version__}"),
        ("Authorization", f"Bearer {token}"), ("Content-Type", "application/json"),
        ("Content-Length", str(len(payload)))])
    return request, payload


async def exchange(base: str, request: h11.Request, payload: bytes) -> tuple[int, bytes]:
    """``request`` and its ``payload`` sent on a new connection to ``base`` (plain HTTP), the answer's status and
    body read whole (h11 frames it, chunked or not); the client then closes the connection."""
    host, port = base.split("://", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    conn = h11.Connection(h11.CLIENT)
    status, parts = 0, []
    try:
        writer.write(b"".join(conn.send(event) or b"" for event in (request, h11.Data(data=payload), h11.EndOfMessage())))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(1 << 16))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return status, b"".join(parts)
    finally:
        writer.close()


async def start_up(base: str, token: str, request: tuple[h11.Request, bytes], inline: bool, n_keys: int,
                   fetch: bool) -> bool:
    """One client start-up's exchange with the server: ``request`` (:func:`resolve_request`) on a connection of its
    own, then, when ``fetch``, each blob from its ``blob_url`` (the server's with the token, else on connections
    of their own without it, 8 at a time); True when all plans came (each blob of its record's size, when
    ``fetch``). Answers are counted, not parsed, unless their blob URLs are needed: the generator's CPU is the
    server's too here."""
    try:
        async with asyncio.timeout(TIMEOUT_S):
            status, answer = await exchange(base, *request)
    except (OSError, TimeoutError, h11.ProtocolError):
        return False
    if status != 200:
        return False
    if inline or not fetch:
        return answer.count(b'"blob_b64":"' if inline else b'"blob_url":"') == n_keys
    plans = json.loads(answer)["plans"]
    if len(plans) != n_keys:
        return False
    urls = [(p["blob_url"], p["record"]["blob_size"]) for p in plans.values()]
    gate = asyncio.Semaphore(FETCH_AT_ONCE)
    timeout = httpx.Timeout(TIMEOUT_S)
    try:
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=timeout,
                                     verify=tls_verification(base)) as server, \
                httpx.AsyncClient(timeout=timeout, verify=tls_verification(urls[0][0])) as elsewhere:

            async def get(url: str, size: int) -> bool:
                async with gate:
                    got = await (server if url.startswith("/") else elsewhere).get(url)
                return got.status_code == 200 and len(got.content) == size

            return all(await asyncio.gather(*(get(u, n) for u, n in urls)))
    except httpx.HTTPError:
        return False


async def storm(bases: list[str], token: str, keys: list[str], rate: float, duration: float, *, inline: bool = True,
                fetch: bool = True) -> dict[str, Any]:
    """Start-ups arriving at ``rate`` for ``duration`` seconds, the i-th sent to ``bases[i % len(bases)]`` (replicas
    behind a load balancer that takes turns)."""
    body = {"environment": ENV.model_dump(), "graph_keys": keys, "include_blobs": inline}
    requests = [resolve_request(base, token, body) for base in bases]
    t0 = time.perf_counter() + 0.05
    latencies: list[float] = []
    failed = 0

    async def one(i: int, at: float) -> None:
        nonlocal failed
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        k = i % len(bases)
        ok = await start_up(bases[k], token, requests[k], inline, len(keys), fetch)
        latencies.append(time.perf_counter() - at)
        failed += not ok

    n = max(1, int(rate * duration))
    await asyncio.gather(*(one(i, t0 + i / rate) for i in range(n)))
    latencies.sort()
    late = sum(x > DEADLINE_S for x in latencies)
    return {"rate": rate, "start_ups": n, "p50_s": round(percentile(latencies, 0.5), 3),
            "p99_s": round(percentile(latencies, 0.99), 3), "max_s": round(latencies[-1], 3),
            "failed": failed, "later_than_deadline": late, "fallbacks": failed + late}


def plot(results: dict[str, Any], path: Path) -> None:
    """p99 latency against the arrival rate, one line per database and blob mode of ``results``."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, result in sorted(results.items()):
        rows = result["rates"]
        ax.plot([r["rate"] for r in rows], [r["p99_s"] for r in rows], marker="o", label=name)
    ax.axhline(P99_GOAL_S, color="grey", linestyle="--", linewidth=1)
    ax.set(xscale="log", yscale="log", xlabel="start-ups per second (open loop)", ylabel="p99 latency (s)",
           title="Start-up storm: plancache serve processes, 49 plans of 64 KiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database-url")
    parser.add_argument("--blobs", choices=MODES, default="inline")
    parser.add_argument("--resolve-only", action="store_true", help="no blob GETs (server, presigned)")
    parser.add_argument("--rates", default="2,4,8,16,32")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--servers", type=int, default=1,
                        help="server processes on one database, taking the start-ups in turn (replicas)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    mode = args.blobs + ("-resolve-only" if args.resolve_only and args.blobs != "inline" else "")
    mode += f"-{args.servers}-servers" if args.servers > 1 else ""
    with database(args.database_url) as (backend, url), tempfile.TemporaryDirectory() as tmp, \
            (moto_bucket() if args.blobs == "presigned" else contextlib.nullcontext(("database", {}))) as (blobs, aws):
        os.environ.update(aws)  # the seeding store's and the server's
        keys, token = seed(url, Path(tmp) / "keys", blobs)
        env = {**os.environ, "PLANCACHE_DATABASE_URL": url, "PLANCACHE_ADMIN_TOKEN": secrets.token_urlsafe(24),
               "PLANCACHE_BLOB_STORE": blobs}
        env.pop("PLANCACHE_OPEN_READS", None)
        rows = []
        run = {"inline": args.blobs == "inline", "fetch": not args.resolve_only}
        with contextlib.ExitStack() as servers:
            bases = [servers.enter_context(server(["-m", "plancache", "serve"], env, "/readyz"))
                     for _ in range(args.servers)]
            pids = [server_pid(base) for base in bases]
            asyncio.run(storm(bases, token, keys, 2 * len(bases), 1, **run))  # warm-up, each server
            for rate in rates:
                cpu0 = sum(map(cpu_seconds, pids))
                row = asyncio.run(storm(bases, token, keys, rate, args.duration, **run))
                row["server_cpu_s_per_start_up"] = round((sum(map(cpu_seconds, pids)) - cpu0) / row["start_ups"], 5)
                rows.append(row)
                print(backend, mode, row, flush=True)
    within = [r["rate"] for r in rows if r["p99_s"] <= P99_GOAL_S and not r["fallbacks"]]
    falling = [r["rate"] for r in rows if r["fallbacks"]]
    cpu = sorted(r["server_cpu_s_per_start_up"] for r in rows if r["rate"] in within)
    result = {"database": backend, "blobs": mode, "servers": args.servers, "graphs": len(keys), "blob_bytes": BLOB_BYTES,
              "duration_s": args.duration, "sustained_per_s_p99_under_1s": max(within, default=None),
              "first_rate_with_fallbacks": min(falling, default=None),
              "server_cpu_s_per_start_up": cpu[len(cpu) // 2] if cpu else None, "rates": rows,
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    print(json.dumps({k: v for k, v in result.items() if k != "rates"}))
    if args.out:
        merged = json.loads(args.out.read_text()) if args.out.exists() else {}
        merged[f"{backend}/{mode}"] = result
        args.out.write_text(json.dumps(merged, indent=2) + "\n")
        plot(merged, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
