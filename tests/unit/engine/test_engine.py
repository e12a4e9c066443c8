"""Tests for engine.engine on a tiny random Llama: generation, stops, limits, abort, reserve/admit,
prefill-only hand-off, KV exhaustion, seeded sampling, and agreement with transformers."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import CapacityError, ContextLengthExceededError, InvalidRequestError, RequestNotFoundError
from engine.kv_connector import KVConnector
from engine.page_allocator import pages_needed
from engine.request import FinishReason, Request, SamplingParams, StepOutput
from engine.runner import FaultHooks
from engine.weights import open_checkpoint
from kv_transfer import KVTransferError
from tests.local_handoff import LocalHandoff, confirm, take_kv_in
from tests.tiny_models import save_tiny_llama

PAGE_SIZE = 4
GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPT_A = [3, 17, 42, 99, 5, 61, 7, 200, 31]
PROMPT_B = [11, 250, 9, 128, 77]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _engine(model_dir: Path, **overrides) -> Engine:
    """An engine that also takes reservations, as a decode worker's does (a KVReceiveConnector)."""
    config = dict(dtype="float32", page_size=PAGE_SIZE, max_total_tokens=64)
    config.update(overrides)
    engine = Engine(open_checkpoint(str(model_dir)), EngineConfig(**config), progress=False)
    take_kv_in(engine)
    return engine


def _run(engine: Engine, max_steps: int = 500) -> dict[str, list[StepOutput]]:
    """Step until the engine is idle; outputs grouped by request id, in order."""
    outputs: dict[str, list[StepOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def _tokens(outputs: list[StepOutput]) -> list[int]:
    return [out.token_id for out in outputs if out.token_id is not None]


def _generate(engine: Engine, prompt: list[int], request_id: str = "r", **sampling) -> list[StepOutput]:
    engine.add_request(Request(request_id, list(prompt), SamplingParams(**sampling)))
    return _run(engine)[request_id]


def _assert_idle(engine: Engine) -> None:
    assert not engine.has_work
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_generates_max_new_tokens_and_frees_every_page(model_dir: Path) -> None:
    engine = _engine(model_dir)
    outputs = _generate(engine, PROMPT_A, max_new_tokens=12, **GREEDY)
    assert len(_tokens(outputs)) == 12 and len(outputs) == 12
    assert all(out.finish_reason is None for out in outputs[:-1])
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert all(out.logprob is not None and out.logprob <= 0 for out in outputs)
    assert all(0 <= t < 256 for t in _tokens(outputs))
    _assert_idle(engine)
    assert not engine.holds("r")


def test_greedy_tokens_and_logprobs_match_transformers(model_dir: Path) -> None:
    """Two prompts of different lengths decoded in one batch across several pages."""
    engine = _engine(model_dir)
    engine.add_request(Request("a", PROMPT_A, SamplingParams(max_new_tokens=10, **GREEDY)))
    engine.add_request(Request("b", PROMPT_B, SamplingParams(max_new_tokens=10, **GREEDY)))
    outputs = _run(engine)
    reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for request_id, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        tokens = _tokens(outputs[request_id])
        logprobs = torch.tensor([out.logprob for out in outputs[request_id]])
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # rows predicting each token
        chosen = expected.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(chosen, expected.max(dim=-1).values, atol=1e-4, rtol=0)  # greedy
        torch.testing.assert_close(logprobs, chosen, atol=1e-4, rtol=1e-4)
    _assert_idle(engine)


def test_batched_decode_matches_decoding_alone(model_dir: Path) -> None:
    alone = {rid: _tokens(_generate(_engine(model_dir), prompt, rid, max_new_tokens=8, **GREEDY))
             for rid, prompt in (("a", PROMPT_A), ("b", PROMPT_B))}
    engine = _engine(model_dir)
    engine.add_request(Request("a", PROMPT_A, SamplingParams(max_new_tokens=8, **GREEDY)))
    first_a = engine.step()  # "a" prefills alone; "b" joins later, so their decode steps are offset
    engine.add_request(Request("b", PROMPT_B, SamplingParams(max_new_tokens=8, **GREEDY)))
    together = _run(engine)
    assert _tokens(first_a + together["a"]) == alone["a"]
    assert _tokens(together["b"]) == alone["b"]
    _assert_idle(engine)


def _first_new_token_after(tokens: list[int], start: int) -> tuple[int, int]:
    """(index, token) of the first token at or after `start` that does not occur earlier."""
    for index in range(start, len(tokens)):
        if tokens[index] not in tokens[:index]:
            return index, tokens[index]
    raise AssertionError(f"every token from {start} on repeats an earlier one: {tokens}")


def test_stop_token_id_ends_generation(model_dir: Path) -> None:
    engine = _engine(model_dir)
    free_run = _tokens(_generate(engine, PROMPT_A, "free", max_new_tokens=12, **GREEDY))
    index, stop_id = _first_new_token_after(free_run, 2)
    outputs = _generate(engine, PROMPT_A, "stopped", max_new_tokens=12, stop_token_ids=(stop_id,), **GREEDY)
    assert _tokens(outputs) == free_run[:index + 1]  # the stop token itself is emitted
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert outputs[-1].matched_token_id == stop_id
    _assert_idle(engine)


def test_eos_stops_unless_ignore_eos(model_dir: Path, tmp_path: Path) -> None:
    free_run = _tokens(_generate(_engine(model_dir), PROMPT_A, max_new_tokens=12, **GREEDY))
    index, eos_id = _first_new_token_after(free_run, 2)
    # Same weights, but the config names the token the model emits as an eos id.
    eos_dir = tmp_path / "eos"
    eos_dir.mkdir()
    for path in model_dir.iterdir():
        (eos_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    config["eos_token_id"] = [255 if eos_id != 255 else 254, eos_id]
    (eos_dir / "config.json").write_text(json.dumps(config))
    engine = _engine(eos_dir)
    assert eos_id in engine.eos_token_ids

    stopped = _generate(engine, PROMPT_A, "eos", max_new_tokens=12, temperature=0.0)
    assert _tokens(stopped) == free_run[:index + 1]
    assert stopped[-1].finish_reason is FinishReason.STOP and stopped[-1].matched_token_id == eos_id

    ignored = _generate(engine, PROMPT_A, "ignore", max_new_tokens=12, **GREEDY)
    assert _tokens(ignored) == free_run
    assert ignored[-1].finish_reason is FinishReason.LENGTH and ignored[-1].matched_token_id is None

    # stop_token_ids still stop when eos is ignored
    both = _generate(engine, PROMPT_A, "both", max_new_tokens=12, stop_token_ids=(eos_id,), **GREEDY)
    assert both[-1].finish_reason is FinishReason.STOP and len(both) == index + 1
    _assert_idle(engine)


def test_prompt_of_context_len_tokens_is_rejected(model_dir: Path) -> None:
    engine = _engine(model_dir)
    assert engine.context_len == 128
    with pytest.raises(ContextLengthExceededError):
        engine.add_request(Request("r", [1] * engine.context_len, SamplingParams()))
    assert not engine.has_work and not engine.holds("r")


def test_generation_stops_at_the_context_length(model_dir: Path) -> None:
    engine = _engine(model_dir, context_len=12)
    assert engine.context_len == 12
    outputs = _generate(engine, list(range(10)), max_new_tokens=50, **GREEDY)
    assert len(_tokens(outputs)) == 2  # 10 + 2 == context_len
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    with pytest.raises(ContextLengthExceededError):
        engine.add_request(Request("long", list(range(12)), SamplingParams()))
    with pytest.raises(ContextLengthExceededError):
        engine.reserve("res", prompt_len=12)
    _assert_idle(engine)


@pytest.mark.parametrize("prompt", [[], [256], [3, -1], [5, 1000, 7]])
def test_empty_prompt_or_token_outside_vocab_is_invalid(model_dir: Path, prompt: list[int]) -> None:
    engine = _engine(model_dir)
    with pytest.raises(InvalidRequestError):
        engine.add_request(Request("r", prompt, SamplingParams()))
    assert not engine.has_work and not engine.holds("r")


def test_prompt_larger_than_the_pool_is_a_capacity_error(model_dir: Path) -> None:
    engine = _engine(model_dir)  # 16 pages of 4 tokens
    with pytest.raises(CapacityError):
        engine.add_request(Request("r", [1] * 65, SamplingParams()))
    assert not engine.has_work


def test_duplicate_request_id_is_rejected(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.add_request(Request("dup", PROMPT_A, SamplingParams(max_new_tokens=3, **GREEDY)))
    with pytest.raises(InvalidRequestError):
        engine.add_request(Request("dup", PROMPT_B, SamplingParams()))
    with pytest.raises(InvalidRequestError):
        engine.reserve("dup", prompt_len=4)
    outputs = _run(engine)
    assert len(_tokens(outputs["dup"])) == 3
    _assert_idle(engine)


def test_an_engine_whose_connector_takes_no_kv_in_refuses_reservations_before_taking_a_page(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.kv_connector = KVConnector()   # a prefill worker's kind: it sends KV, it takes none in
    engine.add_request(Request("running", PROMPT_A, SamplingParams(max_new_tokens=40, **GREEDY), priority=5))
    engine.step()
    used = engine.allocator.num_used
    with pytest.raises(InvalidRequestError, match="takes no KV"):
        engine.reserve("r", prompt_len=64 - 4, priority=0)   # would preempt "running" for its pages
    assert engine.allocator.num_used == used and not engine.holds("r") and not engine.scheduler.has_resuming


def test_reserved_id_cannot_be_reused_by_a_prompt(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.reserve("res", prompt_len=4)
    with pytest.raises(InvalidRequestError):
        engine.add_request(Request("res", PROMPT_B, SamplingParams()))
    with pytest.raises(InvalidRequestError):
        engine.reserve("res", prompt_len=4)
    assert not engine.has_work and engine.allocator.num_used == 1


def test_abort_running_request_frees_its_pages(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.add_request(Request("r", PROMPT_A, SamplingParams(max_new_tokens=30, **GREEDY)))
    engine.step()
    engine.step()
    assert engine.allocator.num_used == pages_needed(len(PROMPT_A) + 1, PAGE_SIZE)
    out = engine.abort("r", "client disconnected")
    assert out == StepOutput("r", None, None, FinishReason.ABORT, abort_message="client disconnected")
    _assert_idle(engine)
    assert engine.step() == []
    assert engine.abort("r") is None and engine.abort("never-seen") is None


def test_abort_waiting_request(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.add_request(Request("w", PROMPT_B, SamplingParams()))
    out = engine.abort("w")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert engine.step() == []
    _assert_idle(engine)


def test_reserve_then_admit_decodes_from_transferred_kv(model_dir: Path) -> None:
    """Prefill-only on one engine, whose KV connector writes its pages into another engine's
    reservation, decode there: the tokens equal a single-engine run."""
    expected = _tokens(_generate(_engine(model_dir), PROMPT_A, max_new_tokens=8, **GREEDY))

    prefill, decode = _engine(model_dir), _engine(model_dir)
    decode.allocator.allocate(3)  # so the reserved page ids differ from the prefill engine's
    page_ids = decode.reserve("r", prompt_len=len(PROMPT_A)).page_ids
    assert len(page_ids) == pages_needed(len(PROMPT_A), PAGE_SIZE) and decode.holds("r")
    assert decode.allocator.num_used == 3 + len(page_ids)
    with LocalHandoff(prefill, decode) as handoff:
        send = handoff.target(page_ids)
        prefill.add_request(Request("r", PROMPT_A, SamplingParams(max_new_tokens=8, **GREEDY),
                                    is_prefill_only=True, kv_params=send))
        [first] = prefill.step()
        assert first.token_id == expected[0] and first.finish_reason is None
        assert send.written.result(timeout=10).num_bytes == len(page_ids) * decode.runner.layout.page_bytes
        assert prefill.poll_kv() == ["r"]
    _assert_idle(prefill)

    assert confirm(decode, "r", PROMPT_A, first.token_id, first.logprob,
                   SamplingParams(max_new_tokens=8, **GREEDY)) is None
    outputs = _run(decode)["r"]
    assert [first.token_id] + _tokens(outputs) == expected
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert decode.allocator.num_used == 3 and not decode.holds("r")


def test_confirmation_errors_keep_or_lack_the_reservation(model_dir: Path) -> None:
    engine = _engine(model_dir)
    with pytest.raises(RequestNotFoundError):
        confirm(engine, "unknown", PROMPT_B, 1, -0.5, SamplingParams())
    engine.reserve("r", prompt_len=len(PROMPT_B))
    with pytest.raises(InvalidRequestError):
        confirm(engine, "r", PROMPT_B + [1], 1, -0.5, SamplingParams())
    with pytest.raises(InvalidRequestError):
        confirm(engine, "r", PROMPT_B, 256, -0.5, SamplingParams())  # first token outside vocab
    assert engine.holds("r") and engine.allocator.num_used == pages_needed(len(PROMPT_B), PAGE_SIZE)
    assert engine.abort("r") is None  # dropping a reservation returns no output
    _assert_idle(engine)
    assert not engine.holds("r")


@pytest.mark.parametrize(("sampling", "reason"), [
    (dict(max_new_tokens=1), FinishReason.LENGTH),
    (dict(max_new_tokens=5, stop_token_ids=(7,)), FinishReason.STOP),
])
def test_a_confirmation_whose_first_token_finishes(model_dir: Path, sampling: dict, reason: FinishReason) -> None:
    engine = _engine(model_dir)
    engine.reserve("r", prompt_len=len(PROMPT_B))
    out = confirm(engine, "r", PROMPT_B, 7, -0.25, SamplingParams(**sampling))
    assert out is not None and out.finish_reason is reason and out.token_id is None
    assert out.matched_token_id == (7 if reason is FinishReason.STOP else None)
    _assert_idle(engine)
    assert not engine.holds("r")


def test_reservations_past_their_ttl_are_dropped_by_poll_kv(model_dir: Path) -> None:
    engine, now = _engine(model_dir), [0.0]
    take_kv_in(engine, ttl_s=1.0, clock=lambda: now[0])
    engine.reserve("short", prompt_len=5)
    now[0] = 0.5
    engine.reserve("long", prompt_len=9)
    assert engine.allocator.num_used == 2 + 3 and engine.num_receiving == 2
    assert engine.poll_kv() == []
    now[0] = 1.2
    assert engine.poll_kv() == ["short"]
    assert engine.allocator.num_used == 3 and not engine.holds("short") and engine.holds("long")
    with pytest.raises(RequestNotFoundError):
        confirm(engine, "short", [1] * 5, 1, -1.0, SamplingParams())
    now[0] = 200.0
    assert engine.poll_kv() == ["long"] and engine.poll_kv() == []
    _assert_idle(engine)


def test_prefill_only_request_keeps_its_pages_while_the_connector_sends_them(model_dir: Path) -> None:
    prefill, decode = _engine(model_dir), _engine(model_dir)
    with LocalHandoff(prefill, decode) as handoff:
        dst = decode.allocator.allocate(pages_needed(len(PROMPT_A), PAGE_SIZE))
        send = handoff.target(dst)
        expired = dataclasses.replace(send, expires_unix_ms=0, written=concurrent.futures.Future())
        prefill.add_request(Request("p", PROMPT_A, SamplingParams(max_new_tokens=50, **GREEDY),
                                    is_prefill_only=True, kv_params=send))
        outputs = prefill.step()
        assert len(outputs) == 1 and outputs[0].token_id is not None and outputs[0].logprob is not None
        assert not prefill.has_work and prefill.holds("p") and prefill.stats().num_sending == 1
        assert prefill.allocator.num_used == len(dst) and send.written.done()
        with pytest.raises(InvalidRequestError):  # the id stays taken while its KV is held
            prefill.add_request(Request("p", PROMPT_B, SamplingParams()))
        assert prefill.abort("p") is None and prefill.allocator.num_used == len(dst)  # the send owns them
        assert prefill.step() == [] and not prefill.holds("p")  # each step polls the connector first
        _assert_idle(prefill)

        # a grant that expired while the prompt ran: no write, the error, and the pages back
        prefill.add_request(Request("late", PROMPT_A, SamplingParams(**GREEDY), is_prefill_only=True,
                                    kv_params=expired))
        prefill.step()
        with pytest.raises(KVTransferError, match="expired before the prompt's KV was ready"):
            expired.written.result(timeout=1)
        assert prefill.poll_kv() == ["late"]
        _assert_idle(prefill)


def test_prefill_only_request_without_a_connector_frees_its_pages(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.add_request(Request("p", PROMPT_A, SamplingParams(**GREEDY), is_prefill_only=True))
    [out] = engine.step()
    assert out.token_id is not None and not engine.holds("p")
    _assert_idle(engine)


def test_abort_of_a_running_prefill_only_request_frees_its_pages(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.add_request(Request("p", PROMPT_B, SamplingParams(), is_prefill_only=True))
    assert engine.allocator.num_used == 0
    out = engine.abort("p")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    _assert_idle(engine)


def test_kv_exhaustion_preempts_the_newest_request_and_its_greedy_output_is_unchanged(model_dir: Path) -> None:
    engine = _engine(model_dir)  # 16 pages; three requests of 8 + 20 tokens need 7 pages each
    for rid in ("r0", "r1", "r2"):
        engine.add_request(Request(rid, PROMPT_A[:8], SamplingParams(max_new_tokens=20, **GREEDY)))
    outputs = _run(engine)
    assert engine.scheduler.num_preemptions >= 1
    alone = _tokens(_generate(_engine(model_dir), PROMPT_A[:8], "alone", max_new_tokens=20, **GREEDY))
    for rid in ("r0", "r1", "r2"):   # the preempted one was recomputed and went on as if never paused
        assert _tokens(outputs[rid]) == alone, rid
        assert outputs[rid][-1].finish_reason is FinishReason.LENGTH
    _assert_idle(engine)
    assert not any(engine.holds(rid) for rid in ("r0", "r1", "r2"))


def test_a_request_that_could_never_fit_the_pool_is_aborted_saying_why(model_dir: Path) -> None:
    engine = _engine(model_dir)  # 16 pages of 4 tokens: 64 tokens in all
    engine.add_request(Request("long", PROMPT_A[:8], SamplingParams(max_new_tokens=80, **GREEDY)))
    last = _run(engine)["long"][-1]
    assert last.finish_reason is FinishReason.ABORT and last.token_id is None
    assert "more than the pool's 16" in last.abort_message
    _assert_idle(engine)


def test_same_seed_gives_same_tokens_wherever_it_runs(model_dir: Path) -> None:
    sampling = dict(temperature=1.0, seed=1234, max_new_tokens=10, ignore_eos=True)
    engine = _engine(model_dir)
    engine.add_request(Request("x", PROMPT_A, SamplingParams(**sampling)))
    engine.add_request(Request("other", PROMPT_B, SamplingParams(temperature=1.0, max_new_tokens=4)))
    engine.add_request(Request("y", PROMPT_A, SamplingParams(**sampling)))
    batched = _run(engine)
    alone = _tokens(_generate(_engine(model_dir), PROMPT_A, "z", **sampling))
    assert _tokens(batched["x"]) == _tokens(batched["y"]) == alone
    _assert_idle(engine)


def test_different_seeds_give_different_tokens(model_dir: Path) -> None:
    engine = _engine(model_dir)
    for seed in (1, 2, 3):
        engine.add_request(Request(f"s{seed}", PROMPT_A, SamplingParams(temperature=1.0, seed=seed,
                                                                        max_new_tokens=10, ignore_eos=True)))
    runs = {rid: tuple(_tokens(outs)) for rid, outs in _run(engine).items()}
    assert len(set(runs.values())) == 3
    greedy = tuple(_tokens(_generate(engine, PROMPT_A, "g", max_new_tokens=10, **GREEDY)))
    assert greedy not in runs.values()
    _assert_idle(engine)


def test_a_kept_reservation_outlives_its_first_ttl(model_dir: Path) -> None:
    engine, now = _engine(model_dir), [0.0]
    receiver = take_kv_in(engine, ttl_s=30.0, clock=lambda: now[0])
    engine.reserve("slow-grammar", len(PROMPT_A))
    now[0] = 20.0
    receiver.keep("slow-grammar")                 # its Generate is compiling a grammar
    now[0] = 40.0
    assert engine.poll_kv() == [] and engine.holds("slow-grammar")
    receiver.keep("unknown")                      # nothing to keep: no error
    now[0] = 50.0
    assert engine.poll_kv() == ["slow-grammar"]
    _assert_idle(engine)


def test_non_finite_logits_fail_that_request_alone(model_dir: Path) -> None:
    """A request whose logits come out NaN ends with FinishReason.ERROR and its pages freed; the
    request batched with it decodes on, token for token as it would alone."""
    alone = _tokens(_generate(_engine(model_dir), PROMPT_B, max_new_tokens=8, **GREEDY))
    engine = Engine(open_checkpoint(str(model_dir)), EngineConfig(dtype="float32", page_size=PAGE_SIZE,
                                                                  max_total_tokens=64),
                    progress=False, faults=FaultHooks(nan_logits_seed=7))
    engine.add_request(Request("bad", PROMPT_A, SamplingParams(max_new_tokens=8, seed=7, **GREEDY)))
    engine.add_request(Request("good", PROMPT_B, SamplingParams(max_new_tokens=8, **GREEDY)))
    outputs = _run(engine)
    [failed] = outputs["bad"]
    assert failed.finish_reason is FinishReason.ERROR and failed.token_id is None
    assert "non-finite logits" in failed.abort_message
    assert _tokens(outputs["good"]) == alone and outputs["good"][-1].finish_reason is FinishReason.LENGTH
    _assert_idle(engine)
    assert not engine.holds("bad")


def test_a_float16_kv_pool_under_float32_rows_takes_the_torch_code_on_cpu(model_dir: Path) -> None:
    """The C++ kernels take float32 and bfloat16 pools only: with a float16 pool, rotary's KV store,
    attention and the fused layer all decline it, so the `cpu` backend gives what the `torch` one does
    (it used to stop at the first KV store)."""
    sampling = SamplingParams(max_new_tokens=6, **GREEDY)
    tokens = {}
    for backend in ("cpu", "torch"):
        engine = _engine(model_dir, kv_cache_dtype="float16", quantization="q8_0", attention_backend=backend)
        assert not any(layer.fused for layer in engine.runner.model.model.layers)
        engine.add_request(Request("r", PROMPT_A, sampling))
        tokens[backend] = _tokens(_run(engine)["r"])
    assert len(tokens["cpu"]) == 6 and tokens["cpu"] == tokens["torch"]
    fused = _engine(model_dir, kv_cache_dtype="bfloat16", quantization="q8_0")
    assert all(layer.fused for layer in fused.runner.model.model.layers)


def test_a_better_reservation_preempts_a_worse_running_request_which_comes_back_unchanged(model_dir: Path) -> None:
    engine = _engine(model_dir)  # 16 pages
    for rid in ("low_old", "low_new"):
        engine.add_request(Request(rid, PROMPT_A[:8], SamplingParams(max_new_tokens=20, **GREEDY), priority=1))
    outputs: dict[str, list[StepOutput]] = {}
    for _ in range(4):               # the prefill and three decode steps
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    free = engine.allocator.num_free
    prompt_len = (free + 1) * PAGE_SIZE          # one page more than is free
    with pytest.raises(CapacityError):
        engine.reserve("same", prompt_len, priority=1)
    assert engine.reserve("urgent", prompt_len, priority=0).page_ids
    assert [r.request_id for r in engine.scheduler.running] == ["low_old"] and engine.scheduler.has_resuming
    with pytest.raises(CapacityError):           # the paused one comes back before new ones of its priority
        engine.reserve("later", PAGE_SIZE, priority=1)
    engine.abort("urgent", write_settled=True)
    for rid, more in _run(engine).items():
        outputs.setdefault(rid, []).extend(more)
    alone = _tokens(_generate(_engine(model_dir), PROMPT_A[:8], "alone", max_new_tokens=20, **GREEDY))
    assert _tokens(outputs["low_old"]) == _tokens(outputs["low_new"]) == alone
    _assert_idle(engine)
