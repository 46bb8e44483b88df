"""Admin: API tokens over HTTP (create, list, revoke), as ``plancache token`` does on the database."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Path

from ...protocol import TokenCreate, TokenCreated, TokenInfo, TokenList
from ...validation import INT32_MAX
from ..auth import Admin
from ..bodies import CheckedRoute
from ..deps import StoreDep
from ..errors import documented_errors

router = APIRouter(route_class=CheckedRoute, tags=["admin"])

TokenId = Annotated[int, Path(ge=1, le=INT32_MAX)]


@router.get("/v1/admin/tokens", response_model=TokenList, summary="List API tokens (never their secrets)",
            responses=documented_errors(401, 403))
def list_tokens(store: StoreDep, _admin: Admin) -> TokenList:
    return TokenList(tokens=store.list_tokens())


@router.post("/v1/admin/tokens", response_model=TokenCreated, status_code=201, summary="Create an API token",
             responses=documented_errors(401, 403, 409, 422))
def create_token(req: TokenCreate, store: StoreDep, _admin: Admin) -> TokenCreated:
    """The secret is in this answer only (the store keeps its hash); a live token of the same name is a 409."""
    expires_in = None if req.expires_in_seconds is None else timedelta(seconds=req.expires_in_seconds)
    plaintext, info = store.create_token(req.name, req.role, expires_in=expires_in)
    return TokenCreated(token=plaintext, info=info)


@router.post("/v1/admin/tokens/{token_id}/revoke", response_model=TokenInfo, summary="Revoke an API token",
             responses=documented_errors(401, 403, 404, 422))
def revoke_token(token_id: TokenId, store: StoreDep, _admin: Admin) -> TokenInfo:
    """Requests bearing it are refused within ``PLANCACHE_TOKEN_CACHE_SECONDS`` on every replica. Revoking twice is
    harmless."""
    return store.revoke_token(token_id)
