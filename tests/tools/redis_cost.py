"""What Redis does per generated token on a worker's output path, at 1, 7 and 32
tokens per event: commands (``INFO commandstats`` calls, a script's own
commands counted one each as Redis counts them), Redis CPU in µs (the
scripts' ``usec`` in ``INFO commandstats``: the whole script, its commands
included; and the process's ``INFO cpu``, which adds reading and writing the
sockets) and bytes in (``INFO stats`` ``total_net_input_bytes``).

A redis-server of its own, no model and no Celery: ``--jobs`` job records
(running, attempt 1) and the worker's ``Publisher`` driven step by step, one
token per job per step, on a clock of its own that makes every event carry
exactly the tokens asked (``coalesce_tokens``; 1: ``coalesce_ms`` 0). Two
windows per setting: ``steady``, the events in the middle of the jobs (what
every further token costs), and ``job``, the whole output path of the jobs
(the first token alone, the end, ``finish.lua``); submit, start and the
client's reads are not in either (``commands_per_job.py`` has them).

    python tests/tools/redis_cost.py --jobs 64 --tokens 225
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import redis

from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import FinishReason, SamplingParams
from tokenfleet.shared.settings import get_settings
from tokenfleet.bench.procs import RedisProc
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.null_runner import null_tokenizer
from tokenfleet.workers.publisher import Publisher
from tokenfleet.workers.sequence import SeqOutput, Sequence

SCRIPT_COMMANDS = ("evalsha", "eval")


@dataclass(frozen=True)
class Counters:
    calls: dict[str, int]
    usec: dict[str, int]
    cpu_s: float
    bytes_in: int

    @staticmethod
    def read(r: redis.Redis) -> Counters:
        stats = r.info("commandstats")
        cpu = r.info("cpu")
        return Counters({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()},
                        {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in stats.items()},
                        float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
                        int(r.info("stats")["total_net_input_bytes"]))


def per_token(before: Counters, after: Counters, tokens: int) -> dict[str, Any]:
    """The counters' growth between two readings, per token; the readings'
    own INFO calls left out."""
    calls = {k: n - before.calls.get(k, 0) for k, n in after.calls.items() if k != "info"}
    calls = {k: n for k, n in calls.items() if n}
    usec = sum(after.usec.get(k, 0) - before.usec.get(k, 0) for k in SCRIPT_COMMANDS)
    return {
        "commands": sum(calls.values()) / tokens,
        "script_us": usec / tokens,
        "process_cpu_us": (after.cpu_s - before.cpu_s) * 1e6 / tokens,
        "bytes_in": (after.bytes_in - before.bytes_in) / tokens,
        "by_command": {k: round(n / tokens, 3) for k, n in
                       sorted(calls.items(), key=lambda kv: -kv[1])},
    }


class Clock:
    """The publisher's clock: a millisecond a step."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(url: str, per_event: int, jobs: int, tokens: int) -> dict[str, dict[str, Any]]:
    r = redis.Redis.from_url(url)
    namespace = f"cost{per_event}-{time.monotonic_ns()}"
    keys = Keys(namespace)
    # Events of exactly per_event tokens: a window no step reaches, so only
    # the count sends them (1: no window, every token at once).
    settings = get_settings().model_copy(update={
        "namespace": namespace, "coalesce_tokens": per_event,
        "coalesce_ms": 0.0 if per_event == 1 else 10_000.0})
    clock = Clock()
    publisher = Publisher(redis.Redis.from_url(url), keys, settings, "cost@tool", clock=clock)
    tokenizer = null_tokenizer()
    token = tokenizer.encode("x", add_special_tokens=False)[0]
    seqs = [Sequence(f"{namespace}:{i}", [1, 2], SamplingParams(max_new_tokens=tokens),
                     TextStream(tokenizer), entry_id="") for i in range(jobs)]
    for seq in seqs:
        r.hset(keys.job(seq.job_id), mapping={"status": "running", "attempts": 1})
    # The steady window: from after the first event of each job to before the
    # last full event, whole events only.
    first = 1 + per_event
    last = first + ((tokens - 1 - first) // per_event - 1) * per_event
    readings: dict[str, Counters] = {"job": Counters.read(r)}
    for index in range(tokens):
        if index == first:
            readings["steady"] = Counters.read(r)
        if index == last:
            readings["steady_end"] = Counters.read(r)
        end = index == tokens - 1
        outputs = []
        for seq in seqs:
            seq.generated.append(token)
            text = seq.text.push(token)
            if end:
                text += seq.finish(FinishReason.LENGTH)
            outputs.append(SeqOutput(seq, index, token, text, end))
        publisher.send(outputs)
        stored = publisher.collect()
        assert not stored.fenced and not stored.untrusted, stored
        clock.now += 0.001
    done = Counters.read(r)
    r.close()
    return {"steady": per_token(readings["steady"], readings["steady_end"],
                                (last - first) * jobs),
            "job": per_token(readings["job"], done, tokens * jobs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=64, help="jobs in the batch")
    parser.add_argument("--tokens", type=int, default=225, help="tokens each job makes")
    parser.add_argument("--per-event", default="1,7,32", help="tokens per event, a list")
    parser.add_argument("--redis-url", help="a server to use (default: one of its own)")
    args = parser.parse_args()
    server = None if args.redis_url else RedisProc()
    url = args.redis_url or server.url  # type: ignore[union-attr]
    try:
        print(f"{'tokens/event':>12} {'window':>7} {'cmds/token':>10} {'script µs':>9} "
              f"{'cpu µs':>7} {'bytes in':>8}  commands per token")
        for per_event in (int(n) for n in args.per_event.split(",")):
            figures = run(url, per_event, args.jobs, args.tokens)
            for window in ("steady", "job"):
                f = figures[window]
                top = ", ".join(f"{k} {v:g}" for k, v in list(f["by_command"].items())[:6])
                print(f"{per_event:>12} {window:>7} {f['commands']:>10.3f} "
                      f"{f['script_us']:>9.2f} {f['process_cpu_us']:>7.2f} "
                      f"{f['bytes_in']:>8.1f}  {top}")
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
