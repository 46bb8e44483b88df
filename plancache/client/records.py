"""A records source in memory (:class:`MemoryRecords`): the server step and the revalidation read it as they read
the server, so the whole ladder runs without a network."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from ..environment import Environment
from ..errors import NotFound, PlanCacheError
from ..protocol import MissReason, PlanRecord, ResolvedPlan, ResolveResponse, b64encode
from ..spec import GraphSpec
from ..spec.axes import sibling_key

#: The reasons :class:`MemoryRecords` gives for a key without a plan, by whether its spec was registered.
UNREGISTERED = MissReason(reason="not_registered", message="no spec registered in memory: the client registers it")
REGISTERED = MissReason(reason="not_queued", message="the spec is registered in memory; no plan was published")


class MemoryRecords:
    """Plans published in memory (:meth:`publish`), served as a server of API 1.2 serves them: blobs inline, or
    (``inline`` False) fetched by digest; a missing key is counted in :attr:`misses` and answered with its reason
    (:attr:`reasons`, else :data:`UNREGISTERED` or :data:`REGISTERED`). Every call is counted in :attr:`calls`
    (``resolve``, ``blob``, ``specs``, ``siblings``, ``rejects``: one each is a round trip to a server), and fails with the next
    error queued in ``failures[call]``. One environment: the records say which they are for."""

    where = "memory"

    def __init__(self, *, inline: bool = True) -> None:
        self.inline = inline
        self.records: dict[str, PlanRecord] = {}
        self.blobs: dict[str, bytes] = {}
        self.specs: dict[str, GraphSpec] = {}
        self.reasons: dict[str, MissReason] = {}
        self.misses: Counter[str] = Counter()
        self.rejects: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.failures: dict[str, list[PlanCacheError]] = {}
        self.is_off = False

    def publish(self, record: PlanRecord, blob: bytes) -> None:
        """Serve ``record`` (replacing any of its key, as the most recently published) with ``blob``."""
        self.records.pop(record.graph_key, None)
        self.records[record.graph_key] = record
        self.blobs[record.blob_sha256] = blob

    def _call(self, name: str) -> None:
        self.calls[name] += 1
        if queued := self.failures.get(name):
            raise queued.pop(0)

    def resolve(self, environment: Environment, graph_keys: list[str], *, include_blobs: bool = True,
                deadline: float | None = None, background: bool = False) -> ResolveResponse:
        self._call("resolve")
        keys = list(dict.fromkeys(graph_keys))
        plans = {k: self._answer(self.records[k], include_blobs) for k in keys if k in self.records}
        missing = [k for k in keys if k not in plans]
        self.misses.update(missing)
        reasons = {k: self.reasons.get(k) or (REGISTERED if k in self.specs else UNREGISTERED) for k in missing}
        return ResolveResponse(plans=plans, missing=missing, reasons=reasons)

    def _answer(self, record: PlanRecord, include_blobs: bool) -> ResolvedPlan:
        if include_blobs and self.inline:
            return ResolvedPlan(record=record, blob_b64=b64encode(self.blobs[record.blob_sha256]))
        return ResolvedPlan(record=record, blob_url=f"/v1/blobs/{record.blob_sha256}")

    def fetch_blob(self, sha256: str, *, size: int | None = None, deadline: float | None = None,
                   url: str | None = None, background: bool = False) -> bytes:
        self._call("blob")
        blob = self.blobs.get(sha256)
        if blob is None:
            raise NotFound(f"no blob {sha256}")
        return blob

    def register_spec(self, spec: GraphSpec, *, deadline: float | None = None) -> str:
        self._call("specs")
        self.specs[spec.graph_key] = spec
        return spec.graph_key

    def siblings(self, environment: Environment, graph_keys: list[str], *, limit: int,
                 deadline: float | None = None) -> dict[str, dict[str, Any]]:
        """The registered specs of published plans sharing the sibling keys of ``graph_keys`` (whose specs are registered),
        the most recently published first, ``limit`` per key."""
        self._call("siblings")
        published = [k for k in reversed(self.records) if k in self.specs]
        found: dict[str, dict[str, Any]] = {}
        for key in graph_keys:
            shared = sibling_key(self.specs[key]) if key in self.specs else None
            if shared is None:
                continue
            same = [k for k in published if k not in graph_keys and sibling_key(self.specs[k]) == shared]
            found.update((k, self.specs[k].to_json()) for k in same[:limit])
        return found

    def report_rejects(self, rejects: Mapping[str, int], *, deadline: float) -> None:
        self._call("rejects")
        self.rejects.update(rejects)

    def stop(self) -> None:
        """Nothing waits."""

    def close(self) -> None:
        """Nothing to release."""
