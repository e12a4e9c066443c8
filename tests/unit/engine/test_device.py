"""The device plumbing: with `EngineConfig.device="meta"` the weights, the KV pool and every per-step
tensor must be on the meta device, where mixing in a CPU tensor raises. So a tensor created on the
wrong device anywhere in a forward pass (model, rotary, attention, forward batch) fails these tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ConfigError, EngineConfig
from engine.embedder import load_embedder
from engine.engine import Engine
from engine.pooling import PoolingConfig, PoolingMode, pool
from engine.request import Request, SamplingParams
from engine.runner import ModelRunner
from engine.weights import open_checkpoint
from tests.tiny_models import save_tiny_llama

PAGE_SIZE = 4
META = torch.device("meta")
TINY = dict(vocab_size=256, hidden_size=64)   # tests/tiny_models.py's sizes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), tie_word_embeddings=True)


def _meta_config(**overrides) -> EngineConfig:
    settings = dict(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=64, device="meta",
                    quantization="none", attention_backend="torch", sampling_backend="torch")
    settings.update(overrides)
    return EngineConfig(**settings)


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(open_checkpoint(str(model_dir)), _meta_config(), context_len=128, progress=False)


def test_the_runner_puts_weights_pool_and_tables_on_the_device(runner: ModelRunner) -> None:
    assert {p.device for p in runner.model.parameters()} == {META}
    assert runner.kv_pool.device == META and runner.kv_pool.tensor.dtype == torch.float32
    assert runner.rotary.cos.device == META and runner.rotary.sin.device == META
    assert runner.expert_recorder._totals.device == META
    assert runner.attention.device == META and runner.attention.dtype == torch.float32
    assert runner.sampler.device == META
    assert not runner._pin   # pinned host memory only for a CUDA device


def test_a_prefill_and_a_decode_step_run_entirely_on_the_device(runner: ModelRunner) -> None:
    # two prompts that cross page boundaries, one resumed after a first chunk, then a decode step
    first = Request("a", list(range(3, 12)), SamplingParams(), page_ids=[0, 1, 2])
    second = Request("b", [5, 6, 7, 8, 9, 10], SamplingParams(), page_ids=[3, 4], num_computed=2)
    logits = runner.forward_logits([first, second], [9, 4])
    assert logits.device == META
    assert logits.shape == (2, TINY["vocab_size"]) and logits.dtype == torch.float32

    first.num_computed, first.output_ids = first.prompt_len, [42]
    second.num_computed, second.output_ids = second.prompt_len, [17]
    logits = runner.forward_logits([first, second])
    assert logits.device == META and logits.shape == (2, TINY["vocab_size"])


def test_the_backend_plans_once_from_host_metadata_and_the_model_gets_device_inputs(
        runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU index tensors would pass unnoticed on meta (indexing accepts them), so what the backend
    and the model receive is checked directly."""
    planned, calls = [], []
    monkeypatch.setattr(runner.attention, "plan", planned.append)
    hook = runner.model.register_forward_pre_hook(lambda module, args: calls.append(args))
    try:
        runner.forward_logits([Request("c", [1, 2, 3, 4, 5], SamplingParams(), page_ids=[5, 6])])
    finally:
        hook.remove()
    assert len(planned) == 1 and planned[0].qo_indptr.device.type == "cpu"
    assert planned[0].query_lens == (5,) and planned[0].seq_lens == (5,)
    batch, _, _, kv_pool = calls[0]
    meta = batch.meta
    step_tensors = [batch.input_ids, batch.positions, batch.logit_rows, kv_pool, meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                    meta.kv_last_page_len, meta.write_pages, meta.write_offsets]
    assert [t.device for t in step_tensors] == [META] * len(step_tensors)
    assert meta.query_lens == (5,) and meta.seq_lens == (5,)


def test_a_decoder_embedder_computes_on_the_device(model_dir: Path) -> None:
    embedder = load_embedder(str(model_dir), _meta_config(), progress=False)
    hidden = embedder.encoder.hidden_states([[1, 2, 3, 4, 5], [6, 7]])
    assert hidden.device == META and hidden.shape == (7, TINY["hidden_size"])
    pooled = pool(hidden, [5, 2], PoolingConfig(PoolingMode.MEAN, normalize=True))
    assert pooled.device == META and pooled.shape == (2, TINY["hidden_size"])


@pytest.mark.parametrize("device", ["cpu", "meta", "cuda", "cuda:1"])
def test_engine_config_accepts_cpu_cuda_and_meta(device: str) -> None:
    assert EngineConfig(device=device).device == device


@pytest.mark.parametrize("device", ["auto", "nvidia", "cuda:", "cuda:x", "CPU", ""])
def test_engine_config_refuses_other_device_names(device: str) -> None:
    with pytest.raises(ConfigError, match="device must be"):
        EngineConfig(device=device)


@pytest.mark.parametrize("quantization", ["gguf", "q8_0", "q4_0", "q4_1"])
def test_quantized_weights_are_refused_off_the_cpu(quantization: str) -> None:
    assert EngineConfig(device="cpu", quantization=quantization).quantization == quantization
    with pytest.raises(ConfigError, match="CPU kernel"):
        EngineConfig(device="cuda", quantization=quantization)


@pytest.mark.gpu
def test_a_cuda_runner_pins_its_forward_batch_and_matches_the_cpu(model_dir: Path) -> None:
    checkpoint = open_checkpoint(str(model_dir))
    cpu = ModelRunner(checkpoint, _meta_config(device="cpu"), context_len=128, progress=False)
    cuda = ModelRunner(checkpoint, _meta_config(device="cuda"), context_len=128, progress=False)
    assert cuda._pin
    requests = lambda: [Request("a", list(range(3, 12)), SamplingParams(), page_ids=[0, 1, 2])]   # noqa: E731
    expected = cpu.forward_logits(requests())
    got = cuda.forward_logits(requests())
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_greedy_generation_on_cuda_equals_the_cpu_fp32_engine(model_dir: Path) -> None:
    def generate(device: str) -> list[int]:
        config = _meta_config(device=device, max_total_tokens=128, attention_backend="auto", sampling_backend="auto")
        engine = Engine(open_checkpoint(str(model_dir)), config, progress=False)
        engine.add_request(Request("g", [3, 17, 42, 99, 5, 61, 7], SamplingParams(temperature=0.0, ignore_eos=True,
                                                                                 max_new_tokens=24)))
        tokens: list[int] = []
        while engine.has_work:
            tokens += [out.token_id for out in engine.step() if out.token_id is not None]
        return tokens
    assert generate("cuda") == generate("cpu")


@pytest.mark.gpu
def test_ngram_speculation_on_cuda_keeps_greedy_tokens_and_verifies_sampled_drafts(model_dir: Path) -> None:
    """n-gram drafts verified on CUDA (sampled ones by FlashInfer's chain speculative sampling where it is
    installed): greedy tokens equal those of decoding without drafts, and a sampled request gets all its
    tokens with its drafts verified."""
    def generate(speculative: bool, temperature: float) -> tuple[list[int], int]:
        drafts = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=4, speculative_draft_policy="always")
        config = _meta_config(device="cuda", max_total_tokens=256, attention_backend="auto", sampling_backend="auto",
                              **(drafts if speculative else {}))
        engine = Engine(open_checkpoint(str(model_dir)), config, progress=False)
        sampling = SamplingParams(temperature=temperature, ignore_eos=True, max_new_tokens=32)
        engine.add_request(Request("s", [3, 17, 42, 99, 5, 61, 7] * 4, sampling))   # repeats: lookups find drafts
        tokens: list[int] = []
        verified = 0
        while engine.has_work:
            for out in engine.step():
                tokens += [out.token_id] if out.token_id is not None else []
                verified = max(verified, out.spec_verify_ct)
        return tokens, verified
    greedy, verified = generate(True, 0.0)
    assert verified > 0 and greedy == generate(False, 0.0)[0]
    sampled, verified = generate(True, 0.8)
    assert verified > 0 and len(sampled) == 32 and all(0 <= t < TINY["vocab_size"] for t in sampled)


@pytest.mark.gpu
def test_a_draft_model_on_cuda_keeps_greedy_tokens_and_has_its_drafts_accepted(model_dir: Path) -> None:
    """The model drafting for itself on CUDA (its own KV pool and attention plan there): the greedy
    tokens are those of decoding without drafts, and nearly every draft is accepted."""
    def generate(draft: bool) -> tuple[list[int], int, int]:
        drafts = dict(speculative_algorithm="draft", speculative_num_draft_tokens=3, speculative_draft_policy="always")
        config = _meta_config(device="cuda", max_total_tokens=256, attention_backend="auto", sampling_backend="auto",
                              **(drafts if draft else {}))
        checkpoint = open_checkpoint(str(model_dir))
        engine = Engine(checkpoint, config, progress=False, draft=checkpoint if draft else None)
        engine.add_request(Request("d", [3, 17, 42, 99, 5, 61, 7], SamplingParams(temperature=0.0, ignore_eos=True,
                                                                                 max_new_tokens=32)))
        tokens: list[int] = []
        while engine.has_work:
            tokens += [out.token_id for out in engine.step() if out.token_id is not None]
        return tokens, engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_tokens
    tokens, num_drafts, num_accepted = generate(True)
    assert tokens == generate(False)[0]
    assert num_drafts > 0 and num_accepted >= 0.9 * num_drafts


def test_a_kv_pool_in_another_dtype_than_the_model_is_cpu_only() -> None:
    assert EngineConfig(device="cpu", dtype="float32", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    assert EngineConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="CPU only"):
        EngineConfig(device="cuda", dtype="float32", kv_cache_dtype="bfloat16")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="int8")
