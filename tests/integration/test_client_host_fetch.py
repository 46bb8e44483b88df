"""One fetch per host: client processes sharing a cache folder that miss the same plans at the same instant ask the
server once; the others read what the first wrote (verified as any disk entry). A holder that dies releases its
turn at once. Real processes, a live server, the fake GPU backend."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from plancache.client.cache import DiskCache
from plancache.signing import Signer, keygen
from plancache.spec import parse_spec
from tests.client_burst_child import ROOT, burst
from tests.factories import H200, make_meta
from tests.live_server import LiveServer

EXAMPLES = ROOT / "examples"
SPECS = [parse_spec((EXAMPLES / f"{name}.json").read_text())
         for name in ("conv_bias_relu", "conv_bias_relu_n8", "conv_bias_relu_n16", "sdpa_causal",
                      "matmul_scale_bias_gelu_amax")]
PROCESSES = 8


@pytest.fixture
def seeded(tmp_path):
    """A live server holding a signed plan for each of SPECS, the public key's file and the specs' file."""
    private, public, _ = keygen(tmp_path / "keys", "test")
    signer = Signer.from_file(private)
    specs_file = tmp_path / "specs.json"
    specs_file.write_text(json.dumps([s.to_json() for s in SPECS]))
    with LiveServer(tmp_path / "server") as srv:
        for spec in SPECS:
            blob = f"serialized plan of {spec.name}".encode() * 20
            srv.store.put_spec(spec.graph_key, spec.to_json())
            srv.store.publish_plan(make_meta(spec.graph_key, H200, blob, signer), blob)
        yield srv, public, specs_file


def test_processes_starting_together_on_one_cache_folder_ask_the_server_once(seeded, tmp_path):
    srv, public, specs_file = seeded
    results = burst(PROCESSES, srv.url, srv.token("reader"), public, [tmp_path / "cache"], specs_file)
    assert srv.requests["/v1/plans/resolve"] == 1  # before: one per process (8)
    assert sorted(r["hits"].get("server", 0) for r in results) == [0] * (PROCESSES - 1) + [len(SPECS)]
    assert all(r["hits"].get("server", 0) + r["hits"].get("disk", 0) == len(SPECS) for r in results)
    spread = max(r["done"] for r in results) - min(r["started"] for r in results)
    print(f"\n{PROCESSES} processes, one folder: 1 resolve, ready within {spread * 1000:.0f} ms of the first start")


def test_processes_on_separate_folders_each_ask(seeded, tmp_path):
    """The lock is the folder's: processes that share nothing still each ask (what the burst test is measured against)."""
    srv, public, specs_file = seeded
    burst(3, srv.url, srv.token("reader"), public, [tmp_path / f"cache{i}" for i in range(3)], specs_file)
    assert srv.requests["/v1/plans/resolve"] == 3


def test_a_holder_killed_with_sigkill_releases_its_turn_at_once(seeded, tmp_path):
    """A process holding the fetch lock of the burst's keys dies (SIGKILL); the waiting client goes on at once, long
    before its deadline, and fetches from the server itself."""
    srv, public, specs_file = seeded
    cache_dir = tmp_path / "cache"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from plancache.client.cache import DiskCache\n"
        "from plancache.spec import parse_spec\n"
        "from tests.factories import H200\n"
        "import json\n"
        f"specs = [parse_spec(s) for s in json.loads(open({str(specs_file)!r}).read())]\n"
        f"lock = DiskCache({str(cache_dir)!r}, H200).fetch_lock([s.graph_key for s in specs], 5)\n"
        "assert lock is not None and not lock.waited\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    killer = threading.Timer(1.5, holder.kill)  # 1.5 s after the client was released (its start-up, not counted)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        [result] = burst(1, srv.url, srv.token("reader"), public, [cache_dir], specs_file, deadline=30.0,
                         released=killer.start)
        killer.join()
    finally:
        killer.cancel()
        holder.kill()
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    assert result["hits"] == {"server": len(SPECS)} and srv.requests["/v1/plans/resolve"] == 1
    assert result["done"] - result["started"] < 15  # the deadline is 30 s: the kernel released the dead holder's lock


def test_a_fetch_lock_held_elsewhere_is_waited_for_at_most_the_timeout(tmp_path):
    cache, other = DiskCache(tmp_path, H200), DiskCache(tmp_path, H200)
    keys = [s.graph_key for s in SPECS]
    held = cache.fetch_lock(keys, 1)
    assert held is not None and not held.waited
    t0 = time.monotonic()
    assert other.fetch_lock(keys, 0.2) is None
    assert 0.2 <= time.monotonic() - t0 < 2
    assert other.fetch_lock(keys[:1], 0.2) is not None  # another set of keys: another lock
    held.release()
    again = other.fetch_lock(list(reversed(keys)), 1)  # the same set in another order: the same lock
    assert again is not None and not again.waited
    again.release()
    again.release()  # idempotent


def test_a_folder_that_cannot_hold_a_lock_means_no_waiting(tmp_path):
    """A cache root that cannot be made a folder (here a file stands there): no lock, the server is asked at once."""
    (tmp_path / "file").write_text("not a folder")
    assert DiskCache(tmp_path / "file", H200).fetch_lock([SPECS[0].graph_key], 1) is None


def test_the_turn_to_fetch_is_given_back_before_the_holders_local_builds(tmp_path):
    """The server is down: the process holding the host's turn to fetch builds its graphs locally (slow: cuDNN compiles
    kernels). Another one waiting for the same keys goes on once the holder's server step is over, not at its
    ``request_deadline`` (nor after the holder's builds, whose plans are never written to the folder)."""
    from plancache.client import PlanCache
    from tests.client_fakes import RecordingBackend
    from tests.factories import new_signer, trusted

    building, built = threading.Event(), threading.Event()

    class SlowBuilds(RecordingBackend):
        def build_heuristic(self, spec, kernel_cache, *, graph=None):
            building.set()
            built.wait(10)
            return super().build_heuristic(spec, kernel_cache, graph=graph)

    signer = new_signer()

    def cache(backend):  # nothing listens on port 9
        return PlanCache("http://127.0.0.1:9", token="t", backend=backend, trusted_keys=trusted(signer),
                         cache_dir=tmp_path / "cache", request_deadline=3)

    holder, waiter = cache(SlowBuilds()), cache(RecordingBackend())
    t = threading.Thread(target=holder.plan, args=(SPECS[0],))
    t.start()
    try:
        assert building.wait(10)
        t0 = time.monotonic()
        assert waiter.plan(SPECS[0]).source == "heuristic"
        waited = time.monotonic() - t0
    finally:
        built.set()
        t.join()
        holder.close()
        waiter.close()
    assert waited < 1.5  # before: 3 s, the whole request_deadline
