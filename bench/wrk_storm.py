"""Closed-loop start-up storms with ``wrk`` (C, one event loop per thread): a load generator cheap enough not to be
the bottleneck on a small machine, for ``bench/index_storm.py --generator wrk``.

Each wrk thread holds one connection and runs start-ups back to back on it: the GETs of a start-up (or the API's one
resolve) in order, the last one with ``Connection: close``, so every start-up opens a connection of its own, as a
fresh client process does. A Lua script (LuaJIT, ``clock_gettime``) times each start-up from its first request to its
last answer, checks every answer's status and ``Content-Length`` (or, for the API, the count of plans in the body), and
prints the per-start-up latencies' percentiles. ``nginx`` (Debian's, one worker, no access log) is the plain static
file server. Given a core list, wrk runs pinned to it with ``taskset``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LUA = r"""
local ffi = require("ffi")
ffi.cdef[[ typedef struct { long tv_sec; long tv_nsec; } pc_timespec; int clock_gettime(int, pc_timespec *); ]]
local ts = ffi.new("pc_timespec")
local function now() ffi.C.clock_gettime(1, ts); return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9 end
local steps = %s   -- {path, expected Content-Length or -1, plans counted in the body or 0}
local method, body, extra = %s, %s, %s
local reqs = {}
function init(args)  -- in the thread, once wrk.host (the Host header) is known
  for k, s in ipairs(steps) do
    local h = {Host = wrk.host .. ":" .. wrk.port}
    for name, value in pairs(extra) do h[name] = value end
    if k == #steps then h["Connection"] = "close" end
    reqs[k] = wrk.format(method, s[1], h, body)
  end
end
-- wrk calls request() once in thread 0's state to check the script: wrap around, and drop each thread's first
-- start-up (thread 0's lacks its first GET)
local i, started, first = 0, 0, true
lat, bad = {}, 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function request()
  if i >= #reqs then i = 0 end
  if i == 0 then started = now() end
  i = i + 1
  return reqs[i]
end
function response(status, headers, data)
  local s = steps[i]
  local ok = status == 200
  if ok and s[2] >= 0 then
    local n = headers["Content-Length"] or headers["content-length"]
    ok = tonumber(n) == s[2]
  end
  if ok and s[3] > 0 then
    local count, at = 0, 1
    while true do
      local a, b = string.find(data, '"blob_url":"', at, true)
      if not a then break end
      count, at = count + 1, b
    end
    ok = count == s[3]
  end
  if not ok then bad = bad + 1 end
  if i == #steps then
    if not first then lat[#lat + 1] = now() - started end
    first, i = false, 0
  end
end
function done(summary, latency, requests)
  local all, failed = {}, 0
  for _, t in ipairs(threads) do
    for _, x in ipairs(t:get("lat")) do all[#all + 1] = x end
    failed = failed + t:get("bad")
  end
  table.sort(all)
  local function pct(q) if #all == 0 then return -1 end return all[math.max(1, math.ceil(q * #all))] end
  io.write(string.format('RESULT {"start_ups": %%d, "failed": %%d, "errors": %%d, "p50_s": %%.6f, "p99_s": %%.6f, ' ..
    '"max_s": %%.6f, "requests": %%d, "duration_us": %%d}\n', #all, failed,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status +
    summary.errors.timeout, pct(0.5), pct(0.99), pct(1.0), summary.requests, summary.duration))
end
"""


def lua_string(s: str) -> str:
    return json.dumps(s)  # a JSON string is a Lua string literal for the ASCII used here


def script(steps: list[tuple[str, int, int]], method: str = "GET", body: str | None = None,
           headers: dict[str, str] | None = None) -> str:
    """The Lua script of a start-up: ``steps`` as ``(path, Content-Length or -1, plans in the body or 0)``."""
    lua_steps = "{" + ", ".join(f"{{{lua_string(p)}, {n}, {c}}}" for p, n, c in steps) + "}"
    lua_headers = "{" + ", ".join(f"[{lua_string(k)}] = {lua_string(v)}" for k, v in (headers or {}).items()) + "}"
    return LUA % (lua_steps, lua_string(method), lua_string(body) if body is not None else "nil", lua_headers)


def cores() -> dict[str, list[int]]:
    """Per-core jiffies from ``/proc/stat``: ``cpuN -> [user, nice, system, idle, iowait, irq, softirq, ...]``."""
    return {line.split()[0]: [int(x) for x in line.split()[1:]] for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("cpu") and line[3].isdigit()}


def core_use(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Each core's share of time idle, in software interrupts (the kernel's loopback TCP) and busy otherwise."""
    out = {}
    for name, a in after.items():
        d = [x - y for x, y in zip(a, before[name])]
        total = sum(d[:8]) or 1
        out[name] = {"idle": round((d[3] + d[4]) / total, 2), "softirq": round(d[6] / total, 2),
                     "busy": round(1 - (d[3] + d[4] + d[6]) / total, 2)}
    return out


def run(base: str, lua: str, connections: int, duration: float, core: str = "") -> dict[str, Any]:
    """One closed-loop storm of ``connections`` concurrent start-ups for ``duration`` seconds (wrk on the cores
    ``core``, e.g. ``"1"``; any when empty): start-ups/s, p50/p99/max per start-up, failures, wrk's own CPU seconds
    per start-up and each core's use."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(lua)
    try:
        cmd = [*(["taskset", "-c", core] if core else []), "wrk", "-t", str(connections), "-c", str(connections),
               "-d", f"{max(1, round(duration))}s", "--timeout", "30s", "-s", f.name, base]
        c0 = cores()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        use = core_use(c0, cores())
        out = proc.stdout.read() if proc.stdout else ""
        err = proc.stderr.read() if proc.stderr else ""
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        os.unlink(f.name)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"wrk failed ({proc.returncode}): {out}\n{err}")
    r = json.loads(line.removeprefix("RESULT "))
    seconds, requests = r.pop("duration_us") / 1e6, r.pop("requests")
    n = max(1, r["start_ups"])
    return {"connections": connections, "rate": round(r["start_ups"] / seconds, 1), **r,
            "requests_per_s": round(requests / seconds), "fallbacks": r["failed"] + r["errors"],
            "generator_cpu_s_per_start_up": round((usage.ru_utime + usage.ru_stime) / n, 6),
            "generator_core_busy": round((usage.ru_utime + usage.ru_stime) / seconds, 2), "cores": use}


NGINX = """
daemon off; master_process on; worker_processes 1; user root; pid {tmp}/nginx.pid; error_log {tmp}/error.log;
events {{ worker_connections 4096; }}
http {{
  access_log off; sendfile on; tcp_nopush on; tcp_nodelay on; keepalive_requests 100000;
  default_type application/octet-stream; open_file_cache max=1000 inactive=60s;
  client_body_temp_path {tmp}/b; proxy_temp_path {tmp}/p; fastcgi_temp_path {tmp}/f; uwsgi_temp_path {tmp}/u;
  scgi_temp_path {tmp}/s;
  server {{ listen 127.0.0.1:{port} backlog=4096; root {root}; location / {{ }} }}
}}
"""


@contextlib.contextmanager
def nginx(root: Path, port: int) -> Iterator[tuple[str, int]]:
    """Debian's nginx (one worker) serving ``root`` on loopback ``port``; yields its base URL and the worker's pid."""
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        raise SystemExit("nginx is not installed: apt-get install -y nginx-light")
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(NGINX.format(tmp=tmp, port=port, root=root.resolve()))
        proc = subprocess.Popen([shutil.which("nginx") or "/usr/sbin/nginx", "-c", str(conf), "-p", tmp],
                                stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 10
            while not (children := Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"nginx did not start: {proc.stderr.read() if proc.stderr else b''!r}")
                time.sleep(0.05)
            time.sleep(0.2)
            yield f"http://127.0.0.1:{port}", int(children[0])
        finally:
            proc.terminate()
            proc.wait(timeout=10)
