"""The engine flags of the worker commands and `tandem serve`: chunked prefill, quantization per role,
the device (resolved once, here) and the attention and sampling backends."""

from __future__ import annotations

from typing import Callable

import pytest

from engine.config import EngineConfig
from launcher.cli import _engine_config
from launcher.flags import build_parser
from launcher.serve import serve_worker_flags
from launcher.worker_flags import DEFAULT_CHUNKED_PREFILL_SIZE


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
    worker_flags = serve_worker_flags(args, threads=1)
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
    flags = serve_worker_flags(serve, 1)
    assert flags[flags.index("--quantization") + 1] == "gguf" and "--int8-activations" in flags


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Set how many CUDA devices torch reports (a fact of the machine)."""
    import torch

    def set_count(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return set_count


def _config(*argv: str) -> EngineConfig:
    return _engine_config(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize(("count", "expected"), [(0, "cpu"), (1, "cuda"), (4, "cuda")])
def test_device_auto_is_cuda_where_torch_sees_a_gpu(gpus: Callable[[int], None], count: int,
                                                    expected: str) -> None:
    gpus(count)
    assert _config("prefill", "--is-embedding", "--dtype", "float32").device == expected   # auto is the default
    assert _config("prefill", "--is-embedding", "--dtype", "float32", "--device", "auto").device == expected


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_device_auto_keeps_kv_moving_workers_on_the_cpu_until_kv_leaves_gpu_memory(
        gpus: Callable[[int], None], role: str, caplog: pytest.LogCaptureFixture) -> None:
    gpus(1)
    assert _config(role, "--dtype", "float32").device == "cpu"
    assert "KV transfer from GPU memory" in caplog.text


def test_an_explicit_device_is_kept_and_checked_against_the_machine(gpus: Callable[[int], None]) -> None:
    gpus(2)
    assert _config("decode", "--device", "cpu", "--dtype", "float32").device == "cpu"
    assert _config("decode", "--device", "cuda").device == "cuda"
    assert _config("decode", "--device", "cuda:1").device == "cuda:1"
    with pytest.raises(SystemExit, match="has 2 CUDA device"):
        _config("decode", "--device", "cuda:2")
    gpus(0)
    with pytest.raises(SystemExit, match="has 0 CUDA device"):
        _config("prefill", "--device", "cuda")


@pytest.mark.parametrize("value", ["nvidia", "cuda:", "cuda:one", "meta", "CUDA"])
def test_a_bad_device_is_refused_at_parse_time(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--device", value])
    assert "--device" in capsys.readouterr().err


def test_on_a_gpu_auto_quantization_loads_floats_and_auto_dtype_is_bfloat16(gpus: Callable[[int], None],
                                                                           tmp_path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    gpus(1)
    config = _config("decode", "--model-path", str(gguf), "--device", "cuda")
    assert (config.device, config.quantization, config.dtype) == ("cuda", "none", "bfloat16")
    assert _config("decode", "--model-path", str(gguf), "--device", "cpu").quantization == "gguf"
    assert _config("prefill", "--is-embedding", "--device", "cuda").dtype == "float32"


@pytest.mark.parametrize("quantization", ["gguf", "int8", "q4_0", "int4"])
def test_an_explicit_quantization_on_a_gpu_is_refused_with_the_reason(gpus: Callable[[int], None],
                                                                      quantization: str) -> None:
    gpus(1)
    with pytest.raises(SystemExit, match="CPU kernel"):
        _config("decode", "--device", "cuda", "-q", quantization)


def test_backend_flags_reach_the_engine_config(gpus: Callable[[int], None]) -> None:
    gpus(0)
    config = _config("decode", "--dtype", "float32", "--attention-backend", "torch", "--sampling-backend", "torch")
    assert (config.attention_backend, config.sampling_backend) == ("torch", "torch")
    config = _config("decode", "--dtype", "float32")
    assert (config.attention_backend, config.sampling_backend) == ("auto", "auto")


def test_serve_passes_device_and_backends_to_both_workers(gpus: Callable[[int], None]) -> None:
    gpus(2)
    args = build_parser().parse_args(["serve", "--device", "cuda:1", "--attention-backend", "flashinfer",
                                      "--sampling-backend", "torch", "--dtype", "float16"])
    worker_flags = serve_worker_flags(args, threads=1)
    for role in ("prefill", "decode"):
        config = _config(role, *worker_flags)
        assert (config.device, config.attention_backend, config.sampling_backend, config.dtype) == \
            ("cuda:1", "flashinfer", "torch", "float16")
    default_flags = serve_worker_flags(build_parser().parse_args(["serve"]), threads=1)
    assert default_flags[default_flags.index("--device") + 1] == "auto"   # each worker resolves it itself
