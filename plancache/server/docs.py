"""``GET /docs``: the API reference as one self-contained HTML page, rendered from the app's own OpenAPI document.

FastAPI's default ``/docs`` and ``/redoc`` load Swagger UI / ReDoc from a CDN and are blank on a host without
internet access. This page has no external asset (inline CSS, no script): it lists every operation of
``/openapi.json`` -- method, path, summary, description, token requirement, parameters, request body and
responses -- and every schema with its fields, linked to each other. The machine-readable document stays at
``/openapi.json``.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse

from .bodies import CheckedRoute

_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")
_REF = "#/components/schemas/"

_CSS = """
body{font:15px/1.45 system-ui,sans-serif;margin:0 auto;max-width:72rem;padding:1rem 2rem;color:#1b1f24}
h1{margin-bottom:0}h2{border-bottom:1px solid #ccd;padding-bottom:.2rem;margin-top:2.2rem}
h3{margin:1.6rem 0 .3rem;font-size:1.05rem}code,.path{font-family:ui-monospace,monospace}
.desc{white-space:pre-wrap}.muted{color:#667}
.m{display:inline-block;min-width:4.2rem;text-align:center;border-radius:3px;color:#fff;font:bold 12px ui-monospace,monospace;
padding:2px 0;margin-right:.5rem}.get{background:#2b7bb9}.post{background:#2e8b57}.put{background:#b8860b}
.delete{background:#b22222}.patch{background:#6a5acd}.head,.options{background:#556}
table{border-collapse:collapse;margin:.3rem 0 .8rem;width:100%}th,td{border:1px solid #dde;padding:.25rem .5rem;
text-align:left;vertical-align:top}th{background:#f3f4f7}ul.toc{list-style:none;padding-left:0}ul.toc li{margin:.15rem 0}
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _anchor(kind: str, name: str) -> str:
    return kind + "-" + "".join(c if c.isalnum() else "-" for c in name)


def _type(schema: Mapping[str, Any] | None) -> str:
    """A short HTML rendering of a JSON schema: its type, with links to named schemas."""
    if not schema:
        return "any"
    if "$ref" in schema:
        name = str(schema["$ref"]).removeprefix(_REF)
        return f'<a href="#{_anchor("schema", name)}">{_e(name)}</a>'
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            sep = " &amp; " if key == "allOf" else " | "
            return sep.join(_type(s) for s in schema[key])
    if "const" in schema:
        return f"<code>{_e(repr(schema['const']))}</code>"
    if "enum" in schema:
        return " | ".join(f"<code>{_e(v)}</code>" for v in schema["enum"])
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        return " | ".join(_e(k) for k in kind)
    if kind == "array":
        return f"array of {_type(schema.get('items'))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), Mapping):
        return f"object of {_type(schema['additionalProperties'])}"
    text = _e(kind)
    if "format" in schema:
        text += f" ({_e(schema['format'])})"
    return text


def _constraints(schema: Mapping[str, Any]) -> str:
    keys = ("pattern", "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems", "default")
    parts = [f"{k}: <code>{_e(schema[k])}</code>" for k in keys if k in schema]
    return "; ".join(parts)


def _description(*texts: Any) -> str:
    return " ".join(f'<span class="desc">{_e(t)}</span>' for t in texts if t)


def _operation(method: str, path: str, op: Mapping[str, Any], secured: bool) -> list[str]:
    out = [f'<h3 id="{_anchor("op", method + path)}"><span class="m {method}">{method.upper()}</span>'
           f'<span class="path">{_e(path)}</span> <span class="muted">{_e(op.get("summary", ""))}</span></h3>']
    if op.get("description"):
        out.append(f'<p class="desc">{_e(op["description"])}</p>')
    if secured:
        out.append("<p>Needs <code>Authorization: Bearer &lt;token&gt;</code>.</p>" if op.get("security")
                   else "<p>No token needed.</p>")
    params = op.get("parameters") or []
    if params:
        out.append("<table><tr><th>parameter</th><th>in</th><th>required</th><th>type</th><th>description</th></tr>")
        for p in params:
            schema = p.get("schema") or {}
            out.append(f"<tr><td><code>{_e(p.get('name'))}</code></td><td>{_e(p.get('in'))}</td>"
                       f"<td>{'yes' if p.get('required') else 'no'}</td><td>{_type(schema)}</td>"
                       f"<td>{_description(p.get('description') or schema.get('description'))} "
                       f"{_constraints(schema)}</td></tr>")
        out.append("</table>")
    body = op.get("requestBody")
    if body:
        content = body.get("content") or {}
        kinds = ", ".join(f"<code>{_e(ct)}</code> {_type(c.get('schema'))}" for ct, c in content.items())
        out.append(f"<p>Request body{' (required)' if body.get('required') else ''}: {kinds}</p>")
    responses = op.get("responses") or {}
    if responses:
        out.append("<table><tr><th>status</th><th>description</th><th>body</th></tr>")
        for status, r in sorted(responses.items()):
            content = r.get("content") or {}
            kinds = ", ".join(f"<code>{_e(ct)}</code> {_type(c.get('schema'))}" for ct, c in content.items())
            out.append(f"<tr><td>{_e(status)}</td><td>{_description(r.get('description'))}</td><td>{kinds}</td></tr>")
        out.append("</table>")
    return out


def _schema(name: str, schema: Mapping[str, Any]) -> list[str]:
    out = [f'<h3 id="{_anchor("schema", name)}">{_e(name)}</h3>']
    if schema.get("description"):
        out.append(f'<p class="desc">{_e(schema["description"])}</p>')
    props = schema.get("properties") or {}
    if not props:
        out.append(f"<p>{_type({k: v for k, v in schema.items() if k != 'title'})}</p>")
        return out
    required = set(schema.get("required") or ())
    out.append("<table><tr><th>field</th><th>required</th><th>type</th><th>description</th></tr>")
    for field, sub in props.items():
        out.append(f"<tr><td><code>{_e(field)}</code></td><td>{'yes' if field in required else 'no'}</td>"
                   f"<td>{_type(sub)}</td><td>{_description(sub.get('description'))} {_constraints(sub)}</td></tr>")
    out.append("</table>")
    if schema.get("additionalProperties") is False:
        out.append('<p class="muted">No other fields are accepted.</p>')
    return out


def render(document: Mapping[str, Any], openapi_url: str) -> str:
    """The HTML page of an OpenAPI ``document``; ``openapi_url`` is where the document itself is served."""
    info = document.get("info") or {}
    title = f"{info.get('title', 'API')} {info.get('version', '')}".strip()
    paths = document.get("paths") or {}
    schemas = (document.get("components") or {}).get("schemas") or {}
    secured = bool((document.get("components") or {}).get("securitySchemes"))
    ops = [(m, p, op) for p, item in paths.items() for m in _METHODS if isinstance(op := item.get(m), Mapping)]
    out = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{_e(title)} API</title><style>{_CSS}</style></head><body>",
           f"<h1>{_e(title)}</h1>",
           f'<p class="muted">OpenAPI {_e(document.get("openapi", ""))} document: '
           f'<a href="{_e(openapi_url)}">{_e(openapi_url)}</a></p>']
    if info.get("description"):
        out.append(f'<p class="desc">{_e(info["description"])}</p>')
    out.append('<h2 id="operations">Operations</h2><ul class="toc">')
    for m, p, op in ops:
        out.append(f'<li><a href="#{_anchor("op", m + p)}"><span class="m {m}">{m.upper()}</span>'
                   f'<span class="path">{_e(p)}</span></a> {_e(op.get("summary", ""))}</li>')
    out.append("</ul>")
    for m, p, op in ops:
        out.extend(_operation(m, p, op, secured))
    if schemas:
        out.append('<h2 id="schemas">Schemas</h2><ul class="toc">')
        out.append("".join(f'<li><a href="#{_anchor("schema", n)}">{_e(n)}</a></li>' for n in schemas))
        out.append("</ul>")
        for name, schema in schemas.items():
            out.extend(_schema(name, schema))
    out.append("</body></html>")
    return "\n".join(out)


def install_docs(app: FastAPI, path: str = "/docs") -> None:
    """Serve :func:`render` of ``app.openapi()`` at ``path`` (the app must be created with ``docs_url=None``)."""
    router = APIRouter(route_class=CheckedRoute)
    page: dict[str, str] = {}

    @router.get(path, include_in_schema=False, response_class=HTMLResponse)
    def docs(request: Request) -> HTMLResponse:
        url = request.scope.get("root_path", "") + (app.openapi_url or "/openapi.json")
        if url not in page:  # the document is fixed once the app serves requests
            page[url] = render(app.openapi(), url)
        return HTMLResponse(page[url])

    app.include_router(router)
