"""The LoRA adapters an engine holds on its device, stacked for the batched kernels (`kernels/lora.py`),
and a step's view of which rows take which (`LoraBatch`).

`LoraSlots` keeps `num_slots` adapters at once. Per decoder layer it holds four groups, one per
projection the model computes (`engine/models/layers.py`): `qkv` (parts q, k, v of the merged
projection), `o`, `gate_up` (parts gate, up) and `down`. A group stacks its parts' A matrices along
the rank, [slots, parts * max_rank, in], so one shrink serves the merged projection, and keeps each
part's B [slots, out, max_rank] and scaling [slots] for its own expand into the part's columns.
An adapter of a smaller rank, or one that does not target a part, leaves zeros there, which add
nothing. A group no loaded adapter targets is skipped.

A step whose rows include an adapter's runs every projection unfused (`DecoderLayer.forward`): the
base projection, then `LoraBatch.apply` adds each row's update in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.lora import LoraAdapter, Projection
from kernels.lora import NO_ADAPTER, LoraSegments, lora_expand, lora_shrink, segments_from_slots

GROUPS: dict[str, tuple[Projection, ...]] = {
    "qkv": (Projection.Q_PROJ, Projection.K_PROJ, Projection.V_PROJ),
    "o": (Projection.O_PROJ,),
    "gate_up": (Projection.GATE_PROJ, Projection.UP_PROJ),
    "down": (Projection.DOWN_PROJ,),
}
_GROUP_OF = {projection: (group, part) for group, parts in GROUPS.items() for part, projection in enumerate(parts)}


@dataclass(slots=True)
class _Group:
    """One layer's stacked weights of one group: `a` [slots, parts * rank, in]; per part `b` [slots,
    out, rank], `scaling` [slots] and its first output column; `num_users`: loaded slots targeting it."""

    a: torch.Tensor
    b: tuple[torch.Tensor, ...]
    scaling: tuple[torch.Tensor, ...]
    out_offsets: tuple[int, ...]
    num_users: int = 0


class LoraSlots:
    """`num_slots` adapters of rank up to `max_rank` for `config`'s dense layers, in `dtype` on `device`."""

    def __init__(
        self, config: ModelConfig, num_slots: int, max_rank: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        if num_slots < 1 or max_rank < 1:
            raise ValueError("num_slots and max_rank must be positive")
        self.num_slots, self.max_rank = num_slots, max_rank
        self.layers: list[dict[str, _Group]] = []
        for _ in range(config.num_layers):
            groups = {}
            for name, parts in GROUPS.items():
                shapes = [p.shape(config) for p in parts]
                offsets = [sum(out for out, _ in shapes[:i]) for i in range(len(shapes))]
                groups[name] = _Group(
                    torch.zeros(num_slots, len(parts) * max_rank, shapes[0][1], device=device, dtype=dtype),
                    tuple(torch.zeros(num_slots, out, max_rank, device=device, dtype=dtype) for out, _ in shapes),
                    tuple(torch.zeros(num_slots, device=device, dtype=dtype) for _ in parts),
                    tuple(offsets),
                )
            self.layers.append(groups)
        self._targets: list[set[tuple[int, str]]] = [set() for _ in range(num_slots)]

    def write(self, slot_id: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in slot `slot_id` (whatever was there is gone). Its rank must be at most `max_rank`."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"the adapter's rank {adapter.rank} is above the slots' {self.max_rank} (--max-lora-rank)")
        self.clear(slot_id)
        for (layer_id, projection), weights in adapter.weights.items():
            name, part = _GROUP_OF[projection]
            group = self.layers[layer_id][name]
            rank, start = weights.rank, part * self.max_rank
            group.a[slot_id, start : start + rank].copy_(weights.a)
            group.b[part][slot_id, :, :rank].copy_(weights.b)
            group.scaling[part][slot_id] = weights.scaling
            self._targets[slot_id].add((layer_id, name))
        for layer_id, name in self._targets[slot_id]:
            self.layers[layer_id][name].num_users += 1

    def clear(self, slot_id: int) -> None:
        """Empty slot `slot_id`: rows on it get no update."""
        if not 0 <= slot_id < self.num_slots:
            raise ValueError(f"slot {slot_id} is not one of the {self.num_slots} LoRA slots")
        for layer_id, name in self._targets[slot_id]:
            group = self.layers[layer_id][name]
            group.num_users -= 1
            group.a[slot_id].zero_()
            for b, scaling in zip(group.b, group.scaling):
                b[slot_id].zero_()
                scaling[slot_id] = 0
        self._targets[slot_id] = set()

    def batch(self, row_slots: list[int]) -> LoraBatch | None:
        """The step's view for rows taking slots `row_slots` (NO_ADAPTER: none); None when no row takes one."""
        if all(slot == NO_ADAPTER for slot in row_slots):
            return None
        return LoraBatch(self, segments_from_slots(row_slots))


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """Which adapter each of a step's rows takes (`segments`), over the slots' weights."""

    slots: LoraSlots
    segments: LoraSegments

    def apply(self, layer_id: int, group_name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add each row's adapter update of projection group `group_name` of layer `layer_id` to `y`
        [T, out] (the base projection of `x` [T, in]), in place."""
        group = self.slots.layers[layer_id][group_name]
        if group.num_users == 0:
            return
        starts, slots = self.segments
        t = lora_shrink(x.contiguous(), group.a, starts, slots)
        for part, (b, scaling, out_offset) in enumerate(zip(group.b, group.scaling, group.out_offsets)):
            lora_expand(t, b, starts, slots, scaling, y, part * self.slots.max_rank, out_offset)
