"""The sampling fields OpenAI clients send, through the fleet on the real model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tokenfleet import FleetClient, JobStatus

pytestmark = pytest.mark.timeout(120)


def test_logit_bias_steers_every_token_and_an_id_outside_the_vocabulary_fails_alone(
    client: FleetClient, start_worker: Callable[..., Any], loaded_tiny: Any
) -> None:
    _, tok = loaded_tiny
    start_worker()
    forced = client.submit("Once upon a time", max_new_tokens=6, temperature=0.8, seed=3,
                           logit_bias={"40": 100})
    outside = client.submit("Once upon a time", max_new_tokens=6, logit_bias={len(tok): 1})
    plain = client.submit("Once upon a time", max_new_tokens=6, temperature=0.0)
    assert client.wait(forced, timeout=60).token_ids == [40] * 6
    failed = client.wait(outside, timeout=60)
    assert failed.status is JobStatus.FAILED
    assert f"logit_bias names token {len(tok)}, outside this model's vocabulary" in failed.error
    assert client.wait(plain, timeout=60).status is JobStatus.SUCCEEDED


def test_a_frequency_penalty_stops_greedy_repetition(
    client: FleetClient, start_worker: Callable[..., Any]
) -> None:
    start_worker()
    plain = client.wait(client.submit("the the the the", max_new_tokens=40, temperature=0.0),
                        timeout=60).token_ids
    penalised = client.wait(client.submit("the the the the", max_new_tokens=40, temperature=0.0,
                                          frequency_penalty=2.0), timeout=60).token_ids
    # Greedy decoding of the tiny model repeats itself; at 2.0 per use a token
    # soon loses to another, so more distinct tokens come out.
    assert len(set(penalised)) > len(set(plain))
