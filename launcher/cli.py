"""The `tandem` command: serve (all three services), gateway, prefill, decode, healthcheck."""

from __future__ import annotations

import argparse
import logging
import asyncio
import json
import os
import re
import sys
from typing import TYPE_CHECKING

from gateway.config import (DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_MAX_QUEUE_WAIT_S, DEFAULT_MAX_QUEUED,
                            DEFAULT_MAX_REQUEST_BODY_BYTES)
from gateway.cluster.discovery import check_worker_spec
from launcher.defaults import (BUNDLED_MODEL_SAMPLING, default_data_dir, default_dtype, default_model_path,
                               default_torch_threads, is_bundled_model, served_name_for)
from launcher.healthcheck import add_healthcheck_args, run_healthcheck
from launcher.internal_plane import (add_internal_plane_args, add_internal_token_args, add_kv_grant_args,
                                     check_open_plane, credentials_from_args, ensure_serve_token,
                                     kv_grant_secret_from_args, run_internal_token, serve_grant_env)
from tandem.request_log import configure_logging

if TYPE_CHECKING:   # the engine is imported only by the worker commands that run one
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_GATEWAY_PORT = 30000
DEFAULT_PREFILL_PORT = 30001
DEFAULT_DECODE_PORT = 30002
# vLLM's spellings are accepted too, so its serving commands work unchanged.
_DTYPE_ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "float": "float32",
                  "float16": "float16", "half": "float16", "fp16": "float16"}
# int8 / int4 are the generic names; each maps to the GGUF block format that implements it.
_QUANTIZATION_ALIASES = {"none": "none", "gguf": "gguf", "q8_0": "q8_0", "int8": "q8_0", "q4_0": "q4_0",
                         "q4_1": "q4_1", "int4": "q4_1"}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
METRICS_PORT_OFFSET = 100   # a worker's metrics port defaults to its gRPC port + 100 (30101, 30102)
DEFAULT_CHUNKED_PREFILL_SIZE = 512


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", "--model", dest="model_path", default=None,
                   help="HF safetensors directory or GGUF file (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=_device, default="auto",
                   help="where the weights, the KV pool and every step compute: cpu, cuda or cuda:N. "
                        "auto: cuda when torch sees a GPU, else cpu")
    p.add_argument("--dtype", default="auto", choices=sorted(["auto", *_DTYPE_ALIASES]),
                   help="auto: bfloat16 on a GPU and on CPUs with AVX512-BF16/AMX, else float32 (vLLM's "
                        "half/float/bf16 too)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV pool size in GiB when --max-total-tokens is unset")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="prompt tokens per prefill batch")
    p.add_argument("--chunked-prefill-size", type=_chunked_prefill_size, default=DEFAULT_CHUNKED_PREFILL_SIZE,
                   help="prompt tokens one prefill step computes at most (with --max-prefill-tokens); a longer "
                        "prompt runs in chunks over several steps, so it cannot hold the engine for seconds while "
                        "aborts and other requests wait. -1 or 0: off. The default leaves typical prompts (a "
                        "256-token benchmark prompt, a chat turn) whole, since each chunk costs another pass over "
                        "the weights on a CPU, and splits only the long prompts that would stall a step")
    p.add_argument("--quantization", "-q", default="auto", choices=["auto", *_QUANTIZATION_ALIASES],
                   help="weight format: none (the --dtype floats), gguf (a GGUF file's Q8_0/Q4_0/Q4_1 blocks kept "
                        "packed), q8_0 / int8, q4_0, q4_1 / int4 (quantized at load; CPU only). auto: gguf on a "
                        "CPU decode worker given a .gguf file, none otherwise (docs/performance.md has the "
                        "measurements)")
    p.add_argument("--int8-activations", action="store_true",
                   help="quantized matmuls round each activation row to int8 blocks and take integer dot "
                        "products, as llama.cpp does: faster for small batches, less exact (the default keeps "
                        "activations in float; docs/performance.md compares both)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "flashinfer"],
                   help="auto: on a GPU flashinfer when installed, else torch SDPA; on CPU the C++ paged-attention "
                        "kernel (cpu) where it builds, else torch")
    p.add_argument("--sampling-backend", default="auto", choices=["auto", "torch", "flashinfer"],
                   help="auto: flashinfer's sampling kernels on a GPU when installed, else torch")
    p.add_argument("--disable-prefix-cache", action="store_true",
                   help="prefill: recompute every prompt instead of reusing cached prefix pages")
    p.add_argument("--context-length", "--max-model-len", dest="context_length", type=int, default=None,
                   help="cap the model's context length")
    p.add_argument("--torch-threads", type=int, default=None, help="torch threads per worker process")
    p.add_argument("--kv-transport", default="mooncake", choices=["mooncake", "local"])
    p.add_argument("--kv-host", default=None, help="address peers use to reach this worker's KV transport")
    p.add_argument("--kv-protocol", default="tcp", choices=["tcp", "rdma"])
    p.add_argument("--kv-device", default="", help="RDMA device names (rdma protocol only)")
    p.add_argument("--reservation-ttl", type=float, default=30.0, help="decode: seconds reserved pages wait for KV")
    p.add_argument("--transfer-timeout", type=float, default=30.0, help="prefill: seconds allowed for one KV write")
    p.add_argument("--weights-dir", action="append", default=None,
                   help="directory /update_weights_from_disk may load from (repeatable; default: the served "
                        "model's directory); any other path is answered as not found")
    p.add_argument("--grammar-compile-timeout", type=float, default=5.0,
                   help="seconds a request's JSON schema, regex or EBNF grammar may take to compile; longer is "
                        "a 400 (the compile finishes in the background, holding later compiles back)")
    p.add_argument("--kv-write-grace", type=float, default=30.0,
                   help="decode: seconds the pages of a reservation dropped before its KV arrived stay unused "
                        "(a write may still be in flight); keep it >= the prefill side's --transfer-timeout")


def _add_gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model path)")
    p.add_argument("--prefill-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED,
                   help="generations that may wait for decode KV space at once; one more gets a 503 with "
                        "Retry-After (0: no queue, refuse at once)")
    p.add_argument("--max-queue-wait", type=float, default=DEFAULT_MAX_QUEUE_WAIT_S,
                   help="seconds a generation may wait for decode KV space before a 503 with Retry-After")
    p.add_argument("--stall-timeout", type=float, default=20.0,
                   help="seconds a worker may send nothing on a request before the gateway checks its health; "
                        "one that does not answer ends the request with a 503 and gets no new requests until "
                        "it answers again")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: requests send token ids and get token ids back (no text, no chat)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on every route but /health, /ping and /metrics "
                        "(default: the TANDEM_API_KEY environment variable, else no key)")
    p.add_argument("--admin-api-key", default=None,
                   help="the admin routes (/flush_cache, /update_weights_from_disk, /get_server_info, the expert "
                        "distribution record) need `Authorization: Bearer <admin key>`; the user key no longer "
                        "opens them (default: the TANDEM_ADMIN_API_KEY environment variable, else the admin "
                        "routes take the --api-key)")
    p.add_argument("--default-sampling", default=None,
                   help='JSON of sampling defaults for fields a request leaves unset, e.g. \'{"temperature": 0.7, '
                        '"top_p": 0.9}\' (keys: temperature, top_p, top_k, min_p). Default: the model\'s '
                        'generation_config.json; greedy for the bundled SmolLM2')
    p.add_argument("--data-dir", default=None,
                   help="where /v1/files and /v1/batches keep their SQLite database and file contents; one "
                        "gateway per directory (default: $XDG_DATA_HOME/tandem, i.e. ~/.local/share/tandem)")
    p.add_argument("--max-batch-requests", type=int, default=256,
                   help="most generations one request may start (prompts x n); more get a 400")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="largest request body (JSON) the gateway reads; larger ones get a 413 unread "
                        "(/v1/files uploads have their own limit, 200 MB per file)")
    p.add_argument("--batch-concurrency", type=int, default=8,
                   help="batch lines run at once; a new one starts only while no interactive request is in flight")
    p.add_argument("--expert-distribution-dir", default=None,
                   help="where /dump_expert_distribution_record writes expert_distribution_*.csv "
                        "(default: the gateway's working directory)")


def _add_drain_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="on SIGTERM or Ctrl-C: seconds a server keeps serving the requests in flight before it "
                        "exits (a worker's health answers NOT_SERVING and it refuses new requests; the gateway "
                        "stops accepting connections); a second signal exits at once")


def _add_embedding_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--is-embedding", action="store_true",
                   help="serve an embedding model (/v1/embeddings, /encode): a BERT directory, or a Llama/Qwen2 "
                        "checkpoint pooled at its last token, or a Llama/Qwen2 *ForSequenceClassification reward "
                        "model (/classify: its scores); prefill workers only, no decode worker")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="gateway + 1 prefill + 1 decode on this machine")
    _add_model_args(serve)
    _add_worker_args(serve)
    _add_gateway_args(serve)
    _add_drain_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    serve.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT)
    serve.add_argument("--prefill-port", type=int, default=DEFAULT_PREFILL_PORT)
    serve.add_argument("--decode-port", type=int, default=DEFAULT_DECODE_PORT)
    serve.add_argument("--startup-timeout", type=float, default=600.0)
    add_internal_plane_args(serve)
    serve.add_argument("--prefill-metrics-port", type=int, default=None,
                       help="prefill worker's Prometheus port (default: --prefill-port + 100; 0: off)")
    serve.add_argument("--decode-metrics-port", type=int, default=None,
                       help="decode worker's Prometheus port (default: --decode-port + 100; 0: off)")
    _add_embedding_arg(serve)

    gateway = sub.add_parser("gateway", help="the HTTP gateway alone")
    _add_model_args(gateway)
    _add_gateway_args(gateway)
    _add_drain_arg(gateway)
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT)
    gateway.add_argument("--prefill", action="append", required=True, type=check_worker_spec,
                         help="prefill worker host:port, or dns:///name:port for every address the name resolves "
                              "to, re-resolved every few seconds (a headless Service); repeatable")
    gateway.add_argument("--decode", action="append", type=check_worker_spec,
                         help="decode worker host:port or dns:///name:port (as --prefill); repeatable; "
                              "required unless --is-embedding")
    _add_embedding_arg(gateway)
    add_internal_plane_args(gateway)

    for role, port in (("prefill", DEFAULT_PREFILL_PORT), ("decode", DEFAULT_DECODE_PORT)):
        worker = sub.add_parser(role, help=f"a {role} worker alone")
        _add_model_args(worker)
        _add_worker_args(worker)
        _add_drain_arg(worker)
        worker.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
        worker.add_argument("--port", type=int, default=port)
        worker.add_argument("--metrics-port", type=int, default=None,
                            help="HTTP port serving Prometheus text at /metrics (default: --port + 100; 0: off)")
        if role == "prefill":
            _add_embedding_arg(worker)
        add_internal_plane_args(worker)
        add_kv_grant_args(worker)

    add_healthcheck_args(sub.add_parser("healthcheck", help="probe a worker's gRPC health or the gateway's /health once"))
    add_internal_token_args(sub.add_parser("internal-token", help="write a fresh internal token (or KV grant "
                                                                  "secret) to a file (once)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "healthcheck":
        return run_healthcheck(args)
    if args.command == "internal-token":
        return run_internal_token(args)
    configure_logging(args.log_level, args.command)
    if args.command == "serve":
        return _serve(args)
    if args.command == "gateway":
        return _gateway(args)
    return _worker(args)


def _serve(args: argparse.Namespace) -> int:
    from launcher.supervisor import ChildSpec, Supervisor
    model_path = args.model_path or default_model_path()
    served_name = args.served_model_name or served_name_for(args.model_path)
    threads = args.torch_threads or default_torch_threads(1 if args.is_embedding else 2)
    ensure_serve_token(args)   # the children's, by environment
    grant_env = serve_grant_env()   # the workers' alone: the gateway child never sees it
    shared = ["--model-path", model_path, "--log-level", args.log_level,
              *(arg for flag in ("tls_cert", "tls_key", "tls_ca") if getattr(args, flag)
                for arg in (f"--{flag.replace('_', '-')}", getattr(args, flag)))]
    worker_flags = [*shared, *_serve_worker_flags(args, threads)]
    prefill_addr, decode_addr = f"127.0.0.1:{args.prefill_port}", f"127.0.0.1:{args.decode_port}"
    # An embedding stack is gateway + one embedding prefill worker: embeddings need no decode.
    embedding_flags = ["--is-embedding"] if args.is_embedding else []
    prefill_metrics = ("--metrics-port", str(_metrics_port(args.prefill_metrics_port, args.prefill_port)))
    decode_metrics = ("--metrics-port", str(_metrics_port(args.decode_metrics_port, args.decode_port)))
    children = [
        ChildSpec("prefill", ("prefill", *worker_flags, *embedding_flags, "--port", str(args.prefill_port),
                              *prefill_metrics), grant_env),
        *([] if args.is_embedding else [ChildSpec("decode", ("decode", *worker_flags, "--port", str(args.decode_port),
                                                             *decode_metrics), grant_env)]),
        ChildSpec("gateway", ("gateway", *shared, "--served-model-name", served_name, "--host", args.host,
                              "--port", str(args.port), "--prefill", prefill_addr,
                              *(embedding_flags or ["--decode", decode_addr]),
                              "--prefill-timeout", str(args.prefill_timeout),
                              "--request-timeout", str(args.request_timeout),
                              "--stall-timeout", str(args.stall_timeout),
                              "--max-queued-requests", str(args.max_queued_requests),
                              "--max-queue-wait", str(args.max_queue_wait),
                              "--data-dir", args.data_dir or default_data_dir(),
                              "--batch-concurrency", str(args.batch_concurrency),
                              "--max-batch-requests", str(args.max_batch_requests),
                              "--max-request-body-bytes", str(args.max_request_body_bytes),
                              "--drain-timeout", str(args.drain_timeout),
                              *(["--default-sampling", args.default_sampling] if args.default_sampling else []),
                              *(["--skip-tokenizer-init"] if args.skip_tokenizer_init else []),
                              *(["--expert-distribution-dir", args.expert_distribution_dir]
                                if args.expert_distribution_dir else []))),
    ]
    if args.api_key:   # handed to the gateway child by environment, never on a command line
        os.environ["TANDEM_API_KEY"] = args.api_key
    if args.admin_api_key:
        os.environ["TANDEM_ADMIN_API_KEY"] = args.admin_api_key
    url_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    supervisor = Supervisor(children, f"http://{url_host}:{args.port}/health", args.startup_timeout,
                            stop_grace_s=args.drain_timeout + 10)
    workers = (f"embedding prefill {prefill_addr}, no decode). Ctrl-C stops both." if args.is_embedding
               else f"prefill {prefill_addr}, decode {decode_addr}). Ctrl-C stops all three.")
    return supervisor.run(f"Tandem is ready: gateway on http://{url_host}:{args.port} (model {served_name!r}; {workers}")


def _serve_worker_flags(args: argparse.Namespace, threads: int) -> list[str]:
    """The worker flags of `tandem serve` that its prefill and decode children both get."""
    flags = ["--dtype", args.dtype, "--page-size", str(args.page_size), "--kv-cache-gib", str(args.kv_cache_gib),
             "--max-running-requests", str(args.max_running_requests),
             "--max-prefill-tokens", str(args.max_prefill_tokens),
             "--chunked-prefill-size", str(args.chunked_prefill_size or -1), "--torch-threads", str(threads),
             "--device", args.device, "--quantization", args.quantization,
             "--attention-backend", args.attention_backend, "--sampling-backend", args.sampling_backend,
             *(["--int8-activations"] if args.int8_activations else []),
             "--kv-transport", args.kv_transport, "--kv-protocol", args.kv_protocol,
             "--reservation-ttl", str(args.reservation_ttl), "--transfer-timeout", str(args.transfer_timeout),
             "--kv-write-grace", str(args.kv_write_grace), "--drain-timeout", str(args.drain_timeout),
             "--grammar-compile-timeout", str(args.grammar_compile_timeout)]
    if args.disable_prefix_cache:
        flags.append("--disable-prefix-cache")
    for flag, value in (("--max-total-tokens", args.max_total_tokens), ("--context-length", args.context_length),
                        ("--kv-host", args.kv_host)):
        if value is not None:
            flags += [flag, str(value)]
    for directory in args.weights_dir or ():
        flags += ["--weights-dir", directory]
    return flags


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
    config = GatewayConfig(model_path=model_path, sampling_defaults=defaults,
                           api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None,
                           admin_api_key=args.admin_api_key or os.environ.get("TANDEM_ADMIN_API_KEY") or None,
                           skip_tokenizer_init=args.skip_tokenizer_init,
                           served_model_name=args.served_model_name or served_name_for(args.model_path),
                           prefill_addrs=tuple(args.prefill), decode_addrs=tuple(args.decode or ()),
                           is_embedding=args.is_embedding, host=args.host,
                           port=args.port, prefill_timeout_s=args.prefill_timeout,
                           request_timeout_s=args.request_timeout, stall_timeout_s=args.stall_timeout,
                           max_queued_requests=args.max_queued_requests, max_queue_wait_s=args.max_queue_wait,
                           data_dir=os.path.abspath(args.data_dir or default_data_dir()),
                           batch_concurrency=args.batch_concurrency, max_batch_requests=args.max_batch_requests,
                           max_request_body_bytes=args.max_request_body_bytes, drain_timeout_s=args.drain_timeout,
                           expert_distribution_dir=os.path.abspath(args.expert_distribution_dir or os.getcwd()),
                           internal=internal)
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
    if args.kv_host is not None:   # the token does not reach the KV ports: a closed plane is still required
        check_open_plane(credentials, [args.kv_host], args.insecure, f"{args.command} worker KV address (--kv-host)")
    is_embedding = getattr(args, "is_embedding", False)
    grant_secret = None if is_embedding else kv_grant_secret_from_args(args, credentials)
    kv_host = args.kv_host or ("127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host)
    config = WorkerConfig(
        role=args.command, model_path=args.model_path or default_model_path(), host=args.host, port=args.port,
        engine=_engine_config(args),
        transport=TransportConfig(backend=args.kv_transport, hostname=kv_host, protocol=args.kv_protocol,
                                  device_name=args.kv_device, transfer_timeout_s=args.transfer_timeout),
        torch_threads=args.torch_threads or default_torch_threads(2),
        reservation_ttl_s=args.reservation_ttl, write_grace_s=args.kv_write_grace, is_embedding=is_embedding,
        metrics_port=_metrics_port(args.metrics_port, args.port), credentials=credentials,
        kv_grant_secret=grant_secret,
        weights_dirs=tuple(os.path.abspath(d) for d in args.weights_dir or ()),
        grammar_compile_timeout_s=args.grammar_compile_timeout, drain_timeout_s=args.drain_timeout)
    kind = EMBEDDING if is_embedding else PREFILL if args.command == "prefill" else DECODE
    asyncio.run(serve_worker(config, kind))
    return 0


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """A prefill or decode worker's engine settings from its flags; the device is resolved here, once.
    Exits with the reason when the flags do not fit together (e.g. a quantization on a GPU)."""
    from engine.config import ConfigError, EngineConfig
    device = _worker_device(args.device, moves_kv=not getattr(args, "is_embedding", False))
    try:
        return EngineConfig(dtype=_worker_dtype(args, device), page_size=args.page_size,
                            max_total_tokens=args.max_total_tokens, kv_cache_gib=args.kv_cache_gib,
                            max_running_requests=args.max_running_requests,
                            max_prefill_tokens=args.max_prefill_tokens,
                            chunked_prefill_size=args.chunked_prefill_size, context_len=args.context_length,
                            device=device, quantization=_worker_quantization(args, device),
                            attention_backend=args.attention_backend, sampling_backend=args.sampling_backend,
                            int8_activations=args.int8_activations,
                            enable_prefix_cache=args.command == "prefill" and not args.disable_prefix_cache)
    except ConfigError as exc:
        raise SystemExit(f"tandem {args.command}: {exc}") from None


def _device(text: str) -> str:
    """--device: auto, cpu, cuda or cuda:N."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def _worker_device(flag: str, moves_kv: bool = True) -> str:
    """--device resolved: auto is cuda when torch sees a GPU, else cpu. Until the KV transports
    move GPU memory, a worker that moves KV (prefill, decode) keeps auto on the CPU, so GPU images
    and charts keep serving; an explicit cuda is refused by WorkerConfig with the reason. A CUDA
    device this machine does not have is refused here, before any weight is read."""
    import torch
    if flag == "auto":
        if torch.cuda.is_available() and moves_kv:
            logger.warning("--device auto: a GPU is present, but KV transfer from GPU memory is not there "
                           "yet; this worker computes on the CPU")
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    if flag.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(flag.partition(":")[2] or 0)
        if index >= count:
            raise SystemExit(f"--device {flag}: this machine has {count} CUDA device(s)"
                             f"{'' if count else ' (or this torch build has no CUDA)'}")
    return flag


def _worker_quantization(args: argparse.Namespace, device: str) -> str:
    """--quantization, where auto suits each role: a decode worker keeps a GGUF file's blocks packed
    (decode is bound by the bytes of weights read per token), a prefill worker computes in the
    --dtype floats (prefill is bound by arithmetic, where the BLAS matmul is faster than reading
    packed blocks; measured in docs/performance.md). Safetensors checkpoints load as floats, and so
    does every checkpoint on a GPU (the packed-block kernel is CPU code)."""
    if args.quantization != "auto":
        return _QUANTIZATION_ALIASES[args.quantization]
    if device != "cpu":
        return "none"
    model_path = args.model_path or default_model_path()
    is_gguf = model_path.lower().endswith(".gguf") or _holds_one_gguf(model_path)
    return "gguf" if is_gguf and args.command == "decode" else "none"


def _holds_one_gguf(path: str) -> bool:
    return os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")) and \
        sum(name.lower().endswith(".gguf") for name in os.listdir(path)) == 1


def _chunked_prefill_size(text: str) -> int | None:
    """--chunked-prefill-size: a positive token count, or -1 / 0 for no chunking (None)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be positive, or -1 or 0 to turn chunking off, got {value}")
    return value if value > 0 else None


def _metrics_port(flag: int | None, grpc_port: int) -> int:
    """A worker's metrics port: the flag when given, else its gRPC port + 100 (off when that is no port)."""
    if flag is not None:
        return flag
    port = grpc_port + METRICS_PORT_OFFSET
    return port if grpc_port and port < 65536 else 0


def _worker_dtype(args: argparse.Namespace, device: str) -> str:
    """--dtype, where auto is float32 for embedding models (small, and compared with fp32 references),
    else bfloat16 on a GPU and on CPUs that compute it natively."""
    if args.dtype != "auto":
        return _DTYPE_ALIASES[args.dtype]
    if getattr(args, "is_embedding", False):
        return "float32"
    return "bfloat16" if device.startswith("cuda") else default_dtype()


if __name__ == "__main__":
    sys.exit(main())
