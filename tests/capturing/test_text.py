"""Text sources and tokenization windows."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kverr.capturing import load_text, tokenize
from kverr.capturing.tiny import _byte_tokenizer
from kverr.exceptions import TextError


@pytest.fixture(scope="module")
def tok():
    return _byte_tokenizer()


def test_pydoc_is_the_topics_joined_in_sorted_order():
    from pydoc_data.topics import topics

    text = load_text("pydoc")
    expected = "\n\n".join(topics[k] for k in sorted(topics))
    assert text.text == expected and text.source == "pydoc"
    assert text.sha256 == hashlib.sha256(expected.encode()).hexdigest()
    assert len(text.text) > 400_000
    assert load_text("pydoc") == text  # deterministic


def test_file_source(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("Grüße, KV cache ✓\n", encoding="utf-8")
    text = load_text(str(path))
    assert text.text == "Grüße, KV cache ✓\n" and text.source == str(path.resolve())
    assert text.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_bad_files(tmp_path):
    with pytest.raises(TextError, match="not found"):
        load_text(str(tmp_path / "missing.txt"))
    with pytest.raises(TextError, match="not found"):
        load_text(str(tmp_path))  # a directory
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("Grüße".encode("latin-1"))
    with pytest.raises(TextError, match="not UTF-8.*offset 2"):
        load_text(str(latin))
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\n")
    with pytest.raises(TextError, match="empty"):
        load_text(str(blank))


def test_tokenize_windows(tok):
    text = load_text("pydoc")
    ids = tokenize(tok, text, 300, add_bos=False)
    assert ids.dtype == np.int64 and ids.shape == (300,)
    shifted = tokenize(tok, text, 200, offset=100, add_bos=False)
    assert np.array_equal(shifted, ids[100:])
    with_bos = tokenize(tok, text, 300, add_bos=True)
    assert with_bos[0] == tok.bos_token_id and np.array_equal(with_bos[1:], ids[:299])
    # Default: what the tokenizer does by default (this one adds no BOS).
    assert np.array_equal(tokenize(tok, text, 300), ids)
    assert tok.decode(ids) == text.text.encode()[:300].decode("utf-8", errors="ignore")[: len(tok.decode(ids))]


def test_tokenize_rejects_impossible_windows(tok):
    with pytest.raises(TextError, match=r"has 5 tokens; 6 from offset 0.*at most 5"):
        tokenize(tok, "hello", 6)
    with pytest.raises(TextError, match=r"from offset 3.*at most 2"):
        tokenize(tok, "hello", 3, offset=3)
    assert list(tokenize(tok, "hello", 2, offset=3)) == list(tokenize(tok, "lo", 2))
    with pytest.raises(TextError, match="at least 1"):
        tokenize(tok, "hello", 0)
    with pytest.raises(TextError, match="offset"):
        tokenize(tok, "hello", 1, offset=-1)
