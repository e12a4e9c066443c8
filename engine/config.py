"""Frozen configuration records for the model runtime.

`ModelConfig` describes an architecture (read from an HF `config.json` or GGUF metadata);
`EngineConfig` describes how one engine instance runs it (dtype, KV pool size, batching limits).
Values discovered at run time (the number of pages that fit, eos ids found in a tokenizer) live in
runtime state, never in these records.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.graph_batches import check_graph_batch_sizes


class ConfigError(ValueError):
    """A configuration value is missing or invalid."""


# the ModelConfig fields on which some weight's shape depends (checked before new weights load in place)
_SHAPE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "qkv_bias",
    "o_proj_bias",
    "num_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
    "mlp_only_layers",
)


class Architecture(enum.Enum):
    LLAMA = "LlamaForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    QWEN2_MOE = "Qwen2MoeForCausalLM"  # routed experts + a sigmoid-gated shared expert
    MIXTRAL = "MixtralForCausalLM"  # top-k routed experts, no shared expert
    LLAMA_CLASSIFIER = "LlamaForSequenceClassification"  # `score` head instead of `lm_head` (reward models)
    QWEN2_CLASSIFIER = "Qwen2ForSequenceClassification"

    @property
    def is_classifier(self) -> bool:
        return self in (Architecture.LLAMA_CLASSIFIER, Architecture.QWEN2_CLASSIFIER)

    @property
    def has_qkv_bias(self) -> bool:
        """Qwen2-family attention always has q/k/v biases (Llama only with `attention_bias`)."""
        return self in (Architecture.QWEN2, Architecture.QWEN2_MOE, Architecture.QWEN2_CLASSIFIER)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    `qkv_bias` is True for Qwen2 and for Llama configs with `attention_bias`; `o_proj_bias` only for
    the latter. `eos_token_ids` holds every token id that ends generation by default.

    Mixture of experts (`num_experts` > 0): layer i routes each token to `num_experts_per_tok` of
    `num_experts` SwiGLU experts of width `moe_intermediate_size` when `is_moe_layer(i)`; the other
    layers keep a dense MLP of width `intermediate_size`. `shared_expert_intermediate_size` > 0 adds
    Qwen2-MoE's sigmoid-gated shared expert. `num_labels` > 0 means a sequence-classification model:
    a `score` head with that many outputs replaces `lm_head`.
    """

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: tuple[tuple[str, Any], ...] = field(default=())
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the chosen experts' weights to sum to 1
    decoder_sparse_step: int = 1  # every n-th layer (1-based) is an MoE layer ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which stay dense
    num_labels: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        scaling = dict(self.rope_scaling)
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in (None, "default", "llama3", "linear"):
            raise ConfigError(f"unsupported rope_scaling type {kind!r}")
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ConfigError("moe_intermediate_size and decoder_sparse_step must be positive")
        if self.architecture.is_classifier != (self.num_labels > 0):
            raise ConfigError(
                f"{self.architecture.value} needs num_labels "
                f"{'> 0' if self.architecture.is_classifier else '= 0'}, got {self.num_labels}"
            )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer `layer_id` routes tokens to experts (else it has a dense MLP)."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    def shape_changes(self, other: ModelConfig) -> list[str]:
        """`field: ours -> other's` for each field that fixes a weight's shape and differs in
        `other`; empty when weights made for `other` load into a model built from this config."""
        return [
            f"{name}: {getattr(self, name)} -> {getattr(other, name)}"
            for name in _SHAPE_FIELDS
            if getattr(self, name) != getattr(other, name)
        ]

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from the dict of an HF `config.json`."""
        archs = config.get("architectures") or []
        try:
            architecture = Architecture(archs[0])
        except (IndexError, ValueError):
            supported = ", ".join(a.value for a in Architecture)
            raise ConfigError(f"unsupported architectures {archs!r}; supported: {supported}") from None
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_scaling = config.get("rope_scaling") or {}
        rope_parameters = config.get("rope_parameters") or {}
        if not rope_scaling and rope_parameters.get("rope_type", "default") != "default":
            # transformers 5 writes the scaling into rope_parameters, next to rope_theta
            rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
        rope_theta = config.get("rope_theta")
        if rope_theta is None:  # transformers 5 moved rope settings into rope_parameters
            rope_theta = rope_parameters.get("rope_theta", 10000.0)
        max_positions = int(config.get("max_position_embeddings", 2048))
        if architecture is Architecture.MIXTRAL and config.get("sliding_window"):
            # No sequence is let past the window, so full attention over it is exact.
            max_positions = min(max_positions, int(config["sliding_window"]))
        return cls(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)) and not architecture.is_classifier,
            qkv_bias=architecture.has_qkv_bias or bool(config.get("attention_bias", False)),
            o_proj_bias=(
                architecture in (Architecture.LLAMA, Architecture.LLAMA_CLASSIFIER)
                and bool(config.get("attention_bias", False))
            ),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_scaling=tuple(sorted((k, v) for k, v in rope_scaling.items() if not isinstance(v, (list, dict)))),
            **_moe_fields(architecture, config),
            num_labels=_num_labels(config) if architecture.is_classifier else 0,
        )


def _moe_fields(architecture: Architecture, config: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields of `ModelConfig` from an HF config (none for dense architectures)."""
    if architecture is Architecture.QWEN2_MOE:
        return dict(
            num_experts=int(config["num_experts"]),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=int(config.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
        )
    if architecture is Architecture.MIXTRAL:  # every layer is MoE; experts are intermediate_size wide
        return dict(
            num_experts=int(config["num_local_experts"]),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            moe_intermediate_size=int(config["intermediate_size"]),
            norm_topk_prob=True,
        )
    return {}


def _num_labels(config: Mapping[str, Any]) -> int:
    """HF writes `id2label` (one entry per output); `num_labels` alone in older files; HF's default is 2."""
    labels = config.get("id2label")
    return len(labels) if labels else int(config.get("num_labels", 2))


_DTYPES = ("bfloat16", "float32", "float16")
QUANTIZATIONS = ("none", "gguf", "q8_0", "q4_0", "q4_1")  # what each means: engine/weight_loader.py
# "meta" (shapes without data) lets tests run the whole forward pass with no memory and no GPU
_DEVICE = re.compile(r"cpu|meta|cuda(:\d+)?")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How one engine runs a model.

    The KV pool holds `max_total_tokens` tokens when set, else as many as fit `kv_cache_gib`.
    `context_len` overrides the model's `max_position_embeddings` (it may only shrink it).
    A prefill step computes at most `max_prefill_tokens` prompt tokens, except that without
    chunking a longer prompt still runs whole, alone. `chunked_prefill_size` (None: off) caps a
    step at that many prompt tokens too and splits the prompt that would cross the cap, so it is
    prefilled over several steps (0 is accepted as off, as SGLang's users write it).

    `device` is where the weights, the KV pool and every per-step tensor live ("cpu", "cuda",
    "cuda:<n>"; the entry point resolves "auto"). Quantized weights compute in a CPU kernel, so a
    non-CPU device needs `quantization="none"`. `attention_backend` and `sampling_backend` are
    names resolved for the device at start-up (`kernels.attention`, `kernels.sampling`).
    `kv_cache_dtype` is the KV pool's dtype (None: `dtype`); on CPU it may differ from `dtype` (a
    float32 model over a bfloat16 pool halves the bytes attention reads and a KV transfer moves),
    elsewhere it must not. Workers that hand KV to each other must agree on it.
    `cuda_graph_batch_sizes`: the decode batch sizes captured as CUDA graphs at start-up, on a CUDA
    device with an attention backend that can replay them (`engine/cuda_graph.py`); None: the
    defaults up to `max_running_requests` (`engine/graph_batches.py`); (): every step eager.
    """

    dtype: str = "bfloat16"
    page_size: int = 16
    max_total_tokens: int | None = None
    kv_cache_gib: float = 1.0
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int | None = None
    context_len: int | None = None
    device: str = "cpu"
    attention_backend: str = "auto"
    sampling_backend: str = "auto"
    quantization: str = "none"  # one of QUANTIZATIONS
    int8_activations: bool = False  # quantized matmuls round activations to int8 blocks (llama.cpp's way)
    kv_cache_dtype: str | None = None
    enable_prefix_cache: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in _DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {_DTYPES} or None, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype not in (None, self.dtype) and self.device != "cpu":
            raise ConfigError(
                f"a KV pool in {self.kv_cache_dtype} under a {self.dtype} model is CPU only; on "
                f"{self.device} the pool is in the model's dtype (leave kv_cache_dtype unset)"
            )
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(f"max_total_tokens must be >= page_size, got {self.max_total_tokens}")
        if self.kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")
        if self.max_running_requests <= 0 or self.max_prefill_tokens <= 0:
            raise ConfigError("max_running_requests and max_prefill_tokens must be positive")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 0:
            raise ConfigError(
                f"chunked_prefill_size must be positive, or None or 0 (no chunking), got {self.chunked_prefill_size}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"device must be cpu, cuda or cuda:<index>, got {self.device!r}")
        if self.quantization != "none" and self.device != "cpu":
            raise ConfigError(
                f"quantization {self.quantization!r} computes with the CPU kernel only; on "
                f"device {self.device!r} the weights must be floats (quantization none)"
            )
        if self.context_len is not None and self.context_len <= 1:
            raise ConfigError(f"context_len must be > 1, got {self.context_len}")
        if self.cuda_graph_batch_sizes is not None:
            try:
                check_graph_batch_sizes(self.cuda_graph_batch_sizes, self.max_running_requests)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
