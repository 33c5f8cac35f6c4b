"""A worker sizes its batch from memory and its torch threads from the host's cores."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from tokenfleet.shared.settings import Settings
from tokenfleet.workers import budget, build
from tokenfleet.workers.budget import AUTO_MAX_BATCH, GIB, kv_bytes_per_token, resolve


def llama(layers: int = 4, heads: int = 8, kv_heads: int = 2, hidden: int = 512) -> LlamaConfig:
    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, hidden_size=hidden, vocab_size=64)


def fake_model(config: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    weight = torch.zeros(1, dtype=dtype)
    return SimpleNamespace(config=config, parameters=lambda: iter([weight]))


def test_kv_bytes_per_token_count_keys_and_values_of_every_layer_and_kv_head() -> None:
    # 2 (keys, values) x 4 layers x 2 KV heads x 64 dims x 2 bytes
    assert kv_bytes_per_token(llama(), 2) == 2 * 4 * 2 * 64 * 2


def test_auto_batch_holds_every_sequence_at_its_longest_within_the_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    per_token = kv_bytes_per_token(llama(), 2)
    monkeypatch.setattr(budget, "memory_for_kv", lambda s, d: (per_token * 10_000, "test"))
    got = resolve(Settings(max_new_tokens_limit=500), fake_model(llama()), max_model_len=1000,
                  rows_at_longest=True)
    assert (got.max_batch, got.max_batch_tokens) == (10, 10_000)  # 10,000 tokens / 1,000
    # a shorter prompt and output limit than the context is the longest a sequence gets
    got = resolve(Settings(max_prompt_tokens=100, max_new_tokens_limit=100),
                  fake_model(llama()), max_model_len=1000, rows_at_longest=True)
    assert got.max_batch == 50
    # a paged cache holds only the tokens held: the token bound alone limits it
    got = resolve(Settings(), fake_model(llama()), max_model_len=1000)
    assert (got.max_batch, got.max_batch_tokens) == (AUTO_MAX_BATCH, 10_000)


def test_auto_batch_is_capped_and_never_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "memory_for_kv", lambda s, d: (100 * GIB, "test"))
    assert resolve(Settings(), fake_model(llama()), 1024).max_batch == AUTO_MAX_BATCH
    monkeypatch.setattr(budget, "memory_for_kv", lambda s, d: (1, "test"))
    assert resolve(Settings(), fake_model(llama()), 1024, rows_at_longest=True).max_batch == 1


def test_numbers_given_stay_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "memory_for_kv", lambda s, d: (GIB, "test"))
    got = resolve(Settings(max_batch=24, max_batch_tokens=5000), fake_model(llama()), 1024)
    assert (got.max_batch, got.max_batch_tokens) == (24, 5000)
    assert Settings(max_batch="64").max_batch == 64  # as the environment gives it
    with pytest.raises(ValueError):
        Settings(max_batch="lots")


def test_cpu_budget_is_a_share_of_available_ram_split_among_the_hosts_workers_and_capped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "available_ram", lambda: 8 * GIB)
    cpu = torch.device("cpu")
    assert budget.memory_for_kv(Settings(cpu_memory_fraction=0.5), cpu)[0] == 4 * GIB
    two = Settings(cpu_memory_fraction=0.5, host_workers=2)
    assert budget.memory_for_kv(two, cpu)[0] == 2 * GIB
    assert budget.memory_for_kv(Settings(cpu_kv_cache_gib=1), cpu)[0] == GIB


def test_a_worker_that_was_not_sized_says_how_to_size_it() -> None:
    with pytest.raises(ValueError, match="build_worker"):
        budget.resolved(Settings())
    assert budget.resolved(Settings(max_batch=8, max_batch_tokens=100)) == (8, 100)


def test_the_heartbeat_shows_the_batch_size_the_budget_gave(settings: Any) -> None:
    from tokenfleet.workers.null_runner import NULL_MODEL

    auto = settings.model_copy(update={"model": NULL_MODEL, "max_batch": "auto"})
    worker = build.build_worker(auto, name="sized@test")
    try:
        assert worker.heartbeat.describe()["max_batch"] == AUTO_MAX_BATCH
        assert worker.engine_loop.credits() == AUTO_MAX_BATCH + settings.prefetch
    finally:
        worker.redis.close()


@pytest.mark.parametrize("cores, workers, threads",
                         [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 3, 1), (8, 1, 7), (16, 4, 3)])
def test_torch_threads_share_the_cores_but_one_among_the_hosts_workers(
        monkeypatch: pytest.MonkeyPatch, cores: int, workers: int, threads: int) -> None:
    monkeypatch.setattr(build, "usable_cores", lambda: cores)
    assert build.cpu_threads(Settings(host_workers=workers)) == threads
    assert build.cpu_threads(Settings(host_workers=workers, torch_threads=3)) == 3
