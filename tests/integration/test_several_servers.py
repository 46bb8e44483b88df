"""A client given several server URLs (``PLANCACHE_SERVER_URL=http://a,http://b``) loads its plans from the first
that answers, and its rejects, misses and revalidations follow it."""

from __future__ import annotations

from pathlib import Path

from plancache.client import PlanCache
from plancache.spec import parse_spec
from tests.client_fakes import RecordingBackend
from tests.factories import H200, PATIENT, make_meta, new_signer, trusted
from tests.live_server import LiveServer, free_port

CONV = parse_spec((Path(__file__).resolve().parents[2] / "examples" / "conv_bias_relu.json").read_text())


def test_a_client_loads_from_the_next_server_when_the_first_is_down(tmp_path, monkeypatch):
    signer, blob = new_signer(), b"a plan of conv" * 40
    with LiveServer(tmp_path / "server") as srv:
        srv.store.put_spec(CONV.graph_key, CONV.to_json())
        srv.store.publish_plan(make_meta(CONV.graph_key, H200, blob, signer), blob)
        down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        monkeypatch.setenv("PLANCACHE_SERVER_URL", f"{down},{srv.url}")
        with PlanCache(backend=RecordingBackend(), token=srv.token("reader"), cache_dir=tmp_path / "cache",
                       trusted_keys=trusted(signer), **PATIENT) as pc:
            plan = pc.plan(CONV)
            assert plan.source == "server" and pc.stats().remote_errors == 0
        assert srv.requests["/v1/plans/resolve"] == 1
