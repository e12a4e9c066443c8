"""The image recipe without building it: requirement lists follow pyproject.toml, both targets run as
a non-root user with a health check, and the build context holds what the build reads."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _load_python_deps():
    spec = importlib.util.spec_from_file_location("python_deps", ROOT / "docker" / "python_deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


python_deps = _load_python_deps()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DEPENDENCIES = PROJECT["dependencies"]
EXTRAS = PROJECT["optional-dependencies"]


def names(requirements: list[str]) -> set[str]:
    return {python_deps.requirement_name(r) for r in requirements}


def test_worker_image_gets_every_dependency_but_torch():
    assert names(python_deps.image_requirements(DEPENDENCIES, "worker", "cpu")) == names(DEPENDENCIES) - {"torch"}


def test_cuda_worker_swaps_the_mooncake_build_and_adds_flashinfer_both_pinned():
    cuda = python_deps.image_requirements(DEPENDENCIES, "worker", "cuda", EXTRAS)
    assert "mooncake-transfer-engine-non-cuda" not in names(cuda) and "torch" not in names(cuda)
    # the versions the GPU code was written against (docs/performance.md, "GPU"), and nothing looser
    assert "flashinfer-python==0.7.2.post1" in cuda and "mooncake-transfer-engine==0.3.13.post1" in cuda
    assert EXTRAS["gpu"] == ["flashinfer-python==0.7.2.post1"]
    assert names(cuda) == names(DEPENDENCIES) - {"torch", "mooncake-transfer-engine-non-cuda"} | {
        "flashinfer-python",
        "mooncake-transfer-engine",
    }
    with pytest.raises(ValueError, match="no optional dependency group 'gpu'"):
        python_deps.image_requirements(DEPENDENCIES, "worker", "cuda", {})


def _accelerator_checks() -> dict[str, str]:
    """The worker stage's `if [ "$ACCELERATOR" = X ]; then ...; fi` commands, by X, line continuations joined."""
    stage = _stage("worker")
    branches = re.findall(r'if \[ "\$ACCELERATOR" = (\w+) \]; then (.*?); fi', stage, re.DOTALL)
    return {name: re.sub(r"\\\n\s*", "", command) for name, command in branches}


def test_the_cpu_worker_stage_imports_mooncake():
    assert _accelerator_checks()["cpu"] == 'python3 -c "import mooncake.engine"'


@pytest.mark.parametrize(
    "installed, error",
    [
        ({"flashinfer-python": "0.7.2.post1", "mooncake-transfer-engine": "0.3.13.post1"}, None),
        (
            {
                "flashinfer-python": "0.7.2.post1",
                "mooncake-transfer-engine": "0.3.13.post1",
                "mooncake-transfer-engine-non-cuda": "0.3.13",
            },
            "the CPU Mooncake would shadow the CUDA one",
        ),
        ({"mooncake-transfer-engine": "0.3.13.post1"}, "flashinfer-python"),
        ({"flashinfer-python": "0.7.2.post1"}, "mooncake-transfer-engine"),
    ],
)
def test_the_cuda_worker_stage_checks_the_builds_it_installed(monkeypatch, capsys, installed, error):
    """The CUDA Mooncake links libcuda.so.1, which only a GPU host has, so the stage cannot import it: its
    check, run here over a made-up set of installed distributions, fails the build when the CPU Mooncake is
    still installed or either CUDA build is missing, and names the versions it found."""
    command = _accelerator_checks()["cuda"]
    assert command.startswith('python3 -c "') and command.endswith('"')
    code = command[len('python3 -c "') : -1]
    assert "import mooncake" not in code

    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    distributions = [SimpleNamespace(metadata={"Name": name}) for name in installed]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: iter(distributions))
    monkeypatch.setattr(importlib.metadata, "version", version)
    if error is None:
        exec(code, {})
        assert capsys.readouterr().out.split() == [
            "flashinfer-python",
            "0.7.2.post1",
            "mooncake-transfer-engine",
            "0.3.13.post1",
        ]
    else:
        with pytest.raises((AssertionError, importlib.metadata.PackageNotFoundError), match=error):
            exec(code, {})


def test_gateway_image_leaves_out_the_engine_side():
    gateway = python_deps.image_requirements(DEPENDENCIES, "gateway", "cpu")
    assert set(gateway) <= set(DEPENDENCIES)  # same specifiers as pyproject
    assert not names(gateway) & {
        "torch",
        "safetensors",
        "mooncake-transfer-engine-non-cuda",
        "grpcio-tools",
        "xgrammar",
    }
    assert {"transformers", "gguf", "fastapi", "uvicorn", "grpcio", "grpcio-health-checking"} <= names(gateway)
    # The gRPC API: server reflection, and google.rpc's error details (googleapis-common-protos comes with
    # grpcio-status).
    assert {"grpcio-reflection", "grpcio-status", "protobuf"} <= names(gateway)


def _imported_modules(path: Path) -> set[str]:
    """The absolute modules `path` imports (its syntax tree, so docstrings and comments never count)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_gateway_imports_are_covered_by_its_requirements():
    """Every third-party module the gateway's packages (and `tandem healthcheck`) import is installed in its image."""
    provided = names(python_deps.image_requirements(DEPENDENCIES, "gateway", "cpu"))
    # By the longest matching prefix: google.rpc is googleapis-common-protos, which grpcio-status brings.
    module_to_project = {
        "grpc": "grpcio",
        "grpc_health": "grpcio-health-checking",
        "grpc_reflection": "grpcio-reflection",
        "grpc_status": "grpcio-status",
        "google.protobuf": "protobuf",
        "google.rpc": "grpcio-status",
        "fastapi": "fastapi",
        "starlette": "fastapi",
        "pydantic": "fastapi",
        "uvicorn": "uvicorn",
        "transformers": "transformers",
        "jinja2": "jinja2",
        "httpx": "httpx",
        "multipart": "python-multipart",
        "python_multipart": "python-multipart",
        "prometheus_client": "prometheus-client",
    }
    imported = set()
    for path in [*(ROOT / "gateway").rglob("*.py"), ROOT / "launcher" / "healthcheck.py"]:
        imported |= _imported_modules(path)
    stdlib = set(sys.stdlib_module_names) | {"gateway", "tandem", "launcher", "__future__"}
    third_party = {m for m in imported if m.split(".")[0] not in stdlib}

    def project(module: str) -> str | None:
        parts = module.split(".")
        prefixes = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
        return next((module_to_project[p] for p in prefixes if p in module_to_project), None)

    unknown = {m for m in third_party if project(m) is None}
    assert not unknown, f"map these gateway imports to their PyPI projects: {unknown}"
    assert "grpc_reflection.v1alpha" in third_party and "google.rpc" in third_party  # the gRPC API's, read
    missing = {project(m) for m in third_party} - provided
    assert not missing, f"the gateway imports {missing}, which pyproject.toml's dependencies (and so its image) lack"


def test_python_deps_cli_prints_one_requirement_a_line():
    out = subprocess.run(
        [sys.executable, str(ROOT / "docker" / "python_deps.py"), "worker", "--accelerator", "cuda"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out == python_deps.image_requirements(DEPENDENCIES, "worker", "cuda", EXTRAS)
    with pytest.raises(ValueError):
        python_deps.image_requirements(DEPENDENCIES, "worker", "rocm")


def _stage(name: str) -> str:
    match = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.MULTILINE | re.DOTALL)
    assert match, name
    return match.group(1)


@pytest.mark.parametrize("target", ["gateway", "worker"])
def test_final_images_are_non_root_with_a_health_check(target):
    stage = _stage(target)
    assert re.search(r"^USER tandem$", stage, re.MULTILINE)
    assert re.search(r"^HEALTHCHECK .*\n?.*tandem.*healthcheck", stage, re.MULTILINE)
    assert 'ENTRYPOINT ["tandem"]' in stage
    assert "COPY --from=" in stage and "/models" in stage


def test_an_edit_of_tandem_rebuilds_only_the_last_layer_of_each_image():
    """The 1.5 GB environments and the model come from stages that never read the source, the kernel build
    reads only the kernels' build script and C++ sources, and each image installs Tandem's wheel last."""
    for stage in ("requirements", "gateway-deps", "worker-deps", "model-wheel", "gateway-env", "worker-env"):
        copies = re.findall(r"^COPY (.*)$", _stage(stage), re.MULTILINE)
        assert all(
            c.startswith(("docker/", "--from=requirements", "--from=model-wheel"))
            or c.startswith("docker/python_deps.py pyproject.toml")
            for c in copies
        ), (stage, copies)
    kernel_copies = re.findall(r"^COPY (.*)$", _stage("kernel-build"), re.MULTILINE)
    assert kernel_copies == [
        "kernels/__init__.py kernels/native.py /opt/tandem/build/kernels/",
        "kernels/csrc/ /opt/tandem/build/kernels/csrc/",
    ]
    for target in ("gateway", "worker"):
        steps = re.findall(r"^(COPY|RUN|FROM|ENV|ARG|LABEL|USER) ?(.*)$", _stage(target), re.MULTILINE)
        source_at = steps.index(("COPY", "--from=source /dist/ /opt/tandem/dist/"))
        assert [kind for kind, _ in steps[source_at + 1 :]] == ["RUN", "USER"], target
        assert not any("--from=source" in args for _, args in steps[:source_at]), target


def test_base_image_is_a_build_argument_with_a_cpu_default():
    assert re.search(r"^ARG BASE_IMAGE=debian:bookworm-slim$", DOCKERFILE, re.MULTILINE)
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS system$", DOCKERFILE, re.MULTILINE)
    for arg in ("ACCELERATOR", "TORCH_VERSION", "TORCH_INDEX_URL"):
        assert f"ARG {arg}=" in DOCKERFILE


def test_build_context_has_what_the_build_reads_and_not_the_rest():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(relative: str) -> bool:
        return any(
            fnmatch.fnmatch(relative, p.lstrip("/")) or relative.split("/")[0] == p.lstrip("/") for p in patterns
        )

    for needed in (
        "pyproject.toml",
        "README.md",
        "scripts/gen_protos.py",
        "docker/python_deps.py",
        "docker/install-torch.sh",
        "docker/bundle_model.py",
        "docker/check_cpu_grammar.py",
        "docker/wheels/README.md",
        "docker/certs/README.md",
        "protos/tandem/v1/common.proto",
    ):
        assert (ROOT / needed).exists() and not ignored(needed), needed
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in (p.rstrip("*") for p in include):
        if (ROOT / package).is_dir():
            assert not ignored(package), package
    for excluded in (".git", ".venv", "tests", "helm", "protos/tandem/v1/common_pb2.py"):
        assert ignored(excluded), excluded
