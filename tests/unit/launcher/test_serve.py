"""`tandem serve` builds its three configs from one parse of its flags: one token, the workers on
loopback where the gateway finds them, an embedding stack without decode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine.config import EngineConfig
from gateway.config import GatewayConfig
from kv_transfer import TransportConfig
from launcher.defaults import default_torch_threads, field_default
from launcher.flags import build_parser
from launcher.handoff import HANDOFF_FLAG
from launcher.serve import child_name, child_spec, stack_configs
from server_runtime.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[3]


def _stack(*flags: str):
    return stack_configs(build_parser().parse_args(["serve", "--dtype", "float32", *flags]))


def test_the_gateway_finds_both_workers_and_all_three_share_one_token(tmp_path: Path) -> None:
    stack = _stack("--prefill-port", "40001", "--decode-port", "40002", "--port", "40000",
                   "--served-model-name", "smol", "--data-dir", str(tmp_path), "--drain-timeout", "7")
    assert stack.decode is not None
    assert (stack.gateway.prefill_addrs, stack.gateway.decode_addrs) == (("127.0.0.1:40001",), ("127.0.0.1:40002",))
    assert (stack.gateway.port, stack.gateway.served_model_name, stack.gateway.data_dir) == (40000, "smol",
                                                                                             str(tmp_path))
    assert stack.prefill.credentials == stack.decode.credentials == stack.gateway.internal
    assert [c.drain_timeout_s for c in stack.children] == [7, 7, 7]
    assert (stack.prefill.engine.enable_prefix_cache, stack.decode.engine.enable_prefix_cache) == (True, True)
    assert (stack.prefill.torch_threads, stack.decode.torch_threads) == (
        default_torch_threads("prefill"), default_torch_threads("decode"))
    assert (stack.prefill.max_torch_threads, stack.decode.max_torch_threads) == (0, default_torch_threads("prefill"))
    fixed = _stack("--torch-threads", "3")   # a count given is kept: no tuning
    assert [(c.torch_threads, c.max_torch_threads) for c in fixed.children[:2]] == [(3, 0), (3, 0)]


def test_an_embedding_stack_has_no_decode_and_no_grant_secret() -> None:
    stack = _stack("--is-embedding")
    assert stack.decode is None and stack.prefill.is_embedding and stack.gateway.is_embedding
    assert stack.prefill.kv_grant_secret is None and stack.gateway.decode_addrs == ()
    assert [type(c).__name__ for c in stack.children] == ["WorkerConfig", "GatewayConfig"]


def test_each_child_is_told_its_role_and_log_level_and_nothing_else_on_its_command_line() -> None:
    stack = _stack("--api-key", "user-key-0123456789", "--max-total-tokens", "4096")
    specs = [child_spec(config, "debug") for config in stack.children]
    assert [(s.name, s.args) for s in specs] == [(role, (role, "--log-level", "debug", HANDOFF_FLAG))
                                                 for role in ("prefill", "decode", "gateway")]
    assert '"max_total_tokens": 4096' in specs[0].config and "user-key" not in repr(specs[2])


def test_flags_left_unset_take_the_config_fields_defaults() -> None:
    stack = _stack()
    assert stack.decode is not None
    gateway_defaults = GatewayConfig(model_path="m", served_model_name="m", prefill_addrs=("p:1",),
                                     decode_addrs=("d:2",), data_dir="/d")
    for name in ("host", "port", "prefill_timeout_s", "request_timeout_s", "stall_timeout_s", "max_queued_requests",
                 "max_queue_wait_s", "batch_concurrency", "max_batch_requests", "max_request_body_bytes",
                 "drain_timeout_s"):
        assert getattr(stack.gateway, name) == getattr(gateway_defaults, name), name
    for name in ("reservation_ttl_s", "write_grace_s", "grammar_compile_timeout_s", "drain_timeout_s"):
        assert getattr(stack.decode, name) == field_default(WorkerConfig, name), name
    engine, transport = EngineConfig(), TransportConfig()
    for name in ("page_size", "max_total_tokens", "kv_cache_gib", "max_running_requests", "max_prefill_tokens",
                 "context_len", "attention_backend", "sampling_backend", "int8_activations"):
        assert getattr(stack.decode.engine, name) == getattr(engine, name), name
    for name in ("backend", "protocol", "device_name", "transfer_timeout_s"):
        assert getattr(stack.decode.transport, name) == getattr(transport, name), name


def test_the_command_line_loads_no_torch() -> None:
    """The parser reads the configs' defaults from modules that import no torch, so that `tandem
    healthcheck` (a container's probe) stays quick."""
    code = "import sys; from launcher.cli import main; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_many_workers_take_consecutive_ports_and_share_the_cores() -> None:
    stack = _stack("--prefill-workers", "2", "--decode-workers", "3", "--prefill-port", "40001")
    assert [w.port for w in stack.prefills] == [40001, 40002]
    assert [w.port for w in stack.decodes] == [40003, 40004, 40005]   # right after the prefill workers
    assert [w.metrics_port for w in stack.children[:5]] == [40101, 40102, 40103, 40104, 40105]
    assert stack.gateway.prefill_addrs == ("127.0.0.1:40001", "127.0.0.1:40002")
    assert len(stack.gateway.decode_addrs) == 3
    assert [w.torch_threads for w in stack.children[:5]] == [default_torch_threads("prefill", 2, 3)] * 2 + [
        default_torch_threads("decode", 2, 3)] * 3
    assert len({w.kv_grant_secret for w in stack.children[:5]}) == 1
    names = [child_spec(c, "info", child_name(stack, c)).name for c in stack.children]
    assert names == ["prefill-1", "prefill-2", "decode-1", "decode-2", "decode-3", "gateway"]


def test_ports_two_servers_would_share_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="port 40002"):
        _stack("--prefill-workers", "2", "--prefill-port", "40001", "--decode-port", "40002")
    with pytest.raises(SystemExit):
        _stack("--decode-workers", "0")
    assert "--decode-workers: must be positive, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("cores", "workers", "expected"), [
    (2, (1, 1), (2, 1)),      # the measured case: prefill bursts on both cores, decode keeps one thread
    (16, (1, 1), (16, 8)),
    (16, (2, 3), (8, 3)),
    (1, (1, 1), (1, 1)),
    (4, (1, 0), (4, 4)),      # an embedding stack: no decode worker
])
def test_default_threads_give_prefill_the_cores_and_decode_its_share(
        monkeypatch: pytest.MonkeyPatch, cores: int, workers: tuple[int, int], expected: tuple[int, int]) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))   # the machine's cores
    assert (default_torch_threads("prefill", *workers), default_torch_threads("decode", *workers)) == expected


def test_prefix_cache_flags_reach_each_role(tmp_path: Path) -> None:
    both = _stack("--kv-disk-cache-dir", str(tmp_path / "kv"), "--kv-disk-cache-gb", "2", "--kv-host-cache-gb", "0.5")
    assert both.decode is not None
    for engine in (both.prefill.engine, both.decode.engine):
        assert engine.enable_prefix_cache and engine.kv_disk_cache_dir == str(tmp_path / "kv")
        assert (engine.kv_disk_cache_gib, engine.kv_host_cache_gib) == (2.0, 0.5)
    apart = _stack("--disable-decode-prefix-cache", "--kv-disk-cache-dir", str(tmp_path / "kv"))
    assert apart.decode is not None and apart.prefill.engine.kv_disk_cache_dir == str(tmp_path / "kv")
    assert (apart.decode.engine.enable_prefix_cache, apart.decode.engine.kv_disk_cache_dir) == (False, None)
    none = _stack("--disable-prefix-cache")
    assert none.decode is not None
    assert not none.prefill.engine.enable_prefix_cache and not none.decode.engine.enable_prefix_cache
    off = _stack("--kv-disk-cache-dir", str(tmp_path / "kv"), "--kv-disk-cache-gb", "0")   # compose's default
    assert off.prefill.engine.kv_disk_cache_dir is None
    with pytest.raises(SystemExit):
        _stack("--kv-disk-cache-gb", "-1")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="cannot write there"):   # one line at start-up, before any weight
        _stack("--kv-disk-cache-dir", str(tmp_path / "a-file" / "kv"))


def test_kv_store_alone_starts_a_store_the_workers_use_and_an_address_names_one_elsewhere(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _stack().kv_store is None and _stack().prefill.kv_store is None
    started = _stack("--kv-store", "--kv-store-port", "41000", "--kv-store-gb", "0.5", "--prefill-workers", "2")
    assert started.kv_store is not None and started.kv_store.address == "127.0.0.1:41000"
    assert [c.kv_store for c in started.prefills + started.decodes] == ["127.0.0.1:41000"] * 3
    spec = started.kv_store.child_spec("info")
    assert spec.args == ("kv-store", "--host", "127.0.0.1", "--port", "41000", "--memory-gb", "0.5",
                         "--log-level", "info")
    assert not spec.is_essential  # the stack serves on without it
    assert not {"TANDEM_INTERNAL_TOKEN", "TANDEM_KV_GRANT_SECRET"} & set(spec.env)  # the store holds no secret
    elsewhere = _stack("--kv-store", "10.0.0.5:50151")
    assert elsewhere.kv_store is None and elsewhere.decode is not None
    assert (elsewhere.prefill.kv_store, elsewhere.decode.kv_store) == ("10.0.0.5:50151", "10.0.0.5:50151")
    assert _stack("--kv-store", "", "--prefill-workers", "1").prefill.kv_store is None
    with pytest.raises(SystemExit, match="port 41001 would be both"):   # the store's metrics port
        _stack("--kv-store", "--kv-store-port", "41000", "--prefill-port", "41001", "--decode-port", "41002")
    with pytest.raises(SystemExit):
        _stack("--kv-store", "--kv-store-gb", "0")
    assert "--kv-store-gb: must be above 0" in capsys.readouterr().err


def test_a_worker_alone_needs_the_stores_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.configs import worker_config

    def config(*flags: str) -> WorkerConfig:
        args = build_parser().parse_args(["decode", "--dtype", "float32", *flags])
        return worker_config(args, role="decode", host="127.0.0.1", port=40002, metrics_port=0,
                             credentials=stack_configs(build_parser().parse_args(["serve"])).decode.credentials,
                             kv_grant_secret="s" * 32, torch_threads=1)

    assert config("--kv-store", "store.internal:50151").kv_store == "store.internal:50151"
    with pytest.raises(SystemExit, match="--kv-store needs the store's HOST:PORT"):
        config("--kv-store")
    with pytest.raises(SystemExit, match="kv_store must be the store's host:port"):
        config("--kv-store", "store.internal")
