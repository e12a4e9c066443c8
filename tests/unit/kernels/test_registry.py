"""Tests for kernels.registry: backends registered on import, lazily imported by name, and clear
errors for unknown names and for backends whose module cannot be imported."""

from __future__ import annotations

import sys

import pytest

from kernels import attention
from kernels.registry import BackendRegistry


class _Backend:
    pass


def test_registered_names_are_found_and_auto_is_listed() -> None:
    registry: BackendRegistry[_Backend] = BackendRegistry("test", {"later": "no.such.module"})
    registry.register("here")(_Backend)
    assert registry.get("here") is _Backend
    assert registry.names == ["auto", "here", "later"]


def test_an_unknown_name_lists_the_known_ones() -> None:
    registry: BackendRegistry[_Backend] = BackendRegistry("test", {})
    registry.register("here")(_Backend)
    with pytest.raises(ValueError, match=r"unknown test backend 'elsewhere'; known: \['auto', 'here'\]"):
        registry.get("elsewhere")


def test_a_lazy_backend_whose_module_cannot_be_imported_is_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)   # `import flashinfer` raises ImportError
    monkeypatch.delitem(sys.modules, "kernels.flashinfer_attention", raising=False)
    registry: BackendRegistry[_Backend] = BackendRegistry("attention", {"flashinfer": "kernels.flashinfer_attention"})
    with pytest.raises(ValueError, match="FlashInfer attention backend not available"):
        registry.get("flashinfer")


def test_a_lazy_module_must_register_the_name() -> None:
    registry: BackendRegistry[_Backend] = BackendRegistry("test", {"json": "json"})
    with pytest.raises(ValueError, match="registers no 'json'"):
        registry.get("json")


def test_flashinfer_registers_itself_on_first_use() -> None:
    pytest.importorskip("flashinfer")
    assert attention._BACKENDS.get("flashinfer").__name__ == "FlashInferAttention"
