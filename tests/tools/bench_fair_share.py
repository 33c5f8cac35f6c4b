"""Fleet tokens/s with one tenant, fair share on and off, side by side.

Two fleets of one worker each (``TOKENFLEET_FAIR_SHARE=1`` and ``=0``) run on
one Redis; rounds alternate between them, so load on a shared machine falls on
both alike. Each round queues ``--jobs`` jobs of one tenant at once (one
pipeline) and times the first submit to the last end (heard on the end
channels). ``--engine null`` (no model: the fleet's own costs, where the feeder
weighs most) or ``gpu-sim`` (a GPU-shaped step of ``--step-ms``).

    python tests/tools/bench_fair_share.py --url redis://127.0.0.1:6379 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid

import redis

from tokenfleet import FleetClient
from tokenfleet.client.protocol import build_request, submission
from tokenfleet.shared.wire.client_scripts import SubmitVerdict
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.settings import get_settings
from tokenfleet.bench.procs import CeleryProc, wait_for


class Fleet:
    """One worker on a namespace of its own, and a tally of ended jobs."""

    def __init__(self, url: str, fair: bool, args: argparse.Namespace) -> None:
        self.label = "on" if fair else "off"
        self.namespace = f"fairbench-{uuid.uuid4().hex[:6]}-{self.label}"
        self.keys = Keys(self.namespace)
        self.r = redis.Redis.from_url(url)
        env = {"TOKENFLEET_REDIS_URL": url, "TOKENFLEET_NAMESPACE": self.namespace,
               "TOKENFLEET_FAIR_SHARE": "1" if fair else "0", "TOKENFLEET_QUEUE": "default",
               "TOKENFLEET_MAX_BATCH": str(args.max_batch), "TOKENFLEET_HEARTBEAT_S": "0.5",
               "TOKENFLEET_RESULT_TTL_S": "300", "TOKENFLEET_TORCH_THREADS": "1",
               "CUDA_VISIBLE_DEVICES": ""}
        if args.engine == "null":
            env["TOKENFLEET_MODEL"] = "null"
        else:
            env.update(TOKENFLEET_ENGINE="gpu-sim", TOKENFLEET_GPU_SIM_STEP_MS=str(args.step_ms))
        self.worker = CeleryProc("tokenfleet.workers.app", f"fair-{self.label}@bench", env)
        self.client = FleetClient(url, namespace=self.namespace,
                                  settings=get_settings().model_copy(
                                      update={"require_worker": False}))
        self.ended = 0  # end events heard (the listener's thread counts)
        self._done = 0  # of them, those of finished rounds
        self._pubsub = self.r.pubsub()
        self._pubsub.psubscribe(self.keys.ends("*"))
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        for message in self._pubsub.listen():
            if message["type"] == "pmessage":
                self.ended += 1

    def started(self) -> bool:
        return bool(self.r.exists(self.keys.worker(self.worker.node))) or not self.worker.alive()

    def round(self, jobs: int, tokens: int, tenant: str | None) -> float:
        """Tokens per second for ``jobs`` jobs queued at once."""
        now = self.client.clock.read(self.r)
        subs = [submission(build_request(f"job {i}", {"max_new_tokens": tokens,
                                                      "tenant": tenant}, self.client.settings),
                           self.client.keys, self.client.settings, False, now,
                           tenants=(tenant,) if tenant else ())
                for i in range(jobs)]
        self.client.submit("warm the script cache", max_new_tokens=1, tenant=tenant)
        wait_for(lambda: self.ended >= 1 + self._done, 60, "the warm-up job")
        target = self._done + 1 + jobs
        pipe = self.r.pipeline(transaction=False)
        for sub in subs:
            pipe.execute_command(*sub.call.command())
        t0 = time.perf_counter()
        replies = pipe.execute()
        assert all(s.call.decode(x).admission is SubmitVerdict.QUEUED for s, x in zip(subs, replies))
        wait_for(lambda: self.ended >= target, 600, f"{jobs} jobs to end")
        elapsed = time.perf_counter() - t0
        self._done = target
        return jobs * tokens / elapsed

    def close(self) -> None:
        self.worker.close()
        self.client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379")
    parser.add_argument("--engine", choices=("null", "gpu-sim"), default="null")
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tenant", default=None, help="the one tenant (default: none)")
    args = parser.parse_args()
    fleets = [Fleet(args.url, True, args), Fleet(args.url, False, args)]
    try:
        for fleet in fleets:
            wait_for(fleet.started, 300, f"worker {fleet.worker.node} to start")
            fleet.worker.check()
        figures: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(args.rounds):
            for fleet in fleets if i % 2 == 0 else fleets[::-1]:
                rate = fleet.round(args.jobs, args.max_new_tokens, args.tenant)
                figures[fleet.label].append(rate)
                print(f"round {i + 1} fair share {fleet.label:>3}: {rate:,.0f} tokens/s",
                      flush=True)
        on, off = (statistics.median(figures[k]) for k in ("on", "off"))
        print(f"median tokens/s: fair share on {on:,.0f}, off {off:,.0f}: "
              f"on is {100 * (on / off - 1):+.1f}% of off")
    finally:
        for fleet in fleets:
            fleet.close()


if __name__ == "__main__":
    main()
