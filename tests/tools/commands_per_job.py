"""What Redis runs per job, command by command: a redis-server, one worker with
the null runner (no model), ``--jobs`` jobs of ``--tokens`` tokens submitted at
once and waited for (or streamed) one after the other by the blocking client;
``INFO commandstats`` before and after, divided by the jobs. Commands inside a
Lua script count one each, as Redis counts them.

    python tests/tools/commands_per_job.py --jobs 64 --tokens 1
    python tests/tools/commands_per_job.py --jobs 64 --tokens 32 --stream
"""

from __future__ import annotations

import argparse
import uuid
from contextlib import ExitStack, closing

import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.settings import get_settings
from tokenfleet.bench.modes import BenchEnv
from tokenfleet.bench.procs import CeleryProc, RedisProc, wait_for
from tokenfleet.bench.redis_cost import sample
from tokenfleet.workers.null_runner import NULL_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--stream", action="store_true", help="stream() each job, not wait()")
    args = parser.parse_args()
    with ExitStack() as stack:
        server = RedisProc()
        stack.callback(server.close)
        env = BenchEnv(server.url, NULL_MODEL, "cpu", 1, uuid.uuid4().hex[:8])
        namespace = env.namespace("cmds")
        keys = Keys(namespace)
        r = redis.Redis.from_url(server.url)
        node = "cmds@bench"
        stack.enter_context(closing(CeleryProc("tokenfleet.workers.app", node,
                                               env.worker_env(namespace, NULL_MODEL, 64))))
        wait_for(lambda: bool(r.exists(keys.worker(node))), 120, "the worker to start")
        settings = get_settings().model_copy(update={"require_worker": False})
        client = stack.enter_context(FleetClient(server.url, namespace=namespace,
                                                 settings=settings))
        client.wait(client.submit("warm up", max_new_tokens=2), timeout=60)
        before = sample(r)
        ids = [client.submit(f"prompt {i}", max_new_tokens=args.tokens, temperature=0.0)
               for i in range(args.jobs)]
        for job_id in ids:
            if args.stream:
                for _ in client.stream(job_id, timeout=60):
                    pass
            else:
                client.wait(job_id, timeout=60)
        after = sample(r)
    calls = {name: n - before.calls.get(name, 0) for name, n in after.calls.items()}
    for name, n in sorted(calls.items(), key=lambda item: -item[1]):
        if n:
            print(f"{name:<14} {n / args.jobs:7.2f}")
    print(f"{'all':<14} {sum(calls.values()) / args.jobs:7.2f} per job of {args.tokens} tokens")


if __name__ == "__main__":
    main()
