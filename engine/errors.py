"""Errors the engine raises for the user to read: a message and a hint, never a traceback."""

from __future__ import annotations


class EngineError(Exception):
    """An error with a message for the user and a hint of what to do about it."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class ModelLoadError(EngineError):
    """A model could not be found, read or loaded."""


class TokenizerMismatchError(EngineError):
    """Target and draft tokenizers differ, so draft tokens mean nothing to the target."""


class ContextOverflowError(EngineError):
    """The prompt does not fit the context window, even after dropping old turns."""


class FetchError(EngineError):
    """Model files could not be obtained or did not verify."""


class QuantizationError(EngineError):
    """A quantization mode cannot work with this model or machine."""


class OutOfMemoryError(EngineError):
    """Loading or decoding would exhaust memory."""
