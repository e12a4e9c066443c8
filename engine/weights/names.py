"""Parameter names and shapes a checkpoint must provide, and llama.cpp's names for them.

Shapes come from the module itself: the family builds the model on the meta device and its parameters
(fused projections listed as their parts) are what a checkpoint must hold, named as transformers'
checkpoints spell them, minus `lm_head.weight` when the embeddings are tied. GGUF names come from the
`gguf` package's own map of HF names to llama.cpp's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import gguf

from engine.config import ConfigError, ModelConfig
from engine.models.registry import build_model, on_meta
from engine.weight_loader import checkpoint_shapes

LM_HEAD = "lm_head.weight"
SCORE = "score.weight"  # the head of *ForSequenceClassification, instead of lm_head

# Buffers some older HF checkpoints saved next to the parameters; they carry no weights.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

Shape = tuple[int, ...]


def expected_shapes(config: ModelConfig) -> dict[str, Shape]:
    """HF parameter name -> shape for every parameter of `config`, in state_dict order."""
    with on_meta():
        model = build_model(config)
    return checkpoint_shapes(model)


def shape_changes(served: ModelConfig, new: ModelConfig) -> list[str]:
    """`name: ours -> theirs` for each parameter whose shape differs between the two configs (or that
    only one has); empty when weights made for `new` load into a model built from `served`."""
    if served.architecture != new.architecture:
        return [f"architecture: {served.architecture} -> {new.architecture}"]
    ours, theirs = expected_shapes(served), expected_shapes(new)
    return [
        f"{name}: {ours.get(name)} -> {theirs.get(name)}"
        for name in sorted(ours.keys() | theirs.keys())
        if ours.get(name) != theirs.get(name)
    ]


def check_tensors(
    found: Mapping[str, Shape], config: ModelConfig, where: str, expected: Mapping[str, Shape] | None = None
) -> None:
    """Raise `ConfigError` unless `found` (HF name -> shape) is exactly what `config` needs
    (`expected`: its `expected_shapes`, when the caller has them already).

    An unexpected tensor (an MLP bias, an MoE expert) means the checkpoint is not the
    architecture `config` describes, so it is an error rather than something to drop.
    """
    needed = expected_shapes(config) if expected is None else expected
    check_shapes(found, needed, where, f"{config.architecture} with {config.num_layers} layers")


def check_shapes(found: Mapping[str, Shape], expected: Mapping[str, Shape], where: str, model: str) -> None:
    """Raise `ConfigError` unless `found` has exactly the names of `expected`, with its shapes.

    `model` names what was expected in the message (e.g. "BertModel with 6 layers").
    """
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    if missing or unexpected:
        raise ConfigError(
            f"{where}: tensors do not match {model}; missing {_preview(missing)}; unexpected {_preview(unexpected)}"
        )
    wrong = [
        f"{name} {tuple(found[name])} (expected {shape})"
        for name, shape in expected.items()
        if tuple(found[name]) != tuple(shape)
    ]
    if wrong:
        raise ConfigError(f"{where}: tensor shapes do not match the config: {_preview(wrong)}")


def is_ignored(name: str) -> bool:
    """True for stored tensors that are not parameters (e.g. saved rotary `inv_freq` buffers)."""
    return bool(_IGNORED.search(name))


def gguf_to_hf_names(config: ModelConfig, expected: Mapping[str, Shape], gguf_arch: str) -> dict[str, str]:
    """llama.cpp tensor name -> HF name for every parameter in `expected` (`config`'s `expected_shapes`),
    from `gguf`'s name map for architecture `gguf_arch` (a name the map lacks is left out, so such a file
    fails `check_tensors`)."""
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}.get(gguf_arch)
    if arch is None:
        raise ConfigError(f"the gguf package has no architecture {gguf_arch!r}")
    name_map = gguf.get_tensor_name_map(arch, config.num_layers)
    names: dict[str, str] = {}
    for hf_name in expected:
        base, _, kind = hf_name.rpartition(".")
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            names[f"{gguf_base}.{kind}"] = hf_name
    if config.tie_word_embeddings:
        names.pop("output.weight", None)
    return names


def _preview(items: list[str], limit: int = 4) -> str:
    shown = ", ".join(items[:limit]) or "none"
    return shown if len(items) <= limit else f"{shown} (+{len(items) - limit} more)"
