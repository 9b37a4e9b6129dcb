"""Real text to capture on: the Python documentation topics that ship with every Python, or a file.

``"pydoc"`` is ``pydoc_data.topics.topics`` (the help texts of Python's keywords, statements and
special methods; about 110k tokens of English technical prose), joined in sorted key order with a
blank line between topics, so the text and its sha256 depend only on the Python version.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kverr.exceptions import TextError

log = logging.getLogger(__name__)

__all__ = ["Text", "adds_bos", "load_text", "tokenize", "tokenize_windows"]


@dataclass(frozen=True)
class Text:
    """A text to capture on.

    Attributes
    ----------
    text : str
        The whole text.
    source : str
        ``"pydoc"`` or the resolved path of the file.
    sha256 : str
        sha256 of the text's UTF-8 bytes.
    """

    text: str
    source: str
    sha256: str


def _pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_text(source: str) -> Text:
    """Load a text source.

    Parameters
    ----------
    source : str
        ``"pydoc"`` or the path of a UTF-8 text file.

    Raises
    ------
    TextError
        The file is missing, unreadable, not UTF-8 or empty.
    """
    if source == "pydoc":
        text, name = _pydoc_text(), "pydoc"
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise TextError(f"text file {source!r} not found; give 'pydoc' or the path of a UTF-8 text file")
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise TextError(f"cannot read text file {path}: {exc}") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TextError(
                f"text file {path} is not UTF-8 (invalid byte at offset {exc.start}); "
                "convert it, e.g. with iconv -t UTF-8"
            ) from exc
        name = str(path.resolve())
    if not text.strip():
        raise TextError(f"text {name!r} is empty")
    return Text(text=text, source=name, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts a BOS token in front of a text by default."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def tokenize(
    tokenizer: Any,
    text: Text | str,
    n_tokens: int,
    offset: int = 0,
    *,
    add_bos: bool | None = None,
) -> np.ndarray:
    """Token ids of a window of a text, as the model would see them as a fresh context.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        The model's tokenizer.
    text : Text or str
        The text.
    n_tokens : int
        Number of token ids to return (BOS included, when there is one).
    offset : int
        Number of the text's tokens to skip before the window.
    add_bos : bool, optional
        Put the BOS token first; by default do what the tokenizer does by default.

    Returns
    -------
    numpy.ndarray
        ``[token]`` int64 ids, exactly ``n_tokens`` of them.

    Raises
    ------
    TextError
        ``n_tokens`` or ``offset`` is out of range, or the text is too short.
    """
    return tokenize_windows(tokenizer, text, n_tokens, [offset], add_bos=add_bos)[0]


def tokenize_windows(
    tokenizer: Any,
    text: Text | str,
    n_tokens: int,
    offsets: Sequence[int],
    *,
    add_bos: bool | None = None,
    what: str = "window",
) -> list[np.ndarray]:
    """Token ids of several windows of a text (each as :func:`tokenize` gives it), tokenizing
    the text once: every window is checked against the text's length before any is returned.

    Parameters
    ----------
    tokenizer, text, n_tokens, add_bos
        As in :func:`tokenize`.
    offsets : sequence of int
        Text tokens to skip before each window.
    what : str
        What a window is called in error messages (e.g. ``"segment"``).

    Returns
    -------
    list of numpy.ndarray
        One ``[token]`` int64 array of ``n_tokens`` ids per offset.

    Raises
    ------
    TextError
        ``n_tokens`` or an offset is out of range, or the text is too short for a window; the
        message names the first window that does not fit and how many do.
    """
    if n_tokens < 1:
        raise TextError(f"the number of tokens must be at least 1, got {n_tokens}")
    if any(off < 0 for off in offsets):
        raise TextError(f"the token offset must be 0 or more, got {min(offsets)}")
    body = text.text if isinstance(text, Text) else text
    source = text.source if isinstance(text, Text) else "the text"
    bos = adds_bos(tokenizer) if add_bos is None else add_bos
    if bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise TextError("add_bos=True but the tokenizer has no BOS token")
    ids = tokenizer(body, add_special_tokens=False, verbose=False)["input_ids"]
    n_text = n_tokens - int(bos)
    out = []
    for i, offset in enumerate(offsets):
        available = len(ids) - offset
        if available < n_text:
            which = f"{what} {i} of {len(offsets)}: " if len(offsets) > 1 else ""
            fit = f"; {i} of the {len(offsets)} {what}s fit" if len(offsets) > 1 else ""
            raise TextError(
                f"{which}{source} has {len(ids)} tokens; {n_text} from offset {offset} were asked for "
                f"(at most {max(available, 0) + int(bos)} tokens at this offset{fit}): ask for fewer "
                f"tokens{' or ' + what + 's' if len(offsets) > 1 else ''}, a smaller offset or a longer text"
            )
        window = ids[offset : offset + n_text]
        if bos:
            window = [tokenizer.bos_token_id, *window]
        out.append(np.asarray(window, dtype=np.int64))
    return out
