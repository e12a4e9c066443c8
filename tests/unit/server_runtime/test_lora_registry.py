"""Tests for server_runtime.lora_registry: names, slots (stable ids, LRU eviction, pins), per-request holds,
and an unload that waits for the requests holding its adapter."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError
from engine.errors import CapacityError, LoraInUseError, LoraLoadError, LoraNotFoundError
from engine.lora import LoraAdapter, LoraSettings, LoraWeights, Projection
from server_runtime.lora_registry import LoraInfo, LoraRegistry


def adapter(path: str, rank: int = 2) -> LoraAdapter:
    settings = LoraSettings(rank, 2.0 * rank, False, ("q_proj",), None)
    weights = LoraWeights(torch.ones(rank, 64), torch.ones(64, rank), 2.0)
    return LoraAdapter(Path(path), settings, {(0, Projection.Q_PROJ): weights})


def use(registry: LoraRegistry, name: str) -> int:
    """One request's acquire and release; the slot it ran in."""
    slot = registry.acquire(name)
    registry.release(name)
    return slot.slot_id


def test_slots_are_stable_and_the_least_recently_used_unheld_adapter_is_evicted() -> None:
    registry = LoraRegistry(max_loras=2)
    for name in "abc":
        registry.add(name, adapter(f"/loras/{name}"))
    first = registry.acquire("a")
    assert (first.slot_id, first.is_new, first.adapter.path) == (0, True, Path("/loras/a"))
    registry.release("a")
    assert use(registry, "b") == 1
    again = registry.acquire("a")  # resident: same slot, nothing to write; a is now the most recent
    assert (again.slot_id, again.is_new) == (0, False)
    registry.release("a")

    placed = registry.acquire("c")  # evicts b, the least recently used
    assert (placed.slot_id, placed.is_new) == (1, True)
    assert {i.name: i.slot_id for i in registry.info()} == {"a": 0, "b": None, "c": 1}
    assert use(registry, "b") == 0  # c is held, so a (unheld) makes way
    registry.release("c")
    assert [i.num_users for i in registry.info()] == [0, 0, 0]


def test_pinned_adapters_are_never_evicted() -> None:
    registry = LoraRegistry(max_loras=2)
    registry.add("pinned", adapter("/p"), is_pinned=True)
    registry.add("x", adapter("/x"))
    registry.add("y", adapter("/y"))
    for name in ("x", "y", "x", "y"):
        assert use(registry, name) == 1
    first = registry.acquire("pinned")
    assert (first.slot_id, first.is_new) == (0, True)  # placed by add: its first acquire writes it
    registry.release("pinned")
    assert [(i.name, i.is_pinned, i.slot_id) for i in registry.info()] == [
        ("pinned", True, 0),
        ("x", False, None),
        ("y", False, 1),
    ]
    registry.acquire("y")
    with pytest.raises(CapacityError, match=r"no LoRA slot for 'x': all 2 slots \(--max-loras\)"):
        registry.acquire("x")
    with pytest.raises(CapacityError, match="no LoRA slot for 'z'"):
        registry.add("z", adapter("/z"), is_pinned=True)
    assert "z" not in registry
    registry.release("y")
    assert use(registry, "x") == 1


def test_unknown_duplicate_and_unmatched_names_fail_clearly() -> None:
    registry = LoraRegistry(max_loras=1)
    registry.add("a", adapter("/a"))
    with pytest.raises(LoraNotFoundError, match="LoRA adapter 'nope' is not loaded"):
        registry.acquire("nope")
    with pytest.raises(LoraNotFoundError, match="is not loaded"):
        registry.unload("nope", timeout_s=0)
    with pytest.raises(LoraLoadError, match="'a' is already loaded; unload it first"):
        registry.add("a", adapter("/other"))
    with pytest.raises(RuntimeError, match="released without a matching acquire"):
        registry.release("a")
    with pytest.raises(ConfigError, match="max_loras must be positive"):
        LoraRegistry(max_loras=0)
    assert registry.info() == [LoraInfo("a", "/a", 2, False, None, 0)]


def test_unload_waits_for_the_requests_holding_the_adapter() -> None:
    registry = LoraRegistry(max_loras=2)
    registry.add("a", adapter("/a"))
    registry.acquire("a")
    registry.acquire("a")
    errors: list[BaseException] = []

    def unload() -> None:
        try:
            registry.unload("a", timeout_s=30)
        except BaseException as exc:  # the assertion below reports it
            errors.append(exc)

    unloader = threading.Thread(target=unload)
    unloader.start()
    deadline = time.monotonic() + 10
    while "a" in registry and time.monotonic() < deadline:  # refused for new requests as soon as unload starts
        time.sleep(0.01)
    with pytest.raises(LoraNotFoundError, match="'a' is being unloaded"):
        registry.acquire("a")
    registry.release("a")
    time.sleep(0.1)
    assert unloader.is_alive(), "unload returned while a request still held the adapter"
    assert [i.name for i in registry.info()] == ["a"]
    registry.release("a")
    unloader.join(timeout=10)
    assert not unloader.is_alive() and errors == []
    assert registry.info() == []
    registry.add("a", adapter("/a2"))  # the name is free again, and so is its slot
    assert use(registry, "a") == 0


def test_unload_that_times_out_keeps_the_adapter() -> None:
    registry = LoraRegistry(max_loras=1)
    registry.add("a", adapter("/a"))
    registry.acquire("a")
    with pytest.raises(LoraInUseError, match=r"'a' is still used by 1 request\(s\) after 0.05 s; it stays loaded"):
        registry.unload("a", timeout_s=0.05)
    assert "a" in registry
    registry.release("a")
    assert use(registry, "a") == 0
    registry.unload("a", timeout_s=0)
    assert "a" not in registry
