"""Property-based run of schemathesis against the app's own OpenAPI schema, on SQLite and Postgres:
generated requests (valid and invalid) to every operation, with an admin token, must never get a
5xx, invalid ones must be refused with a 4xx, and every answer must match the documented statuses,
content types, headers and schemas. Bounded to
``MAX_EXAMPLES`` per operation and derandomized, so CI is reproducible."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from plancache.protocol import TargetEnvironment
from plancache.server import create_app
from plancache.settings import Settings
from tests.server_util import ADMIN_TOKEN, bearer

MAX_EXAMPLES = 25
#: Checks that do not fit this API; all others (not_a_server_error first) apply.
EXCLUDED_CHECKS = [
    # "Schema-valid data is accepted": a schema-valid GraphSpec or key can still be semantically wrong (422)
    # or unknown (404).
    checks.positive_data_acceptance,
    # "Schema-violating data is refused": the wire models coerce in pydantic's lax mode ("5" or true for an
    # integer field); bad input is still refused with a 4xx naming the field, and never a 5xx.
    checks.negative_data_rejection,
    # "An undeclared method is 405": GET /v1/plans/resolve is the record lookup GET /v1/plans/{graph_key}
    # with the key "resolve", refused with 422 as a malformed key.
    checks.unsupported_method,
]

# The schema is read from the app at import; each test binds the app to its own seeded store (below).
APP = create_app(Settings(admin_token=ADMIN_TOKEN, max_request_bytes=1 << 20, max_blob_bytes=1 << 16))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(autouse=True)
def seeded_store(store: Any, make_spec: Any, make_plan: Any, gpu_env: Any) -> Iterator[Any]:
    """The app's store for this test, holding a spec, a plan, a queued job and a miss, so that generated
    requests reach more than the not-found paths."""
    key, spec = make_spec(0)
    store.put_spec(key, spec)
    store.publish_plan(*make_plan(key, gpu_env))
    other, other_spec = make_spec(1)
    store.put_spec(other, other_spec)
    store.enqueue(other, TargetEnvironment(sm=gpu_env.sm))
    store.record_misses(gpu_env, [other])
    APP.state.store = store
    try:
        yield store
    finally:
        APP.state.store = None


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_api_conforms_and_never_fails(case: Any) -> None:
    case.call_and_validate(headers=bearer(ADMIN_TOKEN), excluded_checks=EXCLUDED_CHECKS)
