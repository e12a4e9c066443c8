"""Tests for kernels.lora: the C++ shrink / expand against the torch path, the torch path against a
row-by-row formula, merged q/k/v offsets, adapters of different ranks, rows of no adapter, errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels import lora, native
from kernels.lora import NO_ADAPTER, LoraSegments, lora_expand, lora_shrink, segments_from_slots

torch.set_flush_denormal(True)

# decode-like (one row per segment), prefill-like (long segments), and both with rows of no adapter
ROW_SLOTS = {
    "decode": [2, 0, 1, 3, NO_ADAPTER, 2, 2, 0],
    "prefill": [1] * 19 + [NO_ADAPTER] * 5 + [3] * 33,
    "mixed": [0] * 7 + [2, NO_ADAPTER, 1, 1, 3] + [NO_ADAPTER] * 3 + [2] * 12,
}
RANKS = (4, 16, 8, 64)  # slot i's rank; each is zero-padded to the stack's

needs_kernels = pytest.mark.skipif(not native.is_available(), reason="the C++ kernels are not built here")


def _adapters(num_parts: int, ins: int, outs: tuple[int, ...], rank: int, gen: torch.Generator):
    """a [slots, parts * rank, in] (each part's A stacked along the rank) and b per part [slots, out, rank],
    slot i holding rank RANKS[i] (min rank) and zeros past it."""
    a = torch.zeros(len(RANKS), num_parts * rank, ins)
    bs = [torch.zeros(len(RANKS), out, rank) for out in outs]
    for slot, slot_rank in enumerate(RANKS):
        r = min(slot_rank, rank)
        for part, b in enumerate(bs):
            a[slot, part * rank : part * rank + r] = torch.randn(r, ins, generator=gen) / ins**0.5
            b[slot, :, :r] = torch.randn(b.shape[1], r, generator=gen)
    return a, bs


def _row_formula(x: torch.Tensor, row_slots: list[int], matrix: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Row i times matrix(slot)^T, zeros for rows of no adapter: the definition, row by row."""
    rows = [x[i] @ matrix(slot).T if slot != NO_ADAPTER else None for i, slot in enumerate(row_slots)]
    width = next(r for r in rows if r is not None).shape[0]
    return torch.stack([torch.zeros(width) if r is None else r for r in rows])


def test_segments_merge_equal_neighbours() -> None:
    segments = segments_from_slots([2, 2, NO_ADAPTER, 0, 0, 0, 2])
    assert isinstance(segments, LoraSegments)
    assert segments.starts.tolist() == [0, 2, 3, 6, 7]
    assert segments.slots.tolist() == [2, NO_ADAPTER, 0, 2]
    assert segments.starts.dtype == segments.slots.dtype == torch.int32
    empty = segments_from_slots([])
    assert empty.starts.tolist() == [0] and empty.slots.tolist() == []


@pytest.mark.parametrize("batch", sorted(ROW_SLOTS))
def test_torch_path_is_the_row_by_row_formula(batch: str) -> None:
    gen = torch.Generator().manual_seed(1)
    row_slots = ROW_SLOTS[batch]
    x = torch.randn(len(row_slots), 40, generator=gen)
    a, (b,) = _adapters(1, 40, (24,), 16, gen)
    scaling = torch.tensor([0.5, 2.0, 1.0, 0.25])
    segments = segments_from_slots(row_slots)
    t = lora.reference_shrink(x, a, *segments)
    torch.testing.assert_close(t, _row_formula(x, row_slots, lambda slot: a[slot]))
    y = torch.randn(len(row_slots), 30, generator=gen)
    expected = y.clone()
    expected[:, 3:27] += _row_formula(t, row_slots, lambda slot: scaling[slot] * b[slot])
    lora.reference_expand(t, b, *segments, scaling, y, 0, 3)
    torch.testing.assert_close(y, expected)


@needs_kernels
@pytest.mark.parametrize("batch", sorted(ROW_SLOTS))
@pytest.mark.parametrize(("ins", "rank"), [(576, 16), (100, 64), (37, 8)])
def test_kernels_match_the_torch_path(batch: str, ins: int, rank: int) -> None:
    """in of 576 (vectors only), 100 and 37 (scalar tails); ranks one, four and half a vector wide."""
    gen = torch.Generator().manual_seed(2)
    row_slots = ROW_SLOTS[batch]
    x = torch.randn(len(row_slots), ins, generator=gen)
    a, (b,) = _adapters(1, ins, (83,), rank, gen)  # 83 outputs: a partial last tile
    scaling = torch.tensor([0.5, 2.0, 1.0, 0.25])
    segments = segments_from_slots(row_slots)
    t = lora_shrink(x, a, *segments)
    torch.testing.assert_close(t, lora.reference_shrink(x, a, *segments), atol=1e-5, rtol=1e-5)
    y = torch.randn(len(row_slots), 90, generator=gen)
    expected = y.clone()
    lora.reference_expand(t, b, *segments, scaling, expected, 0, 5)
    lora_expand(t, b, *segments, scaling, y, 0, 5)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_merged_qkv_takes_one_shrink_and_three_expands(path: str) -> None:
    """SmolLM2-like q 64 / k 32 / v 32 columns of one output; stacked A of three parts of rank 16,
    slots of ranks 4, 16, 8 (16 used) and 64 (cut to 16): the same as each projection alone."""
    if path == "kernels" and not native.is_available():
        pytest.skip("the C++ kernels are not built here")
    shrink, expand = (lora_shrink, lora_expand) if path == "kernels" else (lora.reference_shrink, lora.reference_expand)
    gen = torch.Generator().manual_seed(3)
    row_slots, rank, outs = ROW_SLOTS["mixed"], 16, (64, 32, 32)
    x = torch.randn(len(row_slots), 48, generator=gen)
    a, bs = _adapters(3, 48, outs, rank, gen)
    scaling = torch.tensor([1.0, 0.5, 2.0, 0.125])
    segments = segments_from_slots(row_slots)
    base = torch.randn(len(row_slots), sum(outs), generator=gen)
    y = base.clone()
    t = shrink(x, a, *segments)
    for part, b in enumerate(bs):
        expand(t, b, *segments, scaling, y, part * rank, sum(outs[:part]))
    for part, b in enumerate(bs):
        cols = slice(sum(outs[:part]), sum(outs[: part + 1]))
        a_part = a[:, part * rank : (part + 1) * rank]
        delta = _row_formula(x, row_slots, lambda slot, a_part=a_part, b=b: scaling[slot] * b[slot] @ a_part[slot])
        torch.testing.assert_close(y[:, cols], base[:, cols] + delta, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_rows_of_no_adapter_and_zero_b_leave_y_exactly(path: str) -> None:
    if path == "kernels" and not native.is_available():
        pytest.skip("the C++ kernels are not built here")
    shrink, expand = (lora_shrink, lora_expand) if path == "kernels" else (lora.reference_shrink, lora.reference_expand)
    gen = torch.Generator().manual_seed(4)
    row_slots = ROW_SLOTS["mixed"]
    x = torch.randn(len(row_slots), 64, generator=gen)
    a, (b,) = _adapters(1, 64, (48,), 16, gen)
    segments = segments_from_slots(row_slots)
    scaling = torch.ones(len(RANKS))
    t = shrink(x, a, *segments)
    is_none = torch.tensor(row_slots) == NO_ADAPTER
    assert torch.equal(t[is_none], torch.zeros(int(is_none.sum()), 16))
    y = torch.randn(len(row_slots), 48, generator=gen)
    before = y.clone()
    expand(t, b, *segments, scaling, y, 0, 0)
    assert torch.equal(y[is_none], before[is_none])
    assert not torch.equal(y[~is_none], before[~is_none])
    unchanged = y.clone()
    expand(t, torch.zeros_like(b), *segments, scaling, y, 0, 0)
    assert torch.equal(y, unchanged)  # an all-zero B adds exactly nothing


@needs_kernels
def test_a_row_gets_the_same_bits_alone_as_in_a_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    row_slots = ROW_SLOTS["mixed"]
    x = torch.randn(len(row_slots), 576, generator=gen)
    a, (b,) = _adapters(1, 576, (576,), 16, gen)
    scaling = torch.tensor([0.5, 2.0, 1.0, 0.25])
    t = lora_shrink(x, a, *segments_from_slots(row_slots))
    y = torch.zeros(len(row_slots), 576)
    lora_expand(t, b, *segments_from_slots(row_slots), scaling, y)
    for row in (0, 7, 20):
        alone = segments_from_slots(row_slots[row : row + 1])
        t_row = lora_shrink(x[row : row + 1].contiguous(), a, *alone)
        y_row = torch.zeros(1, 576)
        lora_expand(t_row, b, *alone, scaling, y_row)
        assert torch.equal(t_row[0], t[row]) and torch.equal(y_row[0], y[row])


def test_bfloat16_takes_the_torch_path() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(6, 32, generator=gen)
    a = torch.randn(2, 8, 32, generator=gen)
    segments = segments_from_slots([0, 0, 1, NO_ADAPTER, 1, 0])
    t = lora_shrink(x.bfloat16(), a.bfloat16(), *segments)
    assert t.dtype == torch.bfloat16
    torch.testing.assert_close(t.float(), lora.reference_shrink(x, a, *segments), atol=0.1, rtol=0.02)


def _bad_calls() -> dict[str, Callable[[Callable, Callable], None]]:
    """Each call gets (shrink, expand) and makes one mistake."""
    x, a = torch.randn(4, 32), torch.randn(3, 16, 32)
    t, b, y, scaling = torch.randn(4, 16), torch.randn(3, 24, 16), torch.randn(4, 24), torch.ones(3)
    ok = segments_from_slots([0, 0, NO_ADAPTER, 2])
    starts = torch.tensor
    return {
        "x's inputs are not a's": lambda s, e: s(x, torch.randn(3, 16, 31), *ok),
        "a is 2-d": lambda s, e: s(x, a[0], *ok),
        "starts end before the rows": lambda s, e: s(x, a, starts([0, 2, 3], dtype=torch.int32), ok.slots[:2]),
        "starts decrease": lambda s, e: s(x, a, starts([0, 3, 2, 4], dtype=torch.int32), ok.slots[:3]),
        "starts int64": lambda s, e: s(x, a, ok.starts.long(), ok.slots),
        "one start too few": lambda s, e: s(x, a, ok.starts[1:], ok.slots),
        "slot past the slots": lambda s, e: s(x, a, *segments_from_slots([0, 0, 3, 3])),
        "slot -2": lambda s, e: s(x, a, *segments_from_slots([0, 0, -2, 2])),
        "r columns past t": lambda s, e: e(t, b, *ok, scaling, y, 1, 0),
        "out columns past y": lambda s, e: e(t, b, *ok, scaling, y, 0, 1),
        "negative offset": lambda s, e: e(t, b, *ok, scaling, torch.randn(4, 30), 0, -1),
        "scaling per slot": lambda s, e: e(t, b, *ok, torch.ones(2), y, 0, 0),
        "rows of t and y": lambda s, e: e(t, b, *ok, scaling, y[:3].contiguous(), 0, 0),
        "rank above 64": lambda s, e: e(torch.randn(4, 65), torch.randn(3, 24, 65), *ok, scaling, y, 0, 0),
        "expand's slots": lambda s, e: e(t, b, *segments_from_slots([0, 0, 5, 5]), scaling, y, 0, 0),
    }


@pytest.mark.parametrize("path", ["kernels", "torch"])
@pytest.mark.parametrize("mistake", sorted(_bad_calls()))
def test_operands_that_do_not_fit_raise_value_error(path: str, mistake: str) -> None:
    if path == "kernels" and not native.is_available():
        pytest.skip("the C++ kernels are not built here")
    functions = (lora_shrink, lora_expand) if path == "kernels" else (lora.reference_shrink, lora.reference_expand)
    with pytest.raises(ValueError):
        _bad_calls()[mistake](*functions)
