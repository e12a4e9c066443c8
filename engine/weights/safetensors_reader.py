"""Reads an HF checkpoint directory: `config.json` plus one or more `*.safetensors` shards."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import ConfigError, ModelConfig
from engine.models.registry import config_from_hf, family_of
from engine.weights.names import LM_HEAD, Shape, check_tensors, is_ignored

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class SafetensorsShard:
    """One `.safetensors` file and the parameter names to read from it, in file order."""

    path: Path
    names: tuple[str, ...]


def _unchanged(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True, slots=True)
class SafetensorsSource:
    """Yields tensors shard by shard, in their stored dtype, each through `convert(name, tensor)` (the
    family's `from_hf_tensor`: the form its modules keep)."""

    shards: tuple[SafetensorsShard, ...]
    convert: Callable[[str, torch.Tensor], torch.Tensor] = _unchanged

    @property
    def num_tensors(self) -> int:
        return sum(len(shard.names) for shard in self.shards)

    @property
    def num_bytes(self) -> int:
        """The shards' sizes (their headers are a few KiB of that)."""
        return sum(shard.path.stat().st_size for shard in self.shards)

    def read(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor in its stored dtype (safetensors hold no packed blocks: `keep_quantized`
        changes nothing)."""
        for shard in self.shards:
            with safe_open(str(shard.path), framework="pt") as handle:
                for name in shard.names:
                    yield name, self.convert(name, handle.get_tensor(name))


def open_safetensors_dir(directory: Path) -> tuple[ModelConfig, SafetensorsSource]:
    """Read `directory`'s config and shard headers (no tensor data) and check them.

    Raises `ConfigError` when the config is unreadable or unsupported, no weights are found, a
    shard named by the index is missing, or the tensors do not match the config.
    """
    config = _read_config(directory / CONFIG_FILE)
    shapes, source = read_tensor_table(
        directory, lambda name: is_ignored(name) or (name == LM_HEAD and config.tie_word_embeddings)
    )
    check_tensors(shapes, config, str(directory))
    return config, replace(source, convert=family_of(config.architecture).from_hf_tensor)


def read_tensor_table(directory: Path, skip: Callable[[str], bool]) -> tuple[dict[str, Shape], SafetensorsSource]:
    """Every stored tensor's name and shape (headers only) and a source yielding them, minus those `skip`s.

    Raises `ConfigError` when no weights are found, a shard is missing or unreadable, or a name is
    stored twice. Checking the names against a model is the caller's job.
    """
    shapes: dict[str, Shape] = {}
    shards = []
    for path in _shard_paths(directory):
        names = []
        for name, shape in _read_header(path).items():
            if skip(name):
                logger.debug("skipping %s in %s", name, path.name)
                continue
            if name in shapes:
                raise ConfigError(f"{directory}: tensor {name} is stored in more than one shard")
            shapes[name] = shape
            names.append(name)
        shards.append(SafetensorsShard(path, tuple(names)))
    return shapes, SafetensorsSource(tuple(shards))


def _read_config(path: Path) -> ModelConfig:
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    try:
        return config_from_hf(raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    except KeyError as exc:
        raise ConfigError(f"{path} lacks required field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path} has an invalid value: {exc}") from exc


def _shard_paths(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if not index.is_file():
        paths = sorted(directory.glob("*.safetensors"))
        if not paths:
            raise ConfigError(
                f"{directory} has {CONFIG_FILE} but no *.safetensors weights "
                f"(expected model.safetensors, or shards listed in {INDEX_FILE})"
            )
        return paths
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = list(dict.fromkeys(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"cannot read the weight_map of {index}: {exc!r}") from exc
    paths = [directory / name for name in files]
    missing = [path.name for path in paths if not path.is_file()]
    if missing:
        raise ConfigError(f"{index} names shards that are not in {directory}: {missing}")
    return paths


def _read_header(path: Path) -> dict[str, Shape]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as exc:  # safetensors raises its own untyped errors for corrupt headers
        raise ConfigError(f"cannot read safetensors header of {path}: {exc}") from exc
