"""The one progress bar of kverr: drawn on a terminal only.

Every long loop of the library goes through :func:`progress`, so that a bar appears where a
person watches (stderr is a terminal) and never as carriage-return clutter in a redirected log.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["progress", "progress_enabled"]


def progress_enabled(enabled: bool = True) -> bool:
    """Whether a bar is drawn: asked for (``enabled``) and stderr is a terminal."""
    if not enabled:
        return False
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False


def progress(iterable: Iterable | None = None, *, enabled: bool = True, **kwargs: Any) -> Any:
    """A ``tqdm`` bar over ``iterable`` (or a manual one with ``total=``), hidden off a terminal.

    Parameters
    ----------
    iterable : iterable, optional
        What to iterate over; omit it and give ``total=`` for a bar advanced with ``update()``.
    enabled : bool
        False hides the bar even on a terminal (a caller's ``progress=False``).
    **kwargs
        Passed to ``tqdm`` (``desc``, ``total``, ``unit``, ...).

    Returns
    -------
    tqdm.tqdm
        Usable as an iterator and with ``update()``/``close()``; draws nothing when disabled.
    """
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not progress_enabled(enabled), **kwargs)
