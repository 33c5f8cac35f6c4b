"""What the fleet's limits cost a submit in Redis: ``submit.lua``'s time per
call (``INFO commandstats``, ``evalsha``) with the limits of 0, 1, 8 and 64
workers published for the queue. A redis-server of its own; no worker runs
(the published limits are written as a worker's heartbeat writes them).

    python tests/tools/submit_limits_cost.py --submits 2000
"""

from __future__ import annotations

import argparse
import uuid

import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.limits import worker_limits
from tokenfleet.shared.settings import Settings
from tokenfleet.bench.procs import RedisProc


def usec_per_eval(r: redis.Redis) -> float:
    stats = r.info("commandstats").get("cmdstat_evalsha", {})
    return float(stats.get("usec_per_call", 0.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submits", type=int, default=2000)
    args = parser.parse_args()
    server = RedisProc()
    try:
        r = redis.Redis.from_url(server.url)
        published = worker_limits(Settings(), 1024).model_dump_json()
        for workers in (0, 1, 8, 64):
            settings = Settings(redis_url=server.url, namespace=uuid.uuid4().hex[:8],
                                max_queue=10 * args.submits)
            keys = Keys(settings.namespace)
            if workers:
                r.hset(keys.limits("default"),
                       mapping={f"w{i}@bench": published for i in range(workers)})
            r.config_resetstat()
            with FleetClient(settings=settings) as client:
                for _ in range(args.submits):
                    client.submit("Hello there", max_new_tokens=16, require_worker=False)
            print(f"{workers:>3} workers' limits published: submit.lua "
                  f"{usec_per_eval(r):.1f} µs a call ({args.submits} submits)")
    finally:
        server.close()


if __name__ == "__main__":
    main()
