"""The plans of a graph's other shapes fetched ahead, over the wire: a live server's ``POST /v1/plans/siblings`` and
the client that asks it (``PlanCache.verified_blobs``, as PyTorch attention's route asks at a new shape)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from examples.generate import sdpa_causal
from plancache.client import PlanCache
from tests.client_fakes import RecordingBackend
from tests.factories import H200, make_meta, new_signer, patient, trusted
from tests.live_server import LiveServer

#: One attention graph at three shapes: siblings.
SHAPES = [sdpa_causal(batch=b, heads=16, seq=s, d=128) for b, s in ((2, 512), (2, 1024), (4, 2048))]


def serving(srv: LiveServer, tmp_path: Path, **options: Any) -> PlanCache:
    """A strict client of ``srv``, which holds a signed plan of each of :data:`SHAPES`."""
    signer = new_signer()
    for spec in SHAPES:
        blob = os.urandom(4096)
        srv.store.put_spec(spec.graph_key, spec.to_json())
        srv.store.publish_plan(make_meta(spec.graph_key, H200, blob, signer), blob)
    return PlanCache(srv.url, **patient({"token": srv.token("reader"), "trusted_keys": trusted(signer),
                                         "cache_dir": tmp_path / "cache", "backend": RecordingBackend(),
                                         "environment": H200, "mode": "strict", **options}))


def test_the_route_s_next_new_shape_is_in_memory_before_its_first_call(tmp_path):
    shapes = SHAPES
    with LiveServer(tmp_path / "server", autotune=False) as srv, serving(srv, tmp_path) as cache:
        assert cache.verified_blobs([shapes[0]])[shapes[0].graph_key].source == "server"
        cache.siblings.join(30)
        assert cache.stats().siblings == 2
        asked = dict(srv.requests)
        got = cache.verified_blobs([shapes[2]])[shapes[2].graph_key]
        assert got.source == "memory" and got.record.graph_key == shapes[2].graph_key
        assert dict(srv.requests) == asked  # no request at the new shape
    assert asked["/v1/plans/siblings"] == 1 and asked["/v1/plans/resolve"] == 2


def test_a_server_without_the_route_is_asked_once_over_the_wire(tmp_path):
    """An older server (API 1.3) answers ``POST /v1/plans/siblings`` 405 (its ``GET /v1/plans/{graph_key}`` takes the
    path), as this server answers a POST to another such path: the client asks once, goes without, and serves every
    shape from the server as before."""
    import httpx

    asked: list[str] = []

    class OlderServer(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/plans/siblings":
                asked.append(request.url.path)
                request.url = request.url.copy_with(path="/v1/plans/" + "ab" * 32)  # what an older server answers
            return super().handle_request(request)

    with LiveServer(tmp_path / "server", autotune=False) as srv:
        with serving(srv, tmp_path, transport=OlderServer()) as cache:
            for spec in SHAPES:
                assert cache.verified_blobs([spec])[spec.graph_key].source == "server"
                cache.siblings.join(30)
            assert asked == ["/v1/plans/siblings"] and cache.stats().siblings == 0
        assert srv.requests["/v1/plans/" + "ab" * 32] == 1
