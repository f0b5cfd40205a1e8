"""Synthetic tokenizer writer + the Tokenizer wrapper (special ids by name, round trips)."""
import hashlib
import json
import os
import time

import pytest

from dsflash.config import preset
from dsflash.tokenizer import (ASSISTANT, BOS, EOS, IMAGE, PAD, SYSTEM, THINK_END, THINK_START, USER,
                               Tokenizer, bytes_to_unicode, write_synthetic_tokenizer)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_synthetic_tokenizer(tmp_path_factory.mktemp("tok"), preset("tiny"))


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer.from_folder(tiny_dir)


def test_layout_matches_tiny_preset(tok):
    cfg = preset("tiny")
    assert len(tok) == tok.vocab_size == cfg.vocab_size == 512
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2) == (cfg.bos_token_id, cfg.eos_token_id,
                                                                cfg.engram_pad_token_id)
    assert tok.think_end_id == 3 == cfg.dspark_noise_token_id
    assert tok.id_to_token(cfg.dspark_noise_token_id) == THINK_END
    assert tok.think_start_id == 4
    assert tok.image_id == cfg.image_token_id == 511
    assert tok.id_to_token(511) == IMAGE
    for name in (USER, ASSISTANT, SYSTEM):
        assert tok.token_to_id(name) is not None
    # the 256 byte tokens follow the special tokens, in byte order
    b2u = bytes_to_unicode()
    first = tok.token_to_id(b2u[0])
    assert [tok.token_to_id(b2u[b]) for b in range(256)] == list(range(first, first + 256))
    assert first == max(i for n, i in tok.special_ids.items() if n != "image") + 1
    # merges fill the rest: every id decodes to something
    assert all(tok.id_to_token(i) is not None for i in range(512))


def test_special_tokens_flags(tok):
    assert tok.is_special(tok.bos_id) and tok.is_special(tok.eos_id) and tok.is_special(tok.user_id)
    # <think>/</think> survive skip_special_tokens (the reasoning parser needs them)
    assert not tok.is_special(tok.think_end_id) and not tok.is_special(tok.think_start_id)


def test_deterministic_and_fast(tmp_path):
    cfg = preset("tiny")
    t0 = time.perf_counter()
    a = write_synthetic_tokenizer(tmp_path / "a", cfg)
    dt = time.perf_counter() - t0
    b = write_synthetic_tokenizer(tmp_path / "b", cfg)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        ha = hashlib.sha256(open(os.path.join(a, f), "rb").read()).hexdigest()
        hb = hashlib.sha256(open(os.path.join(b, f), "rb").read()).hexdigest()
        assert ha == hb, f
    assert dt < 5.0
    tc = json.load(open(os.path.join(a, "tokenizer_config.json")))
    assert tc["bos_token"] == BOS and tc["eos_token"] == EOS and tc["pad_token"] == PAD


@pytest.mark.parametrize("vocab", [272, 300, 1024])
def test_other_vocab_sizes(tmp_path, vocab):
    cfg = preset("tiny").replace(vocab_size=vocab, image_token_id=vocab - 1)
    t = Tokenizer.from_folder(write_synthetic_tokenizer(tmp_path, cfg))
    assert len(t) == vocab
    assert t.decode(t.encode("hello world")) == "hello world"


def test_image_id_out_of_range_goes_after_specials(tmp_path):
    cfg = preset("tiny").replace(image_token_id=5000)  # not a valid slot in a 512 vocabulary
    t = Tokenizer.from_folder(write_synthetic_tokenizer(tmp_path, cfg))
    assert len(t) == 512 and t.image_id == 15


def test_vocab_too_small(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        write_synthetic_tokenizer(tmp_path, preset("tiny").replace(vocab_size=200, image_token_id=100,
                                                                     dspark_noise_token_id=3))


@pytest.mark.parametrize("text", [
    "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "Café naïve Straße",
    "今天天气很好", "emoji 😀🎉 and 𝄞", "", "x" * 300, "def f(x):\n    return x * 2\n",
])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < len(tok) for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_special_text_maps_to_single_ids(tok):
    ids = tok.encode(f"{BOS}{USER}hi{ASSISTANT}{THINK_START}x{THINK_END}y{EOS}")
    assert ids[0] == tok.bos_id and ids[1] == tok.user_id and ids[-1] == tok.eos_id
    assert tok.assistant_id in ids and tok.think_start_id in ids and tok.think_end_id in ids
    assert tok.decode(ids, skip_special_tokens=True) == f"hi{THINK_START}x{THINK_END}y"
    assert tok.encode("hi", add_special_tokens=True) == [tok.bos_id] + tok.encode("hi")


def test_from_folder_accepts_file_and_rejects_missing(tiny_dir, tmp_path):
    t = Tokenizer.from_folder(os.path.join(tiny_dir, "tokenizer.json"))
    assert len(t) == 512
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_folder(tmp_path / "nothing-here")


def test_decode_rejects_bad_ids(tok):
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([0, 512])
    with pytest.raises(ValueError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_special_ids_are_looked_up_by_name():
    """A file whose special tokens sit at other ids: nothing is hard-coded."""
    from tokenizers import AddedToken, Tokenizer as HFTok, decoders, models, pre_tokenizers

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    hf = HFTok(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in (USER, EOS, BOS, ASSISTANT)])
    t = Tokenizer(hf)
    assert (t.user_id, t.eos_id, t.bos_id, t.assistant_id) == (256, 257, 258, 259)
    assert t.pad_id is None and t.think_end_id is None and t.system_id is None
    assert t.decode(t.encode(f"{BOS}abc{EOS}"), skip_special_tokens=True) == "abc"
    bare = HFTok(models.BPE(vocab=vocab, merges=[]))
    with pytest.raises(ValueError, match="not found"):
        Tokenizer(bare)


@pytest.mark.slow
def test_full_size_vocab(tmp_path):
    """The v41_flash vocabulary size works (filled with reserved specials past the corpus)."""
    cfg = preset("v41_flash")
    t0 = time.perf_counter()
    t = Tokenizer.from_folder(write_synthetic_tokenizer(tmp_path, cfg))
    assert time.perf_counter() - t0 < 30
    assert len(t) == cfg.vocab_size and t.image_id == cfg.image_token_id
    assert t.decode(t.encode("round trip ✓")) == "round trip ✓"
