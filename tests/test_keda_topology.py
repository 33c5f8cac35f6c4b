"""The KEDA pool of a partitioned queue with named tenants, as ``tokenfleet
deploy keda`` renders it, counts a job in any of the queue's streams: a
backlog of 100 reads 100 (the pool at zero wakes), and 0 once a worker has
ended every job (the pool may go back to zero). The base manifests' four
triggers name the default tenant's streams of an unpartitioned queue only: on
this queue they read 0 under the same 100 jobs, and the pool never wakes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner
from tokenfleet.shared.wire.keys import PRIORITIES, Keys
from tokenfleet.shared.wire.schemas import JobStatus
from tokenfleet.shared.settings import get_settings
from tokenfleet.shared.wire.topology import QueueTopology

from tests.test_keda_scaler import keda_reads

pytestmark = pytest.mark.timeout(180)
QUEUE, PARTS, TENANTS = "parts", 3, ("acme", "globex")


def cli(settings: Any, *args: str) -> str:
    from tokenfleet.cli.app import main

    result = CliRunner().invoke(main, list(args), env={
        "TOKENFLEET_REDIS_URL": settings.redis_url, "TOKENFLEET_NAMESPACE": settings.namespace})
    get_settings.cache_clear()  # read under the runner's environment: not this process's
    assert result.exit_code == 0, result.output
    return result.output


def pool_reads(r: Any, scaled: dict[str, Any]) -> int:
    """The ScaledObject's formula (a sum of its triggers), as KEDA evaluates it."""
    values = {t["name"]: keda_reads(r, t["metadata"]) for t in scaled["spec"]["triggers"]}
    formula = scaled["spec"]["advanced"]["scalingModifiers"]["formula"]
    assert formula == " + ".join(values), formula
    return sum(values.values())


def test_the_rendered_trigger_names_every_stream_of_a_partitioned_queue_with_tenants() -> None:
    keys = Keys("tokenfleet")
    topology = QueueTopology(keys, QUEUE, PARTS, TENANTS)
    from tokenfleet.cli.deploy import scaled_object

    scaled = scaled_object(topology, "pool", "pool", "tokenfleet-redis", 8)
    streams = [t["metadata"]["stream"] for t in scaled["spec"]["triggers"]]
    assert len(streams) == len(set(streams)) == PARTS * len(PRIORITIES) * (1 + len(TENANTS))
    assert "tokenfleet:q:{parts#2}:low:globex" in streams
    assert "tokenfleet:q:{parts#0}" in streams  # partition 0's default tenant, normal
    assert "tokenfleet:q:{parts}" not in streams  # a queue of P > 1 queues nothing there


def test_the_rendered_pool_reads_100_queued_jobs_as_100_and_zero_after_a_worker(
        settings: Any, r: Any, start_worker: Any) -> None:
    from tokenfleet import FleetClient

    cli(settings, "queue", "create", QUEUE, "--partitions", str(PARTS))
    with FleetClient(settings=settings) as client:
        ids = [client.submit("Hello", model=QUEUE, priority=PRIORITIES[i % 4],
                             tenant=(None, *TENANTS)[i % 3], max_new_tokens=2)
               for i in range(100)]
        scaled = json.loads(cli(settings, "deploy", "keda", QUEUE))
        assert scaled["metadata"]["annotations"]["tokenfleet/tenants"] == ",".join(TENANTS)
        # Every stream with a job is one a trigger names: the pool wakes for all 100.
        assert pool_reads(r, scaled) == 100
        start_worker(queue=QUEUE)
        for job_id in ids:
            assert client.wait(job_id, timeout=60).status is JobStatus.SUCCEEDED
        assert pool_reads(r, scaled) == 0


def test_the_rendered_pool_patched_into_a_queue_folder_keeps_every_stream(
        tmp_path: Any) -> None:
    """What docs/deploy.md tells an operator to do for a partitioned queue: the
    printed ScaledObject as a patch of the queue's folder. The pool's stream-tag
    replacement must not fold the partitions back into one stream."""
    import shutil

    from tokenfleet.cli.app import main

    from tests.kustomize import KUBE, of_kind, render

    printed = CliRunner().invoke(main, [
        "deploy", "keda", "default", "--offline", "--partitions", str(PARTS),
        *(a for t in TENANTS for a in ("--tenant", t)),
        "--name", "tokenfleet-worker", "--target", "tokenfleet-worker"])
    assert printed.exit_code == 0, printed.output
    root = tmp_path / "kubernetes"
    shutil.copytree(KUBE, root)
    folder = root / "base" / "queues" / "default"
    (folder / "autoscaler.json").write_text(printed.output)
    with (folder / "kustomization.yaml").open("a") as f:
        f.write("patches:\n  - path: autoscaler.json\n")
    objects = render("cpu", root)
    [scaled] = of_kind(objects, "ScaledObject")
    [auth] = of_kind(objects, "TriggerAuthentication")
    expected = QueueTopology(Keys("tokenfleet"), "default", PARTS, TENANTS).streams()
    assert [t["metadata"]["stream"] for t in scaled["spec"]["triggers"]] == expected
    assert scaled["spec"]["scaleTargetRef"]["name"] == "tokenfleet-worker-default"
    assert {t["authenticationRef"]["name"] for t in scaled["spec"]["triggers"]} == {
        auth["metadata"]["name"]}
