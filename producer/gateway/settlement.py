"""The end of a job admitted under an API key's limits: its token charge is
corrected to what it used, and it leaves its tenant's count of queued jobs.

One task per gateway sweeps every job it admitted so, once a second, with one
pipelined read of their statuses (and one of the token ids of those that
ended): a gateway holding thousands of queued jobs costs Redis one round trip
a second, not a waiter per job. Jobs a stopped gateway held keep their charge
(it leaves the window within a minute) and are dropped from their tenant's
count by a later admission at the cap (``KeyLimits``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import orjson
from redis.exceptions import RedisError

from tokenfleet.client.aio import AsyncFleetClient
from tokenfleet.shared.wire import gateway_scripts
from tokenfleet.shared.wire.schemas import JobStatus

log = logging.getLogger("tokenfleet.gateway.app")

# How often the jobs are looked at: how late a charge is corrected, at most.
SWEEP_S = 1.0


@dataclass(frozen=True)
class Charge:
    """What one admitted job was charged, and under which key and tenant."""

    key_id: str
    tenant: str
    request_id: str
    tokens: int  # charged at admission (0: the key has no tpm)
    max_new_tokens: int
    counted: bool  # in its tenant's count of queued jobs (the key has max_queued)


class Settlement:
    """The jobs this gateway admitted under limits, settled as they end."""

    def __init__(self, client: AsyncFleetClient) -> None:
        self.client = client
        self._open: dict[str, Charge] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def watch(self, job_id: str, charge: Charge) -> None:
        self._open[job_id] = charge
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.sweep()
            except (RedisError, OSError, TimeoutError) as exc:
                log.info("settling ended jobs failed (%s); tried again in %.0f s",
                         type(exc).__name__, SWEEP_S)

    async def sweep(self) -> None:
        """Settle every watched job that has ended (or whose record is gone)."""
        job_ids = list(self._open)
        if not job_ids:
            return
        redis, keys = self.client.redis, self.client.keys
        pipe = redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), ["status", "num_prompt_tokens"])
        ended = [(job_id, prompt) for job_id, (status, prompt) in zip(job_ids, await pipe.execute())
                 if status is None or JobStatus(status.decode()).is_terminal]
        if not ended:
            return
        pipe = redis.pipeline(transaction=False)
        for job_id, _ in ended:
            pipe.hget(keys.job(job_id), "token_ids")
        made = [len(orjson.loads(ids)) if ids else 0 for ids in await pipe.execute()]
        for (job_id, prompt), tokens_made in zip(ended, made):
            charge = self._open.pop(job_id)
            if charge.counted:
                await redis.zrem(keys.tenant_jobs(charge.tenant), job_id)
            if charge.tokens:
                # A job that never started has no count of its prompt: the estimate stands.
                prompt_tokens = (int(prompt) if prompt
                                 else charge.tokens - charge.max_new_tokens)
                await gateway_scripts.rate_settle(
                    keys, key_id=charge.key_id, request_id=charge.request_id,
                    charged=charge.tokens, used=prompt_tokens + tokens_made).run_async(redis)
