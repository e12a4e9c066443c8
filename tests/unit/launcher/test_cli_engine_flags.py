"""The engine flags of the worker commands and `tandem serve`: chunked prefill, quantization per role."""

from __future__ import annotations

import pytest

from launcher.cli import DEFAULT_CHUNKED_PREFILL_SIZE, _engine_config, _serve_worker_flags, build_parser


def _worker_engine_size(argv: list[str]) -> int | None:
    return _engine_config(build_parser().parse_args(argv)).chunked_prefill_size


def test_a_worker_chunks_by_default_and_minus_one_or_zero_turns_it_off() -> None:
    assert DEFAULT_CHUNKED_PREFILL_SIZE >= 256   # a 256-token benchmark prompt is never split
    assert _worker_engine_size(["prefill", "--dtype", "float32"]) == DEFAULT_CHUNKED_PREFILL_SIZE
    assert _worker_engine_size(["prefill", "--dtype", "float32", "--chunked-prefill-size", "64"]) == 64
    assert _worker_engine_size(["decode", "--dtype", "float32", "--chunked-prefill-size", "-1"]) is None
    assert _worker_engine_size(["prefill", "--dtype", "float32", "--chunked-prefill-size", "0"]) is None


@pytest.mark.parametrize("value", ["-2", "lots"])
def test_a_bad_chunk_size_is_refused_at_parse_time(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill", "--chunked-prefill-size", value])
    assert "--chunked-prefill-size" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "expected"), [([], DEFAULT_CHUNKED_PREFILL_SIZE),
                                                (["--chunked-prefill-size", "96"], 96),
                                                (["--chunked-prefill-size", "-1"], None)])
def test_serve_passes_the_chunk_size_to_both_workers(flag: list[str], expected: int | None) -> None:
    args = build_parser().parse_args(["serve", "--dtype", "float32", *flag])
    worker_flags = _serve_worker_flags(args, threads=1)
    for role in ("prefill", "decode"):
        assert _worker_engine_size([role, *worker_flags]) == expected


def test_quantization_auto_packs_the_decode_workers_gguf_weights_only(tmp_path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")

    def resolved(role: str, *flags: str) -> str:
        return _engine_config(build_parser().parse_args([role, *flags])).quantization

    assert resolved("decode", "--model-path", str(gguf)) == "gguf"
    assert resolved("prefill", "--model-path", str(gguf)) == "none"      # prefill computes in floats
    assert resolved("decode", "--model-path", str(folder)) == "none"     # safetensors: floats
    assert resolved("prefill", "--model-path", str(gguf), "-q", "int4") == "q4_1"
    assert resolved("decode", "--model-path", str(folder), "--quantization", "int8") == "q8_0"
    serve = build_parser().parse_args(["serve", "--int8-activations", "-q", "gguf"])
    flags = _serve_worker_flags(serve, 1)
    assert flags[flags.index("--quantization") + 1] == "gguf" and "--int8-activations" in flags
