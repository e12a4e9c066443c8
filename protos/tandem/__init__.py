"""Tandem protocol packages; `tandem.v1` holds the generated gRPC stubs."""

from importlib import metadata


def version() -> str:
    """The installed tandem-serve version (every process reports the same one)."""
    try:
        return metadata.version("tandem-serve")
    except metadata.PackageNotFoundError:
        return "0+unknown"
