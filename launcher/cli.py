"""The `tandem` command: serve (the workers and the gateway in front of them), gateway, prefill, decode, kv-store,
healthcheck, internal-token; and a child of `tandem serve`, which gets its config on stdin (launcher/handoff.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

from engine.config import ConfigError
from gateway.config import GatewayConfig
from launcher.configs import gateway_config, worker_config
from launcher.defaults import default_max_torch_threads, default_torch_threads
from launcher.flags import build_parser
from launcher.handoff import HANDOFF_FLAG, parse_handoff_args, receive_config
from launcher.healthcheck import run_healthcheck
from launcher.internal_plane import (
    check_open_plane,
    credentials_from_args,
    kv_grant_secret_from_args,
    run_internal_token,
)
from launcher.serve import serve
from launcher.worker_flags import metrics_port
from server_runtime.config import WorkerConfig
from tandem.request_log import configure_logging
from tandem.tracing import tracing_to

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if HANDOFF_FLAG in argv:
        return _run_handed_off(parse_handoff_args(argv))
    args = build_parser().parse_args(argv)
    if args.command == "healthcheck":
        return run_healthcheck(args)
    if args.command == "internal-token":
        return run_internal_token(args)
    configure_logging(args.log_level, args.command)
    if args.command == "serve":
        return serve(args)
    if args.command == "kv-store":
        return _kv_store(args)
    if args.command == "gateway":
        return _gateway(args)
    return _worker(args)


def _run_handed_off(args: argparse.Namespace) -> int:
    """A child of `tandem serve`: the config its parent built, read from stdin once the child's code is
    imported (the parent checks the model meanwhile, and stops the child if it cannot be served)."""
    configure_logging(args.log_level, args.command)
    if args.command == "gateway":
        import gateway.app  # noqa: F401

        return _serve_gateway(receive_config(GatewayConfig))
    _worker_code()
    return _serve_worker(receive_config(WorkerConfig))


def _gateway(args: argparse.Namespace) -> int:
    """`tandem gateway`: its config from its flags."""
    if not args.decode and not args.is_embedding:
        raise SystemExit("tandem gateway: --decode is required (unless --is-embedding)")
    internal = credentials_from_args(args)
    check_open_plane(internal, [*args.prefill, *(args.decode or ())], args.insecure, "worker address")
    config = gateway_config(
        args, prefill_addrs=tuple(args.prefill), decode_addrs=tuple(args.decode or ()), internal=internal
    )
    return _serve_gateway(config)


def _worker(args: argparse.Namespace) -> int:
    """`tandem prefill|decode`: its config from its flags."""
    credentials = credentials_from_args(args)
    check_open_plane(credentials, [args.host], args.insecure, f"{args.command} worker bind address")
    if args.kv_host is not None:  # the token does not reach the KV ports: a closed plane is still required
        check_open_plane(credentials, [args.kv_host], args.insecure, f"{args.command} worker KV address (--kv-host)")
    is_embedding = getattr(args, "is_embedding", False)
    config = worker_config(
        args,
        role=args.command,
        host=args.host,
        port=args.port,
        metrics_port=metrics_port(args.metrics_port, args.port),
        credentials=credentials,
        kv_grant_secret=None if is_embedding else kv_grant_secret_from_args(args, credentials),
        torch_threads=args.torch_threads or default_torch_threads(args.command),
        max_torch_threads=0 if args.torch_threads else default_max_torch_threads(args.command),
    )
    return _serve_worker(config)


def _kv_store(args: argparse.Namespace) -> int:
    """`tandem kv-store`: the cluster's KV store, until SIGTERM or SIGINT."""
    from kv_transfer import KVTransferError
    from kv_transfer.mooncake_store import run_store

    metrics = args.metrics_port if args.metrics_port is not None else args.port + 1
    try:
        return run_store(args.host, args.port, int(args.memory_gb * 2**30), metrics)
    except KVTransferError as exc:
        raise SystemExit(f"tandem kv-store: {exc}") from None


def _serve_gateway(config: GatewayConfig) -> int:
    from gateway.app import serve_gateway

    with tracing_to(config.otlp_traces_endpoint, "tandem-gateway"):
        serve_gateway(config)
    return 0


def _worker_code() -> tuple[Callable[..., Any], Any, Any, Any]:
    """`serve_worker` and the prefill, decode and embedding servicer kinds: the worker's code (torch among
    it), imported on the first call, never when this module is."""
    from decode_server.servicer import DECODE
    from prefill_server.embedding_servicer import EMBEDDING
    from prefill_server.servicer import PREFILL
    from server_runtime.worker import serve_worker

    return serve_worker, PREFILL, DECODE, EMBEDDING


def _serve_worker(config: WorkerConfig) -> int:
    serve_worker, PREFILL, DECODE, EMBEDDING = _worker_code()
    kind = EMBEDDING if config.is_embedding else PREFILL if config.role == "prefill" else DECODE
    try:
        with tracing_to(config.otlp_traces_endpoint, f"tandem-{config.kind_name}"):
            asyncio.run(serve_worker(config, kind))
    except (ConfigError, FileNotFoundError) as exc:  # a model it cannot serve: one line, no traceback
        logger.error("cannot serve %s: %s", config.model_path, exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
