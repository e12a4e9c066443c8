"""`open_checkpoint`: find a local checkpoint, read its config, and expose its tensors lazily."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from engine.config import ConfigError, ModelConfig
from engine.weights.gguf_reader import open_gguf_file
from engine.weights.safetensors_reader import CONFIG_FILE, open_safetensors_dir
from engine.weights.source import TensorSource
from kernels.packing import PackedWeight

logger = logging.getLogger(__name__)

_EXPECTED = (
    "a local HF directory (config.json plus *.safetensors), a .gguf file, or a directory holding exactly one .gguf file"
)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """An opened checkpoint: its config, validated tensor table, and a lazy tensor reader.

    Opening checked that the stored tensors are exactly the parameters `config` needs, with the
    right shapes; reading the data happens only in `tensors()`.
    """

    config: ModelConfig
    path: str
    format: str
    num_tensors: int
    num_tensor_bytes: int  # the tensors' bytes in the files, as stored
    identity: str  # `weights_identity` of the files the weights come from
    _source: TensorSource = field(repr=False, compare=False)

    def tensors(
        self, progress: bool = True, keep_quantized: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        """Yield `(HF parameter name, tensor)` for every parameter, one at a time, on CPU.

        Names are those of transformers' `state_dict()`; `lm_head.weight` is absent when
        `config.tie_word_embeddings`. Safetensors tensors keep their stored dtype; GGUF tensors
        are dequantized to float32, except that with `keep_quantized` GGUF's matrices of the block
        types the matmul reads come repacked into its panels, as `PackedWeight`s. Each yielded tensor
        is owned by the caller and is not kept by the reader. `progress` shows a tqdm bar ("Loading weights") on stderr.
        """
        # only GGUF files hold packed blocks; other formats always yield floats
        pairs = self._source.read(keep_quantized=keep_quantized)
        if not progress:
            yield from pairs
            return
        with tqdm(pairs, total=self.num_tensors, desc="Loading weights", unit="tensor", file=sys.stderr) as bar:
            yield from bar


def open_checkpoint(path: str) -> Checkpoint:
    """Open the local checkpoint at `path` without reading tensor data.

    `path` is an HF directory (`config.json` and `model.safetensors`, or shards listed in
    `model.safetensors.index.json`), a `.gguf` file, or a directory with exactly one `.gguf`
    file and no `config.json`. Nothing is downloaded. Raises `FileNotFoundError` when `path`
    does not exist and `ConfigError` when it is not a usable checkpoint.
    """
    resolved = Path(path).expanduser().resolve()
    if not resolved.exists():
        raise FileNotFoundError(
            f"checkpoint path {path!r} does not exist locally (Tandem never downloads from the "
            f"Hub); expected {_EXPECTED}"
        )
    if resolved.is_file():
        if resolved.suffix.lower() != ".gguf":
            raise ConfigError(f"{resolved} is not a .gguf file; expected {_EXPECTED}")
        return _open_gguf(resolved)
    if not resolved.is_dir():
        raise ConfigError(f"{resolved} is neither a file nor a directory; expected {_EXPECTED}")
    if (resolved / CONFIG_FILE).is_file():
        config, source = open_safetensors_dir(resolved)
        return _opened(config, resolved, "safetensors", source)
    ggufs = sorted(resolved.glob("*.gguf"))
    if len(ggufs) == 1:
        return _open_gguf(ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ConfigError(f"{resolved} holds several .gguf files ({names}); pass one file's path")
    raise ConfigError(f"{resolved} holds neither {CONFIG_FILE} nor a .gguf file; expected {_EXPECTED}")


def _open_gguf(path: Path) -> Checkpoint:
    config, source = open_gguf_file(path)
    return _opened(config, path, "gguf", source)


def _opened(config: ModelConfig, path: Path, fmt: str, source: TensorSource) -> Checkpoint:
    files = [path] if fmt == "gguf" else [path / CONFIG_FILE, *sorted(path.glob("*.safetensors"))]
    checkpoint = Checkpoint(
        config=config,
        path=str(path),
        format=fmt,
        num_tensors=source.num_tensors,
        num_tensor_bytes=source.num_bytes,
        identity=weights_identity(files),
        _source=source,
    )
    logger.info(
        "opened %s checkpoint %s: %s, %d layers, %d tensors, weights %s",
        fmt,
        path,
        config.architecture,
        config.num_layers,
        checkpoint.num_tensors,
        checkpoint.identity,
    )
    return checkpoint


_SAMPLES_PER_FILE = 64
_SAMPLE_BYTES = 64 * 1024


def weights_identity(files: list[Path]) -> str:
    """A name for the weights in `files`, from their content, equal wherever a copy of the same
    checkpoint lies (another path, host or mtime), so that workers started apart can tell whether
    they compute the same KV.

    It hashes each file's name and size and 64 evenly spaced 64 KiB samples of its bytes: constant
    work at start-up whatever the model's size (4 MiB read per file), and any retrained or
    differently quantized checkpoint changes the samples. A change confined to the bytes between
    samples would go unnoticed; this is a guard against pairing mismatched workers, not a checksum.
    """
    digest = hashlib.sha256()
    for path in files:
        size = os.path.getsize(path)
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= _SAMPLES_PER_FILE * _SAMPLE_BYTES:
                digest.update(f.read())
                continue
            for i in range(_SAMPLES_PER_FILE):  # the first sample starts the file, the last one ends it
                f.seek(i * (size - _SAMPLE_BYTES) // (_SAMPLES_PER_FILE - 1))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]
