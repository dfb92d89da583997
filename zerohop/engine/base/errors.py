"""Exceptions the engine raises, each with a message a user can act on."""


class ZerohopError(Exception):
    """Base class of every error zerohop raises on purpose."""


class ModelLoadError(ZerohopError):
    """A model folder is missing a file, or holds something we do not support."""


class InvalidRequestError(ZerohopError, ValueError):
    """A request's parameters or prompt are not acceptable (too long, bad values)."""


class RequestFailedError(ZerohopError):
    """Processing one request failed (sampler error, NaN, out of memory)."""


class EngineDeadError(RequestFailedError):
    """The engine (its process, or vLLM's EngineCore) has exited; no request can be served."""
