"""The frozen configs from one parse of the flags: a worker's `WorkerConfig` (with its `EngineConfig`
and `TransportConfig`) and the gateway's `GatewayConfig`. What the flags leave to the machine or the
model (the device, dtype, quantization, model path, data directory, sampling defaults) is resolved
here, once: by the command that runs the server, or by `tandem serve` for each of its children.
SystemExit with the reason when the flags do not make a valid config."""

from __future__ import annotations

import argparse
import json
import logging
import os

from engine.config import EngineConfig
from engine.graph_batches import default_graph_batch_sizes
from gateway.config import GatewayConfig, RoutingConfig
from gateway.sampling_defaults import SamplingDefaults, load_generation_config
from kv_transfer import TransportConfig
from launcher.defaults import (
    BUNDLED_MODEL_SAMPLING,
    default_data_dir,
    default_dtype,
    default_model_path,
    field_default,
    is_bundled_model,
    served_name_for,
)
from launcher.worker_flags import (
    DTYPE_ALIASES,
    QUANTIZATION_ALIASES,
    START_KV_STORE,
    max_loras,
    parse_lora_paths,
)
from server_runtime.config import WorkerConfig
from tandem.internal_auth import InternalCredentials

logger = logging.getLogger(__name__)

API_KEY_ENV = "TANDEM_API_KEY"
ADMIN_API_KEY_ENV = "TANDEM_ADMIN_API_KEY"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def gateway_config(
    args: argparse.Namespace,
    *,
    prefill_addrs: tuple[str, ...],
    decode_addrs: tuple[str, ...],
    internal: InternalCredentials,
) -> GatewayConfig:
    """The gateway's config from `tandem gateway`'s or `tandem serve`'s flags; TANDEM_API_KEY and
    TANDEM_ADMIN_API_KEY stand in for a key flag left unset."""
    model_path = args.model_path or default_model_path()
    try:
        return GatewayConfig(
            model_path=model_path,
            sampling_defaults=_sampling_defaults(model_path, args.default_sampling),
            api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
            admin_api_key=args.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None,
            skip_tokenizer_init=args.skip_tokenizer_init,
            served_model_name=args.served_model_name or served_name_for(args.model_path),
            prefill_addrs=prefill_addrs,
            decode_addrs=decode_addrs,
            is_embedding=args.is_embedding,
            host=args.host,
            port=args.port,
            grpc_port=args.grpc_port,
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
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            expert_distribution_dir=os.path.abspath(args.expert_distribution_dir or os.getcwd()),
            internal=internal,
            routing=RoutingConfig(
                policy=args.router_policy,
                prefix_load_guard=args.prefix_load_guard,
                local_prefill_threshold=args.local_prefill_threshold,
                prefill_busy_threshold=args.prefill_busy_threshold,
            ),
        )
    except ValueError as exc:
        raise SystemExit(f"tandem {args.command}: {exc}") from None


def _sampling_defaults(model_path: str, flag: str | None) -> SamplingDefaults:
    """The model's sampling defaults (greedy for the bundled SmolLM2), --default-sampling's JSON over them."""
    defaults = BUNDLED_MODEL_SAMPLING if is_bundled_model(model_path) else load_generation_config(model_path)
    if not flag:
        return defaults
    try:
        return defaults.overridden_by(SamplingDefaults.from_mapping(json.loads(flag)))
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"--default-sampling: {exc}") from None


def worker_config(
    args: argparse.Namespace,
    *,
    role: str,
    host: str,
    port: int,
    metrics_port: int,
    credentials: InternalCredentials,
    kv_grant_secret: str | None,
    torch_threads: int,
    max_torch_threads: int = 0,
    engine: EngineConfig | None = None,
    kv_store: str | None = None,
) -> WorkerConfig:
    """The `role` worker's config from `tandem prefill|decode`'s or `tandem serve`'s flags, listening
    on `host:port`; the KV transport is reached at --kv-host, else `host` (loopback for a wildcard).
    `engine`: the role's `engine_config`, when the caller builds several workers of one role;
    `kv_store`: the store `tandem serve` started for its workers (else --kv-store's address)."""
    is_embedding = role == "prefill" and getattr(args, "is_embedding", False)
    try:
        return WorkerConfig(
            role=role,
            model_path=args.model_path or default_model_path(),
            draft_model_path=_draft_model_path(args, role),
            host=host,
            port=port,
            engine=engine or engine_config(args, role, is_embedding),
            transport=TransportConfig(
                backend=args.kv_transport,
                hostname=args.kv_host or ("127.0.0.1" if host in _WILDCARD_HOSTS else host),
                protocol=args.kv_protocol,
                device_name=args.kv_device,
                transfer_timeout_s=args.transfer_timeout,
            ),
            torch_threads=torch_threads,
            max_torch_threads=max_torch_threads,
            reservation_ttl_s=args.reservation_ttl,
            write_grace_s=args.kv_write_grace,
            is_embedding=is_embedding,
            metrics_port=metrics_port,
            credentials=credentials,
            kv_grant_secret=kv_grant_secret,
            weights_dirs=tuple(os.path.abspath(d) for d in args.weights_dir or ()),
            grammar_compile_timeout_s=args.grammar_compile_timeout,
            drain_timeout_s=args.drain_timeout,
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            lora_paths=() if is_embedding else tuple(parse_lora_paths(args.lora_paths or ()).items()),
            lora_dir=os.path.abspath(args.lora_dir) if args.lora_dir and not is_embedding else None,
            kv_store=None if is_embedding else kv_store or _kv_store_address(args),
        )
    except ValueError as exc:
        raise SystemExit(f"tandem {args.command}: {exc}") from None


def engine_config(args: argparse.Namespace, role: str, is_embedding: bool) -> EngineConfig:
    """The `role` worker's engine settings from its flags; the device is resolved here, once.
    Exits with the reason when the flags do not fit together (e.g. a quantization on a GPU)."""
    device = _worker_device(args.device, kv_transport=None if is_embedding else args.kv_transport)
    quantization = _worker_quantization(args, device)
    is_packed = device == "cpu" and quantization != "none"
    has_prefix_cache = not args.disable_prefix_cache and not (role == "decode" and args.disable_decode_prefix_cache)
    try:
        return EngineConfig(
            dtype=_worker_dtype(args.dtype, device, is_embedding, is_packed),
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            kv_cache_gib=args.kv_cache_gib,
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            speculative_algorithm=args.speculative_algorithm if role == "decode" else None,  # only decode drafts
            speculative_num_draft_tokens=args.speculative_num_draft_tokens,
            speculative_draft_policy=args.speculative_draft_policy,
            max_decode_slowdown=args.max_decode_slowdown,
            unpaced_prompt_tokens=args.unpaced_prompt_tokens,
            overlap_schedule=not args.disable_overlap_schedule,
            max_loras=0 if is_embedding else max_loras(args),
            max_lora_rank=args.max_lora_rank,
            context_len=args.context_length,
            device=device,
            quantization=quantization,
            kv_cache_dtype=_worker_kv_dtype(args.kv_cache_dtype, is_packed),
            attention_backend=args.attention_backend,
            sampling_backend=args.sampling_backend,
            int8_activations=args.int8_activations,
            enable_prefix_cache=has_prefix_cache,
            kv_disk_cache_dir=_writable_dir(args.kv_disk_cache_dir, args.command)
            if args.kv_disk_cache_dir and args.kv_disk_cache_gb and has_prefix_cache
            else None,
            kv_disk_cache_gib=args.kv_disk_cache_gb or field_default(EngineConfig, "kv_disk_cache_gib"),
            kv_host_cache_gib=args.kv_host_cache_gb if has_prefix_cache else 0.0,
            cuda_graph_batch_sizes=_graph_batch_sizes(args),
        )
    except ValueError as exc:
        raise SystemExit(f"tandem {args.command}: {exc}") from None


def _draft_model_path(args: argparse.Namespace, role: str) -> str | None:
    """A decode worker's draft model (--speculative-draft-model-path); `WorkerConfig` checks that it goes
    with --speculative-algorithm draft."""
    path = args.speculative_draft_model_path
    return os.path.abspath(path) if path and role == "decode" else None


def _kv_store_address(args: argparse.Namespace) -> str | None:
    """--kv-store's HOST:PORT (None: no store; an empty value is none too)."""
    if args.kv_store == START_KV_STORE:
        raise SystemExit(
            f"tandem {args.command}: --kv-store needs the store's HOST:PORT (only `tandem serve` starts one itself)"
        )
    return args.kv_store or None


def _writable_dir(path: str, command: str) -> str:
    """`path` made absolute, created if missing; exits with the reason when this process cannot write there."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe.{os.getpid()}.tmp")
        with open(probe, "wb"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise SystemExit(f"tandem {command}: --kv-disk-cache-dir {path}: cannot write there ({exc.strerror})") from None
    return path


def _worker_device(flag: str, kv_transport: str | None) -> str:
    """--device resolved: auto is cuda when torch sees a GPU, else cpu. A worker that moves KV
    (`kv_transport` names its transport; None for an embedding worker) stays on the CPU under auto,
    with a warning, where its transport cannot move GPU memory: the local transport, or Mooncake's
    CPU build. An explicit cuda is kept (the transport refuses it at start-up with the reason); a
    CUDA device this machine does not have is refused here, before any weight is read."""
    if flag == "cpu":
        return flag
    import torch

    if flag == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        reason = _why_kv_stays_on_the_host(kv_transport)
        if reason:
            logger.warning("--device auto: a GPU is present, but %s; this worker computes on the CPU", reason)
            return "cpu"
        return "cuda"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(flag.partition(":")[2] or 0)
    if index >= count:
        raise SystemExit(
            f"--device {flag}: this machine has {count} CUDA device(s)"
            f"{'' if count else ' (or this torch build has no CUDA)'}"
        )
    return flag


def _why_kv_stays_on_the_host(kv_transport: str | None) -> str | None:
    """Why a worker's KV transport cannot move GPU memory here, or None when it can (or moves no KV)."""
    if kv_transport == "local":
        return "the local KV transport copies host memory only"
    if kv_transport == "mooncake":
        from kv_transfer.mooncake_backend import installed_build_moves_gpu_memory

        if not installed_build_moves_gpu_memory():
            return (
                "the installed Mooncake is its CPU build, which cannot move KV from GPU memory "
                "(install mooncake-transfer-engine in place of mooncake-transfer-engine-non-cuda)"
            )
    return None


def _graph_batch_sizes(args: argparse.Namespace) -> tuple[int, ...] | None:
    """The decode batch sizes to capture as CUDA graphs: none with --disable-cuda-graph, the list of
    --cuda-graph-bs, the ladder up to --cuda-graph-max-bs (capped at --max-running-requests), or None
    for the engine's default (the ladder up to --max-running-requests). Used on a GPU only."""
    if args.disable_cuda_graph:
        return ()
    if args.cuda_graph_bs:
        return tuple(sorted(set(args.cuda_graph_bs)))
    if args.cuda_graph_max_bs:
        return default_graph_batch_sizes(min(args.cuda_graph_max_bs, args.max_running_requests))
    return None


def _worker_quantization(args: argparse.Namespace, device: str) -> str:
    """--quantization, where auto keeps a GGUF file's blocks packed on CPU for both roles: decode is
    bound by the bytes of weights read per token, and prefill computes with the packed-block kernel
    (int16 activations) as fast as bfloat16 BLAS on floats and twice float32's (measured in
    docs/performance.md), with the decode worker's numerics. Safetensors checkpoints load as floats,
    and so does every checkpoint on a GPU (the packed-block kernel is CPU code)."""
    if args.quantization != "auto":
        return QUANTIZATION_ALIASES[args.quantization]
    if device != "cpu":
        return "none"
    model_path = args.model_path or default_model_path()
    is_gguf = model_path.lower().endswith(".gguf") or _holds_one_gguf(model_path)
    return "gguf" if is_gguf else "none"


def _holds_one_gguf(path: str) -> bool:
    return (
        os.path.isdir(path)
        and not os.path.exists(os.path.join(path, "config.json"))
        and sum(name.lower().endswith(".gguf") for name in os.listdir(path)) == 1
    )


def _worker_dtype(flag: str, device: str, is_embedding: bool, is_packed: bool) -> str:
    """--dtype, where auto is float32 for embedding models (small, and compared with fp32 references)
    and for packed weights on CPU (their kernels take float32 rows, and the fused C++ layers need
    them: bfloat16 rows would only add conversions), else bfloat16 on a GPU and on CPUs that
    compute it natively."""
    if flag != "auto":
        return DTYPE_ALIASES[flag]
    if is_embedding or is_packed:
        return "float32"
    return "bfloat16" if device.startswith("cuda") else default_dtype()


def _worker_kv_dtype(flag: str, is_packed: bool) -> str | None:
    """--kv-cache-dtype; auto is bfloat16 under packed weights on CPU (the attention kernel reads half
    the bytes, in float32 math; docs/performance.md has the greedy agreement), else the model's
    dtype (None)."""
    if flag != "auto":
        return DTYPE_ALIASES[flag]
    return "bfloat16" if is_packed else None
