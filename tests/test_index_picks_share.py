"""scripts/index_picks_share.py: the picks' share of the attention mass equals a direct numpy sum on a constructed
case (empty slots and duplicates ignored), is 1 where index_topk covers every visible entry and strictly inside
(0, 1) and at most the best k entries' mass where it does not; in the tiny model the captured top-k are the
captured scores' best entries, all visible, and the forward's hooks are removed afterwards."""
import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.train import teacher_picks

_spec = importlib.util.spec_from_file_location(
    "index_picks_share", os.path.join(os.path.dirname(__file__), "..", "scripts", "index_picks_share.py"))
ips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ips)


def test_share_matches_a_direct_sum():
    rng = np.random.default_rng(0)
    t = rng.random((3, 10))
    t[:, 7:] = 0.0                                         # 7 visible entries
    picks = np.asarray([[0, 3, -1], [6, 6, 2], [-1, -1, -1]])
    got = ips.picks_share(t, picks)
    want = [(t[0, 0] + t[0, 3]) / t[0].sum(), (t[1, 6] + t[1, 2]) / t[1].sum(), 0.0]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert all(0 < g < 1 for g in got[:2])
    assert np.isnan(ips.picks_share(np.zeros((1, 4)), np.asarray([[0, 1]])))[0]       # no mass: NaN, not 0
    # every visible entry picked: exactly 1
    assert ips.picks_share(t[:1], np.asarray([[6, 5, 4, 3, 2, 1, 0, -1]]))[0] == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(ips.oracle_share(t[:1], 2), np.sort(t[0])[-2:].sum() / t[0].sum())
    assert ips.effective_entries(np.asarray([[0.25, 0.25, 0.25, 0.25, 0.0]]))[0] == pytest.approx(4.0)


def test_entity_helpers():
    assert ips.entity_entries([5, 6, 7], 2) == [2, 3] and ips.entity_entries([5, 6], 1) == [5, 6]
    s = np.asarray([[0.5, 3.0, 1.0, -np.inf], [2.0, 1.0, 0.0, -np.inf]])
    np.testing.assert_array_equal(ips.entity_rank(s, [2]), [1, 2])
    np.testing.assert_array_equal(ips.entity_rank(s, [3]), [-1, -1])        # not visible
    assert ips.tokens_overlapping([(0, 3), (3, 5), (5, 9)], 4, 6) == [1, 2]
    np.testing.assert_array_equal(ips.all_picked([3, 8, 9], 8), [True, True, False])


@pytest.fixture(scope="module")
def captured():
    from dsflash.model.params import float_params, init_params
    from dsflash.train.config import mini_config
    cfg = mini_config(512)
    params = float_params(cfg, init_params(cfg, 0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 500, size=(2, 48)), jnp.int32)
    return cfg, ips.capture(params, cfg, tokens, jnp.asarray([48, 40], jnp.int32))


def test_tiny_model_share_is_one_when_topk_covers_all_and_inside_0_1_otherwise(captured):
    from dsflash.model import attention
    from dsflash.model import index_distill as idd
    cfg, rec = captured
    assert attention.index_distill_loss is idd.index_distill_loss                  # hooks removed
    assert sorted(rec) == sorted(cfg.index_source_layer_ids)
    K = cfg.index_topk
    for layer, d in rec.items():
        for b, n in ((0, 48), (1, 40)):
            t, pk, vis, sc = d["target"][b, :n], d["topk"][b, :n], d["visible"][b, :n], d["score"][b, :n]
            has = vis > 0
            np.testing.assert_allclose(t[has].sum(-1), 1.0, rtol=1e-5)
            assert np.all((pk < vis[:, None]) | (pk < 0)), layer          # only visible entries picked
            share, oracle = ips.picks_share(t, pk), ips.oracle_share(t, K)
            cover = has & ips.all_picked(vis, K)
            assert cover.any() and (has & ~cover).any(), (layer, vis)
            np.testing.assert_allclose(share[cover], 1.0, rtol=1e-6)
            part = share[has & ~cover]
            assert np.all((part > 0) & (part < 1)), (layer, part)
            assert np.all(part <= oracle[has & ~cover] + 1e-9)
            if layer < cfg.candidate_source_layer_id:
                # no candidate filter: the picks are the captured scores' best min(K, visible) entries
                for s in np.nonzero(has & ~cover)[0]:
                    chosen = pk[s][pk[s] >= 0]
                    assert len(chosen) == K
                    rest = np.setdiff1d(np.arange(vis[s]), chosen)
                    assert sc[s, chosen].min() >= sc[s, rest].max(), (layer, s)


def test_forced_picks_put_the_entries_in_once():
    topk = jnp.asarray([[[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, -1]]], jnp.int32)
    got = np.asarray(ips.forced_picks(topk, jnp.asarray([[5, 1, -1]], jnp.int32), jnp.asarray([[9, 9, 3]]),
                                      jnp.asarray([[True, True, True]])))
    # the entries take the last F=3 slots (a pad keeps the slot's pick), copies elsewhere blanked; row 2: 5 not visible
    np.testing.assert_array_equal(got, [[[0, 5, 1, 3], [4, 5, 1, 7], [0, -1, 1, -1]]])
    for row in got[0]:
        kept = row[row >= 0]
        assert len(set(kept.tolist())) == len(kept)


def test_tiny_model_forced_entries_reach_the_picks_and_the_outputs(captured):
    from dsflash.model import attention
    from dsflash.model.params import float_params, init_params
    cfg, _ = captured
    params = float_params(cfg, init_params(cfg, 0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 500, size=(2, 48)), jnp.int32)
    lengths = jnp.asarray([48, 40], jnp.int32)
    cases = [{"entity_pos": [3, 4, 5]}, {"entity_pos": [10]}]
    force = {r: jnp.asarray(v) for r, v in ips.entity_force(cases, [cfg.ratio(l) for l in cfg.index_source_layer_ids]
                                                            ).items()}
    rec = ips.capture(params, cfg, tokens, lengths, force=force)
    assert not isinstance(attention.ik, teacher_picks.Proxy)                              # hook removed
    for layer, d in rec.items():
        ents = ips.entity_entries(cases[0]["entity_pos"], cfg.ratio(layer))
        rows = np.nonzero(d["visible"][0] > max(ents))[0]
        assert all(set(ents) <= set(d["topk"][0, s].tolist()) for s in rows), layer
    plain, forced = ips.next_token(params, cfg, tokens, lengths), ips.next_token(params, cfg, tokens, lengths, force)
    assert np.abs(plain[0] - forced[0]).max() > 1e-4            # the forced picks change what the model predicts
    np.testing.assert_array_equal(plain[0][:, :3], forced[0][:, :3])    # not before any forced entry is visible


def test_entity_rank_breaks_ties_as_the_selection_does():
    # the selection takes ties in ascending id order (SPEC 4.5): among equal scores a lower id ranks first
    s = np.asarray([[0.0, 0.0, 0.0, 0.0, -np.inf], [0.0, 1.0, 0.0, 0.0, 0.0]])
    np.testing.assert_array_equal(ips.entity_rank(s, [2]), [2, 2])
    np.testing.assert_array_equal(ips.entity_rank(s, [3, 2]), [2, 2])          # the best entity entry counts
    np.testing.assert_array_equal(ips.entity_rank(s, [0]), [0, 1])
    np.testing.assert_array_equal(ips.entity_tied(s, [2]), [4, 4])              # entries sharing that score


@pytest.fixture(scope="module")
def collapsed():
    """The mini model with a consumer layer (3, after the candidate source 2) and the candidate source's indexer
    dead (head weights 0: every score 0, as layer 5's after the teacher-picks run), so its picks and its candidate
    blocks are decided by the tie rule alone."""
    from dsflash.model.params import float_params, init_params
    from dsflash.train.config import mini_config
    cfg = mini_config(512).replace(index_source_layer_ids=(1, 2, 3))
    params = dict(float_params(cfg, init_params(cfg, 0)))
    w = f"layers.{cfg.candidate_source_layer_id}.attn.indexer.weights_proj.weight"
    params[w] = jnp.zeros_like(params[w])
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 500, size=(2, 48)), jnp.int32)
    return cfg, ips.capture(params, cfg, tokens, jnp.asarray([48, 40], jnp.int32))


def test_entity_rank_below_topk_exactly_when_picked(collapsed):
    """layer_rows's rank of an entity and whether it is picked agree at every layer and row: the rank is taken over
    the entries the layer selects from (a consumer's candidate set) with the selection's tie rule."""
    cfg, rec = collapsed
    K, cs = cfg.index_topk, cfg.candidate_source_layer_id
    assert np.all(rec[cs]["score"][0][rec[cs]["visible"][0] > 0][:, 0] == 0)      # the dead indexer: all ties
    n, seen = 48, {"ranked_not_picked": 0, "picked": 0, "consumer_excluded": 0}
    for layer in cfg.index_source_layer_ids:
        r = cfg.ratio(layer)
        for s in range(16, n - 1, 5):                     # row s predicts token s + 1
            vis = int(rec[layer]["visible"][0, s])
            for e in range(vis):
                case = {"entity_pos": [e * r], "arg_pos": [s + 1], "answer_start": s + 1, "ids": np.zeros(n, int)}
                a = ips.layer_rows(rec, cfg, case, 0, layer)["arg"]
                assert a["entity_picked_first"] == (0 <= a["entity_rank_first"] < K), (layer, s, e, a)
                seen["picked"] += a["entity_picked_first"]
                if layer > cs and not a["entity_picked_first"] and a["entity_rank_first_all"] < K:
                    seen["consumer_excluded"] += 1       # ranked in the top-k over all entries, outside the candidates
    assert seen["picked"] and seen["consumer_excluded"], seen
