"""The transformers fallback (engine/models/transformers_fallback.py) against HF transformers in fp32, on
tiny random checkpoints of architectures with no Tandem family file: OLMo 2, Granite (tied embeddings,
its own attention scale, logits divided by `logits_scaling`) and OLMo 3 (a sliding-window layer). The
same logits at every position of a batched prefill and of batched decode steps, the same greedy tokens;
a prefill worker's KV pages carry on in a decode worker; the model info says which code runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.config import ConfigError, EngineConfig
from engine.engine import Engine
from engine.models.registry import family_of, implementation_of
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from engine.weights.names import expected_shapes
from gateway.cluster.handoff import run_handoff
from gateway.cluster.pool import WorkerPool
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from server_runtime.context import EngineFacts
from server_runtime.convert import model_info_to_proto
from tandem.sampling import SamplingSpec
from tests.hf_oracle import assert_logits_match_hf, hf_greedy, load_hf_dir
from tests.integration.inprocess_workers import running_workers
from tests.tiny_models import (TINY_WINDOW, save_tiny_gpt_oss, save_tiny_granite, save_tiny_llama, save_tiny_olmo2,
                               save_tiny_olmo3)

MODELS: dict[str, Callable[[Path], Path]] = {
    "olmo2": save_tiny_olmo2,
    "granite": save_tiny_granite,
    "olmo3": save_tiny_olmo3,
}
PAGE = 4


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_flush_denormal(True)
    return MODELS[request.param](tmp_path_factory.mktemp(request.param))


def _engine(model_dir: Path, **overrides: object) -> Engine:
    config = EngineConfig(**{"dtype": "float32", "page_size": PAGE, "max_total_tokens": 512, **overrides})
    return Engine(open_checkpoint(str(model_dir)), config, progress=False)


def _run_to_end(engine: Engine) -> list[int]:
    tokens = []
    while engine.has_work:
        tokens += [o.token_id for o in engine.step() if o.token_id is not None]
    return tokens


def test_prefill_and_decode_logits_match_hf(model_dir: Path) -> None:
    """Three prompts of different lengths (one past the window) prefill in one batch, then decode six
    steps together: each row's logits equal HF's full forward at that position."""
    engine, hf = _engine(model_dir), load_hf_dir(model_dir, torch.float32)
    assert type(engine.runner.model).__name__ == "TransformersCausalLM"
    assert_logits_match_hf(engine, hf, (5, 2 * TINY_WINDOW + 3, 2), PAGE, num_decode_steps=6)


def test_greedy_tokens_match_hf(model_dir: Path) -> None:
    """Greedy generation through the engine's scheduler (batched, paged) equals HF's, token for token."""
    engine, hf = _engine(model_dir), load_hf_dir(model_dir, torch.float32)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (3, TINY_WINDOW + 5)]
    num_tokens = 3 * TINY_WINDOW
    sampling = SamplingParams(temperature=0, max_new_tokens=num_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"r{i}", list(ids), sampling))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            if out.token_id is not None:
                outputs[out.request_id].append(out.token_id)
    for i, ids in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(hf, ids, num_tokens)
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_chunked_prefill_and_cached_prefix_continue_from_the_pages(tmp_path: Path) -> None:
    """A prompt prefilled in chunks of 8, then again from the prefix cache: both continue from KV read
    back out of the pool, and give HF's greedy tokens."""
    model_path = save_tiny_olmo3(tmp_path / "olmo3")
    engine = _engine(model_path, chunked_prefill_size=2 * PAGE, enable_prefix_cache=True)
    prompt = torch.randint(3, 256, (3 * TINY_WINDOW + 1,), generator=torch.Generator().manual_seed(3)).tolist()
    sampling = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    expected = hf_greedy(load_hf_dir(model_path), prompt, 6)
    cached = []
    for request_id in ("chunked", "cached"):
        engine.add_request(Request(request_id, list(prompt), sampling))
        outputs = []
        while engine.has_work:
            outputs += [out for out in engine.step() if out.token_id is not None]
        assert [out.token_id for out in outputs] == expected
        cached.append(outputs[0].cached_tokens)
    assert cached[0] == 0 and cached[1] >= 2 * TINY_WINDOW


def test_checkpoint_names_are_hf_ones(model_dir: Path) -> None:
    """The names and shapes the checkpoint must hold are the HF model's, a tied lm_head left out."""
    checkpoint = open_checkpoint(str(model_dir))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        stored = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    assert expected_shapes(checkpoint.config) == stored
    assert ("lm_head.weight" not in stored) == checkpoint.config.tie_word_embeddings


def test_model_info_says_which_code_runs(tmp_path: Path) -> None:
    olmo2 = _engine(save_tiny_olmo2(tmp_path / "olmo2"))
    info = model_info_to_proto(EngineFacts.read(olmo2), "m", "prefill", "v", "w")
    assert (info.architecture, info.implementation) == ("Olmo2ForCausalLM", "transformers")
    llama = _engine(save_tiny_llama(tmp_path / "llama"))
    assert EngineFacts.read(llama).implementation == "tandem"
    assert implementation_of("LlamaForCausalLM") == "tandem"
    assert family_of("GraniteForCausalLM").name == "transformers"


def test_new_weights_load_in_place(tmp_path: Path) -> None:
    """UpdateWeights' path: other weights of the same shapes replace the served ones (the rotary buffers
    transformers derives are rebuilt, not left as they were) and the engine computes with them."""
    engine = _engine(save_tiny_granite(tmp_path / "a", seed=0))
    other = save_tiny_granite(tmp_path / "b", seed=1)
    engine.update_weights(open_checkpoint(str(other)))
    prompt = list(range(3, 20))
    engine.add_request(Request("r", prompt, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)))
    assert _run_to_end(engine) == hf_greedy(load_hf_dir(other), prompt, 8)


def test_unknown_architecture_and_quantized_engine_are_config_errors(tmp_path: Path) -> None:
    directory = save_tiny_olmo2(tmp_path / "olmo2")
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    with pytest.raises(ConfigError, match="float weights only .quantization none., not quantization .q8_0."):
        _engine(directory, quantization="q8_0")
    for architecture, message in (
        ("NoSuchModelForCausalLM", "transformers has no such \\*ForCausalLM class"),
        ("Olmo2ForTokenClassification", "transformers has no such"),
        ("GraniteForCausalLM", "model_type 'olmo2' is not GraniteForCausalLM's"),
    ):
        config_path.write_text(json.dumps({**config, "architectures": [architecture]}))
        with pytest.raises(ConfigError, match=message):
            open_checkpoint(str(directory))
    config_path.write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    with pytest.raises(ConfigError, match="MambaForCausalLM does not take transformers' attention functions"):
        open_checkpoint(str(directory))


def test_an_attention_argument_the_backends_cannot_apply_is_refused_at_start_up(tmp_path: Path) -> None:
    """GPT-OSS's layers pass attention sinks (`s_aux`), which no backend applies: the engine refuses the
    checkpoint while it loads, naming the layer and the argument, not at the first request's step."""
    directory = save_tiny_gpt_oss(tmp_path / "gpt_oss")
    with pytest.raises(ConfigError, match="^GptOssForCausalLM cannot run on Tandem's paged attention: "
                                          "GptOssAttention passes 's_aux'"):
        _engine(directory)


def test_prefill_worker_pages_carry_on_in_a_decode_worker(tmp_path: Path) -> None:
    """The gateway's handoff over real in-process workers (KV over a local transport) gives the tokens
    one engine gives, and both workers report the transformers implementation."""
    model_path = save_tiny_olmo2(tmp_path / "olmo2")
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    num_tokens = 10

    async def handed_off() -> list[int]:
        async with running_workers(model_path) as workers:
            pool = WorkerPool((workers.prefill.address,), (workers.decode.address,))
            config = GatewayConfig(
                str(model_path),
                "tiny",
                (workers.prefill.address,),
                (workers.decode.address,),
                data_dir="unused",
                stall_timeout_s=10.0,
            )
            try:
                await pool.probe_all()
                assert [w.info.implementation for w in pool.all_workers() if w.info] == ["transformers"] * 2
                sampling = SamplingSpec(temperature=0.0, max_new_tokens=num_tokens, ignore_eos=True)
                events = run_handoff(pool, config, GatewayMetrics(), "h1", prompt, sampling)
                return [token.token_id async for event in events for token in event.tokens]
            finally:
                await pool.close()

    tokens = asyncio.run(handed_off())
    engine = _engine(model_path)
    engine.add_request(
        Request("whole", prompt, SamplingParams(temperature=0, max_new_tokens=num_tokens, ignore_eos=True))
    )
    assert tokens == _run_to_end(engine) == hf_greedy(load_hf_dir(model_path), prompt, num_tokens)
