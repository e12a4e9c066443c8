"""Page keys: the one name a full page of prompt tokens has in the gateway's prefix-aware routing and in
the KV events workers publish (`WorkerService.SubscribeKvEvents`). Standard library only.

Key i of a sequence stands for its pages 0..i: a 64-bit BLAKE2b hash chained from a root, the LoRA
adapter's name ("" the base model), over each page's tokens in turn. So two sequences share key i
exactly when they share their first i + 1 pages under the same adapter, and a gateway and a worker (or
two processes of any kind) compute the same keys for the same tokens.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def root_key(lora_name: str = "") -> int:
    """The key every chain under the adapter `lora_name` starts from."""
    return _hash(b"tandem page keys\x00" + lora_name.encode())


def next_key(parent: int, tokens: Sequence[int]) -> int:
    """The key of the page holding `tokens` after the prefix whose last page's key is `parent` (or a root)."""
    return _hash(struct.pack(f"<Q{len(tokens)}i", parent, *tokens))


def page_keys(token_ids: Sequence[int], page_size: int, lora_name: str = "") -> tuple[int, ...]:
    """One key per full page of `token_ids` under the adapter `lora_name`."""
    keys: list[int] = []
    key = root_key(lora_name)
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        key = next_key(key, token_ids[start : start + page_size])
        keys.append(key)
    return tuple(keys)


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
