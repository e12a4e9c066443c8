"""`tandem serve`: the gateway, a prefill and a decode worker as child processes of one supervisor.
Their configs are built here from one parse of the flags and handed to each child whole
(launcher/handoff.py): a child reads no flag of its own but its log level."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from gateway.config import GatewayConfig
from launcher.configs import gateway_config, worker_config
from launcher.defaults import default_torch_threads
from launcher.handoff import HANDOFF_FLAG, child_environment, to_json
from launcher.internal_plane import serve_credentials
from launcher.supervisor import ChildSpec, Supervisor
from launcher.worker_flags import DEFAULT_WORKER_HOST, metrics_port
from server_runtime.config import WorkerConfig
from tandem.internal_auth import generate_token


@dataclass(frozen=True, slots=True)
class StackConfigs:
    """What `tandem serve` runs: a prefill worker, a decode worker (none in an embedding stack: embeddings
    need no decode) and the gateway in front of both, on loopback."""

    prefill: WorkerConfig
    decode: WorkerConfig | None
    gateway: GatewayConfig

    @property
    def children(self) -> tuple[WorkerConfig | GatewayConfig, ...]:
        """Each child's config, in the order they start."""
        return (self.prefill, self.gateway) if self.decode is None else (self.prefill, self.decode, self.gateway)


def stack_configs(args: argparse.Namespace) -> StackConfigs:
    """The three configs from `tandem serve`'s flags: one token for all three (the flags' or a fresh one)
    and a fresh KV grant secret for the two workers alone."""
    credentials = serve_credentials(args)
    grant_secret = None if args.is_embedding else generate_token()
    threads = args.torch_threads or default_torch_threads(1 if args.is_embedding else 2)

    def worker(role: str, port: int, metrics_port_flag: int | None) -> WorkerConfig:
        return worker_config(
            args,
            role=role,
            host=DEFAULT_WORKER_HOST,
            port=port,
            metrics_port=metrics_port(metrics_port_flag, port),
            credentials=credentials,
            kv_grant_secret=grant_secret,
            torch_threads=threads,
        )

    prefill = worker("prefill", args.prefill_port, args.prefill_metrics_port)
    decode = None if args.is_embedding else worker("decode", args.decode_port, args.decode_metrics_port)
    gateway = gateway_config(
        args,
        prefill_addrs=(_address(prefill),),
        decode_addrs=() if decode is None else (_address(decode),),
        internal=credentials,
    )
    return StackConfigs(prefill, decode, gateway)


def serve(args: argparse.Namespace) -> int:
    stack = stack_configs(args)
    children = [child_spec(config, args.log_level) for config in stack.children]
    gateway = stack.gateway
    url_host = "127.0.0.1" if gateway.host in ("0.0.0.0", "::") else gateway.host
    supervisor = Supervisor(
        children,
        f"http://{url_host}:{gateway.port}/health",
        args.startup_timeout,
        stop_grace_s=args.drain_timeout + 10,
    )
    workers = (
        f"embedding prefill {_address(stack.prefill)}, no decode). Ctrl-C stops both."
        if stack.decode is None
        else f"prefill {_address(stack.prefill)}, decode {_address(stack.decode)}). Ctrl-C stops all three."
    )
    grpc_api = f", gRPC API on {url_host}:{gateway.grpc_port}" if gateway.grpc_port else ""
    return supervisor.run(
        f"Tandem is ready: gateway on http://{url_host}:{gateway.port}{grpc_api} "
        f"(model {gateway.served_model_name!r}; {workers}"
    )


def child_spec(config: WorkerConfig | GatewayConfig, log_level: str) -> ChildSpec:
    """The child that runs `config`: it reads the config from stdin, its secrets from its environment."""
    name = config.role if isinstance(config, WorkerConfig) else "gateway"
    return ChildSpec(
        name,
        (name, "--log-level", log_level, HANDOFF_FLAG),
        env=child_environment(os.environ, config),
        config=to_json(config),
    )


def _address(worker: WorkerConfig) -> str:
    return f"{worker.host}:{worker.port}"
