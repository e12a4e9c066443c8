"""Incremental detokenization: turn a stream of generated ids into a stream of text.

Decoding one token at a time is wrong for two reasons: a token may hold only part of a
UTF-8 character (decoding it alone yields U+FFFD), and some decoders change a token's text
depending on what precedes it (SentencePiece strips the leading space of the first token).
So each step decodes a short window of ids twice, with and without the new ids, and emits
the difference ("prefix offset / read offset"):

    ids:  ... | prefix_offset ...... | read_offset ...... | end
                 already emitted,        not yet emitted
                 kept only as context
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gateway.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
# Prompt ids kept as decoding context for the first generated tokens.
_NUM_PROMPT_CONTEXT_IDS = 5
# Pending ids are released even if the text still ends in U+FFFD once this many pile up.
# A UTF-8 character has at most 4 bytes, so only malformed output or long runs of skipped
# special tokens get here; the bound keeps each step O(1).
_MAX_PENDING_IDS = 16


class IncrementalDetokenizer:
    """Turns ids, fed in chunks of any size, into text chunks for one sequence.

    Contract: for generated ids fed with no ``prompt_ids``, the concatenation of every
    :meth:`add` result followed by :meth:`flush` equals
    ``tokenizer.decode(all_ids, skip_special_tokens, spaces_between_special_tokens)``. With
    ``prompt_ids``, their last few ids give the first generated ids their left context, and
    the output is the text that the generated ids append to the prompt's text. The one
    exception is malformed output: once ``_MAX_PENDING_IDS`` ids stay held from one call to
    the next, the next call releases them as decoded (with U+FFFD).

    Each call mutates this object; one instance per sequence, not shared between threads.
    Work per call is proportional to the ids passed plus a short window, never to the
    length of the whole sequence.
    """

    __slots__ = (
        "_tokenizer",
        "_skip_special_tokens",
        "_spaces_between_special_tokens",
        "_ids",
        "_prefix_offset",
        "_read_offset",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._ids: list[int] = [int(i) for i in prompt_ids[-_NUM_PROMPT_CONTEXT_IDS:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    @property
    def num_pending_ids(self) -> int:
        """Ids received whose text is held back (an unfinished character, or no text yet)."""
        return len(self._ids) - self._read_offset

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ``token_ids`` and return the text they finalize (may be empty).

        Text ending in U+FFFD is held back until later ids complete the character; the text
        before it is released at the latest id boundary that ends a whole character.
        """
        if not token_ids:
            return ""
        num_held_before = self.num_pending_ids
        self._ids.extend(int(i) for i in token_ids)
        prefix_text, new_text = self._decode_window(len(self._ids))
        is_stuck = num_held_before >= _MAX_PENDING_IDS
        if is_stuck:
            logger.debug("releasing %d held ids as decoded", self.num_pending_ids)
            return self._advance(prefix_text, new_text, len(self._ids))
        if new_text.endswith(_REPLACEMENT_CHAR):
            return self._release_finished_part(prefix_text)
        if len(new_text) > len(prefix_text):
            return self._advance(prefix_text, new_text, len(self._ids))
        return ""

    def flush(self) -> str:
        """Release whatever is held back, even if it ends in U+FFFD; call at end of stream."""
        if self.num_pending_ids == 0:
            return ""
        prefix_text, new_text = self._decode_window(len(self._ids))
        return self._advance(prefix_text, new_text, len(self._ids))

    def _release_finished_part(self, prefix_text: str) -> str:
        """Emit up to the latest of the last few id boundaries that ends a whole character.

        An unfinished UTF-8 character spans at most 3 trailing bytes, so in well-formed
        output one of the last 3 boundaries ends a whole character (or nothing is new).
        """
        num_ids = len(self._ids)
        for end in range(num_ids - 1, max(self._read_offset, num_ids - 4), -1):
            text = self._tokenizer.decode(
                self._ids[self._prefix_offset : end],
                self._skip_special_tokens,
                self._spaces_between_special_tokens,
            )
            if len(text) > len(prefix_text) and not text.endswith(_REPLACEMENT_CHAR):
                return self._advance(prefix_text, text, end)
        return ""

    def _decode_window(self, end: int) -> tuple[str, str]:
        """Decode the context ids alone and together with the pending ids up to ``end``."""
        decode = self._tokenizer.decode
        skip, spaces = self._skip_special_tokens, self._spaces_between_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip, spaces)
        new_text = decode(self._ids[self._prefix_offset : end], skip, spaces)
        return prefix_text, new_text

    def _advance(self, prefix_text: str, new_text: str, end: int) -> str:
        """Emit ids up to ``end``; the ids just emitted become the next window's context."""
        if not new_text.startswith(prefix_text):
            # A decoder that rewrites earlier text given later ids; the slice below is the
            # best available answer and the only place output can drift from a full decode.
            logger.debug("decoded window does not extend its prefix: %r", prefix_text)
        delta = new_text[len(prefix_text) :]
        num_dropped = self._read_offset
        del self._ids[:num_dropped]
        self._prefix_offset = 0
        self._read_offset = end - num_dropped
        return delta
