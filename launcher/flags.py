"""The `tandem` command line: every subcommand's flags (`build_parser`). A flag that sets a config
field takes its default from that field (`GatewayConfig` here, the worker's in worker_flags.py)."""

from __future__ import annotations

import argparse

from gateway.cluster.discovery import check_worker_spec
from gateway.config import GatewayConfig, RouterPolicy, RoutingConfig
from launcher.defaults import field_default
from launcher.healthcheck import add_healthcheck_args
from launcher.internal_plane import (
    add_internal_plane_args,
    add_internal_token_args,
    add_kv_grant_args,
)
from launcher.worker_flags import (
    DEFAULT_WORKER_HOST,
    add_embedding_arg,
    add_model_args,
    add_worker_args,
    positive_float,
    positive_int,
)
from server_runtime.config import WorkerConfig

DEFAULT_PREFILL_PORT = 30001
DEFAULT_DECODE_PORT = 30002
DEFAULT_KV_STORE_PORT = 50151
DEFAULT_KV_STORE_GIB = 4.0


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    """The gateway's flags (also taken by `tandem serve`)."""
    _add_gateway_limit_args(p)
    _add_routing_args(p)
    _add_gateway_plane_args(p)


def _add_routing_args(p: argparse.ArgumentParser) -> None:
    """Where requests go (gateway/cluster/routing.py)."""
    p.add_argument(
        "--router-policy",
        default=field_default(RoutingConfig, "policy").value,
        choices=[policy.value for policy in RouterPolicy],
        help="how requests are placed on the workers: round_robin; least_load (fewest requests in flight, "
        "decode then most free pages); prefix_aware (prefill and decode each where the prompt's prefix is "
        "likely cached, within --prefix-load-guard; else least_load)",
    )
    p.add_argument(
        "--prefix-load-guard",
        type=int,
        default=field_default(RoutingConfig, "prefix_load_guard"),
        help="prefix_aware: a prompt goes to the prefill (or decode) worker holding its prefix only while that "
        "worker has at most this many more requests in flight than the least loaded one of its role",
    )
    p.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=field_default(RoutingConfig, "local_prefill_threshold"),
        help="prompts of which their decode worker likely lacks fewer than this many tokens (the whole "
        "prompt, unless prefix_aware finds part of it in that worker's prefix cache) are prefilled by "
        "it, with no KV transfer (0: never)",
    )
    p.add_argument(
        "--prefill-busy-threshold",
        type=int,
        default=field_default(RoutingConfig, "prefill_busy_threshold"),
        help="while every prefill worker has this many requests or more in flight, prompts are prefilled "
        "by their decode worker (0: never)",
    )


def _add_gateway_limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model path)")
    p.add_argument("--prefill-timeout", type=float, default=field_default(GatewayConfig, "prefill_timeout_s"))
    p.add_argument("--request-timeout", type=float, default=field_default(GatewayConfig, "request_timeout_s"))
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=field_default(GatewayConfig, "max_queued_requests"),
        help="generations that may wait for decode KV space at once; one more gets a 503 with "
        "Retry-After (0: no queue, refuse at once)",
    )
    p.add_argument(
        "--max-queue-wait",
        type=float,
        default=field_default(GatewayConfig, "max_queue_wait_s"),
        help="seconds a generation may wait for decode KV space before a 503 with Retry-After",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=field_default(GatewayConfig, "stall_timeout_s"),
        help="seconds a worker may send nothing on a request before the gateway checks its health; "
        "one that does not answer ends the request with a 503 and gets no new requests until "
        "it answers again",
    )
    p.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer: requests send token ids and get token ids back (no text, no chat)",
    )


def _add_gateway_plane_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer <key>` on every route but /health, /ping and /metrics "
        "(default: the TANDEM_API_KEY environment variable, else no key)",
    )
    p.add_argument(
        "--admin-api-key",
        default=None,
        help="the admin routes (/flush_cache, /update_weights_from_disk, /get_server_info, the expert "
        "distribution record) need `Authorization: Bearer <admin key>`; the user key no longer "
        "opens them (default: the TANDEM_ADMIN_API_KEY environment variable, else the admin "
        "routes take the --api-key)",
    )
    p.add_argument(
        "--default-sampling",
        default=None,
        help='JSON of sampling defaults for fields a request leaves unset, e.g. \'{"temperature": 0.7, '
        "\"top_p\": 0.9}' (keys: temperature, top_p, top_k, min_p). Default: the model's "
        "generation_config.json; greedy for the bundled SmolLM2",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="where /v1/files, /v1/batches and /v1/responses keep their SQLite databases and file contents; one "
        "gateway per directory (default: $XDG_DATA_HOME/tandem, i.e. ~/.local/share/tandem)",
    )
    p.add_argument(
        "--max-batch-requests",
        type=int,
        default=field_default(GatewayConfig, "max_batch_requests"),
        help="most generations one request may start (prompts x n); more get a 400",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=field_default(GatewayConfig, "max_request_body_bytes"),
        help="largest request body (JSON) the gateway reads; larger ones get a 413 unread "
        "(/v1/files uploads have their own limit, 200 MB per file)",
    )
    p.add_argument(
        "--batch-concurrency",
        type=int,
        default=field_default(GatewayConfig, "batch_concurrency"),
        help="batch lines run at once; a new one starts only while no interactive request is in flight",
    )
    p.add_argument(
        "--expert-distribution-dir",
        default=None,
        help="where /dump_expert_distribution_record writes expert_distribution_*.csv "
        "(default: the gateway's working directory)",
    )


def add_drain_arg(p: argparse.ArgumentParser, config: type) -> None:
    """--drain-timeout, its default `config`'s (`tandem serve` gives the gateway's to all three)."""
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=field_default(config, "drain_timeout_s"),
        help="on SIGTERM or Ctrl-C: seconds a server keeps serving the requests in flight before it "
        "exits (a worker's health answers NOT_SERVING and it refuses new requests; the gateway "
        "stops accepting connections); a second signal exits at once",
    )


def add_tracing_arg(p: argparse.ArgumentParser) -> None:
    """--otlp-traces-endpoint (`tandem serve` gives it to the gateway and every worker)."""
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="export OpenTelemetry traces, one per request (a caller's W3C traceparent is joined), to the "
        "OTLP/gRPC collector at this URL: http://host:4317 (plaintext) or https://host:4317 (TLS); "
        "OTEL_* variables tune the exporter (docs/tracing.md). Default: off, nothing is sent anywhere",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="gateway + prefill and decode workers on this machine")
    add_model_args(serve)
    add_worker_args(serve)
    add_gateway_args(serve)
    add_drain_arg(serve, GatewayConfig)
    add_tracing_arg(serve)
    serve.add_argument("--host", default=field_default(GatewayConfig, "host"), help="gateway bind address")
    serve.add_argument("--port", type=int, default=field_default(GatewayConfig, "port"))
    serve.add_argument(
        "--grpc-port",
        type=int,
        default=field_default(GatewayConfig, "grpc_port"),
        help="port of the gateway's gRPC API (tandem.api.v1, beside HTTP on --host); 0 turns it off",
    )
    serve.add_argument(
        "--prefill-workers", type=positive_int, default=1, help="prefill workers to run (ports from --prefill-port up)"
    )
    serve.add_argument(
        "--decode-workers", type=positive_int, default=1, help="decode workers to run (ports from --decode-port up)"
    )
    serve.add_argument(
        "--prefill-port", type=int, default=DEFAULT_PREFILL_PORT, help="the first prefill worker's gRPC port"
    )
    serve.add_argument(
        "--decode-port",
        type=int,
        default=None,
        help="the first decode worker's gRPC port (default: right after the prefill workers' ports, "
        f"{DEFAULT_DECODE_PORT} with one)",
    )
    serve.add_argument("--startup-timeout", type=float, default=600.0)
    add_internal_plane_args(serve)
    serve.add_argument(
        "--prefill-metrics-port",
        type=int,
        default=None,
        help="the first prefill worker's Prometheus port, the others' following it (default: each "
        "worker's gRPC port + 100; 0: off)",
    )
    serve.add_argument(
        "--decode-metrics-port",
        type=int,
        default=None,
        help="the first decode worker's Prometheus port, the others' following it (default: each "
        "worker's gRPC port + 100; 0: off)",
    )
    add_embedding_arg(serve)
    serve.add_argument(
        "--kv-store-gb",
        type=positive_float,
        default=DEFAULT_KV_STORE_GIB,
        help="with --kv-store and no address: GiB of memory the store started for the workers keeps pages in",
    )
    serve.add_argument(
        "--kv-store-port", type=int, default=DEFAULT_KV_STORE_PORT, help="with --kv-store and no address: its port"
    )

    gateway = sub.add_parser("gateway", help="the HTTP gateway alone")
    add_model_args(gateway)
    add_gateway_args(gateway)
    add_drain_arg(gateway, GatewayConfig)
    add_tracing_arg(gateway)
    gateway.add_argument("--host", default=field_default(GatewayConfig, "host"))
    gateway.add_argument("--port", type=int, default=field_default(GatewayConfig, "port"))
    gateway.add_argument(
        "--grpc-port",
        type=int,
        default=field_default(GatewayConfig, "grpc_port"),
        help="port of the gateway's gRPC API (tandem.api.v1, beside HTTP on --host); 0 turns it off",
    )
    gateway.add_argument(
        "--prefill",
        action="append",
        required=True,
        type=check_worker_spec,
        help="prefill worker host:port, or dns:///name:port for every address the name resolves "
        "to, re-resolved every few seconds (a headless Service); repeatable",
    )
    gateway.add_argument(
        "--decode",
        action="append",
        type=check_worker_spec,
        help="decode worker host:port or dns:///name:port (as --prefill); repeatable; required unless --is-embedding",
    )
    add_embedding_arg(gateway)
    add_internal_plane_args(gateway)

    for role, port in (("prefill", DEFAULT_PREFILL_PORT), ("decode", DEFAULT_DECODE_PORT)):
        worker = sub.add_parser(role, help=f"a {role} worker alone")
        add_model_args(worker)
        add_worker_args(worker)
        add_drain_arg(worker, WorkerConfig)
        add_tracing_arg(worker)
        worker.add_argument("--host", default=DEFAULT_WORKER_HOST, help="gRPC bind address")
        worker.add_argument("--port", type=int, default=port)
        worker.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            help="HTTP port serving Prometheus text at /metrics (default: --port + 100; 0: off)",
        )
        if role == "prefill":
            add_embedding_arg(worker)
        add_internal_plane_args(worker)
        add_kv_grant_args(worker)

    store = sub.add_parser(
        "kv-store", help="the cluster's KV store (Mooncake Store): workers started with --kv-store keep pages in it"
    )
    store.add_argument(
        "--host",
        default="127.0.0.1",
        help="this machine's address the store listens on (every port it opens); workers reach it there",
    )
    store.add_argument("--port", type=int, default=DEFAULT_KV_STORE_PORT, help="the port workers' --kv-store names")
    store.add_argument(
        "--memory-gb", type=positive_float, default=DEFAULT_KV_STORE_GIB, help="GiB of memory the store keeps pages in"
    )
    store.add_argument(
        "--metrics-port", type=int, default=None, help="the store's Prometheus text, on --host (default: --port + 1)"
    )
    store.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    add_healthcheck_args(
        sub.add_parser("healthcheck", help="probe a worker's gRPC health or the gateway's /health once")
    )
    add_internal_token_args(
        sub.add_parser("internal-token", help="write a fresh internal token (or KV grant secret) to a file (once)")
    )
    return parser
