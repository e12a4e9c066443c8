"""The workers: pool, discovery, admission, the handoff and the worker client."""
