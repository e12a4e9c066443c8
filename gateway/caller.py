"""Who a request is for and how urgent it is: the tenant the admission queue is fair between, whether
it is a batch line, which runs below every interactive request, and the body's `priority` (lower is
served first, vLLM's convention; `checked_priority`).

The tenant is the `x-tandem-tenant` header (or llm-d's `x-llm-d-inference-fairness-id`) when given,
else the API key the request presented, as `key-` and 12 hex digits of its sha256 (never the key),
else "" (every anonymous caller is one tenant). The headers are trusted as sent: a deployment whose
clients must not pick their tenant sets them at its proxy. The fronts bind the caller per request
(`bind_caller`: the HTTP middleware `gateway/api/caller_middleware.py`, the gRPC API per call, the
batch runner per line, as a batch caller), and `run_handoff` reads it, as the request id is read from
the log context.
"""

from __future__ import annotations

import contextvars
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.errors import bad_request
from tandem.limits import BATCH_PRIORITY_OFFSET, MAX_TENANT_LEN, PRIORITY

TENANT_HEADERS = ("x-tandem-tenant", "x-llm-d-inference-fairness-id")


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str = ""
    is_batch: bool = False

    def rank(self, priority: int) -> int:
        """The priority the admission queue and the workers order by: a batch line's below every
        interactive request's, in its own order."""
        return priority + BATCH_PRIORITY_OFFSET if self.is_batch else priority


_ANONYMOUS = Caller()
_current: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("tandem_caller", default=None)


def bind_caller(caller: Caller) -> None:
    """The caller of the request this task (and the tasks it starts) serves."""
    _current.set(caller)


def current_caller() -> Caller:
    """The bound caller; an anonymous interactive one where none is bound (an admin route's warm-up)."""
    return _current.get() or _ANONYMOUS


def caller_from(headers: Iterable[tuple[str, str]]) -> Caller:
    """The caller of a request with these (lower-case name, value) headers or gRPC metadata. Raises a
    400 naming the header for a tenant that is empty, longer than `MAX_TENANT_LEN`, not printable
    ASCII, or given twice with two values."""
    tenants: dict[str, str] = {}
    key = ""
    for name, value in headers:
        if name in TENANT_HEADERS:
            if tenants and value not in tenants.values():
                raise bad_request(
                    f"{name} and {next(iter(tenants))} name different tenants; send one", name, "invalid_tenant"
                )
            tenants[name] = value
        elif name == "authorization" and value.lower().startswith("bearer "):
            key = value[len("bearer ") :].strip()
        elif name == "x-api-key" and not key:
            key = value.strip()
    if tenants:
        name, tenant = next(iter(tenants.items()))
        _check_tenant(name, tenant)
    elif key:
        tenant = "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    else:
        tenant = ""
    return Caller(tenant)


def checked_priority(value: int | None, param: str = "priority") -> int:
    """A body's `priority` (None: 0); a 400 naming `param` when it is out of `tandem.limits.PRIORITY`."""
    if value is None:
        return 0
    if value not in PRIORITY:
        raise bad_request(PRIORITY.error(param, value), param)
    return value


def _check_tenant(name: str, tenant: str) -> None:
    if not tenant or len(tenant) > MAX_TENANT_LEN or not (tenant.isascii() and tenant.isprintable()):
        raise bad_request(f"{name} must be 1 to {MAX_TENANT_LEN} printable ASCII characters", name, "invalid_tenant")
