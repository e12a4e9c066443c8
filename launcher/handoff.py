"""How `tandem serve` hands each child its config: the frozen config as JSON on the child's stdin, its
secrets in the child's environment.

The child's command line is `python -m launcher <prefill|decode|gateway> --log-level L --config-stdin`
(`HANDOFF_FLAG`; `parse_handoff_args` takes nothing else). stdin, because a pipe leaves nothing
behind (no file to create readable by the user alone and to remove after), reaches this child alone
and shows in no `ps` output. The JSON holds no secret all the same: a field kept out of reprs
(`field(repr=False)`) is a secret, is left out of the JSON, and goes by environment (`SECRETS`), as
the internal token and the KV grant secret always have, so that no secret is ever in a JSON a pipe or
a debug dump might show. The child rebuilds the dataclasses, which runs every `__post_init__` check
again, then puts its secrets back from its environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from collections.abc import Mapping
from typing import IO, Any, TypeVar

from gateway.config import GatewayConfig
from launcher.configs import ADMIN_API_KEY_ENV, API_KEY_ENV
from launcher.internal_plane import GRANT_SECRET_ENV, GRANT_SECRET_FILE_ENV, TOKEN_ENV, TOKEN_FILE_ENV
from server_runtime.config import WorkerConfig

HANDOFF_FLAG = "--config-stdin"
ROLES = ("prefill", "decode", "gateway")

# Each secret of a child's config (the path of field names to it) and the variable that carries it.
SECRETS: dict[type, tuple[tuple[tuple[str, ...], str], ...]] = {
    WorkerConfig: ((("credentials", "token"), TOKEN_ENV), (("kv_grant_secret",), GRANT_SECRET_ENV)),
    GatewayConfig: (
        (("internal", "token"), TOKEN_ENV),
        (("api_key",), API_KEY_ENV),
        (("admin_api_key",), ADMIN_API_KEY_ENV),
    ),
}
# What no child inherits from `tandem serve`'s own environment: each gets its own secrets, or none.
WITHHELD_VARIABLES = frozenset(
    {TOKEN_ENV, TOKEN_FILE_ENV, GRANT_SECRET_ENV, GRANT_SECRET_FILE_ENV, API_KEY_ENV, ADMIN_API_KEY_ENV}
)

Config = TypeVar("Config", WorkerConfig, GatewayConfig)


def to_json(config: WorkerConfig | GatewayConfig) -> str:
    """`config` as JSON, every secret left out."""
    return json.dumps(_public_fields(config))


def child_environment(parent: Mapping[str, str], config: WorkerConfig | GatewayConfig) -> dict[str, str]:
    """The whole environment of the child that runs `config`: `parent`'s without any secret, plus the
    variables that carry this config's own secrets."""
    inherited = {name: value for name, value in parent.items() if name not in WITHHELD_VARIABLES}
    secrets = {variable: _get(config, path) for path, variable in SECRETS[type(config)]}
    return inherited | {variable: value for variable, value in secrets.items() if value is not None}


def from_json(cls: type[Config], text: str, environ: Mapping[str, str]) -> Config:
    """The config `to_json` wrote, with its secrets from `environ`. ValueError or TypeError when the
    JSON does not make a valid `cls` (a field unknown, missing or out of range)."""
    config = _build(cls, json.loads(text))
    for path, variable in SECRETS[cls]:
        if variable in environ:
            config = _replace(config, path, environ[variable])
    return config


def receive_config(cls: type[Config], stdin: IO[str] | None = None) -> Config:
    """A child's config, read from its stdin to the end; SystemExit with the reason when it is not valid."""
    try:
        return from_json(cls, (stdin or sys.stdin).read(), os.environ)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"the config `tandem serve` handed down is not a valid {cls.__name__}: {exc}") from None


def parse_handoff_args(argv: list[str]) -> argparse.Namespace:
    """A child's command line: its role and log level, nothing else (its config comes on stdin)."""
    parser = argparse.ArgumentParser(prog="tandem", description="A child of `tandem serve`; its config comes on stdin.")
    parser.add_argument("command", choices=ROLES)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(HANDOFF_FLAG, action="store_true", required=True)
    return parser.parse_args(argv)


def _public_fields(config: Any) -> dict[str, Any]:
    public = {}
    for field in dataclasses.fields(config):
        if field.repr:  # a field kept out of reprs is a secret
            value = getattr(config, field.name)
            public[field.name] = _public_fields(value) if dataclasses.is_dataclass(value) else value
    return public


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    """`cls(**values)`, nested dataclasses and tuples rebuilt from their JSON forms by `cls`'s hints."""
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(f"unknown fields {unknown}")
    return cls(**{name: _value(hints[name], value) for name, value in values.items()})


def _value(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    for option in options:
        if dataclasses.is_dataclass(option) and isinstance(value, Mapping):
            return _build(option, value)
        if typing.get_origin(option) is tuple and isinstance(value, list):  # a tuple of pairs too
            return tuple(tuple(item) if isinstance(item, list) else item for item in value)
    return value


def _get(config: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        config = getattr(config, name)
    return config


def _replace(config: Any, path: tuple[str, ...], value: str) -> Any:
    """`config` with the field at `path` set to `value` (each dataclass on the way checked again)."""
    inner = value if len(path) == 1 else _replace(getattr(config, path[0]), path[1:], value)
    return dataclasses.replace(config, **{path[0]: inner})
