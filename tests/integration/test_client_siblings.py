"""The plans of a graph's other shapes fetched ahead, over the wire: a live server's ``POST /v1/plans/siblings`` and
the client that asks it (``PlanCache.verified_blobs``, as PyTorch attention's route asks at a new shape)."""

from __future__ import annotations

import os

from examples.generate import sdpa_causal
from plancache.client import PlanCache
from tests.client_fakes import RecordingBackend
from tests.factories import H200, make_meta, new_signer, patient, trusted
from tests.live_server import LiveServer


def test_the_route_s_next_new_shape_is_in_memory_before_its_first_call(tmp_path):
    signer = new_signer()
    shapes = [sdpa_causal(batch=b, heads=16, seq=s, d=128) for b, s in ((2, 512), (2, 1024), (4, 2048))]
    with LiveServer(tmp_path / "server", autotune=False) as srv:
        for spec in shapes:
            blob = os.urandom(4096)
            srv.store.put_spec(spec.graph_key, spec.to_json())
            srv.store.publish_plan(make_meta(spec.graph_key, H200, blob, signer), blob)
        with PlanCache(srv.url, **patient({"token": srv.token("reader"), "trusted_keys": trusted(signer),
                                           "cache_dir": tmp_path / "cache", "backend": RecordingBackend(),
                                           "environment": H200, "mode": "strict"})) as cache:
            assert cache.verified_blobs([shapes[0]])[shapes[0].graph_key].source == "server"
            cache.siblings.join(30)
            assert cache.stats().siblings == 2
            asked = dict(srv.requests)
            got = cache.verified_blobs([shapes[2]])[shapes[2].graph_key]
            assert got.source == "memory" and got.record.graph_key == shapes[2].graph_key
            assert dict(srv.requests) == asked  # no request at the new shape
    assert asked["/v1/plans/siblings"] == 1 and asked["/v1/plans/resolve"] == 2
