"""Live jobs' time to first token and tokens/s with a batch running, and without.

Fleets of one gpu-sim worker each (a GPU-shaped step of ``--step-ms``), on one
Redis, in namespaces of their own: ``idle`` serves live jobs alone; ``batch``
has batch-level jobs filling its batch all along (preemption on, the default);
with ``--off`` a third, ``batch-off``, the same with
``TOKENFLEET_PREEMPT_BATCH=0``. Rounds alternate between the fleets, so load on
a shared machine falls on each alike. A round queues ``--live`` live jobs at
once (one pipeline) and reads their records: the time to first token of each
(``first_token_at - created_at``, both on Redis's clock) and the round's live
tokens/s (their tokens over the first submit to the last end).

    python tests/tools/bench_preemption.py --url redis://127.0.0.1:6379 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import uuid

from tokenfleet import FleetClient, JobStatus
from tokenfleet.client.protocol import build_request, submission
from tokenfleet.shared.wire.client_scripts import SubmitVerdict
from tokenfleet.shared.settings import get_settings
from tokenfleet.bench.procs import CeleryProc, wait_for

BATCH_TOKENS = 1024  # a batch job outlasts many rounds


class Fleet:
    """One worker on a namespace of its own."""

    def __init__(self, url: str, label: str, args: argparse.Namespace) -> None:
        self.label = label
        namespace = f"preemptbench-{uuid.uuid4().hex[:6]}-{label}"
        env = {"TOKENFLEET_REDIS_URL": url, "TOKENFLEET_NAMESPACE": namespace,
               "TOKENFLEET_ENGINE": "gpu-sim", "TOKENFLEET_GPU_SIM_STEP_MS": str(args.step_ms),
               "TOKENFLEET_MAX_BATCH": str(args.max_batch), "TOKENFLEET_PREFETCH": "2",
               "TOKENFLEET_PREEMPT_BATCH": "0" if label == "batch-off" else "1",
               "TOKENFLEET_HEARTBEAT_S": "0.5", "TOKENFLEET_RESULT_TTL_S": "600",
               "CUDA_VISIBLE_DEVICES": ""}
        self.worker = CeleryProc("tokenfleet.workers.app", f"preempt-{label}@bench", env)
        self.client = FleetClient(url, namespace=namespace, settings=get_settings().model_copy(
            update={"require_worker": False, "namespace": namespace}))
        self.batch: list[str] = []

    def started(self) -> bool:
        return bool(self.client.redis.exists(self.client.keys.worker(self.worker.node))) \
            or not self.worker.alive()

    def running(self) -> int:
        """Batch jobs a worker has taken (their records say running)."""
        return sum(1 for j in self.batch if self.client.status(j).status is JobStatus.RUNNING)

    def burst(self, n: int, priority: str, tokens: int) -> list[str]:
        """``n`` submits in one pipeline."""
        now = self.client.clock.read(self.client.redis)
        subs = [submission(build_request(f"request {i}", {"max_new_tokens": tokens,
                                                          "priority": priority},
                                         self.client.settings),
                           self.client.keys, self.client.settings, False, now)
                for i in range(n)]
        pipe = self.client.redis.pipeline(transaction=False)
        for sub in subs:
            pipe.execute_command(*sub.call.command())
        for sub, reply in zip(subs, pipe.execute()):
            assert sub.call.decode(reply).admission is SubmitVerdict.QUEUED
        return [sub.job_id for sub in subs]

    def keep_batch_full(self, max_batch: int) -> None:
        """Batch jobs for every slot and as many again waiting behind them."""
        running = sum(1 for j in self.batch
                      if self.client.status(j).status in (JobStatus.QUEUED, JobStatus.RUNNING))
        if running < 2 * max_batch:
            self.batch += self.burst(2 * max_batch - running, "batch", BATCH_TOKENS)

    def round(self, live: int, tokens: int) -> tuple[list[float], float]:
        """Each live job's time to first token, and the round's live tokens/s."""
        states = [self.client.wait(j, timeout=600) for j in self.burst(live, "normal", tokens)]
        assert all(s.status is JobStatus.SUCCEEDED for s in states), states
        ttfts = [s.first_token_at - s.created_at for s in states
                 if s.first_token_at and s.created_at]
        span = max(s.finished_at or 0.0 for s in states) - min(s.created_at or 0.0
                                                                for s in states)
        return ttfts, live * tokens / span

    def close(self) -> None:
        for job_id in self.batch:
            self.client.cancel(job_id)
        self.worker.close()
        self.client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379")
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--live", type=int, default=32, help="live jobs per round")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="of each live job")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--off", action="store_true",
                        help="also a fleet with TOKENFLEET_PREEMPT_BATCH=0")
    args = parser.parse_args()
    labels = ["idle", "batch", *(["batch-off"] if args.off else [])]
    fleets = [Fleet(args.url, label, args) for label in labels]
    try:
        for fleet in fleets:
            wait_for(fleet.started, 300, f"worker {fleet.worker.node} to start")
            fleet.worker.check()
            fleet.client.submit("warm the script cache", max_new_tokens=1)
        ttfts: dict[str, list[float]] = {label: [] for label in labels}
        rates: dict[str, list[float]] = {label: [] for label in labels}
        for i in range(args.rounds):
            for fleet in fleets if i % 2 == 0 else fleets[::-1]:
                if fleet.label != "idle":
                    fleet.keep_batch_full(args.max_batch)
                    wait_for(lambda: fleet.running() == args.max_batch, 60,
                             "the batch jobs to fill the batch")
                got, rate = fleet.round(args.live, args.max_new_tokens)
                ttfts[fleet.label] += got
                rates[fleet.label].append(rate)
                print(f"round {i + 1} {fleet.label:>9}: TTFT p50 "
                      f"{statistics.median(got) * 1000:7.1f} ms, live {rate:8,.0f} tokens/s",
                      flush=True)
        idle_ttft, idle_rate = statistics.median(ttfts["idle"]), statistics.median(rates["idle"])
        for label in labels:
            ttft, rate = statistics.median(ttfts[label]), statistics.median(rates[label])
            print(f"{label:>9}: live TTFT p50 {ttft * 1000:7.1f} ms ({ttft / idle_ttft:.2f}x "
                  f"idle), live {rate:8,.0f} tokens/s ({rate / idle_rate:.2f}x idle)")
    finally:
        for fleet in fleets:
            fleet.close()


if __name__ == "__main__":
    main()
