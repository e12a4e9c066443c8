"""KV transfer: write a request's KV pages from a prefill server's pool into a decode server's pool.

Importing this package registers both backends ("mooncake", "local"); Mooncake itself is imported
only when a "mooncake" transport is created.
"""

from kv_transfer.base import (
    KVTransferError,
    KVTransferTimeout,
    KVTransport,
    RemotePages,
    TransferStats,
    TransportConfig,
    available_transports,
    check_timeout,
    create_transport,
    register_transport,
)
from kv_transfer.local_backend import LocalTransport
from kv_transfer.mooncake_backend import MooncakeTransport
from kv_transfer.pages import PageRun, WritePlan, coalesce_page_runs, plan_page_writes

__all__ = [
    "KVTransferError",
    "KVTransferTimeout",
    "KVTransport",
    "LocalTransport",
    "MooncakeTransport",
    "PageRun",
    "RemotePages",
    "TransferStats",
    "TransportConfig",
    "WritePlan",
    "available_transports",
    "check_timeout",
    "coalesce_page_runs",
    "create_transport",
    "plan_page_writes",
    "register_transport",
]
