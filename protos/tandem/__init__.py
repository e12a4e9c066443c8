"""Tandem protocol packages; `tandem.v1` holds the generated gRPC stubs."""
