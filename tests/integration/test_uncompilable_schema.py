"""A JSON schema that does not compile, sent through a gateway without xgrammar
(the shipped gateway image leaves it out): the gateway cannot check it, the
worker finds out, and the job fails with the compiler's reason. The OpenAI
client gets an error that says why, never a hang, and the tenant's place in
the queue is given back."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import redis

from tokenfleet.shared import grammar_check
from tokenfleet.shared.wire.keys import Keys

from gateway_server import gateway, port_of  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(120)

# Valid JSON Schema in shape, which no grammar can hold: a string pattern that is
# not a regular expression xgrammar reads.
BROKEN = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?<=a)b"}},
          "required": ["code"]}


def test_a_schema_only_the_worker_can_check_fails_the_request_with_the_reason(
    gateway: Any, start_worker: Any, r: redis.Redis, settings: Any,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gateway's process as the image builds it: no xgrammar to compile with.
    # (The worker, which has it, runs in this process too: only the check is patched.)
    made = grammar_check.GrammarCheck.__init__

    def without_xgrammar(self: grammar_check.GrammarCheck, *args: Any) -> None:
        made(self, *args)
        self._xgrammar = False

    monkeypatch.setattr(grammar_check.GrammarCheck, "__init__", without_xgrammar)
    start_worker()
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(gateway())}/v1",
                        api_key="unused", max_retries=0, timeout=60)
    fmt = {"type": "json_schema", "json_schema": {"name": "code", "schema": BROKEN}}
    with pytest.raises(openai.APIStatusError) as refused:
        oai.chat.completions.create(model="default", max_tokens=8, response_format=fmt,
                                    messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 400, refused.value
    assert "could not be compiled" in str(refused.value), refused.value
    keys = Keys(settings.namespace)
    # Nothing of the job holds a place: not the queue, not the tenant's count.
    assert r.xlen(keys.queue("default")) == 0
    assert r.zcard(keys.tenant_jobs("default")) == 0
