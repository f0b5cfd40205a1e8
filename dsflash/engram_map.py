"""Engram token compression (SPEC_V41 §9.2 and §16b.11): tokenizer id -> compressed id.

Every id ``0..len(tokenizer)-1`` is decoded on its own (special tokens kept) and normalised:
NFKC -> NFD -> strip accents -> lowercase -> collapse runs of ``[ \\t\\r\\n]`` to one space -> a text
that is then exactly one space is kept (via a private-use sentinel) -> strip -> sentinel back to a
space. Ids whose keys are equal share a compressed id; compressed ids are handed out in first-seen
order. Two exceptions decide the key:

* the decoding contains U+FFFD (a partial UTF-8 byte sequence): the key is the raw token string
  (``id_to_token``), so such byte tokens stay distinct;
* the normalised text is empty (e.g. ``\\x0b``, ``\\x0c``, a zero-width character): the key is the
  decoded text itself (§16b.11), so such tokens stay distinct too.

The normaliser is built from the ``tokenizers`` library's own normalizers, the same primitives the
official builder uses, so the Unicode tables (NFKC, lowercase, whitespace) agree with it exactly.
For the released tokenizer the compressed vocabulary is 99,092 (``cfg.engram_compressed_vocab_size``);
:func:`check_compressed_vocab_size` asserts that.
"""
from __future__ import annotations

import os
from functools import lru_cache

import numpy as np

_SENTINEL = "\ue000"  # private use: survives NFKC/lowercase/strip untouched


@lru_cache(maxsize=1)
def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def normalize_token_text(text: str) -> str:
    """The §9.2 normalisation of one decoded token (without the empty / U+FFFD key rules)."""
    return _normalizer().normalize_str(text)


def _backend(tokenizer):
    """A ``tokenizers.Tokenizer`` from a dsflash Tokenizer, an HF fast tokenizer, or itself."""
    if hasattr(tokenizer, "hf"):                  # dsflash.tokenizer.Tokenizer
        return tokenizer.hf
    if hasattr(tokenizer, "backend_tokenizer"):   # transformers PreTrainedTokenizerFast
        return tokenizer.backend_tokenizer
    if hasattr(tokenizer, "decode") and hasattr(tokenizer, "id_to_token"):
        return tokenizer
    raise ValueError("build_compressed_token_map: tokenizer must be a dsflash Tokenizer, a "
                     f"tokenizers.Tokenizer or a fast HF tokenizer, got {type(tokenizer).__name__}")


def _length(tokenizer, backend) -> int:
    try:
        return len(tokenizer)
    except TypeError:
        return backend.get_vocab_size(with_added_tokens=True)


def compressed_key(backend, token_id: int) -> str:
    """The key under which ``token_id`` is merged (see the module docstring)."""
    text = backend.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text:
        raw = backend.id_to_token(token_id)
        return raw if raw is not None else ""
    norm = normalize_token_text(text)
    return norm if norm else text


def build_compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """``(lookup, compressed_vocab_size)``: ``lookup`` is int32 ``[len(tokenizer)]`` with
    ``lookup[token_id]`` = compressed id, assigned in first-seen order over ids 0..len-1."""
    backend = _backend(tokenizer)
    n = _length(tokenizer, backend)
    key_to_id: dict[str, int] = {}
    lookup = np.empty((n,), dtype=np.int32)
    for i in range(n):
        k = compressed_key(backend, i)
        c = key_to_id.get(k)
        if c is None:
            c = len(key_to_id)
            key_to_id[k] = c
        lookup[i] = c
    return lookup, len(key_to_id)


def check_compressed_vocab_size(size: int, cfg) -> None:
    """Raise ValueError unless ``size == cfg.engram_compressed_vocab_size`` (99,092 for V4.1): the
    size feeds every Engram hash multiplier, so a mismatch silently rehashes the whole table."""
    want = int(cfg.engram_compressed_vocab_size)
    if int(size) != want:
        raise ValueError(f"Engram compressed vocabulary: the tokenizer gives {size} compressed ids but "
                         f"ModelConfig.engram_compressed_vocab_size is {want}; wrong tokenizer for this "
                         "checkpoint, or a config whose engram_compressed_vocab_size must be updated")


def load_or_build_compressed_token_map(tokenizer, cache_path: str | os.PathLike | None = None
                                       ) -> tuple[np.ndarray, int]:
    """Build the map, or load it from ``cache_path`` (``.npy``) when present; building it for the
    129k-id tokenizer takes a few seconds, so servers may cache it beside the checkpoint."""
    if cache_path is not None and os.path.isfile(cache_path):
        lookup = np.load(cache_path).astype(np.int32, copy=False)
        n = _length(tokenizer, _backend(tokenizer))
        if lookup.shape == (n,):
            return lookup, int(lookup.max()) + 1 if n else 0
    lookup, size = build_compressed_token_map(tokenizer)
    if cache_path is not None:
        tmp = os.fspath(cache_path) + ".tmp.npy"
        np.save(tmp, lookup)
        os.replace(tmp, cache_path)
    return lookup, size
