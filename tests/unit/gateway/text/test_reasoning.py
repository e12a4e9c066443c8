"""<think> reasoning separated from the answer, whole and in chunks of every size."""

from __future__ import annotations

import pytest

from gateway.text.reasoning import ReasoningSplitter, split_reasoning

TEXT = "<think>First, Paris is in France.\nSo the answer is Paris.</think>\n\nThe capital is Paris."


def test_whole_output_split() -> None:
    assert split_reasoning(TEXT) == ("First, Paris is in France.\nSo the answer is Paris.", "The capital is Paris.")
    assert split_reasoning("Just an answer.") == (None, "Just an answer.")
    assert split_reasoning("<think>cut off mid-thought") == ("cut off mid-thought", "")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 13])
def test_chunked_feeding_gives_the_same_split(size: int) -> None:
    splitter = ReasoningSplitter()
    reasoning = content = ""
    for start in range(0, len(TEXT), size):
        r, c = splitter.feed(TEXT[start:start + size])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    assert (reasoning + r, content + c) == split_reasoning(TEXT)
    assert "<" not in reasoning + r and "think>" not in content + c
