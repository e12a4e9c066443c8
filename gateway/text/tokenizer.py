"""Tokenizer loading and the gateway's one wrapper around a Hugging Face tokenizer.

The gateway owns all text; every other process sees token ids only. This module turns a
model path into a :class:`Tokenizer` that encodes prompts, renders chat templates to ids,
decodes ids and knows which ids end a turn. It never reaches a hub. It imports no torch
itself, but transformers' AutoTokenizer does when torch is installed, so AutoTokenizer is
imported only when a tokenizer is loaded, never when this module is.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from tandem.converted_tokenizer import load_hf_tokenizer

logger = logging.getLogger(__name__)

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_GGUF_SUFFIX = ".gguf"
# Template arguments a request may not set: the names of Hugging Face's own apply_chat_template
# parameters (a custom `chat_template`, tokenizing, padding; the wrapper sets the rest itself) and
# the template's `messages`. Anything else (`enable_thinking`, `tools`, `documents`, ...) reaches
# the template as a variable.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_EOT_PROBE_CONTENT = "tandem-end-of-turn-probe"
_TEMPLATE_ERRORS = (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError)


class TokenizerError(ValueError):
    """A tokenizer could not be loaded, or a text/template operation on it failed."""


class Tokenizer:
    """Wraps one Hugging Face tokenizer; every id list it returns is a plain ``list[int]``.

    Decoding never applies ``clean_up_tokenization_spaces``: that post-processing cannot be
    done incrementally, and streamed and non-streamed outputs must agree exactly.
    Calls do not mutate the wrapped tokenizer, so one instance may serve many requests.
    """

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int] = ()) -> None:
        self._hf = hf_tokenizer
        self._eos_token_ids = _collect_eos_ids(hf_tokenizer, extra_eos_token_ids)

    @property
    def name_or_path(self) -> str:
        """The path the tokenizer was loaded from."""
        return str(self._hf.name_or_path)

    @property
    def vocab_size(self) -> int:
        """Number of ids this tokenizer can produce or decode, added tokens included."""
        return len(self._hf)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: eos, then the template's end-of-turn token if it differs."""
        return self._eos_token_ids

    @property
    def has_chat_template(self) -> bool:
        """Whether :meth:`apply_chat_template` can be used."""
        return bool(self._hf.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize ``text``; ``add_special_tokens`` adds the model's bos/eos decorations."""
        if not isinstance(text, str):
            raise TokenizerError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            return _as_id_list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        except TypeError:  # the Rust tokenizer takes only valid Unicode: a lone surrogate ends here
            raise TokenizerError(f"text is not valid Unicode: {unicode_problem(text)}") from None

    def encode_pair(self, text: str, text_pair: str) -> tuple[list[int], list[int] | None]:
        """A cross-encoder's input: the pair as the model's tokenizer joins it (BERT: `[CLS] a [SEP] b
        [SEP]`), and each token's segment when the tokenizer gives them (BERT: 0s then 1s), else None."""
        if not isinstance(text, str) or not isinstance(text_pair, str):
            raise TokenizerError("texts to encode must be str")
        try:
            encoded = self._hf(text, text_pair)
        except TypeError:
            raise TokenizerError(f"text is not valid Unicode: {unicode_problem(text + text_pair)}") from None
        types = encoded.get("token_type_ids")
        return _as_id_list(encoded["input_ids"]), None if types is None else _as_id_list(types)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """No token stands for more characters than this (its longest vocabulary string), so a text
        of `n` characters has at least `n / max_token_chars` tokens: a bound to check before encoding."""
        return max(1, max((len(token) for token in self._hf.get_vocab()), default=1))

    def template_uses(self, variable: str) -> bool:
        """Whether the chat template refers to `variable` (e.g. "tools")."""
        template = getattr(self._hf, "chat_template", None)
        if isinstance(template, dict):
            template = " ".join(template.values())
        return isinstance(template, str) and re.search(rf"\b{re.escape(variable)}\b", template) is not None

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        continue_final_message: bool = False,
    ) -> str:
        """Render ``messages`` with the model's chat template to text.

        ``template_kwargs`` (``tools``, ``documents``, ``enable_thinking``, ...) become template
        variables; ``continue_final_message`` leaves the last (assistant) message open.
        Raises TokenizerError if the model has no template, a key is reserved, or rendering fails.
        """
        if not self.has_chat_template:
            raise TokenizerError(
                f"tokenizer {self.name_or_path!r} has no chat template; "
                "send a raw prompt (completions API) instead of chat messages"
            )
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
        if reserved:
            raise TokenizerError(f"chat template arguments {sorted(reserved)} are reserved (set by the server)")
        try:
            rendered = self._hf.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except _TEMPLATE_ERRORS as exc:
            raise TokenizerError(f"chat template failed to render: {exc}") from exc
        if not isinstance(rendered, str):
            raise TokenizerError(f"chat template rendered {type(rendered).__name__}, not text")
        return rendered

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Render ``messages`` with the chat template and return the prompt's token ids.

        The rendered text is encoded without added special tokens, because templates write
        their own bos text (as Hugging Face does). Raises TokenizerError like
        :meth:`render_chat_template`.
        """
        text = self.render_chat_template(
            messages, add_generation_prompt, template_kwargs, continue_final_message=continue_final_message
        )
        return self.encode(text, add_special_tokens=False)

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """Decode ``ids`` to text; bytes that are not valid UTF-8 become U+FFFD.

        ``spaces_between_special_tokens=False`` (with special tokens kept) decodes the runs
        between special tokens on their own and joins everything with nothing in between, so a
        tokenizer that puts spaces around special tokens ("[CLS] hi [SEP]") gives "[CLS]hi[SEP]".
        Byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM2) add no such spaces: same text either way.
        """
        ids = list(ids)
        if spaces_between_special_tokens or skip_special_tokens:
            return self._decode(ids, skip_special_tokens)
        special = self._special_ids
        pieces: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in special:
                if run:
                    pieces.append(self._decode(run, False))
                    run = []
                pieces.append(self._decode([token_id], False))
            else:
                run.append(token_id)
        if run:
            pieces.append(self._decode(run, False))
        return "".join(pieces)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self._hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False))

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        """Special tokens: the named ones and every added token marked special."""
        added = getattr(self._hf, "added_tokens_decoder", {}) or {}
        return frozenset(self._hf.all_special_ids) | frozenset(
            i for i, t in added.items() if getattr(t, "special", False)
        )

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings (not decoded text) of ``ids``."""
        return [str(token) for token in self._hf.convert_ids_to_tokens(list(ids))]


def load_tokenizer(path: str) -> Tokenizer:
    """Load a tokenizer from local files only; never contacts a hub.

    ``path`` is a Hugging Face directory (``tokenizer.json`` or ``tokenizer_config.json``),
    a ``.gguf`` file, or a directory holding exactly one ``.gguf`` file. A directory's
    ``generation_config.json`` may add eos ids. Raises TokenizerError for anything else.
    """
    if os.path.isfile(path):
        if not path.endswith(_GGUF_SUFFIX):
            raise TokenizerError(f"{path!r} is a file but not a {_GGUF_SUFFIX} file")
        return Tokenizer(_from_pretrained(os.path.dirname(path) or ".", os.path.basename(path)))
    if not os.path.isdir(path):
        raise TokenizerError(f"tokenizer path {path!r} does not exist")
    names = sorted(os.listdir(path))
    if any(name in names for name in _HF_TOKENIZER_FILES):
        return Tokenizer(_from_pretrained(path, None), _generation_config_eos_ids(path))
    ggufs = [name for name in names if name.endswith(_GGUF_SUFFIX)]
    if len(ggufs) == 1:
        return Tokenizer(_from_pretrained(path, ggufs[0]), _generation_config_eos_ids(path))
    if ggufs:
        raise TokenizerError(
            f"directory {path!r} holds {len(ggufs)} {_GGUF_SUFFIX} files {ggufs}; pass the path of one of them"
        )
    raise TokenizerError(f"directory {path!r} has no {' or '.join(_HF_TOKENIZER_FILES)} and no {_GGUF_SUFFIX} file")


def _from_pretrained(directory: str, gguf_file: str | None) -> PreTrainedTokenizerBase:
    # A GGUF file's conversion is kept per file (tandem.converted_tokenizer), shared with the workers' grammar backend.
    try:
        tokenizer: PreTrainedTokenizerBase = load_hf_tokenizer(directory, gguf_file)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        source = os.path.join(directory, gguf_file) if gguf_file else directory
        raise TokenizerError(f"cannot load tokenizer from {source!r}: {exc}") from exc
    return tokenizer


def _generation_config_eos_ids(directory: str) -> tuple[int, ...]:
    config_path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(config_path):
        return ()
    try:
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable %s: %s", config_path, exc)
        return ()
    eos = config.get("eos_token_id") if isinstance(config, Mapping) else None
    candidates = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in candidates if isinstance(i, int) and not isinstance(i, bool))


def _collect_eos_ids(hf_tokenizer: PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int]) -> tuple[int, ...]:
    candidates = [hf_tokenizer.eos_token_id, _end_of_turn_id(hf_tokenizer), *extra_eos_token_ids]
    ids: list[int] = []
    for token_id in candidates:
        if isinstance(token_id, int) and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def _end_of_turn_id(hf_tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template writes right after an assistant message, if any."""
    if not hf_tokenizer.chat_template:
        return None
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": _EOT_PROBE_CONTENT},
    ]
    try:
        text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    except _TEMPLATE_ERRORS as exc:
        logger.debug("cannot probe the end-of-turn token: %s", exc)
        return None
    if not isinstance(text, str) or _EOT_PROBE_CONTENT not in text:
        return None
    tail = text.split(_EOT_PROBE_CONTENT, 1)[1]
    tail_ids = _as_id_list(hf_tokenizer.encode(tail, add_special_tokens=False))
    special_ids = set(hf_tokenizer.all_special_ids) | set(hf_tokenizer.get_added_vocab().values())
    if tail_ids and tail_ids[0] in special_ids:
        return tail_ids[0]
    return None


def unicode_problem(text: str) -> str | None:
    """Where `text` stops being encodable as UTF-8 (a lone surrogate, as JSON's "\\ud800" gives), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}"
    return None


def _as_id_list(ids: Any) -> list[int]:
    """Normalize what Hugging Face returns (list, BatchEncoding/dict) to ``list[int]``."""
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]
