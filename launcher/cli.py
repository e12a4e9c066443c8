"""The `tandem` command: serve (all three services), gateway, prefill, decode, healthcheck."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from launcher.defaults import (
    BUNDLED_MODEL_SAMPLING,
    default_data_dir,
    default_dtype,
    default_model_path,
    default_torch_threads,
    is_bundled_model,
    served_name_for,
)
from launcher.healthcheck import run_healthcheck
from launcher.internal_plane import (
    check_open_plane,
    credentials_from_args,
    kv_grant_secret_from_args,
    run_internal_token,
)
from tandem.request_log import configure_logging

if TYPE_CHECKING:  # the engine is imported only by the worker commands that run one
    from engine.config import EngineConfig
from launcher.flags import build_parser
from launcher.serve import serve
from launcher.worker_flags import DTYPE_ALIASES, QUANTIZATION_ALIASES, metrics_port

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "healthcheck":
        return run_healthcheck(args)
    if args.command == "internal-token":
        return run_internal_token(args)
    configure_logging(args.log_level, args.command)
    if args.command == "serve":
        return serve(args)
    if args.command == "gateway":
        return _gateway(args)
    return _worker(args)


def _gateway(args: argparse.Namespace) -> int:
    from gateway.app import serve_gateway
    from gateway.config import GatewayConfig
    from gateway.sampling_defaults import SamplingDefaults, load_generation_config

    if not args.decode and not args.is_embedding:
        raise SystemExit("tandem gateway: --decode is required (unless --is-embedding)")
    internal = credentials_from_args(args)
    check_open_plane(internal, [*args.prefill, *(args.decode or ())], args.insecure, "worker address")
    model_path = args.model_path or default_model_path()
    defaults = BUNDLED_MODEL_SAMPLING if is_bundled_model(model_path) else load_generation_config(model_path)
    if args.default_sampling:
        try:
            defaults = defaults.overridden_by(SamplingDefaults.from_mapping(json.loads(args.default_sampling)))
        except (ValueError, TypeError) as exc:
            raise SystemExit(f"--default-sampling: {exc}") from None
    config = GatewayConfig(
        model_path=model_path,
        sampling_defaults=defaults,
        api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None,
        admin_api_key=args.admin_api_key or os.environ.get("TANDEM_ADMIN_API_KEY") or None,
        skip_tokenizer_init=args.skip_tokenizer_init,
        served_model_name=args.served_model_name or served_name_for(args.model_path),
        prefill_addrs=tuple(args.prefill),
        decode_addrs=tuple(args.decode or ()),
        is_embedding=args.is_embedding,
        host=args.host,
        port=args.port,
        prefill_timeout_s=args.prefill_timeout,
        request_timeout_s=args.request_timeout,
        stall_timeout_s=args.stall_timeout,
        max_queued_requests=args.max_queued_requests,
        max_queue_wait_s=args.max_queue_wait,
        data_dir=os.path.abspath(args.data_dir or default_data_dir()),
        batch_concurrency=args.batch_concurrency,
        max_batch_requests=args.max_batch_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        drain_timeout_s=args.drain_timeout,
        expert_distribution_dir=os.path.abspath(args.expert_distribution_dir or os.getcwd()),
        internal=internal,
    )
    serve_gateway(config)
    return 0


def _worker(args: argparse.Namespace) -> int:
    from decode_server.servicer import DECODE
    from kv_transfer import TransportConfig
    from prefill_server.embedding_servicer import EMBEDDING
    from prefill_server.servicer import PREFILL
    from server_runtime.context import WorkerConfig
    from server_runtime.worker import serve_worker

    credentials = credentials_from_args(args)
    check_open_plane(credentials, [args.host], args.insecure, f"{args.command} worker bind address")
    if args.kv_host is not None:  # the token does not reach the KV ports: a closed plane is still required
        check_open_plane(credentials, [args.kv_host], args.insecure, f"{args.command} worker KV address (--kv-host)")
    is_embedding = getattr(args, "is_embedding", False)
    grant_secret = None if is_embedding else kv_grant_secret_from_args(args, credentials)
    kv_host = args.kv_host or ("127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host)
    config = WorkerConfig(
        role=args.command,
        model_path=args.model_path or default_model_path(),
        host=args.host,
        port=args.port,
        engine=_engine_config(args),
        transport=TransportConfig(
            backend=args.kv_transport,
            hostname=kv_host,
            protocol=args.kv_protocol,
            device_name=args.kv_device,
            transfer_timeout_s=args.transfer_timeout,
        ),
        torch_threads=args.torch_threads or default_torch_threads(2),
        reservation_ttl_s=args.reservation_ttl,
        write_grace_s=args.kv_write_grace,
        is_embedding=is_embedding,
        metrics_port=metrics_port(args.metrics_port, args.port),
        credentials=credentials,
        kv_grant_secret=grant_secret,
        weights_dirs=tuple(os.path.abspath(d) for d in args.weights_dir or ()),
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        drain_timeout_s=args.drain_timeout,
    )
    kind = EMBEDDING if is_embedding else PREFILL if args.command == "prefill" else DECODE
    asyncio.run(serve_worker(config, kind))
    return 0


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """A prefill or decode worker's engine settings from its flags; the device is resolved here, once.
    Exits with the reason when the flags do not fit together (e.g. a quantization on a GPU)."""
    from engine.config import ConfigError, EngineConfig

    device = _worker_device(args.device, moves_kv=not getattr(args, "is_embedding", False))
    try:
        return EngineConfig(
            dtype=_worker_dtype(args, device),
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            kv_cache_gib=args.kv_cache_gib,
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            context_len=args.context_length,
            device=device,
            quantization=_worker_quantization(args, device),
            attention_backend=args.attention_backend,
            sampling_backend=args.sampling_backend,
            int8_activations=args.int8_activations,
            enable_prefix_cache=args.command == "prefill" and not args.disable_prefix_cache,
        )
    except ConfigError as exc:
        raise SystemExit(f"tandem {args.command}: {exc}") from None


def _worker_device(flag: str, moves_kv: bool = True) -> str:
    """--device resolved: auto is cuda when torch sees a GPU, else cpu. Until the KV transports
    move GPU memory, a worker that moves KV (prefill, decode) keeps auto on the CPU, so GPU images
    and charts keep serving; an explicit cuda is refused by WorkerConfig with the reason. A CUDA
    device this machine does not have is refused here, before any weight is read."""
    import torch

    if flag == "auto":
        if torch.cuda.is_available() and moves_kv:
            logger.warning(
                "--device auto: a GPU is present, but KV transfer from GPU memory is not there "
                "yet; this worker computes on the CPU"
            )
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    if flag.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(flag.partition(":")[2] or 0)
        if index >= count:
            raise SystemExit(
                f"--device {flag}: this machine has {count} CUDA device(s)"
                f"{'' if count else ' (or this torch build has no CUDA)'}"
            )
    return flag


def _worker_quantization(args: argparse.Namespace, device: str) -> str:
    """--quantization, where auto suits each role: a decode worker keeps a GGUF file's blocks packed
    (decode is bound by the bytes of weights read per token), a prefill worker computes in the
    --dtype floats (prefill is bound by arithmetic, where the BLAS matmul is faster than reading
    packed blocks; measured in docs/performance.md). Safetensors checkpoints load as floats, and so
    does every checkpoint on a GPU (the packed-block kernel is CPU code)."""
    if args.quantization != "auto":
        return QUANTIZATION_ALIASES[args.quantization]
    if device != "cpu":
        return "none"
    model_path = args.model_path or default_model_path()
    is_gguf = model_path.lower().endswith(".gguf") or _holds_one_gguf(model_path)
    return "gguf" if is_gguf and args.command == "decode" else "none"


def _holds_one_gguf(path: str) -> bool:
    return (
        os.path.isdir(path)
        and not os.path.exists(os.path.join(path, "config.json"))
        and sum(name.lower().endswith(".gguf") for name in os.listdir(path)) == 1
    )


def _worker_dtype(args: argparse.Namespace, device: str) -> str:
    """--dtype, where auto is float32 for embedding models (small, and compared with fp32 references),
    else bfloat16 on a GPU and on CPUs that compute it natively."""
    if args.dtype != "auto":
        return DTYPE_ALIASES[args.dtype]
    if getattr(args, "is_embedding", False):
        return "float32"
    return "bfloat16" if device.startswith("cuda") else default_dtype()


if __name__ == "__main__":
    sys.exit(main())
