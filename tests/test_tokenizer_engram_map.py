"""Engram compressed token map (SPEC_V41 §9.2, §16b.11)."""
import re
import unicodedata

import numpy as np
import pytest

from dsflash.config import preset
from dsflash.engram_map import (build_compressed_token_map, check_compressed_vocab_size, compressed_key,
                                load_or_build_compressed_token_map, normalize_token_text)
from dsflash.tokenizer import BOS, EOS, PAD, USER, Tokenizer, bytes_to_unicode, write_synthetic_tokenizer


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return Tokenizer.from_folder(write_synthetic_tokenizer(tmp_path_factory.mktemp("tok"), preset("tiny")))


def _bl(text: str) -> str:
    """Byte-level token string of ``text``."""
    b2u = bytes_to_unicode()
    return "".join(b2u[b] for b in text.encode("utf-8"))


# Tokens of a hand-built vocabulary (text as it decodes), after the 256 byte tokens.
HAND = ["The", " the", "THE", "the", "Café", " cafe", "CAFÉ", "ﬁ", "fi", "１２３", "123", " ",
        "  ", "\n", "\t\n", " \n ", "\x0b", "\x0c", "\u200b", "é", "Ñ", "ñ", " x ", "x"]


@pytest.fixture(scope="module")
def hand_tok():
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, models, pre_tokenizers

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    for t in HAND:
        vocab.setdefault(_bl(t), len(vocab))
    hf = HFTok(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in (BOS, EOS, PAD, USER)])
    return Tokenizer(hf)


def cid(tok, lookup, text):
    i = tok.token_to_id(_bl(text))
    assert i is not None, text
    return lookup[i]


def test_collisions_and_distinct_keys(hand_tok):
    lookup, n = build_compressed_token_map(hand_tok)
    assert lookup.dtype == np.int32 and lookup.shape == (len(hand_tok),)
    c = lambda t: cid(hand_tok, lookup, t)  # noqa: E731
    # case, leading space, accents, compatibility forms collide
    assert c("The") == c(" the") == c("THE") == c("the")
    assert c("Café") == c(" cafe") == c("CAFÉ")
    assert c("ﬁ") == c("fi")
    assert c("１２３") == c("123")
    assert c("Ñ") == c("ñ") == c("n")
    assert c("é") == c("e") == c("E")
    assert c(" x ") == c("x")
    # whitespace-only tokens collapse to the single-space key (kept through strip by the sentinel)
    assert c(" ") == c("  ") == c("\n") == c("\t\n") == c(" \n ")
    assert compressed_key(hand_tok.hf, hand_tok.token_to_id(_bl("\t\n"))) == " "
    # tokens that normalise to "" are keyed by their raw text: distinct from each other and from " "
    assert len({c("\x0b"), c("\x0c"), c("\u200b"), c(" ")}) == 4
    # special tokens are decoded with specials kept; NFKC folds the full-width bars
    assert compressed_key(hand_tok.hf, hand_tok.user_id) == "<|user|>"
    assert len({lookup[hand_tok.bos_id], lookup[hand_tok.eos_id], lookup[hand_tok.pad_id]}) == 3


def test_partial_utf8_bytes_keyed_by_raw_token(hand_tok):
    lookup, _ = build_compressed_token_map(hand_tok)
    b2u = bytes_to_unicode()
    lead, cont = hand_tok.token_to_id(b2u[0xC3]), hand_tok.token_to_id(b2u[0xA9])
    assert "\ufffd" in hand_tok.decode([lead]) and "\ufffd" in hand_tok.decode([cont])
    assert compressed_key(hand_tok.hf, lead) == b2u[0xC3] == "Ã"
    assert lookup[lead] != lookup[cont]
    # raw-token keys share the key space with normalised keys: byte 0xC3's raw string "Ã"
    # equals the normalised text of nothing here, but byte 0xA9's raw string is "©", the same key
    # as a whole-character token "©" would get (the reference's behaviour, reproduced)
    assert compressed_key(hand_tok.hf, cont) == "©" == normalize_token_text("©")


def test_first_seen_order(hand_tok):
    lookup, n = build_compressed_token_map(hand_tok)
    first = {}
    for i, c in enumerate(lookup.tolist()):
        first.setdefault(c, i)
    assert sorted(first.values()) == [first[c] for c in range(n)]  # ids appear in increasing order
    assert lookup[0] == 0 and lookup.max() == n - 1 and len(first) == n


def _oracle_key(text: str, raw: str) -> str:
    """Independent pure-Python statement of §9.2 (valid for the tiny vocabulary's characters)."""
    if "\ufffd" in text:
        return raw
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = "".join(ch for ch in t if unicodedata.category(ch) != "Mn").lower()
    t = re.sub(r"[ \t\r\n]+", " ", t)
    t = " " if t == " " else t.strip(" \t\n\r\x0b\x0c\x85\xa0\u1680\u2028\u2029\u3000")
    return t if t else text


def test_synthetic_tokenizer_against_oracle(tiny_tok):
    lookup, n = build_compressed_token_map(tiny_tok)
    keys = {}
    want = []
    for i in range(len(tiny_tok)):
        k = _oracle_key(tiny_tok.decode([i]), tiny_tok.id_to_token(i))
        want.append(keys.setdefault(k, len(keys)))
    assert lookup.tolist() == want and n == len(keys)
    assert n < len(tiny_tok)
    # concrete cases in the synthetic vocabulary
    c = lambda t: cid(tiny_tok, lookup, t)  # noqa: E731
    assert c("The") == c(" the")
    assert c("A") == c("a") and c(" a") == c("a")
    partial = [tiny_tok.token_to_id(bytes_to_unicode()[b]) for b in (0xC3, 0xE4, 0xF0, 0x9F, 0x80)]
    assert len({lookup[i] for i in partial}) == 5
    # the noise token (</think>) and pad keep their own ids
    cfg = preset("tiny")
    assert lookup[cfg.engram_pad_token_id] == cfg.engram_pad_token_id
    assert lookup[cfg.dspark_noise_token_id] == cfg.dspark_noise_token_id


def test_deterministic(tiny_tok, tmp_path):
    a, na = build_compressed_token_map(tiny_tok)
    b, nb = build_compressed_token_map(Tokenizer.from_folder(write_synthetic_tokenizer(tmp_path, preset("tiny"))))
    assert na == nb and np.array_equal(a, b)


def test_accepts_raw_tokenizers_object(tiny_tok):
    a, na = build_compressed_token_map(tiny_tok)
    b, nb = build_compressed_token_map(tiny_tok.hf)
    assert na == nb and np.array_equal(a, b)
    with pytest.raises(ValueError, match="tokenizer"):
        build_compressed_token_map(object())


def test_check_size_and_cache(tiny_tok, tmp_path):
    lookup, n = build_compressed_token_map(tiny_tok)
    cfg = preset("tiny")
    check_compressed_vocab_size(n, cfg.replace(engram_compressed_vocab_size=n))
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        check_compressed_vocab_size(n + 1, cfg.replace(engram_compressed_vocab_size=n))
    path = tmp_path / "map.npy"
    a, na = load_or_build_compressed_token_map(tiny_tok, path)
    assert path.exists()
    b, nb = load_or_build_compressed_token_map(tiny_tok, path)
    assert na == nb == n and np.array_equal(a, lookup) and np.array_equal(b, lookup)
