"""Plans for clients (resolve many keys in one round trip, look one record up, fetch blobs) and uploads from workers."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from ...blobs import BlobStream, MemoryBlobs, ObjectStoreBlobs
from ...environment import Environment
from ...errors import IntegrityError, NotFound, PayloadTooLarge
from ...http import PROCESS_HEADER
from ...protocol import (
    SHA256_PATTERN,
    ExplainRequest,
    ExplainResponse,
    MissReason,
    PlanCandidates,
    PlanRecord,
    PlanUpload,
    ResolveRequest,
    ResolveResponse,
    SiblingsRequest,
    SiblingsResponse,
)
from ...settings import ServerSettings
from ...store import Store
from ...store.blobs import ContentBlobs
from ...store.misses import MissCaller
from ...store.plans import PlanVersion
from ..auth import Admin, Reader
from ..autotune import autotune_policy
from ..bodies import CheckedRoute
from ..deps import MetricsDep, SettingsDep, StoreDep
from ..errors import documented_errors
from ..limits import Held, miss_caller, miss_share, rate_key
from ..memo import RecordMemo, TtlMemory
from ..metrics import Metrics
from ..uploads import accept_upload
from .specs import GraphKeyPath

log = logging.getLogger("plancache.server")

router = APIRouter(route_class=CheckedRoute, tags=["plans"])

#: Blobs are content-addressed: a URL's bytes never change.
IMMUTABLE = "public, max-age=31536000, immutable"
BLOB_ROUTE = "/v1/blobs/{sha256}"
#: Resolve answers with blobs are streamed in chunks of about this size.
CHUNK_BYTES = 1 << 20
#: Blob bytes base64-encoded at a time in a resolve answer: whole 3-byte groups, about CHUNK_BYTES of text.
_B64_PIECE = 3 * (CHUNK_BYTES // 4)
#: Blob bytes one resolve answer inlines at most (the server holds them in memory while it answers).
MAX_INLINE_BLOB_BYTES = 128 << 20
#: An answer inlining at most this many blob bytes is sent whole: streaming it costs a thread-pool hop a chunk
#: (a pair of 60 KB blobs answered in 2.5 ms whole against 3.1 ms streamed, on a CPU host), and its base64, joined,
#: stays within what the in-flight budget holds for it.
WHOLE_ANSWER_BLOB_BYTES = CHUNK_BYTES // 4


@router.post("/v1/plans/resolve", response_model=ResolveResponse,
             summary="Records (and blobs) for many graph keys on one environment",
             responses=documented_errors(401, 403, 413, 422, 503))
def resolve(req: ResolveRequest, store: StoreDep, settings: SettingsDep, metrics: MetricsDep, principal: Reader,
            request: Request) -> Response:
    """Exact match on the environment's validity fields; keys without a plan are listed in ``missing`` and recorded
    as misses, up to a budget per token (``PLANCACHE_MISSES_PER_MINUTE``, ``PLANCACHE_MISS_BURST``; past it they are
    still listed, not counted). A miss counts once per caller (token or anonymous address) and client process
    (header ``X-Plancache-Process``) in a week, and a caller raises keys it counted already within a share of the
    autotune budget, both kept in the database across replicas (docs/DEPLOYMENT.md, "Autotune"). Each missing key
    has its reason in ``reasons``, as ``explain`` gives it once the miss is recorded (a key never registered: the
    client that missed it registers it next, and the reason says what follows), so a client learns why in the same
    round trip. Each plan whose blob is not inline has ``blob_url``: a presigned GET URL of the object store
    (``PLANCACHE_PRESIGN_BLOBS``; valid ``PLANCACHE_PRESIGN_SECONDS`` when made, and handed out again while more
    than half of that is left) when the blobs are in one, else this server's ``/v1/blobs/{sha256}``.
    ``include_blobs`` inlines the blobs as base64 where the server serves them itself (never when it presigns: the
    bytes then bypass it), in key order up to 128 MiB of blob bytes per answer and what the server's in-flight
    budget has room for, from this process's blob memory where it keeps them (``PLANCACHE_BLOB_MEMORY_BYTES``, as
    for blob GETs); a plan past that has ``blob_b64`` null."""
    if len(req.graph_keys) > settings.max_resolve_keys:
        raise PayloadTooLarge(f"{len(req.graph_keys)} graph keys in one resolve; the limit is {settings.max_resolve_keys}")
    keys = list(dict.fromkeys(req.graph_keys))
    reasons: dict[str, MissReason] = {}
    found = _answer_heads(store, request.app.state.record_memo, req.environment, keys)
    missing = [key for key in keys if key not in found]
    if missing:
        who = MissCaller(miss_caller(principal, request.client.host if request.client else None),
                         request.headers.get(PROCESS_HEADER, "")[:64])
        fresh = store.countable_misses(req.environment.env_id, who, missing, miss_share(settings.autotune_jobs_per_hour))
        counted = request.app.state.miss_writes.take(rate_key(principal), len(fresh.keys), partial=True) if fresh.keys else 0
        if counted:
            store.record_misses(req.environment, fresh.keys[:counted], who, fresh.shared)
        metrics.misses_not_counted.inc(len(missing) - counted)
        reasons = store.explain_misses(req.environment, missing, autotune=autotune_policy(request),
                                       job_errors=principal.may("admin"), resolving=True)
    held = 0
    presign = _presigner(store, settings, request.app.state.presigned_urls)
    inline: set[str] = set()
    blobs: dict[str, bytes] = {}
    if req.include_blobs and presign is None:
        wanted = 0
        for version, _ in found.values():
            if wanted + version.blob_size <= MAX_INLINE_BLOB_BYTES:
                wanted += version.blob_size
        # the blobs' bytes and one piece of their base64 (resolve_json), released once the answer is sent
        held = request.app.state.inflight.take_up_to(wanted + CHUNK_BYTES)
        budget = held - CHUNK_BYTES
        for key, (version, _) in found.items():
            if version.blob_size <= budget:
                inline.add(key)
                budget -= version.blob_size
        try:  # a blob collected since its record was read (replaced meanwhile) is not inlined
            blobs = _inline_blobs(store, request.app.state.blob_memory, {found[key][0].blob_sha256 for key in inline})
        except BaseException:
            request.app.state.inflight.release(held)
            raise
    plans = [(head, version.blob_sha256, blobs.get(version.blob_sha256) if key in inline else None)
             for key, (version, head) in found.items()]
    inline_bytes = sum(len(blob) for _, _, blob in plans if blob is not None)
    metrics.observe_resolve(len(found), len(missing), inline_bytes)
    chunks = resolve_json(plans, missing, presign or _server_route, reasons)
    # the held bytes go back once the answer is sent, or the client is gone (background)
    hold = Held(request.app.state.inflight, held) if held else None
    release = BackgroundTask(hold.release) if hold is not None else None
    if hold is not None and inline_bytes > WHOLE_ANSWER_BLOB_BYTES:
        return StreamingResponse(_releasing(chunks, hold), media_type="application/json", background=release)
    return Response(b"".join(chunks), media_type="application/json", background=release)


def _answer_heads(store: Store, memo: RecordMemo, env: Environment, keys: list[str]
                  ) -> dict[str, tuple[PlanVersion, bytes]]:
    """The version and :func:`answer_head` of each plan stored for ``keys`` on ``env``, in key order: the versions
    read now, the heads from ``memo`` where it holds the version, else from the records, read whole (and kept). A
    plan gone between the two reads is left out; one replaced in between is answered as read the second time."""
    heads, unknown = {}, []
    for key, version in store.plan_versions(env, keys).items():
        head = memo.get(version)
        if head is None:
            unknown.append(key)
        else:
            heads[key] = (version, head)
    for key, (version, record) in store.plan_records(env, unknown).items():
        heads[key] = (version, answer_head(key, record))
        memo.put(version, heads[key][1])
    return {key: heads[key] for key in keys if key in heads}


def _inline_blobs(store: Store, memory: MemoryBlobs, digests: set[str]) -> dict[str, bytes]:
    """The bytes of ``digests`` a resolve answer inlines: those this process keeps in its blob memory, the others
    read from the store and kept there for the next answers and GETs (each hashed once, as it goes in; one over the
    memory's largest item is inlined as read). One found damaged as it goes in is left out (logged), as a GET
    answers it 404: its plan gets its ``blob_url``."""
    found = {sha256: data for sha256 in digests if (data := memory.get(sha256)) is not None}
    for sha256, data in store.get_blobs(digests - found.keys()).items():
        if len(data) <= memory.max_item:
            try:
                memory.put(sha256, data)
            except IntegrityError as exc:
                log.warning("blob %s of %s is damaged, not inlined: %s", sha256, store.blob_store.url, exc)
                continue
        found[sha256] = data
    return found


def answer_head(key: str, record: PlanRecord) -> bytes:
    """A plan's part of a resolve answer up to its blob: ``"<key>":{"record":{…},"blob_b64":``."""
    return b"".join((json.dumps(key).encode(), b':{"record":', record.model_dump_json().encode(), b',"blob_b64":'))


def _releasing(chunks: Iterator[bytes], hold: Held) -> Iterator[bytes]:
    """``chunks``, giving ``hold`` back when they are all sent (or the iterator is dropped)."""
    try:
        yield from chunks
    finally:
        hold.release()


@router.post("/v1/plans/explain", response_model=ExplainResponse, summary="Why graph keys have no plan here",
             responses=documented_errors(401, 403, 413, 422, 503))
def explain(req: ExplainRequest, request: Request, store: StoreDep, settings: SettingsDep,
            principal: Reader) -> ExplainResponse:
    """Per graph key, why it has no plan on the environment: never registered; registered, never queued; queued
    or running (the job); failed (the job's error); tuned only for other environments (the validity fields in
    which the nearest differs); or ``planned`` when it has one. Nothing is recorded. Clients ask it for the keys
    a resolve missed; ``plancache explain`` asks it for a spec file or key. A failed job's error (a worker's text,
    with its paths) is quoted to an admin token only."""
    if len(req.graph_keys) > settings.max_resolve_keys:
        raise PayloadTooLarge(f"{len(req.graph_keys)} graph keys in one explain; the limit is {settings.max_resolve_keys}")
    return ExplainResponse(reasons=store.explain_misses(req.environment, req.graph_keys,
                                                        autotune=autotune_policy(request),
                                                        job_errors=principal.may("admin")))


@router.post("/v1/plans/siblings", response_model=SiblingsResponse,
             summary="The tuned plans of other shapes of graph keys on one environment",
             responses=documented_errors(401, 403, 422, 503))
def siblings(req: SiblingsRequest, store: StoreDep, _: Reader) -> Response:
    """For each graph key, the specs of the plans stored on exactly this environment's validity fields for graphs
    that differ from it only in batch size and sequence lengths (``plancache.spec.axes.sibling_key``: attention
    forward and backward without a mask, bias or sequence-length input; other graphs have none), up to ``limit``
    per key, the most recently published first (API 1.4). A client that has just fetched one shape's plans asks for
    its siblings in the background and fetches theirs ahead of its next new shape. Nothing is recorded; a key
    without a stored spec has none."""
    found = store.plan_siblings(req.environment, req.graph_keys, req.limit)
    body = b",".join(json.dumps(key).encode() + b":" + text.encode() for key, text in found.items())
    return Response(b'{"specs":{' + body + b"}}", media_type="application/json")


def _server_route(sha256: str) -> str:
    return BLOB_ROUTE.format(sha256=sha256)


def _presigner(store: Store, settings: ServerSettings, urls: TtlMemory[str]) -> Callable[[str], str] | None:
    """The presigned GET URL of a blob, when the blobs are in an object store and presigning is on (else None):
    from ``urls``, which keeps each for half of ``PLANCACHE_PRESIGN_SECONDS``, or made anew."""
    blobs = store.blob_store.content if isinstance(store.blob_store, ContentBlobs) else None
    if not settings.presign_blobs or not isinstance(blobs, ObjectStoreBlobs):
        return None
    expiry = timedelta(seconds=settings.presign_seconds)

    def presign(sha256: str) -> str:
        url = urls.get(sha256)
        if url is None:
            url = blobs.presign(sha256, expiry)
            urls.put(sha256, url)
        return url

    return presign


def resolve_json(plans: Iterable[tuple[bytes, str, bytes | None]], missing: list[str],
                 blob_url: Callable[[str], str] = _server_route,
                 reasons: Mapping[str, MissReason] | None = None) -> Iterator[bytes]:
    """The :class:`ResolveResponse` JSON in chunks of about :data:`CHUNK_BYTES`, from each plan's
    :func:`answer_head`, blob sha256 and blob (or None). Blobs are base64-encoded as their chunk is made (base64
    needs no JSON escaping) a piece at a time, so the answer holds no copy of a blob beyond its bytes (which the
    in-flight budget counts) and one piece; a plan without its blob gets ``blob_url(sha256)``."""
    buffer, size = [b'{"plans":{'], 0
    for i, (head, sha256, blob) in enumerate(plans):
        if blob is None:
            part = b"".join((b"," if i else b"", head, b'null,"blob_url":', json.dumps(blob_url(sha256)).encode(),
                             b"}"))
            buffer.append(part)
            size += len(part)
            if size >= CHUNK_BYTES:
                yield b"".join(buffer)
                buffer, size = [], 0
            continue
        buffer += [b"," if i else b"", head, b'"']
        yield b"".join(buffer)
        view = memoryview(blob)
        for start in range(0, len(blob), _B64_PIECE):  # whole 3-byte groups: the pieces' base64 concatenates
            yield base64.b64encode(view[start:start + _B64_PIECE])
        buffer, size = [b'","blob_url":null}'], 0
    explained = b"".join((b'{', b",".join(json.dumps(k).encode() + b":" + r.model_dump_json().encode()
                                          for k, r in (reasons or {}).items()), b'}'))
    buffer.append(b'},"missing":' + json.dumps(missing).encode() + b',"reasons":' + explained + b"}")
    yield b"".join(buffer)


@router.get("/v1/plans/{graph_key}", response_model=PlanRecord, summary="The plan record for one graph key on one environment",
            responses=documented_errors(401, 403, 404, 422, 503))
def read_plan(graph_key: GraphKeyPath, environment: Annotated[Environment, Query()], store: StoreDep, _: Reader) -> PlanRecord:
    """The environment's validity fields (``sm``, ``sm_count``, ``cudnn_version``, ``driver_version``,
    ``frontend_version``) are required query parameters; the info fields are ignored."""
    record = store.get_plan(graph_key, environment)
    if record is None:
        raise NotFound(f"no plan for graph key {graph_key} on {environment.describe()}")
    return record


@router.get("/v1/plans/{graph_key}/candidates", response_model=PlanCandidates,
            summary="The candidates table of the tuning run of one plan (admin)",
            responses=documented_errors(401, 403, 404, 422, 503))
def read_candidates(graph_key: GraphKeyPath, environment: Annotated[Environment, Query()], store: StoreDep,
                    _: Admin) -> PlanCandidates:
    """What the worker tried choosing the plan of ``graph_key`` on the environment (validity fields as query
    parameters, as for the record): at most 512 candidates, the best ones, and how many others were tried, by
    status. Kept apart from the record: resolve answers, records and bundles never carry it."""
    table = store.get_candidates(graph_key, environment)
    if table is None:
        raise NotFound(f"no plan for graph key {graph_key} on {environment.describe()}")
    return table


def _cut_off_when_damaged(stream: BlobStream) -> Iterator[bytes]:
    """The stream's chunks; a blob that turns out damaged ends the answer before its last chunk, the connection
    closed, so no client or cache takes it for whole (an error raised in the answer's body: it is already started)."""
    try:
        yield from stream
    except IntegrityError as exc:
        raise RuntimeError(f"{stream.source}: blob {stream.sha256} is damaged, its answer cut off: {exc}") from None


def _etag_matches(if_none_match: str | None, sha256: str) -> bool:
    if if_none_match is None:
        return False
    tags = [t.strip() for t in if_none_match.split(",")]
    return any(t == "*" or t.removeprefix("W/") == f'"{sha256}"' for t in tags)


@router.get(BLOB_ROUTE, response_class=Response, summary="A plan blob by its sha256",
            responses={200: {"content": {"application/octet-stream": {}}, "description": "the blob"},
                       304: {"description": "If-None-Match matched: the cached copy is current"},
                       **documented_errors(401, 403, 404, 422, 503)})
async def read_blob(sha256: Annotated[str, Path(pattern=SHA256_PATTERN)], request: Request, store: StoreDep,
                    metrics: MetricsDep, _: Reader, if_none_match: Annotated[str | None, Header()] = None) -> Response:
    """Blobs are immutable: the answer may be cached by anyone (``ETag`` is the digest). A blob read once is kept
    in this process's memory (``PLANCACHE_BLOB_MEMORY_BYTES``) and served from there without the database.
    Bytes are hashed when first read (from a folder or a bucket as they are read, from the database before they are
    kept): a damaged blob is 404 (logged), and one of a folder or bucket too large to keep in memory is streamed and
    cut off before its last chunk when it turns out damaged."""
    headers = {"ETag": f'"{sha256}"', "Cache-Control": IMMUTABLE}
    memory: MemoryBlobs = request.app.state.blob_memory
    data = memory.get(sha256)
    if _etag_matches(if_none_match, sha256):
        if data is None and await run_in_threadpool(store.blob_size, sha256) is None:
            raise NotFound(f"no blob {sha256}")
        return Response(status_code=304, headers=headers)
    if data is None:
        stream = await run_in_threadpool(store.blob_store.open, sha256)
        if stream is not None and stream.size > memory.max_item:  # a large blob of a folder or bucket: streamed
            metrics.bytes_served.labels(BLOB_ROUTE).inc(stream.size)
            return StreamingResponse(_cut_off_when_damaged(stream), media_type="application/octet-stream",
                                     headers={**headers, "Content-Length": str(stream.size)},
                                     background=BackgroundTask(stream.close))
        if stream is not None:
            data = await run_in_threadpool(stream.whole)
        else:
            found = await run_in_threadpool(store.get_blob_up_to, sha256, memory.max_item)
            if found is not None and found[1] is None:  # read whole, not kept: a share of the budget until sent
                return await _whole_blob(request, store, metrics, sha256, found[0], headers)
            data = None if found is None else found[1]
        if data is None:
            raise NotFound(f"no blob {sha256}")
        try:
            await run_in_threadpool(memory.put, sha256, data)  # bytes from the database are hashed here, once
        except IntegrityError as exc:
            log.warning("blob %s of %s is damaged, treated as missing: %s", sha256, store.blob_store.url, exc)
            raise NotFound(f"no blob {sha256}") from None
    metrics.bytes_served.labels(BLOB_ROUTE).inc(len(data))
    return Response(data, media_type="application/octet-stream", headers=headers)


async def _whole_blob(request: Request, store: Store, metrics: Metrics, sha256: str, size: int,
                      headers: dict[str, str]) -> Response:
    """A blob of the database store too large for the blob memory, read whole for this answer: its bytes are taken
    from the in-flight budget (waiting, then 503) and given back once sent, so that slow readers of large blobs
    cannot hold more memory than the budget."""
    budget = request.app.state.inflight
    await budget.take(size, "blob bytes")
    hold = Held(budget, size)
    try:
        data = await run_in_threadpool(store.get_blob, sha256)
    except BaseException:
        hold.release()
        raise
    if data is None:
        hold.release()
        raise NotFound(f"no blob {sha256}")
    metrics.bytes_served.labels(BLOB_ROUTE).inc(len(data))
    return Response(data, media_type="application/octet-stream", headers=headers, background=BackgroundTask(hold.release))


@router.put("/v1/plans", response_model=PlanRecord, status_code=201,
            summary="Upload a tuned plan outside the job queue (admin)",
            responses={200: {"model": PlanRecord, "description": "this key and environment already had a plan"},
                       **documented_errors(401, 403, 404, 409, 413, 422, 503)})
def upload_plan(upload: PlanUpload, store: StoreDep, settings: SettingsDep, metrics: MetricsDep, response: Response,
                principal: Admin) -> PlanRecord:
    """201 for a new plan; 200 when the same blob was stored already (or ``replace`` swapped it).
    A different blob for a stored key and environment without ``replace`` is 409, and so is a replacement whose
    ``revision`` is not above the stored record's (``stale_revision``: an older record cannot replace a newer one;
    the same blob signed again with a higher revision replaces its record).

    The body is the record alone: the blob is uploaded raw before, with ``PUT /v1/blobs/{sha256}`` (404 when it is not
    stored with ``blob_size`` bytes, nothing published); a body that carries the blob (``blob_b64``) is 422.

    A worker publishes the plan of a job it holds with ``POST /v1/jobs/{id}/complete``, the one completion route; a
    body here that names a job (``job_id``, ``lease_token``) is 422 saying so."""
    accept_upload(upload, principal, store, settings)
    existing = store.get_plan(upload.graph_key, upload.environment)
    record = store.publish_plan(upload, None, replace=upload.replace)
    if existing is not None:
        response.status_code = 200
    if existing is None or existing.blob_sha256 != record.blob_sha256:
        metrics.tuning_seconds.observe(upload.tuning_seconds)
    return record
