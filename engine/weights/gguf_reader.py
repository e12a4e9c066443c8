"""Reads a llama.cpp `.gguf` file: config from its metadata, tensors dequantized to float32 or,
on request, Q8_0 / Q4_0 / Q4_1 tensors kept packed as `kernels.quant.QuantizedWeight`.

GGUF lists dimensions innermost first, so a `[in, out]` GGUF shape is an `(out, in)` torch
tensor. For `general.architecture == "llama"`, llama.cpp's converter permutes the rows of the Q
and K projections (interleaved rotary pairs instead of HF's rotate-half halves); this reader
undoes that so the tensors equal the HF checkpoint. Qwen2 uses rotate-half in both and is not
permuted.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from engine.config import Architecture, ConfigError, ModelConfig
from engine.weights import gguf_blocks
from engine.weights.names import Shape, check_tensors, hf_name_from_gguf
from kernels.quant import QuantizedWeight

logger = logging.getLogger(__name__)

_ARCHITECTURES = {"llama": Architecture.LLAMA, "qwen2": Architecture.QWEN2}
_ROPE_PERMUTED = (".self_attn.q_proj.", ".self_attn.k_proj.")
_PACKED = gguf_blocks.PACKED_TYPES  # GGUF block types kept packed (Q8_0, Q4_x, Q5_x, Q4_K, Q5_K, Q6_K)


@dataclass(frozen=True, slots=True)
class GGUFTensorRef:
    """One tensor to yield: its HF name, its reader entry, and the head count to un-permute by."""

    hf_name: str
    tensor: ReaderTensor
    unpermute_heads: int | None


@dataclass(frozen=True, slots=True)
class GGUFSource:
    """Yields tensors one at a time from the memory-mapped file: float32, or with `keep_quantized`
    the 2-D ones of a `_PACKED` block type as `QuantizedWeight`s."""

    reader: GGUFReader
    refs: tuple[GGUFTensorRef, ...]

    @property
    def num_tensors(self) -> int:
        return len(self.refs)

    def read(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        for ref in self.refs:
            packed = ref.tensor.tensor_type in _PACKED and len(ref.tensor.shape) == 2
            yield ref.hf_name, _to_quantized(ref) if keep_quantized and packed else _to_torch(ref)


def open_gguf_file(path: Path) -> tuple[ModelConfig, GGUFSource]:
    """Parse `path`'s metadata and tensor table (no dequantization) and check them.

    Raises `ConfigError` for an unreadable file, an unsupported architecture, missing metadata,
    or tensors that do not match the metadata.
    """
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ConfigError(f"cannot read GGUF file {path}: {exc}") from exc
    arch_name = str(_field(reader, "general.architecture"))
    if arch_name not in _ARCHITECTURES:
        raise ConfigError(
            f"{path}: unsupported GGUF architecture {arch_name!r}; supported: {', '.join(_ARCHITECTURES)}"
        )
    tensor_names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ConfigError(
            f"{path}: rope scaling stored as a rope_freqs tensor (Llama 3.1 style) "
            "is not supported for GGUF; use the HF safetensors checkpoint"
        )
    config = _config_from_metadata(reader, _ARCHITECTURES[arch_name], tensor_names)
    refs, shapes = [], {}
    for tensor in reader.tensors:
        hf_name = hf_name_from_gguf(tensor.name) or tensor.name  # unmapped names fail the check
        shapes[hf_name] = tuple(int(dim) for dim in reversed(tensor.shape))
        refs.append(GGUFTensorRef(hf_name, tensor, _unpermute_heads(hf_name, arch_name, config)))
    check_tensors(shapes, config, str(path))
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    logger.debug("%s: tensor types %s", path.name, dict(types))
    return config, GGUFSource(reader, tuple(refs))


def _config_from_metadata(reader: GGUFReader, architecture: Architecture, tensor_names: set[str]) -> ModelConfig:
    arch = "llama" if architecture is Architecture.LLAMA else "qwen2"
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", None)
    has_bias = {part: f"blk.0.{part}.bias" in tensor_names for part in ("attn_q", "attn_k", "attn_v", "attn_output")}
    if len({has_bias["attn_q"], has_bias["attn_k"], has_bias["attn_v"]}) != 1:
        raise ConfigError(f"{reader.data.filename}: q, k and v must all have a bias or none")
    return ModelConfig(
        architecture=architecture,
        vocab_size=_vocab_size(reader, arch),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias=architecture is Architecture.QWEN2 or has_bias["attn_q"],
        o_proj_bias=has_bias["attn_output"],
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        rope_scaling=_rope_scaling(reader, arch),
    )


def _rope_scaling(reader: GGUFReader, arch: str) -> tuple[tuple[str, Any], ...]:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return ()
    if kind == "linear":
        return (("factor", float(_field(reader, f"{arch}.rope.scaling.factor"))), ("rope_type", "linear"))
    raise ConfigError(f"{reader.data.filename}: unsupported GGUF rope scaling type {kind!r}")


def _vocab_size(reader: GGUFReader, arch: str) -> int:
    size = _field(reader, f"{arch}.vocab_size", None)
    if size is not None:
        return int(size)
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise ConfigError(
            f"{reader.data.filename}: neither {arch}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size"
        )
    return len(tokens.data)  # one entry per array element; avoids decoding every token


_REQUIRED = object()


def _field(reader: GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ConfigError(f"{reader.data.filename}: GGUF metadata lacks required key {key!r}")
        return default
    return field.contents()


def _unpermute_heads(hf_name: str, arch_name: str, config: ModelConfig) -> int | None:
    if arch_name != "llama" or not any(part in hf_name for part in _ROPE_PERMUTED):
        return None
    return config.num_heads if ".q_proj." in hf_name else config.num_kv_heads


def _to_torch(ref: GGUFTensorRef) -> torch.Tensor:
    shape: Shape = tuple(int(dim) for dim in reversed(ref.tensor.shape))
    array = np.asarray(dequantize(ref.tensor.data, ref.tensor.tensor_type), dtype=np.float32)
    if not array.flags.writeable:  # F32 tensors come back as views into the read-only mapping
        array = array.copy()
    tensor = torch.from_numpy(array).reshape(shape)
    if ref.unpermute_heads is not None:
        tensor = _unpermute_rope(tensor, ref.unpermute_heads)
    return tensor


def _unpermute_rope(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's `permute`: rows per head go from (pair, 2) order back to (2, half).

    llama.cpp computes `w.reshape(heads, 2, half, ...).swapaxes(1, 2)`; this is its inverse.
    Works for weights `(heads*head_dim, in)` and biases `(heads*head_dim,)`.
    """
    half = tensor.shape[0] // num_heads // 2
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(tensor.shape)


def _to_quantized(ref: GGUFTensorRef) -> QuantizedWeight:
    """The tensor's blocks unpacked into a `QuantizedWeight` (engine.weights.gguf_blocks)."""
    rows, cols = (int(dim) for dim in reversed(ref.tensor.shape))
    weight = gguf_blocks.to_quantized(ref.tensor.data, ref.tensor.tensor_type, (rows, cols))
    if ref.unpermute_heads is not None:  # the permutation moves whole rows, so blocks move intact
        order = _unpermute_rope(torch.arange(rows), ref.unpermute_heads)
        weight = weight.index_rows(order)
    return weight
