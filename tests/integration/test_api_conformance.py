"""What schemathesis (tests/integration/test_schemathesis.py, every check) found where the published OpenAPI
document and the server disagreed, each pinned here: 14 mismatches on SQLite with ``schemathesis run --checks
all`` before, none in the test after.

- ``GET`` on a POST-only route (``/v1/plans/resolve``, ``/v1/plans/explain``) was taken as ``GET
  /v1/plans/{graph_key}`` with a malformed key (422); it is 405 with ``Allow: POST``.
- The wire models validate in pydantic's lax mode: ``0`` for a boolean, ``"90"`` or ``true`` for an integer were
  accepted although the schema says boolean/integer; they are 422 now (a whole number written ``90.0`` is an
  integer in JSON Schema and stays accepted; a spec's ``1.0`` reaches the store as written).
- The document stated less than the server checks: resolve's and explain's key limit and the blob limit (settings,
  413 past them), a blob's base64, ``job_id`` and ``lease_token`` together, a tune request naming keys or specs;
  bounds of an optional integer were ``ge``/``le`` (not JSON Schema), integer bounds floats (``2**63`` for
  INT64_MAX); a spec (any JSON) allowed NUL and huge integers the server refuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plancache.server.bodies import JSON_VALUE_REF, NO_NUL_PATTERN
from plancache.spec import graph_key
from tests.factories import make_meta
from tests.server_util import api, upload_json  # noqa: F401

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("path", ["/v1/plans/resolve", "/v1/plans/explain"])
def test_get_on_a_post_only_route_is_405(api: Any, path: str) -> None:
    r = api.client.get(path, headers=api.reader)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    assert r.headers["allow"] == "POST"
    assert api.client.get(f"/v1/plans/{'0' * 64}", headers=api.reader).status_code == 422  # its query is missing


def _resolve(api: Any, gpu_env: Any, **changes: Any) -> Any:
    environment = {**gpu_env.model_dump(mode="json"), **changes.pop("environment", {})}
    body = {"environment": environment, "graph_keys": ["a" * 64], **changes}
    return api.client.post("/v1/plans/resolve", json=body, headers=api.reader)


@pytest.mark.parametrize(("changes", "field"), [
    ({"include_blobs": 0}, "body.include_blobs"),
    ({"include_blobs": "yes"}, "body.include_blobs"),
    ({"environment": {"sm": "90"}}, "body.environment.sm"),
    ({"environment": {"sm": True}}, "body.environment.sm"),
])
def test_a_value_of_another_json_type_is_refused(api: Any, gpu_env: Any, changes: dict[str, Any], field: str) -> None:
    r = _resolve(api, gpu_env, **changes)
    assert r.status_code == 422 and r.json()["error"]["message"].startswith(field), r.text


def test_whole_numbers_stay_integers_and_a_spec_reaches_the_store_as_written(api: Any, gpu_env: Any) -> None:
    assert _resolve(api, gpu_env, environment={"sm": float(gpu_env.sm)}).status_code == 200
    text = (EXAMPLES / "matmul_scale_bias_gelu_amax.json").read_text()
    assert '"padding": 0.0' in text  # a whole number written as a float, in a spec (any JSON to the schema)
    r = api.client.post("/v1/specs", content=text, headers={**api.admin, "Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    key = r.json()["graph_key"]
    assert key == graph_key(json.loads(text))
    stored = api.client.get(f"/v1/specs/{key}", headers=api.reader).text
    assert '"padding":0.0' in stored.replace(" ", "")


def test_an_inline_blob_and_job_fields_are_refused_as_the_document_says(api: Any, gpu_env: Any,
                                                                      make_spec: Any) -> None:
    key, spec = make_spec(0)
    body = upload_json(make_meta(key, gpu_env, b"blob"), spec)
    r = api.client.put("/v1/plans", json={**body, "blob_b64": "YmxvYg=="}, headers=api.admin)  # not in the schema
    assert r.status_code == 422 and "PUT /v1/blobs/{sha256}" in r.json()["error"]["message"]
    r = api.client.put("/v1/plans", json={**body, "job_id": 5}, headers=api.admin)  # not in the schema either
    assert r.status_code == 422 and "POST /v1/jobs/{id}/complete" in r.json()["error"]["message"]


def test_the_document_states_the_servers_limits_and_rules(api: Any) -> None:
    doc = api.client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    settings = api.app.state.settings
    for name in ("ResolveRequest", "ExplainRequest"):
        assert schemas[name]["properties"]["graph_keys"]["maxItems"] == settings.max_resolve_keys
    props = schemas["PlanUpload"]["properties"]
    assert props["blob_size"]["maximum"] == settings.max_blob_bytes
    assert schemas["PlanUpload"]["additionalProperties"] is False  # the record alone
    assert not {"blob_b64", "job_id", "lease_token"} & set(props) and "PlanPut" not in schemas  # one completion route
    put = doc["paths"]["/v1/plans"]["put"]
    assert put["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/PlanUpload")
    assert {tuple(alt["required"]) for alt in schemas["TuneRequest"]["anyOf"]} == {("graph_keys",), ("specs",)}
    assert schemas["TuneRequest"]["properties"]["max_attempts"]["anyOf"][0] == {
        "type": "integer", "minimum": 1, "maximum": 100}
    spec_body = doc["paths"]["/v1/specs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert spec_body["additionalProperties"] == {"$ref": JSON_VALUE_REF}
    assert spec_body["propertyNames"] == {"pattern": NO_NUL_PATTERN}
    assert {"pattern": NO_NUL_PATTERN, "type": "string"} in schemas["JsonValue"]["anyOf"]
    assert "507" in doc["paths"]["/v1/blobs/{sha256}"]["put"]["responses"]  # the blob store is written there
    assert "507" not in doc["paths"]["/v1/plans"]["put"]["responses"]

    def integer_bounds(node: Any) -> list[Any]:
        if isinstance(node, dict):
            own = [node[k] for k in ("minimum", "maximum") if k in node] if node.get("type") == "integer" else []
            assert not {"ge", "le", "gt", "lt"} & node.keys(), node
            return own + [b for v in node.values() for b in integer_bounds(v)]
        return [b for v in node for b in integer_bounds(v)] if isinstance(node, list) else []

    json_value = schemas.pop("JsonValue")  # any JSON: integers of up to 20 characters, beyond int64
    assert all(isinstance(b, int) for b in integer_bounds(json_value))
    bounds = integer_bounds(doc)  # every field's: whole numbers within int64 (2**63 was stated for INT64_MAX)
    assert bounds and all(isinstance(b, int) and -(2**63) < b < 2**63 for b in bounds), bounds
