"""What the Mooncake backend does when Mooncake cannot be imported (kv_transfer/mooncake_backend.py).
Transfers over a real engine are covered by tests/integration/test_mooncake_transport.py."""

import sys

import pytest

from kv_transfer import KVTransferError, TransportConfig, create_transport


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
