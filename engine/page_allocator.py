"""Free-list bookkeeping of KV pages. Plain Python: the tensors live in `engine.kv_pool`."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.errors import CapacityError


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens."""
    return -(-num_tokens // page_size)


class PageAllocator:
    """Hands out page ids in [0, num_pages); every id is either free or owned by one holder."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._is_used = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def is_allocated(self, page_id: int) -> bool:
        """Whether some holder owns `page_id` (False for a free page)."""
        return self._is_used[page_id]

    def allocate(self, num: int) -> list[int]:
        """Take `num` pages; raises CapacityError (taking none) when fewer are free."""
        if num > len(self._free):
            raise CapacityError(f"need {num} KV pages, {len(self._free)} free of {self.num_pages}")
        ids = [self._free.popleft() for _ in range(num)]
        for page_id in ids:
            self._is_used[page_id] = True
        return ids

    def free(self, page_ids: Iterable[int]) -> None:
        """Return pages; freeing a page that is not in use is a bug and raises ValueError."""
        ids = list(page_ids)
        for page_id in ids:
            if not (0 <= page_id < self.num_pages) or not self._is_used[page_id]:
                raise ValueError(f"page {page_id} is not allocated")
        if len(set(ids)) != len(ids):
            raise ValueError(f"page ids {ids} name a page more than once")
        for page_id in ids:
            self._is_used[page_id] = False
            self._free.append(page_id)

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list and the in-use flags disagree (for tests)."""
        assert len(set(self._free)) == len(self._free), "a page is free twice"
        assert all(not self._is_used[page_id] for page_id in self._free), "a free page is marked in use"
        assert self._is_used.count(False) == len(self._free), "a page is neither free nor in use"
