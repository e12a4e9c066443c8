"""The operations both fronts (HTTP, gRPC) and the batch runner call, their request and response
models, and the generation, pooling and scoring logic below them."""
