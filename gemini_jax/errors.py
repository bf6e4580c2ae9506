"""Typed errors. Each one says what went wrong and what to do next.

Every error raised on bad user input derives from `GeminiJaxError`, so callers can catch the
whole family; the subclasses say which layer refused (config, weights, cache, snapshot ...).
"""

from __future__ import annotations


class GeminiJaxError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(GeminiJaxError, ValueError):
    """A configuration field holds a value that is not allowed."""


class CheckpointError(GeminiJaxError):
    """Weights on disk are missing, corrupt, or do not match the model config."""


class TokenError(GeminiJaxError, ValueError):
    """Token ids outside the vocabulary, or an empty prompt."""


class ContextLengthError(GeminiJaxError, ValueError):
    """A request would grow a sequence beyond the configured maximum length."""


class SamplingError(GeminiJaxError, ValueError):
    """Invalid sampling parameters."""


class CacheExhausted(GeminiJaxError, RuntimeError):
    """The KV page pool has no free page and nothing evictable."""


class IntegrityError(GeminiJaxError):
    """Stored data (a disk page, a snapshot) failed its checksum."""


class SnapshotError(GeminiJaxError):
    """A decode snapshot is missing, corrupt, or belongs to another model/config."""


class BudgetExceeded(GeminiJaxError, RuntimeError):
    """A request used up its compute quota."""

    def __init__(self, message: str, partial=None):
        super().__init__(message)
        self.partial = partial


class AuthError(GeminiJaxError):
    """A server request without a valid API key."""


class QuotaExceeded(GeminiJaxError):
    """A request would pass its tenant's compute-unit pool or the per-request cap."""


class SourceError(GeminiJaxError, ValueError):
    """Source code that cannot become syntax nodes: binary, too large, or not valid in its language."""


class EncoderError(GeminiJaxError, ValueError):
    """A modality encoder refused: an unknown name, inputs of the wrong shape or range, or a projector
    trained with another encoder."""
