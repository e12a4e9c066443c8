"""Multi-LoRA in the engine, against HF + PEFT in fp32: adapters made by the real `peft` on a tiny random
Llama (several ranks and targets) give PEFT's greedy tokens; one step serves requests on different
adapters and on none (chunked prompts beside decode rows) with each request's own tokens; an adapter
whose B matrices are zero (PEFT's default init) gives exactly the base model's output; a slot can be
reused; the prefix cache never hands KV computed under one adapter to another; bad slots and ranks
are clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError, LoraLoadError
from engine.lora import LoraAdapter
from engine.request import Request, SamplingParams, StepOutput
from engine.weights import open_checkpoint
from tests.peft_adapters import peft_greedy, save_peft_adapter
from tests.tiny_models import save_tiny_llama

torch.set_flush_denormal(True)

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 99, 42, 7, 7, 130, 64, 3, 250, 11], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("lora-base"), seed=5)


def _engine(base_dir: Path, **overrides: Any) -> Engine:
    config = dict(dtype="float32", page_size=4, max_total_tokens=512, max_loras=2, max_lora_rank=16) | overrides
    return Engine(open_checkpoint(str(base_dir)), EngineConfig(**config), progress=False)


def _load(engine: Engine, slot_id: int, adapter_dir: Path) -> None:
    engine.load_lora(slot_id, LoraAdapter.load(adapter_dir, engine.model_config))


def _request(request_id: str, prompt: list[int], slot: int | None, lora_id: str = "") -> Request:
    sampling = SamplingParams(temperature=0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    return Request(
        request_id, list(prompt), sampling, lora_slot=slot, lora_id=lora_id or ("" if slot is None else f"s{slot}")
    )


def _run(engine: Engine, requests: list[Request]) -> dict[str, list[StepOutput]]:
    for req in requests:
        engine.add_request(req)
    outputs: dict[str, list[StepOutput]] = {}
    while engine.has_work:
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def _tokens(outputs: list[StepOutput]) -> list[int]:
    return [o.token_id for o in outputs if o.token_id is not None]


@pytest.mark.parametrize(
    "lora",
    [
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        {"r": 8, "lora_alpha": 16, "target_modules": ALL_TARGETS},
        {"r": 16, "lora_alpha": 4, "target_modules": ALL_TARGETS, "use_rslora": True},
        {"r": 2, "lora_alpha": 6, "target_modules": ["k_proj", "o_proj", "gate_proj", "down_proj"]},
    ],
    ids=["qv-r4", "all-r8", "all-r16-rslora", "kogd-r2"],
)
def test_greedy_tokens_equal_peft(base_dir: Path, tmp_path: Path, lora: dict[str, Any]) -> None:
    adapter = save_peft_adapter(base_dir, tmp_path / "adapter", seed=1, **lora)
    engine = _engine(base_dir)
    _load(engine, 1, adapter)
    outputs = _run(engine, [_request(f"p{i}", p, 1) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert _tokens(outputs[f"p{i}"]) == peft_greedy(base_dir, adapter, prompt, NUM_TOKENS), i


def test_one_step_serves_two_adapters_and_the_base_model_each_with_its_own_tokens(
    base_dir: Path, tmp_path: Path
) -> None:
    a = save_peft_adapter(base_dir, tmp_path / "a", seed=2, r=8, lora_alpha=16, target_modules=ALL_TARGETS)
    b = save_peft_adapter(base_dir, tmp_path / "b", seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"])
    engine = _engine(base_dir, chunked_prefill_size=8, max_decode_slowdown=None)
    _load(engine, 0, a)
    _load(engine, 1, b)
    slots = {"a": 0, "b": 1, "base": None}
    requests = [_request(f"{name}{i}", p, slot) for i, p in enumerate(PROMPTS) for name, slot in slots.items()]
    outputs = _run(engine, requests)
    for i, prompt in enumerate(PROMPTS):
        for name, adapter in (("a", a), ("b", b), ("base", None)):
            assert _tokens(outputs[f"{name}{i}"]) == peft_greedy(base_dir, adapter, prompt, NUM_TOKENS), (name, i)
    assert engine.scheduler.pages.allocator.num_free == engine.scheduler.pages.num_pages


def test_an_adapter_with_zero_b_gives_exactly_the_base_output(base_dir: Path, tmp_path: Path) -> None:
    zero = save_peft_adapter(
        base_dir, tmp_path / "zero", seed=4, r=8, target_modules=ALL_TARGETS, init_lora_weights=True
    )
    base = _run(_engine(base_dir), [_request("x", PROMPTS[1], None)])["x"]
    engine = _engine(base_dir)
    _load(engine, 0, zero)
    adapted = _run(engine, [_request("x", PROMPTS[1], 0)])["x"]
    assert [(o.token_id, o.logprob) for o in adapted] == [(o.token_id, o.logprob) for o in base]


def test_a_slot_rewritten_serves_its_new_adapter_and_a_cleared_one_the_base(base_dir: Path, tmp_path: Path) -> None:
    a = save_peft_adapter(base_dir, tmp_path / "a", seed=6, r=4, target_modules=ALL_TARGETS)
    b = save_peft_adapter(base_dir, tmp_path / "b", seed=7, r=8, target_modules=["v_proj", "down_proj"])
    engine = _engine(base_dir)
    _load(engine, 0, a)
    _load(engine, 0, b)
    assert _tokens(_run(engine, [_request("b", PROMPTS[0], 0)])["b"]) == peft_greedy(
        base_dir, b, PROMPTS[0], NUM_TOKENS
    )
    engine.unload_lora(0)
    assert _tokens(_run(engine, [_request("none", PROMPTS[0], 0)])["none"]) == peft_greedy(
        base_dir, None, PROMPTS[0], NUM_TOKENS
    )


def test_the_prefix_cache_keeps_each_adapters_kv_to_itself(base_dir: Path, tmp_path: Path) -> None:
    a = save_peft_adapter(base_dir, tmp_path / "a", seed=8, r=8, target_modules=ALL_TARGETS)
    engine = _engine(base_dir, enable_prefix_cache=True)
    _load(engine, 0, a)
    prompt = PROMPTS[1]
    first = _request("a1", prompt, 0, "a#1")
    _run(engine, [first])
    base = _request("base", prompt, None)
    assert _tokens(_run(engine, [base])["base"]) == peft_greedy(base_dir, None, prompt, NUM_TOKENS)
    assert base.num_cached_tokens == 0  # a's pages were there, for a only
    again = _request("a2", prompt, 0, "a#1")
    assert _tokens(_run(engine, [again])["a2"]) == peft_greedy(base_dir, a, prompt, NUM_TOKENS)
    assert again.num_cached_tokens == 16


def test_bad_slots_and_ranks_are_clear_errors(base_dir: Path, tmp_path: Path) -> None:
    big = save_peft_adapter(base_dir, tmp_path / "big", seed=9, r=32, target_modules=["q_proj"])
    engine = _engine(base_dir)
    with pytest.raises(LoraLoadError, match="max-lora-rank"):
        _load(engine, 0, big)
    with pytest.raises(InvalidRequestError, match="slot 2 is not one of"):
        engine.add_request(_request("x", PROMPTS[0], 2))
    plain = _engine(base_dir, max_loras=0)
    with pytest.raises(InvalidRequestError, match="no LoRA adapters"):
        plain.add_request(_request("y", PROMPTS[0], 0))
    assert not engine.has_work and not plain.has_work
