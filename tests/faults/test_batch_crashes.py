"""A 500-line batch through faults: a worker killed (kill -9), the gateway whose
driver holds the batch's lease killed, and every process of the fleet
(gateways and workers; Redis stays) killed and started again 10 s later. Each
time the batch completes, each custom_id is in the output file once, no token
of any line's job is made twice (each token index published once on the job's
channel; a done line's token log goes as its result is written, so the channel
is where every token shows), and each line's text is the undisturbed (greedy)
run's."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import orjson
import pytest
import redis

from tokenfleet.shared.wire.keys import Keys

from helpers import ChannelTally, direct_greedy, free_port, wait_until
from placed_kill import frozen_mid_job

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
LINES = 500
WORDS = "the value of a list is returned when the module calls its function".split()
WORKER_ENV = {"TOKENFLEET_MAX_BATCH": "32", "TOKENFLEET_CLAIM_IDLE_S": "2"}


def job(i: int) -> tuple[str, int]:
    """Line i's prompt and max_tokens: 35 prompts, three lengths."""
    return " ".join(WORDS[i % 7: i % 7 + 2 + i % 5]), 12 + i % 3 * 4


class GatewayProc:
    """``tokenfleet gateway`` as a process of its own (so kill -9 is real)."""

    def __init__(self, settings: Any, files: Path) -> None:
        self.port = free_port()
        env = {**os.environ, "TOKENFLEET_REDIS_URL": settings.redis_url,
               "TOKENFLEET_NAMESPACE": settings.namespace,
               "TOKENFLEET_FILES_URL": f"file://{files}",
               "TOKENFLEET_GATEWAY_AUTH": "off", "TOKENFLEET_BLOCK_MS": "20",
               "PYTHONUNBUFFERED": "1"}
        self.log = tempfile.NamedTemporaryFile(prefix="gateway-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet.cli.app", "gateway", "--host", "127.0.0.1",
             "--port", str(self.port)], env=env, cwd=ROOT, stdout=self.log,
            stderr=subprocess.STDOUT)
        with httpx.Client(base_url=self.url) as http:
            wait_until(lambda: self._healthy(http), timeout=60, what="the gateway to listen",
                       interval=0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self, http: httpx.Client) -> bool:
        assert self.proc.poll() is None, self.output()
        with contextlib.suppress(httpx.TransportError):
            return http.get("/healthz").status_code == 200
        return False

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=3,
                             timeout=60)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


@pytest.fixture
def start_gateway(settings: Any, tmp_path: Path) -> Iterator[Callable[[], GatewayProc]]:
    started: list[GatewayProc] = []

    def start() -> GatewayProc:
        started.append(GatewayProc(settings, tmp_path))
        return started[-1]

    yield start
    for gateway in started:
        gateway.close()


@pytest.fixture
def tally(settings: Any) -> Iterator[ChannelTally]:
    """Every token and end published on the namespace's job channels."""
    channels = ChannelTally(settings.redis_url, Keys(settings.namespace))
    yield channels
    channels.close()


@pytest.fixture(scope="module")
def undisturbed(loaded_tiny: tuple[Any, Any]) -> dict[tuple[str, int], str]:
    """Each distinct (prompt, max_tokens) of the batch, run greedy in-process."""
    jobs = sorted({job(i) for i in range(LINES)})
    return dict(zip(jobs, direct_greedy(loaded_tiny, jobs)))


def batch_file() -> bytes:
    return b"".join(orjson.dumps({
        "custom_id": f"q-{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": "default", "prompt": job(i)[0], "max_tokens": job(i)[1],
                 "temperature": 0}}) + b"\n" for i in range(LINES))


def done_lines(r: redis.Redis, keys: Keys, batch_id: str) -> int:
    counts = r.hmget(keys.batch(batch_id), "completed", "failed")
    return sum(int(c or 0) for c in counts)


def lease_holder_pid(r: redis.Redis, keys: Keys, batch_id: str) -> int | None:
    """The pid in the lease holder's driver name (``host:pid:suffix``)."""
    holder = cast(bytes | None, r.get(keys.batch_lease(batch_id)))
    return int(holder.decode().rsplit(":", 2)[1]) if holder else None


@pytest.mark.slow
@pytest.mark.single_redis("tallies every job's channels by pattern, and a batch's job ids are "
                          "not known before its driver makes them; a cluster's channels are "
                          "shard channels, which take no pattern")
@pytest.mark.parametrize("fault", ["worker_kill_9", "gateway_kill_9", "fleet_kill_9_10s"])
def test_a_500_line_batch_completes_through_the_fault_each_line_once(
    fault: str, settings: Any, r: redis.Redis, celery_workers: Any, tally: ChannelTally,
    start_gateway: Callable[[], GatewayProc], undisturbed: dict[tuple[str, int], str],
    report: dict[str, Any],
) -> None:
    keys = Keys(settings.namespace)
    worker = celery_workers("cpu@first", **WORKER_ENV)
    gateways = [start_gateway()]
    if fault == "gateway_kill_9":
        gateways.append(start_gateway())  # the one that takes the batch over
    oa = gateways[0].openai()
    file_id = oa.files.create(file=("in.jsonl", batch_file()), purpose="batch").id
    batch = oa.batches.create(input_file_id=file_id, endpoint="/v1/completions",
                              completion_window="24h")
    wait_until(lambda: done_lines(r, keys, batch.id) >= 100, timeout=120,
               what="100 lines to finish before the fault")
    faulted_at = time.monotonic()
    done_at_fault = done_lines(r, keys, batch.id)

    def lines_jobs() -> list[str]:
        return [j.decode() for j in r.hvals(keys.batch_running(batch.id))]

    if fault == "worker_kill_9":
        with frozen_mid_job(worker.proc, r, keys, "cpu@first", lines_jobs):
            worker.kill()  # its pending entries go to the next worker after claim_idle_s
        celery_workers("cpu@second", **WORKER_ENV)
    elif fault == "gateway_kill_9":
        holder = lease_holder_pid(r, keys, batch.id)
        victim = next(g for g in gateways if g.proc.pid == holder)
        victim.kill()  # its lease lapses; the other gateway's driver takes the batch
        gateways.remove(victim)
        oa = gateways[0].openai()
    else:
        # Every process at once, with no grace (a power cut): no lease given
        # back, no job handed back; the next processes find what Redis holds.
        with frozen_mid_job(worker.proc, r, keys, "cpu@first", lines_jobs):
            for gateway in gateways:
                gateway.kill()
            worker.kill()
        time.sleep(10)  # the outage itself: nothing of the fleet runs
        celery_workers("cpu@after", **WORKER_ENV)
        gateways = [start_gateway()]
        oa = gateways[0].openai()
    wait_until(lambda: done_lines(r, keys, batch.id) > done_at_fault, timeout=60,
               what="a line to finish after the fault")
    recovery_s = time.monotonic() - faulted_at
    wait_until(lambda: oa.batches.retrieve(batch.id).status not in (
        "validating", "in_progress", "finalizing"), timeout=180, what="the batch to end",
        interval=0.2)
    done = oa.batches.retrieve(batch.id)
    assert done.status == "completed", (done, gateways[0].output())
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
    assert done.error_file_id is None
    assert done.output_file_id is not None
    out = [orjson.loads(line) for line in oa.files.content(done.output_file_id).content.splitlines()
           if line.strip()]
    assert sorted(line["custom_id"] for line in out) == sorted(f"q-{i}" for i in range(LINES))
    jobs = {line["response"]["request_id"]: line for line in out}
    tally.wait_ended(list(jobs), timeout=30)
    made: dict[str, list[int]] = {}
    for j, k in sorted(tally.tokens):
        made.setdefault(j, []).append(k)
    for job_id, line in jobs.items():
        body = line["response"]["body"]
        # Each token made once (its index published once), none missing.
        tokens = body["usage"]["completion_tokens"]
        assert made.get(job_id) == list(range(tokens)), line["custom_id"]
        assert body["choices"][0]["text"] == undisturbed[job(int(line["custom_id"][2:]))]
    assert tally.duplicated == 0
    # A written line's token log is gone: Redis keeps no batch's worth of logs.
    assert sum(r.exists(keys.out(j)) for j in jobs) == 0
    assert tally.ends_not_once(list(jobs)) == {}
    # The records of the lines done in the last minute are still there.
    resumed = sum(int(r.hget(keys.job(j), "attempts") or 1) > 1 for j in jobs)
    if fault != "gateway_kill_9":
        assert resumed, "the kill hit no line in flight"
    report.update(lines=LINES, done_at_fault=done_at_fault, resumed=resumed,
                  recovery_s=round(recovery_s, 2))
