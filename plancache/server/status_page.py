"""The status page (``GET /ui``): one server-rendered HTML document with inline SVG, no script, no CDN; and its
sign-in form.

:func:`gather` reads what the page shows from the store (bounded queries); :func:`render` turns it into HTML,
escaping every stored value.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from html import escape
from typing import Any

from ..environment import Environment
from ..protocol import Job, JobStatus, Miss, PlanRecord
from ..store.autotune import AutotunePolicy

#: How much of each table the page reads and shows.
PLANS_SHOWN = 500
MISSES_SHOWN = 50
JOBS_SHOWN = 30
FAILURES_SHOWN = 20
WORKER_ENVIRONMENTS_SHOWN = 50
#: A worker environment claimed for this recently is "claiming now" (idle workers claim every few seconds).
ACTIVE_WITHIN = timedelta(minutes=2)


@dataclass
class Status:
    """What the page shows, read from the store."""

    plans: list[PlanRecord]
    misses: list[Miss]
    jobs: list[Job]
    job_counts: dict[str, int]
    miss_reasons: dict[tuple[str, str], str] = field(default_factory=dict)  # (env id, graph key) -> why no plan
    planned_misses: set[tuple[str, str]] = field(default_factory=set)  # (env id, graph key) missed, planned since
    generated_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    failures: list[Job] = field(default_factory=list)  # the newest failed jobs, shown first
    workers: list[tuple[Environment, datetime]] = field(default_factory=list)  # environment, its last claim
    workers_now: datetime | None = None  # the database's clock when ``workers`` was read
    worker_window: timedelta = AutotunePolicy().worker_window  # claimed within it: a worker serves that GPU


def gather(store: Any, autotune: AutotunePolicy | None = None) -> Status:
    """Read the page's data: the newest plans, the most missed keys (with why each has no plan), recent jobs and the
    newest failures, and the environments workers claim for."""
    misses = store.list_misses(limit=MISSES_SHOWN)
    status = Status(store.list_plans(limit=PLANS_SHOWN), misses, store.list_jobs(limit=JOBS_SHOWN), store.job_counts())
    status.failures = store.list_jobs(status="failed", limit=FAILURES_SHOWN)
    status.workers_now, status.workers = store.worker_environments(limit=WORKER_ENVIRONMENTS_SHOWN)
    if autotune is not None:
        status.worker_window = autotune.worker_window
    by_env: dict[str, list[Miss]] = defaultdict(list)
    for m in misses:
        by_env[m.env_id].append(m)
    for env_id, group in by_env.items():
        for key, reason in store.explain_misses(group[0].environment, [m.graph_key for m in group],
                                                 autotune=autotune, job_errors=False).items():  # a reader's page
            status.miss_reasons[env_id, key] = reason.message
            if reason.reason == "planned":  # its plan may be older than the newest PLANS_SHOWN read above
                status.planned_misses.add((env_id, key))
    return status


_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1b1f24;max-width:1200px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eaeef2;
vertical-align:top}th{background:#f6f8fa}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}td.t{white-space:nowrap}
code{font:12px ui-monospace,monospace}.muted{color:#59636e}.pill{display:inline-block;padding:0 8px;
border-radius:10px;margin-right:6px;background:#eaeef2}.failed,.gone{color:#b42318}.succeeded,.active{color:#1a7f37}
.bar{display:flex;width:220px;height:14px;background:#f6f8fa;border-radius:3px;overflow:hidden;margin-top:3px}
.bar .p{background:#2da44e}.bar .m{background:#cf222e}tr.pinned td{background:#fff5f5}
.flag{border-left:4px solid #cf222e;background:#fff5f5;padding:8px 12px;margin:8px 0}
header{display:flex;justify-content:space-between;align-items:baseline}form.inline{display:inline}
input[type=password]{font:14px ui-monospace,monospace;width:28em;padding:4px}button{font:14px system-ui;padding:4px 12px}
"""


def _key(graph_key: str) -> str:
    return f"<code title='{escape(graph_key)}'>{escape(graph_key[:12])}</code>"


def _bar(planned: int, missed: int) -> str:
    """Graphs with a plan (green) and missed graphs without one (red), as shares of one bar."""
    total = planned + missed
    if not total:
        return ""
    return (f"<div class='bar' role='img' aria-label='{planned} of {total} with a plan'>"
            f"<span class='p' style='width:{100 * planned / total:.1f}%'></span>"
            f"<span class='m' style='width:{100 * missed / total:.1f}%'></span></div>")


def _ago(now: datetime, then: datetime) -> str:
    """``25 min ago``: how long before ``now`` ``then`` was, in its largest whole unit."""
    seconds = max(0, int((now - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit} ago"
    return f"{seconds} s ago"


def _speedup_svg(plans: list[PlanRecord]) -> str:
    """Heuristic time over tuned time per plan (1.0 = no gain), as bars on a linear scale."""
    gains = [(p, p.heuristic_median_ms / p.winner_median_ms) for p in plans
             if p.heuristic_median_ms and p.winner_median_ms > 0][:40]
    if not gains:
        return "<p class='muted'>No plan records a heuristic time yet.</p>"
    width, bar, gap, label = 760, 12, 4, 130
    height = len(gains) * (bar + gap) + gap
    most = max(g for _, g in gains)
    parts = [f"<svg role='img' aria-label='tuned versus heuristic time' width='{width}' height='{height}' "
             f"xmlns='http://www.w3.org/2000/svg' font-size='11' font-family='ui-monospace,monospace'>"]
    for i, (p, g) in enumerate(gains):
        y = gap + i * (bar + gap)
        w = (width - label - 70) * g / most
        parts.append(f"<text x='0' y='{y + 10}'>{escape(p.graph_key[:12])}</text>"
                     f"<rect x='{label}' y='{y}' width='{w:.1f}' height='{bar}' fill='#0969da'/>"
                     f"<text x='{label + w + 6:.1f}' y='{y + 10}'>{g:.2f}x</text>")
    parts.append("</svg>")
    return "".join(parts)


#: The order jobs are listed in: failures first, so that none scrolls away behind successes.
STATUS_ORDER: dict[JobStatus, int] = {"failed": 0, "running": 1, "queued": 2, "succeeded": 3}


#: How a job's target names each field it fixes.
_TARGET_PARTS = {"sm": "sm_{}", "sm_count": "x{}", "cudnn_version": "cuDNN {}", "driver_version": "driver {}",
                 "frontend_version": "FE {}"}


def _target(job: Job) -> str:
    """``sm_90 x132, cuDNN 91900``: the fields a job's target fixes (``any GPU`` when none)."""
    fixed = job.target.model_dump(exclude_none=True)
    return ", ".join(_TARGET_PARTS[f].format(v) for f, v in fixed.items() if f in _TARGET_PARTS) or "any GPU"


def _stranded(status: Status) -> list[Job]:
    """The queued jobs (of those read) whose target no environment claimed for within the window matches: no worker
    will take them."""
    now = status.workers_now or status.generated_at
    serving = [env for env, last in status.workers if now - last <= status.worker_window]
    return [j for j in status.jobs if j.status == "queued" and not any(j.target.matches(e) for e in serving)]


def _workers(status: Status, names: dict[str, str], stranded: list[Job]) -> list[str]:
    """The workers panel: each environment workers claimed for and how long ago, then the queued jobs no worker
    serving now can take."""
    now = status.workers_now or status.generated_at
    out = ["<h2>Workers</h2>",
           f"<p class='muted'>Environments workers claimed jobs for: a worker serves one when it claimed within "
           f"{_ago(now, now - status.worker_window).removesuffix(' ago')} (PLANCACHE_AUTOTUNE_WORKER_WINDOW); idle "
           f"workers claim every few seconds, a busy one when its job is done.</p>"]
    if status.workers:
        out.append("<table><tr><th>environment</th><th>env id</th><th>last claim</th><th>state</th></tr>")
        for env, last in status.workers:
            age = now - last
            state, css = (("claiming now", "active") if age <= ACTIVE_WITHIN else
                          ("serving (busy or idle)", "") if age <= status.worker_window else ("gone", "gone"))
            out.append(f"<tr><td>{escape(names.get(env.env_id, env.describe()))}</td><td>{_key(env.env_id)}</td>"
                       f"<td>{last:%Y-%m-%d %H:%M} ({_ago(now, last)})</td><td class='{css}'>{state}</td></tr>")
        out.append("</table>")
    else:
        out.append("<p class='muted'>No worker has claimed a job yet.</p>")
    if stranded:
        targets = Counter(_target(j) for j in stranded)
        out.append(f"<div class='flag'><strong>{len(stranded)} queued job{'s' if len(stranded) > 1 else ''} no "
                   f"serving worker can take</strong> (of the {len(status.jobs)} newest jobs): "
                   + "; ".join(f"{escape(t)} ({n})" for t, n in targets.most_common())
                   + ". Start a worker on such a GPU, or cancel them (<code>plancache jobs cancel</code>).</div>")
    return out


def _jobs(status: Status, stranded: set[int]) -> list[str]:
    """Failed jobs first (the newest failures, whether or not among the newest jobs), then running, queued and
    succeeded ones."""
    seen: dict[int, Job] = {j.id: j for j in status.failures}
    for j in status.jobs:
        seen.setdefault(j.id, j)
    jobs = sorted(seen.values(), key=lambda j: (STATUS_ORDER[j.status], -j.id))
    out = ["<h2>Jobs: failures first</h2>",
           f"<p class='muted'>The {FAILURES_SHOWN} newest failed jobs and the {JOBS_SHOWN} newest jobs.</p>",
           "<table><tr><th>job</th><th>graph</th><th>target</th><th>source</th><th>status</th><th>attempts</th>"
           "<th>updated</th><th>error</th></tr>"]
    for j in jobs:
        flag = " <span class='failed'>(no serving worker)</span>" if j.id in stranded else ""
        row = " class='pinned'" if j.status == "failed" else ""
        out.append(f"<tr{row}><td class='n'>{j.id}</td><td>{_key(j.graph_key)}</td>"
                   f"<td>{escape(_target(j))}{flag}</td><td>{escape(j.source)}</td>"
                   f"<td class='{escape(j.status)}'>{escape(j.status)}</td><td class='n'>{j.attempts}/{j.max_attempts}</td>"
                   f"<td class='t'>{j.updated_at:%Y-%m-%d %H:%M}</td><td>{_error_note(j)}</td></tr>")
    out.append("</table>")
    return out


def _page(title: str, body: list[str]) -> str:
    return "".join(["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
                    f"<title>{escape(title)}</title><meta name='viewport' content='width=device-width'>",
                    f"<style>{_STYLE}</style></head><body>", *body, "</body></html>"])


def render(status: Status, *, signed_in: str | None = None) -> str:
    """The page as one HTML document; ``signed_in``: the name of the session's token (a sign-out button)."""
    envs: dict[str, str] = {}
    planned: dict[str, set[str]] = defaultdict(set)
    for p in status.plans:
        envs[p.env_id] = p.environment.describe()
        planned[p.env_id].add(p.graph_key)
    missed: dict[str, set[str]] = defaultdict(set)
    for m in status.misses:
        envs.setdefault(m.env_id, m.environment.describe())
        if m.graph_key not in planned[m.env_id] and (m.env_id, m.graph_key) not in status.planned_misses:
            missed[m.env_id].add(m.graph_key)
    counts = "".join(f"<span class='pill'>{escape(s)} {n}</span>" for s, n in status.job_counts.items())
    per_env = Counter(p.env_id for p in status.plans)
    stranded = _stranded(status)
    session = (f"<form class='inline' method='post' action='/ui/logout'><span class='muted'>signed in as "
               f"{escape(signed_in)}</span> <button>sign out</button></form>" if signed_in else "")
    body = [
        f"<header><h1>plancache status</h1>{session}</header>",
        f"<p class='muted'>{status.generated_at:%Y-%m-%d %H:%M:%S} UTC · newest {PLANS_SHOWN} plans, "
        f"{MISSES_SHOWN} most missed graphs, {JOBS_SHOWN} newest jobs · jobs: {counts}</p>",
        *_workers(status, envs, stranded),
        *_jobs(status, {j.id for j in stranded}),
        "<h2>Plan coverage by environment</h2>",
        "<p class='muted'>Graphs with a tuned plan, of those with a plan or a recorded miss.</p>",
        "<table><tr><th>environment</th><th>env id</th><th>coverage</th><th>plans</th><th>missed, no plan</th></tr>",
        *(f"<tr><td>{escape(envs[e])}</td><td>{_key(e)}</td><td class='n'>{len(planned[e])} / "
          f"{len(planned[e]) + len(missed[e])}{_bar(len(planned[e]), len(missed[e]))}</td>"
          f"<td class='n'>{per_env[e]}</td><td class='n'>{len(missed[e])}</td></tr>"
          for e in sorted(envs, key=lambda e: envs[e])),
        "</table>" if envs else "</table><p class='muted'>No plans and no misses yet.</p>",
        "<h2>Most missed graphs</h2>",
        "<table><tr><th>graph</th><th>environment</th><th>misses</th><th>last seen</th><th>why no plan</th></tr>",
        *(f"<tr><td>{_key(m.graph_key)}</td><td>{escape(m.environment.describe())}</td><td class='n'>{m.count}</td>"
          f"<td class='t'>{m.last_seen:%Y-%m-%d %H:%M}</td>"
          f"<td>{escape(status.miss_reasons.get((m.env_id, m.graph_key), '')[:300])}</td></tr>"
          for m in status.misses),
        "</table><h2>Tuned versus heuristic</h2>",
        "<p class='muted'>Per plan: the heuristic's first plan time over the tuned winner's (both measured by the "
        "worker that tuned it).</p>",
        _speedup_svg(status.plans),
        "<table><tr><th>graph</th><th>environment</th><th>plan</th><th>tuned ms</th><th>heuristic ms</th></tr>",
        *(f"<tr><td>{_key(p.graph_key)}</td><td>{escape(p.environment.describe())}</td>"
          f"<td>{escape(p.plan_name[:60])}</td><td class='n'>{p.winner_median_ms:.4f}</td><td class='n'>"
          f"{'' if p.heuristic_median_ms is None else f'{p.heuristic_median_ms:.4f}'}</td></tr>"
          for p in status.plans[:100]),
        "</table>",
    ]
    return _page("plancache status", body)


def render_login(problem: str | None = None, *, note: str | None = None) -> str:
    """The sign-in form: a reader token, kept in the page's session cookie; ``problem`` says why a sign-in failed."""
    return _page("plancache status: sign in", [
        "<h1>plancache status</h1>",
        "<p>Sign in with a <strong>reader</strong> token (<code>plancache token create --role reader --name "
        "NAME</code>). This browser keeps it in an HttpOnly cookie of this site, for this page only, for 8 hours.</p>",
        f"<p class='failed'>{escape(problem)}</p>" if problem else "",
        f"<p class='muted'>{escape(note)}</p>" if note else "",
        "<form method='post' action='/ui/login'><input type='password' name='token' autocomplete='off' "
        "aria-label='reader token' placeholder='pct_…' required> <button>Sign in</button></form>",
    ])


def _error_note(job: Any) -> str:
    """Where a job's error is read: a worker's text (paths, host names) is for admins, the page is a reader's."""
    return f"GET /v1/jobs/{job.id} (admin)" if job.error else ""
