"""The KV page store in the chart (kvStore.*), rendered as in test_helm_chart.py: nothing of it by default;
when enabled, one pod running `tandem kv-store` on its pod IP with memory for its pages, a Service the
workers' --kv-store names, no secret; and the values schema's refusals. Its NetworkPolicy is checked in
test_helm_network.py."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.helm_chart import (
    KUBE_VERSIONS,
    NAMESPACE,
    PROFILES,
    RELEASE,
    STORE,
    WORKERS,
    by_kind,
    container,
    deployment,
    grant_secret_file_arg,
    has_store,
    pod_labels,
    render,
    selects,
)

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is a test dependency (pip install '.[test]')")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ON = {"kvStore": {"enabled": True}}


def store_flags(docs: list[dict]) -> dict[str, list[str]]:
    """Each worker's --kv-store values (none, one, or more when the chart got it wrong)."""
    return {
        role: [a.split("=", 1)[1] for a in container(docs, role)["args"] if a.startswith("--kv-store")]
        for role in WORKERS
    }


def test_no_store_unless_enabled(profile):
    name, _, docs = profile
    if name == "everything-on":
        assert has_store(docs)
        return
    assert not [d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == STORE]
    assert not [d for d in docs if STORE in d["metadata"]["name"]]
    assert store_flags(docs) == {role: [] for role in WORKERS}


def test_workers_are_pointed_at_the_store_service():
    docs = render(ON)
    service = by_kind(docs, "Service")[f"{RELEASE}-{STORE}"]
    assert service["spec"]["type"] == "ClusterIP"
    (port,) = service["spec"]["ports"]
    address = f"{RELEASE}-{STORE}.{NAMESPACE}.svc.cluster.local:{port['port']}"
    assert store_flags(docs) == {role: [address] for role in WORKERS}
    labels = {c: pod_labels(docs, c) for c in ("gateway", *WORKERS, STORE)}
    assert [c for c, pod in labels.items() if selects({"matchLabels": service["spec"]["selector"]}, pod)] == [STORE]
    ports = {p["name"]: p["containerPort"] for p in container(docs, STORE)["ports"]}
    assert port == {"name": "rpc", "port": 50151, "targetPort": "rpc", "protocol": "TCP"} and ports["rpc"] == 50151


def test_one_store_pod_on_its_pod_ip_with_the_worker_image_and_no_secret():
    docs = render(ON)
    store = deployment(docs, STORE)
    # One master: a second pod during a rollout would be a second, empty store behind the same Service.
    assert store["spec"]["replicas"] == 1 and store["spec"]["strategy"] == {"type": "Recreate"}
    pod = store["spec"]["template"]["spec"]
    c = container(docs, STORE)
    assert c["args"] == [
        STORE,
        "--host=$(POD_IP)",
        "--port=50151",
        "--metrics-port=50152",
        "--memory-gb=4",
        "--log-level=$(TANDEM_LOG_LEVEL)",
    ]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert c["image"] == container(docs, "prefill")["image"] and c["imagePullPolicy"] == "IfNotPresent"
    assert "volumes" not in pod and "volumeMounts" not in c  # no model, no token, no grant secret
    assert grant_secret_file_arg(docs, STORE) is None
    assert not any("token" in a or "secret" in a for a in c["args"])
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    annotations = store["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == ("50152", "/metrics")


def test_the_store_is_probed_by_a_tcp_connect_to_the_master():
    c = container(render(ON), STORE)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"rpc": 50151, "metrics": 50152}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "rpc"}  # kubelet dials the pod IP, where the master listens


def gib(quantity: str) -> float:
    assert quantity.endswith("Gi"), quantity
    return float(quantity[: -len("Gi")])


@pytest.mark.parametrize(
    ("values", "pages", "pod"),
    [({}, "4", 5.0), ({"memoryGib": 2.5}, "2.5", 3.5), ({"memoryGib": 64, "memoryOverheadGib": 2}, "64", 66.0)],
)
def test_the_pod_requests_and_is_limited_to_its_pages_and_some(values, pages, pod):
    docs = render({"kvStore": {"enabled": True, **values}})
    for version in KUBE_VERSIONS:  # a fractional quantity ("3.5Gi") included
        kubernetes_validate.validate(deployment(docs, STORE), version, strict=True)
    c = container(docs, STORE)
    assert f"--memory-gb={pages}" in c["args"]
    resources = c["resources"]
    assert gib(resources["requests"]["memory"]) == gib(resources["limits"]["memory"]) == pod
    assert pod > float(pages)
    assert resources["requests"]["cpu"] == "1"


def test_store_values_reach_the_pod_the_service_and_the_workers():
    values = {
        "kvStore": {
            "enabled": True,
            "port": 6000,
            "metricsPort": 6001,
            "resources": {"requests": {"cpu": "500m"}, "limits": {"cpu": "2"}},
            "nodeSelector": {"pool": "memory"},
            "podLabels": {"team": "kv"},
        }
    }
    docs = render(values)
    c = container(docs, STORE)
    assert {"--port=6000", "--metrics-port=6001"} <= set(c["args"])
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"rpc": 6000, "metrics": 6001}
    assert by_kind(docs, "Service")[f"{RELEASE}-{STORE}"]["spec"]["ports"][0]["port"] == 6000
    assert store_flags(docs)["decode"] == [f"{RELEASE}-{STORE}.{NAMESPACE}.svc.cluster.local:6000"]
    assert c["resources"]["requests"] == {"cpu": "500m", "memory": "5Gi"}
    assert c["resources"]["limits"] == {"cpu": "2", "memory": "5Gi"}
    pod = deployment(docs, STORE)["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"pool": "memory"} and pod["metadata"]["labels"]["team"] == "kv"


def test_the_store_image_defaults_to_the_worker_image_field_by_field():
    """The GPU profile's workers run the CUDA build, which loads only where a GPU is: the profile gives the
    store the CPU build's tag, and nothing of the GPU pods' scheduling."""
    values = copy.deepcopy(PROFILES["gpu-rdma"])
    values["kvStore"]["enabled"] = True
    docs = render(values)
    c = container(docs, STORE)
    assert container(docs, "prefill")["image"] == "registry.example.com/tandem-worker:0.1.0-cuda"
    assert c["image"] == "registry.example.com/tandem-worker:0.1.0"
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    pod = deployment(docs, STORE)["spec"]["template"]["spec"]
    assert not {"hostNetwork", "runtimeClassName", "tolerations", "nodeSelector"} & set(pod)
    own = render({"kvStore": {"enabled": True, "image": {"repository": "r.example/kv", "pullPolicy": "Always"}}})
    assert container(own, STORE)["image"] == "r.example/kv:0.1.0"  # the chart's appVersion, as for the workers
    assert container(own, STORE)["imagePullPolicy"] == "Always"


@pytest.mark.parametrize(
    "bad",
    [
        {"memoryGib": -1},
        {"memoryGib": 0},
        {"memoryGib": "4Gi"},
        {"memoryOverheadGib": 0},
        {"port": 0},
        {"port": 70000},
        {"metricsPort": 50151},  # the master's RPC port
        {"enabled": "yes"},
        {"resources": {"limits": {"memory": "1Gi"}}},  # memoryGib + memoryOverheadGib decide it
        {"resources": {"requests": {"memory": "1Gi"}}},
        {"image": {"pullPolicy": "Sometimes"}},
    ],
)
def test_bad_store_values_are_refused(bad):
    with pytest.raises(helm.HelmError, match="kvStore"):
        render({"kvStore": {"enabled": True, **bad}})


def test_values_from_before_the_store_still_render():
    """`helm upgrade --reuse-values` from a release whose values have no kvStore: no store, workers as before."""
    values = {"kvStore": None}
    docs = render(values)
    assert not has_store(docs) and store_flags(docs) == {role: [] for role in WORKERS}
