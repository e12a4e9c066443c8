"""gateway/caller.py: the tenant from the headers (or a hash of the presented key, never the key), the
batch rank below every interactive priority, and the 400s naming the header or `priority`."""

from __future__ import annotations

import asyncio

import pytest

from gateway.caller import Caller, bind_caller, caller_from, checked_priority, current_caller
from gateway.errors import APIError
from tandem.limits import MAX_PRIORITY


def test_the_tenant_is_the_header_else_a_hash_of_the_key_else_anonymous() -> None:
    key = "sk-secret-123"
    assert caller_from([("authorization", f"Bearer {key}"), ("x-tandem-tenant", "team-a")]).tenant == "team-a"
    assert caller_from([("x-llm-d-inference-fairness-id", "team-b")]).tenant == "team-b"
    by_key = caller_from([("authorization", f"Bearer {key}")]).tenant
    assert by_key.startswith("key-") and key not in by_key and len(by_key) == 16
    assert caller_from([("x-api-key", key)]).tenant == by_key
    assert caller_from([("authorization", "Bearer other")]).tenant != by_key
    assert caller_from([("content-type", "application/json")]) == Caller()


@pytest.mark.parametrize("headers, param", [
    ([("x-tandem-tenant", "")], "x-tandem-tenant"),
    ([("x-tandem-tenant", "t" * 129)], "x-tandem-tenant"),
    ([("x-tandem-tenant", "a\tb")], "x-tandem-tenant"),
    ([("x-tandem-tenant", "a"), ("x-llm-d-inference-fairness-id", "b")], "x-llm-d-inference-fairness-id"),
    ([("x-tandem-tenant", "a"), ("x-tandem-tenant", "b")], "x-tandem-tenant"),
])
def test_a_bad_tenant_header_is_a_400_naming_it(headers, param) -> None:
    with pytest.raises(APIError) as error:
        caller_from(headers)
    assert (error.value.status, error.value.param, error.value.code) == (400, param, "invalid_tenant")


def test_a_batch_line_ranks_below_every_interactive_priority_in_its_own_order() -> None:
    batch = Caller("b", is_batch=True)
    assert batch.rank(-MAX_PRIORITY) > Caller().rank(MAX_PRIORITY)
    assert batch.rank(-1) < batch.rank(0) and Caller().rank(3) == 3


def test_priority_is_checked_against_the_limits_table() -> None:
    assert checked_priority(None) == 0 and checked_priority(-MAX_PRIORITY) == -MAX_PRIORITY
    with pytest.raises(APIError) as error:
        checked_priority(MAX_PRIORITY + 1)
    assert error.value.status == 400 and error.value.param == "priority" and str(MAX_PRIORITY) in error.value.message


def test_a_bound_caller_is_seen_by_the_tasks_its_task_starts() -> None:
    async def main() -> tuple[Caller, Caller]:
        bind_caller(Caller("team-a"))
        return await asyncio.create_task(_current()), current_caller()

    async def _current() -> Caller:
        return current_caller()

    assert asyncio.run(main()) == (Caller("team-a"), Caller("team-a"))
    assert current_caller() == Caller()   # asyncio.run ran it in a copy of this context
