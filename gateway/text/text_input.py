"""A request's text to token ids without holding the event loop.

Every route that tokenizes text or renders a chat template comes here. A text longer in characters
than the context could hold in tokens is refused before it is touched (no token stands for more
than `Tokenizer.max_token_chars` characters); the rest is tokenized or templated on a worker
thread, so a large prompt never stalls `/health` or other requests. Tokenizer errors become 400s
naming the request field they came from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from gateway.text.tokenizer import RESERVED_TEMPLATE_KWARGS, Tokenizer, TokenizerError
from tandem import tracing

# Texts at most this long are tokenized on the event loop: a thread hop costs more than they do.
_INLINE_CHARS = 4096


def token_id_lists(input_ids: Sequence[int] | Sequence[Sequence[int]]) -> tuple[list[list[int]], bool]:
    """One prompt of token ids (`[1, 2]`) or several (`[[1, 2], [3]]`) as a list of prompts, and
    whether it was several."""
    several = [list(ids) for ids in input_ids if not isinstance(ids, int)]
    if several:
        return several, True
    return [[token for token in input_ids if isinstance(token, int)]], False


async def encode_texts(
    tokenizer: Tokenizer, texts: Sequence[str], param: str, context_len: int | None, add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of each text in `texts` (the request's field `param`).

    With `context_len` (the served model's context, when known), a text with more characters than
    `context_len` tokens could cover is a 400 `context_length_exceeded` before any tokenizing.
    """
    for text in texts:
        check_chars(tokenizer, len(text), param, context_len)

    def encode_all() -> list[list[int]]:
        return [tokenizer.encode(text, add_special_tokens=add_special_tokens) for text in texts]

    with tracing.span("tokenize") as span:
        token_lists = await _off_loop(encode_all, sum(len(t) for t in texts), param)
        if span is not None:
            span.set_attribute("tandem.prompt_tokens", sum(len(ids) for ids in token_lists))
        return token_lists


@dataclass(frozen=True, slots=True)
class EncodedPairs:
    """Token ids of each pair, and each token's segment where the tokenizer gives segments (else None)."""

    token_lists: list[list[int]]
    token_type_lists: list[list[int]] | None


async def encode_pairs(
    tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]], param: str, context_len: int | None
) -> EncodedPairs:
    """Each (text, text_pair) joined as the model's tokenizer joins a pair (see `encode_texts` for the
    length check, on the two texts together)."""
    for text, text_pair in pairs:
        check_chars(tokenizer, len(text) + len(text_pair), param, context_len)

    def encode_all() -> EncodedPairs:
        encoded = [tokenizer.encode_pair(text, text_pair) for text, text_pair in pairs]
        types = [t for _, t in encoded]
        has_types = all(t is not None for t in types)
        return EncodedPairs([ids for ids, _ in encoded], [t or [] for t in types] if has_types else None)

    return await _off_loop(encode_all, sum(len(a) + len(b) for a, b in pairs), param)


async def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    param: str,
    context_len: int | None,
    add_generation_prompt: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """The prompt ids of `messages` rendered with the chat template (see `encode_texts` for the
    length check, done on the messages' text before rendering and on the rendered text after).
    A reserved `template_kwargs` key is a 400 naming `chat_template_kwargs`."""
    reserved = RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: the server sets "
            "those itself (use the request's own fields, e.g. continue_final_message)",
            "chat_template_kwargs",
        )
    num_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    check_chars(tokenizer, num_chars, param, context_len)

    def render() -> str:
        return tokenizer.render_chat_template(
            messages, add_generation_prompt, template_kwargs, continue_final_message=continue_final_message
        )

    with tracing.span("tokenize") as span:  # the chat template's rendering included
        text = await _off_loop(render, num_chars, param)
        check_chars(tokenizer, len(text), param, context_len)
        ids = await _off_loop(lambda: tokenizer.encode(text, add_special_tokens=False), len(text), param)
        if span is not None:
            span.set_attribute("tandem.prompt_tokens", len(ids))
        return ids


def check_chars(tokenizer: Tokenizer, num_chars: int, param: str, context_len: int | None) -> None:
    """400 when `num_chars` characters are sure to be more tokens than `context_len`."""
    if context_len is None:
        return
    max_chars = context_len * tokenizer.max_token_chars
    if num_chars > max_chars:
        raise bad_request(
            f"This model's maximum context length is {context_len} tokens. However, `{param}` has "
            f"{num_chars} characters, more than {context_len} tokens can hold (at most {max_chars}: "
            f"no token of this model is over {tokenizer.max_token_chars} characters).",
            param,
            "context_length_exceeded",
        )


async def _off_loop(work, num_chars: int, param: str):
    try:
        if num_chars <= _INLINE_CHARS:
            return work()
        return await asyncio.to_thread(work)
    except TokenizerError as exc:
        raise bad_request(str(exc), param) from None
