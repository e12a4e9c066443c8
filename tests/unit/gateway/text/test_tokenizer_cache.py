"""A GGUF file's tokenizer is converted once and kept: the kept copy tokenizes, templates and stops
exactly as the conversion does (the bundled model's real file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.text.tokenizer import load_tokenizer

TEXTS = ["What is the capital of France?", "  spaces\tand\nnewlines ", "émoji 🙂 and ünïcode", "<|im_start|>x"]


def test_the_kept_copy_equals_the_conversion(smollm2_path: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    converted = load_tokenizer(str(smollm2_path))
    kept = list((tmp_path / ".cache" / "tandem" / "tokenizers").iterdir())
    assert len(kept) == 1 and (kept[0] / "tokenizer_config.json").is_file()
    stamp = os.stat(kept[0] / "tokenizer_config.json").st_mtime_ns
    again = load_tokenizer(str(smollm2_path))
    assert os.stat(kept[0] / "tokenizer_config.json").st_mtime_ns == stamp  # read, not converted again
    for text in TEXTS:
        assert again.encode(text) == converted.encode(text)
        assert again.decode(again.encode(text)) == converted.decode(converted.encode(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]}]
    assert again.apply_chat_template(messages) == converted.apply_chat_template(messages)
    assert again.eos_token_ids == converted.eos_token_ids and again.vocab_size == converted.vocab_size


def test_an_unwritable_cache_still_loads(smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".cache").write_text("a file where the cache directory would go")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_tokenizer(str(smollm2_path)).encode("Paris")
