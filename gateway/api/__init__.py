"""The HTTP front: routes (OpenAI, SGLang native, vLLM, Anthropic, Responses, admin, embeddings, scoring,
experts) and middleware.

A route parses, calls an operation (`gateway/service/`), formats the HTTP answer."""
