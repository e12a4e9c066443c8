"""The flags of the model and of a prefill or decode worker, with their parsers and aliases. A flag
that sets a config field takes its default from that field (`EngineConfig`, `TransportConfig`,
`WorkerConfig`); the flags' own defaults here are the launcher's ("auto", resolved once per worker)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable

from engine.config import DRAFT_POLICIES, MAX_LORA_RANK, SPECULATIVE_ALGORITHMS, EngineConfig
from engine.graph_batches import DEFAULT_MAX_GRAPH_BATCH_SIZE
from kv_transfer import TransportConfig
from launcher.defaults import field_default
from server_runtime.config import WorkerConfig

# vLLM's spellings are accepted too, so its serving commands work unchanged.
DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}
# int8 / int4 are the generic names; each maps to the GGUF block format that implements it.
QUANTIZATION_ALIASES = {
    "none": "none",
    "gguf": "gguf",
    "q8_0": "q8_0",
    "int8": "q8_0",
    "q4_0": "q4_0",
    "q4_1": "q4_1",
    "int4": "q4_1",
}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
METRICS_PORT_OFFSET = 100  # a worker's metrics port defaults to its gRPC port + 100 (30101, 30102)
# A served worker chunks long prompts; `EngineConfig`'s own default (None, no chunking) suits library use.
DEFAULT_CHUNKED_PREFILL_SIZE = 512
DEFAULT_WORKER_HOST = "127.0.0.1"  # a worker's gRPC bind address, and where `tandem serve`'s gateway finds both


START_KV_STORE = "start"  # `tandem serve --kv-store` with no address: start a store for the stack


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-path",
        "--model",
        dest="model_path",
        default=None,
        help="HF safetensors directory or GGUF file (default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def add_worker_args(p: argparse.ArgumentParser) -> None:
    """The flags of a prefill or decode worker (also taken by `tandem serve`, which passes them on)."""
    _add_engine_args(p)
    _add_runtime_args(p)
    _add_lora_args(p)


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    """LoRA adapters (engine/lora.py, server_runtime/lora_serving.py)."""
    p.add_argument(
        "--lora-paths",
        nargs="+",
        default=None,
        metavar="NAME=DIR",
        help="PEFT LoRA adapters to load at start, each under the name a request gives for it",
    )
    p.add_argument(
        "--lora-dir",
        default=None,
        help="the only directory adapters may be loaded from at run time (LoadLoraAdapter); unset: none are",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="LoRA adapters a worker holds on its device at once, least recently used out first (default: 4 "
        "when --lora-paths or --lora-dir is given, else 0: no adapters)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=field_default(EngineConfig, "max_lora_rank"),
        help=f"the largest adapter rank served (at most {MAX_LORA_RANK}); slots are sized for it",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model's numbers, KV pool and scheduling."""
    p.add_argument(
        "--device",
        type=_device,
        default="auto",
        help="where the weights, the KV pool and every step compute: cpu, cuda or cuda:N. "
        "auto: cuda when torch sees a GPU, else cpu",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=sorted(["auto", *DTYPE_ALIASES]),
        help="auto: float32 on a CPU computing with packed (quantized) weights, whose kernels take float32 "
        "rows; else bfloat16 on a GPU and on CPUs with AVX512-BF16/AMX, else float32 (vLLM's half/float/bf16 "
        "too; docs/performance.md has the measurements)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=sorted(["auto", *DTYPE_ALIASES]),
        help="the KV pool's dtype (prefill and decode workers must agree). auto: bfloat16 on a CPU "
        "computing with packed weights (half the bytes attention reads and a KV transfer moves, greedy "
        "output as close to the float32 reference as a float32 pool's but on 1 of 16 prompts; "
        "docs/performance.md), else --dtype. Another dtype than the model's is CPU only",
    )
    p.add_argument("--page-size", type=int, default=field_default(EngineConfig, "page_size"), help="tokens per KV page")
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=field_default(EngineConfig, "max_total_tokens"),
        help="KV pool size in tokens",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=field_default(EngineConfig, "kv_cache_gib"),
        help="KV pool size in GiB when --max-total-tokens is unset",
    )
    p.add_argument("--max-running-requests", type=int, default=field_default(EngineConfig, "max_running_requests"))
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=field_default(EngineConfig, "max_prefill_tokens"),
        help="prompt tokens per prefill batch",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=_chunked_prefill_size,
        default=DEFAULT_CHUNKED_PREFILL_SIZE,
        help="prompt tokens one prefill step computes at most (with --max-prefill-tokens); a longer "
        "prompt runs in chunks over several steps, so it cannot hold the engine for seconds while "
        "aborts and other requests wait. -1 or 0: off. The default leaves typical prompts (a "
        "256-token benchmark prompt, a chat turn) whole, since each chunk costs another pass over "
        "the weights on a CPU, and splits only the long prompts that would stall a step",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=field_default(EngineConfig, "max_num_batched_tokens"),
        help="tokens one step computes at most, decode and prompt together (vLLM's flag): running "
        "requests' decode tokens go first and prompt chunks get what is left. Unset: prompt tokens "
        "are capped only by --max-prefill-tokens and --chunked-prefill-size",
    )
    p.add_argument(
        "--max-decode-slowdown",
        type=_max_decode_slowdown,
        default=field_default(EngineConfig, "max_decode_slowdown"),
        help="while requests decode, a step that also prefills (a prompt kept on its decode worker, a "
        "preempted request's recompute) takes prompt tokens only up to about this many times a "
        "decode-only step's measured time, so running streams keep their pace and the prompt takes "
        "longer; needs --chunked-prefill-size to split a prompt. 0: off",
    )
    p.add_argument(
        "--unpaced-prompt-tokens",
        type=int,
        default=field_default(EngineConfig, "unpaced_prompt_tokens"),
        help="a prompt with at most this many tokens left to compute after its cached prefix (a chat's "
        "next turn on the decode worker holding its history) runs whole in one step, outside "
        "--max-decode-slowdown's pace: its streams wait that step once. 0: every prompt is paced",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="schedule each step only once the one before it is over (SGLang's flag). By default a "
        "decode step that is certain (nothing waits, no drafts, no grammar) is chosen and queued "
        "while the step before it computes, so forward passes run back to back; the tokens are the "
        "same either way",
    )
    p.add_argument(
        "--speculative-algorithm",
        choices=SPECULATIVE_ALGORITHMS,
        default=field_default(EngineConfig, "speculative_algorithm"),
        help="speculative decoding on decode workers: ngram guesses each request's next tokens from "
        "its own text (prompt lookup, no second model), draft asks a smaller model of the same "
        "tokenizer (--speculative-draft-model-path); either is verified in the same step, and the "
        "output follows the model's distribution exactly (greedy output is unchanged). Unset: off",
    )
    p.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="the draft model of --speculative-algorithm draft (HF safetensors directory or GGUF file, "
        "the target's vocabulary): each decode worker runs it beside the target, on the same device, "
        "with the same dtype and quantization",
    )
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=field_default(EngineConfig, "speculative_num_draft_tokens"),
        help="draft tokens a request may verify per step with --speculative-algorithm",
    )
    p.add_argument(
        "--speculative-draft-policy",
        choices=DRAFT_POLICIES,
        default=field_default(EngineConfig, "speculative_draft_policy"),
        help="auto: a step verifies a request's drafts only while the decode steps' measured cost per "
        "row is below what the drafts are expected to yield at the request's acceptance so far (none "
        "where rows are dear, as K-quant weights on a CPU without AVX-512 make them); always: every "
        "draft the proposer guesses, up to --speculative-num-draft-tokens",
    )
    p.add_argument(
        "--quantization",
        "-q",
        default="auto",
        choices=["auto", *QUANTIZATION_ALIASES],
        help="weight format: none (the --dtype floats), gguf (a GGUF file's Q8_0/Q4_0/Q4_1 blocks kept "
        "packed), q8_0 / int8, q4_0, q4_1 / int4 (quantized at load; CPU only). auto: gguf on a "
        "CPU worker given a .gguf file, none otherwise (docs/performance.md has the measurements)",
    )
    p.add_argument(
        "--int8-activations",
        action="store_true",
        help="quantized matmuls round each activation row to int8 blocks, as llama.cpp does, instead "
        "of int16 blocks: the same kernel and speed here, and greedy output further from the float32 "
        "reference (docs/performance.md compares both)",
    )
    p.add_argument(
        "--attention-backend",
        default=field_default(EngineConfig, "attention_backend"),
        choices=["auto", "cpu", "torch", "flashinfer"],
        help="auto: on a GPU flashinfer when installed, else torch SDPA; on CPU the C++ paged-attention "
        "kernel (cpu) where it builds, else torch",
    )
    p.add_argument(
        "--sampling-backend",
        default=field_default(EngineConfig, "sampling_backend"),
        choices=["auto", "torch", "flashinfer"],
        help="auto: flashinfer's sampling kernels on a GPU when installed, else torch",
    )
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="on a GPU, run every decode step eagerly instead of replaying CUDA graphs captured at start-up",
    )
    graphs.add_argument(
        "--cuda-graph-max-bs",
        type=positive_int,
        default=None,
        help="on a GPU, capture decode graphs for batch sizes 1, 2, 4, 8, 16, 32, ... up to this "
        f"(default: --max-running-requests; never above it or {DEFAULT_MAX_GRAPH_BATCH_SIZE}); larger batches "
        "run eagerly",
    )
    graphs.add_argument(
        "--cuda-graph-bs",
        type=positive_int,
        nargs="+",
        default=None,
        help="on a GPU, the decode batch sizes to capture as CUDA graphs, instead of the ladder of --cuda-graph-max-bs",
    )
    p.add_argument(
        "--disable-prefix-cache",
        action="store_true",
        help="recompute every prompt instead of reusing cached prefix pages (prefill and decode workers)",
    )
    p.add_argument(
        "--kv-host-cache-gb",
        type=non_negative_float,
        default=field_default(EngineConfig, "kv_host_cache_gib"),
        help="keep copies of the prefix cache's full KV pages in this many GiB of host memory (pinned on a GPU), "
        "so a page the pool evicts comes back by a copy instead of a recompute; default 0: none",
    )
    p.add_argument(
        "--kv-disk-cache-dir",
        default=None,
        help="keep the prefix cache's full KV pages as files here too (checksummed, named by the tokens they "
        "hold), so a restarted worker, or another sharing the directory, reads them back instead of "
        "recomputing; default: no disk tier",
    )
    p.add_argument(
        "--kv-disk-cache-gb",
        type=non_negative_float,
        default=field_default(EngineConfig, "kv_disk_cache_gib"),
        help="most GiB of KV pages the disk tier keeps (least recently used deleted first; default 16; "
        "0: no disk tier, even with --kv-disk-cache-dir)",
    )
    p.add_argument(
        "--disable-decode-prefix-cache",
        action="store_true",
        help="decode: keep no prefix cache, so every handoff writes the whole prompt's KV "
        "(the prefill workers still cache prefixes)",
    )
    p.add_argument(
        "--context-length",
        "--max-model-len",
        dest="context_length",
        type=int,
        default=field_default(EngineConfig, "context_len"),
        help="cap the model's context length",
    )


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Threads, the KV transport and the handoff's timeouts."""
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch threads per worker process, fixed (default: a prefill worker the cores the prefill workers "
        "share; a decode worker starts on its even share of the cores among all workers and picks each step's "
        "threads between that and the cores the decode workers share from measured step times; "
        "docs/performance.md)",
    )
    p.add_argument("--kv-transport", default=field_default(TransportConfig, "backend"), choices=["mooncake", "local"])
    p.add_argument("--kv-host", default=None, help="address peers use to reach this worker's KV transport")
    p.add_argument(
        "--kv-store",
        nargs="?",
        const=START_KV_STORE,
        default=None,
        metavar="HOST:PORT",
        help="the cluster's KV store (`tandem kv-store`): the prefix cache keeps its full pages there too, so any "
        "worker, or this one after a restart, reads a prefix another computed; `tandem serve --kv-store` with no "
        "address starts one for its workers (--kv-store-gb); default: none",
    )
    p.add_argument("--kv-protocol", default=field_default(TransportConfig, "protocol"), choices=["tcp", "rdma"])
    p.add_argument(
        "--kv-device",
        default=field_default(TransportConfig, "device_name"),
        help="RDMA device names (rdma protocol only)",
    )
    p.add_argument(
        "--reservation-ttl",
        type=float,
        default=field_default(WorkerConfig, "reservation_ttl_s"),
        help="decode: seconds reserved pages wait for KV",
    )
    p.add_argument(
        "--transfer-timeout",
        type=float,
        default=field_default(TransportConfig, "transfer_timeout_s"),
        help="prefill: seconds allowed for one KV write",
    )
    p.add_argument(
        "--weights-dir",
        action="append",
        default=None,
        help="directory /update_weights_from_disk may load from (repeatable; default: the served "
        "model's directory); any other path is answered as not found",
    )
    p.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=field_default(WorkerConfig, "grammar_compile_timeout_s"),
        help="seconds a request's JSON schema, regex or EBNF grammar may take to compile; longer is "
        "a 400 (the compile finishes in the background, holding later compiles back)",
    )
    p.add_argument(
        "--kv-write-grace",
        type=float,
        default=field_default(WorkerConfig, "write_grace_s"),
        help="decode: seconds the pages of a reservation dropped before its KV arrived stay unused "
        "(a write may still be in flight); keep it >= the prefill side's --transfer-timeout",
    )


def add_embedding_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--is-embedding",
        action="store_true",
        help="serve an embedding model (/v1/embeddings, /encode): a BERT directory, or a Llama/Qwen2 "
        "checkpoint pooled at its last token, or a Llama/Qwen2 *ForSequenceClassification reward "
        "model (/classify: its scores); prefill workers only, no decode worker",
    )


def _device(text: str) -> str:
    """--device: auto, cpu, cuda or cuda:N."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _chunked_prefill_size(text: str) -> int | None:
    """--chunked-prefill-size: a positive token count, or -1 / 0 for no chunking (None)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be positive, or -1 or 0 to turn chunking off, got {value}")
    return value if value > 0 else None


def _max_decode_slowdown(text: str) -> float | None:
    """--max-decode-slowdown: a factor above 1, or 0 for off (None)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != 0 and not value > 1:
        raise argparse.ArgumentTypeError(f"must be above 1, or 0 for off, got {value}")
    return value or None


def parse_lora_paths(items: Iterable[str]) -> dict[str, str]:
    """`--lora-paths name=dir ...` -> {name: dir}, in the order given. Raises ValueError for an item that
    is not `name=dir`, a name with whitespace, or a name given twice."""
    paths: dict[str, str] = {}
    for item in items:
        name, sep, directory = item.partition("=")
        if not sep or not name or not directory:
            raise ValueError(f"--lora-paths takes name=dir items, got {item!r}")
        if any(c.isspace() for c in name):
            raise ValueError(f"--lora-paths: adapter name {name!r} contains whitespace")
        if name in paths:
            raise ValueError(f"--lora-paths names adapter {name!r} twice")
        paths[name] = directory
    return paths


def max_loras(args: argparse.Namespace) -> int:
    """--max-loras, resolved: 4 where adapters are given (--lora-paths, --lora-dir) and it is not."""
    if args.max_loras is not None:
        return args.max_loras
    return DEFAULT_MAX_LORAS if args.lora_paths or args.lora_dir else 0


DEFAULT_MAX_LORAS = 4


def metrics_port(flag: int | None, grpc_port: int) -> int:
    """A worker's metrics port: the flag when given, else its gRPC port + 100 (off when that is no port)."""
    if flag is not None:
        return flag
    port = grpc_port + METRICS_PORT_OFFSET
    return port if grpc_port and port < 65536 else 0


def non_negative_float(text: str) -> float:
    """An argparse type: a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number above 0."""
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value
