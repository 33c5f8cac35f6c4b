"""The console's routes, under ``/console``: a page (and its JSON) per view,
and the few forms a page posts (sign in, cancel, retry).

Each page reads through ``console/reads.py``, bounded by the rows it shows.
A form's POST answers 303 to the page to show next, so a reload posts
nothing twice; a POST from another site's page is refused (its ``Origin``
is not this gateway's, and the sign-in cookie is ``SameSite=Strict``).
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any, cast
from urllib.parse import parse_qs, quote

import orjson
from fastapi import APIRouter, Header, Request
from fastapi.responses import Response

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.client.batch_records import BatchRecord, cancel_batch, read_record
from tokenfleet.gateway.console import reads
from tokenfleet.gateway.console.access import viewer
from tokenfleet.gateway.console.pages import back_to, not_found, page, wants_json
from tokenfleet.gateway import sse
from tokenfleet.gateway.auth import CONSOLE, CONSOLE_COOKIE
from tokenfleet.gateway.files import file_content
from tokenfleet.gateway.job_events import job_event_frames
from tokenfleet.gateway.request_body import keepalive_s
from tokenfleet.shared.file_store import store_for
from tokenfleet.shared.wire.api_keys import close_sign_in, list_keys_async, open_sign_in
from tokenfleet.shared.wire.keys import DEFAULT_TENANT
from tokenfleet.shared.wire.schemas import JobStatus, QueueEntry
from tokenfleet.webhooks.resend import resend_async

router = APIRouter(prefix=CONSOLE, include_in_schema=False)

# How long a sign-in lasts in the browser (the key itself may be revoked sooner:
# every request looks it up again).
SIGN_IN_S = 12 * 3600
STATIC = {"console.css": "text/css", "console.js": "text/javascript"}
JOB_STATES = tuple(s.value for s in JobStatus)


def _aio(request: Request) -> AsyncFleetClient:
    return cast(AsyncFleetClient, request.app.state.fleet)


def _refused_origin(request: Request) -> Response | None:
    """A 403 for a form posted from another origin; None for this gateway's."""
    origin = request.headers.get("origin")
    if origin is None:  # not a browser's form (a script's request, with its key)
        return None
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin != own:
        return Response("a console form is posted from the console's own pages only",
                        status_code=403, media_type="text/plain")
    return None


async def _form(request: Request) -> dict[str, str]:
    """An urlencoded form's fields (the first value of each)."""
    fields = parse_qs((await request.body()).decode("utf-8", "replace"))
    return {name: values[0] for name, values in fields.items()}


@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in STATIC:
        return Response(status_code=404)
    body = resources.files("tokenfleet.gateway.console").joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC[name],
                    headers={"Cache-Control": "public, max-age=300"})


@router.get("/login")
async def login_form(request: Request) -> Response:
    return page(request, "login.html", {"error": None})


@router.post("/login")
async def login(request: Request) -> Response:
    refused = _refused_origin(request)
    if refused is not None:
        return refused
    key = (await _form(request)).get("key", "").strip()
    record = await request.app.state.keybook.lookup(key) if key else None
    if record is None:
        return page(request, "login.html",
                    {"error": "that key does not exist or was revoked"}, status=401)
    aio = _aio(request)
    writing, token = open_sign_in(aio.redis, aio.keys, key, SIGN_IN_S)
    await writing
    answer = back_to(CONSOLE)
    answer.set_cookie(CONSOLE_COOKIE, token, max_age=SIGN_IN_S, path=CONSOLE, httponly=True,
                      samesite="strict", secure=_https(request))
    return answer


def _https(request: Request) -> bool:
    """Whether the browser reached the console over TLS: on the gateway, or on
    a proxy in front that says so (the cookie is then sent over TLS only)."""
    return (request.url.scheme == "https"
            or request.headers.get("x-forwarded-proto", "").lower() == "https")


@router.post("/logout")
async def logout(request: Request) -> Response:
    token = request.cookies.get(CONSOLE_COOKIE)
    if token:  # the sign-in ends on the server, not only in this browser
        aio = _aio(request)
        await close_sign_in(aio.redis, aio.keys, token)
    answer = back_to(f"{CONSOLE}/login")
    answer.delete_cookie(CONSOLE_COOKIE, path=CONSOLE)
    return answer


@router.get("")
async def fleet(request: Request) -> Response:
    aio, who = _aio(request), viewer(request)
    report = await reads.fleet(aio, request.app.state.console_reads, aio.clock.now())
    if who.tenant is not None:  # a tenant sees its own share of each queue only
        for q in report["queues"]:
            q["tenants"] = {t: n for t, n in q["tenants"].items() if t == who.tenant}
    return page(request, "fleet.html", report, spark=_spark)


@router.get("/jobs")
async def jobs(request: Request, id: str | None = None, tenant: str | None = None,
               state: str | None = None) -> Response:
    aio, who = _aio(request), viewer(request)
    if id:
        found = await reads.job(aio, id.strip(), who.tenant)
        listed = [found] if found is not None else []
    else:
        parts, _, _ = await reads.queues(aio, aio.clock.now())
        listed = await reads.jobs(aio, parts, who.tenant, state=state or None,
                                  of_tenant=tenant or None)
    return page(request, "jobs.html",
                {"jobs": [j.model_dump(mode="json", exclude={"token_ids"}) for j in listed],
                 "query": {"id": id or "", "tenant": tenant or "", "state": state or ""}},
                states=JOB_STATES)


@router.get("/jobs/{job_id:path}/events")
async def job_events(job_id: str, request: Request, after: int = -1,
                     last_event_id: str | None = Header(default=None)) -> Response:
    """The job's token events after the token of index ``after`` (what its
    page showed when it was served), or after ``Last-Event-ID`` (the
    browser's own resume, once connected)."""
    aio = _aio(request)
    if await reads.job(aio, job_id, viewer(request).tenant) is None:
        return not_found(request, "job", job_id)
    if last_event_id and last_event_id.isdigit():
        after = int(last_event_id)
    return sse.response(job_event_frames(aio, job_id, after, request.scope),
                        keepalive_s(request))


@router.post("/jobs/{job_id:path}/cancel")
async def cancel_job(job_id: str, request: Request) -> Response:
    refused = _refused_origin(request)
    if refused is not None:
        return refused
    aio = _aio(request)
    if await reads.job(aio, job_id, viewer(request).tenant) is None:
        return not_found(request, "job", job_id)
    cancelled = await aio.cancel(job_id)
    if wants_json(request):
        return Response(orjson.dumps({"id": job_id, "cancelled": cancelled}),
                        media_type="application/json")
    return back_to(f"{CONSOLE}/jobs/{quote(job_id, safe=':')}")


@router.get("/jobs/{job_id:path}")
async def job(job_id: str, request: Request) -> Response:
    aio = _aio(request)
    state = await reads.job(aio, job_id, viewer(request).tenant)
    if state is None:
        return not_found(request, "job", job_id)
    text, tokens = ((state.text, len(state.token_ids)) if state.status.is_terminal
                    else await reads.text_so_far(aio, job_id))
    return page(request, "job.html",
                {"job": state.model_dump(mode="json", exclude={"token_ids"}), "text": text,
                 "tokens": tokens, "terminal": state.status.is_terminal},
                when=_when, took=_took)


@router.get("/batches")
async def batches(request: Request) -> Response:
    aio = _aio(request)
    found = await reads.batches(aio, viewer(request).tenant)
    now = time.time()
    return page(request, "batches.html",
                {"batches": [_batch_view(b, now) for b in found]},
                when=_when)


@router.get("/batches/{batch_id}")
async def batch(batch_id: str, request: Request) -> Response:
    aio = _aio(request)
    found = await reads.batch(aio, batch_id, viewer(request).tenant)
    if found is None:
        return not_found(request, "batch", batch_id)
    return page(request, "batch.html",
                {"batch": _batch_view(found, time.time()), "ended": found.batch.is_ended},
                when=_when)


@router.post("/batches/{batch_id}/cancel")
async def cancel_a_batch(batch_id: str, request: Request) -> Response:
    refused = _refused_origin(request)
    if refused is not None:
        return refused
    aio = _aio(request)
    record = await read_record(aio.redis, aio.keys, batch_id)
    tenant = viewer(request).tenant
    if record is None or (tenant is not None and record.tenant != tenant):
        return not_found(request, "batch", batch_id)
    await cancel_batch(aio.redis, aio.keys, batch_id, record.tenant)
    driver = getattr(request.app.state, "batch_driver", None)
    if driver is not None:
        driver.wake()
    return back_to(f"{CONSOLE}/batches/{quote(batch_id)}")


def _batch_view(record: BatchRecord, now: float) -> dict[str, Any]:
    """OpenAI's batch object, with what a progress bar shows: lines done
    (completed or failed) of the total, the tokens its lines made and their
    rate, and at the rate so far the time left."""
    b = record.batch
    counts = b.request_counts
    done = counts.completed + counts.failed
    ended = b.completed_at or b.failed_at or b.cancelled_at or b.expired_at
    # The object's times are whole seconds: a batch that ended within the second
    # it started ran under one, and its rate is given over one (at least that).
    took = max(1.0, (ended or now) - b.in_progress_at) if b.in_progress_at else 0.0
    eta = None
    if took > 0 and 0 < done < counts.total and not b.is_ended:
        eta = round((counts.total - done) / (done / took), 1)
    return {**b.model_dump(mode="json"), "done": done, "eta_s": eta, "tokens": record.tokens,
            "tokens_per_s": round(record.tokens / took, 1) if took > 0 else None}


@router.get("/files")
async def files(request: Request) -> Response:
    found = await reads.file_list(_aio(request), viewer(request).tenant)
    return page(request, "files.html", {"files": [f.model_dump() for f in found]}, when=_when)


@router.get("/files/{file_id}/content")
async def file_download(file_id: str, request: Request) -> Response:
    aio = _aio(request)
    found = await reads.file(aio, file_id, viewer(request).tenant)
    answer = None if found is None else await file_content(
        store_for(aio.settings.files_url), found)
    return not_found(request, "file", file_id) if answer is None else answer


@router.get("/dead-letters")
async def dead_letters(request: Request) -> Response:
    aio = _aio(request)
    parts, _, _ = await reads.queues(aio, aio.clock.now())
    letters = await reads.dead_letters(aio, parts, viewer(request).tenant)
    return page(request, "dead_letters.html", {"dead_letters": letters}, when=_when)


@router.post("/dead-letters/{queue}/{entry_id}/retry")
async def retry_dead_letter(queue: str, entry_id: str, request: Request) -> Response:
    """Submit a dead letter's request again, as a new job (the dead letter
    stays: it is the record of what failed)."""
    refused = _refused_origin(request)
    if refused is not None:
        return refused
    aio, tenant = _aio(request), viewer(request).tenant
    found = await aio.redis.xrange(aio.keys.dlq(queue), entry_id, entry_id)
    letter = reads.letter_of(queue, entry_id, found[0][1]) if found else None
    if letter is None or not letter["retryable"] or (
            tenant is not None and letter["tenant"] != tenant):
        return not_found(request, "dead letter that can run again", entry_id)
    entry = QueueEntry.model_validate_json(letter["entry"])
    job_id = await aio.submit(entry.request)
    if wants_json(request):
        return Response(orjson.dumps({"id": job_id}), media_type="application/json")
    return back_to(f"{CONSOLE}/jobs/{quote(job_id, safe=':')}")


@router.get("/webhooks")
async def webhooks(request: Request) -> Response:
    dead = await reads.webhook_dead(_aio(request), viewer(request).tenant)
    return page(request, "webhooks.html", {"dead": dead})


@router.post("/webhooks/{stream}/{entry_id}/retry")
async def retry_webhook(stream: str, entry_id: str, request: Request) -> Response:
    refused = _refused_origin(request)
    if refused is not None:
        return refused
    aio, tenant = _aio(request), viewer(request).tenant
    keys = aio.keys
    own = (keys.webhook_dead if tenant in (None, DEFAULT_TENANT)
           else keys.webhook_dead_of(tenant))
    # A tenant sends its own dead list's events again; one who sees all, any list's.
    allowed = stream == own or (tenant is None and stream.startswith(keys.webhook_dead))
    if not allowed or not await resend_async(aio.redis, keys, stream, entry_id):
        return not_found(request, "webhook dead letter", entry_id)
    return back_to(f"{CONSOLE}/webhooks")


@router.get("/keys")
async def keys(request: Request) -> Response:
    if not viewer(request).admin:
        return not_found(request, "page", request.url.path)
    aio = _aio(request)
    found = await list_keys_async(aio.redis, aio.keys)
    used = {k.decode(): float(v) for k, v in (await aio.redis.hgetall(aio.keys.api_keys_used)).items()}
    served = await reads.tenant_tokens(aio, aio.clock.now())
    total = sum(served.values()) or 1
    return page(request, "keys.html",
                {"keys": [{**k.model_dump(), "last_used_at": used.get(k.key_id)} for k in found],
                 "refusals": await reads.tenant_refusals(aio),
                 "tokens_last_hour": {t: {"tokens": n, "share": round(n / total, 4)}
                                      for t, n in sorted(served.items())}}, when=_when)


def _when(t: float | None) -> str:
    return "" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _took(start: float | None, end: float | None) -> str:
    return "" if start is None or end is None else f"{end - start:.3f} s"


def _spark(values: list[float], width: int = 240, height: int = 36) -> str:
    """An SVG polyline's points for ``values`` (drawn on the server: no script)."""
    top = max(values, default=0.0) or 1.0
    step = width / max(1, len(values) - 1)
    return " ".join(f"{i * step:.1f},{height - v / top * (height - 2) - 1:.1f}"
                    for i, v in enumerate(values))
