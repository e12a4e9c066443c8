"""KV write grants: a grant verifies only for its own request, destination, pages and lifetime, once."""

from __future__ import annotations

import logging

import pytest

from server_runtime.kv_grants import GrantChecker, GrantError, IssuedGrants, grant_key, sign
from tandem.v1 import common_pb2

SECRET = "the-workers-grant-secret-0123456789"
TOKEN = "the-cluster-internal-token-0123456789"   # what the gateway holds too


def _target(page_ids=(3, 4, 5)) -> common_pb2.KvTarget:
    return common_pb2.KvTarget(session_id="127.0.0.1:17000", base_addr=4096, page_ids=list(page_ids))


def _issued(rid: str = "victim", ttl_s: float = 30) -> tuple[IssuedGrants, common_pb2.KvTarget]:
    grants = IssuedGrants(grant_key(SECRET))
    target = _target()
    grants.issue(rid, target, ttl_s)
    return grants, target


def test_the_issued_grant_verifies_once() -> None:
    _, target = _issued()
    checker = GrantChecker(grant_key(SECRET))
    checker.check("victim", target)
    with pytest.raises(GrantError, match="already used"):
        checker.check("victim", target)


@pytest.mark.parametrize("tamper", [
    lambda t: t.page_ids.append(6),                      # one page more
    lambda t: t.page_ids.__setitem__(0, 9),              # another page
    lambda t: setattr(t, "base_addr", 8192),
    lambda t: setattr(t, "session_id", "10.0.0.9:17000"),
    lambda t: setattr(t, "grant_expires_unix_ms", t.grant_expires_unix_ms + 60_000),   # a longer life
    lambda t: setattr(t, "grant", "0" * 64),            # made up
    lambda t: setattr(t, "grant", ""),                  # none
])
def test_any_change_to_the_target_voids_the_grant(tamper) -> None:
    _, target = _issued()
    tamper(target)
    with pytest.raises(GrantError, match="not valid"):
        GrantChecker(grant_key(SECRET)).check("victim", target)


def test_a_grant_is_for_one_request_and_one_key() -> None:
    _, target = _issued("attacker")
    with pytest.raises(GrantError):   # the attacker's own grant, aimed as the victim
        GrantChecker(grant_key(SECRET)).check("victim", target)
    with pytest.raises(GrantError):   # a cluster with another grant secret
        GrantChecker(grant_key("another-cluster-grant-secret-98765")).check("attacker", target)


@pytest.mark.parametrize("forger_key", [grant_key(TOKEN), grant_key(None), grant_key("made-up-secret-0123456789")])
def test_a_token_holder_cannot_mint_a_grant_for_the_victims_pages(forger_key: bytes,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """What a gateway (or anyone with the internal token) could sign is refused, and the refusal logged."""
    _, genuine = _issued("victim")
    forged = _target(genuine.page_ids)
    sign(forger_key, "victim", forged, ttl_s=30)
    with caplog.at_level(logging.WARNING, logger="server_runtime.kv_grants"):
        with pytest.raises(GrantError, match="not valid"):
            GrantChecker(grant_key(SECRET)).check("victim", forged)
    assert "refused a KV grant for victim" in caplog.text
    GrantChecker(grant_key(SECRET)).check("victim", genuine)   # the decode side's own grant still works


def test_an_expired_grant_is_refused() -> None:
    _, target = _issued(ttl_s=-1)
    with pytest.raises(GrantError, match="expired"):
        GrantChecker(grant_key(SECRET)).check("victim", target)


def test_generate_needs_the_issued_grant_and_a_wrong_one_leaves_it() -> None:
    grants, target = _issued()
    with pytest.raises(GrantError):
        grants.redeem("victim", "f" * 64)
    with pytest.raises(GrantError):
        grants.redeem("nobody", target.grant)
    grants.redeem("victim", target.grant)   # the wrong attempts did not drop it
    with pytest.raises(GrantError):
        grants.redeem("victim", target.grant)


def test_a_revoked_grant_can_no_longer_start_a_write() -> None:
    _, target = _issued()
    checker = GrantChecker(grant_key(SECRET))
    checker.revoke("victim", target)
    with pytest.raises(GrantError, match="already used"):
        checker.check("victim", target)
    checker.revoke("victim", target)   # once spent (by a write or a cancel), a revoke is still fine


def test_revoke_verifies_the_grant_first() -> None:
    _, target = _issued()
    checker = GrantChecker(grant_key(SECRET))
    with pytest.raises(GrantError, match="not valid"):
        checker.revoke("someone-else", target)
    checker.check("victim", target)   # the failed revoke spent nothing


def test_an_expired_grant_is_accepted_by_revoke_and_not_remembered() -> None:
    _, target = _issued(ttl_s=-1)
    checker = GrantChecker(grant_key(SECRET))
    checker.revoke("victim", target)
    assert not checker._used
