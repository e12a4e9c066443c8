"""Multi-LoRA on a GPU: the engine on CUDA (float32, torch attention and sampling) serves requests on two
adapters made by the real `peft` and on none in one batch, each with PEFT's greedy tokens, through the
torch path of `kernels/lora.py` (one matmul per segment on the device); the CPU side is
tests/integration/test_lora_engine.py. A step with adapter rows replays no CUDA graph.

Needs CUDA; skipped without.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.lora import LoraAdapter  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.weights import open_checkpoint  # noqa: E402
from tests.peft_adapters import peft_greedy, save_peft_adapter  # noqa: E402
from tests.tiny_models import save_tiny_llama  # noqa: E402

PROMPT = [5, 17, 99, 42, 7, 7, 130, 64, 3, 250, 11, 12, 13]
NUM_TOKENS = 12


def test_two_adapters_and_the_base_model_in_one_cuda_batch_give_pefts_tokens(tmp_path: Path) -> None:
    base = save_tiny_llama(tmp_path / "base", seed=3)
    adapters = {
        "a": save_peft_adapter(base, tmp_path / "a", 1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "b": save_peft_adapter(base, tmp_path / "b", 2, target_modules=["gate_proj", "up_proj", "down_proj"]),
    }
    config = EngineConfig(
        dtype="float32",
        device="cuda",
        max_total_tokens=1024,
        attention_backend="torch",
        sampling_backend="torch",
        max_loras=2,
        max_lora_rank=8,
    )
    engine = Engine(open_checkpoint(str(base)), config, progress=False)
    slots = {"a": 0, "b": 1, "": None}
    for name, slot in slots.items():
        if slot is not None:
            engine.load_lora(slot, LoraAdapter.load(adapters[name], engine.model_config))
    sampling = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    for name, slot in slots.items():
        engine.add_request(Request(name or "base", list(PROMPT), sampling, lora_slot=slot, lora_id=name))
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        for output in engine.step():
            if output.token_id is not None:
                tokens.setdefault(output.request_id, []).append(output.token_id)
    for name in slots:
        assert tokens[name or "base"] == peft_greedy(base, adapters.get(name), PROMPT, NUM_TOKENS), name
