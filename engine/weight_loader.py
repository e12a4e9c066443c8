"""Copies a checkpoint's HF-named tensors into a model: fused projections, quantized weights.

Quantization modes (`EngineConfig.quantization`):
- `none`: every weight in the model's dtype (GGUF blocks dequantized): the reference path;
- `gguf`: a GGUF file's matrices of the block types `engine.weights.gguf_blocks` reads (Q8_0, Q4_x,
  Q5_x, Q4_K, Q5_K, Q6_K) stay packed as the file has them, everything else as `none` (for a
  safetensors checkpoint this is `none`);
- `q8_0`, `q4_0`, `q4_1`: every projection of the decoder layers is quantized to that format at
  load (from the file's blocks when they already are that format), embeddings and the LM head to
  Q8_0, as llama.cpp's own 4-bit files keep them.
A fused projection (q/k/v, gate/up) is packed when every part is, each run of parts in its own
format (one matmul call computes them all); if a part stays float, so does the whole projection.

Float weights are copied into the model's parameters, on whatever device those live. Quantized
weights stay in host memory: the C++ kernel that computes with them runs on CPU only, and
`EngineConfig` refuses a quantization other than `none` on any other device.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from engine.config import QUANTIZATIONS, ConfigError
from kernels.packing import PackedWeight, pack
from kernels.quant import BLOCK, QuantFormat, QuantizedWeight, quantize
from kernels.quant_linear import QuantizedEmbedding, QuantizedLinear

logger = logging.getLogger(__name__)

# modules whose weight may be quantized (MoE router gates and the classifier head stay in float)
_QUANTIZABLE = frozenset(
    {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "w1", "w2", "w3", "lm_head", "embed_tokens"}
)
_HIGH_PRECISION = frozenset({"lm_head", "embed_tokens"})

Value = torch.Tensor | QuantizedWeight | PackedWeight  # GGUF readers yield their matrices packed
Parts = tuple[tuple[str, int], ...]


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input (q/k/v, gate/up): their weights stacked
    by rows in `parts` order. Checkpoints name the parts; the loader writes each into its rows."""

    def __init__(self, in_features: int, parts: Parts, bias: bool) -> None:
        super().__init__(in_features, sum(size for _, size in parts), bias=bias)
        self.parts = parts


def load_into(
    model: nn.Module, tensors: Iterable[tuple[str, Value]], quantization: str, int8_activations: bool = False
) -> None:
    """Copy every `(HF name, tensor)` into `model`; each parameter must be covered exactly once.

    Raises ValueError for an unknown name, a shape mismatch, or parameters the checkpoint lacks.
    Quantized modules replace the model's `nn.Linear` / `nn.Embedding` in place; their matmuls round
    activations to int8 blocks when `int8_activations` (llama.cpp's arithmetic), else keep them float.
    """
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    config = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    pending: dict[str, dict[str, Value]] = {}
    seen: set[str] = set()
    for name, value in tensors:
        if name == "lm_head.weight" and tied or name.endswith("rotary_emb.inv_freq"):
            continue
        module_name, _, leaf = name.rpartition(".")
        parent_name, _, part = module_name.rpartition(".")
        merged = _merged_parent(model, parent_name, part)
        if merged is not None and leaf == "weight":
            group_name, module = merged
            parts = pending.setdefault(group_name, {})
            parts[part] = value
            if len(parts) == len(_parts(module)):
                _assign_merged(model, group_name, module, pending.pop(group_name), quantization, int8_activations)
                seen.add(f"{group_name}.weight")
            continue
        if merged is not None:  # a part's bias goes into its rows of the merged bias
            group_name, module = merged
            target = f"{group_name}.bias"
            _copy_rows(params, target, _as_float(value), _row_offset(module, part), name)
            seen.add(target)
            continue
        if name not in params and not _is_quantized_weight(model, name):
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
        _assign(model, params, name, value, quantization, int8_activations)
        seen.add(name)
    if pending:
        raise ValueError(f"checkpoint lacks parts of fused projections: {sorted(pending)[:3]}")
    skipped = {"lm_head.weight"} if tied else set()
    missing = set(params) - seen - skipped
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    embed_tokens = model.get_submodule("model.embed_tokens") if tied else None
    if isinstance(embed_tokens, QuantizedEmbedding):
        model.lm_head = QuantizedLinear(embed_tokens.quantized, int8_activations=int8_activations)


def checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and shapes `model` loads: fused projections listed as their parts."""
    shapes: dict[str, tuple[int, ...]] = {}
    merged = {name: m for name, m in model.named_modules() if isinstance(m, MergedLinear)}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        if module_name not in merged:
            shapes[name] = tuple(param.shape)
            continue
        parent = module_name.rpartition(".")[0]
        for part, size in merged[module_name].parts:
            shapes[f"{parent}.{part}.{leaf}"] = (size, *param.shape[1:])
    return shapes


def _is_quantized_weight(model: nn.Module, name: str) -> bool:
    """Whether `name` is the weight of a module an earlier load replaced by its quantized form."""
    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return False
    return leaf == "weight" and isinstance(module, (QuantizedLinear, QuantizedEmbedding))


def _merged_parent(model: nn.Module, parent_name: str, part: str) -> tuple[str, MergedLinear | QuantizedLinear] | None:
    """The fused module that holds checkpoint projection `parent_name.part`, if any: a `MergedLinear`
    or the `QuantizedLinear` an earlier load replaced one by."""
    if not parent_name:
        return None
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        return None
    for child_name, child in parent.named_children():
        if isinstance(child, (MergedLinear, QuantizedLinear)) and part in dict(_parts(child)):
            return f"{parent_name}.{child_name}", child
    return None


def _parts(module: nn.Module) -> Parts:
    """The projections fused in `module` (a `MergedLinear`, or the `QuantizedLinear` that replaced
    one), in row order; none for any other module."""
    parts: Parts = getattr(module, "parts", ())
    return parts


def _row_offset(module: nn.Module, part: str) -> int:
    offset = 0
    for name, size in _parts(module):
        if name == part:
            return offset
        offset += size
    raise ValueError(f"{part} is not a part of {module}")


def _as_float(value: Value) -> torch.Tensor:
    return value.dequantize() if isinstance(value, (QuantizedWeight, PackedWeight)) else value


def _copy_rows(params: dict[str, nn.Parameter], target: str, tensor: torch.Tensor, offset: int, name: str) -> None:
    param = params[target]
    rows = param.narrow(0, offset, tensor.shape[0])
    if tuple(tensor.shape) != tuple(rows.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(rows.shape)}")
    with torch.no_grad():
        rows.copy_(tensor)


def _target_format(module_name: str, value: Value, quantization: str) -> QuantFormat | None:
    """The format a weight is kept in, or None for the model's float dtype."""
    kind = module_name.rpartition(".")[2]
    if quantization == "none" or kind not in _QUANTIZABLE:
        return None
    if quantization == "gguf":
        return value.format if isinstance(value, (QuantizedWeight, PackedWeight)) else None
    if value.shape[-1] % BLOCK:
        return None
    return QuantFormat.Q8_0 if kind in _HIGH_PRECISION else QuantFormat[quantization.upper()]


def _converted(value: Value, fmt: QuantFormat) -> QuantizedWeight | PackedWeight:
    if isinstance(value, (QuantizedWeight, PackedWeight)) and value.format is fmt:
        return value
    return quantize(_as_float(value), fmt)


def _assign_merged(
    model: nn.Module,
    group_name: str,
    module: MergedLinear | QuantizedLinear,
    parts: dict[str, Value],
    quantization: str,
    int8_activations: bool,
) -> None:
    ordered = [(name, parts[name], size) for name, size in _parts(module)]
    for name, value, size in ordered:
        if value.shape != (size, module.in_features):
            raise ValueError(
                f"{group_name} part {name}: checkpoint shape {tuple(value.shape)} != model shape "
                f"{(size, module.in_features)}"
            )
    formats = [_target_format(group_name, value, quantization) for _, value, _ in ordered]
    if any(fmt is None for fmt in formats):
        weight = torch.cat([_as_float(value) for _, value, _ in ordered])
        _set_float_weight(model, group_name, module, weight)
        return
    converted = [_converted(value, fmt) for (_, value, _), fmt in zip(ordered, formats) if fmt is not None]
    _set_quantized(model, group_name, module, pack(converted), int8_activations)


def _assign(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    name: str,
    value: Value,
    quantization: str,
    int8_activations: bool,
) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    fmt = _target_format(module_name, value, quantization) if leaf == "weight" else None
    if fmt is None:
        if _is_quantized_weight(model, name):
            _set_float_weight(model, module_name, module, _as_float(value))
            return
        _copy_rows(params, name, _as_float(value), 0, name)
        return
    if name in params:
        expected = tuple(params[name].shape)
    else:  # `load_into` checked that an earlier load quantized this module
        assert isinstance(module, (QuantizedLinear, QuantizedEmbedding))
        expected = module.quantized.shape
    if tuple(value.shape) != expected:
        raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {expected}")
    _set_quantized(model, module_name, module, _converted(value, fmt), int8_activations)


def _set_quantized(
    model: nn.Module,
    module_name: str,
    module: nn.Module,
    weight: QuantizedWeight | PackedWeight,
    int8_activations: bool,
) -> None:
    """Replace the module by its quantized form (keeping a Linear's bias parameter and fused parts)."""
    if isinstance(module, nn.Embedding) or isinstance(module, QuantizedEmbedding):
        dtype = module.weight.dtype if isinstance(module, nn.Embedding) else module.dtype
        replacement: nn.Module = QuantizedEmbedding(weight, dtype)
    else:
        replacement = QuantizedLinear(weight, getattr(module, "bias", None), int8_activations)
        if hasattr(module, "parts"):
            replacement.parts = module.parts
    _replace(model, module_name, replacement)


def _set_float_weight(model: nn.Module, module_name: str, module: nn.Module, weight: torch.Tensor) -> None:
    """Copy a float weight, turning a module quantized by an earlier load back into a float one."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        if tuple(weight.shape) != tuple(module.weight.shape):
            raise ValueError(
                f"{module_name}.weight: checkpoint shape {tuple(weight.shape)} != model shape "
                f"{tuple(module.weight.shape)}"
            )
        with torch.no_grad():
            module.weight.copy_(weight)
        return
    raise ValueError(f"{module_name}: cannot load a float weight into a quantized module; reload the model")


def _replace(model: nn.Module, module_name: str, replacement: nn.Module) -> None:
    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, replacement)
