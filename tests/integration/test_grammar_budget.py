"""A schema cannot freeze the gateway: its compile runs after the key's limits,
off the event loop, within TOKENFLEET_GRAMMAR_COMPILE_S; a real gateway on a
real redis-server (no model: the queue's worker is pinned, nothing runs)."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tokenfleet.shared.grammar_check import GrammarCheck
from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import ApiKey
from tokenfleet.shared.wire.structured import StructuredOutput

from gateway_server import gateway, pin_live_worker  # noqa: F401 (a fixture)
from helpers import redis_client

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

QUEUE = "idle"
BUDGET_S = 1.0


def pathological(n: int) -> dict[str, Any]:
    """47 bytes of schema that xgrammar expands into ``n`` rules: seconds to compile."""
    return {"type": "string", "pattern": f"[a-z]{{1,{n}}}"}


def completion(n: int) -> dict[str, Any]:
    return {"model": QUEUE, "prompt": "x", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": f"long{n}", "schema": pathological(n)}}}


def tool_call(n: int) -> dict[str, Any]:
    return {"model": QUEUE, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "tool_choice": "required", "tools": [{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "properties": {
                    "s": pathological(n)}, "required": ["s"]}}}]}


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> list[StructuredOutput]:
    """Every spec a gateway in this process compiles, in order."""
    specs: list[StructuredOutput] = []
    compile_one = GrammarCheck._compile

    def counted(self: GrammarCheck, spec: StructuredOutput, budget_s: float) -> Any:
        specs.append(spec)
        return compile_one(self, spec, budget_s)

    monkeypatch.setattr(GrammarCheck, "_compile", counted)
    return specs


def make_key(settings: Any, tenant: str, **limits: Any) -> str:
    r = redis_client(settings.redis_url)
    key, key_id = new_key()
    create_key(r, Keys(settings.namespace), ApiKey(key_id=key_id, tenant=tenant,
                                                   created_at=time.time(), **limits), key)
    pin_live_worker(r, settings.namespace, QUEUE)
    r.close()
    return key


def test_healthz_stays_fast_while_ten_pathological_schemas_are_refused_naming_the_budget(
    settings: Any, gateway: Any, compiled: list[StructuredOutput]
) -> None:
    key = make_key(settings, "acme")
    http: httpx.Client = gateway(grammar_compile_s=BUDGET_S)
    auth = {"Authorization": f"Bearer {key}"}
    assert http.get("/healthz").status_code == 200
    latencies: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=http.base_url, timeout=30) as own:
            while not done.is_set():
                started = time.monotonic()
                assert own.get("/healthz").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.01)

    def post(n: int) -> httpx.Response:
        path, body = (("/v1/chat/completions", tool_call(n)) if n % 5 == 0
                      else ("/v1/completions", completion(n)))
        with httpx.Client(base_url=http.base_url, timeout=120) as own:
            return own.post(path, json=body, headers=auth)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(post, range(8_000, 8_010)))
    finally:
        done.set()
        prober.join()
    for n, answer in zip(range(8_000, 8_010), answers, strict=True):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert "TOKENFLEET_GRAMMAR_COMPILE_S" in error["message"], error
        assert error["param"] == ("tools" if n % 5 == 0 else "response_format"), error
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    assert len(latencies) > 50 and p99 < 0.1, (len(latencies), p99, latencies[-5:])
    # Refused once, refused at once: the same schema is not compiled again.
    before = len(compiled)
    assert before >= 10, before  # each of the ten was compiled once, in this process
    again = http.post("/v1/completions", json=completion(8_001), headers=auth)
    assert again.status_code == 400 and len(compiled) == before


def test_a_key_whose_rpm_is_spent_gets_its_429_at_once_without_compiling(
    settings: Any, gateway: Any, compiled: list[StructuredOutput]
) -> None:
    key = make_key(settings, "spent", rpm=1)
    http: httpx.Client = gateway(grammar_compile_s=30.0)
    auth = {"Authorization": f"Bearer {key}"}
    assert http.post("/v1/jobs", json={"model": QUEUE, "prompt": "x"},
                     headers=auth).status_code == 202
    for n in (12_000, 12_001):  # a new schema each time: nothing cached to answer from
        refused = http.post("/v1/completions", json=completion(n), headers=auth)
        assert refused.status_code == 429, refused.text
    assert not compiled, f"{len(compiled)} schemas were compiled for requests refused 429"


def test_a_worker_fails_a_schema_over_its_budget_while_other_streams_keep_their_pace(
    settings: Any, loaded_tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenfleet import FleetClient, JobStatus
    from tokenfleet.workers.build import grammars, hf_engine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.service import Worker

    worker_settings = settings.model_copy(update={"grammar_compile_s": BUDGET_S})
    model, tokenizer = loaded_tiny
    runner = HFRunner(model, tokenizer)
    engine = hf_engine(worker_settings, runner, runner.eos_token_ids, runner.max_model_len)
    engine.grammars = grammars(tokenizer, runner.vocab_size, runner.eos_token_ids,
                               worker_settings)
    worker = Worker(worker_settings, engine, tokenizer, name="w@grammar")
    worker.start()
    # The client as the bare install (no xgrammar): the worker alone compiles.
    with monkeypatch.context() as hidden:
        hidden.setitem(sys.modules, "xgrammar", None)
        client = FleetClient(settings=settings)
    try:
        small = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                 "required": ["ok"], "additionalProperties": False}
        warm = client.wait(client.submit("x", json_schema=small, max_new_tokens=16,
                                         require_worker=False), timeout=120)
        assert warm.status is JobStatus.SUCCEEDED, warm.error  # the compile server is up
        gaps: list[float] = []
        done = threading.Event()

        def plain_streams() -> None:
            while not done.is_set():
                job_id = client.submit("Once upon a time", max_new_tokens=32)
                last = None  # from its first token: the wait in the queue is not a gap
                for _ in client.stream(job_id, timeout=60):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

        streamer = threading.Thread(target=plain_streams)
        streamer.start()
        while not gaps:  # a plain job streams before the schemas arrive
            time.sleep(0.01)
        try:
            started = time.monotonic()
            ids = [client.submit("x", json_schema=pathological(n), max_new_tokens=8)
                   for n in range(8_100, 8_104)]
            ended = [client.wait(job_id, timeout=60) for job_id in ids]
            took = time.monotonic() - started
        finally:
            done.set()
            streamer.join()
        for state in ended:
            assert state.status is JobStatus.FAILED, state
            assert "TOKENFLEET_GRAMMAR_COMPILE_S" in str(state.error), state.error
        assert took < 4 * BUDGET_S + 10, took  # each held to its budget, none to its compile
        assert len(gaps) > 20 and max(gaps) < 0.5, (len(gaps), sorted(gaps)[-5:])
        # Refused once, refused at once: the same schema is not compiled again.
        again = time.monotonic()
        state = client.wait(client.submit("x", json_schema=pathological(8_100),
                                          max_new_tokens=8), timeout=60)
        assert state.status is JobStatus.FAILED and time.monotonic() - again < BUDGET_S
    finally:
        client.close()
        worker.stop(grace_s=0)
        assert engine.grammars is not None
        engine.grammars.close()
