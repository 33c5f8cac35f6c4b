"""deploy/kubernetes renders, validates, and says what the code means.

Each overlay is rendered once with `kubectl kustomize`; every object is checked
against the Kubernetes schemas (kubernetes-validate, offline) or the vendored
CRD schemas (deploy/kubernetes/schemas), then against the fleet's own names:
the streams and group of shared/wire/keys.py, the settings, the drain grace.
"""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest

from tests.kustomize import KUBE, Obj, env_of, named, of_kind, render, render_with_prometheus
from tests.test_compose import options_of
from tokenfleet.shared.wire.keys import PRIORITIES, Keys, level_queue
from tokenfleet.shared.settings import Settings

OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.33.0"
# The trigger parameters KEDA v2.20.2's redis-streams scaler reads from metadata.
REDIS_STREAMS_PARAMS = {"address", "addresses", "host", "hosts", "port", "ports", "username",
                        "password", "stream", "consumerGroup", "pendingEntriesCount",
                        "streamLength", "lagCount", "activationLagCount", "databaseIndex",
                        "enableTLS", "unsafeSsl"}


def crd_schemas() -> dict[str, Obj]:
    found: dict[str, Obj] = {}
    for path in sorted((KUBE / "schemas").glob("*.json")):
        found.update(json.loads(path.read_text())["schemas"])
    return found


@pytest.fixture(scope="module", params=[*OVERLAYS, "cpu+prometheus"])
def rendered(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    overlay, _, prometheus = request.param.partition("+")
    if prometheus:  # the components for a cluster with Prometheus (docs/deploy.md)
        return render_with_prometheus(overlay, tmp_path_factory.mktemp("kube"))
    return render(overlay)


def workers(objects: list[Obj]) -> list[Obj]:
    return [d for d in of_kind(objects, "Deployment")
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]


def test_every_object_validates_against_its_schema(rendered: list[Obj]) -> None:
    crds = crd_schemas()
    for obj in rendered:
        key = f"{obj['apiVersion']}/{obj['kind']}"
        if key in crds:
            jsonschema.validate(obj, crds[key])
        else:  # raises SchemaNotFoundError for a kind neither knows
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_a_typo_in_a_scaled_object_is_caught() -> None:
    schema = crd_schemas()["keda.sh/v1alpha1/ScaledObject"]
    good = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "w"},
            "spec": {"scaleTargetRef": {"name": "w"},
                     "triggers": [{"type": "redis-streams", "metadata": {"stream": "s"}}]}}
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        jsonschema.validate({**good, "spec": {**good["spec"], "minReplicas": 0}}, schema)


def test_each_pool_scales_on_every_priority_level_of_its_queue(rendered: list[Obj]) -> None:
    keys = Keys(Settings.model_fields["namespace"].default)
    for scaled in of_kind(rendered, "ScaledObject"):
        spec = scaled["spec"]
        worker = named(rendered, "Deployment", spec["scaleTargetRef"]["name"])
        queue = env_of(worker["spec"]["template"]["spec"]["containers"][0])["TOKENFLEET_QUEUE"]
        triggers = {t["name"]: t for t in spec["triggers"]}
        assert set(triggers) - {"tokens"} == set(PRIORITIES)
        for priority in PRIORITIES:
            trigger, meta = triggers[priority], triggers[priority]["metadata"]
            assert trigger["type"] == "redis-streams" and set(meta) <= REDIS_STREAMS_PARAMS
            assert meta["stream"] == keys.queue(level_queue(queue, priority))
            # No consumerGroup: KEDA reads XLEN (its streamLength mode), which
            # counts running jobs too and needs no group (docs/deploy.md).
            assert "consumerGroup" not in meta and int(meta["streamLength"]) > 0
        # The sum of the levels' lengths sizes the pool; one waiting job wakes it.
        modifiers = spec["advanced"]["scalingModifiers"]
        levels = " + ".join(PRIORITIES)
        assert modifiers["formula"] == (
            f"max({levels}, tokens / 256)" if "tokens" in triggers else levels)
        assert modifiers["activationTarget"] == "0" and spec["minReplicaCount"] == 0
        assert spec["cooldownPeriod"] > 0
        if "tokens" in triggers:  # the prometheus-scaler component
            meta = triggers["tokens"]["metadata"]
            assert triggers["tokens"]["type"] == "prometheus"
            assert meta["query"] == f'sum(tokenfleet_queue_backlog_tokens{{queue="{queue}"}})'
            assert int(meta["threshold"]) == 256 * int(modifiers["target"])


def test_the_scaler_reads_redis_with_the_fleets_secret(rendered: list[Obj]) -> None:
    for scaled in of_kind(rendered, "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            if trigger["type"] == "prometheus":
                continue  # the exporter's numbers, from Prometheus with no password
            auth = named(rendered, "TriggerAuthentication", trigger["authenticationRef"]["name"])
            refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
            assert set(refs) == {"address", "password"}
            for ref in refs.values():
                assert ref["key"] in named(rendered, "Secret", ref["name"])["data"]


def test_workers_outlast_their_drain_and_probe_the_health_endpoints(
        rendered: list[Obj]) -> None:
    assert workers(rendered)
    for worker in workers(rendered):
        pod = worker["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = env_of(container)
        assert set(env) - {"HF_HUB_OFFLINE"} <= {f"TOKENFLEET_{f.upper()}"
                                                  for f in Settings.model_fields}
        drain = float(env.get("TOKENFLEET_DRAIN_GRACE_S",
                              Settings.model_fields["drain_grace_s"].default))
        assert pod["terminationGracePeriodSeconds"] >= drain + 15
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == int(env["TOKENFLEET_METRICS_PORT"])
        probes = {kind: container[f"{kind}Probe"]["httpGet"] for kind in
                  ("startup", "liveness", "readiness")}
        assert {kind: (p["path"], p["port"]) for kind, p in probes.items()} == {
            "startup": ("/healthz", "metrics"), "liveness": ("/healthz", "metrics"),
            "readiness": ("/readyz", "metrics")}
        assert container["args"][0] == "worker"
        assert pod["securityContext"]["runAsNonRoot"] is True


def test_containers_run_tokenfleet_commands_with_real_options(rendered: list[Obj]) -> None:
    for deployment in of_kind(rendered, "Deployment"):
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        used = {arg for arg in args[1:] if arg.startswith("--")}
        assert used and used <= options_of(args[0]), (args, used - options_of(args[0]))


def test_gateway_probes_and_service(rendered: list[Obj]) -> None:
    gateway = named(rendered, "Deployment", "tokenfleet-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    service = named(rendered, "Service", "tokenfleet-gateway")
    assert service["spec"]["selector"].items() <= gateway["spec"]["template"]["metadata"][
        "labels"].items()


def test_disruption_budgets_and_the_monitor_select_real_pods(rendered: list[Obj]) -> None:
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in of_kind(rendered, "Deployment")]

    def selects(selector: dict[str, str]) -> int:
        return sum(selector.items() <= labels.items() for labels in pods)

    budgets = of_kind(rendered, "PodDisruptionBudget")
    assert len(budgets) == len(workers(rendered)) + 1  # one each: the gateway and every pool
    assert all(selects(b["spec"]["selector"]["matchLabels"]) == 1 for b in budgets)
    exporters = [d for d in of_kind(rendered, "Deployment")
                 if d["metadata"]["name"] == "tokenfleet-metrics-exporter"]
    scraped = {"tokenfleet-workers": len(workers(rendered)), "tokenfleet-gateway": 1,
               "tokenfleet-metrics-exporter": len(exporters)}
    monitors = of_kind(rendered, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {n for n, k in scraped.items() if k}
    for monitor in monitors:
        [service] = [s for s in of_kind(rendered, "Service") if
                     monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"][
                         "labels"].items()]
        assert selects(service["spec"]["selector"]) == scraped[monitor["metadata"]["name"]]
        assert {p["name"] for p in service["spec"]["ports"]} >= {
            e["port"] for e in monitor["spec"]["endpoints"]}


def test_only_the_gpu_overlay_asks_for_gpus(rendered: list[Obj]) -> None:
    for worker in workers(rendered):
        pod = worker["spec"]["template"]["spec"]
        resources = pod["containers"][0]["resources"]
        image = pod["containers"][0]["image"]
        if "cuda" in image:
            assert resources["limits"]["nvidia.com/gpu"] == resources["requests"][
                "nvidia.com/gpu"] == 1
            assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
            assert pod["containers"][0]["args"][:3] == ["worker", "--gpus", "all"]
        else:
            assert "nvidia.com/gpu" not in resources.get("limits", {})
            assert "worker-cpu" in image
