"""The chart's two generated Secrets, rendered as in test_helm_chart.py: the internal token every pod
mounts and the KV grant secret only worker pods mount, each drawn anew on a first install, replaceable
by an existing Secret, never written into a pod spec; and values from before they existed still render."""

from __future__ import annotations

import base64
import re

import pytest

from tests.deploy.helm_chart import (
    GRANT_SECRET,
    RELEASE,
    TOKEN_SECRET,
    WORKERS,
    by_kind,
    container,
    deployment,
    grant_secret_file_arg,
    render,
    token_file_arg,
)

pytest.importorskip("helm_python", reason="helm-python-sdk is a test dependency (pip install '.[test]')")


def test_the_internal_token_is_a_generated_secret_every_pod_mounts(profile):
    _, _, docs = profile
    secret = by_kind(docs, "Secret")[TOKEN_SECRET]
    assert secret["type"] == "Opaque" and list(secret["data"]) == ["internal-token"]
    token = base64.b64decode(secret["data"]["internal-token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    for component in ("gateway", *WORKERS):
        assert token_file_arg(docs, component) == (TOKEN_SECRET, "internal-token")
        c = container(docs, component)
        # The token itself appears nowhere in the pod spec: not as an argument, not as a plain env value.
        assert token not in str(deployment(docs, component))
        assert not any(a.startswith("--internal-token=") for a in c["args"])


def test_each_render_draws_a_new_token_when_there_is_no_previous_secret():
    # `lookup` finds nothing without a cluster, as on a first install: the token is random, not a constant.
    tokens = {by_kind(render(None), "Secret")[TOKEN_SECRET]["data"]["internal-token"] for _ in range(3)}
    assert len(tokens) == 3


def test_the_kv_grant_secret_is_a_generated_secret_only_worker_pods_mount(profile):
    """The gateway holds the internal token; were it to hold the grant secret too, it could sign KV writes."""
    _, _, docs = profile
    secrets = by_kind(docs, "Secret")
    secret = secrets[GRANT_SECRET]
    assert secret["type"] == "Opaque" and list(secret["data"]) == ["kv-grant-secret"]
    value = base64.b64decode(secret["data"]["kv-grant-secret"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", value)
    assert value != base64.b64decode(secrets[TOKEN_SECRET]["data"]["internal-token"]).decode()
    for component in WORKERS:
        assert grant_secret_file_arg(docs, component) == (GRANT_SECRET, "kv-grant-secret")
        assert value not in str(deployment(docs, component))
    assert grant_secret_file_arg(docs, "gateway") is None
    assert GRANT_SECRET not in str(deployment(docs, "gateway"))


def test_each_render_draws_a_new_grant_secret_when_there_is_no_previous_one():
    values = {by_kind(render(None), "Secret")[GRANT_SECRET]["data"]["kv-grant-secret"] for _ in range(3)}
    assert len(values) == 3


def test_an_existing_grant_secret_replaces_the_generated_one():
    docs = render({"kvGrantSecret": {"existingSecret": "vault-grant", "key": "grant"}})
    assert GRANT_SECRET not in by_kind(docs, "Secret")
    for component in WORKERS:
        assert grant_secret_file_arg(docs, component) == ("vault-grant", "grant")
    assert grant_secret_file_arg(docs, "gateway") is None


def test_an_existing_token_secret_replaces_the_generated_one():
    docs = render({"internalToken": {"existingSecret": "vault-synced", "key": "token"}})
    assert set(by_kind(docs, "Secret")) == {GRANT_SECRET}  # the grant secret is still the chart's own
    for component in ("gateway", *WORKERS):
        assert token_file_arg(docs, component) == ("vault-synced", "token")


def test_values_from_before_the_token_and_the_policies_still_render():
    # `helm upgrade --reuse-values` from a release made before these values existed passes none of them
    # (null removes a default, as the missing key would): the chart must still render its defaults.
    docs = render(
        {
            "internalToken": None,
            "kvGrantSecret": None,
            "networkPolicy": None,
            "gateway": {"grpcPort": None, "router": None, "drainTimeoutSeconds": None},
            "prefill": {"drainTimeoutSeconds": None},
        }
    )
    assert "--drain-timeout=30" in container(docs, "prefill")["args"]
    assert not any(a.startswith("--router-policy") for a in container(docs, "gateway")["args"])  # its default
    assert {TOKEN_SECRET, GRANT_SECRET} <= set(by_kind(docs, "Secret"))
    for component in WORKERS:
        assert grant_secret_file_arg(docs, component) == (GRANT_SECRET, "kv-grant-secret")
    assert set(by_kind(docs, "NetworkPolicy")) == {f"{RELEASE}-{role}" for role in WORKERS}
    for component in ("gateway", *WORKERS):
        assert token_file_arg(docs, component) == (TOKEN_SECRET, "internal-token")
    assert "--grpc-port=30051" in container(docs, "gateway")["args"]  # the gateway's own default
