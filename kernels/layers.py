"""Elementwise layers: RMSNorm (with the residual add), SwiGLU and GeLU-tanh gating, rotary position embedding.

Torch code is the implementation everywhere and the reference; float32 CPU tensors go through the
fused C++ kernels (`kernels/csrc`) when they are built: one call where torch needs several.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

# The KV pool dtypes the C++ kernels read and write; a pool in another dtype takes the torch code.
NATIVE_KV_CACHE_DTYPES = (torch.float32, torch.bfloat16)


def _fused(*tensors: torch.Tensor) -> ModuleType | None:
    """The C++ kernels when every tensor is a float32 CPU tensor and they are built, else None
    (the torch code below is then the implementation, and always the reference)."""
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return None
    from kernels import native

    return native.load() if native.is_available() else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back to `x.dtype` before the weight, as HF Llama does."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for [T, H] rows; `residual` None means zero.

    Mutates `residual` in place (it becomes the sum); `x` is never changed."""
    if residual is None:
        residual = x.clone()
    elif (fused := _fused(x, residual, weight)) is not None and x.is_contiguous() and residual.is_contiguous():
        return fused.rms_norm(x, weight, eps, residual), residual
    else:
        residual.add_(x)
    if (fused := _fused(residual, weight)) is not None and residual.is_contiguous():
        return fused.rms_norm(residual, weight, eps, None), residual
    return rms_norm(residual, weight, eps), residual


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm over the last dimension of x (any shape, e.g. [T, heads, head_dim]), with no residual;
    a new tensor. One C++ call for float32 on CPU, whose rows get the bits the fused layer gives them."""
    if (fused := _fused(x, weight)) is not None:
        return fused.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps, None).view(x.shape)
    return rms_norm(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `gate_up` [T, 2I] holding [gate | up] -> [T, I]."""
    if (fused := _fused(gate_up)) is not None and gate_up.is_contiguous():
        return fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up for `gate_up` [T, 2I] holding [gate | up] -> [T, I]."""
    if (fused := _fused(gate_up)) is not None and gate_up.is_contiguous():
        return fused.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with optional linear or llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions [0, max_positions) on `device` (computed in fp32 on
    the host, so every device gets the same tables); applied in the input dtype. `local` holds a
    second set for a model whose sliding-window layers rotate with another base."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: Mapping[str, Any],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.local: RotaryEmbedding | None = None  # sliding-window layers' own tables, where a model has them

    def for_layer(self, is_sliding: bool) -> RotaryEmbedding:
        """The tables a layer rotates with: `local` on a sliding-window layer when set (Gemma 3), else these."""
        return self.local if is_sliding and self.local is not None else self

    def apply_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        write_pages: torch.Tensor,
        write_offsets: torch.Tensor,
    ) -> torch.Tensor:
        """Rotate q [T, Hq, D] and k [T, Hkv, D], write k and v into `kv_cache` [P, 2, S, Hkv, D] at
        (write_pages, write_offsets), rounded to the cache's dtype, and return the rotated q. One C++
        call for float32 on CPU."""
        if (
            (fused := _fused(q, k, v, self.cos)) is not None
            and kv_cache.dtype in NATIVE_KV_CACHE_DTYPES
            and all(t.stride(-1) == 1 for t in (q, k, v))
        ):
            fused.rope_and_store(q, k, v, self.cos, self.sin, positions, kv_cache, write_pages, write_offsets)
            return q
        q, k = self.apply(q, k, positions)
        kv_cache[write_pages, 0, write_offsets] = k.to(kv_cache.dtype)  # the pool's dtype may be another
        kv_cache[write_pages, 1, write_offsets] = v.to(kv_cache.dtype)
        return q

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] int64 -> rotated (q, k)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
