"""The internal plane's flags: where the token comes from, `tandem serve` making one, and the refusal
to open an unauthenticated plane beyond loopback (real processes for the refusals)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.flags import build_parser
from launcher.internal_plane import GRANT_SECRET_ENV, GRANT_SECRET_FILE_ENV, TOKEN_ENV, TOKEN_FILE_ENV, \
    check_open_plane, credentials_from_args, kv_grant_secret_from_args, serve_credentials
from launcher.serve import stack_configs
from tandem.internal_auth import InternalCredentials

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "token-from-somewhere-0123456789"
GRANT_SECRET = "grant-secret-of-the-workers-0123456789"
_SECRET_ENVS = (TOKEN_ENV, TOKEN_FILE_ENV, GRANT_SECRET_ENV, GRANT_SECRET_FILE_ENV)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _SECRET_ENVS:   # setenv first, so that teardown restores what was there
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    return monkeypatch


def _credentials(*argv: str) -> InternalCredentials:
    return credentials_from_args(build_parser().parse_args(["decode", *argv]))


def test_token_from_flag_file_or_environment(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _credentials().token is None
    assert _credentials("--internal-token", TOKEN).token == TOKEN
    (tmp_path / "token").write_text(f"  {TOKEN}\n")
    assert _credentials("--internal-token-file", str(tmp_path / "token")).token == TOKEN
    clean_env.setenv(TOKEN_FILE_ENV, str(tmp_path / "token"))
    assert _credentials().token == TOKEN
    clean_env.setenv(TOKEN_ENV, "from-the-environment-first")
    assert _credentials().token == "from-the-environment-first"
    with pytest.raises(SystemExit, match="internal plane"):
        _credentials("--internal-token", "short")


def test_serve_makes_its_children_a_token_unless_given_one(clean_env: pytest.MonkeyPatch) -> None:
    made = serve_credentials(build_parser().parse_args(["serve"])).token
    assert made is not None and len(made) >= 32
    assert serve_credentials(build_parser().parse_args(["serve"])).token != made   # fresh for every stack
    assert serve_credentials(build_parser().parse_args(["serve", "--internal-token", TOKEN])).token == TOKEN
    clean_env.setenv(TOKEN_ENV, TOKEN)
    assert serve_credentials(build_parser().parse_args(["serve"])).token == TOKEN
    assert os.environ.keys().isdisjoint({TOKEN_FILE_ENV, GRANT_SECRET_ENV})   # its own environment is left alone


def _grant_secret(*argv: str) -> str | None:
    args = build_parser().parse_args(["decode", *argv])
    return kv_grant_secret_from_args(args, credentials_from_args(args))


def test_grant_secret_from_file_or_environment(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _grant_secret() is None   # an open plane: the public key
    (tmp_path / "grant").write_text(f"{GRANT_SECRET}\n")
    assert _grant_secret("--kv-grant-secret-file", str(tmp_path / "grant")) == GRANT_SECRET
    clean_env.setenv(GRANT_SECRET_FILE_ENV, str(tmp_path / "grant"))
    assert _grant_secret("--internal-token", TOKEN) == GRANT_SECRET
    clean_env.setenv(GRANT_SECRET_ENV, "grant-secret-from-the-environment")
    assert _grant_secret("--internal-token", TOKEN) == "grant-secret-from-the-environment"
    assert _grant_secret("--kv-grant-secret-file", str(tmp_path / "grant")) == GRANT_SECRET   # the flag first
    for bad, reason in (("short", "at least 16"), (TOKEN, "differ from the internal token")):
        clean_env.setenv(GRANT_SECRET_ENV, bad)
        with pytest.raises(SystemExit, match=reason):
            _grant_secret("--internal-token", TOKEN)


def test_a_closed_plane_needs_a_grant_secret(clean_env: pytest.MonkeyPatch) -> None:
    """A grant key the token gives would let every token holder, the gateway included, forge grants."""
    with pytest.raises(SystemExit, match="--kv-grant-secret-file") as refused:
        _grant_secret("--internal-token", TOKEN)
    assert "the same secret to the prefill and the decode workers" in str(refused.value)


def test_serve_makes_a_fresh_grant_secret_for_its_workers_only(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(GRANT_SECRET_ENV, "inherited-by-every-child-0123456789")
    stacks = [stack_configs(build_parser().parse_args(["serve", "--dtype", "float32"])) for _ in range(2)]
    secret = stacks[0].prefill.kv_grant_secret
    assert secret is not None and len(secret) >= 32 and secret != "inherited-by-every-child-0123456789"
    assert stacks[0].decode is not None and stacks[0].decode.kv_grant_secret == secret
    assert stacks[1].prefill.kv_grant_secret != secret   # fresh for every stack
    assert secret != stacks[0].prefill.credentials.token == stacks[0].gateway.internal.token


def test_open_plane_only_on_loopback_unless_insecure(caplog: pytest.LogCaptureFixture) -> None:
    open_plane = InternalCredentials()
    check_open_plane(open_plane, ["127.0.0.1", "localhost"], False, "bind")
    check_open_plane(InternalCredentials(token=TOKEN), ["0.0.0.0"], False, "bind")
    for hosts in (["0.0.0.0"], ["::"], ["10.0.0.7"], ["127.0.0.1:30001", "10.0.0.7:30002"],
                  ["dns:///tandem-decode.invalid:30002"]):
        with pytest.raises(SystemExit, match="--insecure"):
            check_open_plane(open_plane, hosts, False, "bind")
    check_open_plane(open_plane, ["0.0.0.0"], True, "bind")
    assert "INSECURE" in caplog.text


@pytest.mark.parametrize("argv", [["prefill", "--host", "0.0.0.0"],
                                  ["prefill", "--host", "127.0.0.1", "--kv-host", "10.0.0.7"],
                                  ["decode", "--kv-host", "0.0.0.0"],
                                  ["gateway", "--prefill", "10.0.0.7:30001", "--decode", "10.0.0.7:30002"]])
def test_the_commands_refuse_an_open_plane_beyond_loopback(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENVS}
    done = subprocess.run([sys.executable, "-m", "launcher", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "no internal token is set" in done.stderr and "--insecure" in done.stderr


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_with_a_token_and_no_grant_secret_refuses_to_start(role: str) -> None:
    env = {**{k: v for k, v in os.environ.items() if k not in _SECRET_ENVS}, TOKEN_ENV: TOKEN}
    done = subprocess.run([sys.executable, "-m", "launcher", role], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "no KV grant secret is set" in done.stderr and "--kv-grant-secret-file" in done.stderr


def test_internal_token_command_writes_once(tmp_path: Path) -> None:
    path = tmp_path / "run" / "token"
    for expected in ("wrote a new", "kept the"):
        done = subprocess.run([sys.executable, "-m", "launcher", "internal-token", "--file", str(path)], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and expected in done.stdout
    assert len(path.read_text().strip()) >= 32
