"""dsflash.train.data: corpus, held-out split, trained tokenizer layout, packing, grain determinism."""
import numpy as np

from dsflash.tokenizer import BOS, EOS, THINK_END, Tokenizer
from dsflash.train import data


def test_corpus_is_deterministic_and_split():
    a, b = data.corpus_documents(), data.corpus_documents()
    assert a == b and len(a) > 500
    ia = data.corpus_info(a)
    assert ia == data.corpus_info(b) and ia["python"] and len(ia["sha256"]) == 64
    tr, he = data.split_documents(a)
    assert tr + he and set(tr).isdisjoint(he) and len(tr) + len(he) == len(a)
    assert 0.02 < len(he) / len(a) < 0.1
    assert data.split_documents(a) == (tr, he)


def test_tokenizer_layout_and_pipeline(tmp_path):
    docs = data.corpus_documents()[:150]
    data.train_tokenizer(tmp_path, docs, 512, 511)
    tok = Tokenizer.from_folder(tmp_path)
    assert len(tok) == 512
    assert tok.id_to_token(0) == BOS and tok.id_to_token(1) == EOS and tok.id_to_token(3) == THINK_END
    text = docs[0][:200]
    assert tok.decode(tok.encode(text)) == text
    stream = data.encode_documents(tok, docs)
    assert stream[0] == tok.bos_id and stream.dtype == np.int32 and stream.max() < 512
    rows = data.pack(stream, 32)
    assert rows.shape == (len(stream) // 32, 32)
    np.testing.assert_array_equal(rows.reshape(-1), stream[: rows.size])
    first = [np.asarray(x) for x, _ in zip(iter(data.batches(rows, 4, seed=7)), range(3))]
    again = [np.asarray(x) for x, _ in zip(iter(data.batches(rows, 4, seed=7)), range(3))]
    other = next(iter(data.batches(rows, 4, seed=8)))
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    assert first[0].shape == (4, 32) and not np.array_equal(first[0], other)
