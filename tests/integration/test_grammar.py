"""Grammar-constrained decoding on SmolLM2: JSON schema, JSON object, regex, and across a handoff."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from tandem.sampling import GrammarKind, GrammarSpec
from engine.request import Request, SamplingParams
from engine.weights import open_checkpoint
from gateway.text.tokenizer import load_tokenizer
from tests.local_handoff import LocalHandoff, confirm, take_kv_in

# The population is bounded: unbounded, the bundled 4-bit model's greedy answer repeats "1" past any token
# limit, and a cut-off answer tests nothing; bounded, the grammar must also end the number in time.
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "population"], "additionalProperties": False}


@pytest.fixture(scope="module")
def setup(smollm2_path: Path):
    checkpoint = open_checkpoint(str(smollm2_path))
    return checkpoint, load_tokenizer(str(smollm2_path))


def _run(engine: Engine, rid: str, prompt: list[int], sampling: SamplingParams) -> list[int]:
    engine.add_request(Request(rid, prompt, sampling))
    tokens = []
    while engine.has_work:
        tokens += [o.token_id for o in engine.step() if o.token_id is not None]
    return tokens


def _engine(checkpoint) -> Engine:
    return Engine(checkpoint, EngineConfig(max_total_tokens=2048, quantization="gguf"), progress=False)


def test_json_schema_output_parses_and_matches_the_schema(setup) -> None:
    checkpoint, tokenizer = setup
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe Paris as JSON."}])
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    for temperature, seed in ((0.0, None), (1.0, 3)):
        tokens = _run(_engine(checkpoint), "j", prompt, SamplingParams(temperature=temperature, seed=seed,
                                                                       max_new_tokens=120, grammar=spec))
        value = json.loads(tokenizer.decode(tokens))
        assert set(value) == {"city", "population"}
        assert isinstance(value["city"], str) and isinstance(value["population"], int)
        assert 0 <= value["population"] <= 99999999


def test_regex_and_json_object(setup) -> None:
    checkpoint, tokenizer = setup
    engine = _engine(checkpoint)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Is the sky green?"}])
    answer = tokenizer.decode(_run(engine, "r", prompt, SamplingParams(
        temperature=0, max_new_tokens=10, grammar=GrammarSpec(GrammarKind.REGEX, "(yes|no)"))))
    assert answer in ("yes", "no")
    obj = tokenizer.decode(_run(engine, "o", prompt, SamplingParams(
        temperature=0, max_new_tokens=60, grammar=GrammarSpec(GrammarKind.JSON_OBJECT))))
    assert isinstance(json.loads(obj), dict)


def test_an_invalid_grammar_is_rejected_before_anything_runs(setup) -> None:
    checkpoint, _ = setup
    engine = _engine(checkpoint)
    with pytest.raises(InvalidRequestError, match="invalid regex"):
        engine.add_request(Request("bad", [1, 2, 3], SamplingParams(grammar=GrammarSpec(GrammarKind.REGEX, "(a|"))))
    assert not engine.has_work and engine.allocator.num_free == engine.allocator.num_pages


def test_a_handed_off_request_keeps_its_grammar(setup) -> None:
    checkpoint, tokenizer = setup
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe Rome as JSON."}])
    sampling = SamplingParams(temperature=0, max_new_tokens=80,
                              grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    whole = _run(_engine(checkpoint), "w", prompt, sampling)
    prefill, decode = _engine(checkpoint), _engine(checkpoint)
    take_kv_in(decode)
    pages = decode.reserve("h", len(prompt)).page_ids
    with LocalHandoff(prefill, decode) as handoff:  # the transfer, in-process
        send = handoff.target(pages)
        prefill.add_request(Request("h", prompt, sampling, is_prefill_only=True, kv_params=send))
        [first] = prefill.step()
        send.written.result(timeout=10)
    assert confirm(decode, "h", prompt, first.token_id, first.logprob, sampling) is None
    handed = [first.token_id]
    while decode.has_work:
        handed += [o.token_id for o in decode.step() if o.token_id is not None]
    assert handed == whole


def test_speculation_under_a_grammar_keeps_the_constrained_greedy_output(setup) -> None:
    """n-gram drafts a grammar refuses are cut before they run; the rest are verified against masked
    rows, so the constrained output is the same with speculation on and off, and drafts are accepted."""
    checkpoint, tokenizer = setup
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat after me: red blue green red blue "
                                                                        "green red blue green red blue green"}])
    spec = GrammarSpec(GrammarKind.REGEX, "((red|blue|green) ){6,12}(red|blue|green)")
    sampling = SamplingParams(temperature=0, max_new_tokens=40, grammar=spec)
    plain = _run(_engine(checkpoint), "p", prompt, sampling)
    speculative = Engine(checkpoint, EngineConfig(max_total_tokens=2048, quantization="gguf", speculative_algorithm="ngram",
                                                  speculative_draft_policy="always"), progress=False)
    assert _run(speculative, "s", prompt, sampling) == plain
    assert speculative.scheduler.num_accepted_tokens > 0
    words = tokenizer.decode(plain).split(" ")
    assert 7 <= len(words) <= 13 and set(words) <= {"red", "blue", "green"}
