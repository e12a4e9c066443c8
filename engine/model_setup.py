"""Building a model and its per-model kernels on a device: shared by the generation runner and the embedder.

`EngineConfig.dtype` names map to torch dtypes here and nowhere else. Models are built on the
meta device and materialized once on their own device, so no weight is allocated twice or
initialized only to be overwritten by the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.models.layers import CausalLM
from engine.models.registry import family_of, on_meta
from engine.weights import Checkpoint
from kernels.attention import AttentionBackend, create_attention_backend
from kernels.layers import RotaryEmbedding

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype an `EngineConfig.dtype` name means; ConfigError for any other name."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype must be one of {tuple(TORCH_DTYPES)}, got {name!r}") from None


def materialize(build: Callable[[], ModuleT], dtype: torch.dtype, device: torch.device | str) -> ModuleT:
    """`build()` constructed on the meta device, cast to `dtype`, then given uninitialized storage
    on `device`; its weights must be loaded before use. Shared parameters come back unshared (see
    `load_causal_lm`)."""
    with on_meta():
        module = build()
    # cast while still on meta, so the device never holds the weights in two dtypes at once
    return module.to(dtype).to_empty(device=device)


def load_causal_lm(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str = "none",
    int8_activations: bool = False,
    progress: bool = True,
) -> CausalLM:
    """`checkpoint`'s decoder on `device` in `dtype` (and `quantization`), weights loaded, in eval mode."""
    config = checkpoint.config
    family = family_of(config.architecture)
    model = materialize(lambda: family.build(config), dtype, device)
    if config.tie_word_embeddings:
        # CausalLM ties lm_head to embed_tokens by sharing one Parameter, but `to_empty` replaces
        # each module's parameters with new ones, so the two come back as separate tensors. The
        # checkpoint has no lm_head.weight when tied: without the re-tie lm_head would keep
        # uninitialized memory.
        model.lm_head.weight = model.model.embed_tokens.weight
    load_causal_lm_weights(model, checkpoint, quantization, int8_activations, progress)
    return model.eval()


def load_causal_lm_weights(
    model: CausalLM,
    checkpoint: Checkpoint,
    quantization: str = "none",
    int8_activations: bool = False,
    progress: bool = False,
) -> None:
    """(Re)load `model`'s weights in place from `checkpoint` (shapes checked per tensor). GGUF's
    packed blocks are kept packed only when `quantization` asks for quantized weights."""
    tensors = checkpoint.tensors(progress=progress, keep_quantized=quantization != "none")
    model.load_weights(tensors, quantization, int8_activations)


def rotary_embedding(
    config: ModelConfig, context_len: int, dtype: torch.dtype, device: torch.device | str
) -> RotaryEmbedding:
    """The rotary tables for positions [0, context_len) of a `config` model (with the sliding-window
    layers' own tables as `local` where the family gives them another base)."""
    rotary = RotaryEmbedding(
        config.head_dim, context_len, config.rope_theta, dict(config.rope_scaling), dtype, torch.device(device)
    )
    local_theta = config.features.local_rope_theta
    if local_theta is not None:
        rotary.local = RotaryEmbedding(config.head_dim, context_len, local_theta, {}, dtype, torch.device(device))
    return rotary


def attention_backend(
    name: str, config: ModelConfig, page_size: int, dtype: torch.dtype, device: torch.device | str
) -> AttentionBackend:
    """The attention backend `name` (`auto` resolved for `device` and `dtype`) for a `config` model's heads."""
    return create_attention_backend(
        name,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        page_size=page_size,
        dtype=dtype,
        device=device,
        sliding_window=config.features.sliding_window,
    )
