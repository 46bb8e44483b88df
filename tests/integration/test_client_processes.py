"""The client in processes of its own: a load on a thread still running as the interpreter exits, and a child
forked while the parent was loading (each runs or forks a process, so they live here, not in tests/unit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.factories import H200

URL = "http://plancache.test"


_LOADS_AT_EXIT = '''
import json, sys, threading, time
import httpx
from plancache.client import PlanCache
from tests.client_fakes import RecordingBackend
from tests.factories import CONV_SPEC, H200, make_record, new_signer, trusted

KEY, BLOB, signer = CONV_SPEC.graph_key, b"a tuned plan" * 40, new_signer()
record = make_record(KEY, H200, BLOB, signer)
cache_dir, case = sys.argv[1], sys.argv[2]

def handler(request):
    if request.url.path == "/v1/plans/resolve":
        plan = {"record": json.loads(record.model_dump_json()), "blob_url": f"/v1/blobs/{record.blob_sha256}"}
        return httpx.Response(200, json={"plans": {KEY: plan}, "missing": []})
    return httpx.Response(200, content=BLOB)

if case == "disk":  # an entry never confirmed by the server: due for revalidation
    seed = PlanCache("", trusted_keys=trusted(signer), cache_dir=cache_dir, backend=RecordingBackend(), environment=H200)
    seed.disk.save(record, BLOB)
    seed.close()
pc = PlanCache("http://plancache.test", token="t", trusted_keys=trusted(signer), cache_dir=cache_dir,
               backend=RecordingBackend(), environment=H200, transport=httpx.MockTransport(handler))

def load():
    time.sleep(0.3)  # the main thread has returned: the interpreter is exiting
    try:
        print("source", pc.plan(CONV_SPEC).source, flush=True)
    except BaseException as exc:
        print("raised", type(exc).__name__, exc, flush=True)

threading.Thread(target=load).start()
'''


@pytest.mark.parametrize("case", ["server", "disk"])
def test_a_load_on_a_thread_still_running_at_exit_is_served(tmp_path, case):
    """A worker thread of an inference server still loading once the main thread returned: no new thread can be
    started then (``ThreadPoolExecutor``: never; ``threading.Thread``: from Python 3.12), so the blob downloads, the
    request's deadline thread and the revalidation raised ``RuntimeError`` out of ``plan()``."""
    out = subprocess.run([sys.executable, "-c", _LOADS_AT_EXIT, str(tmp_path), case], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert f"source {case}" in out.stdout, out.stdout + out.stderr


def test_a_child_forked_during_a_load_is_told_not_to_use_the_parents_cache_not_left_waiting(tmp_path):
    """A worker forked while another thread of the parent was loading (the ladder's lock held, by a thread the child
    does not have): ``stats()`` in the child waited for that lock for ever; it raises ForkedProcess as a load does."""
    import os
    import select
    import threading
    import time

    from plancache.client import PlanCache
    from tests.client_fakes import RecordingBackend
    from tests.factories import CONV_SPEC, new_signer, trusted

    in_load = threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        in_load.set()
        time.sleep(1.0)
        return httpx.Response(200, json={"plans": {}, "missing": []})

    pc = PlanCache(URL, token="t", trusted_keys=trusted(new_signer()), cache_dir=tmp_path, backend=RecordingBackend(),
                   environment=H200, transport=httpx.MockTransport(slow))
    loading = threading.Thread(target=pc.plan, args=(CONV_SPEC,))
    loading.start()
    assert in_load.wait(5)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        said = "returned"
        try:
            pc.stats()
        except Exception as exc:  # noqa: BLE001
            said = type(exc).__name__
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 5)
        said = os.read(read, 100).decode() if ready else "still waiting after 5 s"
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
        os.close(read)
        loading.join()
        pc.close()
    assert said == "ForkedProcess"
