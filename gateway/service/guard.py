"""`Guard`: how a front stops the work of a caller that went away. The operations shared by the HTTP
routes and the gRPC API await their long steps (a whole generation, a stream's first token) through
the guard their front passes: HTTP's races the work against the client's disconnect
(`disconnect.disconnect_guard`); gRPC's is `unguarded`, since grpc.aio cancels the call's task itself
when its client cancels or its deadline passes."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Guard(Protocol):
    async def __call__(self, work: Awaitable[T], /) -> T: ...


async def unguarded(work: Awaitable[T], /) -> T:
    return await work
