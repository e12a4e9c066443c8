"""--api-key and --admin-api-key: flags of `tandem gateway` and `tandem serve`, else the environment;
the gateway's config gets both."""

from __future__ import annotations

import pytest

import gateway.app
from launcher.cli import _gateway
from launcher.flags import build_parser

GATEWAY_ARGS = ["gateway", "--prefill", "127.0.0.1:31001", "--decode", "127.0.0.1:31002"]


@pytest.fixture()
def started(monkeypatch, tmp_path) -> list:
    """The configs `_gateway` would serve, instead of serving them."""
    configs: list = []
    monkeypatch.setattr(gateway.app, "serve_gateway", configs.append)
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.delenv("TANDEM_ADMIN_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    return configs


def _run(*flags: str) -> None:
    _gateway(build_parser().parse_args([*GATEWAY_ARGS, "--data-dir", ".", *flags]))


def test_the_flags_reach_the_gateway_config(started: list) -> None:
    _run("--api-key", "u", "--admin-api-key", "a")
    assert (started[0].api_key, started[0].admin_api_key) == ("u", "a")


def test_the_environment_fills_in_and_a_flag_wins(started: list, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", "env-u")
    monkeypatch.setenv("TANDEM_ADMIN_API_KEY", "env-a")
    _run()
    _run("--admin-api-key", "flag-a")
    assert [(c.api_key, c.admin_api_key) for c in started] == [("env-u", "env-a"), ("env-u", "flag-a")]


def test_no_key_means_none_and_serve_takes_the_flag_too(started: list) -> None:
    _run()
    assert (started[0].api_key, started[0].admin_api_key) == (None, None)
    assert build_parser().parse_args(["serve", "--admin-api-key", "a"]).admin_api_key == "a"
