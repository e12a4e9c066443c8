"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest


@pytest.fixture
def flashinfer_installed(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """Call with True or False to set whether `find_spec("flashinfer")` finds the package (a fact of
    the environment, which `auto` backends ask); every other module is looked up as usual."""
    real = importlib.util.find_spec

    def set_installed(installed: bool) -> None:
        def find_spec(name: str, *args, **kwargs):   # type: ignore[no-untyped-def]
            if name == "flashinfer":
                return real("torch") if installed else None   # any spec stands for "installed"
            return real(name, *args, **kwargs)
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return set_installed
