"""`LoraRegistry`: the LoRA adapters a worker knows by name, and which of them hold its `max_loras` slots.

An adapter is *loaded* from `add` until `unload` (host memory, as `LoraAdapter`) and *resident* while it
holds a slot: the index the batched LoRA kernel reads its weights from. A request `acquire`s its adapter
before it runs, which places it in a slot if it has none (a free slot, else the least recently used
slot whose adapter is neither pinned nor held by a request), and `release`s it when it ends. A slot id
stays the same while its adapter is resident. `unload` refuses new requests at once and waits, up to
its timeout, for the requests holding the adapter to end.

Thread-safe: the admin calls (`add`, `unload`) come from the asyncio side while the engine thread
acquires and releases; one condition guards everything. Pure bookkeeping: no tensor is touched.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from engine.config import ConfigError
from engine.errors import CapacityError, LoraInUseError, LoraLoadError, LoraNotFoundError
from engine.lora import LoraAdapter


@dataclass(frozen=True, slots=True)
class LoraSlot:
    """An acquired adapter and the slot it is in. `is_new` is True for the first acquire since it was placed
    there (by this acquire, or by `add` for a pinned one): the slot's weights must be written from
    `adapter` before a step uses them."""

    name: str
    slot_id: int
    adapter: LoraAdapter
    is_new: bool


@dataclass(frozen=True, slots=True)
class LoraInfo:
    """One loaded adapter as `/v1/models` and the router see it; `slot_id` None when not resident."""

    name: str
    path: str
    rank: int
    is_pinned: bool
    slot_id: int | None
    num_users: int


@dataclass(slots=True)
class _Entry:
    adapter: LoraAdapter
    is_pinned: bool
    slot_id: int | None = None
    num_users: int = 0
    is_unloading: bool = False
    is_placed_unseen: bool = False  # placed in its slot since the last acquire: LoraSlot.is_new
    last_used: int = 0  # the registry's clock when last acquired or released: the LRU order


class LoraRegistry:
    """Adapters by name and their `max_loras` slots. Every method may be called from any thread."""

    def __init__(self, max_loras: int) -> None:
        if max_loras <= 0:
            raise ConfigError(f"max_loras must be positive, got {max_loras}")
        self._changed = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._slots: list[str | None] = [None] * max_loras
        self._clock = itertools.count(1)

    @property
    def max_loras(self) -> int:
        return len(self._slots)

    def add(self, name: str, adapter: LoraAdapter, is_pinned: bool = False) -> None:
        """Register `adapter` as `name`. A pinned adapter takes a slot now and is never evicted.

        Raises `LoraLoadError` if `name` is loaded already (unload it first), `CapacityError` if a pinned
        one finds no slot it may take."""
        with self._changed:
            if name in self._entries:
                raise LoraLoadError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
            entry = _Entry(adapter, is_pinned, last_used=next(self._clock))
            if is_pinned:
                self._place(name, entry)
            self._entries[name] = entry

    def acquire(self, name: str) -> LoraSlot:
        """Hold `name` for one request and return its slot, placing it first if it has none.

        Raises `LoraNotFoundError` for a name not loaded (or being unloaded), `CapacityError` when it is
        not resident and every slot holds a pinned adapter or one in use (try again when a request ends)."""
        with self._changed:
            entry = self._entries.get(name)
            if entry is None or entry.is_unloading:
                raise LoraNotFoundError(self._not_found(name, entry))
            slot_id = self._place(name, entry) if entry.slot_id is None else entry.slot_id
            is_new, entry.is_placed_unseen = entry.is_placed_unseen, False
            entry.num_users += 1
            entry.last_used = next(self._clock)
            return LoraSlot(name, slot_id, entry.adapter, is_new)

    def release(self, name: str) -> None:
        """End one request's hold on `name` (each `acquire` is released once)."""
        with self._changed:
            entry = self._entries.get(name)
            if entry is None or entry.num_users == 0:
                raise RuntimeError(f"LoRA adapter {name!r} released without a matching acquire")
            entry.num_users -= 1
            entry.last_used = next(self._clock)
            self._changed.notify_all()

    def unload(self, name: str, timeout_s: float) -> None:
        """Forget `name` once no request holds it: new acquires are refused at once, and this waits up to
        `timeout_s` seconds for the holders to release it.

        Raises `LoraNotFoundError` for a name not loaded (or already being unloaded), `LoraInUseError`
        when requests still hold it after `timeout_s`; it then stays loaded and takes requests again."""
        with self._changed:
            entry = self._entries.get(name)
            if entry is None or entry.is_unloading:
                raise LoraNotFoundError(self._not_found(name, entry))
            entry.is_unloading = True
            if not self._changed.wait_for(lambda: entry.num_users == 0, timeout=timeout_s):
                entry.is_unloading = False
                raise LoraInUseError(
                    f"LoRA adapter {name!r} is still used by {entry.num_users} request(s) after {timeout_s:g} s; "
                    "it stays loaded"
                )
            del self._entries[name]
            if entry.slot_id is not None:
                self._slots[entry.slot_id] = None

    def info(self) -> list[LoraInfo]:
        """Every loaded adapter (those being unloaded included), in the order they were added."""
        with self._changed:
            return [
                LoraInfo(name, str(e.adapter.path), e.adapter.rank, e.is_pinned, e.slot_id, e.num_users)
                for name, e in self._entries.items()
            ]

    def __contains__(self, name: object) -> bool:
        with self._changed:
            entry = self._entries.get(name) if isinstance(name, str) else None
            return entry is not None and not entry.is_unloading

    def _place(self, name: str, entry: _Entry) -> int:
        """Give `entry` a slot and return its id: a free one, else the slot of the least recently used
        adapter that is neither pinned nor in use, which loses it."""
        if None in self._slots:
            slot_id = self._slots.index(None)
        else:
            evictable = [
                (self._entries[held].last_used, slot_id, held)
                for slot_id, held in enumerate(self._slots)
                if held is not None and not self._entries[held].is_pinned and self._entries[held].num_users == 0
            ]
            if not evictable:
                raise CapacityError(
                    f"no LoRA slot for {name!r}: all {len(self._slots)} slots (--max-loras) hold adapters that are "
                    "pinned or in use"
                )
            _, slot_id, evicted = min(evictable)
            self._entries[evicted].slot_id = None
        self._slots[slot_id] = name
        entry.slot_id, entry.is_placed_unseen = slot_id, True
        return slot_id

    @staticmethod
    def _not_found(name: str, entry: _Entry | None) -> str:
        state = "is being unloaded" if entry is not None else "is not loaded"
        return f"LoRA adapter {name!r} {state}"
