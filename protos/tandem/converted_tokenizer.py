"""A GGUF file's tokenizer as a transformers tokenizer, converted once per file and kept under
`~/.cache/tandem/tokenizers`: the gateway (its text) and the workers' grammar backend (xgrammar's
vocabulary) load the same copy. Converting a 150k-token vocabulary takes tens of seconds (13 s for
SmolLM2's 49k); the kept copy loads in about a second. transformers is imported only when a tokenizer
is loaded (it imports torch when torch is installed, and importing the gateway must not)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

logger = logging.getLogger(__name__)

_TOKENIZER_CACHE = os.path.join("~", ".cache", "tandem", "tokenizers")
_SAMPLE_BYTES = 1 << 20


def load_hf_tokenizer(directory: str, gguf_file: str | None) -> Any:
    """The transformers tokenizer of `directory` (or of its GGUF file `gguf_file`, through the kept copy),
    from local files only. Raises what transformers raises (OSError, ValueError, KeyError, TypeError)."""
    from transformers import AutoTokenizer

    source = os.path.join(directory, gguf_file) if gguf_file else directory
    cached = _gguf_cache_dir(source) if gguf_file else None
    if cached is not None and os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        logger.info("loading tokenizer of %s from its converted copy %s", source, cached)
        try:
            tokenizer = AutoTokenizer.from_pretrained(cached, local_files_only=True)
            tokenizer.name_or_path = directory  # messages name where the model is, as a fresh conversion does
            return tokenizer
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the unreadable converted tokenizer %s: %s", cached, exc)
    logger.info("loading tokenizer from %s", source)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    if cached is not None:
        _save_converted(tokenizer, cached)
    return tokenizer


def _gguf_cache_dir(path: str) -> str | None:
    """Where the converted tokenizer of the GGUF file `path` is kept: named by the file's name, size,
    first and last MiB (a retrained or requantized file changes them); None if it cannot be read."""
    try:
        size = os.path.getsize(path)
        digest = hashlib.sha256(f"{os.path.basename(path)}\0{size}\0".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(_SAMPLE_BYTES))
            handle.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(handle.read(_SAMPLE_BYTES))
    except OSError:
        return None
    return os.path.join(os.path.expanduser(_TOKENIZER_CACHE), digest.hexdigest()[:24])


def _save_converted(tokenizer: Any, directory: str) -> None:
    """Keep a converted tokenizer for the next start (written to a temporary name, then renamed, so
    a reader never sees half a copy); a failure only costs the next start the conversion."""
    staging = f"{directory}.{os.getpid()}.tmp"
    try:
        tokenizer.save_pretrained(staging)
        os.replace(staging, directory)
    except OSError as exc:
        logger.warning("cannot keep the converted tokenizer in %s: %s", directory, exc)
        shutil.rmtree(staging, ignore_errors=True)
