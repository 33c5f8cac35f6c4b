"""What one blocking ``wait()`` costs when the job has ended: the client's
subscribe, read of the record and unsubscribe, and how many connections Redis
accepted meanwhile. Jobs are queued with no worker and marked ended by hand,
so only the client's own round trips are timed.

    python tests/tools/wait_latency.py --url redis://127.0.0.1:6379 --jobs 50 --rounds 40
"""

from __future__ import annotations

import argparse
import time
import uuid

import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import Keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379")
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    namespace = f"waitlat-{uuid.uuid4().hex[:8]}"
    keys = Keys(namespace)
    r = redis.Redis.from_url(args.url)
    with FleetClient(args.url, namespace=namespace) as client:
        ids = [client.submit(f"job {i}", max_new_tokens=4, require_worker=False)
               for i in range(args.jobs)]
        for job_id in ids:
            r.hset(keys.job(job_id), mapping={"status": "succeeded", "finish_reason": "length",
                                              "text": "x", "token_ids": "[1]"})
        before = r.info("stats")["total_connections_received"]
        started = time.perf_counter()
        for _ in range(args.rounds):
            for job_id in ids:
                client.wait(job_id, timeout=5)
        seconds = time.perf_counter() - started
        made = r.info("stats")["total_connections_received"] - before
    calls = args.jobs * args.rounds
    print(f"{seconds / calls * 1e6:.0f} us per wait() of an ended job; "
          f"{made} connections accepted for {calls} calls")
    for key in r.scan_iter(f"{namespace}:*"):
        r.delete(key)


if __name__ == "__main__":
    main()
