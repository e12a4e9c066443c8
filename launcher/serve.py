"""`tandem serve`: the gateway and its prefill and decode workers (`--prefill-workers N --decode-workers M`)
as child processes of one supervisor.
Their configs are built here from one parse of the flags and handed to each child whole
(launcher/handoff.py): a child reads no flag of its own but its log level."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass

from engine.config import ConfigError
from gateway.config import GatewayConfig
from launcher.configs import engine_config, gateway_config, worker_config
from launcher.defaults import default_max_torch_threads, default_torch_threads
from launcher.handoff import HANDOFF_FLAG, WITHHELD_VARIABLES, child_environment, to_json
from launcher.internal_plane import serve_credentials
from launcher.supervisor import ChildSpec, Supervisor
from launcher.worker_flags import DEFAULT_WORKER_HOST, START_KV_STORE, metrics_port
from server_runtime.config import WorkerConfig
from tandem.internal_auth import generate_token

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVStoreChild:
    """The KV store `tandem serve --kv-store` starts for its workers (`tandem kv-store`), on loopback."""

    port: int
    memory_gib: float
    host: str = DEFAULT_WORKER_HOST

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_port(self) -> int:
        return self.port + 1

    def child_spec(self, log_level: str) -> ChildSpec:
        """Not essential: if the store stops, the workers recompute what it held and the stack serves on."""
        args = ("kv-store", "--host", self.host, "--port", str(self.port), "--memory-gb", str(self.memory_gib))
        env = {name: value for name, value in os.environ.items() if name not in WITHHELD_VARIABLES}
        return ChildSpec("kv-store", (*args, "--log-level", log_level), env=env, config="", is_essential=False)


@dataclass(frozen=True, slots=True)
class StackConfigs:
    """What `tandem serve` runs: prefill workers, decode workers (none in an embedding stack: embeddings
    need no decode) and the gateway in front of them all, on loopback."""

    prefills: tuple[WorkerConfig, ...]
    decodes: tuple[WorkerConfig, ...]
    gateway: GatewayConfig
    kv_store: KVStoreChild | None = None

    @property
    def prefill(self) -> WorkerConfig:
        """The first prefill worker."""
        return self.prefills[0]

    @property
    def decode(self) -> WorkerConfig | None:
        """The first decode worker; None in an embedding stack."""
        return self.decodes[0] if self.decodes else None

    @property
    def children(self) -> tuple[WorkerConfig | GatewayConfig, ...]:
        """Each child's config, in the order they start."""
        return (*self.prefills, *self.decodes, self.gateway)


def stack_configs(args: argparse.Namespace) -> StackConfigs:
    """The configs from `tandem serve`'s flags: one token for all (the flags' or a fresh one) and a fresh
    KV grant secret for the workers alone. Worker i of a role listens on its role's first port + i."""
    num_prefill, num_decode = args.prefill_workers, 0 if args.is_embedding else args.decode_workers
    credentials = serve_credentials(args)
    grant_secret = None if args.is_embedding else generate_token()
    decode_port = args.decode_port if args.decode_port is not None else args.prefill_port + num_prefill
    store = None
    if args.kv_store == START_KV_STORE and not args.is_embedding:
        store = KVStoreChild(args.kv_store_port, args.kv_store_gb)

    def workers(role: str, count: int, first_port: int, first_metrics_port: int | None) -> tuple[WorkerConfig, ...]:
        if count == 0:
            return ()
        # once per role: resolving it probes the device and may warn
        engine = engine_config(args, role, role == "prefill" and args.is_embedding)
        return tuple(
            worker_config(
                args,
                role=role,
                host=DEFAULT_WORKER_HOST,
                port=first_port + i,
                metrics_port=metrics_port(_nth(first_metrics_port, i), first_port + i),
                credentials=credentials,
                kv_grant_secret=grant_secret,
                torch_threads=args.torch_threads or default_torch_threads(role, num_prefill, num_decode),
                max_torch_threads=0 if args.torch_threads else default_max_torch_threads(role, num_prefill, num_decode),
                engine=engine,
                kv_store=store.address if store else None,
            )
            for i in range(count)
        )

    prefills = workers("prefill", num_prefill, args.prefill_port, args.prefill_metrics_port)
    decodes = workers("decode", num_decode, decode_port, args.decode_metrics_port)
    gateway = gateway_config(
        args,
        prefill_addrs=tuple(_address(w) for w in prefills),
        decode_addrs=tuple(_address(w) for w in decodes),
        internal=credentials,
    )
    _check_ports(prefills + decodes, gateway, store)
    return StackConfigs(prefills, decodes, gateway, store)


def _nth(first_port: int | None, i: int) -> int | None:
    """Worker i's port after `first_port` (None: unset; 0: off, for every worker)."""
    return first_port + i if first_port else first_port


def _check_ports(workers: tuple[WorkerConfig, ...], gateway: GatewayConfig, store: KVStoreChild | None) -> None:
    """SystemExit naming the port two of the stack's servers would both listen on."""
    taken: dict[int, str] = {gateway.port: "the gateway's HTTP port"}
    if gateway.grpc_port:
        taken.setdefault(gateway.grpc_port, "the gateway's gRPC port")
    if store is not None:
        for port, what in ((store.port, "port"), (store.metrics_port, "metrics port")):
            if port in taken:
                raise SystemExit(
                    f"tandem serve: port {port} would be both {taken[port]} and the KV store's {what}; "
                    "choose --kv-store-port apart"
                )
            taken[port] = f"the KV store's {what}"
    for worker in workers:
        for port, what in ((worker.port, "gRPC"), (worker.metrics_port, "metrics")):
            if not port:
                continue
            if port in taken:
                raise SystemExit(
                    f"tandem serve: port {port} would be both {taken[port]} and a {worker.role} worker's {what} "
                    "port; choose --prefill-port / --decode-port (and their metrics ports) apart"
                )
            taken[port] = f"a {worker.role} worker's {what} port"


def serve(args: argparse.Namespace) -> int:
    stack = stack_configs(args)
    model_path = stack.gateway.model_path  # the flag, or the bundled model when it is not given
    children = [child_spec(config, args.log_level, child_name(stack, config)) for config in stack.children]
    if stack.kv_store is not None:  # first: the workers find it at their start, or connect once it answers
        children.insert(0, stack.kv_store.child_spec(args.log_level))
    gateway = stack.gateway
    url_host = "127.0.0.1" if gateway.host in ("0.0.0.0", "::") else gateway.host
    supervisor = Supervisor(
        children,
        f"http://{url_host}:{gateway.port}/health",
        args.startup_timeout,
        stop_grace_s=args.drain_timeout + 10,
    )
    if stack.decodes:
        # The children import their code (seconds) while the model is checked here; a model that cannot be
        # served is one line, and the children are stopped before they get their configs, rather than a
        # traceback from each of them.
        supervisor.spawn()
        try:
            draft_path = stack.decodes[0].draft_model_path
            problems = [(path, checkpoint_problem(path)) for path in (model_path, draft_path) if path]
        except BaseException:
            supervisor.stop()
            raise
        for path, problem in problems:
            if problem is not None:
                supervisor.stop()
                logger.error("cannot serve %s: %s", path, problem)
                return 2
    prefills = ", ".join(_address(w) for w in stack.prefills)
    workers = (
        f"embedding prefill {prefills}, no decode). Ctrl-C stops them all."
        if not stack.decodes
        else f"prefill {prefills}, decode {', '.join(_address(w) for w in stack.decodes)}). Ctrl-C stops them all."
    )
    grpc_api = f", gRPC API on {url_host}:{gateway.grpc_port}" if gateway.grpc_port else ""
    if stack.kv_store is not None:
        workers = workers.replace(". Ctrl-C", f", KV store {stack.kv_store.address}. Ctrl-C", 1)
    return supervisor.run(
        f"Tandem is ready: gateway on http://{url_host}:{gateway.port}{grpc_api} "
        f"(model {gateway.served_model_name!r}; {workers}"
    )


def checkpoint_problem(model_path: str) -> str | None:
    """Why the generation model at `model_path` cannot be served (one line), or None when it opens:
    its headers, config and tensor table are read and checked, no weights."""
    from engine.weights import open_checkpoint  # torch: only when a model is served, not for --help

    try:
        open_checkpoint(model_path)
    except (ConfigError, FileNotFoundError) as exc:
        return str(exc)
    return None


def child_spec(config: WorkerConfig | GatewayConfig, log_level: str, name: str | None = None) -> ChildSpec:
    """The child that runs `config` (named `name` in the supervisor's log, else by its role): it reads
    the config from stdin, its secrets from its environment."""
    command = config.role if isinstance(config, WorkerConfig) else "gateway"
    return ChildSpec(
        name or command,
        (command, "--log-level", log_level, HANDOFF_FLAG),
        env=child_environment(os.environ, config),
        config=to_json(config),
    )


def child_name(stack: StackConfigs, config: WorkerConfig | GatewayConfig) -> str:
    """ "prefill", "decode", "gateway"; "prefill-2" and the like where a role has several workers."""
    if not isinstance(config, WorkerConfig):
        return "gateway"
    same_role = stack.prefills if config.role == "prefill" else stack.decodes
    return config.role if len(same_role) == 1 else f"{config.role}-{same_role.index(config) + 1}"


def _address(worker: WorkerConfig) -> str:
    return f"{worker.host}:{worker.port}"
