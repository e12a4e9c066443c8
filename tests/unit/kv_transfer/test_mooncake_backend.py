"""What the Mooncake backend does before Mooncake runs (kv_transfer/mooncake_backend.py): its settings,
and a missing Mooncake. Transfers over a real engine are covered by test_transport_contract.py and
tests/integration/test_mooncake_transport.py."""

import logging
import os
import sys

import pytest

from kv_transfer import KVTransferError, TransportConfig, create_transport
from kv_transfer.mooncake_backend import _set_mooncake_environment


def test_mooncake_times_out_before_its_caller_and_logs_warnings_only(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    environ: dict[str, str] = {}
    monkeypatch.setattr(os, "environ", environ)
    caplog.set_level(logging.INFO, logger="kv_transfer.mooncake_backend")
    _set_mooncake_environment(TransportConfig(transfer_timeout_s=20.0))
    assert environ == {"MC_TRANSFER_TIMEOUT": "16", "MC_LOG_LEVEL": "WARNING"}
    environ.clear()
    caplog.set_level(logging.DEBUG, logger="kv_transfer.mooncake_backend")
    _set_mooncake_environment(TransportConfig(transfer_timeout_s=2.0))
    assert environ == {"MC_TRANSFER_TIMEOUT": "5", "MC_LOG_LEVEL": "INFO"}   # 5 s: Mooncake's floor


def test_mooncake_settings_in_the_environment_win(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {"MC_TRANSFER_TIMEOUT": "9", "MC_LOG_LEVEL": "INFO"}
    monkeypatch.setattr(os, "environ", environ)
    _set_mooncake_environment(TransportConfig(transfer_timeout_s=20.0))
    assert environ == {"MC_TRANSFER_TIMEOUT": "9", "MC_LOG_LEVEL": "INFO"}


def test_missing_mooncake_raises_with_install_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import mooncake.engine` fail as if it were not installed.
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(KVTransferError) as info:
        create_transport(TransportConfig(backend="mooncake"))
    message = str(info.value)
    assert "mooncake-transfer-engine-non-cuda" in message
    assert "`mooncake-transfer-engine`" in message
    assert "libibverbs1" in message
    assert isinstance(info.value.__cause__, ImportError)
