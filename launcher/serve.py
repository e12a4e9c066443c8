"""`tandem serve`: the gateway, a prefill and a decode worker as child processes of one supervisor."""

from __future__ import annotations

import argparse
import os

from launcher.defaults import (
    default_data_dir,
    default_model_path,
    default_torch_threads,
    served_name_for,
)
from launcher.internal_plane import (
    ensure_serve_token,
    serve_grant_env,
)
from launcher.worker_flags import metrics_port


def serve(args: argparse.Namespace) -> int:
    from launcher.supervisor import ChildSpec, Supervisor

    model_path = args.model_path or default_model_path()
    served_name = args.served_model_name or served_name_for(args.model_path)
    threads = args.torch_threads or default_torch_threads(1 if args.is_embedding else 2)
    ensure_serve_token(args)  # the children's, by environment
    grant_env = serve_grant_env()  # the workers' alone: the gateway child never sees it
    shared = [
        "--model-path",
        model_path,
        "--log-level",
        args.log_level,
        *(
            arg
            for flag in ("tls_cert", "tls_key", "tls_ca")
            if getattr(args, flag)
            for arg in (f"--{flag.replace('_', '-')}", getattr(args, flag))
        ),
    ]
    worker_flags = [*shared, *serve_worker_flags(args, threads)]
    prefill_addr, decode_addr = f"127.0.0.1:{args.prefill_port}", f"127.0.0.1:{args.decode_port}"
    # An embedding stack is gateway + one embedding prefill worker: embeddings need no decode.
    embedding_flags = ["--is-embedding"] if args.is_embedding else []
    prefill_metrics = ("--metrics-port", str(metrics_port(args.prefill_metrics_port, args.prefill_port)))
    decode_metrics = ("--metrics-port", str(metrics_port(args.decode_metrics_port, args.decode_port)))
    children = [
        ChildSpec(
            "prefill",
            ("prefill", *worker_flags, *embedding_flags, "--port", str(args.prefill_port), *prefill_metrics),
            grant_env,
        ),
        *(
            []
            if args.is_embedding
            else [
                ChildSpec(
                    "decode", ("decode", *worker_flags, "--port", str(args.decode_port), *decode_metrics), grant_env
                )
            ]
        ),
        ChildSpec(
            "gateway",
            (
                "gateway",
                *shared,
                "--served-model-name",
                served_name,
                "--host",
                args.host,
                "--port",
                str(args.port),
                "--prefill",
                prefill_addr,
                *(embedding_flags or ["--decode", decode_addr]),
                "--prefill-timeout",
                str(args.prefill_timeout),
                "--request-timeout",
                str(args.request_timeout),
                "--stall-timeout",
                str(args.stall_timeout),
                "--max-queued-requests",
                str(args.max_queued_requests),
                "--max-queue-wait",
                str(args.max_queue_wait),
                "--data-dir",
                args.data_dir or default_data_dir(),
                "--batch-concurrency",
                str(args.batch_concurrency),
                "--max-batch-requests",
                str(args.max_batch_requests),
                "--max-request-body-bytes",
                str(args.max_request_body_bytes),
                "--drain-timeout",
                str(args.drain_timeout),
                *(["--default-sampling", args.default_sampling] if args.default_sampling else []),
                *(["--skip-tokenizer-init"] if args.skip_tokenizer_init else []),
                *(["--expert-distribution-dir", args.expert_distribution_dir] if args.expert_distribution_dir else []),
            ),
        ),
    ]
    if args.api_key:  # handed to the gateway child by environment, never on a command line
        os.environ["TANDEM_API_KEY"] = args.api_key
    if args.admin_api_key:
        os.environ["TANDEM_ADMIN_API_KEY"] = args.admin_api_key
    url_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    supervisor = Supervisor(
        children, f"http://{url_host}:{args.port}/health", args.startup_timeout, stop_grace_s=args.drain_timeout + 10
    )
    workers = (
        f"embedding prefill {prefill_addr}, no decode). Ctrl-C stops both."
        if args.is_embedding
        else f"prefill {prefill_addr}, decode {decode_addr}). Ctrl-C stops all three."
    )
    return supervisor.run(
        f"Tandem is ready: gateway on http://{url_host}:{args.port} (model {served_name!r}; {workers}"
    )


def serve_worker_flags(args: argparse.Namespace, threads: int) -> list[str]:
    """The worker flags of `tandem serve` that its prefill and decode children both get."""
    flags = [
        "--dtype",
        args.dtype,
        "--page-size",
        str(args.page_size),
        "--kv-cache-gib",
        str(args.kv_cache_gib),
        "--max-running-requests",
        str(args.max_running_requests),
        "--max-prefill-tokens",
        str(args.max_prefill_tokens),
        "--chunked-prefill-size",
        str(args.chunked_prefill_size or -1),
        "--torch-threads",
        str(threads),
        "--device",
        args.device,
        "--quantization",
        args.quantization,
        "--attention-backend",
        args.attention_backend,
        "--sampling-backend",
        args.sampling_backend,
        *(["--int8-activations"] if args.int8_activations else []),
        "--kv-transport",
        args.kv_transport,
        "--kv-protocol",
        args.kv_protocol,
        "--reservation-ttl",
        str(args.reservation_ttl),
        "--transfer-timeout",
        str(args.transfer_timeout),
        "--kv-write-grace",
        str(args.kv_write_grace),
        "--drain-timeout",
        str(args.drain_timeout),
        "--grammar-compile-timeout",
        str(args.grammar_compile_timeout),
    ]
    if args.disable_prefix_cache:
        flags.append("--disable-prefix-cache")
    for flag, value in (
        ("--max-total-tokens", args.max_total_tokens),
        ("--context-length", args.context_length),
        ("--kv-host", args.kv_host),
    ):
        if value is not None:
            flags += [flag, str(value)]
    for directory in args.weights_dir or ():
        flags += ["--weights-dir", directory]
    return flags
