"""Separating a model's `<think>...</think>` reasoning from its answer (`reasoning_content`)."""

from __future__ import annotations

_OPEN, _CLOSE = "<think>", "</think>"


class ReasoningSplitter:
    """Fed an output's text in chunks, returns (reasoning, content) deltas.

    An output that starts with `<think>` is reasoning until `</think>`; anything else is content.
    A chunk boundary inside a tag is held back until the tag is whole.
    """

    __slots__ = ("_state", "_held")

    def __init__(self) -> None:
        self._state = "start"  # start -> thinking -> after_think -> answer
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        if self._state == "start":
            stripped = text.lstrip()
            if _OPEN.startswith(stripped) and len(stripped) < len(_OPEN):
                self._held = text  # might still become "<think>"
                return "", ""
            if not stripped.startswith(_OPEN):
                self._state = "answer"
                return "", text
            self._state, text = "thinking", stripped[len(_OPEN) :]
        if self._state == "thinking":
            end = text.find(_CLOSE)
            if end < 0:
                keep = _partial_suffix(text, _CLOSE)
                self._held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            self._state = "after_think"
            reasoning, text = text[:end], text[end + len(_CLOSE) :]
            return reasoning, self._answer(text)
        return "", self._answer(text)

    def _answer(self, text: str) -> str:
        """Content; the newlines right after `</think>` are dropped, however they were chunked."""
        if self._state == "after_think":
            text = text.lstrip("\n")
            if text:
                self._state = "answer"
        return text

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self._state == "thinking" else ("", held)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Whole-output form: (reasoning or None, content)."""
    splitter = ReasoningSplitter()
    reasoning, content = splitter.feed(text)
    tail_reasoning, tail_content = splitter.flush()
    reasoning += tail_reasoning
    content += tail_content
    return (reasoning if reasoning or text.lstrip().startswith(_OPEN) else None), content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
