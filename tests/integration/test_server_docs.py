"""``/docs`` works offline (one self-contained page rendered from ``/openapi.json``), and ``/metrics`` labels
every route of the app by its path template, ``/docs`` and ``/openapi.json`` included."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from plancache.server import create_app
from plancache.server.docs import render
from plancache.settings import Settings
from plancache.store import open_store
from tests.server_util import Api, open_api


@pytest.fixture
def sapi(tmp_path) -> Iterator[Api]:
    with open_store(f"sqlite:///{tmp_path / 'docs.db'}", create=True) as store, open_api(store) as a:
        yield a


def test_docs_is_self_contained_and_lists_every_operation(sapi):
    r = sapi.client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert not re.search(r"(?i)https?:", page), "the page must not load or link anything off the host"
    assert not re.search(r"(?i)<script|<link|<img|<iframe|@import|url\(", page), "no asset of any kind"
    assert '<a href="/openapi.json">' in page
    document = sapi.client.get("/openapi.json").json()
    for path, item in document["paths"].items():
        for method, op in item.items():
            assert f'<span class="m {method}">{method.upper()}</span><span class="path">{path}</span>' in page
            assert html.escape(op["summary"]) in page
    resolve = page[page.index('id="op-post-v1-plans-resolve"'):]
    assert "Records (and blobs) for many graph keys on one environment" in resolve
    assert '<a href="#schema-ResolveRequest">ResolveRequest</a>' in resolve  # request body links its schema
    assert "Needs <code>Authorization: Bearer &lt;token&gt;</code>." in resolve
    schema = page[page.index('<h3 id="schema-ResolveRequest">'):]
    assert "<code>graph_keys</code></td><td>yes</td><td>array of string</td>" in schema
    assert "<code>include_blobs</code></td><td>no</td><td>boolean</td>" in schema
    assert page.count("<h3 id=\"schema-") == len(document["components"]["schemas"])


def test_the_cdn_pages_are_off(sapi):
    assert sapi.client.get("/redoc").status_code == 404
    assert sapi.client.get("/docs/oauth2-redirect").status_code == 404


def test_docs_under_a_root_path_links_the_document_there(tmp_path):
    with (open_store(f"sqlite:///{tmp_path / 'root.db'}", create=True) as store,
          TestClient(create_app(Settings(), store=store), root_path="/plancache") as client):
        assert '<a href="/plancache/openapi.json">' in client.get("/docs").text


def test_render_escapes_what_the_document_says():
    document = {"openapi": "3.1.0", "info": {"title": "<t>", "version": "1", "description": "a <script>x</script>"},
                "paths": {"/a/{k}": {"get": {"summary": "s & <b>", "parameters": [
                    {"name": "k", "in": "path", "required": True, "schema": {"type": "string", "pattern": "^<x>$"}}],
                    "responses": {"200": {"description": "ok"}}}}}}
    page = render(document, "/openapi.json")
    assert "<script>" not in page and "<b>" not in page and "<x>" not in page
    assert "a &lt;script&gt;x&lt;/script&gt;" in page and "s &amp; &lt;b&gt;" in page and "^&lt;x&gt;$" in page


def _concrete(path: str) -> str:
    values = {"graph_key": "0" * 64, "sha256": "0" * 64, "job_id": "1"}
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: values.get(m.group(1), "x"), path)


def _http_routes(routes) -> Iterator[object]:
    for route in routes:
        inner = getattr(route, "original_router", None)  # FastAPI's included routers, where it wraps them
        if inner is not None:
            yield from _http_routes(inner.routes)
        elif getattr(route, "methods", None):
            yield route


def test_metrics_label_every_route_by_its_template(sapi):
    # HEAD of a GET route is implicit (not in the document); a route of its own for HEAD is
    sent = {(m, r.path) for r in _http_routes(sapi.app.routes) for m in r.methods - ({"HEAD"} if "GET" in r.methods else set())}
    document = sapi.client.get("/openapi.json").json()
    in_schema = {(m.upper(), p) for p, item in document["paths"].items() for m in item}
    plain = {(m, re.sub(r"\{(\w+):\w+\}", r"{\1}", p)) for m, p in sent}  # OpenAPI drops {name:convertor}
    assert plain == in_schema | {("GET", "/docs"), ("GET", "/openapi.json")}  # every route, the hidden two too
    for method, path in sorted(sent):
        sapi.client.request(method, _concrete(path))  # no token or body: any status will do
    sapi.client.get("/no/such/route")
    text = sapi.client.get("/metrics").text
    labelled = set(re.findall(r'plancache_http_requests_total\{method="(\w+)",route="([^"]+)",status="\d+"\}', text))
    assert sent <= labelled, f"requests not labelled by their route: {sorted(sent - labelled)}"
    unmatched = [line for line in text.splitlines() if 'route="<unmatched>"' in line and "requests_total" in line]
    assert unmatched == ['plancache_http_requests_total{method="GET",route="<unmatched>",status="404"} 1.0']


def test_a_wrong_method_on_a_plain_route_keeps_its_label(sapi):
    assert sapi.client.post("/openapi.json").status_code == 405
    text = sapi.client.get("/metrics").text
    assert 'plancache_http_requests_total{method="POST",route="/openapi.json",status="405"} 1.0' in text
