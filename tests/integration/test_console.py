"""The console's answers without a browser, against a real redis-server: the
sign-in, who sees what (a tenant its own, an admin every tenant's), the JSON
of each page, and the forms' guards. tests/console drives it in Chromium
with a worker running."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
from click.testing import CliRunner
from fastapi.testclient import TestClient

from tokenfleet import FleetClient
from tokenfleet.cli.app import main as cli
from tokenfleet.client.batch_records import create_batch
from tokenfleet.gateway.app import create_app
from tokenfleet.gateway.auth import CONSOLE_COOKIE
from tokenfleet.shared.redis.clock import redis_now
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire import fleet_history
from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.wire.keys import Keys, level_queue
from tokenfleet.shared.wire.schemas import ApiKey

from gateway_server import pin_live_worker
from helpers import redis_client

pytestmark = pytest.mark.timeout(60)

JSON = {"Accept": "application/json"}
IDLE = "idle"  # a queue a live worker seems to serve but never reads: its jobs stay queued


@pytest.fixture(scope="module")
def console(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A gateway that asks for keys, three keys (two tenants and an admin), and
    one queued job and one batch of each tenant."""
    files = tmp_path_factory.mktemp("files")
    settings = Settings(redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}",
                        files_url=f"file://{files}", gateway_auth="on", gateway_webhooks=False)
    r = redis_client(redis_url)
    keys = Keys(settings.namespace)
    pin_live_worker(r, settings.namespace, IDLE)
    # What the idle queue's worker's heartbeat would add: the console finds
    # the queues the last 15 minutes' workers served by their samples.
    pipe = r.pipeline(transaction=False)
    fleet_history.add(pipe, keys, worker="w@idle", queue=IDLE, tokens_per_s=0.0, running=0,
                      waiting=0, backlog_tokens=0, now=redis_now(r))
    pipe.execute()
    made = {}
    for tenant, admin in (("acme", False), ("globex", False), ("ops", True)):
        key, key_id = new_key()
        create_key(r, keys, ApiKey(key_id=key_id, tenant=tenant, admin=admin,
                                   created_at=time.time()), key)
        made[tenant] = key
    jobs, batches = {}, {}
    with FleetClient(settings=settings) as fleet:
        for tenant in ("acme", "globex"):
            jobs[tenant] = fleet.submit(f"{tenant}'s prompt", model=IDLE, tenant=tenant,
                                        max_new_tokens=4)
            batches[tenant] = asyncio.run(_batch_of(redis_url, keys, tenant))
    with TestClient(create_app(settings), base_url="http://console.test") as client:
        yield {"client": client, "keys": made, "jobs": jobs, "batches": batches, "r": r,
               "ns": keys}


async def _batch_of(redis_url: str, keys: Keys, tenant: str) -> str:
    r = aioredis.from_url(redis_url)
    try:
        batch = await create_batch(r, keys, input_file_id="file-x", endpoint="/v1/completions",
                                   completion_window="24h", metadata=None, tenant=tenant,
                                   queues=None, max_open=10)
    finally:
        await r.aclose()
    return batch.id


def signed_in(client: TestClient, key: str) -> TestClient:
    client.cookies.clear()
    answer = client.post("/console/login", data={"key": key}, follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/console"
    return client


def test_a_browser_without_a_key_is_sent_to_sign_in_and_a_script_is_told_401(
        console: dict[str, Any]) -> None:
    client: TestClient = console["client"]
    client.cookies.clear()
    page = client.get("/console/jobs", follow_redirects=False)
    assert page.status_code == 303 and page.headers["location"] == "/console/login"
    assert client.get("/console/jobs", headers=JSON).status_code == 401
    assert client.get("/console/login").status_code == 200
    wrong = client.post("/console/login", data={"key": "tfk_nope"}, follow_redirects=False)
    assert wrong.status_code == 401 and "does not exist" in wrong.text


def test_the_sign_in_cookie_holds_a_token_not_the_key_and_opens_the_console_only(
        console: dict[str, Any]) -> None:
    client: TestClient = console["client"]
    client.cookies.clear()
    key = console["keys"]["acme"]
    answer = client.post("/console/login", data={"key": key}, follow_redirects=False)
    cookie = answer.headers["set-cookie"]
    assert CONSOLE_COOKIE in cookie and "HttpOnly" in cookie
    assert "SameSite=strict" in cookie and "Path=/console" in cookie
    token = client.cookies[CONSOLE_COOKIE]
    assert key not in cookie and token not in key
    assert client.get("/console/jobs", headers=JSON).status_code == 200
    # The API does not take the cookie (nor the key in it): another site's page cannot drive it.
    for value in (token, key):
        api = client.get(f"/v1/jobs/{console['jobs']['acme']}", cookies={CONSOLE_COOKIE: value})
        assert api.status_code == 401
    # Signing out ends the sign-in on the server: a copy of the cookie no longer works.
    assert client.post("/console/logout", follow_redirects=False).status_code == 303
    stolen = client.get("/console/jobs", headers=JSON, cookies={CONSOLE_COOKIE: token})
    assert stolen.status_code == 401


def test_a_tenant_sees_its_own_job_and_batch_and_another_tenants_are_404(
        console: dict[str, Any]) -> None:
    client = signed_in(console["client"], console["keys"]["acme"])
    mine, theirs = console["jobs"]["acme"], console["jobs"]["globex"]
    assert client.get(f"/console/jobs/{mine}", headers=JSON).json()["job"]["id"] == mine
    for headers in ({}, JSON):
        assert client.get(f"/console/jobs/{theirs}", headers=headers).status_code == 404
        assert client.get(f"/console/batches/{console['batches']['globex']}",
                          headers=headers).status_code == 404
        assert client.get("/console/keys", headers=headers).status_code == 404
    listed = client.get("/console/jobs", headers=JSON).json()["jobs"]
    assert [j["id"] for j in listed] == [mine]
    # Another tenant's job cannot be searched for by id either.
    assert client.get(f"/console/jobs?id={theirs}", headers=JSON).json()["jobs"] == []
    batches = client.get("/console/batches", headers=JSON).json()["batches"]
    assert [b["id"] for b in batches] == [console["batches"]["acme"]]


def test_an_admin_sees_every_tenant_and_the_keys_without_their_secrets(
        console: dict[str, Any]) -> None:
    client = signed_in(console["client"], console["keys"]["ops"])
    listed = {j["id"]: j["tenant"] for j in client.get("/console/jobs", headers=JSON).json()["jobs"]}
    assert listed == {console["jobs"]["acme"]: "acme", console["jobs"]["globex"]: "globex"}
    only = client.get("/console/jobs?tenant=globex", headers=JSON).json()["jobs"]
    assert [j["id"] for j in only] == [console["jobs"]["globex"]]
    batches = {b["id"] for b in client.get("/console/batches", headers=JSON).json()["batches"]}
    assert batches == set(console["batches"].values())
    answer = client.get("/console/keys", headers=JSON)
    assert sorted(k["tenant"] for k in answer.json()["keys"]) == ["acme", "globex", "ops"]
    # The admin's own key was just used (its sign-in's requests): its last use is written.
    used = {k["tenant"]: k["last_used_at"] for k in answer.json()["keys"]}
    assert used["ops"] is not None and used["ops"] > time.time() - 60
    for page in ("/console", "/console/jobs", "/console/batches", "/console/keys",
                 "/console/dead-letters", "/console/webhooks", "/console/files"):
        for headers in ({}, JSON):
            body = client.get(page, headers=headers).text
            assert not any(key in body for key in console["keys"].values()), page


def test_keys_create_admin_makes_a_key_that_opens_every_tenants_pages(
        console: dict[str, Any]) -> None:
    namespace = console["ns"].namespace
    env = {"TOKENFLEET_REDIS_URL": console["client"].app.state.fleet.settings.redis_url,
           "TOKENFLEET_NAMESPACE": namespace}
    made = CliRunner().invoke(cli, ["keys", "create", "--tenant", "oncall", "--admin"], env=env)
    assert made.exit_code == 0, made.output
    assert "admin" in made.output.splitlines()[0]
    client = signed_in(console["client"], made.output.strip().splitlines()[-1])
    theirs = console["jobs"]["globex"]
    assert client.get(f"/console/jobs/{theirs}", headers=JSON).json()["job"]["tenant"] == "globex"
    assert client.get("/console/keys", headers=JSON).status_code == 200
    listed = CliRunner().invoke(cli, ["keys", "list"], env=env)
    assert "admin" in next(line for line in listed.output.splitlines() if "oncall" in line)


def test_the_fleet_page_shows_the_queues_and_the_15_minutes_lines(
        console: dict[str, Any]) -> None:
    r, keys = console["r"], console["ns"]
    now = redis_now(r)
    pipe = r.pipeline(transaction=False)
    fleet_history.add(pipe, keys, worker="w@lines", queue=IDLE, tokens_per_s=123.0,
                      running=3, waiting=1, backlog_tokens=456, now=now)
    pipe.execute()
    client = signed_in(console["client"], console["keys"]["ops"])
    report = client.get("/console", headers=JSON).json()
    assert IDLE in [q["queue"] for q in report["queues"]]
    assert len(report["history"]) == fleet_history.POINTS
    assert report["history"][-1] == {**report["history"][-1], "tokens_per_s": 123.0,
                                     "backlog_tokens": 456}
    html = client.get("/console").text
    assert f'data-queue="{IDLE}"' in html and "<polyline" in html


def test_the_keys_page_shows_each_tenants_share_of_the_last_hours_tokens(
        console: dict[str, Any]) -> None:
    r, keys = console["r"], console["ns"]
    # A worker's counters since it started: only what it served within the hour counts.
    for counts in ({"acme": 1000}, {"acme": 1300, "globex": 100}):
        pipe = r.pipeline(transaction=False)
        fleet_history.add(pipe, keys, worker="w@shares", queue=IDLE, tokens_per_s=1.0,
                          running=0, waiting=0, backlog_tokens=0, now=redis_now(r),
                          tenant_tokens=counts)
        pipe.execute()
    client = signed_in(console["client"], console["keys"]["ops"])
    served = client.get("/console/keys", headers=JSON).json()["tokens_last_hour"]
    assert served == {"acme": {"tokens": 300, "share": 0.75},
                      "globex": {"tokens": 100, "share": 0.25}}


def test_a_form_posted_from_another_site_is_refused_and_changes_nothing(
        console: dict[str, Any]) -> None:
    client = signed_in(console["client"], console["keys"]["acme"])
    job_id = console["jobs"]["acme"]
    refused = client.post(f"/console/jobs/{job_id}/cancel",
                          headers={"Origin": "http://evil.example"}, follow_redirects=False)
    assert refused.status_code == 403
    assert client.get(f"/console/jobs/{job_id}", headers=JSON).json()["job"]["status"] == "queued"


def test_a_dead_letter_shows_its_reason_to_its_tenant_and_runs_again(
        console: dict[str, Any]) -> None:
    r, keys = console["r"], console["ns"]
    job_id = console["jobs"]["globex"]
    entry = next(fields[b"data"].decode() for _, fields in r.xrange(keys.queue(level_queue(IDLE, "normal", "globex")))
                 if orjson.loads(fields[b"data"])["job_id"] == job_id)
    record = {"reason": "failed past its retries: the engine raised", "queue": IDLE,
              "entry_id": "1-0", "worker": "w@x", "at": time.time(), "entry": {"data": entry}}
    r.xadd(keys.dlq(IDLE), {"data": orjson.dumps(record)})
    r.xadd(keys.dlq(IDLE), {"data": orjson.dumps({"reason": "not JSON: b'\\xff'", "queue": IDLE,
                                                    "entry": {"x": "\\xff"}, "at": time.time()})})
    client = signed_in(console["client"], console["keys"]["globex"])
    letters = client.get("/console/dead-letters", headers=JSON).json()["dead_letters"]
    assert [d["reason"] for d in letters] == ["failed past its retries: the engine raised"]
    assert letters[0]["retryable"] and letters[0]["job_id"] == job_id
    again = client.post(f"/console/dead-letters/{IDLE}/{letters[0]['id']}/retry", headers=JSON)
    assert again.status_code == 200
    new_id = again.json()["id"]
    job = client.get(f"/console/jobs/{new_id}", headers=JSON).json()["job"]
    assert job["tenant"] == "globex" and job["status"] == "queued"
    # The hostile entry names no tenant's job: only an admin sees it, and it cannot run.
    admin = signed_in(console["client"], console["keys"]["ops"])
    reasons = {d["reason"]: d["retryable"] for d in
               admin.get("/console/dead-letters", headers=JSON).json()["dead_letters"]}
    assert reasons["not JSON: b'\\xff'"] is False

