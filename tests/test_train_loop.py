"""dsflash.train: a few optax steps reduce the target and DSpark losses; export -> dsflash.load round trip."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.model.params import float_params, init_params
from dsflash.train import data, loop
from dsflash.train.config import mini_config

# the target's logits over whole rows, jitted: run eagerly op by op this took ~35 s per check on 2 CPU cores
_target_logits = jax.jit(lambda params, cfg, tokens, precision:
                         loop._target_forward(params, cfg, tokens, precision)["logits"], static_argnums=(1, 3))


@pytest.fixture(scope="module", autouse=True)
def _module_compilation_cache(tmp_path_factory):
    """A persistent XLA compilation cache for this module only, in a fresh folder. ``train()`` builds new jitted
    programs per call for the same computations (each serving engine jits its own prefill/decode; a new optax
    optimizer is a new static argument of the steps); with the cache their second and later compiles are disk
    reads of the same executables. Results are the same either way (the cache key is the program); the
    suite-wide default (no cache, conftest.py) is restored after the module."""
    from jax._src import compilation_cache as cc
    keys = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {k: getattr(jax.config, k) for k in keys}
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("xla_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    cc.reset_cache()
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    cc.reset_cache()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    docs = data.corpus_documents()[:120]
    data.train_tokenizer(folder, docs, 512, 511)
    tok = __import__("dsflash.tokenizer", fromlist=["Tokenizer"]).Tokenizer.from_folder(folder)
    from dsflash.engram_map import build_compressed_token_map
    tmap, n = build_compressed_token_map(tok)
    cfg = mini_config(512, n)
    params = float_params(cfg, init_params(cfg, 0))
    params["engram.token_map"] = jnp.asarray(tmap, jnp.int32)
    rows = data.pack(data.encode_documents(tok, docs), 32)
    return cfg, params, rows, str(folder)


def test_target_and_draft_losses_decrease(setup):
    cfg, params, rows, _ = setup
    tgt, drf, const = loop.split_params(jax.tree.map(jnp.copy, params))   # the steps donate their inputs
    assert "engram.token_map" in const and all(k.startswith("mtp.") for k in drf)
    tok = jnp.asarray(rows[:4])
    opt = loop.make_optimizer(3e-3, 8, warmup=1)
    st = opt.init(tgt)
    losses = []
    for _ in range(6):
        tgt, st, loss, kl = loop.target_step(tgt, st, const, cfg, tok, "fp32", opt)
        assert float(kl) == 0.0             # no distillation asked
        losses.append(float(loss))
    assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.3, losses

    frozen = {**tgt, **const}
    dopt = loop.make_optimizer(3e-3, 8, warmup=1)
    ds = dopt.init(drf)
    a = jnp.asarray(loop.sample_anchors(np.random.default_rng(0), cfg, 4, 32, 2))
    dl = []
    for _ in range(5):
        drf, ds, loss, aux = loop.draft_step(drf, ds, frozen, cfg, tok, a, "fp32", dopt, 0.5)
        dl.append(float(loss))
    assert np.isfinite(dl).all() and dl[-1] < dl[0], dl
    assert aux["hit_per_pos"].shape == (cfg.dspark_block_size,)


def test_export_load_round_trip(setup, tmp_path):
    import dsflash
    from dsflash.model.forward import forward
    from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch
    from dsflash.train.export import export_checkpoint

    cfg, params, rows, tokdir = setup
    stored = export_checkpoint(str(tmp_path), cfg, params, tokdir)
    m = dsflash.load(str(tmp_path), progress=False)
    assert m.cfg == cfg
    for k, v in stored.items():                      # bit-exact stored formats
        np.testing.assert_array_equal(np.asarray(m.params[k]).view(np.uint8), np.asarray(v).view(np.uint8),
                                      err_msg=k)
    np.testing.assert_array_equal(np.asarray(m.params["engram.token_map"]), np.asarray(params["engram.token_map"]))
    # logits of the loaded checkpoint == logits of the quantised float master weights
    qf = float_params(cfg, stored)
    qf["engram.token_map"] = params["engram.token_map"]
    tok = jnp.asarray(rows[:2])
    opts = RunOptions(precision="fp32", logits="all", page_size=16)

    @jax.jit
    def logits(p):
        st = init_state(cfg, CacheGeometry(2, 4, 16, 8), "fp32")
        return forward(p, cfg, make_batch(tok, pages_per_seq=2), st, opts)[0]["logits"]

    np.testing.assert_allclose(np.asarray(logits(m.params)), np.asarray(logits(qf)), rtol=1e-4, atol=1e-4)


def test_greedy_extend_is_the_targets_own_greedy_chain(setup):
    """DSpark trains on these rows: every generated token must be the argmax of the target's logits over the
    row as generated so far (and the kept prefix untouched)."""
    cfg, params, rows, _ = setup
    tok = jnp.asarray(rows[:2])
    start = 20
    out = np.asarray(loop.greedy_extend(params, cfg, tok, start, "fp32"))
    assert (out[:, :start] == rows[:2, :start]).all()
    lg = np.asarray(_target_logits(params, cfg, jnp.asarray(out), "fp32"))
    assert (out[:, start:] == lg[:, start - 1:-1].argmax(-1)).all()
    assert loop.sample_anchors(np.random.default_rng(0), cfg, 3, 32, 4, lo=start - 1).min() >= start - 1


def test_perplexity_counts_every_row_whatever_the_batch_size(setup):
    """A tail that does not fill a batch is evaluated too: the number does not depend on the batch size."""
    cfg, params, rows, _ = setup
    r = rows[:6]
    s, c = loop.eval_nll(params, cfg, jnp.asarray(r), "fp32")
    whole = float(np.exp(float(s) / int(c)))
    for b in (4, 5, 6):
        np.testing.assert_allclose(loop.perplexity(params, cfg, r, b, "fp32"), whole, rtol=1e-5)


def test_anchors_take_one_lower_bound_per_row(setup):
    """Chat-prompt rows start their chains at their own prompt's end: a per-row bound holds row by row, a bound
    below the window is raised to it, and a bound that leaves no anchor is an error naming it."""
    cfg = setup[0]
    lo = np.array([0, 12, 20, 27])
    a = loop.sample_anchors(np.random.default_rng(0), cfg, 4, 32, 64, lo=lo)
    hi = 32 - cfg.dspark_block_size - 1
    assert a.shape == (4, 64) and (a <= hi).all()
    assert (a.min(axis=1) >= np.maximum(lo, cfg.sliding_window)).all()
    with pytest.raises(ValueError, match="lower bound"):
        loop.sample_anchors(np.random.default_rng(0), cfg, 2, 32, 2, lo=np.array([10, hi + 1]))


# the shapes of the tests above (docs, vocab, batch 4 x 32, 2 anchors): their compiled steps are reused
PIPELINE = dict(vocab_size=512, batch_size=4, seq_len=32, anchors=2, eval_every=2, eval_batches=1, quiet=True,
                greedy_rows=8)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from dsflash.train import run
    out = tmp_path_factory.mktemp("pipeline")
    m = run.train(str(out), config="mini", steps=4, draft_steps=50, docs=data.corpus_documents()[:120],
                  max_draft_seconds=1e-9, **PIPELINE)
    return out, m


def test_pipeline_keeps_the_best_heldout_step_and_honours_the_time_budget(pipeline):
    """``dsflash.train.run.train`` end to end on the mini config: the exported target is the evaluated step
    with the lowest held-out loss (or the last when none beat the init), the draft stage stops at its time
    budget, and the checkpoint reloads with the held-out rows beside it."""
    import json
    import os

    tmp_path, m = pipeline
    log = [json.loads(x) for x in open(tmp_path / "log.jsonl")]
    evals = {r["step"]: r["heldout_loss"] for r in log if r["stage"] == "target" and "heldout_loss" in r}
    best = min((s for s in evals if s), key=evals.get)
    assert m["target_step_kept"] == (best if evals[best] < evals[0] else 4), evals
    assert m["steps_run"] == 4 and m["draft_steps_run"] == 1 and m["draft_data"] == "greedy"
    assert os.path.exists(tmp_path / "checkpoint" / "heldout_rows.npy")
    assert os.path.getsize(tmp_path / "loss.png") > 0          # matplotlib is in the [test] extra
    assert np.isfinite(m["loaded_heldout_ppl"])


def test_draft_only_stage_keeps_the_served_target_and_retrains_the_draft(pipeline, tmp_path, monkeypatch):
    """``train(target_from=...)``: only DSpark trains, on the served (stored) target's taps; the exported target
    is the source's, tensor for tensor, so its perplexity is unchanged; bad requests fail before any work."""
    import dsflash
    from dsflash.train import run

    docs = data.corpus_documents()[:120]
    kw = PIPELINE
    src_dir, src = pipeline
    ck = str(src_dir / "checkpoint")
    calls = []
    real = loop.greedy_pool_served

    def spy(model, rows, start, *a, **k):           # the engine's pools, as train() asks for and gets them
        out = real(model, rows, start, *a, **k)
        calls.append((np.array(rows), start, out))
        return out

    monkeypatch.setattr(loop, "greedy_pool_served", spy)
    m = run.train(str(tmp_path / "drf"), target_from=ck, draft_init="checkpoint", draft_steps=3, docs=docs,
                  greedy_batch=8, **kw)
    assert len(calls) == 2                           # the training pool, then the held-out pool
    a, b = dsflash.load(ck, progress=False), dsflash.load(str(tmp_path / "drf" / "checkpoint"), progress=False)
    assert a.params.keys() == b.params.keys()
    for k in a.params:
        if not k.startswith("mtp."):
            assert np.array_equal(np.asarray(a.params[k]), np.asarray(b.params[k])), k
    assert not all(np.array_equal(np.asarray(a.params[k]), np.asarray(b.params[k])) for k in a.params
                   if k.startswith("mtp."))
    assert m["loaded_heldout_ppl"] == src["loaded_heldout_ppl"]
    assert m["draft_steps_run"] == 3 and m["target_step_kept"] == src["target_step_kept"]
    assert m["draft_taps"].startswith("served target") and m["draft_init"] == "checkpoint"
    # the cached target (default: taps + logits of the pools computed once) trains exactly like the in-step one:
    # same batches, same losses, same held-out hits -- a misaligned cache row would change them. The second run's
    # pools are the first run's chains handed back (the same rows must be asked for): greedy decoding is
    # deterministic, so they are what its own engine would decode, and what differs between the runs is only
    # the cache (the engine's chains themselves are checked below)
    import json
    replay = list(calls)

    def replayed(model, rows, start, *a, **k):
        rows0, start0, out0 = replay.pop(0)
        assert start == start0 and np.array_equal(np.asarray(rows), rows0)
        return out0.copy()

    monkeypatch.setattr(loop, "greedy_pool_served", replayed)
    monkeypatch.setattr(loop, "served_engine", lambda *a, **k: None)     # no engine to build: nothing decodes
    m2 = run.train(str(tmp_path / "nocache"), target_from=ck, draft_init="checkpoint", draft_steps=3, docs=docs,
                   greedy_batch=8, target_cache=False, **kw)
    assert not replay                                # both pools were asked for again
    monkeypatch.undo()

    def draft_log(d):
        return [r for r in map(json.loads, open(tmp_path / d / "log.jsonl")) if r["stage"] == "draft"]
    for r1, r2 in zip(draft_log("drf"), draft_log("nocache"), strict=True):
        np.testing.assert_allclose(r1["loss"], r2["loss"], rtol=1e-5)
    np.testing.assert_allclose(m["loaded_draft_teacher_forced_hit_per_pos"],
                               m2["loaded_draft_teacher_forced_hit_per_pos"], atol=1e-6)
    # the chains come from the engine (KV-cached decode of the served target): each generated token is the
    # served target's argmax given the chain so far (a full recompute at reference precision). The held-out
    # pool the first run decoded is these held-out rows, continued from position 16
    rows = np.load(src_dir / "checkpoint" / "heldout_rows.npy").astype(np.int32)[:4]
    held_rows, start, chains = calls[1]
    assert start == 16 and np.array_equal(held_rows, rows)
    assert (chains[:, :16] == rows[:, :16]).all() and not (chains[:, 16:] == rows[:, 16:]).all()
    served = {k: v for k, v in a.params.items() if not k.startswith("mtp.")}
    lg = np.asarray(_target_logits(served, a.cfg, jnp.asarray(chains), "reference"))
    assert (chains[:, 16:] == lg[:, 15:-1].argmax(-1)).mean() >= 0.95
    with pytest.raises(ValueError, match="corpus"):
        run.train(str(tmp_path / "bad"), target_from=ck, draft_steps=1, docs=docs[:100], **kw)
    with pytest.raises(ValueError, match="draft_init"):
        run.train(str(tmp_path / "bad"), draft_init="checkpoint", docs=docs, **kw)
    with pytest.raises(ValueError, match="dspark_"):
        run.train(str(tmp_path / "bad"), target_from=ck, draft_overrides={"hidden_size": 8}, docs=docs, **kw)


def test_other_corpus_trains_the_draft_and_keeps_the_checkpoints_heldout_rows(pipeline, tmp_path):
    """``allow_other_corpus``: a corpus unlike the checkpoint's (here a subset of its documents; in practice another
    Python's) trains the draft; the perplexity rows stay the checkpoint's own, so the recorded perplexity of the
    unchanged target is reproduced, and the export records the draft's corpus."""
    from dsflash.train import run

    src_dir, src = pipeline
    ck = str(src_dir / "checkpoint")
    docs = data.corpus_documents()[:100]
    m = run.train(str(tmp_path / "other"), target_from=ck, draft_steps=1, docs=docs, allow_other_corpus=True,
                  greedy_batch=8, **PIPELINE)
    want = np.load(src_dir / "checkpoint" / "heldout_rows.npy")
    got = np.load(tmp_path / "other" / "checkpoint" / "heldout_rows.npy")
    assert np.array_equal(got, want)
    assert m["loaded_heldout_ppl"] == src["loaded_heldout_ppl"]
    assert m["draft_corpus"]["sha256"] != m["corpus"]["sha256"] == src["corpus"]["sha256"]


def test_greedy_doc_starts_pool_rows_begin_at_document_starts(pipeline, tmp_path, monkeypatch):
    """``train(doc_start_fraction=f)``: that fraction of each greedy pool (training and held-out) is the first tokens
    of a document of that split (BOS, then its ids: what a text prompt cut from a document's start is sent as),
    the rest mid-stream rows as before; before ``start`` the rows are that data, from ``start`` on the engine's
    greedy chain; the fraction is recorded in the checkpoint; a fraction outside [0, 1] fails before any work."""
    import json

    import dsflash
    from dsflash.tokenizer import Tokenizer
    from dsflash.train import run

    docs = data.corpus_documents()[:120]
    src_dir, _ = pipeline
    ck = str(src_dir / "checkpoint")
    calls = []
    real = loop.greedy_pool_served

    def spy(model, rows, start, *a, **k):           # what train() hands the engine, and what comes back
        out = real(model, rows, start, *a, **k)
        calls.append((np.array(rows), start, out))
        return out

    monkeypatch.setattr(loop, "greedy_pool_served", spy)
    frac = 0.5
    m = run.train(str(tmp_path / "doc"), target_from=ck, draft_steps=1, docs=docs, greedy_batch=8,
                  doc_start_fraction=frac, **PIPELINE)
    assert len(calls) == 2                           # the training pool, then the held-out pool

    tok = Tokenizer.from_folder(ck)
    train_docs, held_docs = data.split_documents(docs)
    seq_len, start = PIPELINE["seq_len"], PIPELINE["seq_len"] // 2
    held = np.load(tmp_path / "doc" / "checkpoint" / "heldout_rows.npy").astype(np.int32)
    mid_stream = {"train": {tuple(r) for r in data.pack(data.encode_documents(tok, train_docs), seq_len)},
                  "held": {tuple(r) for r in held}}
    a = dsflash.load(ck, progress=False)
    served = {k: v for k, v in a.params.items() if not k.startswith("mtp.")}
    n_docs = {}
    for (rows, s, out), split, split_docs, n in zip(calls, ("train", "held"), (train_docs, held_docs),
                                                    (PIPELINE["greedy_rows"], len(held))):
        assert s == start and rows.shape == (n, seq_len)
        firsts = {tuple(ids[:start]): ids for ids in map(tok.encode_prompt, split_docs) if len(ids) - 1 >= start}
        assert len(firsts) >= round(frac * n) > 0, "the test needs enough long documents"
        is_doc = np.array([tuple(r[:start]) in firsts for r in rows])
        in_mid = np.array([tuple(r) in mid_stream[split] for r in rows])
        n_docs[split] = round(frac * n)
        # a mid-stream row cut at a document's BOS starts exactly like that document: it may count on either side
        assert (is_doc & ~in_mid).sum() <= n_docs[split] <= is_doc.sum(), (split, is_doc, in_mid)
        for r in rows[is_doc]:                       # a document's own first tokens, as far as the row reaches
            ids = firsts[tuple(r[:start])]
            k = min(len(ids), seq_len)
            assert list(r[:k]) == list(ids[:k])
        assert len({tuple(r[:start]) for r in rows[is_doc]}) >= n_docs[split]    # distinct documents
        assert in_mid[~is_doc].all(), split
        # before start: the data; from start on: the served target's greedy chain (full recompute at reference)
        assert (out[:, :start] == rows[:, :start]).all()
        assert not (out[is_doc, start:] == rows[is_doc, start:]).all()
        lg = np.concatenate([np.asarray(_target_logits(served, a.cfg, jnp.asarray(out[i:i + 4]), "reference"))
                             for i in range(0, len(out), 4)])             # one compiled shape for every batch
        # KV-cached decode vs a full recompute, both at reference precision: the trained demo model agrees on
        # 97.4 % of positions for document starts and 97.7 % mid-document (measured 2026-11-30); this 4-step
        # mini model has flatter logits (more near-ties): 93 %. A chain that were not the target's would be ~0.
        assert (out[:, start:] == lg[:, start - 1:-1].argmax(-1)).mean() >= 0.9
    meta = json.load(open(tmp_path / "doc" / "checkpoint" / "training.json"))
    assert meta["greedy_doc_starts"] == frac and meta["greedy_rows"] == PIPELINE["greedy_rows"]
    assert meta["greedy_doc_start_rows"] == n_docs["train"] and meta["greedy_doc_start_held_rows"] == n_docs["held"]
    assert m["greedy_doc_starts"] == frac
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="doc_start_fraction"):
            run.train(str(tmp_path / "bad"), target_from=ck, docs=docs, doc_start_fraction=bad, **PIPELINE)
    with pytest.raises(ValueError, match="doc_start_fraction"):
        run.train(str(tmp_path / "bad"), docs=docs, draft_data="data", doc_start_fraction=0.5, **PIPELINE)


def test_greedy_chat_prompt_rows_chain_from_each_prompts_end(pipeline, tmp_path, monkeypatch):
    """``train(chat_prompt_fraction=f)``: that fraction of each greedy pool is the first-turn prompt of a chat
    conversation of the split (as the server renders and tokenises it; held-out conversations for the held-out
    pool), only prompts that fit before ``greedy_start``; the engine's chain starts at each prompt's own end and is
    the served target's greedy continuation; the document-start rows are kept; anchors never fall inside a
    prompt; the counts are recorded; a fraction that does not fit beside the document starts fails first."""
    import json

    import dsflash
    from dsflash.tokenizer import Tokenizer
    from dsflash.train import chat_data, run

    docs = data.corpus_documents()[:120]
    src_dir, _ = pipeline
    ck = str(src_dir / "checkpoint")
    calls, anchors = [], []
    real, real_anchors = loop.greedy_pool_served, loop.sample_anchors

    def spy(model, rows, start, *a, **k):
        out = real(model, rows, start, *a, **k)
        calls.append((np.array(rows), np.broadcast_to(start, (len(rows),)).copy(), out))
        return out

    def spy_anchors(rng, cfg, B, S, J, lo=0):
        a = real_anchors(rng, cfg, B, S, J, lo)
        anchors.append((a, np.broadcast_to(np.maximum(lo, cfg.sliding_window), (B,)).copy()))
        return a

    monkeypatch.setattr(loop, "greedy_pool_served", spy)
    monkeypatch.setattr(loop, "sample_anchors", spy_anchors)
    frac, dfrac, start = 0.25, 0.25, 24
    m = run.train(str(tmp_path / "chat"), target_from=ck, draft_steps=2, docs=docs, greedy_batch=8,
                  greedy_start=start, doc_start_fraction=dfrac, chat_prompt_fraction=frac,
                  **dict(PIPELINE, greedy_rows=16))
    assert len(calls) == 2
    tok = Tokenizer.from_folder(ck)
    train_c, held_c = chat_data.split(chat_data.conversations())
    a = dsflash.load(ck, progress=False)
    served = {k: v for k, v in a.params.items() if not k.startswith("mtp.")}
    n_chat = {}
    for (rows, starts, out), convs in zip(calls, (train_c, held_c)):
        prompts = {tuple(p) for p in chat_data.first_turn_prompts(tok, convs) if len(p) <= start}
        pad = tok.pad_id if tok.pad_id is not None else tok.eos_id
        is_chat = np.array([tuple(r[:s]) in prompts and (r[s:] == pad).all() for r, s in zip(rows, starts)])
        n_chat[len(n_chat)] = int(is_chat.sum())
        assert is_chat.sum() == round(frac * len(rows)) > 0, "the test needs short chat prompts"
        assert (starts[~is_chat] == start).all()
        assert all(r[0] == tok.bos_id for r in rows[is_chat])       # whole prompts of this split, then padding
        firsts = {tuple(ids[:start]) for ids in map(tok.encode_prompt, docs)}
        assert sum(tuple(r[:start]) in firsts for r in rows[~is_chat]) >= round(dfrac * len(rows))
        for r, s, o in zip(rows, starts, out):
            assert (o[:s] == r[:s]).all()
        lg = np.concatenate([np.asarray(_target_logits(served, a.cfg, jnp.asarray(out[i:i + 4]), "reference"))
                             for i in range(0, len(out), 4)])
        gen = np.arange(out.shape[1])[None, 1:] >= starts[:, None]          # positions the engine generated
        hit = out[:, 1:] == lg[:, :-1].argmax(-1)
        assert hit[gen].mean() >= 0.9 and not (out[is_chat] == rows[is_chat]).all()
    for a_, lo in anchors:                                   # training and evaluation batches alike
        assert (a_ >= lo[:, None]).all()
    assert any((lo < start - 1).any() for _, lo in anchors)  # some batch held a chat row
    meta = json.load(open(tmp_path / "chat" / "checkpoint" / "training.json"))
    assert meta["greedy_chat_prompts"] == frac and meta["greedy_doc_starts"] == dfrac
    assert (meta["greedy_chat_prompt_rows"], meta["greedy_chat_prompt_held_rows"]) == (n_chat[0], n_chat[1])
    assert m["greedy_chat_prompt_rows"] == n_chat[0]
    for bad in (-0.1, 0.8):
        with pytest.raises(ValueError, match="chat_prompt_fraction"):
            run.train(str(tmp_path / "bad"), target_from=ck, docs=docs, doc_start_fraction=dfrac,
                      chat_prompt_fraction=bad, **PIPELINE)
    with pytest.raises(ValueError, match="chat_prompt_fraction"):
        run.train(str(tmp_path / "bad"), docs=docs, chat_prompt_fraction=0.5, **PIPELINE)


def test_greedy_doc_starts_are_capped_at_the_long_documents(pipeline, tmp_path):
    """More document-start rows asked for than there are documents with >= ``start`` tokens: every such document is
    used once and mid-stream rows keep the pool at its size."""
    from dsflash.tokenizer import Tokenizer
    from dsflash.train import run

    docs = data.corpus_documents()[:120]
    ck = str(pipeline[0] / "checkpoint")
    corpus = data.Corpus(str(tmp_path / "tok"), PIPELINE["vocab_size"], PIPELINE["vocab_size"] - 1,
                         PIPELINE["seq_len"], docs=docs, tokenizer_from=ck)
    start = 24
    held_ids = list(map(Tokenizer.from_folder(ck).encode_prompt, data.split_documents(docs)[1]))
    long_docs = [ids for ids in held_ids if len(ids) - 1 >= start]
    mid = corpus.train_rows[: 3 * len(held_ids)]
    assert 0 < len(long_docs) < len(mid)
    rows, n, is_doc = run._with_doc_starts(corpus, mid, "held", 1.0, start, seed=0)
    assert n == len(long_docs) == is_doc.sum() and rows.shape == mid.shape
    assert {tuple(r[:start]) for r in rows[is_doc]} == {tuple(ids[:start]) for ids in long_docs}
    firsts = sorted(tuple(ids[:start]) for ids in long_docs)
    assert sorted(tuple(r[:start]) for r in rows if tuple(r[:start]) in set(firsts)) == firsts
    assert run._with_doc_starts(corpus, mid, "held", 0.0, start, seed=0)[0] is mid     # default: untouched
