"""Webhook requests as Standard Webhooks define them, and the retry schedule: no Redis."""

from __future__ import annotations

import base64
import time

import orjson
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from tokenfleet.shared.webhook_outbox import webhook_url_problem
from tokenfleet.webhooks.delivery import backoff_s
from tokenfleet.webhooks.signing import (body, event_time, headers, secret_key, tenant_key,
                                       tenant_secret)


def test_a_request_signed_with_a_whsec_secret_verifies_with_standardwebhooks() -> None:
    secret = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    payload = body("job.completed", event_time("1796154002517-0"), '{"id":"default:ab"}')
    head = headers("msg_1", int(time.time()), payload, secret_key(secret))
    assert Webhook(secret).verify(payload, head) == {
        "type": "job.completed", "timestamp": "2026-12-01T19:40:02.517Z",
        "data": {"id": "default:ab"}}
    assert orjson.loads(payload)["data"] == {"id": "default:ab"}


def test_a_raw_secret_is_its_own_bytes_and_no_secret_sends_no_signature() -> None:
    assert secret_key("plain words") == b"plain words"
    assert "webhook-signature" not in headers("msg_1", 1, b"{}", None)


def test_retries_double_from_the_first_wait_up_to_the_cap_jittered_down_by_half() -> None:
    for failures, full in ((1, 1.0), (2, 2.0), (5, 16.0), (9, 256.0), (10, 300.0), (500, 300.0)):
        waits = [backoff_s(failures, 1.0, 300.0) for _ in range(200)]
        assert all(full / 2 <= w <= full for w in waits)
        assert max(waits) - min(waits) > full / 10  # jittered, not fixed


def test_a_webhook_url_is_an_absolute_http_or_https_url_with_a_host() -> None:
    assert webhook_url_problem("https://backend.example.com/hooks?x=1") is None
    assert webhook_url_problem("http://10.0.0.7:8080/") is None
    for bad in ("ftp://example.com/", "/relative", "https://", "http://a b/", "http://h:x/",
                "http://user:secret@example.com/",
                "https://example.com/" + "a" * 2100):
        assert webhook_url_problem(bad), bad


def test_one_tenants_signature_does_not_verify_with_anothers_secret() -> None:
    """A tenant can not replay its own signed event to another tenant's receiver."""
    operator = "whsec_" + base64.b64encode(b"the operator's own secret, 32 b.").decode()
    payload = body("job.completed", event_time("1796154002517-0"), '{"id":"q:1"}')
    signed = headers("msg_1", int(time.time()), payload,
                     tenant_key(secret_key(operator), "acme"))
    assert Webhook(tenant_secret(operator, "acme")).verify(payload, signed)
    for other in (tenant_secret(operator, "globex"), operator):
        with pytest.raises(WebhookVerificationError):
            Webhook(other).verify(payload, signed)
    assert tenant_secret(operator, "acme") != tenant_secret(operator, "globex")


def test_the_default_tenant_signs_with_the_operators_secret_as_before() -> None:
    operator = "whsec_" + base64.b64encode(b"0123456789abcdef0123456789abcdef").decode()
    assert tenant_key(secret_key(operator), "default") == secret_key(operator)
    assert tenant_secret(operator, "default") == operator
