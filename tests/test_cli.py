"""The command line, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.shared.wire.schemas import JobStatus

ROOT = Path(__file__).resolve().parent.parent


def tokenfleet(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenfleet.cli.app", *args], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(180)
def test_demo_runs_with_no_redis_at_all() -> None:
    # Point the environment at a port where nothing listens: the demo must not need it.
    result = tokenfleet("demo", "--max-new-tokens", "12", env={
        "TOKENFLEET_REDIS_URL": "redis://127.0.0.1:1/0", "COLUMNS": "120"})
    assert result.returncode == 0, result.stderr
    assert "embedded fakeredis" in result.stdout
    assert "The function returns" in result.stdout
    assert result.stdout.count("✓") == 5


def test_export_model_writes_a_hugging_face_directory(tmp_path: Path) -> None:
    result = tokenfleet("export-model", "tiny", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    bad = tokenfleet("export-model", "huge", str(tmp_path / "x"))
    assert bad.returncode != 0 and "built-in: tiny" in bad.stderr


@pytest.mark.timeout(120)
def test_submit_wait_and_status(settings: Any, start_worker: Any) -> None:
    start_worker()
    env = {"TOKENFLEET_REDIS_URL": settings.redis_url, "TOKENFLEET_NAMESPACE": settings.namespace}
    result = tokenfleet("submit", "Hello there", "--max-new-tokens", "6", "--wait", "--json",
                        env=env)
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout)
    assert state["status"] == JobStatus.SUCCEEDED.value
    one = tokenfleet("status", state["id"], "--json", env=env)
    assert json.loads(one.stdout)["text"] == state["text"]
    fleet = json.loads(tokenfleet("status", "--json", env=env).stdout)
    assert [q["queue"] for q in fleet["queues"]] == ["default"]
    assert [w["name"] for w in fleet["workers"]] == ["w1@test"]
    streamed = tokenfleet("submit", "Hi", "--max-new-tokens", "4", "--stream", env=env)
    assert streamed.returncode == 0 and "[succeeded:" in streamed.stderr
    refused = tokenfleet("submit", "Hi", "--max-new-tokens", "0", env=env)
    assert refused.returncode != 0 and "--max-new-tokens" in refused.stderr


@pytest.mark.timeout(120)
def test_repair_ends_overdue_jobs_of_unserved_queues_and_forgets_the_queue(
    settings: Any, client: Any
) -> None:
    job_id = client.submit("late", model="nobody", deadline_s=0.01, require_worker=False)
    assert client.wait(job_id, timeout=10).status is JobStatus.EXPIRED  # the deadline passed
    assert client.redis.hget(client.keys.job(job_id), "status") == b"queued"  # a read wrote nothing
    env = {"TOKENFLEET_REDIS_URL": settings.redis_url, "TOKENFLEET_NAMESPACE": settings.namespace}
    result = tokenfleet("repair", env=env)
    assert result.returncode == 0, result.stderr
    assert "expired 1 overdue job(s); queues forgotten: 'nobody'" in result.stdout
    assert client.redis.hget(client.keys.job(job_id), "status") == b"expired"


@pytest.mark.timeout(180)
def test_the_demo_writes_readable_text() -> None:
    """What the demo streams is English-like prose, not byte noise (greedy, five prompts)."""
    import io

    from rich.console import Console

    from readability import readable_ratio, real_word_ratio
    from tokenfleet.cli.demo import PROMPTS, run_demo

    texts = run_demo(None, PROMPTS, 48, 0.0, console=Console(file=io.StringIO(), width=120))
    assert list(texts) == PROMPTS
    joined = " ".join(texts.values())
    assert all(texts.values())
    assert readable_ratio(joined) >= 0.9, texts
    assert real_word_ratio(joined) > 0.5, texts


@pytest.mark.timeout(120)
def test_status_of_a_job_whose_worker_is_gone_says_so_and_shows_its_token_log(
    settings: Any, client: Any
) -> None:
    # A job as a worker killed mid-run leaves it: the record says running, on a
    # worker whose heartbeat no longer counts; its log holds the tokens made so far
    # (the record gets them only when the job ends).
    job_id = client.submit("a long story", require_worker=False)
    r, keys = client.redis, client.keys
    r.hset(keys.job(job_id), mapping={"status": "running", "worker": "gone@test",
                                      "attempts": 1, "started_at": 1.0})
    r.zadd(keys.queue_workers("default"), {"gone@test": 1.0})  # live until long ago
    for index in range(0, 104, 8):
        event = {"index": index, "token_ids": list(range(index, index + 8)), "text": "ab"}
        r.xadd(keys.out(job_id), {"e": json.dumps(event)}, id=f"0-{index + 8}")
    env = {"TOKENFLEET_REDIS_URL": settings.redis_url, "TOKENFLEET_NAMESPACE": settings.namespace}
    shown = tokenfleet("status", job_id, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "worker gone@test (gone: no live heartbeat" in shown.stdout
    assert "generated tokens 104 (in its token log)" in shown.stdout
    assert shown.stdout.rstrip().endswith("ab" * 13)
    as_json = json.loads(tokenfleet("status", job_id, "--json", env=env).stdout)
    assert as_json["worker_live"] is False and as_json["tokens_logged"] == 104


def test_a_bad_setting_is_one_line_naming_the_variable_and_what_it_takes() -> None:
    cases = [(["worker", "--gpus", "none"], {"TOKENFLEET_MAX_BATCH": "abc"},
              ["TOKENFLEET_MAX_BATCH='abc'", '"auto"', "4096"]),
             (["submit", "Hi"], {"TOKENFLEET_MAX_QUEUE": "0"}, ["TOKENFLEET_MAX_QUEUE='0'", "≥ 1"]),
             (["status"], {"TOKENFLEET_QUEUE": "a b"}, ["TOKENFLEET_QUEUE='a b'", "letters"])]
    for args, env, words in cases:
        out = tokenfleet(*args, env={**env, "TOKENFLEET_REDIS_URL": "redis://127.0.0.1:1/0"},
                         timeout=60)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (args, out.stderr)
        assert all(w in lines[0] for w in words), (args, lines)


def test_a_misspelt_setting_is_warned_about_with_the_closest_name(tmp_path: Path) -> None:
    out = tokenfleet("export-model", "tiny", str(tmp_path / "m"),
                     env={"TOKENFLEET_MAX_NEW_TOKENS": "5", "TOKENFLEET_REDIS_UR": "redis://x"})
    assert out.returncode == 0, out.stderr
    assert ("TOKENFLEET_MAX_NEW_TOKENS is not a setting (did you mean "
            "TOKENFLEET_MAX_NEW_TOKENS_LIMIT?)") in out.stderr
    assert "TOKENFLEET_REDIS_UR is not a setting (did you mean TOKENFLEET_REDIS_URL?)" in out.stderr


@pytest.mark.timeout(120)
def test_status_piped_prints_whole_values(settings: Any, client: Any) -> None:
    # A queue name as long as names go: a terminal's 80 columns would cut it.
    queue = "summaries-for-the-customer-support-backend-in-europe-west-4-v2"
    client.submit("Hello", model=queue, require_worker=False)
    env = {"TOKENFLEET_REDIS_URL": settings.redis_url, "TOKENFLEET_NAMESPACE": settings.namespace}
    out = tokenfleet("status", env=env)  # stdout is a pipe
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.startswith(queue)]
    assert row.split()[1:3] == ["1", "(0/1/0/0)"] and row.split()[-1] == "none", row
