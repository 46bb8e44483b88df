"""Environments as table columns: the validity fields (plus info fields) stored individually."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from ..environment import INFO_FIELDS, VALIDITY_FIELDS, Environment
from .db import check_int

_INT_FIELDS = tuple(f for f in VALIDITY_FIELDS if Environment.model_fields[f].annotation is int)


def check_validity(fields: Mapping[str, Any]) -> None:
    """Refuse integer validity fields (of an environment or a target) that no column can hold."""
    for f in _INT_FIELDS:
        if fields.get(f) is not None:
            check_int(f, fields[f])


def env_columns(env: Environment) -> dict[str, Any]:
    """Column values of an environment: env_id, validity and info fields."""
    check_validity(env.validity())
    return {"env_id": env.env_id, **env.model_dump(include=set(VALIDITY_FIELDS) | set(INFO_FIELDS))}


def env_from_row(m: Mapping[Any, Any]) -> Environment:
    """The environment of a row with the environment columns (a ``RowMapping``, keyed by name)."""
    return Environment(**{f: m[f] for f in VALIDITY_FIELDS + INFO_FIELDS})


def same_env(table: sa.Table, env: Environment) -> list[Any]:
    """WHERE clauses for an exact match on the validity fields (env_id is their digest, indexed)."""
    check_validity(env.validity())
    return [table.c.env_id == env.env_id, *(table.c[f] == getattr(env, f) for f in VALIDITY_FIELDS)]


def keyed_env(table: sa.Table, env: Environment) -> list[Any]:
    """:func:`same_env` for a lookup by graph keys (``graph_key IN …``): ``env_id`` is compared as an expression that
    no index serves, so the only indexes a planner can take are those led by ``graph_key``, and a lookup reads the
    rows of its keys, never every row of the environment (which stale statistics may show as few)."""
    check_validity(env.validity())
    return [unindexed(table.c.env_id) == env.env_id, *(table.c[f] == getattr(env, f) for f in VALIDITY_FIELDS)]


def unindexed(column: sa.ColumnElement[str]) -> sa.ColumnElement[str]:
    """A text column as an expression of the same value that no index serves (``column || ''``)."""
    return column.concat(sa.literal_column("''"))
