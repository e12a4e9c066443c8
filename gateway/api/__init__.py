"""The HTTP routes (OpenAI, SGLang native, vLLM, admin, embeddings, experts), their schemas and middleware.

A route parses, calls a service (`gateway/service/`), formats."""
