"""The Helm chart under helm/, rendered and linted in-process by helm-python-sdk (no helm binary, no
cluster), with the default values, the GPU/RDMA profile and an everything-on variant. The rendered
manifests are checked against Kubernetes' own schemas (kubernetes-validate, strict) and against the
wiring Tandem needs: probes and resources on every container, GPU requests, Service ports equal to
container ports, gateway arguments naming the worker Services, the internal token's Secret mounted in
every pod, workers listening on the pod IP, and the NetworkPolicies that fence the workers in."""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path

import pytest
import yaml
from gateway.config import DEFAULT_DRAIN_TIMEOUT_S

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a test dependency (pip install '.[test]')")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = Path(__file__).resolve().parents[2] / "helm"
RELEASE, NAMESPACE = "tandem", "llm"
KUBE_VERSIONS = ("1.27.0", "1.30.0")
WORKERS = ("prefill", "decode")


def _values_file(name: str) -> dict:
    return yaml.safe_load((CHART / name).read_text())


EVERYTHING_ON = {
    "gateway": {"replicas": 2, "ingress": {"enabled": True, "className": "nginx"},
                "autoscaling": {"enabled": True}, "extraPrefill": ["10.0.0.9:30001"]},
    "model": {"source": "pvc", "path": "/models/Qwen2-0.5B-Instruct", "servedModelName": "qwen",
              "pvc": {"claimName": "models", "subPath": "hf"}},
    "config": {"maxTotalTokens": 65536, "contextLength": 4096, "defaultSampling": '{"temperature": 0.7}'},
    "prefill": {"replicas": 3, "extraArgs": ["--max-prefill-tokens=16384"]},
}
EVERYTHING_ON["gateway"]["apiKeySecret"] = {"name": "tandem-api-key", "key": "key"}
EVERYTHING_ON["gateway"]["adminApiKeySecret"] = {"name": "tandem-admin-key", "key": "admin"}
PROFILES = {"default": None, "gpu-rdma": _values_file("values-gpu-rdma.yaml"), "everything-on": EVERYTHING_ON}


def render(values: dict | None) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request) -> tuple[str, dict | None, list[dict]]:
    return request.param, PROFILES[request.param], render(PROFILES[request.param])


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def deployment(docs: list[dict], component: str) -> dict:
    return by_kind(docs, "Deployment")[f"{RELEASE}-{component}"]


def container(docs: list[dict], component: str) -> dict:
    (only,) = deployment(docs, component)["spec"]["template"]["spec"]["containers"]
    return only


def pod_labels(docs: list[dict], component: str) -> dict[str, str]:
    return deployment(docs, component)["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels and matchExpressions) selects `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        matched = {"In": key in labels and labels[key] in values,
                   "NotIn": key not in labels or labels[key] not in values,
                   "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not matched:
            return False
    return True


TOKEN_SECRET = f"{RELEASE}-internal-token"
GRANT_SECRET = f"{RELEASE}-kv-grant-secret"


def token_file_arg(docs: list[dict], component: str) -> str:
    """Where `component`'s pod finds the internal token, checked to be the chart's Secret, mounted read-only."""
    pod = deployment(docs, component)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "internal-token"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "internal-token"]
    assert mount["readOnly"] is True
    (item,) = volume["secret"]["items"]
    (arg,) = [a for a in c["args"] if a.startswith("--internal-token-file=")]
    assert arg == f"--internal-token-file={mount['mountPath']}/{item['path']}"
    return volume["secret"]["secretName"], item["key"]


def grant_secret_file_arg(docs: list[dict], component: str) -> tuple[str, str] | None:
    """Where `component`'s pod finds the KV grant secret (the chart's Secret, mounted read-only), or None
    when its pod has no such volume, mount or flag."""
    pod = deployment(docs, component)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    volumes = [v for v in pod.get("volumes", ()) if v["name"] == "kv-grant-secret"]
    mounts = [m for m in c.get("volumeMounts", ()) if m["name"] == "kv-grant-secret"]
    args = [a for a in c["args"] if a.startswith("--kv-grant-secret-file=")]
    if not (volumes or mounts or args):
        return None
    ((volume,), (mount,), (arg,)) = volumes, mounts, args
    assert mount["readOnly"] is True
    (item,) = volume["secret"]["items"]
    assert arg == f"--kv-grant-secret-file={mount['mountPath']}/{item['path']}"
    return volume["secret"]["secretName"], item["key"]


def test_chart_lints_clean_with_each_values_file():
    for name, values in PROFILES.items():
        report = helm.lint(CHART, copy.deepcopy(values), strict=True, kube_version="v1.30.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert problems == [], f"{name}: {problems}"


def test_manifests_match_the_kubernetes_schemas(profile):
    name, _, docs = profile
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 3 and kinds.count("Service") == 3 and "ConfigMap" in kinds
    assert kinds.count("Secret") == 2 and kinds.count("NetworkPolicy") == 2
    for version in KUBE_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_every_container_has_probes_resources_and_a_drain(profile):
    _, _, docs = profile
    for deploy in by_kind(docs, "Deployment").values():
        pod = deploy["spec"]["template"]["spec"]
        for c in pod["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, (deploy["metadata"]["name"], probe)
            assert c["resources"].get("requests") and c["resources"].get("limits"), deploy["metadata"]["name"]
            sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
            (drain,) = [int(a.split("=", 1)[1]) for a in c["args"] if a.startswith("--drain-timeout=")]
            # the preStop sleep, then the drain the server is told (--drain-timeout), fit in the grace period
            assert 0 < sleep and sleep + drain < pod["terminationGracePeriodSeconds"]
            assert drain == DEFAULT_DRAIN_TIMEOUT_S   # the servers' own default, stated per pod
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True


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
    (service_port,) = [p for p in by_kind(docs, "Service")[f"{RELEASE}-gateway"]["spec"]["ports"]
                       if p["name"] == "grpc"]
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
    with pytest.raises(Exception, match="gateway.grpcPort"):
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
        matched = [d for d in deployments
                   if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, service["metadata"]["name"]
        (pod_container,) = matched[0]["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in pod_container["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)
            if service["spec"].get("clusterIP") == "None":     # DNS hands out pod IPs: same port numbers
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


def test_mooncake_ports_are_pinned_and_declared(profile):
    _, _, docs = profile
    seen: set[int] = set()
    for role in WORKERS:
        c = container(docs, role)
        env = {e["name"]: e.get("value") for e in c["env"]}
        low, high = int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])
        assert high - low + 1 >= 2           # Mooncake listens on two ports: handshake RPC and TCP data
        kv_ports = {p["containerPort"] for p in c["ports"] if p["name"].startswith("kv-")}
        assert kv_ports == set(range(low, high + 1))
        assert not kv_ports & seen           # distinct per role, so hostNetwork pods can share a node
        seen |= kv_ports


def test_worker_metrics_ports_are_declared_passed_and_annotated_for_scraping(profile):
    _, _, docs = profile
    seen: set[int] = set()
    for role in WORKERS:
        c = container(docs, role)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        metrics = ports["metrics"]
        assert f"--metrics-port={metrics}" in c["args"]
        assert metrics not in seen and list(ports.values()).count(metrics) == 1   # no clash, even on hostNetwork
        seen.add(metrics)
        annotations = deployment(docs, role)["spec"]["template"]["metadata"]["annotations"]
        assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"],
                annotations["prometheus.io/path"]) == ("true", str(metrics), "/metrics")


def test_disruption_budgets_cover_each_component(profile):
    _, _, docs = profile
    budgets = by_kind(docs, "PodDisruptionBudget")
    for component in ("gateway", *WORKERS):
        selector = budgets[f"{RELEASE}-{component}"]["spec"]["selector"]["matchLabels"]
        assert selector.items() <= deployment(docs, component)["spec"]["template"]["metadata"]["labels"].items()


def test_rdma_profile_wires_the_transport():
    docs = render(PROFILES["gpu-rdma"])
    assert by_kind(docs, "ConfigMap")[f"{RELEASE}-config"]["data"]["TANDEM_KV_PROTOCOL"] == "rdma"
    for role in WORKERS:
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


def test_the_gpu_profile_runs_the_workers_on_cuda_with_rdma_devices_named():
    """values-gpu-rdma.yaml: each worker passes --device=cuda and names its RDMA NICs; the default
    profile leaves the device to auto (the CPU on a node without a GPU)."""
    docs = render(PROFILES["gpu-rdma"])
    assert by_kind(docs, "ConfigMap")[f"{RELEASE}-config"]["data"]["TANDEM_KV_DEVICE"] == "mlx5_0"
    for role in WORKERS:
        args = container(docs, role)["args"]
        assert args.count("--device=cuda") == 1 and args[0] == role
        assert "--kv-protocol=$(TANDEM_KV_PROTOCOL)" in args and "--kv-device=$(TANDEM_KV_DEVICE)" in args
        assert not any(a.startswith("--device") for a in container(render(None), role)["args"])


def test_default_profile_is_tcp_on_the_pod_network():
    docs = render(None)
    assert by_kind(docs, "ConfigMap")[f"{RELEASE}-config"]["data"]["TANDEM_KV_PROTOCOL"] == "tcp"
    for role in WORKERS:
        pod = deployment(docs, role)["spec"]["template"]["spec"]
        assert "hostNetwork" not in pod
        assert "add" not in pod["containers"][0]["securityContext"]["capabilities"]


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


def test_optional_ingress_autoscaler_and_replicas():
    docs = render(EVERYTHING_ON)
    ingress = by_kind(docs, "Ingress")[f"{RELEASE}-gateway"]
    assert ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == f"{RELEASE}-gateway"
    hpa = by_kind(docs, "HorizontalPodAutoscaler")[f"{RELEASE}-gateway"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-gateway"
    assert "replicas" not in deployment(docs, "gateway")["spec"]          # the autoscaler owns it
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
        with pytest.raises(Exception, match=f"{role}: preStopSleepSeconds"):
            render({role: {"terminationGracePeriodSeconds": 40, "preStopSleepSeconds": 20, "drainTimeoutSeconds": 20}})
    docs = render({"decode": {"terminationGracePeriodSeconds": 50, "preStopSleepSeconds": 5, "drainTimeoutSeconds": 40}})
    assert "--drain-timeout=40" in container(docs, "decode")["args"]


def test_four_prefill_and_four_decode_pods_with_the_routing_set():
    """What docs/deploy.md tells a user to set for 4P4D: replicas per role and the gateway's router; the
    gateway still finds every pod through the headless Services."""
    docs = render({"prefill": {"replicas": 4}, "decode": {"replicas": 4},
                   "gateway": {"router": {"policy": "least_load", "localPrefillThreshold": 64}}})
    assert [deployment(docs, role)["spec"]["replicas"] for role in WORKERS] == [4, 4]
    args = container(docs, "gateway")["args"]
    assert {"--router-policy=least_load", "--local-prefill-threshold=64", "--prefix-load-guard=4",
            "--prefill-busy-threshold=0"} <= set(args)
    assert [a for a in args if a.startswith("--prefill=")] == [
        f"--prefill=dns:///{RELEASE}-prefill-headless.{NAMESPACE}.svc.cluster.local:30001"]
    default = container(render(None), "gateway")["args"]
    assert "--router-policy=prefix_aware" in default and "--local-prefill-threshold=0" in default
    with pytest.raises(helm.HelmError):
        render({"gateway": {"router": {"policy": "fastest"}}})


def test_values_schema_rejects_an_unknown_protocol():
    with pytest.raises(helm.HelmError):
        render({"kv": {"protocol": "carrier-pigeon"}})


def test_a_config_change_rolls_the_pods():
    before = render(None)
    after = render({"config": {"logLevel": "debug"}})
    for component in ("gateway", *WORKERS):
        key = "checksum/config"
        assert (deployment(before, component)["spec"]["template"]["metadata"]["annotations"][key]
                != deployment(after, component)["spec"]["template"]["metadata"]["annotations"][key])


def test_the_internal_token_is_a_generated_secret_every_pod_mounts(profile):
    _, _, docs = profile
    secret = by_kind(docs, "Secret")[TOKEN_SECRET]
    assert secret["type"] == "Opaque" and list(secret["data"]) == ["internal-token"]
    token = base64.b64decode(secret["data"]["internal-token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    for component in ("gateway", *WORKERS):
        assert token_file_arg(docs, component) == (TOKEN_SECRET, "internal-token")
        c = container(docs, component)
        # The token itself appears nowhere in the pod spec: not as an argument, not as a plain env value.
        assert token not in str(deployment(docs, component))
        assert not any(a.startswith("--internal-token=") for a in c["args"])


def test_each_render_draws_a_new_token_when_there_is_no_previous_secret():
    # `lookup` finds nothing without a cluster, as on a first install: the token is random, not a constant.
    tokens = {by_kind(render(None), "Secret")[TOKEN_SECRET]["data"]["internal-token"] for _ in range(3)}
    assert len(tokens) == 3


def test_the_kv_grant_secret_is_a_generated_secret_only_worker_pods_mount(profile):
    """The gateway holds the internal token; were it to hold the grant secret too, it could sign KV writes."""
    _, _, docs = profile
    secrets = by_kind(docs, "Secret")
    secret = secrets[GRANT_SECRET]
    assert secret["type"] == "Opaque" and list(secret["data"]) == ["kv-grant-secret"]
    value = base64.b64decode(secret["data"]["kv-grant-secret"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", value)
    assert value != base64.b64decode(secrets[TOKEN_SECRET]["data"]["internal-token"]).decode()
    for component in WORKERS:
        assert grant_secret_file_arg(docs, component) == (GRANT_SECRET, "kv-grant-secret")
        assert value not in str(deployment(docs, component))
    assert grant_secret_file_arg(docs, "gateway") is None
    assert GRANT_SECRET not in str(deployment(docs, "gateway"))


def test_each_render_draws_a_new_grant_secret_when_there_is_no_previous_one():
    values = {by_kind(render(None), "Secret")[GRANT_SECRET]["data"]["kv-grant-secret"] for _ in range(3)}
    assert len(values) == 3


def test_an_existing_grant_secret_replaces_the_generated_one():
    docs = render({"kvGrantSecret": {"existingSecret": "vault-grant", "key": "grant"}})
    assert GRANT_SECRET not in by_kind(docs, "Secret")
    for component in WORKERS:
        assert grant_secret_file_arg(docs, component) == ("vault-grant", "grant")
    assert grant_secret_file_arg(docs, "gateway") is None


def test_an_existing_token_secret_replaces_the_generated_one():
    docs = render({"internalToken": {"existingSecret": "vault-synced", "key": "token"}})
    assert set(by_kind(docs, "Secret")) == {GRANT_SECRET}   # the grant secret is still the chart's own
    for component in ("gateway", *WORKERS):
        assert token_file_arg(docs, component) == ("vault-synced", "token")


def test_workers_listen_on_the_pod_ip_only(profile):
    _, _, docs = profile
    for role in WORKERS:
        c = container(docs, role)
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        hosts = [a for a in c["args"] if a.startswith("--host=")]
        assert hosts == ["--host=$(POD_IP)"]                  # gRPC and metrics; never 0.0.0.0
        assert "--kv-host=$(POD_IP)" in c["args"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "host" not in c[probe]["grpc"]           # kubelet dials the pod IP, where the worker listens
    assert "--host=0.0.0.0" in container(docs, "gateway")["args"]   # the gateway's HTTP port stays open


def test_network_policies_let_only_the_gateway_reach_grpc_and_only_workers_reach_kv(profile):
    _, _, docs = profile
    policies = by_kind(docs, "NetworkPolicy")
    labels = {component: pod_labels(docs, component) for component in ("gateway", *WORKERS)}
    assert not any(selects(p["spec"]["podSelector"], labels["gateway"]) for p in policies.values())
    for role in WORKERS:
        policy = policies[f"{RELEASE}-{role}"]["spec"]
        assert policy["policyTypes"] == ["Ingress"]
        assert [c for c, l in labels.items() if selects(policy["podSelector"], l)] == [role]
        c = container(docs, role)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        env = {e["name"]: e.get("value") for e in c["env"]}
        rules = {}
        for rule in policy["ingress"]:
            (port,) = rule["ports"]
            assert port["protocol"] == "TCP"
            rules[(port["port"], port.get("endPort", port["port"]))] = rule.get("from")
        kv = (int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"]))
        assert set(rules) == {(ports["grpc"], ports["grpc"]), kv, (ports["metrics"], ports["metrics"])}
        assert set(range(kv[0], kv[1] + 1)) == {v for k, v in ports.items() if k.startswith("kv-")}

        def admitted(peers: list[dict]) -> list[str]:
            assert all(set(peer) == {"podSelector"} for peer in peers)   # this namespace's pods only
            return [c for c, l in labels.items() if any(selects(peer["podSelector"], l) for peer in peers)]

        assert admitted(rules[(ports["grpc"], ports["grpc"])]) == ["gateway"]
        assert admitted(rules[kv]) == list(WORKERS)
        assert rules[(ports["metrics"], ports["metrics"])] is None   # by default, whoever scrapes


def test_network_policies_can_be_narrowed_or_turned_off():
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    docs = render({"networkPolicy": {"metricsFrom": monitoring}})
    for role in WORKERS:
        (metrics,) = [p["containerPort"] for p in container(docs, role)["ports"] if p["name"] == "metrics"]
        (rule,) = [r for r in by_kind(docs, "NetworkPolicy")[f"{RELEASE}-{role}"]["spec"]["ingress"]
                   if r["ports"][0]["port"] == metrics]
        assert rule["from"] == monitoring
    assert by_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == {}


def test_values_from_before_the_token_and_the_policies_still_render():
    # `helm upgrade --reuse-values` from a release made before these values existed passes none of them
    # (null removes a default, as the missing key would): the chart must still render its defaults.
    docs = render({"internalToken": None, "kvGrantSecret": None, "networkPolicy": None,
                   "gateway": {"grpcPort": None, "router": None, "drainTimeoutSeconds": None},
                   "prefill": {"drainTimeoutSeconds": None}})
    assert "--drain-timeout=30" in container(docs, "prefill")["args"]
    assert not any(a.startswith("--router-policy") for a in container(docs, "gateway")["args"])   # its default
    assert {TOKEN_SECRET, GRANT_SECRET} <= set(by_kind(docs, "Secret"))
    for component in WORKERS:
        assert grant_secret_file_arg(docs, component) == (GRANT_SECRET, "kv-grant-secret")
    assert set(by_kind(docs, "NetworkPolicy")) == {f"{RELEASE}-{role}" for role in WORKERS}
    for component in ("gateway", *WORKERS):
        assert token_file_arg(docs, component) == (TOKEN_SECRET, "internal-token")
    assert "--grpc-port=30051" in container(docs, "gateway")["args"]     # the gateway's own default
