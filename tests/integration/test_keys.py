"""API keys, tenants and their limits at the gateway, against a real redis-server,
real gateways (two, sharing one Redis) and a worker on the tiny model."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from click.testing import CliRunner

from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import ApiKey
from tokenfleet.shared.settings import Settings
from tokenfleet.cli.app import main as cli

from gateway_server import gateways, pin_live_worker
from helpers import RedisServer, redis_client, wait_until

pytestmark = pytest.mark.timeout(120)

IDLE = "idle"  # a queue a live worker seems to serve but never reads: its jobs stay queued


@pytest.fixture(scope="module")
def fleet(redis_url: str, loaded_tiny: tuple[Any, Any]) -> Iterator[dict[str, Any]]:
    """One namespace for the module: a tiny worker on 'default', the idle queue,
    two gateways and a key maker."""
    from tokenfleet.workers.build import hf_engine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.service import Worker

    settings = Settings(queue="default", redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}",
                        block_ms=20, heartbeat_s=0.5, max_batch=8, max_batch_tokens=65_536,
                        prefetch=4)
    r = redis_client(redis_url)
    keys = Keys(settings.namespace)
    pin_live_worker(r, settings.namespace, IDLE)
    model, tokenizer = loaded_tiny
    runner = HFRunner(model, tokenizer)
    worker = Worker(settings, hf_engine(settings, runner, runner.eos_token_ids,
                                        runner.max_model_len), tokenizer, name="w@keys")
    worker.start()
    wait_until(lambda: r.zscore(keys.queue_workers("default"), "w@keys") is not None,
               timeout=30, what="the worker's first heartbeat")

    def make_key(tenant: str = "acme", **limits: Any) -> tuple[str, ApiKey]:
        key, key_id = new_key()
        record = ApiKey(key_id=key_id, tenant=tenant, created_at=time.time(), **limits)
        create_key(r, keys, record, key)
        return key, record

    with gateways(settings) as start:
        make_key("bootstrap")  # keys exist: the gateways ask for them (auth auto)
        yield {"settings": settings, "r": r, "keys": keys, "make_key": make_key,
               "one": start(), "two": start(), "start": start}
    worker.stop(grace_s=0)
    r.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def submit(http: httpx.Client, key: str, queue: str = IDLE, **body: Any) -> httpx.Response:
    return http.post("/v1/jobs", headers=bearer(key),
                     json={"prompt": "hello", "model": queue, **body})


ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/default"), ("POST", "/v1/jobs"),
          ("GET", "/v1/jobs/default:00"), ("DELETE", "/v1/jobs/default:00"),
          ("GET", "/v1/jobs/default:00/events"), ("POST", "/v1/completions"),
          ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
          ("GET", "/v1/responses/resp_00"), ("DELETE", "/v1/responses/resp_00"),
          ("POST", "/v1/responses/resp_00/cancel"), ("GET", "/v1/responses/resp_00/input_items")]


def test_every_route_but_health_refuses_a_request_without_a_valid_key(fleet: Any) -> None:
    http = fleet["one"]
    for method, path in ROUTES:
        for headers in ({}, bearer("tfk_000000000000_not-a-key"), {"Authorization": "Basic x"}):
            response = http.request(method, path, headers=headers, json={})
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            if path.startswith("/v1/jobs"):
                assert "API key" in response.json()["detail"]
            else:  # OpenAI's shape, as its clients read it
                assert response.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/healthz").status_code == 200


def test_a_revoked_key_fails_within_a_second_on_both_gateways(fleet: Any) -> None:
    key, record = fleet["make_key"]("acme")
    gateways_ = (fleet["one"], fleet["two"])
    for http in gateways_:  # each has read (and keeps) the key
        assert http.get("/v1/models", headers=bearer(key)).status_code == 200
    env = {"TOKENFLEET_REDIS_URL": fleet["settings"].redis_url,
           "TOKENFLEET_NAMESPACE": fleet["settings"].namespace}
    result = CliRunner().invoke(cli, ["keys", "revoke", record.key_id], env=env)
    assert result.exit_code == 0, result.output
    revoked_at = time.monotonic()
    # The bound under test, not a wait for an event: any request sent a second
    # after the revoke is refused, though both gateways had just read the key.
    time.sleep(max(0.0, revoked_at + 1.0 - time.monotonic()))
    for http in gateways_:
        assert http.get("/v1/models", headers=bearer(key)).status_code == 401


def test_keys_cli_prints_the_key_once_and_lists_no_secret(fleet: Any) -> None:
    env = {"TOKENFLEET_REDIS_URL": fleet["settings"].redis_url,
           "TOKENFLEET_NAMESPACE": fleet["settings"].namespace}
    made = CliRunner().invoke(cli, ["keys", "create", "--tenant", "cli-team", "--rpm", "7",
                                    "--queues", "default"], env=env)
    assert made.exit_code == 0, made.output
    key = made.output.strip().splitlines()[-1]
    assert key.startswith("tfk_")
    listed = CliRunner().invoke(cli, ["keys", "list"], env=env)
    assert "cli-team" in listed.output and "rpm 7" in listed.output
    assert key not in listed.output and key.split("_", 2)[2] not in listed.output
    assert fleet["one"].get("/v1/models", headers=bearer(key)).status_code == 200


def test_another_tenant_gets_404_reading_streaming_or_cancelling_a_job(fleet: Any) -> None:
    key_a, _ = fleet["make_key"]("team-a")
    key_b, _ = fleet["make_key"]("team-b")
    http = fleet["one"]
    job_id = submit(http, key_a).json()["id"]
    mine = http.get(f"/v1/jobs/{job_id}", headers=bearer(key_a))
    assert mine.status_code == 200 and mine.json()["tenant"] == "team-a"
    never = f"{IDLE}:{uuid.uuid4().hex}"
    for method, path in (("GET", "/v1/jobs/{}"), ("GET", "/v1/jobs/{}/events"),
                         ("DELETE", "/v1/jobs/{}")):
        theirs = http.request(method, path.format(job_id), headers=bearer(key_b))
        missing = http.request(method, path.format(never), headers=bearer(key_b))
        assert theirs.status_code == missing.status_code == 404, (method, path)
        # Told exactly what an id never made is told: the id is not confirmed.
        assert theirs.json()["detail"] == missing.json()["detail"].replace(never, job_id)
    assert http.get(f"/v1/jobs/{job_id}", headers=bearer(key_a)).json()["status"] == "queued"
    # A body may not name another tenant than its key's.
    other = submit(http, key_a, tenant="team-b")
    assert other.status_code == 400 and "tenant" in other.text


def test_another_tenant_gets_404_on_every_route_of_a_response(fleet: Any) -> None:
    key_a, _ = fleet["make_key"]("team-a")
    key_b, _ = fleet["make_key"]("team-b")
    http = fleet["one"]
    made = http.post("/v1/responses", headers=bearer(key_a),
                     json={"model": IDLE, "input": "hello", "background": True})
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    never = f"resp_{uuid.uuid4().hex}"
    for method, path, params in (("GET", "/v1/responses/{}", {}),
                                 ("GET", "/v1/responses/{}", {"stream": "true"}),
                                 ("GET", "/v1/responses/{}/input_items", {}),
                                 ("POST", "/v1/responses/{}/cancel", {}),
                                 ("DELETE", "/v1/responses/{}", {})):
        theirs = http.request(method, path.format(rid), headers=bearer(key_b), params=params)
        missing = http.request(method, path.format(never), headers=bearer(key_b), params=params)
        assert theirs.status_code == missing.status_code == 404, (method, path)
        # Told exactly what an id never made is told: the id is not confirmed.
        assert theirs.json() == json.loads(missing.text.replace(never, rid))
    continued = http.post("/v1/responses", headers=bearer(key_b),
                          json={"model": IDLE, "input": "more", "previous_response_id": rid})
    assert continued.status_code == 404
    assert continued.json()["error"]["param"] == "previous_response_id"
    assert http.get(f"/v1/responses/{rid}", headers=bearer(key_a)).json()["status"] == "queued"
    assert http.delete(f"/v1/responses/{rid}", headers=bearer(key_a)).json()["deleted"] is True


def test_at_rpm_60_the_61st_request_is_429_and_two_gateways_share_the_budget(
        fleet: Any) -> None:
    key, _ = fleet["make_key"]("busy", rpm=60)
    remaining = []
    for i in range(60):  # alternate: one budget in Redis, whichever gateway counts
        response = submit(fleet["one"] if i % 2 else fleet["two"], key)
        assert response.status_code == 202, response.text
        assert response.headers["x-ratelimit-limit-requests"] == "60"
        remaining.append(int(response.headers["x-ratelimit-remaining-requests"]))
    assert remaining == list(range(59, -1, -1))  # they count down as OpenAI's do
    for http in (fleet["one"], fleet["two"]):
        refused = submit(http, key)
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
        assert "rpm" in refused.json()["detail"]
    # A read is not counted, and says where the key stands.
    peek = fleet["one"].get("/v1/models", headers=bearer(key))
    assert peek.status_code == 200 and peek.headers["x-ratelimit-remaining-requests"] == "0"


def test_n_above_the_keys_rpm_is_refused_for_good_and_queues_nothing(fleet: Any) -> None:
    key, _ = fleet["make_key"]("many", rpm=2)
    http = fleet["one"]
    refused = http.post("/v1/completions", headers=bearer(key),
                        json={"model": IDLE, "prompt": "hi", "max_tokens": 2, "n": 3})
    assert refused.status_code == 400, refused.text
    assert refused.headers["x-should-retry"] == "false"
    message = refused.json()["error"]["message"]
    assert "'n'" in message and "3" in message and "rpm of 2" in message
    # Nothing counted, so nothing queued: each choice is counted before it is queued.
    peek = http.get("/v1/models", headers=bearer(key))
    assert peek.headers["x-ratelimit-remaining-requests"] == "2"


def test_tokens_are_charged_at_admission_and_corrected_at_the_end(fleet: Any) -> None:
    key, _ = fleet["make_key"]("tokens", tpm=1000)
    http = fleet["one"]
    done = http.post("/v1/completions", headers=bearer(key),
                     json={"model": "default", "prompt": "abcdefgh", "max_tokens": 40,
                           "temperature": 0, "stop": ["e"]})
    assert done.status_code == 200, done.text
    # Charged: the prompt's 5 tokens (counted by the tiny model's tokenizer,
    # which this gateway has) + 40 new ones.
    assert done.headers["x-ratelimit-remaining-tokens"] == str(1000 - 45)
    used = done.json()["usage"]["total_tokens"]

    def corrected() -> bool:
        headers = http.get("/v1/models", headers=bearer(key)).headers
        return headers["x-ratelimit-remaining-tokens"] == str(1000 - used)
    wait_until(corrected, timeout=10, what="the charge to be corrected to the tokens used")
    too_big = http.post("/v1/completions", headers=bearer(key),
                        json={"model": "default", "prompt": "hi", "max_tokens": 1000})
    assert too_big.status_code == 429 and too_big.headers["x-should-retry"] == "false"
    assert "tpm" in too_big.json()["error"]["message"]


@pytest.mark.slow
def test_prompts_of_many_tokens_a_byte_stay_within_tpm(fleet: Any) -> None:
    """An emoji is 4 bytes and 4 tokens of the tiny model: a charge of 4 bytes a
    token let 16 such requests through a tpm of 4,000 (14,432 tokens used)."""
    key, _ = fleet["make_key"]("emoji", tpm=4000)
    prompt = "\U0001f600" * 225  # 900 bytes, 901 tokens with the BOS
    # All 16 are admitted or refused at once, within one window of the limit.
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: fleet["one"].post(
            "/v1/completions", headers=bearer(key),
            json={"model": "default", "prompt": prompt, "max_tokens": 8}), range(16)))
    used = [a.json()["usage"]["total_tokens"] for a in answers if a.status_code == 200]
    assert all(a.status_code in (200, 429) for a in answers), [a.text for a in answers]
    assert used and min(used) >= 901
    assert sum(used) <= 4000 + max(used), used  # the bound, one request's worth over at most
    # What the refused were told: when to retry, not that they can never pass.
    refused = [a for a in answers if a.status_code == 429]
    assert refused and all(a.headers["x-should-retry"] != "false" for a in refused)


def test_a_prompt_no_tokenizer_here_counts_is_charged_a_token_a_byte(fleet: Any) -> None:
    key, _ = fleet["make_key"]("bytes", tpm=5000)  # IDLE's worker loads no model here
    admitted = submit(fleet["one"], key, prompt="\U0001f600" * 225,
                      sampling={"max_new_tokens": 10})
    assert admitted.status_code == 202, admitted.text
    charged = 5000 - int(admitted.headers["x-ratelimit-remaining-tokens"])
    assert charged >= 901 + 10  # never under the tokens it will be


def test_max_queued_caps_a_tenants_waiting_jobs(fleet: Any) -> None:
    key, _ = fleet["make_key"]("capped", max_queued=2)
    http = fleet["one"]
    first = submit(http, key).json()["id"]
    assert submit(http, key).status_code == 202
    refused = submit(http, key)
    assert refused.status_code == 429 and "max_queued 2" in refused.json()["detail"]
    assert http.delete(f"/v1/jobs/{first}", headers=bearer(key)).status_code == 200
    again = submit(http, key)
    assert again.status_code == 202, again.text  # an ended job frees its place


def test_a_key_uses_only_its_queues(fleet: Any) -> None:
    key, _ = fleet["make_key"]("narrow", queues=["default"])
    refused = fleet["one"].post("/v1/completions", headers=bearer(key),
                                json={"model": IDLE, "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "model_not_allowed"
    assert refused.json()["error"]["param"] == "model"


def test_a_priority_above_the_keys_max_is_refused_by_name(fleet: Any) -> None:
    plain, _ = fleet["make_key"]("plain")  # the default: normal at most
    low, _ = fleet["make_key"]("slow-lane", max_priority="low")
    http = fleet["one"]
    for key, priority, allowed in ((plain, "high", "normal"), (low, "normal", "low")):
        refused = submit(http, key, priority=priority)
        assert refused.status_code == 403, refused.text
        assert refused.headers["x-should-retry"] == "false"
        assert f"max priority: '{allowed}'" in refused.json()["detail"]
        assert submit(http, key, priority=allowed).status_code == 202
        assert submit(http, key, priority="batch").status_code == 202  # lower: always
    env = {"TOKENFLEET_REDIS_URL": fleet["settings"].redis_url,
           "TOKENFLEET_NAMESPACE": fleet["settings"].namespace}
    made = CliRunner().invoke(cli, ["keys", "create", "--tenant", "urgent", "--max-priority",
                                    "high"], env=env)
    assert made.exit_code == 0 and "max-priority high" in made.output, made.output
    urgent = made.output.strip().splitlines()[-1]
    assert submit(http, urgent, priority="high").status_code == 202


def test_the_openai_client_works_with_a_key_and_raises_rate_limit_error(fleet: Any) -> None:
    key, _ = fleet["make_key"]("sdk", rpm=1)
    base = f"{fleet['one'].base_url}/v1"
    sdk = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
    done = sdk.completions.create(model="default", prompt="hi", max_tokens=3, temperature=0)
    assert done.choices[0].text is not None
    with pytest.raises(openai.RateLimitError) as caught:
        sdk.completions.create(model="default", prompt="hi", max_tokens=3)
    assert caught.value.response.headers["retry-after"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base, api_key="tfk_wrong", max_retries=0).models.list()


def test_no_key_reaches_redis_or_a_log_line(fleet: Any, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    caplog.set_level(logging.DEBUG)
    key, _ = fleet["make_key"]("quiet", rpm=100, tpm=10_000, max_queued=5)
    http = fleet["one"]
    job_id = submit(http, key).json()["id"]
    http.get(f"/v1/jobs/{job_id}", headers=bearer(key))
    http.post("/v1/completions", headers=bearer(key),
              json={"model": "default", "prompt": "x", "max_tokens": 2})
    http.get("/v1/models", headers=bearer(key + "x"))  # a wrong one
    secret = key.split("_", 2)[2]  # the key id is hex; the secret may hold "_"
    assert secret not in caplog.text
    r: redis.Redis = fleet["r"]
    for name in r.scan_iter(match=f"{fleet['settings'].namespace}:*", count=1000):
        assert secret.encode() not in name
        kind = r.type(name)
        if kind == b"string":
            assert secret.encode() not in (r.get(name) or b"")
        elif kind == b"hash":
            assert secret.encode() not in b"".join(
                k + v for k, v in r.hgetall(name).items())


def test_no_auth_serves_without_keys_and_says_so(fleet: Any,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tokenfleet.gateway.app")
    http = fleet["start"](gateway_auth="off")
    assert "API keys are off" in caplog.text
    assert http.get("/v1/models").status_code == 200


def test_a_fresh_install_serves_without_a_key_until_one_is_made(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tokenfleet.gateway.app")
    settings = Settings(redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}",
                        gateway_key_cache_s=0.2)
    with gateways(settings) as start:
        http = start()
        assert "no API key was ever made" in caplog.text
        assert http.get("/v1/models").status_code == 200
        r = redis_client(redis_url)
        key, key_id = new_key()
        create_key(r, Keys(settings.namespace),
                   ApiKey(key_id=key_id, tenant="first", created_at=time.time()), key)
        r.close()
        wait_until(lambda: http.get("/v1/models").status_code == 401, timeout=5,
                   what="the first key to close the open gateway")
        assert http.get("/v1/models", headers=bearer(key)).status_code == 200


def fresh_fleet(redis_url: str, **overrides: Any) -> tuple[Settings, dict[str, str]]:
    """A namespace of its own, no key ever made, the idle queue served; its
    settings (the auth mode unset) and the CLI's environment."""
    settings = Settings(redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}", **overrides)
    r = redis_client(redis_url)
    pin_live_worker(r, settings.namespace, IDLE)
    r.close()
    return settings, {"TOKENFLEET_REDIS_URL": redis_url,
                      "TOKENFLEET_NAMESPACE": settings.namespace}


def test_revoking_the_last_key_leaves_an_auto_gateway_closed(redis_url: str) -> None:
    settings, env = fresh_fleet(redis_url, gateway_key_cache_s=0.2)
    with gateways(settings) as start:
        http = start()  # loopback, the mode unset: auto
        made = CliRunner().invoke(cli, ["keys", "create", "--tenant", "leaky"], env=env)
        assert made.exit_code == 0, made.output
        key = made.output.strip().splitlines()[-1]
        job_id = submit(http, key).json()["id"]
        key_id = key.split("_")[1]
        revoked = CliRunner().invoke(cli, ["keys", "revoke", key_id], env=env)
        assert revoked.exit_code == 0, revoked.output
        wait_until(lambda: http.get("/v1/models", headers=bearer(key)).status_code == 401,
                   timeout=5, what="the revoked key to be refused")
        # No key is left, and still nothing passes: not the leaked key, not a
        # request without one, not a read of the jobs it made.
        time.sleep(settings.gateway_key_cache_s * 2)  # past every cached answer
        for headers in (bearer(key), {}):
            assert http.get("/v1/models", headers=headers).status_code == 401
            assert http.get(f"/v1/jobs/{job_id}", headers=headers).status_code == 401
            assert submit(http, key).status_code == 401
        # A gateway started now (a deploy) is closed too: the mark outlives the keys.
        assert start().get("/v1/models").status_code == 401


def test_after_redis_loses_its_data_running_gateways_and_on_gateways_stay_closed(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tokenfleet.gateway.app")
    server = RedisServer()  # its own: the test empties it
    try:
        settings = Settings(redis_url=server.url, namespace="wiped", gateway_key_cache_s=0.2)
        with gateways(settings) as start:
            auto, on = start(), start(gateway_auth="on")
            assert "serves everyone" in caplog.text  # said at start, while open
            r = redis_client(server.url)
            key, key_id = new_key()
            create_key(r, Keys(settings.namespace),
                       ApiKey(key_id=key_id, tenant="acme", created_at=time.time()), key)
            for http in (auto, on):
                wait_until(lambda: http.get("/v1/models").status_code == 401, timeout=5,
                           what="the first key to close the gateway")
            r.flushall()
            time.sleep(settings.gateway_key_cache_s * 2)
            for http in (auto, on, start(gateway_auth="on")):
                assert http.get("/v1/models").status_code == 401
                assert http.get("/v1/models", headers=bearer(key)).status_code == 401
            # What the setting is for: an auto gateway started after the wipe
            # cannot know keys were made; it serves everyone, and says so.
            caplog.clear()
            assert start().get("/v1/models").status_code == 200
            assert "serves everyone" in caplog.text
            r.close()
    finally:
        server.close()


def test_a_gateway_bound_beyond_loopback_asks_for_keys_by_default(redis_url: str) -> None:
    settings = Settings(redis_url=redis_url, namespace=f"t{uuid.uuid4().hex[:10]}")
    with gateways(settings) as start:
        assert start(host="0.0.0.0").get("/v1/models").status_code == 401
        assert start(host="127.0.0.1").get("/v1/models").status_code == 200


def test_an_open_gateway_plants_no_job_under_a_tenant_a_key_is_made_for_later(
        redis_url: str) -> None:
    settings, env = fresh_fleet(redis_url)
    with gateways(settings) as start:
        http = start()  # auto, no key yet: open
        planted = http.post("/v1/jobs", json={"prompt": "hi", "model": IDLE, "tenant": "acme"})
        assert planted.status_code == 400 and "tenant" in planted.json()["detail"]
        assert http.post("/v1/jobs", json={"prompt": "hi", "model": IDLE}).status_code == 202
    # The jobs made without a key are the tenant "default": no key may be made for it.
    refused = CliRunner().invoke(cli, ["keys", "create", "--tenant", "default"], env=env)
    assert refused.exit_code != 0 and "made without a key" in refused.output


def test_the_gateway_serves_https_with_the_files_it_is_given(
        fleet: Any, tmp_path: Path) -> None:
    from test_security import make_certs

    certs = make_certs(tmp_path)
    https = fleet["start"](uvicorn_options={"ssl_keyfile": str(certs / "server.key"),
                                            "ssl_certfile": str(certs / "server.crt")},
                           scheme="https", verify=str(certs / "ca.crt"))
    assert https.get("/healthz").json() == {"ok": True}
    with pytest.raises(httpx.HTTPError):  # plain HTTP gets no answer
        httpx.get(str(https.base_url).replace("https", "http") + "/healthz", timeout=5)
