"""Errors the engine raises. `server_runtime.errors` maps each to a gRPC status code."""


class EngineError(Exception):
    """Base class for errors a request can fail with inside the engine."""


class InvalidRequestError(EngineError):
    """The request's values are invalid (bad sampling parameters, empty prompt, token out of range)."""


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested tokens do not fit the model's context."""


class CapacityError(EngineError):
    """Not enough KV pages or queue slots to take the request now."""


class LoraLoadError(InvalidRequestError, ValueError):
    """A LoRA adapter cannot be served: unreadable or unsafe files, a PEFT feature Tandem does not serve,
    shapes made for another base model, a rank over the limit, a path outside `--lora-dir`, or a name
    already loaded. The servers answer it with 400."""


class LoraNotFoundError(EngineError):
    """No adapter of this name is loaded (or it is being unloaded). The servers answer 404 `model_not_found`."""


class LoraInUseError(EngineError):
    """An adapter could not be unloaded in the time given: requests still hold it. It stays loaded."""


class RequestNotFoundError(EngineError):
    """No request or reservation with this id exists (it may have expired)."""


class RequestAbortedError(EngineError):
    """The request was aborted before it finished."""


class EngineDeadError(EngineError):
    """The engine loop stopped after an unrecoverable error; nothing more will run."""


class WouldPreemptError(Exception):
    """A call that may not preempt running requests (a step is computing them) would have to: the
    server runtime runs it again after the step. Never reaches a client."""
