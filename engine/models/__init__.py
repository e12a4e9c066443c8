"""Model families, one module each, found through `engine.models.registry` by HF architecture name."""
