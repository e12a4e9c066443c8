"""LoRA adapters on a worker: the registry built at start (`--lora-paths`), loads and unloads at run time
(only from `--lora-dir`), and a request's hold on its adapter for as long as it runs (`held_lora`).

`LoraRegistry` (lora_registry.py) decides which adapter holds which of the engine's slots; the weights
reach a slot through an engine command, queued before the request that needs them, so the request's
first step already finds them there (commands run in the order they were queued).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig
from engine.engine import Engine
from engine.errors import LoraNotFoundError
from engine.lora import LoraAdapter, resolve_adapter_path
from server_runtime.config import WorkerConfig
from server_runtime.engine_loop import EngineLoop
from server_runtime.lora_registry import LoraRegistry

DEFAULT_UNLOAD_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class HeldLora:
    """A request's adapter while it runs: the engine slot its rows take and the id its KV is cached
    under (the name and the load it came from, so an adapter loaded again under the same name never
    meets the old one's cached KV)."""

    slot_id: int
    lora_id: str


class LoraAdapters:
    """A worker's adapters: its `LoraRegistry`, the base model they must fit and where run-time loads come from."""

    def __init__(self, config: WorkerConfig, model_config: ModelConfig) -> None:
        self.registry = LoraRegistry(config.engine.max_loras)
        self.model_config = model_config
        self.max_rank = config.engine.max_lora_rank
        self.lora_dir = Path(config.lora_dir) if config.lora_dir else None
        self._loads = 0  # adapters loaded since start: each load's id
        self._ids: dict[str, str] = {}
        for name, path in config.lora_paths:  # the operator's own paths: not confined to --lora-dir
            self._add(name, LoraAdapter.load(Path(path), model_config, self.max_rank))

    def _add(self, name: str, adapter: LoraAdapter) -> None:
        self.registry.add(name, adapter)
        self._loads += 1
        self._ids[name] = f"{name}#{self._loads}"

    def cache_namespace(self, name: str) -> str | None:
        """The id `name`'s KV is cached under now (None: no adapter of that name is loaded)."""
        return self._ids.get(name)

    async def load(self, name: str, path: str) -> None:
        """Load the adapter at `path` (inside --lora-dir) as `name`; raises LoraLoadError."""
        directory = resolve_adapter_path(self.lora_dir, path)
        adapter = await asyncio.to_thread(LoraAdapter.load, directory, self.model_config, self.max_rank)
        self._add(name, adapter)

    async def unload(self, name: str, loop: EngineLoop, timeout_s: float) -> None:
        """Forget `name` once no request holds it (LoraNotFoundError, LoraInUseError); its slot is emptied."""
        slot_id = next((info.slot_id for info in self.registry.info() if info.name == name), None)
        await asyncio.to_thread(self.registry.unload, name, timeout_s)
        self._ids.pop(name, None)
        if slot_id is not None and slot_id not in {info.slot_id for info in self.registry.info()}:
            await loop.call(lambda engine: engine.unload_lora(slot_id))

    @contextlib.asynccontextmanager
    async def held(self, name: str, loop: EngineLoop) -> AsyncIterator[HeldLora]:
        """Hold adapter `name` for one request while the block runs (LoraNotFoundError, CapacityError);
        its weights are in the slot before any request submitted after this point computes."""
        slot = self.registry.acquire(name)
        try:
            if slot.is_new:
                adapter = slot.adapter
                await loop.call(lambda engine: Engine.load_lora(engine, slot.slot_id, adapter))
            yield HeldLora(slot.slot_id, self._ids[name])
        finally:
            self.registry.release(name)


@contextlib.asynccontextmanager
async def held_lora(adapters: LoraAdapters | None, name: str, loop: EngineLoop) -> AsyncIterator[HeldLora | None]:
    """A request's hold on adapter `name` while the block runs; None for the base model (an empty name).
    A name on a worker that serves no adapters is LoraNotFoundError."""
    if not name:
        yield None
        return
    if adapters is None:
        raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded: this worker serves no adapters (--max-loras)")
    async with adapters.held(name, loop) as held:
        yield held
