"""The engine flags of the worker commands and `tandem serve`: chunked prefill, quantization, dtypes,
the device (resolved once, by the command that builds the config) and the attention and sampling backends."""

from __future__ import annotations

from typing import Callable

import pytest

from engine.config import EngineConfig
from launcher.configs import engine_config
from launcher.flags import build_parser
from launcher.serve import stack_configs
from launcher.worker_flags import DEFAULT_CHUNKED_PREFILL_SIZE


def _config(*argv: str) -> EngineConfig:
    """A worker command's engine config, as `tandem prefill|decode` builds it from `argv`."""
    args = build_parser().parse_args(list(argv))
    return engine_config(args, args.command, getattr(args, "is_embedding", False))


def _serve_engines(*flags: str) -> dict[str, EngineConfig]:
    """The engine config of each worker `tandem serve` starts, by role."""
    stack = stack_configs(build_parser().parse_args(["serve", *flags]))
    return {worker.role: worker.engine for worker in (stack.prefill, stack.decode) if worker is not None}


def _worker_engine_size(argv: list[str]) -> int | None:
    return _config(*argv).chunked_prefill_size


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
    engines = _serve_engines("--dtype", "float32", *flag)
    assert [engine.chunked_prefill_size for engine in engines.values()] == [expected, expected]


def test_quantization_auto_packs_gguf_weights_on_cpu(tmp_path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")

    def resolved(role: str, *flags: str) -> str:
        return _config(role, *flags).quantization

    assert resolved("decode", "--model-path", str(gguf)) == "gguf"
    assert resolved("prefill", "--model-path", str(gguf)) == "gguf"      # prefill computes packed too
    assert resolved("decode", "--model-path", str(folder)) == "none"     # safetensors: floats
    assert resolved("prefill", "--model-path", str(gguf), "-q", "int4") == "q4_1"
    assert resolved("decode", "--model-path", str(folder), "--quantization", "int8") == "q8_0"
    engines = _serve_engines("--model-path", str(gguf))
    assert {(e.quantization, e.dtype, e.kv_cache_dtype) for e in engines.values()} == {("gguf", "float32", "bfloat16")}
    engines = _serve_engines("--model-path", str(folder), "--dtype", "float32")   # floats: the pool in their dtype
    assert {(e.quantization, e.dtype, e.kv_cache_dtype) for e in engines.values()} == {("none", "float32", None)}
    engines = _serve_engines("--model-path", str(gguf), "--dtype", "bf16", "--kv-cache-dtype", "float")
    assert {(e.dtype, e.kv_cache_dtype) for e in engines.values()} == {("bfloat16", "float32")}
    engines = _serve_engines("--model-path", str(gguf), "--dtype", "float32", "--int8-activations", "-q", "int8")
    assert all((e.quantization, e.int8_activations) == ("q8_0", True) for e in engines.values())


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Set how many CUDA devices torch reports (a fact of the machine)."""
    import torch

    def set_count(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return set_count


@pytest.mark.parametrize(("count", "expected"), [(0, "cpu"), (1, "cuda"), (4, "cuda")])
def test_device_auto_is_cuda_where_torch_sees_a_gpu(gpus: Callable[[int], None], count: int,
                                                    expected: str) -> None:
    gpus(count)
    assert _config("prefill", "--is-embedding", "--dtype", "float32").device == expected   # auto is the default
    assert _config("prefill", "--is-embedding", "--dtype", "float32", "--device", "auto").device == expected


@pytest.fixture
def mooncake_build(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """Set whether the installed Mooncake is its CUDA build (a fact of the machine: `make test-gpu`
    installs the CUDA build in place of the CPU one)."""
    from kv_transfer import mooncake_backend

    def set_cuda(is_cuda: bool) -> None:
        monkeypatch.setattr(mooncake_backend, "installed_build_moves_gpu_memory", lambda: is_cuda)
    return set_cuda


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_device_auto_keeps_kv_on_the_host_where_mooncake_is_its_cpu_build(
        gpus: Callable[[int], None], mooncake_build: Callable[[bool], None], role: str,
        caplog: pytest.LogCaptureFixture) -> None:
    gpus(1)
    mooncake_build(False)
    assert _config(role, "--dtype", "float32").device == "cpu"
    assert "Mooncake is its CPU build, which cannot move KV from GPU memory" in caplog.text


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_device_auto_puts_kv_moving_workers_on_the_gpu_with_mooncakes_cuda_build(
        gpus: Callable[[int], None], mooncake_build: Callable[[bool], None], role: str,
        caplog: pytest.LogCaptureFixture) -> None:
    gpus(1)
    mooncake_build(True)
    assert _config(role).device == "cuda"
    assert _config(role, "--kv-protocol", "rdma", "--kv-device", "mlx5_0").device == "cuda"
    assert _config(role, "--kv-transport", "local", "--dtype", "float32").device == "cpu"
    assert "local KV transport copies host memory only" in caplog.text


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


def test_serve_resolves_device_and_backends_once_for_both_workers(gpus: Callable[[int], None],
                                                                  mooncake_build: Callable[[bool], None],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    gpus(1)
    mooncake_build(False)
    engines = _serve_engines("--attention-backend", "torch", "--sampling-backend", "torch", "--dtype", "float16")
    assert {(e.device, e.attention_backend, e.sampling_backend, e.dtype) for e in engines.values()} == \
        {("cpu", "torch", "torch", "float16")}   # auto: Mooncake's CPU build keeps KV on the host
    assert "cannot move KV from GPU memory" in caplog.text
    embedding = stack_configs(build_parser().parse_args(["serve", "--is-embedding", "--device", "cuda:0",
                                                         "--attention-backend", "flashinfer"])).prefill.engine
    assert (embedding.device, embedding.attention_backend, embedding.dtype) == ("cuda:0", "flashinfer", "float32")


def test_serve_refuses_flags_that_make_no_valid_worker_before_starting_any(gpus: Callable[[int], None]) -> None:
    gpus(2)
    with pytest.raises(SystemExit, match="tandem serve: the local KV transport copies host memory only"):
        stack_configs(build_parser().parse_args(["serve", "--device", "cuda:1", "--kv-transport", "local"]))
    assert stack_configs(build_parser().parse_args(["serve", "--device", "cuda:1"])).decode.engine.device == "cuda:1"
    with pytest.raises(SystemExit, match="has 2 CUDA device"):
        stack_configs(build_parser().parse_args(["serve", "--device", "cuda:2"]))


def test_cuda_graph_flags_reach_the_engine_config() -> None:
    assert _config("decode", "--dtype", "float32").cuda_graph_batch_sizes is None   # the engine's default ladder
    assert _config("decode", "--dtype", "float32", "--disable-cuda-graph").cuda_graph_batch_sizes == ()
    assert _config("decode", "--dtype", "float32", "--cuda-graph-max-bs", "32").cuda_graph_batch_sizes == \
        (1, 2, 4, 8, 16, 32)
    capped = _config("decode", "--dtype", "float32", "--max-running-requests", "12", "--cuda-graph-max-bs", "512")
    assert capped.cuda_graph_batch_sizes == (1, 2, 4, 8, 12)
    assert _config("decode", "--dtype", "float32", "--cuda-graph-bs", "8", "1", "4", "4").cuda_graph_batch_sizes == \
        (1, 4, 8)
    engines = _serve_engines("--dtype", "float32", "--cuda-graph-bs", "1", "2")
    assert [e.cuda_graph_batch_sizes for e in engines.values()] == [(1, 2), (1, 2)]


def test_bad_cuda_graph_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--cuda-graph-bs", "0"], ["--cuda-graph-max-bs", "-4"], ["--disable-cuda-graph", "--cuda-graph-bs", "2"],
                 ["--cuda-graph-max-bs", "8", "--cuda-graph-bs", "2"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["decode", *argv])
        assert "--cuda-graph" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="exceeds max_running_requests"):
        _config("decode", "--dtype", "float32", "--max-running-requests", "4", "--cuda-graph-bs", "1", "8")
