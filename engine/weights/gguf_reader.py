"""Reads a llama.cpp `.gguf` file: config from its metadata (through the family that
`general.architecture` names, `engine.models.registry`), tensors dequantized to float32 or, on
request, the matrices of a block type the matmul reads kept packed, repacked into its panels
(`kernels.packing.PackedWeight`).

GGUF lists dimensions innermost first, so a `[in, out]` GGUF shape is an `(out, in)` torch
tensor. For the Llama family (`ModelFamily.gguf_rope_permuted`), llama.cpp's converter permutes
the rows of the Q and K projections (interleaved rotary pairs instead of HF's rotate-half halves);
this reader undoes that so the tensors equal the HF checkpoint. The other families use rotate-half
in both and are not permuted.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize

from engine.config import ConfigError, ModelConfig
from engine.models.config_readers import GGUFMetadata
from engine.models.registry import family_of, gguf_architecture
from engine.weights import gguf_blocks
from engine.weights.names import Shape, check_tensors, expected_shapes, gguf_to_hf_names
from kernels.packing import PackedWeight

logger = logging.getLogger(__name__)

_ROPE_PERMUTED = (".self_attn.q_proj.", ".self_attn.k_proj.")
_PACKED = gguf_blocks.PACKED_TYPES  # GGUF block types kept packed (Q8_0, Q4_x, Q5_x, Q4_K, Q5_K, Q6_K)


class FastGGUFReader(GGUFReader):
    """`gguf.GGUFReader` with the same fields and tensors, read faster: slices of a plain array over the
    mapping instead of `np.memmap` ones (whose per-slice Python hook dominated), and arrays' parts made
    when read (a 150k-token vocabulary is 300k parts; the engine reads a few control tokens). Opening the
    Qwen2.5 0.5B file's header took 20 s with the library's reader, 1.2 s with eager parts; the tensor data
    is the same memory mapping."""

    _ITEMSIZES: dict[Any, int] = {}

    def _plain(self) -> np.ndarray:
        plain = self.__dict__.get("_plain_view")
        if plain is None:
            plain = self.__dict__["_plain_view"] = self.data.view(np.ndarray)
        return plain  # type: ignore[no-any-return]

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Literal["I", "S", "<"] | None = None
    ) -> np.ndarray:
        count = int(count)
        size = self._ITEMSIZES.get(dtype)
        if size is None:
            size = self._ITEMSIZES[dtype] = np.dtype(dtype).itemsize
        arr = self._plain()[offset : offset + size * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, Any, list[int], list[Any]]:
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)  # type: ignore[no-any-return]
        item_type = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
        scalar = self.gguf_scalar_to_np.get(item_type)
        if item_type != GGUFValueType.STRING and scalar is None:
            return super()._get_field_parts(orig_offs, raw_type)  # type: ignore[no-any-return]
        raw_itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        offs, n = orig_offs + 12, int(count[0])
        if scalar is not None:  # one element per part, as the library lays them out
            values = self._get(offs, scalar, n)
            parts = _ArrayParts([raw_itype, count], lambda i: values[i : i + 1], n)
            return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, item_type]
        # strings: a uint64 length, then the bytes; each one's start is found by walking the lengths
        plain, starts = self._plain(), []
        memory, from_bytes = plain.data, int.from_bytes  # byte order "I": the host's
        for _ in range(n):
            starts.append(offs)
            offs += 8 + from_bytes(memory[offs : offs + 8], sys.byteorder)

        def string_part(i: int) -> np.ndarray:
            start = starts[i // 2]
            if i % 2 == 0:
                return plain[start : start + 8].view(np.uint64)
            return plain[start + 8 : start + 8 + int(plain[start : start + 8].view(np.uint64)[0])]

        parts = _ArrayParts([raw_itype, count], string_part, 2 * n)
        return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), [GGUFValueType.ARRAY, GGUFValueType.STRING]

    def _build_fields(self, offs: int, count: int) -> int:
        """The library's loop, except that an array field keeps its parts lazy (`_ArrayParts`) instead of
        copying them into a list: a 150k-token vocabulary is 300k parts that only a few lookups read."""
        for _ in range(count):
            orig_offs = offs
            key_len, key = self._get_str(offs)
            offs += int(key_len.nbytes + key.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            head: list[np.ndarray] = [key_len, key, raw_kv_type]
            size, field_parts, indices, types = self._get_field_parts(offs, raw_kv_type[0])
            parts = field_parts.after(head) if isinstance(field_parts, _ArrayParts) else head + list(field_parts)
            name = str(bytes(key), encoding="utf-8")
            # ReaderField's parts are typed as a list; the library and the engine only index, slice and iterate them
            field = ReaderField(orig_offs, name, parts, [i + len(head) for i in indices], types)  # type: ignore[arg-type]
            self._push_field(field, skip_sum=True)
            offs += size
        return offs


class _ArrayParts(Sequence[np.ndarray]):
    """The parts of an array field, as the library lists them (`head` parts, then the elements' parts),
    each element's part made when it is read."""

    def __init__(self, head: list[np.ndarray], element_part: Callable[[int], np.ndarray], num_elements: int):
        self._head, self._element_part, self._num_elements = head, element_part, num_elements

    def after(self, prefix: list[np.ndarray]) -> _ArrayParts:
        return _ArrayParts(prefix + self._head, self._element_part, self._num_elements)

    def __len__(self) -> int:
        return len(self._head) + self._num_elements

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...
    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        head = len(self._head)
        return self._head[index] if index < head else self._element_part(index - head)


@dataclass(frozen=True, slots=True)
class GGUFTensorRef:
    """One tensor to yield: its HF name, its reader entry, and the head count to un-permute by."""

    hf_name: str
    tensor: ReaderTensor
    unpermute_heads: int | None


@dataclass(frozen=True, slots=True)
class GGUFSource:
    """Yields tensors one at a time from the memory-mapped file: float32, or with `keep_quantized`
    the 2-D ones of a `_PACKED` block type as single-segment `PackedWeight`s."""

    reader: GGUFReader
    refs: tuple[GGUFTensorRef, ...]

    @property
    def num_tensors(self) -> int:
        return len(self.refs)

    @property
    def num_bytes(self) -> int:
        return sum(int(ref.tensor.n_bytes) for ref in self.refs)

    def read(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        for ref in self.refs:
            packed = ref.tensor.tensor_type in _PACKED and len(ref.tensor.shape) == 2
            yield ref.hf_name, _to_packed(ref) if keep_quantized and packed else _to_torch(ref)


def open_gguf_file(path: Path) -> tuple[ModelConfig, GGUFSource]:
    """Parse `path`'s metadata and tensor table (no dequantization) and check them.

    Raises `ConfigError` for an unreadable file, an unsupported architecture, missing metadata,
    or tensors that do not match the metadata.
    """
    try:
        reader = FastGGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ConfigError(
            f"{path} is not a readable GGUF file, truncated or corrupted ({exc}); check its size and sha256 "
            "against where it came from, and download it again"
        ) from exc
    _check_tensor_types(path, reader)
    field = reader.get_field("general.architecture")
    if field is None:
        raise ConfigError(f"{path}: GGUF metadata lacks required key 'general.architecture'")
    arch_name = str(field.contents())
    family = family_of(gguf_architecture(arch_name))
    if family.config_from_gguf is None:
        raise ConfigError(f"{path}: GGUF files of the {family.name} family are not supported; use its HF checkpoint")
    meta = GGUFMetadata(reader, arch_name)
    if "rope_freqs.weight" in meta.tensor_names:
        raise ConfigError(
            f"{path}: rope scaling stored as a rope_freqs tensor (Llama 3.1 style) "
            "is not supported for GGUF; use the HF safetensors checkpoint"
        )
    config = family.config_from_gguf(meta)
    expected = expected_shapes(config)  # the model built on meta: once per open
    names = gguf_to_hf_names(config, expected, arch_name)
    refs, shapes = [], {}
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name, tensor.name)  # unmapped names fail the check
        shapes[hf_name] = tuple(int(dim) for dim in reversed(tensor.shape))
        heads = _unpermute_heads(hf_name, config) if family.gguf_rope_permuted else None
        refs.append(GGUFTensorRef(hf_name, tensor, heads))
    check_tensors(shapes, config, str(path), expected)
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    logger.debug("%s: tensor types %s", path.name, dict(types))
    return config, GGUFSource(reader, tuple(refs))


# types read as floats (block types dequantized by gguf at load: tested in tests/unit/engine/test_weight_loader.py)
_FLOAT_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
    }
)


def _check_tensor_types(path: Path, reader: GGUFReader) -> None:
    """ConfigError naming the first tensor whose type Tandem can neither keep packed nor dequantize."""
    readable = _FLOAT_TYPES | set(_PACKED)
    for tensor in reader.tensors:
        if tensor.tensor_type not in readable:
            packed = ", ".join(sorted(t.name for t in _PACKED))
            floats = ", ".join(sorted(t.name for t in _FLOAT_TYPES))
            raise ConfigError(
                f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which Tandem cannot read "
                f"(packed: {packed}; read as floats: {floats}); requantize the file, e.g. to Q4_K_M"
            )


def _unpermute_heads(hf_name: str, config: ModelConfig) -> int | None:
    if not any(part in hf_name for part in _ROPE_PERMUTED):
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


def _to_packed(ref: GGUFTensorRef) -> PackedWeight:
    """The tensor's blocks repacked into the matmul's panels (engine.weights.gguf_blocks.to_packed),
    rows un-permuted on the way (the permutation moves whole rows, so blocks move intact)."""
    rows, cols = (int(dim) for dim in reversed(ref.tensor.shape))
    order = None if ref.unpermute_heads is None else _unpermute_rope(torch.arange(rows), ref.unpermute_heads)
    return gguf_blocks.to_packed(ref.tensor.data, ref.tensor.tensor_type, (rows, cols), order)
