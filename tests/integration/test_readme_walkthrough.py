"""The README's HTTP walkthrough ("The service, end to end") runs as written, so the docs cannot drift.

The shell block after the ``<!-- walkthrough`` marker is run verbatim with ``bash`` (``set -euo pipefail``) in a
temporary folder that looks like a fresh checkout (``examples/`` and ``.venv`` linked in), on a free port
(``PORT``, which the block reads): a real ``plancache serve``, real tokens, keys, bundle and gc commands. On a
machine without a GPU the block itself picks the worker's test stand-in (``python -m tests.worker_fakes``: a real
:class:`~plancache.worker.Worker` with the FakeTuner test double). The graph keys its comments show are the real
ones, and it stops at once, saying why, when the port is taken or the server exits.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.live_server import free_port

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- walkthrough"
GPU_LINE = "PLANCACHE_SIGNING_KEY=walkthrough/keys/fleet.key plancache worker --server $API --token $WORKER --once"
STAND_IN = "python -m tests.worker_fakes --server $API --token $WORKER --worker-id gpu-1 --spool-dir walkthrough/spool"

pytestmark = pytest.mark.skipif(not (shutil.which("curl") and shutil.which("jq") and shutil.which("bash")),
                                reason="the walkthrough needs bash, curl and jq")


def walkthrough_block() -> str:
    readme = (ROOT / "README.md").read_text()
    assert readme.count(MARKER) == 1, "README.md must mark the HTTP walkthrough with exactly one <!-- walkthrough … -->"
    m = re.compile(r"<!-- walkthrough[^\n]*-->\n```(?:bash|sh)\n(.*?)\n```\n", re.S).search(readme)
    assert m, "the walkthrough marker must be followed directly by a ```bash block"
    return m.group(1)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc: os.kill found it
        return True


def test_block_is_found_and_has_the_gpu_line() -> None:
    block = walkthrough_block()
    assert block.count(GPU_LINE) == 1, "the walkthrough's GPU worker line changed: update GPU_LINE"
    assert block.count(STAND_IN) == 1, "the walkthrough's CPU stand-in line changed: update STAND_IN"
    assert block.startswith("set -euo pipefail"), "the walkthrough stops at its first failing step"
    for step in ("plancache serve --port $PORT &", "trap ", "until curl -sf $API/readyz", "plancache token create",
                 "plancache keygen", "/v1/specs", "/v1/admin/tune", "/v1/plans/resolve", "/v1/blobs/",
                 "plancache bundle export", "plancache bundle import", "plancache plans gc"):
        assert step in block, step


def run_block(tmp_path: Path, *, port: int | None = None, extra_env: dict[str, str] | None = None,
              timeout: float = 60) -> tuple[subprocess.Popen[str], str, str, int]:
    """The walkthrough block in a fresh-checkout-like folder; returns the process, its stdout and stderr, the port."""
    block = walkthrough_block()
    script = (block
              + "\necho \"WALKTHROUGH_TOKENS=${#WORKER} ${#READER} ${#PLANCACHE_ADMIN_TOKEN}\""
              + "\necho \"WALKTHROUGH_SERVER_PID=$SERVER\"\n")
    (tmp_path / "walkthrough.sh").write_text(script)
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # a fresh checkout: examples/ and the install's .venv
    if not (Path(sys.prefix) / "bin" / "activate").is_file():
        pytest.skip("the walkthrough sources .venv/bin/activate: run pytest from the virtual environment")
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    port = port or free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANCACHE_")}
    env.update(PORT=str(port), HOME=str(tmp_path), PLANCACHE_CACHE_DIR=str(tmp_path / "cache"),
               PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", **(extra_env or {}))  # no GPU: the stand-in runs
    proc = subprocess.Popen(["bash", "walkthrough.sh"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the walkthrough ran over {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, out, err, port


def test_the_walkthrough_stops_at_once_when_the_port_is_taken(tmp_path: Path) -> None:
    import http.server
    import threading

    first = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)  # "Set up and run"
    threading.Thread(target=first.serve_forever, daemon=True).start()
    try:
        start = time.monotonic()
        proc, out, err, _ = run_block(tmp_path, port=first.server_address[1], timeout=30)
    finally:
        first.shutdown()
    assert proc.returncode == 1 and f"port {first.server_address[1]} is taken: stop the server there first" in err, \
        (out, err)
    assert time.monotonic() - start < 20 and "listening on" not in err


def test_the_walkthrough_stops_at_once_when_the_server_exits(tmp_path: Path) -> None:
    start = time.monotonic()
    proc, out, err, _ = run_block(tmp_path, extra_env={"PLANCACHE_BLOB_STORE": "nosuch://x"}, timeout=30)
    assert proc.returncode == 1 and "plancache serve exited: its error is above" in err, (out, err)
    assert "PLANCACHE_BLOB_STORE" in err and time.monotonic() - start < 25, err


def test_the_comments_show_the_real_graph_key() -> None:
    key = subprocess.run([sys.executable, "-m", "plancache", "spec", "key", str(ROOT / "examples" / "conv_bias_relu.json")],
                         capture_output=True, text=True, check=True).stdout.split()[0]
    shown = re.findall(r'"([0-9a-f]{8})…"', walkthrough_block())
    assert shown and set(shown) == {key[:8]}, f"the walkthrough's comments show {set(shown)}, the key is {key[:8]}"


def test_readme_walkthrough_runs_and_runs_again_in_the_same_checkout(tmp_path: Path) -> None:
    """The second run starts from a fresh state of its own: the tokens, keys and bundle of the first one do not
    make it fail (under ``set -e`` it would stop at the first refused step)."""
    check_run(tmp_path)
    for name in ("walkthrough.sh", "examples", ".venv"):
        (tmp_path / name).unlink()
    check_run(tmp_path)


def check_run(tmp_path: Path) -> None:
    start = time.monotonic()
    proc, out, err, port = run_block(tmp_path)
    report = f"rc={proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    assert proc.returncode == 0, report
    assert time.monotonic() - start < 60

    # the server: listening line, then stopped by the block's trap when bash exited
    assert f"listening on http://127.0.0.1:{port}" in err, report
    server_pid = int(re.search(r"WALKTHROUGH_SERVER_PID=(\d+)", out).group(1))
    deadline = time.monotonic() + 15
    while (port_open(port) or alive(server_pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not port_open(port) and not alive(server_pid), "the trap did not stop plancache serve\n" + report

    lines = [x for x in out.splitlines() if not x.startswith("INFO:")]  # uvicorn's access log shares stdout
    report = "\n".join(lines) + "\n" + report
    key = (tmp_path / "examples" / "conv_bias_relu.json").resolve()
    graph_key = subprocess.run([Path(sys.prefix) / "bin" / "plancache", "spec", "key", str(key)],
                               capture_output=True, text=True, check=True).stdout.split()[0]

    def line(prefix: str) -> str:
        found = [x for x in lines if x.startswith(prefix)]
        assert len(found) == 1, f"expected one stdout line starting with {prefix!r}\n" + report
        return found[0]

    # spec registered, job queued
    registered = json.loads(line(f'{{"graph_key":"{graph_key}","created"'))
    assert registered == {"graph_key": graph_key, "created": True}, report
    jobs = json.loads(line('{"jobs":'))["jobs"]
    assert [(j["graph_key"], j["target"]["sm"], j["status"]) for j in jobs] == [(graph_key, 90, "queued")], report
    # the stand-in worker claimed the job and published a signed plan through the worker protocol
    stats = json.loads(line('{"claimed":'))
    assert stats["claimed"] == 1 and stats["succeeded"] == 1 and stats["failed"] == 0, report
    # resolve returns the plan, blob included
    resolved = json.loads((tmp_path / "walkthrough" / "resolved.json").read_text())
    assert resolved["missing"] == [] and list(resolved["plans"]) == [graph_key], report
    record = resolved["plans"][graph_key]["record"]
    assert resolved["plans"][graph_key]["blob_b64"]
    summary = json.loads(line(f'{{"graph_key":"{graph_key}","engine_id"'))
    assert summary == {k: record[k] for k in ("graph_key", "engine_id", "blob_sha256", "blob_size")}, report
    # the blob: fetched with an ETag, then 304 for If-None-Match
    blob = (tmp_path / "walkthrough" / "plan.bin").read_bytes()
    assert len(blob) == record["blob_size"] > 0
    assert hashlib.sha256(blob).hexdigest() == record["blob_sha256"]
    assert re.search(r"(?im)^etag: \S+", (tmp_path / "walkthrough" / "blob.headers").read_text()), report
    assert line("304") == "304", report
    # bundle export and import, gc
    assert re.match(r"wrote walkthrough/h200\.bundle: 1 plans for .*, signed by key ", line("wrote ")), report
    assert line("imported ").startswith("imported walkthrough/h200.bundle: 1 new plans, 0 already stored, for "), report
    assert "deleted 0 plan records" in lines and "deleted 0 unreferenced blobs (0 bytes)" in lines, report
    # the tokens the block captured are not empty
    lengths = [int(n) for n in re.search(r"WALKTHROUGH_TOKENS=(\d+) (\d+) (\d+)", out).groups()]
    assert all(n >= 20 for n in lengths), report
    # everything the block wrote into the checkout is ignored by git (keys/fleet.key above all)
    written = sorted(p.name + ("/" if p.is_dir() else "") for p in tmp_path.iterdir()
                     if p.name not in {"walkthrough.sh", "examples", ".venv", "cache"})
    assert written == ["walkthrough/"], written
    assert (tmp_path / "walkthrough" / "keys" / "fleet.key").is_file()
    kept = [name for name in written
            if subprocess.run(["git", "check-ignore", "-q", "--no-index", name], cwd=ROOT).returncode != 0]
    assert not kept, f"the walkthrough leaves files git would commit: {kept} (add them to .gitignore)"
