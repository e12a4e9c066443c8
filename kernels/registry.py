"""Registries of backends chosen by name at start-up (attention, sampling), and the one fact about
the environment their `auto` choice needs: whether FlashInfer is installed.

A name may be registered by a module that is imported only when that name is asked for (the
FlashInfer backends), so that serving on CPU never imports CUDA libraries.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


def is_flashinfer_installed() -> bool:
    """Whether `import flashinfer` can find the package (it is not imported here)."""
    return importlib.util.find_spec("flashinfer") is not None


class BackendRegistry(Generic[T]):
    """Name -> backend class. `lazy_modules` maps names to the module whose import registers them."""

    def __init__(self, kind: str, lazy_modules: Mapping[str, str]) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}
        self._lazy_modules = dict(lazy_modules)

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def wrap(cls: type[T]) -> type[T]:
            self._classes[name] = cls
            return cls

        return wrap

    @property
    def names(self) -> list[str]:
        """Every name that may be created, `auto` included."""
        return sorted({"auto", *self._classes, *self._lazy_modules})

    def check_known(self, name: str) -> None:
        """Raise ValueError for a name no backend answers to."""
        if name not in self._classes and name not in self._lazy_modules:
            raise ValueError(f"unknown {self.kind} backend {name!r}; known: {self.names}")

    def get(self, name: str) -> type[T]:
        """The class registered as `name`, importing its module first when it registers lazily.

        Raises ValueError for an unknown name or a backend whose module cannot be imported."""
        self.check_known(name)
        if name not in self._classes:
            module = self._lazy_modules[name]
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ValueError(f"{_DISPLAY_NAMES.get(name, name)} {self.kind} backend not available: {exc}") from exc
            if name not in self._classes:
                raise ValueError(
                    f"{_DISPLAY_NAMES.get(name, name)} {self.kind} backend not available: {module} "
                    f"registers no {name!r}"
                )
        return self._classes[name]


_DISPLAY_NAMES = {"flashinfer": "FlashInfer"}


def as_device(device: torch.device | str) -> torch.device:
    """`device` as a `torch.device` ("cuda:1" -> device(type='cuda', index=1))."""
    return device if isinstance(device, torch.device) else torch.device(device)
