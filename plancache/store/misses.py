"""Misses: which graph keys clients asked for and found no plan, per environment, and which callers counted them.

A miss raises a key's count once per caller (a token, or an anonymous address) and client process in
:data:`DISTINCT_MISS_PERIOD`. A caller's first count of a key is free; raising a key it counted already (from
another process) takes one of its ``share`` keys per :data:`SHARE_PERIOD` (a key once taken is free for the rest
of that period), past which such misses are not counted. So a key one caller alone misses stays at 1 however many
processes it names, unless the caller spends its share on it. Who counted what is in the ``miss_callers`` table
(caller and process hashed), so this holds across replicas and restarts: one indexed read per resolve batch
(:meth:`Misses.countable_misses`), the rows written with the misses; rows older than the period are deleted
(:func:`expire_miss_callers`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from ..environment import Environment
from ..protocol import Miss
from .db import Database, check_page, upsert_insert
from .environments import env_columns, env_from_row
from .models import miss_callers, misses, plans, specs

_ROWS_PER_STATEMENT = 500
#: A caller and process count a key once in this long (and their rows are kept this long).
DISTINCT_MISS_PERIOD = timedelta(days=7)
#: The period of a caller's share of keys raised past their first count (the autotune budget's period).
SHARE_PERIOD = timedelta(hours=1)


@dataclass(frozen=True)
class MissCaller:
    """Who missed: ``caller`` (a token's identity, or an anonymous address) and the client ``process`` it names;
    both are kept only as hashes."""

    caller: str
    process: str = ""

    @staticmethod
    def _hash(text: str) -> str:
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    @property
    def caller_hash(self) -> str:
        return self._hash(self.caller)

    @property
    def process_hash(self) -> str:
        return self._hash(self.process)


@dataclass(frozen=True)
class Countable:
    """The keys whose miss counts now, in the order asked, and those of them that take one of the caller's share."""

    keys: list[str]
    shared: frozenset[str]


class Misses:
    db: Database

    def countable_misses(self, env_id: str, who: MissCaller, keys: list[str], share: int) -> Countable:
        """Which of ``keys`` (distinct) ``who`` raises by missing them on ``env_id`` now, with a share of ``share``
        keys per :data:`SHARE_PERIOD` (see the module docstring): one read of ``who``'s rows of those keys."""
        if not keys:
            return Countable([], frozenset())
        now = self.db.now()
        rows = {}
        with self.db.read() as conn:
            for i in range(0, len(keys), _ROWS_PER_STATEMENT):
                rows.update({row.graph_key: row for row in conn.execute(
                    _callers_rows(env_id, who, keys[i:i + _ROWS_PER_STATEMENT], now))})
        used = max((row.share_used for row in rows.values()), default=0)
        counted, shared = [], set()
        for key in keys:
            row = rows.get(key)
            if row is not None and row.this_process:
                continue  # this caller's process counted it already
            if row is not None and not row.shared_now:  # another of its processes: from its share
                if used >= share:
                    continue
                used += 1
                shared.add(key)
            counted.append(key)
        return Countable(counted, frozenset(shared))

    def record_misses(self, env: Environment, keys: Iterable[str], who: MissCaller | None = None,
                      shared: Collection[str] = ()) -> None:
        """Count one miss for each distinct key (duplicates in ``keys`` count once), updating last seen. With
        ``who`` (keys :meth:`countable_misses` gave), record that it counted them (``shared``: from its share);
        a key another replica recorded for the same caller and process meanwhile does not count again."""
        distinct = sorted(set(keys))  # a fixed order: concurrent upserts on Postgres then never deadlock
        if not distinct:
            return
        now = self.db.now()
        base = {**env_columns(env), "count": 1, "first_seen": now, "last_seen": now}
        with self.db.write() as conn:
            if who is not None:
                distinct = _record_callers(conn, env.env_id, who, distinct, set(shared), now)
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


def _callers_rows(env_id: str, who: MissCaller, keys: list[str], now: datetime) -> Any:
    """Per key of ``keys`` that ``who``'s caller counted within :data:`DISTINCT_MISS_PERIOD`: whether this process
    did (``this_process``), whether the key took its share within :data:`SHARE_PERIOD` (``shared_now``), and how
    many keys took its share then (``share_used``, the same on every row)."""
    mc, caller = miss_callers.c, who.caller_hash
    recent = mc.counted_at >= now - SHARE_PERIOD
    share_used = (sa.select(sa.func.count()).select_from(miss_callers)
                  .where(mc.caller == caller, mc.shared == sa.true(), recent).scalar_subquery())
    return (sa.select(mc.graph_key,
                      sa.func.max(sa.case((mc.process == who.process_hash, 1), else_=0)).label("this_process"),
                      sa.func.max(sa.case((sa.and_(mc.shared == sa.true(), recent), 1), else_=0)).label("shared_now"),
                      share_used.label("share_used"))
            .where(mc.env_id == env_id, mc.caller == caller, mc.graph_key.in_(keys),
                   mc.counted_at >= now - DISTINCT_MISS_PERIOD)
            .group_by(mc.graph_key))


def _record_callers(conn: Any, env_id: str, who: MissCaller, keys: list[str], shared: set[str],
                    now: datetime) -> list[str]:
    """Insert ``who``'s rows for ``keys`` (an expired row of the same key is renewed); the keys inserted, in order.
    A row another transaction wrote meanwhile stays, and its key is left out: it counted there."""
    inserted: set[str] = set()
    base = {"env_id": env_id, "caller": who.caller_hash, "process": who.process_hash, "counted_at": now}
    for i in range(0, len(keys), _ROWS_PER_STATEMENT):
        stmt = upsert_insert(conn, miss_callers).values(
            [{**base, "graph_key": k, "shared": k in shared} for k in keys[i:i + _ROWS_PER_STATEMENT]])
        stmt = stmt.on_conflict_do_update(
            index_elements=["env_id", "caller", "graph_key", "process"],
            set_={"counted_at": stmt.excluded.counted_at, "shared": stmt.excluded.shared},
            where=miss_callers.c.counted_at < now - DISTINCT_MISS_PERIOD)
        inserted.update(conn.execute(stmt.returning(miss_callers.c.graph_key)).scalars())
    return [k for k in keys if k in inserted]


def expire_miss_callers(conn: Any, now: datetime, limit: int) -> int:
    """Delete up to ``limit`` rows of ``miss_callers`` older than :data:`DISTINCT_MISS_PERIOD` (they count no
    more), oldest first; how many."""
    mc = miss_callers.c
    old = (sa.select(mc.env_id, mc.caller, mc.graph_key, mc.process)
           .where(mc.counted_at < now - DISTINCT_MISS_PERIOD).order_by(mc.counted_at).limit(limit))
    batch = conn.execute(old).all()
    if not batch:
        return 0
    key = sa.tuple_(mc.env_id, mc.caller, mc.graph_key, mc.process)
    return len(conn.execute(sa.delete(miss_callers).where(key.in_(batch), mc.counted_at < now - DISTINCT_MISS_PERIOD)
                            .returning(mc.graph_key)).all())
