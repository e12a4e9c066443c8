"""The Helm chart under helm/, rendered and linted in-process by helm-python-sdk (no helm binary, no
cluster), with the default values, the GPU/RDMA profile and an everything-on variant (helm_chart.py). The
rendered manifests are checked against Kubernetes' own schemas (kubernetes-validate, strict) and against
the wiring Tandem needs: probes and resources on every container, GPU requests, Service ports equal to
container ports, gateway arguments naming the worker Services, the values schema's refusals. The Secrets
are checked in test_helm_secrets.py, listening addresses, KV ports and NetworkPolicies in test_helm_network.py,
the KV page store in test_helm_kv_store.py."""

from __future__ import annotations

import copy
import re

import pytest

from gateway.config import DEFAULT_DRAIN_TIMEOUT_S
from tests.deploy.helm_chart import (
    CHART,
    EVERYTHING_ON,
    KUBE_VERSIONS,
    NAMESPACE,
    PROFILES,
    RELEASE,
    STORE,
    WORKERS,
    by_kind,
    container,
    deployment,
    has_store,
    render,
)

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a test dependency (pip install '.[test]')")
kubernetes_validate = pytest.importorskip("kubernetes_validate")


def test_chart_lints_clean_with_each_values_file():
    for name, values in PROFILES.items():
        report = helm.lint(CHART, copy.deepcopy(values), strict=True, kube_version="v1.30.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert problems == [], f"{name}: {problems}"


def test_manifests_match_the_kubernetes_schemas(profile):
    name, _, docs = profile
    kinds = sorted(d["kind"] for d in docs)
    store = int(has_store(docs))  # its Deployment, Service and NetworkPolicy (everything-on)
    assert name != "everything-on" or store
    assert kinds.count("Deployment") == 3 + store and kinds.count("Service") == 3 + store and "ConfigMap" in kinds
    assert kinds.count("Secret") == 2 and kinds.count("NetworkPolicy") == 2 + store
    for version in KUBE_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_every_container_has_probes_resources_and_a_drain(profile):
    """Every server drains; the KV store, which serves no requests, has nothing to drain."""
    _, _, docs = profile
    for deploy in by_kind(docs, "Deployment").values():
        pod = deploy["spec"]["template"]["spec"]
        for c in pod["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, (deploy["metadata"]["name"], probe)
            assert c["resources"].get("requests") and c["resources"].get("limits"), deploy["metadata"]["name"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert pod["securityContext"]["runAsNonRoot"] is True
            if c["name"] == STORE:
                assert "lifecycle" not in c and not any(a.startswith("--drain-timeout") for a in c["args"])
                continue
            sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
            (drain,) = [int(a.split("=", 1)[1]) for a in c["args"] if a.startswith("--drain-timeout=")]
            # the preStop sleep, then the drain the server is told (--drain-timeout), fit in the grace period
            assert 0 < sleep and sleep + drain < pod["terminationGracePeriodSeconds"]
            assert drain == DEFAULT_DRAIN_TIMEOUT_S  # the servers' own default, stated per pod


def test_workers_and_the_gateways_grpc_api_are_probed_on_grpc_health(profile):
    _, _, docs = profile
    for role in WORKERS:
        c = container(docs, role)
        (grpc_port,) = [p["containerPort"] for p in c["ports"] if p["name"] == "grpc"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == grpc_port
    gateway = container(docs, "gateway")
    (grpc_port,) = [p["containerPort"] for p in gateway["ports"] if p["name"] == "grpc"]
    assert f"--grpc-port={grpc_port}" in gateway["args"] and grpc_port == 30051
    # Service "" of the gateway's grpc.health.v1: SERVING only while a prefill and a decode worker are ready.
    assert gateway["readinessProbe"]["grpc"] == {"port": grpc_port}
    assert "httpGet" not in gateway["readinessProbe"]
    # Workers being away (NOT_SERVING, 503 on /health) or an API key must not restart the gateway.
    assert gateway["livenessProbe"]["tcpSocket"]["port"] == "http"
    assert gateway["startupProbe"]["tcpSocket"]["port"] == "http"
    (service_port,) = [
        p for p in by_kind(docs, "Service")[f"{RELEASE}-gateway"]["spec"]["ports"] if p["name"] == "grpc"
    ]
    assert (service_port["port"], service_port["targetPort"]) == (30051, "grpc")


def test_with_the_grpc_api_off_the_gateway_is_probed_on_health_and_serves_http_only():
    docs = render({"gateway": {"grpcPort": 0}})
    gateway = container(docs, "gateway")
    assert "--grpc-port=0" in gateway["args"]
    assert [p["name"] for p in gateway["ports"]] == ["http"]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert [p["name"] for p in by_kind(docs, "Service")[f"{RELEASE}-gateway"]["spec"]["ports"]] == ["http"]
    for version in KUBE_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_grpc_api_cannot_share_the_http_port():
    with pytest.raises(helm.HelmError, match="gateway.grpcPort"):
        render({"gateway": {"grpcPort": 30000}})


def test_gpu_requests_only_where_asked(profile):
    name, _, docs = profile
    for role in WORKERS:
        resources = container(docs, role)["resources"]
        expected = 1 if name == "gpu-rdma" else None
        assert resources["limits"].get("nvidia.com/gpu") == expected
        assert resources["requests"].get("nvidia.com/gpu") == expected
    assert "nvidia.com/gpu" not in container(docs, "gateway")["resources"].get("limits", {})


def test_service_ports_are_the_container_ports(profile):
    _, _, docs = profile
    deployments = by_kind(docs, "Deployment").values()
    for service in by_kind(docs, "Service").values():
        selector = service["spec"]["selector"]
        matched = [d for d in deployments if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, service["metadata"]["name"]
        (pod_container,) = matched[0]["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in pod_container["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)
            if service["spec"].get("clusterIP") == "None":  # DNS hands out pod IPs: same port numbers
                assert port["port"] == ports[port["targetPort"]]


def test_gateway_is_pointed_at_the_worker_services(profile):
    _, _, docs = profile
    args = container(docs, "gateway")["args"]
    services = by_kind(docs, "Service")
    for role in WORKERS:
        headless = services[f"{RELEASE}-{role}-headless"]
        assert headless["spec"]["clusterIP"] == "None"
        (grpc,) = [p["port"] for p in headless["spec"]["ports"] if p["name"] == "grpc"]
        target = f"--{role}=dns:///{RELEASE}-{role}-headless.{NAMESPACE}.svc.cluster.local:{grpc}"
        assert target in args
        worker_args = container(docs, role)["args"]
        assert worker_args[0] == role and f"--port={grpc}" in worker_args
        assert "--kv-host=$(POD_IP)" in worker_args


def test_every_variable_in_args_is_defined(profile):
    _, _, docs = profile
    config = by_kind(docs, "ConfigMap")[f"{RELEASE}-config"]["data"]
    for deploy in by_kind(docs, "Deployment").values():
        c = deploy["spec"]["template"]["spec"]["containers"][0]
        assert c["envFrom"] == [{"configMapRef": {"name": f"{RELEASE}-config"}}]
        defined = set(config) | {e["name"] for e in c.get("env", [])}
        used = {v for arg in c["args"] for v in re.findall(r"\$\((\w+)\)", arg)}
        assert used <= defined, (deploy["metadata"]["name"], used - defined)


def test_worker_metrics_ports_are_declared_passed_and_annotated_for_scraping(profile):
    _, _, docs = profile
    seen: set[int] = set()
    for role in WORKERS:
        c = container(docs, role)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        metrics = ports["metrics"]
        assert f"--metrics-port={metrics}" in c["args"]
        assert metrics not in seen and list(ports.values()).count(metrics) == 1  # no clash, even on hostNetwork
        seen.add(metrics)
        annotations = deployment(docs, role)["spec"]["template"]["metadata"]["annotations"]
        assert (
            annotations["prometheus.io/scrape"],
            annotations["prometheus.io/port"],
            annotations["prometheus.io/path"],
        ) == ("true", str(metrics), "/metrics")


def test_disruption_budgets_cover_each_component(profile):
    _, _, docs = profile
    budgets = by_kind(docs, "PodDisruptionBudget")
    for component in ("gateway", *WORKERS):
        selector = budgets[f"{RELEASE}-{component}"]["spec"]["selector"]["matchLabels"]
        assert selector.items() <= deployment(docs, component)["spec"]["template"]["metadata"]["labels"].items()


def test_model_from_a_pvc_is_mounted_everywhere_and_needs_a_claim():
    docs = render(EVERYTHING_ON)
    for component in ("gateway", *WORKERS):
        pod = deployment(docs, component)["spec"]["template"]["spec"]
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["model"]["mountPath"] == "/models" and mounts["model"]["readOnly"] is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"]["claimName"] == "models"
    with pytest.raises(helm.HelmError, match="claimName"):
        render({"model": {"source": "pvc"}})


def test_the_prefix_cache_tiers_are_off_by_default_and_a_disk_tier_gets_its_own_volume():
    def worker(values: dict | None) -> tuple[dict, dict, dict]:
        docs = render(values)
        pod = deployment(docs, "decode")["spec"]["template"]["spec"]
        (config,) = by_kind(docs, "ConfigMap").values()
        return pod, pod["containers"][0], config["data"]

    pod, c, config = worker(None)
    assert "--kv-host-cache-gb=$(TANDEM_KV_HOST_CACHE_GIB)" in c["args"] and config["TANDEM_KV_HOST_CACHE_GIB"] == "0"
    assert not [a for a in c["args"] if a.startswith("--kv-disk-cache")]
    assert "kv-cache" not in {v["name"] for v in pod["volumes"]}
    pod, c, config = worker(EVERYTHING_ON)
    assert config["TANDEM_KV_HOST_CACHE_GIB"] == "2"
    assert {"--kv-disk-cache-dir=/var/cache/tandem-kv", "--kv-disk-cache-gb=20"} <= set(c["args"])
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "kv-cache"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "kv-cache"]
    assert mount["mountPath"] == "/var/cache/tandem-kv" and volume["emptyDir"] == {"sizeLimit": "21Gi"}


def test_optional_ingress_autoscaler_and_replicas():
    docs = render(EVERYTHING_ON)
    ingress = by_kind(docs, "Ingress")[f"{RELEASE}-gateway"]
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == f"{RELEASE}-gateway"
    hpa = by_kind(docs, "HorizontalPodAutoscaler")[f"{RELEASE}-gateway"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-gateway"
    assert "replicas" not in deployment(docs, "gateway")["spec"]  # the autoscaler owns it
    assert deployment(docs, "prefill")["spec"]["replicas"] == 3
    assert "--prefill=10.0.0.9:30001" in container(docs, "gateway")["args"]
    assert '--default-sampling={"temperature": 0.7}' in container(docs, "gateway")["args"]
    (key,) = [e for e in container(docs, "gateway")["env"] if e["name"] == "TANDEM_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "tandem-api-key", "key": "key"}
    (admin,) = [e for e in container(docs, "gateway")["env"] if e["name"] == "TANDEM_ADMIN_API_KEY"]
    assert admin["valueFrom"]["secretKeyRef"] == {"name": "tandem-admin-key", "key": "admin"}
    assert "TANDEM_ADMIN_API_KEY" not in str(container(render(None), "gateway").get("env"))
    assert not by_kind(render(None), "Ingress") and not by_kind(render(None), "HorizontalPodAutoscaler")


def test_a_grace_period_shorter_than_the_sleep_and_the_drain_is_refused():
    for role in ("gateway", *WORKERS):
        with pytest.raises(helm.HelmError, match=f"{role}: preStopSleepSeconds"):
            render({role: {"terminationGracePeriodSeconds": 40, "preStopSleepSeconds": 20, "drainTimeoutSeconds": 20}})
    docs = render(
        {"decode": {"terminationGracePeriodSeconds": 50, "preStopSleepSeconds": 5, "drainTimeoutSeconds": 40}}
    )
    assert "--drain-timeout=40" in container(docs, "decode")["args"]


def test_four_prefill_and_four_decode_pods_with_the_routing_set():
    """What docs/deploy.md tells a user to set for 4P4D: replicas per role and the gateway's router; the
    gateway still finds every pod through the headless Services."""
    docs = render(
        {
            "prefill": {"replicas": 4},
            "decode": {"replicas": 4},
            "gateway": {"router": {"policy": "least_load", "localPrefillThreshold": 64}},
        }
    )
    assert [deployment(docs, role)["spec"]["replicas"] for role in WORKERS] == [4, 4]
    args = container(docs, "gateway")["args"]
    assert {
        "--router-policy=least_load",
        "--local-prefill-threshold=64",
        "--prefix-load-guard=4",
        "--prefill-busy-threshold=0",
    } <= set(args)
    assert [a for a in args if a.startswith("--prefill=")] == [
        f"--prefill=dns:///{RELEASE}-prefill-headless.{NAMESPACE}.svc.cluster.local:30001"
    ]
    default = container(render(None), "gateway")["args"]
    assert "--router-policy=prefix_aware" in default and "--local-prefill-threshold=0" in default
    with pytest.raises(helm.HelmError):
        render({"gateway": {"router": {"policy": "fastest"}}})


def test_values_schema_rejects_an_unknown_protocol():
    with pytest.raises(helm.HelmError):
        render({"kv": {"protocol": "carrier-pigeon"}})


def test_a_config_change_rolls_the_pods():
    before = render({"kvStore": {"enabled": True}})
    after = render({"config": {"logLevel": "debug"}, "kvStore": {"enabled": True}})
    for component in ("gateway", *WORKERS, STORE):
        key = "checksum/config"
        assert (
            deployment(before, component)["spec"]["template"]["metadata"]["annotations"][key]
            != deployment(after, component)["spec"]["template"]["metadata"]["annotations"][key]
        )
