"""Small test helpers."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tokenfleet.shared.wire.keys import job_id_in
from tokenfleet.shared.redis.connect import connect, is_cluster
from tokenfleet.bench.procs import free_port  # the tests use it too
from tokenfleet.workers.output_processor import step


def direct_greedy(loaded: tuple[Any, Any], jobs: list[tuple[str, int]]) -> list[str]:
    """The undisturbed run of (prompt, max_new_tokens) jobs: the same engine
    in-process, no Redis, no faults; greedy texts for a fault test to match."""
    from tokenfleet.shared.wire.schemas import SamplingParams
    from tokenfleet.workers.detokenizer import TextStream
    from tokenfleet.workers.hf_engine import HFEngine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.scheduler import Scheduler
    from tokenfleet.workers.sequence import Sequence

    model, tok = loaded
    runner = HFRunner(model, tok)
    sched = Scheduler(64, runner.eos_token_ids, runner.max_model_len)
    seqs = [Sequence(str(i), tok(p)["input_ids"], SamplingParams(max_new_tokens=n, temperature=0.0),
                     TextStream(tok)) for i, (p, n) in enumerate(jobs)]
    engine = HFEngine(sched, runner)
    for s in seqs:
        engine.add(s)
    while engine.has_work:
        step(engine)
    return [s.text.text for s in seqs]


# -- a job's tokens as Redis and its consumers hold them --------------------------
# An event carries one token or several (the worker coalesces a job's tokens);
# its log entry id is '0-<n>', n the index after its last token, plus LOG_BAND
# per attempt past the first (log_prefix.lua).

def follow_all(settings: Any, job_ids: list[str]) -> tuple[threading.Thread, dict[str, list[Any]]]:
    """Stream every job from the start, on a loop of its own, as async consumers would."""
    from tokenfleet import AsyncFleetClient

    seen: dict[str, list[Any]] = {}

    async def main() -> None:
        async with AsyncFleetClient(settings=settings) as c:
            async def one(job_id: str) -> None:
                seen[job_id] = [e async for e in c.stream(job_id, timeout=240)]
            await asyncio.gather(*(one(j) for j in job_ids))

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    return thread, seen


def logged_count(r: redis.Redis, keys: Any, job_id: str) -> int:
    """How many tokens the job's log holds: its top token entry's id."""
    from tokenfleet.shared.wire.worker_scripts import LOG_BAND

    top = r.xrevrange(keys.out(job_id), "0-18446744073709551615", "-", count=1)
    return int(top[0][0].split(b"-")[1]) % LOG_BAND if top else 0


def logged_tokens(r: redis.Redis, keys: Any, job_id: str) -> tuple[list[int], int, bool]:
    """The job's token log: its tokens in order, how many are missing between
    them (a gap), and whether it ends with the end event."""
    from tokenfleet.shared.wire.serialization import loads
    from tokenfleet.shared.wire.worker_scripts import LOG_BAND

    tokens: list[int] = []
    gaps, ended = 0, False
    for raw_id, fields in r.xrange(keys.out(job_id)):
        ms, end = (int(x) for x in raw_id.split(b"-"))
        if ms == 1:
            ended = True
            continue
        ids = loads(fields[b"e"])["token_ids"]
        end %= LOG_BAND
        gaps += end - len(ids) - len(tokens) - gaps
        tokens.extend(ids)
    return tokens, gaps, ended


def stream_fault(events: Any, state: Any) -> str:
    """What is wrong with what one ``stream()`` consumer saw; '' when it is the job:
    contiguous events from token 0, their tokens and text the job's."""
    if not isinstance(events, list):
        return f"stream() raised {events!r}" if events is not None else "stream() never ended"
    starts = [e.index for e in events]
    if starts != [0, *(e.end for e in events[:-1])]:
        return f"events start at {starts}: not contiguous from 0"
    tokens = [t for e in events for t in e.token_ids]
    if tokens != state.token_ids:
        return f"{len(tokens)} tokens streamed, {len(state.token_ids)} in the result"
    text = "".join(e.text for e in events)
    return "" if text == state.text else f"text {text!r} != {state.text!r}"


class ChannelTally:
    """Counts every token and end event published on every job channel of a
    namespace: ``tokens[(job id, token index)]``, ``ends[job id]``. On a
    cluster the channels are shard channels, which no pattern matches: the
    tally hears the channels of ``job_ids``."""

    def __init__(self, url: str, keys: Any, job_ids: list[str] | None = None) -> None:
        self.tokens: Counter[tuple[str, int]] = Counter()
        self.ends: Counter[str] = Counter()
        self._ended = threading.Condition()
        self._client = connect(url)  # a plain or a cluster URL
        if is_cluster(url):
            # A connection per node, each read by a thread of its own: redis-py's
            # cluster pub/sub reads its nodes in turn, waiting on each.
            assert job_ids, "a tally of shard channels names its jobs"
            by_node: dict[str, Any] = {}
            for job_id in job_ids:
                owner = self._client.get_node_from_key(keys.events(job_id))
                pubsub = by_node.get(owner.name)
                if pubsub is None:
                    pubsub = by_node[owner.name] = owner.redis_connection.pubsub()
                pubsub.ssubscribe(keys.events(job_id))
            self._pubsubs = list(by_node.values())
        else:
            self._pubsubs = [self._client.pubsub()]
            self._pubsubs[0].psubscribe(keys.events("*"))
        self._prefix = keys.events("")
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(p,), daemon=True)
                         for p in self._pubsubs]
        for thread in self._threads:
            thread.start()

    def _run(self, pubsub: Any) -> None:
        from tokenfleet.shared.wire.serialization import loads

        while not self._stop.is_set():
            try:
                message = pubsub.get_message(timeout=0.2)
            except redis.exceptions.ConnectionError:
                continue
            if message is None or message["type"] not in ("pmessage", "smessage"):
                continue
            job_id = job_id_in(message["channel"].decode(), self._prefix)
            event = loads(message["data"])
            with self._ended:
                if event["k"] == "tok":
                    for k in range(event["index"], event["index"] + len(event["token_ids"])):
                        self.tokens[(job_id, k)] += 1
                else:
                    self.ends[job_id] += 1
                    self._ended.notify_all()

    def wait_ended(self, job_ids: list[str], timeout: float) -> None:
        """Until every job's end event has come in on this subscription.

        A client's ``wait()`` can return before this connection has read the
        last end (another connection, another thread); a test that counts
        ends must wait for them here, or it reads a missing end as a fault.
        """
        with self._ended:
            if not self._ended.wait_for(lambda: all(self.ends[j] for j in job_ids), timeout):
                missing = [j for j in job_ids if not self.ends[j]]
                raise TimeoutError(f"no end event in {timeout}s for {len(missing)} jobs: "
                                   f"{missing[:5]}")

    def ends_not_once(self, job_ids: list[str]) -> dict[str, int]:
        """The jobs whose end was published other than once, with the count."""
        return {j: self.ends[j] for j in job_ids if self.ends[j] != 1}

    @property
    def duplicated(self) -> int:
        """Tokens published more than once (their extra copies)."""
        return sum(c - 1 for c in self.tokens.values() if c > 1)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        for pubsub in self._pubsubs:
            pubsub.close()
        self._client.close()


# Figures the fault-injection suite prints at the end of the run (name, figures).
FIGURES: list[tuple[str, dict[str, Any]]] = []


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.02) -> Any:
    """Poll an external process's state (a server, a child process) until it holds.

    For state owned by another process there is no event to wait on; the poll is
    bounded, and the failure names what never happened.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def stop_groups(procs: list[subprocess.Popen[Any]], timeout: float = 30) -> None:
    """Stop processes started with ``start_new_session``, each with its children,
    in the order given (a server others use last): SIGTERM, as Ctrl-C's drain
    would, then SIGKILL if the group outlives ``timeout``."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class RedisServer:
    """A redis-server the tests own: they may stop, kill and restart it."""

    def __init__(self, appendonly: bool = False, cluster: bool = False,
                 extra: tuple[str, ...] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: `apt-get install redis-server` "
                        "(.ci/run does this)")
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tokenfleet-redis-")
        self.appendonly = appendonly
        self.cluster = cluster
        self.bus_port = free_port() if cluster else 0
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def nodes(self) -> list[RedisServer]:
        """The servers behind this Redis: itself (as a cluster's ``nodes``)."""
        return [self]

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", self.dir, "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always"]
        if self.cluster:
            # The bus port is port + 10000 unless given: a free port above 55535 has none.
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-port", str(self.bus_port)]
        args += self.extra
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        wait_until(lambda: _pings(client), timeout=10, what="redis-server to answer PING")
        client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisClusterServers:
    """A Redis Cluster of ``masters`` redis-servers on free ports, each with
    ``replicas`` replicas, made as a user makes one: ``redis-cli --cluster create``.
    ``node_timeout_ms`` is how long a master may be unreachable before its
    replica takes over; without ``full_coverage`` the other masters go on serving
    their slots meanwhile (else every node answers CLUSTERDOWN)."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 15000,
                 full_coverage: bool = True, appendonly: bool = False) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            pytest.fail("redis-cli is not installed (it comes with redis-server; .ci/run "
                        "installs both)")
        extra = ("--cluster-node-timeout", str(node_timeout_ms),
                 "--cluster-require-full-coverage", "yes" if full_coverage else "no")
        self.nodes = [RedisServer(cluster=True, extra=extra, appendonly=appendonly)
                      for _ in range(masters * (1 + replicas))]
        subprocess.run([cli, "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self._wait_ok()

    def _wait_ok(self) -> None:
        probe = redis.Redis(port=self.nodes[0].port)
        wait_until(lambda: probe.cluster("info").get("cluster_state") == "ok", timeout=30,
                   what="the cluster to cover every slot")
        probe.close()

    @property
    def url(self) -> str:
        """Any one node: the clients find the others."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        """Every node, with SIGTERM: each writes its append-only file and its
        cluster config (nodes.conf), and exits."""
        for node in self.nodes:
            node.stop()

    def start(self) -> None:
        """Every node again, on its port and directory: each reloads its data and
        its place in the cluster."""
        for node in self.nodes:
            node.start()
        self._wait_ok()

    def close(self) -> None:
        for node in self.nodes:
            node.close()


def own_redis(cluster: bool, appendonly: bool = False) -> RedisServer | RedisClusterServers:
    """A Redis of the caller's own: one redis-server, or a cluster of three masters."""
    if cluster:
        return RedisClusterServers(masters=3, appendonly=appendonly)
    return RedisServer(appendonly=appendonly)


def redis_client(url: str) -> redis.Redis:
    """Plain redis-py on one server (no retries, as a test wants); a cluster client else."""
    from tokenfleet.shared.redis.connect import connect, is_cluster

    return connect(url) if is_cluster(url) else redis.Redis.from_url(url)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False


class MotoS3Server:
    """moto's S3 in a process of its own on a free port (so a test's tracemalloc
    sees only the client's memory), with one bucket, :data:`S3_BUCKET`.

    S3 asks 5 MiB of every multipart part but the last; this server asks
    ``min_part_bytes``, so that a test can use small parts and small objects."""

    def __init__(self, min_part_bytes: int = 1 << 20) -> None:
        self.port = free_port()
        env = {**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(min_part_bytes)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._listens, timeout=30, what="moto's S3 server to listen")
        s3_client(self.url).create_bucket(Bucket=S3_BUCKET)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listens(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"moto's S3 server exited with {self.proc.returncode}")
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


S3_BUCKET = "tokenfleet-test"
S3_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                  "region_name": "us-east-1"}


def s3_client(endpoint_url: str) -> Any:
    """A boto3 S3 client of the test server at ``endpoint_url`` (the ``s3_server`` fixture)."""
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, **S3_CREDENTIALS)


def s3_env(endpoint_url: str) -> dict[str, str]:
    """The environment in which boto3 finds the test server, as a deployment sets it."""
    return {"AWS_ENDPOINT_URL_S3": endpoint_url,
            "AWS_ACCESS_KEY_ID": S3_CREDENTIALS["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": S3_CREDENTIALS["aws_secret_access_key"],
            "AWS_DEFAULT_REGION": S3_CREDENTIALS["region_name"]}


def queue_parts(r: Any, keys: Any, queue: str = "default") -> list[str]:
    """The partitions of ``queue`` (the queue alone when it has one): the queues its
    jobs go to (``pytest --partitions P`` gives the tests' queue P)."""
    from tokenfleet.shared.wire.declared import queue_partitions
    from tokenfleet.shared.wire.keys import partitions_of

    return partitions_of(queue, queue_partitions(r, keys, queue))


def dead_letters(r: Any, keys: Any, queue: str = "default") -> list[dict[str, Any]]:
    """Every dead letter of ``queue``, its partitions' one after another."""
    from tokenfleet.shared.wire.serialization import loads

    return [loads(f[b"data"]) for part in queue_parts(r, keys, queue)
            for _, f in r.xrange(keys.dlq(part))]


def url_id(job_id: str) -> str:
    """A job id as a URL's path holds it: a partition's ids have a '#' (``%23``)."""
    from urllib.parse import quote

    return quote(job_id, safe=":")


def written_keys(r: Any, namespace: str) -> list[bytes]:
    """Every key of the namespace but the queue's partition count (``pytest
    --partitions`` sets it before a test) and the mark a gateway leaves at its
    start (its tenants' indexes filled): what the test's requests wrote."""
    from tokenfleet.shared.wire.keys import Keys

    keys = Keys(namespace)
    before = {keys.partitions("default").encode(), keys.tenant_indexes_done.encode()}
    return [k for k in r.scan_iter(match=f"{namespace}:*") if k not in before]


def assert_built_as_in_production(worker: Any, read: Any = None) -> None:
    """The worker runs on the settings a Celery worker reads (``get_settings()``),
    no hand-made copy: ``read``, what ``get_settings()`` gave when the worker's
    environment was set, or else what it gives now. (Asked again after the
    environment was put back, it can give a later read: twice on CI its cache
    was found emptied and filled from the test process's own environment.)"""
    from tokenfleet.shared.settings import get_settings

    read = get_settings() if read is None else read
    assert worker.settings == read, ("the worker's settings are not get_settings()'s", {
        name: (value, getattr(read, name)) for name, value in worker.settings
        if getattr(read, name) != value})
