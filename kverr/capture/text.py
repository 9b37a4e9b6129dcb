"""Real text to capture on: the Python documentation topics that ship with every Python, or a file.

``"pydoc"`` is ``pydoc_data.topics.topics`` (the help texts of Python's keywords, statements and
special methods; about 110k tokens of English technical prose), joined in sorted key order with a
blank line between topics, so the text and its sha256 depend only on the Python version.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kverr.errors import TextError

log = logging.getLogger(__name__)

__all__ = ["Text", "load_text", "tokenize"]


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
            raise TextError(f"text file {source!r} not found; pass --text pydoc or a UTF-8 file")
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


def _adds_bos(tokenizer: Any) -> bool:
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
    if n_tokens < 1:
        raise TextError(f"the number of tokens must be at least 1, got {n_tokens}")
    if offset < 0:
        raise TextError(f"the token offset must be 0 or more, got {offset}")
    body = text.text if isinstance(text, Text) else text
    source = text.source if isinstance(text, Text) else "the text"
    bos = _adds_bos(tokenizer) if add_bos is None else add_bos
    if bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise TextError("add_bos=True but the tokenizer has no BOS token")
    ids = tokenizer(body, add_special_tokens=False, verbose=False)["input_ids"]
    n_text = n_tokens - int(bos)
    available = len(ids) - offset
    if available < n_text:
        raise TextError(
            f"{source} has {len(ids)} tokens; {n_text} from offset {offset} were asked for "
            f"(at most {max(available, 0) + int(bos)} tokens at this offset): ask for fewer "
            "tokens, a smaller offset or a longer text"
        )
    window = ids[offset : offset + n_text]
    if bos:
        window = [tokenizer.bos_token_id, *window]
    return np.asarray(window, dtype=np.int64)
