"""Misses: which graph keys clients asked for and found no plan, per environment."""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa

from ..environment import Environment
from ..protocol import Miss
from .db import Database, check_page, upsert_insert
from .environments import env_columns, env_from_row
from .models import misses, plans, specs

_ROWS_PER_STATEMENT = 500


class Misses:
    db: Database

    def record_misses(self, env: Environment, keys: Iterable[str]) -> None:
        """Count one miss for each distinct key (duplicates in ``keys`` count once), updating last seen."""
        distinct = sorted(set(keys))  # a fixed order: concurrent upserts on Postgres then never deadlock
        if not distinct:
            return
        now = self.db.now()
        base = {**env_columns(env), "count": 1, "first_seen": now, "last_seen": now}
        with self.db.write() as conn:
            for i in range(0, len(distinct), _ROWS_PER_STATEMENT):
                stmt = upsert_insert(conn, misses).values([{**base, "graph_key": k} for k in distinct[i:i + _ROWS_PER_STATEMENT]])
                conn.execute(stmt.on_conflict_do_update(
                    index_elements=["graph_key", "env_id"],
                    set_={"count": misses.c.count + 1, "last_seen": stmt.excluded.last_seen},
                ))

    def list_misses(self, *, env_id: str | None = None, limit: int = 100) -> list[Miss]:
        """Misses, most counted first."""
        check_page(limit)
        q = sa.select(misses).order_by(misses.c.count.desc(), misses.c.last_seen.desc(), misses.c.graph_key).limit(limit)
        if env_id is not None:
            q = q.where(misses.c.env_id == env_id)
        with self.db.read() as conn:
            return [
                Miss(graph_key=m["graph_key"], env_id=m["env_id"], environment=env_from_row(m), count=m["count"],
                     first_seen=m["first_seen"], last_seen=m["last_seen"])
                for m in conn.execute(q).mappings()
            ]

    def top_misses(self, env: Environment, n: int, *, require_spec: bool = False) -> list[str]:
        """Graph keys missed on ``env`` that still have no plan there, most missed first.

        With ``require_spec`` only keys whose spec is stored (the ones that can be enqueued).
        """
        check_page(n)
        has_plan = sa.exists().where(plans.c.graph_key == misses.c.graph_key, plans.c.env_id == misses.c.env_id)
        q = (
            sa.select(misses.c.graph_key)
            .where(misses.c.env_id == env.env_id, ~has_plan)
            .order_by(misses.c.count.desc(), misses.c.last_seen.desc(), misses.c.graph_key)
            .limit(n)
        )
        if require_spec:
            q = q.where(sa.exists().where(specs.c.graph_key == misses.c.graph_key))
        with self.db.read() as conn:
            return list(conn.execute(q).scalars())
