"""One page, two answers: HTML for a browser, JSON for a script that asks
with ``Accept: application/json``, from the same data."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from tokenfleet.gateway.console.access import viewer

_templates = Environment(loader=PackageLoader("tokenfleet.gateway.console", "templates"),
                         autoescape=select_autoescape(["html"]), trim_blocks=True,
                         lstrip_blocks=True)


def wants_json(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return "application/json" in accept and "text/html" not in accept


def page(request: Request, template: str, data: dict[str, Any], *, status: int = 200,
         **view: Any) -> Response:
    """``data`` as JSON, or rendered into ``template`` with ``view``'s extras
    (formatting helpers, what a form needs) beside it."""
    if wants_json(request):
        return Response(orjson.dumps(data, default=str), status_code=status,
                        media_type="application/json")
    html = _templates.get_template(template).render(
        **data, **view, viewer=viewer(request), path=request.url.path)
    return HTMLResponse(html, status_code=status)


def not_found(request: Request, what: str, ident: str) -> Response:
    """The same 404 for no such thing and another tenant's (``ownership``)."""
    message = f"no {what} {ident!r}"
    if wants_json(request):
        return Response(orjson.dumps({"error": {"message": message, "type": "not_found"}}),
                        status_code=404, media_type="application/json")
    return page(request, "missing.html", {"message": message}, status=404)


def back_to(url: str) -> Response:
    """After a form's POST: the page to show, by GET (a reload posts nothing)."""
    return RedirectResponse(url, status_code=303)
