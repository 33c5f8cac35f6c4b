"""The pieces of API keys' limits on their own: the rate script's window on a real
redis-server, OpenAI's reset durations, the ownership rule, a job's tenant."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, cast

import pytest
import redis

from tokenfleet import FleetClient, InvalidRequest
from tokenfleet.gateway.auth import auth_mode, warn_while_open
from tokenfleet.gateway.key_limits import duration
from tokenfleet.client.prompt_tokens import charged_prompt_tokens
from tokenfleet.shared.wire import gateway_scripts
from tokenfleet.shared.wire.gateway_scripts import RateVerdict
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.models import local_tokenizer_file
from tokenfleet.shared.wire.ownership import owns
from tokenfleet.shared.wire.schemas import GenerationRequest, JobState, JobStatus

pytestmark = pytest.mark.timeout(60)


def take(r: redis.Redis, keys: Keys, now: float, *, rpm: int | None = None,
         tpm: int | None = None, tokens: int = 0, requests: int = 1) -> Any:
    return gateway_scripts.rate_take(keys, key_id="k1", request_id=uuid.uuid4().hex, now=now,
                                     rpm=rpm, tpm=tpm, requests=requests,
                                     tokens=tokens).run(r)


def test_the_window_slides_and_retry_after_says_when_a_request_fits(r: redis.Redis) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    for i in range(3):
        assert take(r, keys, 1000.0 + i, rpm=3).verdict is RateVerdict.OK
    refused = take(r, keys, 1010.0, rpm=3)
    assert refused.verdict is RateVerdict.REQUESTS and refused.requests == 3
    assert refused.retry_after_s == pytest.approx(50.0)  # the first leaves at 1060
    assert refused.requests_reset_s == pytest.approx(52.0)  # the last leaves at 1062
    assert take(r, keys, 1059.9, rpm=3).verdict is RateVerdict.REQUESTS
    assert take(r, keys, 1060.0, rpm=3).verdict is RateVerdict.OK
    # A read counts nothing.
    assert take(r, keys, 1060.5, rpm=3, requests=0).requests == 3


def test_tokens_are_refused_past_tpm_and_a_settled_charge_frees_them(r: redis.Redis) -> None:
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    first = gateway_scripts.rate_take(keys, key_id="k1", request_id="a", now=1000.0, rpm=None,
                                      tpm=100, requests=1, tokens=80).run(r)
    assert first.verdict is RateVerdict.OK and first.tokens == 80
    refused = take(r, keys, 1001.0, tpm=100, tokens=30)
    assert refused.verdict is RateVerdict.TOKENS and refused.retry_after_s == pytest.approx(59.0)
    assert gateway_scripts.rate_settle(keys, key_id="k1", request_id="a", charged=80,
                                       used=10).run(r)
    assert take(r, keys, 1002.0, tpm=100, tokens=30).tokens == 40
    assert take(r, keys, 1003.0, tpm=100, tokens=101).verdict is RateVerdict.OVERSIZE
    # The corrected charge leaves the window when the original would have.
    assert take(r, keys, 1060.5, tpm=100, requests=0).tokens == 30


def test_reset_durations_read_as_openai_writes_them() -> None:
    assert duration(0.02) == "20ms"
    assert duration(1) == "1s"
    assert duration(1.5) == "1.5s"
    assert duration(59.9994) == "59.999s"
    assert duration(360) == "6m0s"
    assert duration(3723) == "1h2m3s"


def test_a_job_belongs_to_its_tenant_and_none_is_default() -> None:
    job = JobState(id="default:00", status=JobStatus.QUEUED, tenant="acme")
    assert owns("acme", job) and not owns("other", job) and not owns(None, job)
    anonymous = JobState(id="default:01", status=JobStatus.QUEUED)
    assert owns(None, anonymous) and owns("default", anonymous) and not owns("acme", anonymous)


def test_submit_stores_the_tenant_and_refuses_a_bad_name(client: FleetClient,
                                                         r: redis.Redis) -> None:
    job_id = client.submit("hi", max_new_tokens=2, tenant="team-a", require_worker=False)
    assert client.status(job_id).tenant == "team-a"
    assert r.hget(client.keys.job(job_id), "tenant") == b"team-a"
    plain = client.submit("hi", max_new_tokens=2, require_worker=False)
    assert r.hget(client.keys.job(plain), "tenant") is None  # omitted when none
    with pytest.raises(InvalidRequest, match="tenant"):
        client.submit("hi", tenant="no spaces", require_worker=False)


def test_the_auth_mode_left_unset_is_on_beyond_loopback() -> None:
    assert auth_mode(None, "0.0.0.0") == auth_mode(None, "::") == "on"
    assert auth_mode(None, "10.1.2.3") == auth_mode(None, "gateway.internal") == "on"
    assert auth_mode(None, "127.0.0.1") == auth_mode(None, "::1") == "auto"
    assert auth_mode(None, "localhost") == "auto"
    assert auth_mode("auto", "0.0.0.0") == "auto" and auth_mode("off", "0.0.0.0") == "off"


async def test_an_open_auto_gateway_warns_every_interval_until_a_key_is_made(
        caplog: pytest.LogCaptureFixture) -> None:
    class Book:  # no key for three looks, then one
        looks = 0

        async def ever_made(self) -> bool:
            self.looks += 1
            return self.looks > 3

    caplog.set_level(logging.WARNING, logger="tokenfleet.gateway.app")
    await asyncio.wait_for(warn_while_open(cast(Any, Book()), every_s=0.01), timeout=10)
    assert caplog.text.count("serves everyone without a key") == 3


def test_a_prompts_charge_is_never_under_its_tokens() -> None:
    from tokenizers import Tokenizer

    tiny = Tokenizer.from_file(str(local_tokenizer_file("tiny")))
    texts = ["\U0001f600" * 225, "héllo wörld " * 40, "plain english text, " * 30]
    for text in texts:
        real = len(tiny.encode(text).ids)
        assert charged_prompt_tokens(GenerationRequest(prompt=text), ["tiny"]) == (real, True)
        bound, exact = charged_prompt_tokens(GenerationRequest(prompt=text), ["elsewhere"])
        assert bound >= real and not exact  # no tokenizer here: a token a byte
    chat = GenerationRequest(messages=[{"role": "user", "content": texts[0]}],
                             tools=[{"type": "function", "function": {"name": "x" * 500}}])
    for models in (["tiny"], []):
        bound, exact = charged_prompt_tokens(chat, models)
        assert bound >= 901 + 500 // 4 and not exact  # the tools render into the prompt too
    ids = GenerationRequest(prompt_token_ids=[5, 6, 7])
    assert charged_prompt_tokens(ids, []) == (3, True)
