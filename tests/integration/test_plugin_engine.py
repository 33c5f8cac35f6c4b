"""A third engine plugged in from a test-only package by its entry point
alone: a Celery worker started with ``TOKENFLEET_ENGINE=echo`` serves jobs with
it, with no edit of tokenfleet (``tests/plugin_engine``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenfleet import FleetClient
from tokenfleet.shared.wire.schemas import FinishReason, JobStatus
from tokenfleet.workers.null_runner import null_tokenizer

from plugin_engine import NAME, install

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["hello world", "def f(x):", "Redis streams keep"]


@pytest.mark.slow
def test_an_engine_registered_by_entry_point_serves_jobs(
    client: FleetClient, celery_workers: Any, tmp_path: Path
) -> None:
    worker = celery_workers("cpu@plugin", TOKENFLEET_ENGINE=NAME, PYTHONPATH=install(tmp_path))
    job_ids = [client.submit(p, max_new_tokens=64) for p in PROMPTS]
    cut = client.submit("Once upon a time", max_new_tokens=3)

    states = [client.wait(j, timeout=60) for j in job_ids]
    # The echo engine's text: each prompt, ended by its end-of-sequence token.
    assert [s.text for s in states] == PROMPTS
    assert all(s.status == JobStatus.SUCCEEDED and s.finish_reason == FinishReason.EOS
               and s.worker == "cpu@plugin" for s in states), states
    streamed = "".join(e.text for e in client.stream(job_ids[0], timeout=60))
    assert streamed == PROMPTS[0]

    tok = null_tokenizer()
    first_three = tok.decode(tok("Once upon a time", add_special_tokens=False)["input_ids"][:3])
    ended = client.wait(cut, timeout=60)
    assert (ended.text, ended.finish_reason) == (first_three, FinishReason.LENGTH)
    assert worker.stop() == 0


@pytest.mark.slow
def test_a_worker_named_to_an_engine_not_installed_exits_naming_the_installed_ones(
    celery_workers: Any,
) -> None:
    worker = celery_workers("cpu@nope", wait=False, TOKENFLEET_ENGINE="nope")
    assert worker.proc.wait(timeout=120) != 0
    assert "no engine named 'nope'" in worker.output() and "hf, vllm" in worker.output()
