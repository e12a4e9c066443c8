"""The handshake before a prefill and a decode worker are paired: KV moves between them as raw page
bytes, so they must compute with the same weights (by content, `weights_id`) and lay out their pages
alike (dtype, page size, axis order, page bytes) for a model of the same geometry (layers, query and
KV heads, head size). `mismatches` lists every field on which two workers' model infos differ; the
pool pairs only workers with none, and names the others once in its log and in `/get_server_info`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.cluster.worker_records import ModelInfo

# What must agree, by name, and how to read it from a worker's model info.
_CHECKED: tuple[tuple[str, Callable[[ModelInfo], object]], ...] = (
    ("weights_id", lambda i: i.weights_id),
    ("kv_dtype", lambda i: i.kv_layout.dtype),
    ("page_size", lambda i: i.kv_layout.page_size),
    ("kv_order", lambda i: i.kv_layout.order),
    ("num_layers", lambda i: i.kv_layout.num_layers),
    ("num_attention_heads", lambda i: i.num_attention_heads),
    ("num_kv_heads", lambda i: i.kv_layout.num_kv_heads),
    ("head_dim", lambda i: i.kv_layout.head_dim),
    ("page_bytes", lambda i: i.kv_layout.page_bytes),
)


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One field on which a prefill and a decode worker differ, with both sides' values."""

    field: str
    prefill: str
    decode: str

    def __str__(self) -> str:
        return f"{self.field}: prefill {self.prefill}, decode {self.decode}"


def mismatches(prefill: ModelInfo, decode: ModelInfo) -> tuple[Mismatch, ...]:
    """Every checked field whose values differ; () when the two workers may exchange KV."""
    return tuple(
        Mismatch(name, str(read(prefill)) or "unset", str(read(decode)) or "unset")
        for name, read in _CHECKED
        if read(prefill) != read(decode)
    )
