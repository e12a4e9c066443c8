"""A GGUF tensor type Tandem can neither keep packed nor read as floats is refused at open, by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter

from engine.config import ConfigError
from engine.weights import open_checkpoint
from tests.tiny_models import save_tiny_gguf, save_tiny_llama


def test_an_unreadable_block_type_is_named(tmp_path: Path) -> None:
    source = GGUFReader(save_tiny_gguf(save_tiny_llama(tmp_path / "hf"), tmp_path / "f32.gguf"))
    path = tmp_path / "iq4.gguf"
    writer = GGUFWriter(str(path), "llama")
    for field in source.fields.values():
        if field.name.startswith("llama.") or field.name.startswith("tokenizer.") or field.name == "general.name":
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1])
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.IQ4_NL]
    for tensor in source.tensors:
        rows, cols = (int(d) for d in reversed(tensor.shape)) if len(tensor.shape) == 2 else (0, 0)
        if tensor.name == "blk.0.ffn_down.weight":
            raw = np.zeros((rows, cols // block * block_bytes), dtype=np.uint8)
            writer.add_tensor(tensor.name, raw, raw_dtype=GGMLQuantizationType.IQ4_NL)
        else:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_down\.weight is stored as IQ4_NL.*requantize"):
        open_checkpoint(str(path))


def test_the_fast_reader_reads_what_the_library_reads(smollm2_path: Path) -> None:
    """Every field (parts, types, data indices, contents) and tensor of the bundled file, equal."""
    from engine.weights.gguf_reader import FastGGUFReader

    fast, library = FastGGUFReader(smollm2_path), GGUFReader(smollm2_path)
    assert list(fast.fields) == list(library.fields)
    for name, field in library.fields.items():
        mine = fast.fields[name]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset)
        assert [p.tobytes() for p in mine.parts] == [p.tobytes() for p in field.parts]
    assert [(t.name, t.tensor_type, t.data_offset, t.data.shape) for t in fast.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.data.shape) for t in library.tensors]
