"""Every family builds and steps on a device other than the CPU: on the meta device here (a CPU tensor
mixed into a forward pass raises there), on CUDA under the gpu marker (greedy tokens equal to the CPU's
fp32 engine). Prompts run past the sliding window of the families that have one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.cuda_graph import why_decode_runs_eagerly
from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner
from engine.weights import open_checkpoint
from tests.tiny_models import (TINY_WINDOW, save_tiny_gemma3, save_tiny_llama, save_tiny_mistral, save_tiny_phi3,
                               save_tiny_qwen3)

FAMILIES: dict[str, Callable[[Path], Path]] = {
    "qwen3": save_tiny_qwen3,
    "mistral": save_tiny_mistral,
    "phi3": save_tiny_phi3,
    "gemma3": save_tiny_gemma3,
}
META = torch.device("meta")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


def _config(device: str, **overrides) -> EngineConfig:
    settings = dict(dtype="float32", page_size=4, max_total_tokens=256, device=device, quantization="none",
                    attention_backend="torch", sampling_backend="torch")
    return EngineConfig(**{**settings, **overrides})


def test_a_prefill_past_the_window_and_a_decode_step_stay_on_the_device(family_dir: Path) -> None:
    runner = ModelRunner(open_checkpoint(str(family_dir)), _config("meta"), context_len=128, progress=False)
    assert {p.device for p in runner.model.parameters()} == {META}
    prompt = list(range(3, 3 + 2 * TINY_WINDOW + 1))
    request = Request("a", prompt, SamplingParams(), page_ids=list(range(6)))
    logits = runner.forward_logits([request])
    assert logits.device == META and logits.shape == (1, 256)
    request.num_computed, request.output_ids = request.prompt_len, [7]
    assert runner.forward_logits([request]).device == META


def _config_of(save: Callable[[Path], Path], directory: Path) -> ModelConfig:
    return open_checkpoint(str(save(directory))).config


def test_sliding_window_models_decode_eagerly_under_cuda_graphs(tmp_path: Path) -> None:
    """Their layers choose the attention path from the host's lengths, which a graph would freeze."""

    class Capturable:
        supports_cuda_graphs = True

    cuda, backend = torch.device("cuda"), Capturable()
    llama = _config_of(save_tiny_llama, tmp_path / "llama")
    assert why_decode_runs_eagerly(cuda, (1, 2), backend, llama) is None  # type: ignore[arg-type]
    for name, save in (("mistral", save_tiny_mistral), ("gemma3", save_tiny_gemma3)):
        reason = why_decode_runs_eagerly(cuda, (1, 2), backend, _config_of(save, tmp_path / name))  # type: ignore[arg-type]
        assert reason is not None and "sliding-window" in reason


@pytest.mark.gpu
def test_greedy_tokens_on_cuda_equal_the_cpu(family_dir: Path) -> None:
    def generate(device: str) -> list[int]:
        config = _config(device, attention_backend="auto", sampling_backend="auto")
        engine = Engine(open_checkpoint(str(family_dir)), config, progress=False)
        prompt = list(range(3, 3 + TINY_WINDOW + 5))
        engine.add_request(Request("g", prompt, SamplingParams(temperature=0.0, ignore_eos=True,
                                                              max_new_tokens=2 * TINY_WINDOW)))
        tokens: list[int] = []
        while engine.has_work:
            tokens += [out.token_id for out in engine.step() if out.token_id is not None]
        return tokens

    assert generate("cuda") == generate("cpu")
