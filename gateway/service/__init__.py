"""The generation, pooling and scoring logic the HTTP and gRPC fronts share, below all of them."""
