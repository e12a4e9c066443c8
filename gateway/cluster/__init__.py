"""The workers: pool, discovery, admission, the handoff and the worker client. The gateway's only gRPC
edge: no other wing imports the `tandem.v1` stubs or `grpc` (`tests/unit/test_layering.py`)."""
