"""Environments as table columns: the validity fields (plus info fields) stored individually."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

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



def by_keys(table: sa.Table, columns: list[Any], postgres: bool, *, on_env: bool = True,
            where: tuple[Any, ...] = ()) -> sa.Select[Any]:
    """``columns`` of the rows of ``table`` for some graph keys on one environment's validity fields (``on_env``
    False: on every environment) that match ``where``, seeking each key in an index led by ``graph_key`` whatever the
    planner's statistics say. Parameters: ``keys`` (a list), with ``on_env`` also ``env_id`` and each validity field
    (:func:`key_params`), and those of ``where``.

    ``env_id`` is compared as an expression no index serves, so the only indexes that the WHERE can use are those led
    by ``graph_key``: a planner that takes an index led by ``env_id`` (whose rows stale statistics may show as few)
    reads every row of the environment. On Postgres, which scans a table for a long list of keys that stale
    statistics make look unselective, each key is a lookup of its own, in a subquery the planner cannot merge into a
    join: its LIMIT 1 on one environment, where ``graph_key`` and ``env_id`` are unique in these tables, or OFFSET 0."""
    env = [*where, *(table.c[f] == sa.bindparam(f) for f in VALIDITY_FIELDS if on_env)]
    if on_env:
        env.append(table.c.env_id.concat(sa.literal_column("''")) == sa.bindparam("env_id"))
    if not postgres:
        return sa.select(*columns).where(table.c.graph_key.in_(sa.bindparam("keys", expanding=True)), *env)
    keys = sa.func.unnest(sa.bindparam("keys", type_=postgresql.ARRAY(sa.String))).table_valued("key").render_derived("keys")
    each = sa.select(*columns).where(table.c.graph_key == keys.c.key, *env)
    each = each.limit(1) if on_env else each.offset(0)
    found = each.lateral("found")
    return sa.select(found).select_from(keys.join(found, sa.true()))


def key_params(keys: Collection[str], env: Environment | None = None) -> dict[str, Any]:
    """The parameters of a :func:`by_keys` statement (``env``: for one ``on_env``)."""
    if env is None:
        return {"keys": list(keys)}
    check_validity(env.validity())
    return {"keys": list(keys), "env_id": env.env_id, **env.validity()}
