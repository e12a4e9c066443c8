"""`open_bert_checkpoint`: an HF `BertModel` or `BertForSequenceClassification` safetensors
directory, its names and shapes checked.

An encoder's tensor names are those of transformers' `BertModel.state_dict()` with no prefix (how
sentence-transformers saves its encoder); its pooler head is not needed for sentence embeddings and
is skipped. A classifier's keep their `bert.` prefix and the pooler, which its score reads. The saved
`position_ids` / `token_type_ids` buffers are skipped in both.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from engine.bert import BertConfig, expected_shapes, is_bert_config
from engine.config import ConfigError
from engine.weights.names import check_shapes
from engine.weights.safetensors_reader import CONFIG_FILE, SafetensorsSource, read_tensor_table

logger = logging.getLogger(__name__)

_UNUSED = re.compile(r"^(pooler\.|embeddings\.(position_ids|token_type_ids)$)")
_UNUSED_BY_CLASSIFIER = re.compile(r"^bert\.embeddings\.(position_ids|token_type_ids)$")


@dataclass(frozen=True, slots=True)
class BertCheckpoint:
    """An opened BERT directory: its config and a lazy reader of exactly the encoder's parameters."""

    config: BertConfig
    path: str
    num_tensors: int
    _source: SafetensorsSource = field(repr=False, compare=False)

    def tensors(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(HF parameter name, tensor)` for every encoder parameter, in stored dtype, on CPU."""
        pairs = self._source.read()
        if not progress:
            yield from pairs
            return
        with tqdm(pairs, total=self.num_tensors, desc="Loading weights", unit="tensor", file=sys.stderr) as bar:
            yield from bar


def read_hf_config(directory: Path) -> dict[str, Any]:
    """The JSON object in `directory/config.json`; `ConfigError` when it is missing or not an object."""
    path = directory / CONFIG_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return raw


def is_bert_dir(path: str | Path) -> bool:
    """True when `path` is a directory whose config.json names `BertModel` or `BertForSequenceClassification`."""
    directory = Path(path)
    if not (directory / CONFIG_FILE).is_file():
        return False
    try:
        return is_bert_config(read_hf_config(directory))
    except ConfigError:
        return False


def open_bert_checkpoint(path: str | Path) -> BertCheckpoint:
    """Open the BERT directory at `path` without reading tensor data.

    Raises `ConfigError` when the config is not a supported BERT or the stored tensors are not
    exactly the encoder's parameters with the config's shapes.
    """
    directory = Path(path).expanduser().resolve()
    raw = read_hf_config(directory)
    if not is_bert_config(raw):
        raise ConfigError(
            f"{directory / CONFIG_FILE}: architectures {raw.get('architectures')!r} is not BertModel "
            "or BertForSequenceClassification"
        )
    try:
        config = BertConfig.from_hf_config(raw)
    except (TypeError, ValueError) as exc:  # ConfigError is a ValueError
        raise ConfigError(f"{directory / CONFIG_FILE}: {exc}") from exc
    unused = _UNUSED_BY_CLASSIFIER if config.num_labels else _UNUSED
    shapes, source = read_tensor_table(directory, lambda name: bool(unused.match(name)))
    kind = f"BertForSequenceClassification ({config.num_labels} labels)" if config.num_labels else "BertModel"
    check_shapes(shapes, expected_shapes(config), str(directory), f"{kind} with {config.num_layers} layers")
    logger.info(
        "opened BERT checkpoint %s: %d layers, hidden %d, %d tensors",
        directory,
        config.num_layers,
        config.hidden_size,
        len(shapes),
    )
    return BertCheckpoint(config, str(directory), len(shapes), source)
