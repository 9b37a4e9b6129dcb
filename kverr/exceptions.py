"""Exceptions raised by kverr.

Every error caused by bad input is a :class:`KverrError` subclass whose message names what was
wrong, the offending value and what is allowed, so that the CLI can print it as one line.
"""

from __future__ import annotations


class KverrError(Exception):
    """Base class of every error kverr raises on bad input or a failed precondition."""


class ConfigError(KverrError, ValueError):
    """A cache config, format or granularity is invalid (unknown field, bits out of range, ...)."""


class ShapeError(KverrError, ValueError):
    """Array shapes or dims do not fit together or do not fit the format."""


class DTypeError(KverrError, TypeError):
    """An array has a dtype kverr cannot work with."""


class NonFiniteError(KverrError, ValueError):
    """An input array holds NaN or Inf where finite values are required."""


class CaptureError(KverrError):
    """A capture dataset is missing, malformed, from another schema version or another model."""


class ModelError(KverrError):
    """A model cannot be found, loaded or is not supported."""


class TextError(KverrError):
    """A text source is missing, not UTF-8, or too short for what was asked."""


class BudgetError(KverrError, ValueError):
    """A memory budget cannot be met by any candidate format."""


class OutputError(KverrError, OSError):
    """An output cannot be written there (a read-only folder, a directory where a file is
    expected, a parent that is a file, a failed write)."""


class OutputExistsError(OutputError, FileExistsError):
    """An output path exists and overwriting was not asked for."""


class KernelError(KverrError):
    """A kernel launch was asked for with inputs or a device it cannot serve."""
