"""The read-only status page (``GET /ui``): one server-rendered HTML document with inline SVG, no script, no CDN.

:func:`gather` reads what the page shows from the store (bounded queries); :func:`render` turns it into HTML,
escaping every stored value.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from typing import Any

from ..protocol import Job, Miss, PlanRecord
from ..store.autotune import AutotunePolicy

#: How much of each table the page reads and shows.
PLANS_SHOWN = 500
MISSES_SHOWN = 50
JOBS_SHOWN = 30


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


def gather(store: Any, autotune: AutotunePolicy | None = None) -> Status:
    """Read the page's data: the newest plans, the most missed keys (with why each has no plan), recent jobs."""
    misses = store.list_misses(limit=MISSES_SHOWN)
    status = Status(store.list_plans(limit=PLANS_SHOWN), misses, store.list_jobs(limit=JOBS_SHOWN), store.job_counts())
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
vertical-align:top}th{background:#f6f8fa}td.n{text-align:right;font-variant-numeric:tabular-nums}
code{font:12px ui-monospace,monospace}.muted{color:#59636e}.pill{display:inline-block;padding:0 8px;
border-radius:10px;margin-right:6px;background:#eaeef2}.failed{color:#b42318}.succeeded{color:#1a7f37}
"""


def _key(graph_key: str) -> str:
    return f"<code title='{escape(graph_key)}'>{escape(graph_key[:12])}</code>"


def _coverage_svg(rows: list[tuple[str, int, int]]) -> str:
    """One bar per environment: graphs with a plan (green) and missed graphs without one (red)."""
    width, bar, gap, label = 820, 18, 10, 400
    height = max(1, len(rows)) * (bar + gap) + gap
    most = max((p + m for _, p, m in rows), default=1) or 1
    parts = [f"<svg role='img' aria-label='plan coverage by environment' width='{width}' height='{height}' "
             f"xmlns='http://www.w3.org/2000/svg' font-size='12' font-family='system-ui,sans-serif'>"]
    for i, (name, planned, missed) in enumerate(rows):
        y = gap + i * (bar + gap)
        w_p = (width - label - 60) * planned / most
        w_m = (width - label - 60) * missed / most
        parts.append(f"<text x='0' y='{y + 13}'>{escape(name[:58])}</text>"
                     f"<rect x='{label}' y='{y}' width='{w_p:.1f}' height='{bar}' fill='#2da44e'/>"
                     f"<rect x='{label + w_p:.1f}' y='{y}' width='{w_m:.1f}' height='{bar}' fill='#cf222e'/>"
                     f"<text x='{label + w_p + w_m + 6:.1f}' y='{y + 13}'>{planned} / {planned + missed}</text>")
    parts.append("</svg>")
    return "".join(parts)


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


def render(status: Status) -> str:
    """The page as one HTML document."""
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
    coverage = sorted(((envs[e], len(planned[e]), len(missed[e])) for e in envs), key=lambda r: r[0])
    counts = "".join(f"<span class='pill'>{escape(s)} {n}</span>" for s, n in status.job_counts.items())
    per_env = Counter(p.env_id for p in status.plans)
    out = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><title>plancache status</title>",
        f"<meta name='viewport' content='width=device-width'><style>{_STYLE}</style></head><body>",
        "<h1>plancache status</h1>",
        f"<p class='muted'>{status.generated_at:%Y-%m-%d %H:%M:%S} UTC · newest {PLANS_SHOWN} plans, "
        f"{MISSES_SHOWN} most missed graphs, {JOBS_SHOWN} newest jobs · jobs: {counts}</p>",
        "<h2>Plan coverage by environment</h2>",
        "<p class='muted'>Graphs with a tuned plan, of those with a plan or a recorded miss.</p>",
        _coverage_svg(coverage) if coverage else "<p class='muted'>No plans and no misses yet.</p>",
        "<table><tr><th>environment</th><th>env id</th><th>plans</th><th>missed, no plan</th></tr>",
        *(f"<tr><td>{escape(envs[e])}</td><td>{_key(e)}</td><td class='n'>{per_env[e]}</td>"
          f"<td class='n'>{len(missed[e])}</td></tr>" for e in sorted(envs, key=lambda e: envs[e])),
        "</table><h2>Most missed graphs</h2>",
        "<table><tr><th>graph</th><th>environment</th><th>misses</th><th>last seen</th><th>why no plan</th></tr>",
        *(f"<tr><td>{_key(m.graph_key)}</td><td>{escape(m.environment.describe())}</td><td class='n'>{m.count}</td>"
          f"<td>{m.last_seen:%Y-%m-%d %H:%M}</td>"
          f"<td>{escape(status.miss_reasons.get((m.env_id, m.graph_key), '')[:300])}</td></tr>"
          for m in status.misses),
        "</table><h2>Queue and recent jobs</h2>",
        "<table><tr><th>job</th><th>graph</th><th>target</th><th>source</th><th>status</th><th>attempts</th>"
        "<th>updated</th><th>error</th></tr>",
        *(f"<tr><td class='n'>{j.id}</td><td>{_key(j.graph_key)}</td><td>sm_{escape(str(j.target.sm))}</td>"
          f"<td>{escape(j.source)}</td><td class='{escape(j.status)}'>{escape(j.status)}</td>"
          f"<td class='n'>{j.attempts}/{j.max_attempts}</td>"
          f"<td>{j.updated_at:%Y-%m-%d %H:%M}</td><td>{_error_note(j)}</td></tr>" for j in status.jobs),
        "</table><h2>Tuned versus heuristic</h2>",
        "<p class='muted'>Per plan: the heuristic's first plan time over the tuned winner's (both measured by the "
        "worker that tuned it).</p>",
        _speedup_svg(status.plans),
        "<table><tr><th>graph</th><th>environment</th><th>plan</th><th>tuned ms</th><th>heuristic ms</th></tr>",
        *(f"<tr><td>{_key(p.graph_key)}</td><td>{escape(p.environment.describe())}</td>"
          f"<td>{escape(p.plan_name[:60])}</td><td class='n'>{p.winner_median_ms:.4f}</td><td class='n'>"
          f"{'' if p.heuristic_median_ms is None else f'{p.heuristic_median_ms:.4f}'}</td></tr>"
          for p in status.plans[:100]),
        "</table></body></html>",
    ]
    return "".join(out)


def _error_note(job: Any) -> str:
    """Where a job's error is read: a worker's text (paths, host names) is for admins, the page is a reader's."""
    return f"GET /v1/jobs/{job.id} (admin)" if job.error else ""
