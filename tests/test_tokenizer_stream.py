"""IncrementalDetokenizer: complete UTF-8 only, stop strings across token boundaries."""
import random

import pytest

from dsflash.config import preset
from dsflash.tokenizer import (EOS, IncrementalDetokenizer, Tokenizer, find_stop, partial_stop_len,
                               write_synthetic_tokenizer)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_folder(write_synthetic_tokenizer(tmp_path_factory.mktemp("tok"), preset("tiny")))


def stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    pieces = [d.add(i) for i in ids]
    pieces.append(d.finish())
    return d, pieces


def test_multibyte_character_split_across_tokens(tok):
    ids = tok.encode("a𝄞b")
    # U+1D11E is four bytes; in this vocabulary they are separate byte tokens
    assert len(ids) >= 4
    d, pieces = stream(tok, ids)
    assert "".join(pieces) == "a𝄞b" == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    # the character appears in exactly one piece, whole
    assert sum("𝄞" in p for p in pieces) == 1


def test_merged_token_ending_mid_character(tok):
    ids = tok.encode("Straße")
    d, pieces = stream(tok, ids)
    assert "".join(pieces) == "Straße"
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("seed", range(5))
def test_stream_equals_decode(tok, seed):
    rng = random.Random(seed)
    alphabet = "ab cde\nXYZ éßü今天😀𝄞—,.!?"
    text = "".join(rng.choice(alphabet) for _ in range(200))
    ids = tok.encode(text)
    _, pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text


def test_dangling_partial_character_becomes_replacement(tok):
    ids = tok.encode("ok𝄞")[:-1]  # drop the last byte of the 4-byte character
    d, pieces = stream(tok, ids)
    assert "".join(pieces[:-1]) == "ok"
    assert pieces[-1] == "\ufffd"
    assert d.text == tok.decode(ids)


def test_skip_special_tokens(tok):
    ids = tok.encode(f"hi there{EOS}")
    _, pieces = stream(tok, ids)
    assert "".join(pieces) == "hi there"
    _, pieces = stream(tok, ids, skip_special_tokens=False)
    assert "".join(pieces) == f"hi there{EOS}"


def _one_byte_ids(tok, text):
    """Token ids of ``text`` one byte per token (maximal boundary splitting)."""
    from dsflash.tokenizer import bytes_to_unicode
    b2u = bytes_to_unicode()
    return [tok.token_to_id(b2u[b]) for b in text.encode()]


@pytest.mark.parametrize("bytewise", [False, True])
def test_stop_string_across_boundaries(tok, bytewise):
    text = "The answer is 42. STOP here and more"
    ids = _one_byte_ids(tok, text) if bytewise else tok.encode(text)
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    out, n_fed = [], 0
    for i in ids:
        out.append(d.add(i))
        n_fed += 1
        if d.stopped:
            break
    assert d.stopped and d.stop_reason == "STOP"
    assert "".join(out) == "The answer is 42. "
    assert n_fed < len(ids)
    assert all("S" not in p for p in out)  # the partial "S"/"ST"/"STO" was held back, never emitted
    assert d.add(ids[-1]) == "" and d.finish() == ""


def test_stop_with_multibyte_and_include_stop(tok):
    text = "abc 今天 def"
    d = IncrementalDetokenizer(tok, stop=["今天"], include_stop=True)
    out = [d.add(i) for i in _one_byte_ids(tok, text)]
    assert d.stopped and "".join(out) == "abc 今天"


def test_held_prefix_is_released_when_not_a_stop(tok):
    d = IncrementalDetokenizer(tok, stop=["STOP"])
    out = [d.add(i) for i in _one_byte_ids(tok, "ST")]
    assert "".join(out) == ""  # could still become STOP
    out.append(d.add(_one_byte_ids(tok, "x")[0]))
    assert "".join(out) == "STx" and not d.stopped
    d2 = IncrementalDetokenizer(tok, stop=["STOP"])
    assert "".join(d2.add(i) for i in _one_byte_ids(tok, "end ST")) == "end "
    assert d2.finish() == "ST" and d2.text == "end ST" and not d2.stopped


def test_earliest_stop_wins(tok):
    d = IncrementalDetokenizer(tok, stop=["world", "lo w"])
    out = "".join(d.add(i) for i in tok.encode("hello world"))
    assert d.stop_reason == "lo w" and out == "hel"


def test_find_stop_and_partial_len():
    assert find_stop("abcdef", ["cd", "b"]) == (1, "b")
    assert find_stop("abcdef", ["bc", "bcd"]) == (1, "bcd")
    assert find_stop("abcdef", ["x"]) is None
    assert find_stop("abcdef", [""]) is None
    assert partial_stop_len("hello wor", ["world"]) == 3
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("aaa", ["aab"]) == 2
    assert partial_stop_len("x<", ["<｜end", "zz"]) == 1
