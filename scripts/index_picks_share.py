"""How much of the main attention's mass over the compressed entries the indexer's top-k picks hold, and whether the
entries covering the asked-about entity are among them, at the rows of a tool call that must copy the entity's name.

For a checkpoint and tool-call conversations (chosen as ``scripts/chat_samples.py --trials N`` chooses them), each
is teacher-forced through its first assistant turn (prompt + reference tool call) with the fp32 forward, and at
every index-source layer the forward's own quantities are taken from inside it (``capture``): the distillation
target of ``dsflash.model.index_distill`` (the heads' mean attention over all visible compressed entries, exactly
what ``index_distill_loss`` receives), the indexer's scores and the top-k the layer actually used (candidate filter
included). Per layer, at the rows that predict the argument's name tokens (``arg``) and at all rows of the answer
(``answer``):

* ``share``: the target mass on the picked entries (``picks_share``; 1 when every visible entry is picked);
* ``random`` / ``oracle``: what k entries drawn blind would hold (k / visible) and the most any k entries could
  hold (the target's top-k mass), to read ``share`` against; ``effective_entries``: exp(entropy) of the target;
* ``entity_picked``: an entry covering the entity's tokens in the user turn is among the picks;
* ``entity_mass`` / ``entity_uniform``: the target's mass on those entries, and what a flat distribution would give;
* ``entity_rank``: the best entity entry's place in the layer's own selection order (score descending, ties to the
  lower id, as the top-k takes them) among the entries the layer chooses from (a candidate consumer: its candidate
  set), so it is picked exactly when the rank is below ``index_topk``; ``entity_rank_all``: the same over every
  visible entry (differs at a consumer whose candidate filter excludes the entity); ``entity_tied``: how many
  entries share that score (many: the indexer does not separate them and the tie rule -- lowest ids -- decides).
  (Exact at ``--precision fp32``, where the captured scores are the forward's; at ``reference`` the captured scores
  use unquantized keys.)

Before running the model it checks whether ``index_topk`` covers every visible entry at the measured rows (then every
entry is picked, the share is trivially 1 and the picks cannot be the bottleneck) and says so. ``--force-entity``
also scores the reference name teacher-forced (NLL, argmax) twice: with the picks as they are and with the entity's
entries forced into every index-source layer's picks (``forced_picks``; the layers that reuse a source's picks get
them too) -- whether the model names the entity when the picks do hold it -- in the argument (60-100 tokens after
the entity) and, as a control, where a thinking turn's reasoning repeats the name inside the window. Prints a
table, and JSON with ``--json``.

    PYTHONPATH=$PWD python scripts/index_picks_share.py CHECKPOINT_DIR [--trials 20] [--trials-split train]
        [--force-entity] [--json F]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import numpy as np


# ------------------------------------------------------------------ pure helpers (tests/test_index_picks_share.py)
def picks_share(target, picks):
    """Share of each row's mass in ``target`` [..., T] on the entries in ``picks`` [..., K] (-1: empty slot);
    NaN for a row with no mass. Duplicate picks count once."""
    target = np.asarray(target, np.float64)
    picks = np.asarray(picks)
    onehot = (picks[..., :, None] == np.arange(target.shape[-1])).any(-2)        # -1 matches nothing
    tot = target.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, (target * onehot).sum(-1) / np.where(tot > 0, tot, 1.0), np.nan)


def oracle_share(target, k):
    """The most mass any ``k`` entries of each row of ``target`` [..., T] hold (share of the row's total; NaN
    without mass)."""
    target = np.asarray(target, np.float64)
    top = -np.sort(-target, axis=-1)[..., :k].sum(-1)
    tot = target.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tot > 0, top / np.where(tot > 0, tot, 1.0), np.nan)


def effective_entries(target):
    """exp(entropy) of each row of ``target`` [..., T] (normalised first): how many entries its mass is spread
    over (1: one entry; T: flat); NaN without mass."""
    target = np.asarray(target, np.float64)
    tot = target.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = target / tot
        h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), -1)
    return np.where(tot[..., 0] > 0, np.exp(h), np.nan)


def entity_entries(positions, ratio):
    """Compressed entry ids covering token ``positions`` at compression ``ratio`` (entry j holds tokens
    ``j*ratio .. j*ratio+ratio-1``)."""
    return sorted({int(p) // int(ratio) for p in positions})


def all_picked(visible, topk):
    """True where the top-k covers every visible entry (``visible`` <= ``topk``): all are picked, share is 1."""
    return np.asarray(visible) <= int(topk)


def entity_rank(score, entries):
    """Per row of ``score`` [..., T] (-inf: not selectable): the best of ``entries``'s place in the selection's order
    (score descending, ties to the lower id, as ``kernels.indexer_topk.select_topk``): how many entries score above
    it or tie with it at a lower id. So it is picked exactly when the rank is below ``index_topk`` (0: the top); -1
    where none of them is selectable."""
    score = np.asarray(score, np.float64)
    ent = sorted(e for e in entries if e < score.shape[-1])
    if not ent:
        return np.full(score.shape[:-1], -1)
    es = score[..., ent]
    best = es.max(-1)
    first = np.asarray(ent)[np.argmax(es, -1)]                 # the lowest id among the entity's best
    ahead = (score > best[..., None]) | ((score == best[..., None]) & (np.arange(score.shape[-1]) < first[..., None]))
    return np.where(np.isfinite(best), ahead.sum(-1), -1)


def entity_tied(score, entries):
    """Per row of ``score`` [..., T]: how many entries share the best of ``entries``'s score (itself included; 0 where
    none of them is selectable). Many: the rank is decided by the tie rule (a dead indexer scores 0 everywhere)."""
    score = np.asarray(score, np.float64)
    ent = [e for e in entries if e < score.shape[-1]]
    if not ent:
        return np.zeros(score.shape[:-1], int)
    best = score[..., ent].max(-1)
    return np.where(np.isfinite(best), (score == best[..., None]).sum(-1), 0)


def token_byte_spans(tokenizer, ids):
    """[(start, end)] byte offsets of each token in the decoded text."""
    out, pos = [], 0
    for i in ids:
        n = len(tokenizer.token_bytes(int(i)))
        out.append((pos, pos + n))
        pos += n
    return out


def tokens_overlapping(spans, start, end):
    """Token positions whose byte span overlaps ``[start, end)``."""
    return [t for t, (a, b) in enumerate(spans) if a < end and b > start]


# ------------------------------------------------------------------ cases
def pick_conversations(n, split="train"):
    """The tool conversations ``scripts/chat_samples.py --trials n --trials-split split`` scores (its selection)."""
    from dsflash.train import chat_data
    return chat_data.trial_conversations(chat_data.conversations(), n, split)["tool"]


def encode_case(tokenizer, conv):
    """A conversation's first assistant turn teacher-forced: ids, where the answer starts, the entity's tokens in the
    user turn and the argument's name tokens in the answer."""
    from dsflash.train import chat_data
    c = dict(conv, messages=conv["messages"][:2])
    ids, mask = chat_data.encode(tokenizer, c)
    text = "".join(t for t, _ in chat_data.render(c)).encode("utf-8")
    spans = token_byte_spans(tokenizer, ids)
    if spans[-1][1] != len(text):
        raise ValueError(f"{conv['name']}: token bytes do not join to the rendered text")
    name, user = conv["name"].encode("utf-8"), conv["messages"][0]["content"].encode("utf-8")
    ans0 = int(np.argmax(mask))                         # first answer token
    u = text.rfind(user, 0, spans[ans0][0])
    e = text.find(name, u, u + len(user))
    a = text.find(b'string="true">' + name, spans[ans0][0])
    if u < 0 or e < 0 or a < 0:
        raise ValueError(f"{conv['name']}: entity or argument not found")
    a += len(b'string="true">')
    last = text.rfind(name, 0, a)                       # the nearest earlier mention (a thinking turn's reasoning)
    said = text.find(name, spans[ans0][0], a)           # the answer's first mention before the argument (reasoning)
    return {"name": conv["name"], "thinking": conv["thinking"], "ids": np.asarray(ids, np.int32), "answer_start": ans0,
            "entity_pos": tokens_overlapping(spans, e, e + len(name)),
            "arg_pos": tokens_overlapping(spans, a, a + len(name)),
            "nearest_mention_pos": tokens_overlapping(spans, last, last + len(name)),
            "reasoning_pos": tokens_overlapping(spans, said, said + len(name)) if said >= 0 else []}


# ------------------------------------------------------------------ the forward's own quantities
def forced_picks(topk, entries, visible, valid):
    """``topk`` [B, S, K] with each row's visible ``entries`` [B, F] (distinct ids, -1 pad) put in: copies already
    there are blanked (-1) and the entries take the last F slots (a pad or an entry not yet visible leaves the
    slot's pick). So a row keeps at least K - F of its own picks besides the entity's entries. The training's
    teacher picks with one entry list for every position (``teacher_picks.force_positions``)."""
    from dsflash.train.teacher_picks import force_positions
    return force_positions(topk, entries[:, None, :], visible, valid)


@contextlib.contextmanager
def _hooks(rec, force=None, page_size=16):
    """Record, per index-source layer, the distillation target, the indexer's scores and visible counts (from the
    arguments ``csa_attention`` passes ``index_distill_loss``; the scores before any candidate filter), the top-k
    that layer published and, at a candidate consumer, the candidate mask its top-k was restricted to. ``force``
    ({ratio: entries [B, F]}): every index-source layer's picks get those entries (``forced_picks``)."""
    import importlib
    import jax.numpy as jnp
    from dsflash.kernels.indexer_topk import indexer_scores_reference
    from dsflash.train.teacher_picks import Proxy
    from dsflash.model import index_distill as idd
    attention = importlib.import_module("dsflash.model.attention")
    fwd = importlib.import_module("dsflash.model.forward")     # (dsflash.model.forward is also a function's name)
    orig_loss, orig_csa, orig_ik, cur = attention.index_distill_loss, fwd.csa_attention, attention.ik, []

    def loss_hook(q_idx, w_idx, k_idx, q, kv, visible, valid, scale, rope=None):
        f32 = jnp.float32
        rec[cur[-1]] = {"target": idd.attention_target(q, kv, visible, valid, scale, rope), "visible": visible,
                        "score": indexer_scores_reference(q_idx.astype(f32), w_idx.astype(f32), k_idx.astype(f32),
                                                          visible, valid)}
        return orig_loss(q_idx, w_idx, k_idx, q, kv, visible, valid, scale, rope)

    def csa_hook(params, cfg, layer, *a):
        cur.append(layer)
        y, state, shared = orig_csa(params, cfg, layer, *a)
        if layer in rec:
            rec[layer]["topk"] = shared["topk"]
            if layer > cfg.candidate_source_layer_id and "cand" in shared:     # a consumer: it chose among these
                rec[layer]["cand"] = shared["cand"]
        return y, state, shared

    def topk_hook(q, w, pool, page_table, per_page, visible, valid, **kw):
        topk, cand = orig_ik.indexer_topk_paged(q, w, pool, page_table, per_page, visible, valid, **kw)
        return forced_picks(topk, force[page_size // per_page], visible, valid), cand

    attention.index_distill_loss, fwd.csa_attention = loss_hook, csa_hook
    if force is not None:
        attention.ik = Proxy(orig_ik, indexer_topk_paged=topk_hook)
    try:
        yield
    finally:
        attention.index_distill_loss, fwd.csa_attention, attention.ik = orig_loss, orig_csa, orig_ik


def _forward(params, cfg, tokens, lengths, force, rec, precision, page_size, **options):
    """The model's output over ``tokens`` [B, S] (rows ``lengths`` long) inside ``_hooks(rec, force)``; ``options``:
    more ``RunOptions`` fields."""
    from dsflash.model.forward import forward
    from dsflash.model.state import CacheGeometry, RunOptions, init_state, make_batch
    B, S = tokens.shape
    pages = -(-S // page_size)
    with _hooks(rec, force, page_size):
        st = init_state(cfg, CacheGeometry(B, B * pages, page_size, cfg.dspark_block_size + 1), precision)
        out, _ = forward(params, cfg, make_batch(tokens, lengths=lengths, pages_per_seq=pages), st,
                         RunOptions(precision=precision, page_size=page_size, **options))
    return out


def capture(params, cfg, tokens, lengths, precision="fp32", page_size=16, force=None):
    """{index-source layer: {"target" [B,S,T], "score" [B,S,T], "topk" [B,S,K], "visible" [B,S], and at candidate
    consumers "cand" [B,S,T]}} (numpy) of one forward over ``tokens`` [B, S] (rows ``lengths`` long); ``force``: as
    ``_hooks``'s."""
    import jax

    def run(params, tokens, lengths, force):
        rec = {}
        _forward(params, cfg, tokens, lengths, force, rec, precision, page_size, logits="none", index_distill=True)
        return rec

    out = jax.jit(run)(params, tokens, lengths, force)
    return {int(l): {k: np.asarray(v) for k, v in d.items()} for l, d in out.items()}


def next_token(params, cfg, tokens, lengths, force=None, precision="fp32", page_size=16):
    """(NLL [B, S-1] of each next token, argmax [B, S]) of one forward, the picks forced (``_hooks``) if ``force``."""
    import jax
    import jax.numpy as jnp

    def run(params, tokens, lengths, force):
        out = _forward(params, cfg, tokens, lengths, force, {}, precision, page_size, logits="all")
        lp = jax.nn.log_softmax(out["logits"].astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        return nll, jnp.argmax(lp, axis=-1)

    nll, am = jax.jit(run)(params, tokens, lengths, force)
    return np.asarray(nll), np.asarray(am)


def entity_force(cases, ratios, F=None):
    """{ratio: [B, F] int32} the distinct entries covering each case's entity tokens (-1 pad)."""
    out = {}
    for r in sorted(set(ratios)):
        ents = [entity_entries(c["entity_pos"], r) for c in cases]
        f = F or max(len(e) for e in ents)
        a = np.full((len(cases), f), -1, np.int32)
        for b, e in enumerate(ents):
            a[b, :len(e)] = e
        out[r] = a
    return out


# ------------------------------------------------------------------ measurement
def layer_rows(rec, cfg, case, b, layer):
    """One case's numbers at one layer (``rec``: ``capture``'s, row ``b``)."""
    r, K, W = cfg.ratio(layer), cfg.index_topk, cfg.sliding_window
    d = {k: v[b] for k, v in rec[layer].items()}
    ents = entity_entries(case["entity_pos"], r)
    n = len(case["ids"])
    out = {}
    for what, rows in (("arg", [p - 1 for p in case["arg_pos"]]), ("answer", list(range(case["answer_start"] - 1,
                                                                                         n - 1)))):
        rows = np.asarray(rows)
        t, pk, vis = d["target"][rows], d["topk"][rows], d["visible"][rows]
        picked = np.isin(pk, ents) & (pk >= 0)
        o = {"rows": len(rows), "visible_min": int(vis.min()), "all_picked_rows": int(all_picked(vis, K).sum()),
             "share": float(np.nanmean(picks_share(t, pk))), "oracle": float(np.nanmean(oracle_share(t, K))),
             "random": float(np.mean(np.minimum(K, vis) / vis)),        # K entries drawn blind
             "entity_picked_rows": int(picked.any(-1).sum())}
        if what == "arg":
            ev = [e for e in ents if e < t.shape[-1]]
            sc = d["score"][rows[:1]]                                     # over every visible entry
            sel = np.where(d["cand"][rows[:1]], sc, -np.inf) if "cand" in d else sc   # what the layer chose from
            o.update(effective_entries=float(np.nanmean(effective_entries(t))),
                     entity_mass=float(t[:, ev].sum(-1).mean()),
                     entity_uniform=float(np.mean(np.sum(np.asarray(ev)[None] < vis[:, None], -1) / vis)),
                     entity_rank_first=int(entity_rank(sel, ents)[0]),
                     entity_rank_first_all=int(entity_rank(sc, ents)[0]),
                     entity_tied_first=int(entity_tied(sc, ents)[0]),
                     entity_candidate_first=bool(np.isfinite(sel[0, ev]).any()),
                     entity_picked_first=bool(picked[0].any()),
                     distance_first=int(rows[0] - max(case["entity_pos"])), window=W)     # row - last entity token
        out[what] = o
    return out


def measure(checkpoint, trials=20, split="train", precision="fp32", batch=5, force_entity=False):
    import jax.numpy as jnp
    from dsflash.api import load
    from dsflash.model.params import float_params
    t0 = time.time()
    m = load(checkpoint, progress=False)
    cfg = m.cfg
    params = float_params(cfg, m.params) if precision == "fp32" else m.params
    cases = [encode_case(m.tokenizer, c) for c in pick_conversations(trials, split)]
    layers = list(cfg.index_source_layer_ids)
    # first: could the picks matter at all? (every visible entry picked when index_topk >= visible)
    check = {}
    for l in layers:
        vis = [p // cfg.ratio(l) for c in cases for p in c["arg_pos"]]      # row p-1 sees (p-1+1)//ratio
        check[l] = {"ratio": cfg.ratio(l), "visible_min": min(vis), "visible_max": max(vis),
                    "index_topk": cfg.index_topk, "all_picked": bool(all(all_picked(vis, cfg.index_topk)))}
        print(f"layer {l}: ratio {cfg.ratio(l)}, {min(vis)}-{max(vis)} visible entries at the argument rows, "
              f"index_topk {cfg.index_topk}" + (": every entry picked, the share is trivially 1" if
                                                check[l]["all_picked"] else ""), flush=True)
    per_case = []
    for i in range(0, len(cases), batch):
        group = cases[i:i + batch]
        S = max(len(c["ids"]) for c in group)
        S = -(-S // 16) * 16
        tok = np.zeros((len(group), S), np.int32)
        for b, c in enumerate(group):
            tok[b, :len(c["ids"])] = c["ids"]
        rec = capture(params, cfg, jnp.asarray(tok), jnp.asarray([len(c["ids"]) for c in group], jnp.int32),
                      precision)
        runs = {}
        if force_entity:        # does the model name the entity when the picks do hold its entries?
            lens = jnp.asarray([len(c["ids"]) for c in group], jnp.int32)
            force = {r: jnp.asarray(v) for r, v in entity_force(group, [cfg.ratio(l) for l in layers]).items()}
            runs = {"plain": next_token(params, cfg, jnp.asarray(tok), lens, None, precision),
                    "entity_forced": next_token(params, cfg, jnp.asarray(tok), lens, force, precision)}
        for b, c in enumerate(group):
            copy = {}
            for k, (nll, am) in runs.items():
                for what in ("arg", "reasoning"):       # reasoning: a copy inside the window (control)
                    pos = np.asarray(c[f"{what}_pos"])
                    if len(pos):
                        copy.setdefault(k, {})[what] = {
                            "nll": float(nll[b, pos - 1].mean()), "first_nll": float(nll[b, pos[0] - 1]),
                            "first_token_right": bool(am[b, pos[0] - 1] == c["ids"][pos[0]]),
                            "all_tokens_right": bool(np.all(am[b, pos - 1] == c["ids"][pos]))}
            per_case.append({"copy": copy, "name": c["name"], "thinking": c["thinking"], "tokens": len(c["ids"]),
                             "entity_pos": c["entity_pos"], "arg_pos": c["arg_pos"],
                             "nearest_mention_distance": c["arg_pos"][0] - 1 - max(c["nearest_mention_pos"]),
                             "reasoning_distance": (c["reasoning_pos"][0] - 1 - max(c["entity_pos"])
                                                    if c["reasoning_pos"] else None),
                             "layers": {str(l): layer_rows(rec, cfg, c, b, l) for l in layers}})
    summary = {}
    for l in layers:
        rows = [pc["layers"][str(l)] for pc in per_case]
        a = [r["arg"] for r in rows]
        summary[str(l)] = {
            "ratio": cfg.ratio(l), "index_topk": cfg.index_topk,
            "arg_share": float(np.mean([r["share"] for r in a])),
            "arg_oracle": float(np.mean([r["oracle"] for r in a])),
            "arg_random": float(np.mean([r["random"] for r in a])),
            "arg_effective_entries": float(np.mean([r["effective_entries"] for r in a])),
            "arg_visible_min": min(r["visible_min"] for r in a),
            "answer_share": float(np.mean([r["answer"]["share"] for r in rows])),
            "answer_oracle": float(np.mean([r["answer"]["oracle"] for r in rows])),
            "entity_picked_first": sum(r["entity_picked_first"] for r in a),
            "entity_picked_arg_rows": f"{sum(r['entity_picked_rows'] for r in a)}/{sum(r['rows'] for r in a)}",
            "entity_mass": float(np.mean([r["entity_mass"] for r in a])),
            "entity_uniform": float(np.mean([r["entity_uniform"] for r in a])),
            "entity_rank_first_median": float(np.median([r["entity_rank_first"] for r in a])),
            "entity_rank_first_all_median": float(np.median([r["entity_rank_first_all"] for r in a])),
            "entity_tied_first_median": float(np.median([r["entity_tied_first"] for r in a])),
            "entity_candidate_first": sum(r["entity_candidate_first"] for r in a),
            "cases": len(rows)}
    copy = {}
    for k in (per_case[0]["copy"] if per_case else {}):
        for what in ("arg", "reasoning"):
            got = [pc["copy"][k][what] for pc in per_case if what in pc["copy"][k]]
            copy.setdefault(k, {})[what] = {
                "cases": len(got), "nll_mean": float(np.mean([g["nll"] for g in got])),
                "first_nll_mean": float(np.mean([g["first_nll"] for g in got])),
                "first_token_right": sum(g["first_token_right"] for g in got),
                "all_tokens_right": sum(g["all_tokens_right"] for g in got)}
    return {"checkpoint": checkpoint, "trials": trials, "split": split, "precision": precision, "copy": copy,
            "window": cfg.sliding_window, "coverage_check": {str(k): v for k, v in check.items()},
            "distance_first_arg_to_entity": [pc["layers"][str(layers[0])]["arg"]["distance_first"] for pc in per_case],
            "summary": summary, "cases": per_case, "seconds": round(time.time() - t0, 1)}


def table(res):
    lines = [f"{res['checkpoint']}: {len(res['cases'])} tool conversations ({res['split']}), {res['precision']}; "
             f"first argument token {min(res['distance_first_arg_to_entity'])}-"
             f"{max(res['distance_first_arg_to_entity'])} tokens after the entity in the user turn (window "
             f"{res['window']}); nearest earlier mention (thinking turns' reasoning): "
             f"{sorted(c['nearest_mention_distance'] for c in res['cases'])}"]
    for l, c in res["coverage_check"].items():
        lines.append(f"  layer {l}: ratio {c['ratio']}, visible entries at the argument rows {c['visible_min']}-"
                     f"{c['visible_max']}, index_topk {c['index_topk']}"
                     + ("  -> EVERY visible entry is picked: share is trivially 1" if c["all_picked"] else ""))
    lines.append(f"{'layer':>5} {'arg share':>9} {'random':>7} {'oracle':>7} {'ans share':>9} {'oracle':>7} "
                 f"{'eff n':>6} {'ent picked 1st':>14} {'ent picked rows':>15} {'ent mass':>8} {'flat':>6} {'ent rank':>8} "
                 f"{'rank all':>8} {'tied':>5} {'cand':>6}")
    for l, s in res["summary"].items():
        lines.append(f"{l:>5} {s['arg_share']:9.3f} {s['arg_random']:7.3f} {s['arg_oracle']:7.3f} {s['answer_share']:9.3f} "
                     f"{s['answer_oracle']:7.3f} {s['arg_effective_entries']:6.0f} {str(s['entity_picked_first']) + '/' + str(s['cases']):>14} "
                     f"{s['entity_picked_arg_rows']:>15} {s['entity_mass']:8.4f} {s['entity_uniform']:6.4f} "
                     f"{s['entity_rank_first_median']:8.0f} {s['entity_rank_first_all_median']:8.0f} "
                     f"{s['entity_tied_first_median']:5.0f} {str(s['entity_candidate_first']) + '/' + str(s['cases']):>6}")
    lines.append("share: target mass on the picks (arg: rows predicting the argument's name; ans: all answer rows); "
                 "random: k entries drawn blind (k / visible); oracle: the best k entries' mass; eff n: exp(entropy) of the target at the arg rows; ent picked: "
                 "an entity entry among the picks (at the first arg row / over arg rows); ent mass vs flat: the "
                 "target's mass on the entity entries vs a flat target's; ent rank: the best entity entry's place "
                 "in the layer's selection order (score descending, ties to the lower id) among the entries it "
                 "chooses from, picked iff < index_topk, -1 if none is among them (median, first arg row); rank all: "
                 "the same over every visible entry; tied: entries sharing that score (median); cand: the entity in "
                 "a consumer's candidate set (else visible)")
    dist = sorted(c["reasoning_distance"] for c in res["cases"] if c["reasoning_distance"] is not None)
    for k, cc in res.get("copy", {}).items():
        for what, c in cc.items():
            lines.append(f"teacher-forced, picks {k}, the name in the {'argument' if what == 'arg' else 'reasoning'}"
                         + (f" ({dist[0]}-{dist[-1]} tokens after the entity)" if what != "arg" and dist else "")
                         + f": mean NLL {c['nll_mean']:.3f} (first token {c['first_nll_mean']:.3f}); first token the "
                         f"argmax {c['first_token_right']}/{c['cases']}, every token {c['all_tokens_right']}/"
                         f"{c['cases']}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--trials-split", choices=("train", "heldout"), default="train")
    ap.add_argument("--precision", choices=("fp32", "reference"), default="fp32")
    ap.add_argument("--batch", type=int, default=5, help="conversations per forward")
    ap.add_argument("--force-entity", action="store_true", help="also score the reference argument teacher-forced "
                    "with the indexer's picks as they are and with the entity's entries forced into every "
                    "index-source layer's picks")
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    res = measure(a.checkpoint, a.trials, a.trials_split, a.precision, a.batch, a.force_entity)
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
