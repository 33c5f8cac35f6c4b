"""The console's fixtures: one real fleet for the module (redis-server, a worker
on the tiny model, a gateway, three keys) and one headless Chromium to drive it."""

from __future__ import annotations

import base64
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from selenium import webdriver

from tokenfleet import FleetClient
from tokenfleet.shared.settings import Settings
from tokenfleet.shared.wire.api_keys import create_key, new_key
from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import ApiKey
from tokenfleet.workers.runner import HFRunner

from console_helpers import HEARTBEAT_S, WORKER, Fleet, chrome
from gateway_server import gateways
from helpers import redis_client, wait_until

class PacedRunner(HFRunner):
    """The tiny model at a big model's pace, a step every 20 ms: a job of a few
    hundred tokens runs for seconds, long enough to watch its text arrive and to
    cancel it from its page."""

    step_s = 0.02

    def run(self, batch: Any) -> Any:
        time.sleep(self.step_s)  # simulated compute time, not synchronisation
        return super().run(batch)


class LogLines(logging.Handler):
    """Every log record of the module's gateway and worker (both run in this
    process), formatted with its traceback, for the secret scan."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def password_url(url: str, nodes: list[Any], user: str, password: str) -> str:
    """``url`` as an ACL user with a password: a Redis user the fleet's
    processes hold a secret for, so the scan has one to look for."""
    for node in nodes:
        admin = redis.Redis(port=node.port)
        admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"],
                          channels=["*"], categories=["+@all"])
        admin.close()
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.hostname}:{parts.port}"))


@pytest.fixture(scope="module")
def fleet(redis_url: str, redis_nodes: list[Any], loaded_tiny: tuple[Any, Any],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One namespace for the module: a paced tiny worker on 'default', a gateway
    (which runs the batch driver) and the keys of tenants acme and globex and of
    an admin. The fleet reaches Redis as a user with a password, and signs
    webhooks with a secret: the scan looks for both."""
    from tokenfleet.workers.build import hf_engine
    from tokenfleet.workers.service import Worker

    logs = LogLines()
    watched = [logging.getLogger(), logging.getLogger("uvicorn"),
               logging.getLogger("uvicorn.access")]
    for logger in watched:
        logger.addHandler(logs)
    tokenfleet_log = logging.getLogger("tokenfleet")
    level = tokenfleet_log.level
    tokenfleet_log.setLevel(logging.DEBUG)  # what a debugging operator would turn on

    user, password = f"console{uuid.uuid4().hex[:6]}", secrets.token_urlsafe(24)
    webhook_secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    files = tmp_path_factory.mktemp("files")
    settings = Settings(queue="default", redis_url=password_url(redis_url, redis_nodes, user,
                                                                password),
                        namespace=f"t{uuid.uuid4().hex[:10]}", block_ms=20,
                        heartbeat_s=HEARTBEAT_S, max_batch=16, max_batch_tokens=65_536,
                        prefetch=4, files_url=f"file://{files}", webhook_secret=webhook_secret)
    r = redis_client(settings.redis_url)
    keys = Keys(settings.namespace)
    model, tokenizer = loaded_tiny
    workers: list[Any] = []

    def start_worker(name: str, queue: str) -> Any:
        """A paced worker on ``queue``, once its first heartbeat lists it."""
        runner = PacedRunner(model, tokenizer)
        own = settings.model_copy(update={"queue": queue})
        worker = Worker(own, hf_engine(own, runner, runner.eos_token_ids, runner.max_model_len),
                        tokenizer, name=name)
        worker.start()
        workers.append(worker)
        wait_until(lambda: r.zscore(keys.queue_workers(queue), name) is not None,
                   timeout=30, what=f"worker {name}'s first heartbeat")
        return worker

    def make_key(tenant: str, admin: bool = False) -> str:
        key, key_id = new_key()
        create_key(r, keys, ApiKey(key_id=key_id, tenant=tenant, created_at=time.time(),
                                   admin=admin), key)
        return key

    try:
        start_worker(WORKER, "default")
        acme, globex, admin = make_key("acme"), make_key("globex"), make_key("ops", admin=True)
        with gateways(settings) as start, FleetClient(settings=settings) as client:
            fleet = Fleet(settings=settings, r=r, keys=keys, http=start(), client=client,
                          acme=acme, globex=globex, admin=admin, webhook_secret=webhook_secret,
                          redis_password=password, logs=logs.lines, start_worker=start_worker)
            try:
                yield fleet
            finally:
                for opened in fleet.clients:
                    opened.close()
    finally:
        for worker in workers:
            worker.stop(grace_s=0)
        r.close()
        for node in redis_nodes:
            with contextlib.closing(redis.Redis(port=node.port)) as node_admin:
                node_admin.acl_deluser(user)
        tokenfleet_log.setLevel(level)
        for logger in watched:
            logger.removeHandler(logs)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    """One browser for the module (two cores: a browser per test would cost
    more than the tests)."""
    driver = chrome()
    yield driver
    driver.quit()


