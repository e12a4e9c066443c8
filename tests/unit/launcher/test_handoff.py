"""`tandem serve` hands each child its config: JSON on stdin with no secret in it, the secrets in the
child's own environment, and the child rebuilds the same frozen config (checked again on the way)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from gateway.config import GatewayConfig
from launcher.configs import ADMIN_API_KEY_ENV, API_KEY_ENV
from launcher.flags import build_parser
from launcher.handoff import SECRETS, child_environment, from_json, parse_handoff_args, receive_config, to_json
from launcher.internal_plane import GRANT_SECRET_ENV, GRANT_SECRET_FILE_ENV, TOKEN_ENV, TOKEN_FILE_ENV
from launcher.serve import StackConfigs, stack_configs
from server_runtime.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[3]
USER_KEY, ADMIN_KEY = "user-key-0123456789abcdef", "admin-key-0123456789abcdef"
# What `tandem serve` itself may have inherited; no child gets any of it.
PARENT_ENV = {"PATH": "/usr/bin", "TANDEM_FAULT_PREFILL_CRASH_AFTER": "3", TOKEN_FILE_ENV: "/run/token",
              GRANT_SECRET_ENV: "inherited-grant-secret-0123456789", GRANT_SECRET_FILE_ENV: "/run/grant",
              API_KEY_ENV: "inherited-user-key"}


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StackConfigs:
    """A stack with every kind of field set: secrets, TLS files, tuples, nested records."""
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("PEM")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    return stack_configs(build_parser().parse_args([
        "serve", "--dtype", "float32", "--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY,
        "--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem"),
        "--tls-ca", str(tmp_path / "ca.pem"), "--weights-dir", str(tmp_path), "--kv-host", "10.0.0.7",
        "--default-sampling", '{"top_p": 0.9}', "--data-dir", str(tmp_path / "data"), "--max-total-tokens", "4096"]))


def test_each_child_rebuilds_the_config_its_parent_built(stack: StackConfigs) -> None:
    for config in stack.children:
        assert from_json(type(config), to_json(config), child_environment(PARENT_ENV, config)) == config


def test_no_secret_is_in_the_json_and_each_child_gets_only_its_own(stack: StackConfigs) -> None:
    assert stack.decode is not None
    token, grant_secret = stack.gateway.internal.token, stack.prefill.kv_grant_secret
    assert token and grant_secret
    for config in stack.children:
        text = to_json(config)
        assert not any(secret in text for secret in (token, grant_secret, USER_KEY, ADMIN_KEY))
    envs = {name: child_environment(PARENT_ENV, config)
            for name, config in (("prefill", stack.prefill), ("decode", stack.decode), ("gateway", stack.gateway))}
    for role in ("prefill", "decode"):
        assert envs[role].items() >= {TOKEN_ENV: token, GRANT_SECRET_ENV: grant_secret}.items()
        assert API_KEY_ENV not in envs[role] and ADMIN_API_KEY_ENV not in envs[role]
    assert envs["gateway"].items() >= {TOKEN_ENV: token, API_KEY_ENV: USER_KEY, ADMIN_API_KEY_ENV: ADMIN_KEY}.items()
    assert GRANT_SECRET_ENV not in envs["gateway"]   # the gateway must not be able to forge KV write grants
    for env in envs.values():   # the rest of the parent's environment is inherited, its secret files are not
        assert env["TANDEM_FAULT_PREFILL_CRASH_AFTER"] == "3"
        assert TOKEN_FILE_ENV not in env and GRANT_SECRET_FILE_ENV not in env


def _secret_paths(cls: type, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The path of every field kept out of reprs in `cls` and the records it holds."""
    paths: set[tuple[str, ...]] = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.repr:
            paths.add((*prefix, field.name))
        elif isinstance(hints[field.name], type) and dataclasses.is_dataclass(hints[field.name]):
            paths |= _secret_paths(hints[field.name], (*prefix, field.name))
    return paths


@pytest.mark.parametrize("cls", [WorkerConfig, GatewayConfig])
def test_every_secret_field_has_a_variable_to_travel_in(cls: type) -> None:
    """A field kept out of reprs is left out of the JSON: without a variable, a child would lose it."""
    assert _secret_paths(cls) == {path for path, _ in SECRETS[cls]}


def test_a_config_that_is_not_valid_is_refused_with_the_reason(stack: StackConfigs) -> None:
    values = json.loads(to_json(stack.prefill))
    with pytest.raises(ValueError, match="unknown fields"):
        from_json(WorkerConfig, json.dumps({**values, "surprise": 1}), {})
    with pytest.raises(ValueError, match="port out of range"):
        from_json(WorkerConfig, json.dumps({**values, "port": 70000}), {})
    with pytest.raises(ValueError, match="page_size"):
        from_json(WorkerConfig, json.dumps({**values, "engine": {**values["engine"], "page_size": 3}}), {})
    with pytest.raises(SystemExit, match="not a valid GatewayConfig"):
        receive_config(GatewayConfig, io.StringIO("{"))


def test_a_child_takes_its_role_and_log_level_and_no_other_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_handoff_args(["decode", "--log-level", "debug", "--config-stdin"])
    assert (args.command, args.log_level) == ("decode", "debug")
    with pytest.raises(SystemExit):
        parse_handoff_args(["decode", "--config-stdin", "--port", "31002"])
    assert "unrecognized arguments: --port" in capsys.readouterr().err


def test_a_child_process_given_a_bad_config_exits_with_the_reason() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    done = subprocess.run([sys.executable, "-m", "launcher", "prefill", "--config-stdin"], cwd=ROOT, env=env,
                          input='{"role": "prefill"}', capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "not a valid WorkerConfig" in done.stderr and "model_path" in done.stderr
