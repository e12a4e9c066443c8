"""The interface each checkpoint format implements to hand its tensors to `Checkpoint`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from kernels.packing import PackedWeight


class TensorSource(Protocol):
    """Reads one opened checkpoint's parameters on demand.

    `read()` yields `(HF name, tensor)` pairs one at a time, each tensor freshly materialized
    (owned by the caller, never a view into a file mapping), so a consumer that copies each
    tensor to its destination and drops it never holds the whole model twice. `read()` may
    be called more than once; each call starts over. With `keep_quantized`, a format that stores
    packed blocks (GGUF) yields those matrices as `PackedWeight`s; the others ignore it.
    """

    @property
    def num_tensors(self) -> int:
        """How many pairs `read()` yields."""
        ...

    @property
    def num_bytes(self) -> int:
        """The bytes its tensors take in the files, as stored (packed blocks at their size)."""
        ...

    def read(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        """Yield every parameter, in file order."""
        ...
