"""The Helm chart under helm/ as the chart tests read it: the release they render, the values profiles,
`render` (helm-python-sdk in-process: no helm binary, no cluster) and readers of the rendered manifests."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[2] / "helm"
RELEASE, NAMESPACE = "tandem", "llm"
KUBE_VERSIONS = ("1.27.0", "1.30.0")
WORKERS = ("prefill", "decode")
STORE = "kv-store"
TOKEN_SECRET = f"{RELEASE}-internal-token"
GRANT_SECRET = f"{RELEASE}-kv-grant-secret"


def _values_file(name: str) -> dict:
    return yaml.safe_load((CHART / name).read_text())


EVERYTHING_ON = {
    "gateway": {
        "replicas": 2,
        "ingress": {"enabled": True, "className": "nginx"},
        "autoscaling": {"enabled": True},
        "extraPrefill": ["10.0.0.9:30001"],
    },
    "model": {
        "source": "pvc",
        "path": "/models/Qwen2-0.5B-Instruct",
        "servedModelName": "qwen",
        "pvc": {"claimName": "models", "subPath": "hf"},
    },
    "config": {
        "maxTotalTokens": 65536,
        "contextLength": 4096,
        "defaultSampling": '{"temperature": 0.7}',
        "kvHostCacheGib": 2,
        "kvDiskCacheGib": 20,
    },
    "prefill": {"replicas": 3, "extraArgs": ["--max-prefill-tokens=16384"]},
    "kvStore": {"enabled": True, "memoryGib": 8},
}
EVERYTHING_ON["gateway"]["apiKeySecret"] = {"name": "tandem-api-key", "key": "key"}
EVERYTHING_ON["gateway"]["adminApiKeySecret"] = {"name": "tandem-admin-key", "key": "admin"}
PROFILES = {"default": None, "gpu-rdma": _values_file("values-gpu-rdma.yaml"), "everything-on": EVERYTHING_ON}


def render(values: dict | None) -> list[dict]:
    """The chart's manifests for `values` (None: the defaults), as the release RELEASE in NAMESPACE."""
    # helm-python-sdk is a test extra: the chart's test modules skip themselves without it (importorskip),
    # so this module, and the deploy tests' conftest that imports it, load without it.
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values=copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [
        doc
        for path, text in sorted(rendered.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def deployment(docs: list[dict], component: str) -> dict:
    return by_kind(docs, "Deployment")[f"{RELEASE}-{component}"]


def container(docs: list[dict], component: str) -> dict:
    (only,) = deployment(docs, component)["spec"]["template"]["spec"]["containers"]
    return only


def has_store(docs: list[dict]) -> bool:
    """Whether the KV page store (kvStore.enabled) is among the rendered Deployments."""
    return f"{RELEASE}-{STORE}" in by_kind(docs, "Deployment")


def pod_labels(docs: list[dict], component: str) -> dict[str, str]:
    return deployment(docs, component)["spec"]["template"]["metadata"]["labels"]


def token_file_arg(docs: list[dict], component: str) -> tuple[str, str]:
    """The Secret and key `component`'s pod reads the internal token from (checked to be mounted read-only,
    with --internal-token-file naming the mounted file)."""
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
    """The Secret and key `component`'s pod reads the KV grant secret from (checked as `token_file_arg`
    does), or None when its pod has no such volume, mount or flag."""
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


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels and matchExpressions) selects `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        matched = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not matched:
            return False
    return True
