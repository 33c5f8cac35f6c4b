"""Shared fixtures: a real redis-server per session on a free port, settings with a
fresh namespace per test, in-process workers and Celery worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

from helpers import (  # noqa: E402
    S3_BUCKET, MotoS3Server, RedisClusterServers, RedisServer, own_redis, s3_env, wait_until)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--redis", choices=("single", "cluster"), default="single",
                     help="what the tests' settings and `r` point at: one redis-server, or a "
                          "Redis Cluster of three masters (tests marked single_redis skip)")
    parser.addoption("--partitions", type=int, default=1,
                     help="give the tests' queue ('default', in each test's namespace) this "
                          "many partitions: its workers read every one (tests marked "
                          "one_partition skip)")
    parser.addoption("--affinity", action="store_true",
                     help="run with placement by prefix on (TOKENFLEET_AFFINITY) for every "
                          "client, worker and gateway, matching prompts from their first "
                          "character, so that nearly every job is placed on a worker's own "
                          "stream (tests marked shared_streams skip)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--affinity"):
        # In the environment: every Settings the tests make reads it, and every
        # process they start (Celery workers, gateways) inherits it.
        os.environ["TOKENFLEET_AFFINITY"] = "true"
        os.environ["TOKENFLEET_AFFINITY_MIN_CHARS"] = "1"


# The tiers (README, "Run the tests"). A bare `python -m pytest` is the unit and
# integration tests, minutes on two cores; the tests marked with one of these run
# in CI's further steps (.ci/run), or wherever a path or -m names them.
LATER_TIERS = ("slow", "faults", "vllm")
LEFT_OUT = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS and not config.option.markexpr:
        now, later = [], []
        for item in items:
            later_tier = any(item.get_closest_marker(m) for m in LATER_TIERS)
            (later if later_tier else now).append(item)
        if later:
            config.hook.pytest_deselected(items=later)
            items[:] = now
        config.stash[LEFT_OUT] = len(later)
    skips = []
    if config.getoption("--redis") == "cluster":
        skips.append(("single_redis", "single Redis only"))
    if config.getoption("--partitions") > 1:
        skips.append(("one_partition", "a queue of one partition only"))
    if config.getoption("--affinity"):
        skips.append(("shared_streams", "jobs on the shared streams only"))
    for item in items:
        for name, why in skips:
            marker = item.get_closest_marker(name)
            if marker is not None:
                item.add_marker(pytest.mark.skip(reason=f"{why}: {marker.args[0]}"))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    left_out = config.stash.get(LEFT_OUT, 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} tests of the slow, faults and vllm tiers left out: "
            "python -m pytest -m 'slow or faults or vllm' runs them (.ci/run does)")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_backend(request: pytest.FixtureRequest) -> Iterator[RedisServer | RedisClusterServers]:
    """The Redis the tests' settings name: the session's redis-server, or with
    ``--redis cluster`` a cluster of three masters of its own."""
    if request.config.getoption("--redis") == "cluster":
        cluster = own_redis(cluster=True)
        yield cluster
        cluster.close()
    else:
        yield request.getfixturevalue("redis_server")


@pytest.fixture(scope="session")
def redis_nodes(redis_backend: RedisServer | RedisClusterServers) -> list[RedisServer]:
    """The redis-servers behind the tests' Redis (a cluster's masters)."""
    return redis_backend.nodes


@pytest.fixture(scope="session")
def redis_url(redis_backend: RedisServer | RedisClusterServers) -> str:
    return redis_backend.url


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL of moto's S3 on a free port, with the bucket ``S3_BUCKET``
    (``helpers.s3_client(url)`` reads it, ``helpers.s3_env(url)`` points boto3 at it)."""
    server = MotoS3Server()
    yield server.url
    server.close()


@pytest.fixture
def s3_url(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A ``TOKENFLEET_FILES_URL`` on moto's S3 (a fresh prefix per test), with boto3's
    environment pointing at it for the test's length."""
    for name, value in s3_env(s3_server).items():
        monkeypatch.setenv(name, value)
    return f"s3://{S3_BUCKET}/t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def settings(redis_url: str, namespace: str, request: pytest.FixtureRequest) -> Any:
    from tokenfleet.shared.settings import Settings

    # The tests' queue is named, not the model's name (a worker's default),
    # so that the tests submit to it without naming a model.
    settings = Settings(redis_url=redis_url, namespace=namespace, queue="default", block_ms=20,
                        heartbeat_s=0.5, max_batch=16, max_batch_tokens=262_144, prefetch=4)
    partitions = request.config.getoption("--partitions")
    if partitions > 1:  # before any client or worker reads the queue's partitions
        from helpers import redis_client

        from tokenfleet.shared.wire.declared import set_partitions
        from tokenfleet.shared.wire.keys import Keys

        r = redis_client(redis_url)
        set_partitions(r, Keys.for_url(namespace, redis_url), settings.queue, partitions)
        r.close()
    return settings


@pytest.fixture
def r(redis_url: str) -> Iterator[redis.Redis]:
    from helpers import redis_client

    client = redis_client(redis_url)
    yield client
    client.close()


@pytest.fixture
def client(settings: Any) -> Iterator[Any]:
    from tokenfleet import FleetClient

    with FleetClient(settings=settings) as c:
        yield c


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model, exported the way a user would: `tokenfleet export-model`."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run([sys.executable, "-m", "tokenfleet.cli.app", "export-model", "tiny", str(out)],
                   check=True, cwd=ROOT, timeout=120)
    return out


@pytest.fixture(scope="session")
def loaded_tiny(tiny_dir: Path) -> tuple[Any, Any]:
    from tokenfleet.shared import models

    return models.load(str(tiny_dir))


def env_value(value: Any) -> str:
    """A setting as its environment variable spells it (pydantic-settings reads
    JSON for anything that is not a string)."""
    return value if isinstance(value, str) else json.dumps(value)


@pytest.fixture
def worker_env(settings: Any) -> Iterator[Callable[..., Any]]:
    """A worker's settings as production makes them: the test's settings (and
    ``overrides``) put in the environment, then read by ``get_settings()`` as a
    Celery worker's bootstep does. The read must give back what was set: a
    field the environment cannot carry would leave the test's worker unlike a
    real one. The environment is the worker's alone: it is put back once read
    (a command the test runs is a user's shell, not the worker's), and
    ``get_settings()`` keeps what it read, as in a worker process."""
    from tokenfleet.shared.settings import get_settings

    def read(**overrides: Any) -> Any:
        wanted = settings.model_copy(update=overrides)
        with pytest.MonkeyPatch.context() as env:
            for name in settings.model_fields_set | set(overrides):
                env.setenv(f"TOKENFLEET_{name.upper()}", env_value(getattr(wanted, name)))
            # get_settings() reads the environment once per process: each worker
            # a test starts stands for a fresh Celery process, so it reads anew.
            get_settings.cache_clear()
            read_back = get_settings()
        assert read_back == wanted, {k: (v, getattr(read_back, k)) for k, v in wanted
                                     if getattr(read_back, k) != v}
        return read_back

    yield read
    get_settings.cache_clear()  # no later test reads this test's worker's settings


@pytest.fixture
def start_worker(worker_env: Callable[..., Any],
                 loaded_tiny: tuple[Any, Any]) -> Iterator[Callable[..., Any]]:
    """Start an in-process worker (the engine a Celery process runs) on the tiny
    model, its settings read from the environment as a Celery worker's are."""
    from helpers import assert_built_as_in_production

    from tokenfleet.workers.build import grammars, hf_engine
    from tokenfleet.workers.runner import HFRunner
    from tokenfleet.workers.service import Worker

    started: list[Any] = []

    def start(name: str = "w1@test", runner: Any = None, **overrides: Any) -> Any:
        model, tokenizer = loaded_tiny
        model_runner = HFRunner(model, tokenizer)
        worker_settings = worker_env(**overrides)
        engine = hf_engine(worker_settings, runner or model_runner, model_runner.eos_token_ids,
                           model_runner.max_model_len)
        # As workers/build.py does: structured output, where xgrammar is installed.
        engine.grammars = grammars(tokenizer, model_runner.vocab_size,
                                   model_runner.eos_token_ids, worker_settings)
        worker = Worker(worker_settings, engine, tokenizer, name=name)
        assert_built_as_in_production(worker, worker_settings)
        worker.start()
        started.append(worker)
        # Submits require a live worker by default: wait for its first heartbeat,
        # which lists it as serving its queue (as a Celery worker's fixture does).
        served = worker.keys.queue_workers(worker.partitions[0])
        wait_until(lambda: worker.redis.zscore(served, name) is not None, timeout=30,
                   what=f"worker {name} to send its first heartbeat")
        return worker

    yield start
    for worker in started:
        worker.stop(grace_s=0)
        if worker.engine.grammars is not None:
            worker.engine.grammars.close()


class CeleryWorker:
    """`celery -A tokenfleet.workers.app worker -P solo` as a child process."""

    def __init__(self, settings: Any, node: str, model: str, extra_env: dict[str, str]) -> None:
        self.node = node
        env = {**os.environ, "TOKENFLEET_REDIS_URL": settings.redis_url,
               "TOKENFLEET_NAMESPACE": settings.namespace, "TOKENFLEET_MODEL": model,
               "TOKENFLEET_QUEUE": settings.queue,
               "TOKENFLEET_BLOCK_MS": "20", "TOKENFLEET_HEARTBEAT_S": "0.5",
               "TOKENFLEET_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra_env}
        from tokenfleet.workers.pinning import celery_command

        self.log = tempfile.NamedTemporaryFile(prefix=f"celery-{node}-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(celery_command(node, "INFO"), env=env, cwd=ROOT,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self.log.close()


@pytest.fixture
def celery_workers(settings: Any, tiny_dir: Path, r: redis.Redis) -> Iterator[Callable[..., CeleryWorker]]:
    from tokenfleet.shared.wire.keys import Keys

    procs: list[CeleryWorker] = []
    keys = Keys(settings.namespace)

    def start(node: str = "cpu@test", model: str | None = None, wait: bool = True,
              **env: str) -> CeleryWorker:
        worker = CeleryWorker(settings, node, model or str(tiny_dir), env)
        procs.append(worker)
        if wait:
            # Generous: on a loaded machine the imports and the model's load alone
            # take a minute or more.
            wait_until(lambda: r.exists(keys.worker(node)) or worker.proc.poll() is not None,
                       timeout=180, what=f"celery worker {node} to send its first heartbeat")
            assert worker.proc.poll() is None, worker.output()
        return worker

    yield start
    for worker in procs:
        worker.close()
