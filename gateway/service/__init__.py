"""The generation logic the OpenAI, native and gRPC fronts share, below all of them."""
