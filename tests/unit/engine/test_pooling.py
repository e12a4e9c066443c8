"""engine/pooling.py: each mode on packed hidden states, reading sentence-transformers' files, truncation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import ConfigError
from engine.pooling import PoolingConfig, PoolingMode, pool, read_pooling_config, truncate

SEQ_LENS = [3, 1, 4]


@pytest.fixture()
def hidden() -> torch.Tensor:
    return torch.randn(sum(SEQ_LENS), 5, generator=torch.Generator().manual_seed(0))


def _rows(hidden: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(hidden, SEQ_LENS))


@pytest.mark.parametrize("mode, reduce", [
    (PoolingMode.CLS, lambda rows: rows[0]),
    (PoolingMode.LAST, lambda rows: rows[-1]),
    (PoolingMode.MEAN, lambda rows: rows.mean(0)),
    (PoolingMode.MAX, lambda rows: rows.max(0).values),
])
def test_each_mode_pools_only_its_own_rows(hidden: torch.Tensor, mode: PoolingMode, reduce) -> None:
    expected = torch.stack([reduce(rows) for rows in _rows(hidden)])
    raw = pool(hidden, SEQ_LENS, PoolingConfig(mode, normalize=False))
    assert raw.dtype == torch.float32 and raw.shape == (3, 5)
    assert torch.allclose(raw, expected, atol=1e-6)
    assert torch.allclose(pool(hidden, SEQ_LENS, PoolingConfig(mode)), F.normalize(expected, dim=-1), atol=1e-6)


def test_pool_accepts_low_precision_and_returns_float32(hidden: torch.Tensor) -> None:
    out = pool(hidden.bfloat16(), SEQ_LENS, PoolingConfig(PoolingMode.MEAN))
    assert out.dtype == torch.float32
    assert torch.allclose(out.norm(dim=1), torch.ones(3), atol=1e-5)


def test_truncate_keeps_the_first_components_and_renormalizes() -> None:
    vectors = F.normalize(torch.randn(4, 16, generator=torch.Generator().manual_seed(1)), dim=-1)
    cut = truncate(vectors, 8, normalize=True)
    assert torch.allclose(cut, F.normalize(vectors[:, :8], dim=-1))
    assert torch.allclose(truncate(vectors, 8, normalize=False), vectors[:, :8])


def test_minilm_pooling_is_read_from_its_files(minilm_path: Path) -> None:
    assert read_pooling_config(minilm_path, PoolingMode.CLS) == PoolingConfig(PoolingMode.MEAN, normalize=True)


def _write_st_dir(directory: Path, pooling: dict, normalize: bool) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "1_Pooling").mkdir(parents=True)
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return directory


def test_last_token_pooling_without_normalize(tmp_path: Path) -> None:
    directory = _write_st_dir(tmp_path, {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, False)
    assert read_pooling_config(directory, PoolingMode.MEAN) == PoolingConfig(PoolingMode.LAST, normalize=False)


def test_no_modules_json_gives_the_default_mode_normalized(tmp_path: Path) -> None:
    assert read_pooling_config(tmp_path, PoolingMode.LAST) == PoolingConfig(PoolingMode.LAST, normalize=True)
    assert read_pooling_config(tmp_path / "model.gguf", PoolingMode.LAST) == PoolingConfig(PoolingMode.LAST)


@pytest.mark.parametrize("flags", [
    {"pooling_mode_mean_sqrt_len_tokens": True},
    {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
    {},
])
def test_unsupported_or_ambiguous_pooling_is_rejected(tmp_path: Path, flags: dict) -> None:
    directory = _write_st_dir(tmp_path, flags, True)
    with pytest.raises(ConfigError, match="exactly one of"):
        read_pooling_config(directory, PoolingMode.MEAN)


def test_unreadable_modules_json_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        read_pooling_config(tmp_path, PoolingMode.MEAN)
