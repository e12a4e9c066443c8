"""The chart's networking, rendered as in test_helm_chart.py: workers listen on the pod IP only, Mooncake's
ports are pinned and declared, the RDMA profile puts workers on the host network with their NICs, and the
NetworkPolicies let only the gateway reach a worker's gRPC port and only workers (and the KV store) reach its KV
ports, and only workers reach the KV store."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.helm_chart import (
    PROFILES,
    RELEASE,
    STORE,
    WORKERS,
    by_kind,
    container,
    deployment,
    has_store,
    pod_labels,
    render,
    selects,
)

pytest.importorskip("helm_python", reason="helm-python-sdk is a test dependency (pip install '.[test]')")


def test_mooncake_ports_are_pinned_and_declared(profile):
    _, _, docs = profile
    seen: set[int] = set()
    for role in WORKERS:
        c = container(docs, role)
        env = {e["name"]: e.get("value") for e in c["env"]}
        low, high = int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])
        # Mooncake listens on two ports (handshake RPC, TCP data) per engine: the KV transport's and the store client's
        assert high - low + 1 >= 4
        kv_ports = {p["containerPort"] for p in c["ports"] if p["name"].startswith("kv-")}
        assert kv_ports == set(range(low, high + 1))
        assert not kv_ports & seen  # distinct per role, so hostNetwork pods can share a node
        seen |= kv_ports


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


def test_workers_listen_on_the_pod_ip_only(profile):
    _, _, docs = profile
    for role in WORKERS:
        c = container(docs, role)
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        hosts = [a for a in c["args"] if a.startswith("--host=")]
        assert hosts == ["--host=$(POD_IP)"]  # gRPC and metrics; never 0.0.0.0
        assert "--kv-host=$(POD_IP)" in c["args"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "host" not in c[probe]["grpc"]  # kubelet dials the pod IP, where the worker listens
    assert "--host=0.0.0.0" in container(docs, "gateway")["args"]  # the gateway's HTTP port stays open


def test_network_policies_let_only_the_gateway_reach_grpc_and_only_workers_reach_kv(profile):
    _, _, docs = profile
    policies = by_kind(docs, "NetworkPolicy")
    store = [STORE] if has_store(docs) else []
    labels = {component: pod_labels(docs, component) for component in ("gateway", *WORKERS, *store)}
    assert not any(selects(p["spec"]["podSelector"], labels["gateway"]) for p in policies.values())
    for role in WORKERS:
        policy = policies[f"{RELEASE}-{role}"]["spec"]
        assert policy["policyTypes"] == ["Ingress"]
        assert [c for c, pod in labels.items() if selects(policy["podSelector"], pod)] == [role]
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
            assert all(set(peer) == {"podSelector"} for peer in peers)  # this namespace's pods only
            return [c for c, pod in labels.items() if any(selects(peer["podSelector"], pod) for peer in peers)]

        assert admitted(rules[(ports["grpc"], ports["grpc"])]) == ["gateway"]
        assert admitted(rules[kv]) == [*WORKERS, *store]  # Mooncake's engines connect both ways
        assert rules[(ports["metrics"], ports["metrics"])] is None  # by default, whoever scrapes


def test_network_policies_can_be_narrowed_or_turned_off():
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    docs = render({"networkPolicy": {"metricsFrom": monitoring}})
    for role in WORKERS:
        (metrics,) = [p["containerPort"] for p in container(docs, role)["ports"] if p["name"] == "metrics"]
        (rule,) = [
            r
            for r in by_kind(docs, "NetworkPolicy")[f"{RELEASE}-{role}"]["spec"]["ingress"]
            if r["ports"][0]["port"] == metrics
        ]
        assert rule["from"] == monitoring
    assert by_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == {}


def store_policy_rules(docs: list[dict]) -> tuple[dict, list[dict], dict]:
    """The KV store's NetworkPolicy spec: (the policy, the rule with no port, the metrics rule)."""
    policy = by_kind(docs, "NetworkPolicy")[f"{RELEASE}-{STORE}"]["spec"]
    any_port = [r for r in policy["ingress"] if r["ports"] == [{"protocol": "TCP"}]]
    metrics = [r for r in policy["ingress"] if r not in any_port]
    assert len(policy["ingress"]) == 2 and len(any_port) == len(metrics) == 1
    return policy, any_port[0], metrics[0]


def test_only_workers_reach_the_kv_store_on_any_port():
    """The master's RPC port and the store's Mooncake ports, which it picks when it starts, admit the worker
    pods and the store pod (its own client calls its master at the pod IP), nothing else but the metrics
    scrape; with the store off there is no such policy and the workers admit only each other."""
    docs = render({"kvStore": {"enabled": True}})
    labels = {component: pod_labels(docs, component) for component in ("gateway", *WORKERS, STORE)}
    policy, any_port, metrics = store_policy_rules(docs)
    assert policy["policyTypes"] == ["Ingress"]
    assert [c for c, pod in labels.items() if selects(policy["podSelector"], pod)] == [STORE]
    assert all(set(peer) == {"podSelector"} for peer in any_port["from"])
    admitted = [c for c, pod in labels.items() if any(selects(p["podSelector"], pod) for p in any_port["from"])]
    assert admitted == [*WORKERS, STORE]
    (metrics_port,) = [p["containerPort"] for p in container(docs, STORE)["ports"] if p["name"] == "metrics"]
    assert metrics["ports"] == [{"protocol": "TCP", "port": metrics_port}] and "from" not in metrics
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    narrowed = render({"kvStore": {"enabled": True}, "networkPolicy": {"metricsFrom": monitoring}})
    _, _, narrowed_metrics = store_policy_rules(narrowed)
    assert narrowed_metrics["from"] == monitoring
    assert f"{RELEASE}-{STORE}" not in by_kind(render(None), "NetworkPolicy")
    assert by_kind(render({"kvStore": {"enabled": True}, "networkPolicy": {"enabled": False}}), "NetworkPolicy") == {}


def test_no_store_policy_when_the_workers_use_the_host_network():
    """hostNetwork workers (the RDMA profile) reach the store from node addresses, which no pod selector
    matches: a policy would shut them out, so there is none (and the store is as open as the nodes' network)."""
    values = copy.deepcopy(PROFILES["gpu-rdma"])
    values["kvStore"]["enabled"] = True
    docs = render(values)
    assert deployment(docs, "prefill")["spec"]["template"]["spec"]["hostNetwork"] is True
    assert has_store(docs) and f"{RELEASE}-{STORE}" not in by_kind(docs, "NetworkPolicy")
    values["kv"]["rdma"]["hostNetwork"] = False  # a Multus RDMA network: the pods keep their pod IPs
    assert f"{RELEASE}-{STORE}" in by_kind(render(values), "NetworkPolicy")
