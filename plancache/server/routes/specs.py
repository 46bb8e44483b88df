"""Graph specs: register one (any token: clients report the specs they miss) and read one back in canonical form."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Response

from ...errors import NotFound
from ...protocol import GRAPH_KEY_PATTERN, SpecCreated
from ...spec import parse_spec
from ..auth import Reader, TokenReader
from ..bodies import CheckedRoute
from ..deps import StoreDep
from ..errors import documented_errors

router = APIRouter(route_class=CheckedRoute, tags=["specs"])

GraphKeyPath = Annotated[str, Path(pattern=GRAPH_KEY_PATTERN, description="64 lowercase hex characters")]


@router.post("/v1/specs", response_model=SpecCreated, status_code=201, summary="Register a GraphSpec",
             responses={200: {"model": SpecCreated, "description": "already registered"},
                        **documented_errors(401, 403, 409, 413, 422, 429, 503)})
def create_spec(spec: Annotated[dict[str, Any], Body(description="a GraphSpec document (docs/SPEC.md)")], store: StoreDep,
                response: Response, _: TokenReader) -> SpecCreated:
    """Each non-admin token may send ``PLANCACHE_SPEC_WRITE_BURST`` specs at once and
    ``PLANCACHE_SPEC_WRITES_PER_MINUTE`` after that (per server process), valid or not: the budget is taken before
    the body is read; past it, 429 with ``Retry-After``."""
    parsed = parse_spec(spec)  # once: the store checks the key against the same document
    key = parsed.graph_key
    created = store.put_spec(key, parsed)
    if not created:
        response.status_code = 200
    return SpecCreated(graph_key=key, created=created)


@router.get("/v1/specs/{graph_key}", summary="The canonical spec of a graph key",
            responses={200: {"description": "the canonical GraphSpec", "content": {"application/json": {}}},
                       **documented_errors(401, 403, 404, 422, 503)})
def read_spec(graph_key: GraphKeyPath, store: StoreDep, _: Reader) -> dict[str, Any]:
    spec = store.get_spec(graph_key)
    if spec is None:
        raise NotFound(f"no spec stored for graph key {graph_key}")
    return spec
