"""dsflash.train: a few optax steps reduce the target and DSpark losses; export -> dsflash.load round trip."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.model.params import float_params, init_params
from dsflash.train import data, loop
from dsflash.train.config import mini_config


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
        tgt, st, loss = loop.target_step(tgt, st, const, cfg, tok, "fp32", opt)
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
    lg = np.asarray(loop._target_forward(params, cfg, jnp.asarray(out), "fp32")["logits"])
    assert (out[:, start:] == lg[:, start - 1:-1].argmax(-1)).all()
    assert loop.sample_anchors(np.random.default_rng(0), cfg, 3, 32, 4, lo=start - 1).min() >= start - 1


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
    assert np.isfinite(m["loaded_heldout_ppl"])


def test_draft_only_stage_keeps_the_served_target_and_retrains_the_draft(pipeline, tmp_path):
    """``train(target_from=...)``: only DSpark trains, on the served (stored) target's taps; the exported target
    is the source's, tensor for tensor, so its perplexity is unchanged; bad requests fail before any work."""
    import dsflash
    from dsflash.train import run

    docs = data.corpus_documents()[:120]
    kw = PIPELINE
    src_dir, src = pipeline
    ck = str(src_dir / "checkpoint")
    m = run.train(str(tmp_path / "drf"), target_from=ck, draft_init="checkpoint", draft_steps=3, docs=docs,
                  greedy_batch=8, **kw)
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
    # the chains come from the engine (KV-cached decode of the served target): each generated token is the
    # served target's argmax given the chain so far (a full recompute at reference precision)
    rows = np.load(src_dir / "checkpoint" / "heldout_rows.npy").astype(np.int32)[:4]
    chains = loop.greedy_pool_served(a, rows, 16, max_num_seqs=4)
    assert (chains[:, :16] == rows[:, :16]).all() and not (chains[:, 16:] == rows[:, 16:]).all()
    served = {k: v for k, v in a.params.items() if not k.startswith("mtp.")}
    lg = np.asarray(loop._target_forward(served, a.cfg, jnp.asarray(chains), "reference")["logits"])
    assert (chains[:, 16:] == lg[:, 15:-1].argmax(-1)).mean() >= 0.95
    with pytest.raises(ValueError, match="corpus"):
        run.train(str(tmp_path / "bad"), target_from=ck, draft_steps=1, docs=docs[:100], **kw)
    with pytest.raises(ValueError, match="draft_init"):
        run.train(str(tmp_path / "bad"), draft_init="checkpoint", docs=docs, **kw)
    with pytest.raises(ValueError, match="dspark_"):
        run.train(str(tmp_path / "bad"), target_from=ck, draft_overrides={"hidden_size": 8}, docs=docs, **kw)
