"""Weight loading: open a local HF safetensors directory or GGUF file as a `Checkpoint`.

`open_checkpoint(path)` reads the config and tensor table and validates them; `Checkpoint.tensors()`
then streams `(HF parameter name, tensor)` pairs for a model to copy into its parameters.
"""

from engine.weights.checkpoint import Checkpoint, open_checkpoint

__all__ = ["Checkpoint", "open_checkpoint"]
