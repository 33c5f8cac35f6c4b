"""ACL users and TLS: one URL configures clients, workers and Celery alike."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tokenfleet import FleetClient
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.settings import Settings

from helpers import RedisServer, wait_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def acl_url() -> Iterator[str]:
    server = RedisServer()
    admin = redis.Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "fleet", "on", ">s3cret", "~*", "&*", "+@all")
    admin.execute_command("ACL", "SETUSER", "default", "off")  # no anonymous access
    admin.close()
    yield f"redis://fleet:s3cret@127.0.0.1:{server.port}/0"
    server.close()


class TlsRedisServer(RedisServer):
    """redis-server speaking TLS only, with a throwaway CA."""

    def __init__(self, certs: Path) -> None:
        self.certs = certs
        super().__init__()

    @property
    def url(self) -> str:
        return (f"rediss://127.0.0.1:{self.port}/0?ssl_cert_reqs=required"
                f"&ssl_ca_certs={self.certs / 'ca.crt'}")

    def start(self) -> None:
        c = self.certs
        self.proc = subprocess.Popen(
            [self.binary, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(c / "server.crt"), "--tls-key-file", str(c / "server.key"),
             "--tls-ca-cert-file", str(c / "ca.crt"), "--tls-auth-clients", "no",
             "--save", "", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)

        def pings() -> bool:
            try:
                return bool(client.ping())
            except redis.exceptions.ConnectionError:
                return False

        wait_until(pings, timeout=10, what="the TLS redis-server to answer")
        client.close()


def make_certs(out: Path) -> Path:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=out, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=tokenfleet-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    (out / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf")
    return out


@pytest.fixture
def tls_url(tmp_path: Path) -> Iterator[str]:
    server = TlsRedisServer(make_certs(tmp_path))
    yield server.url
    server.close()


def run_one_job(url: str, namespace: str, celery_workers: Any) -> None:
    settings = Settings(queue="default", redis_url=url, namespace=namespace)
    celery_workers("cpu@secure", TOKENFLEET_REDIS_URL=url, wait=False)
    with FleetClient(settings=settings) as client:
        # The worker is still starting: queue ahead of it.
        job_id = client.submit("over a guarded connection", max_new_tokens=5,
                               require_worker=False)
        state = client.wait(job_id, timeout=120)
        assert state.status is JobStatus.SUCCEEDED and state.worker == "cpu@secure"


@pytest.mark.slow
def test_an_acl_user_url_works_for_clients_and_celery_workers(
    acl_url: str, namespace: str, celery_workers: Any
) -> None:
    run_one_job(acl_url, namespace, celery_workers)
    wrong = acl_url.replace("s3cret", "wrong")
    with pytest.raises(redis.exceptions.AuthenticationError):
        FleetClient(settings=Settings(redis_url=wrong, namespace=namespace)).submit("x")


@pytest.mark.slow
def test_a_rediss_url_works_for_clients_and_celery_workers(
    tls_url: str, namespace: str, celery_workers: Any
) -> None:
    run_one_job(tls_url, namespace, celery_workers)
