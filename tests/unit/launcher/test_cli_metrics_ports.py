"""Which metrics port each worker gets: its flag, else its gRPC port + 100, and what `tandem serve` passes."""

from __future__ import annotations

from launcher.flags import build_parser
from launcher.serve import stack_configs
from launcher.worker_flags import metrics_port


def test_a_worker_defaults_to_its_grpc_port_plus_100_and_0_turns_it_off() -> None:
    args = build_parser().parse_args(["decode", "--port", "31002"])
    assert metrics_port(args.metrics_port, args.port) == 31102
    args = build_parser().parse_args(["prefill", "--port", "31001", "--metrics-port", "0"])
    assert metrics_port(args.metrics_port, args.port) == 0
    assert metrics_port(None, 0) == 0 and metrics_port(None, 65500) == 0   # no such port: off
    assert metrics_port(9100, 31001) == 9100


def test_serve_takes_one_metrics_port_per_worker() -> None:
    args = build_parser().parse_args(["serve", "--dtype", "float32", "--prefill-port", "40001",
                                      "--decode-metrics-port", "9102"])
    stack = stack_configs(args)
    assert stack.decode is not None
    assert (stack.prefill.port, stack.prefill.metrics_port) == (40001, 40101)
    assert (stack.decode.port, stack.decode.metrics_port) == (40002, 9102)   # right after the prefill worker
