"""Tokenizer: a thin wrapper over a Hugging Face ``tokenizers`` file, streaming detokenisation, and a
deterministic synthetic byte-level BPE tokenizer for tiny test checkpoints.

Special tokens are always looked up BY NAME in the loaded file (SPEC_V41 §14, §16.5): no id is
hard-coded, so the same code serves the real 129,280-row vocabulary and the 512-id synthetic one.

* :class:`Tokenizer` — ``encode`` / ``decode`` / ``len`` and the V4.1 special-token ids.
* :class:`IncrementalDetokenizer` — feed token ids one at a time, get text only once it is
  complete UTF-8, with stop strings found even when they span token boundaries.
* :func:`write_synthetic_tokenizer` — writes ``tokenizer.json`` + ``tokenizer_config.json`` with
  exactly ``cfg.vocab_size`` ids (layout documented on the function).
"""
from __future__ import annotations

import codecs
import json
import os
from functools import lru_cache
from typing import Iterable, Sequence

# ----------------------------------------------------------------------------- special token names
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
THINK_START = "<think>"
THINK_END = "</think>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜deepseek_image｜>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

#: role name -> token text; ``Tokenizer.special_ids`` maps the names that exist in a file to ids.
SPECIAL_TOKENS: dict[str, str] = {
    "bos": BOS,
    "eos": EOS,
    "pad": PAD,
    "think_end": THINK_END,
    "think_start": THINK_START,
    "user": USER,
    "assistant": ASSISTANT,
    "system": SYSTEM,
    "latest_reminder": LATEST_REMINDER,
    **{f"task_{k}": v for k, v in TASK_TOKENS.items()},
    "image": IMAGE,
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 / byte-level BPE byte -> printable character table (the one ``tokenizers`` uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


# ----------------------------------------------------------------------------- Tokenizer
class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the V4.1 special ids, looked up by name."""

    def __init__(self, tok, path: str | None = None):
        self._tok = tok
        self.path = path
        self._added = {i: t for i, t in tok.get_added_tokens_decoder().items()}
        self.special_ids: dict[str, int] = {}
        for name, text in SPECIAL_TOKENS.items():
            i = tok.token_to_id(text)
            if i is not None:
                self.special_ids[name] = i
        missing = [n for n in ("bos", "eos") if n not in self.special_ids]
        if missing:
            raise ValueError(f"tokenizer {path or ''}: special token(s) {', '.join(SPECIAL_TOKENS[n] for n in missing)} "
                             "not found in the vocabulary")
        self._byte_level = _is_byte_level(tok)
        self._token_bytes: list[bytes] | None = None
        self._special_set = frozenset(i for i, t in self._added.items() if t.special)

    # -- construction
    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load ``tokenizer.json`` from a folder (a path to the file itself is accepted too)."""
        from tokenizers import Tokenizer as _HFTok

        p = os.fspath(path)
        f = os.path.join(p, "tokenizer.json") if os.path.isdir(p) else p
        if not os.path.isfile(f):
            raise FileNotFoundError(f"no tokenizer.json at {p!r}")
        return cls(_HFTok.from_file(f), path=f)

    @classmethod
    def from_str(cls, json_text: str) -> "Tokenizer":
        from tokenizers import Tokenizer as _HFTok
        return cls(_HFTok.from_str(json_text))

    @property
    def hf(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    # -- sizes
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # -- special ids (None when a file lacks the token)
    def _sid(self, name: str) -> int | None:
        return self.special_ids.get(name)

    @property
    def bos_id(self) -> int:
        return self.special_ids["bos"]

    @property
    def eos_id(self) -> int:
        return self.special_ids["eos"]

    @property
    def pad_id(self) -> int | None:
        return self._sid("pad")

    @property
    def think_start_id(self) -> int | None:
        return self._sid("think_start")

    @property
    def think_end_id(self) -> int | None:
        return self._sid("think_end")

    @property
    def user_id(self) -> int | None:
        return self._sid("user")

    @property
    def assistant_id(self) -> int | None:
        return self._sid("assistant")

    @property
    def system_id(self) -> int | None:
        return self._sid("system")

    @property
    def image_id(self) -> int | None:
        return self._sid("image")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation by default (EOS)."""
        return (self.eos_id,)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_set

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    # -- encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token text (e.g. ``<｜User｜>``) maps to its single id.
        ``add_special_tokens`` runs the file's post-processor (BOS for DeepSeek files)."""
        if not isinstance(text, str):
            raise ValueError(f"Tokenizer.encode: text must be str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's ids as every serving entry point sends it to the model: BOS once, then the text (a text
        that already starts with the BOS token keeps its one). The model saw BOS before every document."""
        ids = self.encode(text)
        return ids if ids and ids[0] == self.bos_id else [self.bos_id] + ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def encode_batch_as_text(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with every added token (special or not: ``<think>`` is not special in the
        V4.1 file) tokenised as plain text: a twin of the file with all added tokens marked special and
        ``encode_special_tokens`` on. Batch call, so the GIL is released (a huge chat must not stall the loop)."""
        twin = getattr(self, "_as_text_tok", None)
        if twin is None:
            from tokenizers import Tokenizer as _HFTok
            spec = json.loads(self._tok.to_str())
            for t in spec.get("added_tokens", []):
                t["special"] = True
            twin = _HFTok.from_str(json.dumps(spec))
            twin.encode_special_tokens = True
            self._as_text_tok = twin       # a race builds two equal twins; either is fine
        return [e.ids for e in twin.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"Tokenizer.decode: token id {i} out of range [0, {n})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- bytes of single tokens (for streaming)
    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token contributes to the decoded text (specials: their UTF-8 text)."""
        if self._token_bytes is None:
            self._token_bytes = self._build_token_bytes()
        return self._token_bytes[token_id]

    def _build_token_bytes(self) -> list[bytes]:
        table: list[bytes] = []
        if self._byte_level:
            u2b = unicode_to_bytes()
            for i in range(self.vocab_size):
                if i in self._added:
                    table.append(self._added[i].content.encode("utf-8"))
                    continue
                t = self._tok.id_to_token(i)
                if t is None:
                    table.append(b"")
                    continue
                try:
                    table.append(bytes(u2b[c] for c in t))
                except KeyError:  # a token outside the byte alphabet: take its text
                    table.append(t.encode("utf-8"))
        else:  # not byte-level: the best single-token view is its own decoding
            for i in range(self.vocab_size):
                table.append(self._tok.decode([i], skip_special_tokens=False).encode("utf-8"))
        return table

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, path={self.path!r})"


def _is_byte_level(tok) -> bool:
    dec = tok.decoder
    if dec is None:
        return False
    try:
        d = json.loads(dec.__getstate__())
    except Exception:  # pragma: no cover - a decoder that cannot serialise itself
        return False

    def has_bl(node) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has_bl(x) for x in node.get("decoders", []) or [])

    return has_bl(d)


# ----------------------------------------------------------------------------- streaming
def find_stop(text: str, stops: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in ``text[start:]`` as ``(index, stop)``; on a tie
    at the same index the longest stop wins. ``None`` when there is none."""
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string (text
    that must be held back because the next token could complete a stop)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class IncrementalDetokenizer:
    """Streaming detokeniser: ``add(token_id)`` returns the text that is now final.

    * Bytes are decoded with an incremental UTF-8 decoder, so a character whose bytes are split
      across tokens is released only once complete (an invalid sequence becomes U+FFFD, as in
      ``Tokenizer.decode``).
    * Stop strings are searched in the full decoded text; a tail that is a prefix of a stop string
      is held back until the next token decides it. After a stop, further input is ignored.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] | None = None,
                 skip_special_tokens: bool = True, include_stop: bool = False):
        self.tok = tokenizer
        self.stops = [s for s in (stop or []) if s]
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""          # all decoded text so far (complete characters only)
        self._emitted = 0        # chars of _text already returned
        self.stopped = False
        self.stop_reason: str | None = None
        self.token_ids: list[int] = []

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[: self._emitted]

    def add(self, token_id: int) -> str:
        return self.add_many([token_id])

    def add_many(self, token_ids: Iterable[int]) -> str:
        if self.stopped:
            return ""
        chunks = []
        for t in token_ids:
            t = int(t)
            self.token_ids.append(t)
            if self.skip_special_tokens and self.tok.is_special(t):
                continue
            chunks.append(self.tok.token_bytes(t))
        if chunks:
            self._text += self._dec.decode(b"".join(chunks))
        return self._release(final=False)

    def finish(self) -> str:
        """Flush everything still held (a dangling partial character becomes U+FFFD)."""
        if self.stopped:
            return ""
        self._text += self._dec.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stops:
            # a stop may start up to (longest stop - 1) chars before the unreleased part
            search_from = max(0, self._emitted - max(len(s) for s in self.stops) + 1)
            hit = find_stop(self._text, self.stops, search_from)
            if hit is not None:
                i, s = hit
                end = i + len(s) if self.include_stop else i
                end = max(end, self._emitted)
                out = self._text[self._emitted:end]
                self._emitted = end
                self.stopped, self.stop_reason = True, s
                return out
            hold = 0 if final else partial_stop_len(self._text[self._emitted:], self.stops)
        else:
            hold = 0
        end = len(self._text) - hold
        out = self._text[self._emitted:end]
        self._emitted = end
        return out


# ----------------------------------------------------------------------------- synthetic tokenizer
_NON_SPECIAL = frozenset({THINK_START, THINK_END})
_CORPUS_FILE = os.path.join(os.path.dirname(__file__), "assets", "synthetic_corpus.txt")


def synthetic_special_tokens(cfg=None) -> list[str]:
    """Special tokens of the synthetic tokenizer in id order (ids 0..len-1, the image token aside)."""
    return [BOS, EOS, PAD, THINK_END, THINK_START, USER, ASSISTANT, SYSTEM, LATEST_REMINDER,
            *TASK_TOKENS.values()]


def _corpus(extended: bool) -> list[str]:
    with open(_CORPUS_FILE, encoding="utf-8") as f:
        texts = [p for p in f.read().split("\n\n") if p]
    if extended:  # CPython's own help topics: present on every machine, but they vary by version
        try:
            from pydoc_data.topics import topics
            texts += [topics[k] for k in sorted(topics)]
        except Exception:  # pragma: no cover - a stripped stdlib
            pass
    return texts


def _train_merges(n_merges: int, texts: list[str]) -> list[tuple[str, str]]:
    from tokenizers import Tokenizer as _HFTok, models, pre_tokenizers, trainers

    t = _HFTok(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tr = trainers.BpeTrainer(vocab_size=256 + n_merges, min_frequency=2, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    t.train_from_iterator(texts, tr)
    merges = json.loads(t.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges][:n_merges]


def write_synthetic_tokenizer(folder: str | os.PathLike, cfg) -> str:
    """Write a deterministic byte-level BPE ``tokenizer.json`` (+ ``tokenizer_config.json``) with
    exactly ``cfg.vocab_size`` ids into ``folder``; returns the folder path (accepted by
    :meth:`Tokenizer.from_folder`).

    Id layout: 0 BOS, 1 EOS, 2 pad, 3 ``</think>`` (so the tiny preset's ``dspark_noise_token_id``
    3 is ``</think>`` like the real model's), 4 ``<think>``, 5 ``<｜User｜>``, 6 ``<｜Assistant｜>``,
    7 ``<｜System｜>``, 8 ``<｜latest_reminder｜>``, 9..14 the task tokens; ``<｜deepseek_image｜>`` at
    ``cfg.image_token_id`` when that id is free and in range (else right after the task tokens);
    then the 256 byte tokens in byte order; then BPE merges trained with ``tokenizers``' BpeTrainer
    on ``dsflash/assets/synthetic_corpus.txt`` (extended with CPython's ``pydoc_data`` topics only
    when more merges are needed) until the vocabulary is full; any ids still left become
    ``<｜reserved_{k}｜>`` special tokens. DSML tags are plain text (not special tokens).
    """
    from tokenizers import AddedToken, Tokenizer as _HFTok, decoders, models, pre_tokenizers, processors

    V = int(cfg.vocab_size)
    specials = synthetic_special_tokens(cfg)
    n_fixed = len(specials)
    img = getattr(cfg, "image_token_id", None)
    img_at = int(img) if img is not None and n_fixed <= int(img) < V else None
    n_special_total = n_fixed + 1
    n_min = n_special_total + 256
    if V < n_min:
        raise ValueError(f"write_synthetic_tokenizer: cfg.vocab_size={V} is below the minimum {n_min} "
                         f"({n_special_total} special tokens + 256 byte tokens)")
    n_merges = V - n_min

    merges = _train_merges(n_merges, _corpus(extended=False)) if n_merges else []
    if len(merges) < n_merges:
        merges = _train_merges(n_merges, _corpus(extended=True))

    # ordered token strings for every id except the image slot
    b2u = bytes_to_unicode()
    ordered: list[str] = list(specials)
    if img_at is None:
        ordered.append(IMAGE)
    ordered += [b2u[b] for b in range(256)]
    seen = set(ordered)
    kept_merges = []
    for a, b in merges:
        tok = a + b
        if tok in seen:  # cannot happen with a fresh trainer; guard keeps ids unique
            continue
        seen.add(tok)
        ordered.append(tok)
        kept_merges.append((a, b))
    k = 0
    n_slots = V - (1 if img_at is not None else 0)
    reserved = []
    while len(ordered) < n_slots:
        r = f"<｜reserved_{k}｜>"
        ordered.append(r)
        reserved.append(r)
        k += 1

    vocab: dict[str, int] = {}
    nxt = 0
    for t in ordered:
        if nxt == img_at:
            nxt += 1
        vocab[t] = nxt
        nxt += 1
    if img_at is not None:
        vocab[IMAGE] = img_at
    assert len(vocab) == V and sorted(vocab.values()) == list(range(V))

    tok = _HFTok(models.BPE(vocab=vocab, merges=kept_merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    named = specials + [IMAGE]
    all_special = named + reserved
    # <think>/</think> are added but not "special" (as in DeepSeek's files): decoding with
    # skip_special_tokens=True keeps them, which the reasoning parser relies on.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in named if s not in _NON_SPECIAL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in named if s in _NON_SPECIAL])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, vocab[BOS])])
    data = json.loads(tok.to_str())
    if reserved:  # appended to the JSON directly: adding 100k tokens through the API is slow
        data["added_tokens"] += [{"id": vocab[r], "content": r, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True} for r in reserved]
        data["added_tokens"].sort(key=lambda e: e["id"])
    if len(data["model"]["vocab"]) != V or len({e["id"] for e in data["added_tokens"]}) != len(all_special):
        raise RuntimeError("write_synthetic_tokenizer: vocabulary size mismatch")  # pragma: no cover

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, separators=(",", ":"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": int(getattr(cfg, "max_position_embeddings", 4096)),
        "added_tokens_decoder": {str(vocab[s]): {"content": s, "special": s not in _NON_SPECIAL, "normalized": False,
                                                 "lstrip": False, "rstrip": False, "single_word": False}
                                 for s in all_special},
        "synthetic": True,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tcfg, f, ensure_ascii=False, indent=1)
    return folder
