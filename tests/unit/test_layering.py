"""The layering rules of the style guide (kernels -> engine -> kv_transfer -> server runtime -> servers;
gateway on protos only; `tandem.limits` and `tandem.sampling`, the sampling ranges and record, shared by engine
and gateway), checked on every import statement, lazy ones inside functions included."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# Each in-repo package and the directory its top-level module name is relative to.
PACKAGE_PARENTS = {"engine": ".", "kernels": ".", "kv_transfer": ".", "server_runtime": ".",
                   "prefill_server": ".", "decode_server": ".", "gateway": ".", "launcher": ".",
                   "tandem": "protos"}
IN_REPO = frozenset(PACKAGE_PARENTS)


@dataclass(frozen=True, slots=True)
class Import:
    """One imported module, as written in `path` (relative to the repo root) at `line`."""

    path: str
    line: int
    importer: str   # dotted module name of the importing file
    module: str     # dotted name of the imported module

    @property
    def top(self) -> str:
        return self.module.split(".")[0]

    def is_under(self, *prefixes: str) -> bool:
        return any(self.module == p or self.module.startswith(p + ".") for p in prefixes)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.module}"


def _module_name(root: Path, package: str, file: Path) -> str:
    relative = file.relative_to(root / PACKAGE_PARENTS[package]).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_in_repo_module(root: Path, dotted: str) -> bool:
    top = dotted.split(".")[0]
    if top not in PACKAGE_PARENTS:
        return False
    base = root / PACKAGE_PARENTS[top] / Path(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports_of(root: Path, package: str, file: Path) -> Iterator[Import]:
    importer = _module_name(root, package, file)
    is_package_init = file.name == "__init__.py"
    path = str(file.relative_to(root))
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(path, node.lineno, importer, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = importer.split(".")
                drop = node.level - 1 if is_package_init else node.level
                anchor = anchor[:len(anchor) - drop] if drop else anchor
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                # `from engine import errors` imports the module engine.errors
                candidate = f"{base}.{alias.name}"
                module = candidate if _is_in_repo_module(root, candidate) else base
                yield Import(path, node.lineno, importer, module)


def collect_imports(root: Path) -> list[Import]:
    found = []
    for package, parent in PACKAGE_PARENTS.items():
        for file in sorted((root / parent / package).rglob("*.py")):
            found.extend(_imports_of(root, package, file))
    return found


Rule = Callable[[Import], bool]  # True when the import breaks the rule


def _in_package(imp: Import, package: str) -> bool:
    return imp.importer == package or imp.importer.startswith(package + ".")


def _only_in_repo(package: str, allowed: tuple[str, ...]) -> Rule:
    return lambda imp: (_in_package(imp, package) and imp.top in IN_REPO
                        and not imp.is_under(package, *allowed))


def _never(package: str, forbidden: tuple[str, ...]) -> Rule:
    return lambda imp: _in_package(imp, package) and imp.is_under(*forbidden)


KV_TRANSFER_ENGINE_TYPES = ("engine.config", "engine.errors", "engine.kv_pool", "engine.request")
ENGINE_FORBIDDEN = ("grpc", "grpc_health", "grpc_reflection", "fastapi", "starlette", "uvicorn", "pydantic",
                    "threading", "_thread", "concurrent", "asyncio", "socket", "mooncake")
# The gRPC edges: the generated stubs and the gRPC libraries. In the gateway only the cluster wing, whose
# `WorkerClient` converts to and from gateway records, imports the workers' stubs (tandem.v1); the gRPC
# libraries also the client API's wing (grpc_api), which serves tandem.api.v1 (tandem.internal_auth and
# tandem.request_log are plain helpers, open to every wing).
WORKER_STUBS = ("tandem.v1",)
GRPC_LIBRARIES = ("grpc", "grpc_health", "grpc_reflection", "grpc_status", "google.protobuf", "google.rpc",
                  "tandem.api")

RULES: dict[str, Rule] = {
    "kernels imports no in-repo package": _only_in_repo("kernels", ()),
    # tandem.limits and tandem.sampling (standard library only) are the one table of sampling ranges the gateway
    # checks too and the one sampling record it sends; tandem.converted_tokenizer keeps a GGUF file's tokenizer
    # conversion for the gateway and the grammar backend; tandem.page_keys names cached pages for the router
    "engine imports only engine, kernels, tandem.limits, tandem.sampling, tandem.converted_tokenizer and "
    "tandem.page_keys": _only_in_repo(
        "engine", ("kernels", "tandem.limits", "tandem.sampling", "tandem.converted_tokenizer", "tandem.page_keys")),
    "engine has no network, gRPC, HTTP or threads": _never("engine", ENGINE_FORBIDDEN),
    "kv_transfer imports only engine types": _only_in_repo("kv_transfer", KV_TRANSFER_ENGINE_TYPES),
    "server_runtime imports only engine, kernels, kv_transfer and protos":
        _only_in_repo("server_runtime", ("engine", "kernels", "kv_transfer", "tandem")),
    "gateway imports only protos and gateway": _only_in_repo("gateway", ("tandem",)),
    "gateway never imports torch": _never("gateway", ("torch",)),
    "only gateway.cluster imports tandem.v1 stubs":
        lambda imp: (_in_package(imp, "gateway") and not _in_package(imp, "gateway.cluster")
                     and imp.is_under(*WORKER_STUBS)),
    "only gateway.cluster and gateway.grpc_api import grpc":
        lambda imp: (_in_package(imp, "gateway") and not _in_package(imp, "gateway.cluster")
                     and not _in_package(imp, "gateway.grpc_api") and imp.is_under(*GRPC_LIBRARIES)),
    "prefill_server does not import decode_server": _never("prefill_server", ("decode_server",)),
    "decode_server does not import prefill_server": _never("decode_server", ("prefill_server",)),
    "generated protos import no other in-repo package": _only_in_repo("tandem", ()),
    # the transfer engine (KV handoffs) and the store client (the cluster's KV store)
    "mooncake is imported only in kv_transfer/mooncake_backend.py and kv_transfer/mooncake_store.py":
        lambda imp: imp.is_under("mooncake")
        and imp.importer not in ("kv_transfer.mooncake_backend", "kv_transfer.mooncake_store"),
    "flashinfer is imported only in kernels":
        lambda imp: imp.is_under("flashinfer") and not _in_package(imp, "kernels"),
}


# The gateway's floors, bottom up: a module imports gateway modules of its own floor or below, never
# above (`docs/structures.md` names each wing). The core is what every wing shares.
GATEWAY_FLOORS = (
    ("gateway.errors", "gateway.config", "gateway.sampling_defaults", "gateway.records", "gateway.metrics"),
    ("gateway.text", "gateway.cluster"),
    ("gateway.service",),
    ("gateway.api", "gateway.grpc_api"),
    ("gateway.batch",),
    ("gateway.app",),
)


def _gateway_floor(module: str) -> int | None:
    for floor, prefixes in enumerate(GATEWAY_FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return floor
    return None


def _imports_up_the_gateway(imp: Import) -> bool:
    own, imported = _gateway_floor(imp.importer), _gateway_floor(imp.module)
    return own is not None and imported is not None and imported > own


RULES["gateway modules never import a floor above their own"] = _imports_up_the_gateway
# The seam: the operations live in `service/`, which both fronts and the batch runner call; no front leans on another.
RULES["gateway.service and gateway.grpc_api never import gateway.api"] = lambda imp: (
    (_in_package(imp, "gateway.service") or _in_package(imp, "gateway.grpc_api")) and imp.is_under("gateway.api"))
RULES["gateway.service imports no HTTP framework"] = _never("gateway.service", ("fastapi", "starlette"))


def find_violations(root: Path) -> dict[str, list[str]]:
    imports = collect_imports(root)
    return {name: [str(imp) for imp in imports if rule(imp)] for name, rule in RULES.items()}


def find_cycles(imports: list[Import]) -> list[list[str]]:
    """The circles between in-repo modules (strongly connected components of more than one module,
    or a module importing itself), each sorted; type-only and lazy imports count like any other."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.top in IN_REPO:
            graph.setdefault(imp.importer, set()).add(imp.module)
            graph.setdefault(imp.module, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:   # Tarjan's algorithm; the graph is a few hundred modules deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


@pytest.fixture(scope="module")
def violations() -> dict[str, list[str]]:
    return find_violations(REPO_ROOT)


@pytest.mark.parametrize("rule", list(RULES))
def test_layering_rule(rule: str, violations: dict[str, list[str]]) -> None:
    assert violations[rule] == [], f"{rule}:\n" + "\n".join(violations[rule])


def test_no_module_imports_itself_through_others() -> None:
    cycles = find_cycles(collect_imports(REPO_ROOT))
    assert cycles == [], "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_every_package_is_scanned() -> None:
    imports = collect_imports(REPO_ROOT)
    importers = {imp.importer.split(".")[0] for imp in imports}
    assert importers == IN_REPO
    # Lazy imports inside functions count too (mooncake is only imported that way).
    assert any(imp.module.startswith("mooncake") and imp.importer == "kv_transfer.mooncake_backend"
               for imp in imports)


def _write(root: Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


def test_checker_reports_violations_with_file_and_line(tmp_path: Path) -> None:
    """A fake tree breaking each kind of rule; clean files alongside must stay clean."""
    for package, parent in PACKAGE_PARENTS.items():
        _write(tmp_path, f"{parent}/{package}/__init__.py", "")
    _write(tmp_path, "engine/errors.py", "")
    _write(tmp_path, "engine/kv_pool.py", "")
    _write(tmp_path, "engine/runner.py", "")
    _write(tmp_path, "kernels/attention.py", "import torch\n\nfrom engine import errors\n")
    _write(tmp_path, "engine/loop.py", "import threading\nfrom . import errors\n\ndef f():\n    import grpc\n")
    _write(tmp_path, "engine/request.py", "from tandem.limits import TOP_P\nfrom tandem.v1 import common_pb2\n"
                                         "from tandem.sampling import SamplingSpec\n")
    _write(tmp_path, "kv_transfer/ok.py", "from engine.kv_pool import KVLayout\nfrom engine import errors\n")
    _write(tmp_path, "kv_transfer/bad.py", "from engine.runner import ModelRunner\n")
    _write(tmp_path, "gateway/app.py", "import fastapi\nfrom tandem.v1 import common_pb2\nimport torch.nn\n")
    _write(tmp_path, "decode_server/servicer.py", "from prefill_server.servicer import x\n")
    _write(tmp_path, "server_runtime/worker.py", "from ..gateway import app\n")
    _write(tmp_path, "launcher/cli.py", "def main():\n    import mooncake.engine\n")
    _write(tmp_path, "gateway/errors.py", "")
    _write(tmp_path, "gateway/cluster/__init__.py", "")
    _write(tmp_path, "gateway/cluster/pool.py", "from gateway.api import routes\nfrom gateway.errors import APIError\n"
                                                 "import grpc\nfrom tandem.v1 import worker_pb2_grpc\n")
    _write(tmp_path, "gateway/api/__init__.py", "")
    _write(tmp_path, "gateway/api/routes.py", "from gateway.cluster import pool\nfrom tandem.internal_auth import x\n"
                                              "\ndef f():\n    from grpc_health.v1 import health_pb2\n")

    found = find_violations(tmp_path)
    assert found["kernels imports no in-repo package"] == [
        "kernels/attention.py:3: kernels.attention imports engine.errors"]
    assert found["engine has no network, gRPC, HTTP or threads"] == [
        "engine/loop.py:1: engine.loop imports threading", "engine/loop.py:5: engine.loop imports grpc"]
    engine_rule = ("engine imports only engine, kernels, tandem.limits, tandem.sampling, tandem.converted_tokenizer "
                   "and tandem.page_keys")
    assert found[engine_rule] == [   # `from . import errors`: engine.errors
        "engine/request.py:2: engine.request imports tandem.v1"]
    assert found["kv_transfer imports only engine types"] == [
        "kv_transfer/bad.py:1: kv_transfer.bad imports engine.runner"]
    assert found["gateway never imports torch"] == ["gateway/app.py:3: gateway.app imports torch.nn"]
    assert found["gateway imports only protos and gateway"] == []
    assert found["decode_server does not import prefill_server"] == [
        "decode_server/servicer.py:1: decode_server.servicer imports prefill_server.servicer"]
    assert found["server_runtime imports only engine, kernels, kv_transfer and protos"] == [
        "server_runtime/worker.py:1: server_runtime.worker imports gateway.app"]
    assert found["mooncake is imported only in kv_transfer/mooncake_backend.py and kv_transfer/mooncake_store.py"] == [
        "launcher/cli.py:2: launcher.cli imports mooncake.engine"]
    assert found["prefill_server does not import decode_server"] == []
    assert found["only gateway.cluster imports tandem.v1 stubs"] == ["gateway/app.py:2: gateway.app imports tandem.v1"]
    assert found["only gateway.cluster and gateway.grpc_api import grpc"] == [
        "gateway/api/routes.py:5: gateway.api.routes imports grpc_health.v1"]
    assert found["gateway modules never import a floor above their own"] == [
        "gateway/cluster/pool.py:1: gateway.cluster.pool imports gateway.api.routes"]
    assert find_cycles(collect_imports(tmp_path)) == [["gateway.api.routes", "gateway.cluster.pool"]]
