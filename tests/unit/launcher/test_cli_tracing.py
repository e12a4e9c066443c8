"""--otlp-traces-endpoint: off unless given; `tandem serve` hands it to the gateway and every worker,
through the JSON hand-off; a value that is no collector URL stops the command with the reason."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig
from launcher.flags import build_parser
from launcher.handoff import from_json, to_json
from launcher.serve import stack_configs
from server_runtime.config import WorkerConfig

ENDPOINT = "http://127.0.0.1:4317"


def _stack(*flags: str):
    return stack_configs(build_parser().parse_args(["serve", "--dtype", "float32", *flags]))


def test_off_unless_given_then_every_child_exports_to_it() -> None:
    assert [c.otlp_traces_endpoint for c in _stack().children] == [None, None, None]
    stack = _stack("--otlp-traces-endpoint", ENDPOINT, "--prefill-workers", "2")
    assert [c.otlp_traces_endpoint for c in stack.children] == [ENDPOINT] * 4
    assert from_json(GatewayConfig, to_json(stack.gateway), {}).otlp_traces_endpoint == ENDPOINT
    assert from_json(WorkerConfig, to_json(stack.prefill), {}).otlp_traces_endpoint == ENDPOINT


@pytest.mark.parametrize("command", [["gateway", "--prefill", "p:1", "--decode", "d:2"], ["prefill"], ["decode"]])
def test_each_server_alone_takes_the_flag(command: list[str]) -> None:
    args = build_parser().parse_args([*command, "--otlp-traces-endpoint", ENDPOINT])
    assert args.otlp_traces_endpoint == ENDPOINT


def test_a_bare_host_and_port_is_refused_with_the_reason() -> None:
    with pytest.raises(SystemExit, match="otlp_traces_endpoint must be a URL such as http://host:4317"):
        _stack("--otlp-traces-endpoint", "collector:4317")
