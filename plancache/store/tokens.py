"""API tokens: random secrets shown once, stored as sha256 hashes, with a role, a revocable name and an optional
expiry (a token past it is refused as a revoked one is)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from typing import Any, get_args

import sqlalchemy as sa
from sqlalchemy.engine import Row

from .. import errors
from ..protocol import MAX_TOKEN_LIFETIME_SECONDS, TOKEN_NAME_MAX_LENGTH, Role, TokenInfo
from .db import Database
from .models import api_tokens

TOKEN_PREFIX = "pct_"


def hash_token(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def _info(row: Row[Any]) -> TokenInfo:
    return TokenInfo(id=row.id, name=row.name, role=row.role, created_at=row.created_at,
                     revoked=row.revoked_at is not None, expires_at=row.expires_at)


class Tokens:
    db: Database

    def create_token(self, name: str, role: Role, *, expires_in: timedelta | None = None) -> tuple[str, TokenInfo]:
        """A new token, valid for ``expires_in`` (None: until revoked); the plaintext is returned here only. Names
        are unique among live tokens (an expired one is live until revoked)."""
        if role not in get_args(Role):
            raise errors.InvalidValue(f"unknown role {role!r}; one of {', '.join(get_args(Role))}")
        if not name or len(name) > TOKEN_NAME_MAX_LENGTH or name != name.strip():
            raise errors.InvalidValue(f"a token name is 1-{TOKEN_NAME_MAX_LENGTH} characters without surrounding "
                                      f"spaces, not {name!r}")
        if expires_in is not None and not timedelta(seconds=1) <= expires_in <= timedelta(
                seconds=MAX_TOKEN_LIFETIME_SECONDS):
            raise errors.InvalidValue(f"a token expires 1 s to {MAX_TOKEN_LIFETIME_SECONDS // 86400} days after it is "
                                      f"created, not {expires_in}")
        plaintext = TOKEN_PREFIX + secrets.token_urlsafe(32)
        conflict = errors.Conflict(f"a live token named {name!r} exists; revoke it first")
        try:
            with self.db.write() as conn:
                live = conn.execute(sa.select(api_tokens.c.id)
                                    .where(api_tokens.c.name == name, api_tokens.c.revoked_at.is_(None))).first()
                if live is not None:
                    raise conflict
                now = self.db.now()
                row = conn.execute(
                    sa.insert(api_tokens)
                    .values(name=name, role=role, token_hash=hash_token(plaintext), created_at=now,
                            expires_at=None if expires_in is None else now + expires_in)
                    .returning(*api_tokens.c)
                ).one()
        except sa.exc.IntegrityError:  # a concurrent create of the same name won the race
            raise conflict from None
        return plaintext, _info(row)

    def authenticate(self, plaintext: str) -> TokenInfo | None:
        """The live token with this secret, or None (unknown, revoked or expired)."""
        if not plaintext:
            return None
        digest = hash_token(plaintext)
        with self.db.read() as conn:
            row = conn.execute(sa.select(api_tokens).where(api_tokens.c.token_hash == digest)).first()
        # The lookup is by a hash of the secret; the compare below is constant-time all the same.
        if row is None or not hmac.compare_digest(row.token_hash, digest) or row.revoked_at is not None:
            return None
        if row.expires_at is not None and row.expires_at <= self.db.now():
            return None
        return _info(row)

    def revoke_token(self, name_or_id: str | int) -> TokenInfo:
        """Revoke the live token of this name, or the token of this id (revoking twice is harmless)."""
        with self.db.write() as conn:
            row = None
            if isinstance(name_or_id, str):
                row = conn.execute(
                    sa.select(api_tokens).where(api_tokens.c.name == name_or_id, api_tokens.c.revoked_at.is_(None))
                ).first()
            if row is None and str(name_or_id).isdigit():
                row = conn.execute(sa.select(api_tokens).where(api_tokens.c.id == int(name_or_id))).first()
            if row is None:
                raise errors.NotFound(f"no live token named {name_or_id!r} and no token with that id")
            if row.revoked_at is None:
                row = conn.execute(
                    sa.update(api_tokens).where(api_tokens.c.id == row.id).values(revoked_at=self.db.now())
                    .returning(*api_tokens.c)
                ).one()
        return _info(row)

    def list_tokens(self) -> list[TokenInfo]:
        with self.db.read() as conn:
            return [_info(r) for r in conn.execute(sa.select(api_tokens).order_by(api_tokens.c.id))]
