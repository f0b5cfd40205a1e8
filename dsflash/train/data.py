"""Training data that exists on every machine without downloads: CPython's own documentation.

Corpus = ``pydoc_data.topics`` (the ``help()`` topics) + the docstrings of a fixed list of stdlib modules
and their public classes / functions / methods + the Python source of those modules, cut into documents at
top-level ``def`` / ``class`` boundaries (the docs alone, ~250k tokens, are memorised within ~5 epochs by
the demo model; the source adds ~4 MB of text that every CPython install has). The text differs slightly between Python versions, so
:func:`corpus_info` records the Python version and a SHA-256 of the corpus next to every run.

Pipeline: documents -> byte-level BPE tokenizer (trained with ``tokenizers``, the V4.1 special tokens at
the low ids exactly as :func:`dsflash.tokenizer.write_synthetic_tokenizer` lays them out) -> each document
encoded as ``BOS doc EOS`` -> a held-out split by document -> the token stream of each split packed into
fixed-length sequences -> a ``grain`` MapDataset (seeded shuffle, batch, repeat).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import shutil
import sys
import warnings
from unittest import mock

import numpy as np

#: stdlib modules whose docstrings join the corpus (only pure-Python, always-present ones)
MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum",
    "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac",
    "html", "http.client", "http.server", "imaplib", "inspect", "io", "ipaddress", "itertools", "json",
    "logging", "mailbox", "math", "mimetypes", "operator", "optparse", "os", "pathlib", "pickle",
    "pkgutil", "platform", "poplib", "pprint", "queue", "random", "re", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics", "string", "struct",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace",
    "traceback", "types", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings",
    "wave", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zoneinfo",
)


def documented(mod):
    """``(full name, object, doc, kind)`` of ``mod``'s public classes and functions and their classes' public
    methods whose doc is over 40 characters, in the corpus's order (the chat stage's entries use the same)."""
    for name in sorted(vars(mod)):
        if name.startswith("_"):
            continue
        obj = vars(mod)[name]
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            full = f"{mod.__name__}.{name}"
            d = inspect.getdoc(obj)
            if d and len(d) > 40:
                yield full, obj, d, "class" if inspect.isclass(obj) else "function"
            if inspect.isclass(obj):
                for m in sorted(vars(obj)):
                    f = vars(obj)[m]
                    if m.startswith("_") or not inspect.isfunction(f):
                        continue
                    d = f.__doc__ and inspect.cleandoc(f.__doc__)
                    if d and len(d) > 40:
                        yield f"{full}.{m}", f, d, "method"


def _docs_of(mod) -> list[str]:
    d = inspect.getdoc(mod)
    return ([d] if d else []) + [f"{full}\n{doc}" for full, _, doc, _ in documented(mod)]


def _source_files(mod) -> list[str]:
    f = getattr(mod, "__file__", None)
    if not f or not f.endswith(".py"):
        return []
    if os.path.basename(f) != "__init__.py":
        return [f]
    root = os.path.dirname(f)
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if "test" not in x and not x.startswith("_"))
        out += [os.path.join(d, x) for x in sorted(files) if x.endswith(".py")]
    return out


def source_chunks(text: str, max_chars: int = 3000) -> list[str]:
    """Cut a source file at top-level ``def`` / ``class`` / decorator lines, merging pieces up to
    ``max_chars`` (a piece longer than that stays whole)."""
    pieces, cur = [], []
    for line in text.splitlines(keepends=True):
        if cur and line.startswith(("def ", "class ", "async def ", "@")) and not cur[-1].startswith("@"):
            pieces.append("".join(cur))
            cur = []
        cur.append(line)
    if cur:
        pieces.append("".join(cur))
    out, acc = [], ""
    for pc in pieces:
        if acc and len(acc) + len(pc) > max_chars:
            out.append(acc.strip("\n"))
            acc = ""
        acc += pc
    if acc.strip():
        out.append(acc.strip("\n"))
    return [c for c in out if len(c) > 40]


def corpus_documents(source: bool = True) -> list[str]:
    """The documents, in a fixed order: topics sorted by name, then the docstrings of the modules in
    ``MODULES`` order, then (``source``) those modules' source chunks in the same order."""
    docs: list[str] = []
    try:
        from pydoc_data.topics import topics
        docs += [topics[k].strip() for k in sorted(topics)]
    except Exception:  # pragma: no cover - a stripped stdlib
        pass
    mods = []
    for name in MODULES:
        try:
            mods.append(importlib.import_module(name))
        except Exception:  # pragma: no cover
            continue
    for mod in mods:
        with warnings.catch_warnings():            # typing.io / typing.re deprecation on attribute access
            warnings.simplefilter("ignore", DeprecationWarning)
            docs += _docs_of(mod)
    if source:
        for f in dict.fromkeys(f for mod in mods for f in _source_files(mod)):   # in order, each file once
            with open(f, encoding="utf-8", errors="replace") as fh:
                docs += source_chunks(fh.read())
    seen, out = set(), []
    for d in docs:                     # drop exact duplicates (re-exported objects)
        if d and d not in seen:
            seen.add(d)
            out.append(d)
    return out


def corpus_info(docs: list[str]) -> dict:
    h = hashlib.sha256("\n\x00\n".join(docs).encode("utf-8")).hexdigest()
    return {"python": sys.version.split()[0], "documents": len(docs),
            "characters": sum(len(d) for d in docs), "sha256": h}


def split_documents(docs: list[str], heldout_every: int = 20) -> tuple[list[str], list[str]]:
    """Deterministic held-out split by document: every ``heldout_every``-th document (by content hash)."""
    train, held = [], []
    for d in docs:
        (held if is_heldout(d, heldout_every) else train).append(d)
    return train, held


def is_heldout(doc: str, heldout_every: int = 20) -> bool:
    """The split rule of :func:`split_documents` for one document (its MD5 is 0 mod ``heldout_every``); the chat
    conversations (``chat_data``) use it on the document each one is built from, so both splits agree."""
    return int(hashlib.md5(doc.encode("utf-8")).hexdigest()[:8], 16) % heldout_every == 0


def train_tokenizer(folder: str | os.PathLike, docs: list[str], vocab_size: int, image_token_id: int) -> str:
    """Write ``tokenizer.json`` (+ config) with exactly ``vocab_size`` ids, merges trained on ``docs``.

    Reuses :func:`dsflash.tokenizer.write_synthetic_tokenizer` for the id layout (0 BOS, 1 EOS, 2 pad,
    3 ``</think>``, ..., 256 byte tokens, merges) with its training corpus replaced by ``docs``."""
    from types import SimpleNamespace

    import dsflash.tokenizer as tk

    cfg_like = SimpleNamespace(vocab_size=vocab_size, image_token_id=image_token_id,
                               max_position_embeddings=4096)
    with mock.patch.object(tk, "_corpus", lambda extended: list(docs)):
        tk.write_synthetic_tokenizer(folder, cfg_like)
    p = os.path.join(os.fspath(folder), "tokenizer_config.json")
    with open(p, encoding="utf-8") as f:
        tcfg = json.load(f)
    tcfg["synthetic"] = False
    tcfg["trained_on"] = "CPython documentation (dsflash.train.data)"
    with open(p, "w", encoding="utf-8") as f:
        json.dump(tcfg, f, ensure_ascii=False, indent=1)
    return os.fspath(folder)


def encode_documents(tokenizer, docs: list[str]) -> np.ndarray:
    """One int32 stream: ``BOS doc EOS`` per document."""
    return encode_documents_indexed(tokenizer, docs)[0]


def encode_documents_indexed(tokenizer, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`encode_documents` and where each document's ``BOS`` sits in the stream (``[len(docs)]`` int64;
    document ``i``'s tokens are ``stream[starts[i] + 1 : starts[i + 1] - 1]``)."""
    ids = tokenizer.encode_batch(docs)
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    parts = []
    for x in ids:
        parts.append(np.asarray([bos, *x, eos], np.int32))
    starts = np.cumsum([0] + [len(x) for x in parts[:-1]]).astype(np.int64) if parts else np.zeros((0,), np.int64)
    return (np.concatenate(parts) if parts else np.zeros((0,), np.int32)), starts


def pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut the stream into ``[N, seq_len]`` rows (the tail shorter than a row is dropped)."""
    n = len(stream) // seq_len
    return stream[: n * seq_len].reshape(n, seq_len)


def batches(rows: np.ndarray, batch_size: int, seed: int, shuffle: bool = True, repeat: bool = True):
    """A ``grain`` MapDataset of ``[batch_size, seq_len]`` int32 batches (seeded shuffle per epoch)."""
    import grain

    ds = grain.MapDataset.source(rows)
    if repeat:
        ds = ds.repeat(None)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.batch(batch_size, drop_remainder=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def copy_tokenizer(src_folder: str, dst_folder: str) -> None:
    """Copy a trained tokenizer's files (a folder onto itself is a no-op)."""
    for f in TOKENIZER_FILES:
        src, dst = os.path.join(src_folder, f), os.path.join(dst_folder, f)
        if not os.path.exists(src):
            raise ValueError(f"tokenizer: {src} does not exist")
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)


class Corpus:
    """Everything the trainer needs from the data side: tokenizer, packed train/held-out rows, info."""

    def __init__(self, folder: str, vocab_size: int, image_token_id: int, seq_len: int,
                 heldout_every: int = 20, docs: list[str] | None = None, tokenizer_from: str | None = None):
        """``tokenizer_from``: a folder whose tokenizer files are reused (copied into ``folder``) instead of
        training a new tokenizer -- a trained checkpoint's, so its rows tokenise exactly as it was trained."""
        from dsflash.tokenizer import Tokenizer

        docs = corpus_documents() if docs is None else docs
        self.info = corpus_info(docs)
        train, held = split_documents(docs, heldout_every)
        os.makedirs(folder, exist_ok=True)
        if tokenizer_from is None:
            train_tokenizer(folder, train, vocab_size, image_token_id)
        else:
            copy_tokenizer(tokenizer_from, folder)
        self.tokenizer = Tokenizer.from_folder(folder)
        self.folder = folder
        self.train_stream, self.train_doc_starts = encode_documents_indexed(self.tokenizer, train)
        self.held_stream, self.held_doc_starts = encode_documents_indexed(self.tokenizer, held)
        self.train_rows = pack(self.train_stream, seq_len)
        self.held_rows = pack(self.held_stream, seq_len)
        self.info.update(train_documents=len(train), heldout_documents=len(held),
                         train_tokens=int(len(self.train_stream)), heldout_tokens=int(len(self.held_stream)),
                         seq_len=seq_len, vocab_size=vocab_size)

    def document_rows(self, split: str, length: int, min_tokens: int | None = None) -> np.ndarray:
        """``[N, length]``: the first ``length`` tokens of every document of ``split`` ("train" / "held") that has
        at least ``min_tokens`` tokens (default ``length``), in corpus order -- BOS and the document's ids, i.e.
        what a text prompt cut from the document's start is fed to the model as (``Tokenizer.encode_prompt``). A
        document shorter than ``length`` is followed by its EOS, then pad ids.
        No re-tokenisation: the rows are cut from the split's stream at the recorded document starts."""
        if split not in ("train", "held"):
            raise ValueError(f"split must be 'train' or 'held', got {split!r}")
        stream, starts = ((self.train_stream, self.train_doc_starts) if split == "train"
                          else (self.held_stream, self.held_doc_starts))
        min_tokens = length if min_tokens is None else min_tokens
        ends = np.append(starts[1:], len(stream)) - 1              # each document's EOS
        keep = np.flatnonzero(ends - (starts + 1) >= min_tokens)
        pad = self.tokenizer.pad_id
        rows = np.full((len(keep), length), self.tokenizer.eos_id if pad is None else pad, np.int32)
        for i, d in enumerate(keep):
            r = stream[starts[d]: min(ends[d] + 1, starts[d] + length)]
            rows[i, :len(r)] = r
        return rows
