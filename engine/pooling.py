"""Sentence-embedding pooling: which rows of the last hidden states make one vector, and normalizing.

The pooling of a sentence-transformers directory is read from its own files: `modules.json`
names a `sentence_transformers.models.Pooling` module whose `config.json` says the mode, and a
`sentence_transformers.models.Normalize` module means the vectors are L2-normalized. A model
directory without `modules.json` (or a GGUF file) gets the caller's default mode, normalized.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import ConfigError

_MODULES_FILE = "modules.json"
_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"


class PoolingMode(enum.Enum):
    CLS = "cls"  # the first token ([CLS])
    MEAN = "mean"  # the mean over every token
    MAX = "max"  # the element-wise max over every token
    LAST = "last"  # the last token (decoder models, e.g. gte-Qwen2)


# sentence-transformers' Pooling config flags, each selecting one mode.
_FLAGS = {
    "pooling_mode_cls_token": PoolingMode.CLS,
    "pooling_mode_mean_tokens": PoolingMode.MEAN,
    "pooling_mode_max_tokens": PoolingMode.MAX,
    "pooling_mode_lasttoken": PoolingMode.LAST,
}
_UNSUPPORTED_FLAGS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    mode: PoolingMode
    normalize: bool = True


def read_pooling_config(model_path: str | Path, default_mode: PoolingMode) -> PoolingConfig:
    """The pooling that `model_path`'s sentence-transformers files describe, else `default_mode`, normalized.

    Raises `ConfigError` for unreadable files or a pooling that is not exactly one supported mode.
    """
    directory = Path(model_path)
    modules_path = directory / _MODULES_FILE
    if not directory.is_dir() or not modules_path.is_file():
        return PoolingConfig(default_mode, normalize=True)
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"{modules_path} is not a list of module objects")
    types = [m.get("type") for m in modules]
    pooling = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
    mode = default_mode if pooling is None else _mode_from(directory / str(pooling.get("path", "")) / "config.json")
    return PoolingConfig(mode, normalize=_NORMALIZE_MODULE in types)


def _mode_from(config_path: Path) -> PoolingMode:
    config = _read_json(config_path)
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path} does not hold a JSON object")
    unsupported = [flag for flag in _UNSUPPORTED_FLAGS if config.get(flag)]
    chosen = [mode for flag, mode in _FLAGS.items() if config.get(flag)]
    if unsupported or len(chosen) != 1:
        raise ConfigError(
            f"{config_path}: exactly one of {sorted(_FLAGS)} must be true "
            f"(found {[m.value for m in chosen]}; unsupported {unsupported})"
        )
    return chosen[0]


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def pool(hidden: torch.Tensor, seq_lens: Sequence[int], config: PoolingConfig) -> torch.Tensor:
    """One float32 vector per sequence from packed hidden states.

    hidden: [T, H], the rows of sequence i follow those of sequence i-1 (T = sum(seq_lens), each
    length >= 1). Returns [len(seq_lens), H] float32 on hidden's device, L2-normalized when `config.normalize`.
    """
    hidden = hidden.float()
    device = hidden.device
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    ends = lens.cumsum(0)
    if config.mode is PoolingMode.CLS:
        pooled = hidden[ends - lens]
    elif config.mode is PoolingMode.LAST:
        pooled = hidden[ends - 1]
    else:
        seq_of_row = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=device), lens, output_size=hidden.shape[0]
        )
        out = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=device)
        if config.mode is PoolingMode.MEAN:
            pooled = out.index_add_(0, seq_of_row, hidden) / lens.unsqueeze(1)
        else:
            index = seq_of_row.unsqueeze(1).expand_as(hidden)
            pooled = out.scatter_reduce_(0, index, hidden, reduce="amax", include_self=False)
    return F.normalize(pooled, p=2, dim=-1) if config.normalize else pooled


def truncate(vectors: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """Matryoshka: the first `dimensions` components of each row [N, D], L2-normalized again if `normalize`."""
    kept = vectors[:, :dimensions]
    return F.normalize(kept, p=2, dim=-1) if normalize else kept
