"""The whole pipeline: data + tokenizer -> target -> DSpark -> export -> reload -> held-out perplexity.

    python -m dsflash.train --steps 300 --draft-steps 150 --out runs/demo
    python -m dsflash.train --target-from dsflash/assets/demo --sft-steps 3000 --draft-steps 0 --out runs/chat

The second form fine-tunes a trained checkpoint's target on chat conversations (``chat_data``, the SFT stage)
and exports it with that checkpoint's draft (or a retrained one with ``--draft-steps``).

Writes into ``--out``: ``tokenizer/`` (trained tokenizer.json), ``orbax/target`` and ``orbax/draft``
(float master weights), ``checkpoint/`` (official layout, loadable with ``dsflash.load``), ``loss.png``,
``log.jsonl`` (every step) and ``metrics.json`` (corpus info, config hash, perplexities, draft agreement).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsflash import compile_options
from dsflash.train import data, loop
from dsflash.train.config import CONFIGS


def _bar(total, desc, disable):
    try:
        from tqdm.auto import tqdm
        return tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True)
    except Exception:  # pragma: no cover
        return None


def save_orbax(path: str, tree: dict) -> None:
    import orbax.checkpoint as ocp
    ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    ck.save(os.path.abspath(path), args=ocp.args.PyTreeSave({k: np.asarray(v) for k, v in tree.items()}),
            force=True)


def restore_orbax(path: str) -> dict:
    import orbax.checkpoint as ocp
    ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    return {k: jnp.asarray(v) for k, v in ck.restore(os.path.abspath(path)).items()}


def plot_losses(path: str, log: list[dict]) -> None:
    """loss.png; without matplotlib (``pip install 'dsflash[bench]'``) skipped with a warning, so a finished
    training run never fails at its last step for want of a plotting library."""
    from dsflash.plots import pyplot as _pyplot
    plt = _pyplot()
    if plt is None:
        return

    first = "sft" if any(r["stage"] == "sft" for r in log) else "target"     # target_from: no target stage
    # a panel per stage that ran (the first one always: an empty target panel says the stage did not run)
    stages = [first] + (["draft"] if any(r["stage"] == "draft" for r in log) else [])
    fig, axes = plt.subplots(1, len(stages), figsize=(5.5 * len(stages), 4), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        rows = [r for r in log if r["stage"] == stage]
        key = "ce" if stage == "draft" else "loss"     # the draft's held-out number is its data CE
        tr = [(r["step"], r[key]) for r in rows if key in r]
        held_key = "heldout_chat_loss" if stage == "sft" else "heldout_loss"
        ev = [(r["step"], r[held_key]) for r in rows if held_key in r]
        if stage == "sft":
            ax.plot(*zip(*[(r["step"], r["heldout_loss"]) for r in rows if "heldout_loss" in r]), "s--",
                    label="held-out documentation CE")
        if stage == "draft" and rows:
            ax.plot([r["step"] for r in rows if "loss" in r], [r["loss"] for r in rows if "loss" in r], lw=0.6,
                    alpha=0.5, label="train total (CE + 0.5 distill + 0.1 conf)")
        if tr:
            ax.plot(*zip(*tr), lw=0.8, label="train loss (mixed)" if stage == "sft" else "train CE")
        if ev:
            ax.plot(*zip(*ev), "o-", label="held-out chat CE" if stage == "sft" else "held-out CE")
        ax.set_title(f"{stage}: " + {"draft": "CE of the Markov-chained drafts (teacher forced)",
                                     "sft": "(1-F) chat CE + F doc CE; held-out: chat"}.get(stage, "next-token CE"))
        ax.set_xlabel("step")
        if rows:                        # target_from: no target stage, an empty panel
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _over_budget(t_start: float, limit_s: float) -> bool:
    """A stage's time budget (0 = none) is spent."""
    return bool(limit_s) and time.time() - t_start > limit_s


def _served_target(folder: str, vocab_size: int, seq_len: int, docs) -> dict:
    """A trained checkpoint as served (``model``: the loaded checkpoint) and its training record (``meta``)."""
    from dsflash.api import load
    path = os.path.join(folder, "training.json")
    if not os.path.exists(path):
        raise ValueError(f"target_from: {folder} has no training.json (not a dsflash.train checkpoint)")
    meta = json.load(open(path))
    if docs is None and meta.get("config") not in CONFIGS:
        raise ValueError(f"target_from: unknown config {meta.get('config')!r} in {path}")
    m = load(folder, progress=False)
    if m.cfg.vocab_size != vocab_size or meta["seq_len"] != seq_len:
        raise ValueError(f"target_from: {folder} has vocab_size {m.cfg.vocab_size} / seq_len {meta['seq_len']}, "
                         f"asked for {vocab_size} / {seq_len}")
    return {"model": m, "meta": meta}


def _with_doc_starts(corpus, rows: np.ndarray, split: str, fraction: float, start: int,
                     seed: int) -> tuple[np.ndarray, int, np.ndarray]:
    """``rows`` (mid-stream rows of ``split``) with ``round(fraction * len(rows))`` of them replaced by document
    starts (:meth:`data.Corpus.document_rows`, seeded choice): a document's first tokens, from documents with at
    least ``start`` tokens -- the greedy chain replaces everything from ``start`` on, so only the prefix must be
    the document's. Fewer such documents than asked: all of them are used (printed) and mid-stream rows fill
    the rest, so the pool keeps its size. -> (the rows in a seeded shuffled order, how many are document starts,
    which ones)."""
    n_doc = round(fraction * len(rows))
    if n_doc == 0:
        return rows, 0, np.zeros(len(rows), bool)
    docs = corpus.document_rows(split, rows.shape[1], min_tokens=start)
    if n_doc > len(docs):
        print(f"greedy chains ({split}): {len(docs)} document-start rows of the {n_doc} asked for (only {len(docs)} "
              f"{split} documents have >= {start} tokens); mid-stream rows fill the rest", flush=True)
        n_doc = len(docs)
    rng = np.random.default_rng(seed)
    mixed = np.concatenate([rows[: len(rows) - n_doc], docs[rng.permutation(len(docs))[:n_doc]]])
    is_doc = np.arange(len(mixed)) >= len(rows) - n_doc
    order = rng.permutation(len(mixed))
    return mixed[order], n_doc, is_doc[order]


def _with_chat_prompts(tokenizer, rows: np.ndarray, is_doc: np.ndarray, convs: list[dict], fraction: float,
                       start: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``rows`` (a :func:`_with_doc_starts` pool, ``is_doc`` its document starts) with ``round(fraction *
    len(rows))`` of its mid-stream rows replaced by chat prompts: the first assistant turn's prompt of a seeded
    choice of ``convs`` (``chat_data.first_turn_prompts``: as the server renders and tokenises it), padded; the
    greedy chain then starts at the prompt's end, so the draft sees the target's answers. Only prompts of at most
    ``start`` tokens fit (those with tools, ~600 demo tokens, do not); fewer than asked: all of them (printed).
    -> (rows in a seeded shuffled order, each row's chain start, how many are chat prompts)."""
    n_chat = round(fraction * len(rows))
    starts = np.full(len(rows), start, np.int32)
    if n_chat == 0:
        return rows, starts, 0
    from dsflash.train import chat_data
    prompts = [p for p in chat_data.first_turn_prompts(tokenizer, convs) if len(p) <= start]
    n_mid = int((~is_doc).sum())
    if n_chat > min(len(prompts), n_mid):
        print(f"greedy chains: {min(len(prompts), n_mid)} chat-prompt rows of the {n_chat} asked for ({len(prompts)} "
              f"prompts of <= {start} tokens, {n_mid} mid-stream rows to replace)", flush=True)
        n_chat = min(len(prompts), n_mid)
    rng = np.random.default_rng(seed)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    chat = np.full((n_chat, rows.shape[1]), pad, np.int32)
    chat_starts = np.empty(n_chat, np.int32)
    for i, j in enumerate(rng.permutation(len(prompts))[:n_chat]):
        chat[i, :len(prompts[j])], chat_starts[i] = prompts[j], len(prompts[j])
    keep = np.flatnonzero(~is_doc)[n_chat:]
    out_rows = np.concatenate([rows[is_doc], rows[keep], chat]).astype(rows.dtype)
    out_starts = np.concatenate([starts[is_doc], starts[keep], chat_starts])
    order = rng.permutation(len(out_rows))
    return out_rows[order], out_starts[order], n_chat


def _uniform_or_rows(x: np.ndarray):
    """One int when every row has the same value (the pools without chat prompts: as before), else the array."""
    return int(x[0]) if len(x) and (x == x[0]).all() else x


def _rows_of(bound, idx):
    """The anchors' lower bound of the batch of rows ``idx``: the pool's one bound, or those rows' own."""
    return bound if np.ndim(bound) == 0 else bound[np.asarray(idx)]


def _target_cache(src, cfg, rows: np.ndarray, batch_size: int, precision: str, offset: int, tick) -> dict:
    """:func:`loop.target_outputs` of every row of a fixed pool (batches of ``batch_size``, the tail in one more
    call), written into buffers of the whole pool's size on the device: the frozen target runs once per row instead
    of once per draft step. The buffers are donated to each write, so memory peaks at the cache plus one batch (a
    concatenation of the parts would hold the cache twice)."""
    write = compile_options.jit(lambda buf, part, i: {k: jax.lax.dynamic_update_slice_in_dim(buf[k], part[k], i, 0)
                                                      for k in buf},
                                donate_argnums=0)
    buf = None
    for i in range(0, len(rows), batch_size):
        out = loop.target_outputs(src, cfg, jnp.asarray(rows[i:i + batch_size]), precision, offset)
        part = {k: out[k] for k in ("taps", "logits")}
        if buf is None:
            buf = {k: jnp.zeros((len(rows), *v.shape[1:]), v.dtype) for k, v in part.items()}
        buf = write(buf, part, i)
        del out, part
        if tick is not None:
            tick(1)
    return dict(buf, offset=jnp.int32(offset))


def _pad_rows(rows: np.ndarray, mask: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows up to a whole number of batches, the added rows unmasked (an evaluation then sees every row)."""
    n = -len(rows) % batch_size
    if n == 0:
        return rows, mask
    return (np.concatenate([rows, np.zeros((n, rows.shape[1]), rows.dtype)]),
            np.concatenate([mask, np.zeros((n, mask.shape[1]), bool)]))


def _sft_weights(mask: np.ndarray, n_chat: int, lm_fraction: float) -> np.ndarray:
    """``[B, S-1]`` weights of the next-token NLLs of a mixed batch (its first ``n_chat`` rows chat, the rest
    documentation): loss = (1 - lm_fraction) x the mean CE of the chat rows' assistant tokens + lm_fraction x the
    mean CE of the documentation rows' tokens, so the fraction means the same whatever the token counts."""
    m = mask[:, 1:].astype(np.float32)
    w = np.zeros_like(m)
    chat, lm = m[:n_chat], m[n_chat:]
    if chat.sum():
        w[:n_chat] = (1.0 - lm_fraction if len(lm) else 1.0) * chat / chat.sum()
    if len(lm) and lm.sum():
        w[n_chat:] = lm_fraction * lm / lm.sum()
    return w


def sft_rows(tokenizer, chat: dict, seq_len: int, seed: int, batch_size: int, n_chat: int,
             sources: bool = False) -> tuple:
    """The SFT stage's chat rows: the training conversations packed into rows of ``seq_len`` tokens with their
    loss masks, and the held-out ones padded to ``batch_size`` rows (tiny runs, where no held-out conversation
    fits a row, hold out the last ``n_chat`` training rows instead). -> (rows, mask, held-out rows, held-out
    mask, counts for the record), and with ``sources`` the training rows' ``chat_data.row_sources`` (teacher
    picks) last."""
    from dsflash.train import chat_data
    convs = chat_data.conversations(seed=seed, **chat)
    train_c, held_c = chat_data.split(convs)
    rows, mask, drop_tr, *rows_src = chat_data.chat_rows(tokenizer, train_c, seq_len, seed, sources=sources)
    hrows, hmask, drop_he = chat_data.chat_rows(tokenizer, held_c, seq_len, seed)
    info = dict(chat_data.info(convs), dropped_too_long=drop_tr + drop_he, train_rows=len(rows),
                heldout_rows=len(hrows), chat_train_tokens=int(mask.sum()), chat_heldout_tokens=int(hmask.sum()))
    if not len(hrows):
        hrows, hmask = rows[-n_chat:], mask[-n_chat:]
        info["heldout_from_train_rows"] = len(hrows)
    hrows, hmask = _pad_rows(hrows, hmask, batch_size)
    if sources:
        info["teacher_source_conversations"] = sum(len(r) for r in rows_src[0])
        return rows, mask, hrows, hmask, info, rows_src[0]
    return rows, mask, hrows, hmask, info


def _teacher_force(cfg, rows_src: list, n_lm: int, seq_len: int) -> dict:
    """The teacher picks of a batch (``rows_src``: its chat rows' ``chat_data.row_sources``, then ``n_lm``
    documentation rows, which force nothing): ``{str(ratio): [B, S, F]}`` for each index-source ratio, F = half
    the top-k (a position keeps at least that many of its own picks)."""
    from dsflash.train import chat_data
    src = list(rows_src) + [[]] * n_lm
    return {str(r): jnp.asarray(chat_data.teacher_entries(src, seq_len, r, max(1, cfg.index_topk // 2)))
            for r in sorted({cfg.ratio(l) for l in cfg.index_source_layer_ids})}


def _sft_record(source_meta: dict, sft_meta: dict) -> dict:
    """training.json's SFT entries for a stage run on ``source_meta``'s checkpoint: ``sft`` is this stage, and a
    source that was itself fine-tuned keeps its stages, oldest first, under ``sft_earlier``."""
    earlier = list(source_meta.get("sft_earlier", [])) + ([source_meta["sft"]] if "sft" in source_meta else [])
    return {"sft": sft_meta, **({"sft_earlier": earlier} if earlier else {})}


def _sft(tgt: dict, const: dict, cfg, corpus, held: np.ndarray, record, *, steps: int, lr: float, seq_len: int,
         batch_size: int, lm_fraction: float, chat: dict, precision: str, seed: int, eval_every: int,
         doc_batch_size: int, keep_best: bool, max_seconds: float, quiet: bool, qat: bool = True,
         index_weight: float = 0.0, teacher: bool = False) -> tuple[dict, dict, tuple]:
    """Supervised fine-tuning of the target's float weights on chat conversations (``chat_data``) mixed with
    documentation rows. Every ``eval_every`` steps: the held-out chat loss (assistant tokens of the held-out
    conversations), the held-out documentation loss (the perplexity rows) and the chat loss on the first training
    rows. ``qat``: the forward sees the weights as exported (``loop.quantised_view``) and every evaluation runs
    them so. ``teacher``: teacher picks (``teacher_picks``): in the training steps only, the entries covering the
    name a tool-call or copy conversation must copy are forced into the indexer's picks after it. -> (the weights
    of the step with the lowest held-out chat loss (``keep_best``) or the last one, the stage's record, the
    held-out chat rows and mask)."""
    from dsflash.train import export
    n_lm = round(lm_fraction * batch_size)
    n_chat = batch_size - n_lm
    rows, mask, hrows, hmask, info, *rows_src = sft_rows(corpus.tokenizer, chat, seq_len, seed, batch_size, n_chat,
                                                          sources=teacher)
    lm_rows = data.pack(corpus.train_stream, seq_len)
    if n_chat < 1 or len(rows) < n_chat or (n_lm and len(lm_rows) < n_lm):
        raise ValueError(f"sft: {len(rows)} chat rows and {len(lm_rows)} documentation rows of {seq_len} tokens "
                         f"cannot fill batches of {n_chat} chat + {n_lm} documentation rows")
    trows, tmask = _pad_rows(rows[:batch_size], mask[:batch_size], batch_size)
    if not quiet:
        print(f"sft: {info}", flush=True)
    opt = loop.make_optimizer(lr, steps)
    opt_state = opt.init(tgt)
    cit = iter(data.batches(np.arange(len(rows)), n_chat, seed + 6))
    lit = iter(data.batches(np.arange(len(lm_rows)), n_lm, seed + 7)) if n_lm else None

    def evaluate(p, r):
        p = {**(export.stored_roundtrip(cfg, p) if qat else p), **const}
        r["heldout_chat_loss"] = loop.masked_loss(p, cfg, hrows, hmask, batch_size, precision)
        r["train_chat_loss"] = loop.masked_loss(p, cfg, trows, tmask, batch_size, precision)
        r["heldout_loss"] = math.log(loop.perplexity(p, cfg, held, doc_batch_size, precision))
        return r

    t0 = time.time()
    evals = {0: evaluate(tgt, {"stage": "sft", "step": 0})}
    evals[0]["t"] = round(time.time() - t0, 1)
    record(evals[0])
    best = (math.inf, 0, None)              # (held-out chat loss, step, host copy of the weights)
    bar = _bar(steps, "sft", quiet)
    t_stage, done = time.time(), 0
    for step in range(1, steps + 1):
        ci = np.asarray(next(cit))
        tok, msk = rows[ci], mask[ci]
        if n_lm:
            li = np.asarray(next(lit))
            tok = np.concatenate([tok, lm_rows[li]])
            msk = np.concatenate([msk, np.ones((n_lm, seq_len), bool)])
        w = _sft_weights(msk, n_chat, lm_fraction)
        force = _teacher_force(cfg, [rows_src[0][i] for i in ci], n_lm, seq_len) if teacher else None
        tgt, opt_state, loss, kl = loop.sft_step(tgt, opt_state, const, cfg, jnp.asarray(tok), jnp.asarray(w),
                                                 precision, opt, qat, index_weight, force)
        r = {"stage": "sft", "step": step, "loss": float(loss), "t": round(time.time() - t0, 1)}
        if index_weight:
            r["index_kl"] = float(kl)
        if step == 1:
            t_stage = time.time()       # the budget counts training, not the first step's compile
        out_of_time = _over_budget(t_stage, max_seconds)
        if step % eval_every == 0 or step == steps or out_of_time:
            evals[step] = evaluate(tgt, r)
            if keep_best and r["heldout_chat_loss"] < best[0]:
                best = (r["heldout_chat_loss"], step, {k: np.asarray(v) for k, v in tgt.items()})
        record(r)
        done = step
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", **({"chat": f"{r['heldout_chat_loss']:.3f}"}
                                                         if "heldout_chat_loss" in r else {}), refresh=False)
        if out_of_time:
            print(f"sft: time budget {max_seconds:.0f} s reached after {step} of {steps} steps", flush=True)
            break
    if bar is not None:
        bar.close()
    kept = done
    if best[2] is not None and best[1] != done:
        print(f"sft: keeping step {best[1]} (held-out chat loss {best[0]:.4f}, the lowest; the last step's is "
              "higher: overfitting)", flush=True)
        tgt, kept = {k: jnp.asarray(v) for k, v in best[2].items()}, best[1]
    meta = {"steps": steps, "steps_run": done, "step_kept": kept, "lr": lr, "seq_len": seq_len,
            "index_distill": index_weight, "teacher_picks": teacher,
            "batch_size": batch_size, "lm_fraction": lm_fraction, "chat_rows_per_batch": n_chat, "qat": qat,
            "conversations": info, "chat_options": dict(chat),
            "corpus": corpus.info,          # this machine's documents: the conversations' source and the LM rows'
            "heldout_doc_rows": len(held)}     # heldout_loss: documentation CE over these first perplexity rows
    for k in ("heldout_chat_loss", "heldout_loss", "train_chat_loss"):     # before / kept (as exported with qat)
        meta[f"init_{k}"], meta[k] = evals[0][k], evals[kept][k]
    return tgt, meta, (hrows, hmask)


def train(out: str, *, config: str = "demo", vocab_size: int = 4096, steps: int = 200, draft_steps: int = 100,
          batch_size: int = 8, seq_len: int = 128, lr: float = 3e-3, draft_lr: float = 3e-3,
          precision: str = "fp32", seed: int = 0, anchors: int = 4, distill: float = 0.5, eval_every: int = 50,
          eval_batches: int = 8, quiet: bool = False, docs: list[str] | None = None,
          draft_data: str = "greedy", greedy_rows: int = 2048, greedy_start: int | None = None,
          max_target_seconds: float = 0.0, max_draft_seconds: float = 0.0, keep_best: bool = True,
          target_from: str | None = None, draft_init: str = "fresh", draft_overrides: dict | None = None,
          greedy_batch: int | None = None, doc_start_fraction: float = 0.0, target_cache: bool = True,
          allow_other_corpus: bool = False, sft_steps: int = 0, sft_lr: float = 3e-4, sft_seq_len: int = 1024,
          sft_batch_size: int | None = None, sft_lm_fraction: float = 0.25, max_sft_seconds: float = 0.0,
          sft_qat: bool = True, chat: dict | None = None, chat_prompt_fraction: float = 0.0,
          index_distill: float = 0.0, sft_teacher_picks: bool = False) -> dict:
    """The whole pipeline (module docstring). ``target_from``: a trained checkpoint folder whose target is kept
    as stored (FP8/MXFP4, bit-identical in the export) and only the DSpark stage trains -- on the taps and
    greedy chains of that served target at reference precision, i.e. exactly what the engine feeds the draft.
    ``draft_init`` ("fresh" or "checkpoint": warm start from its draft), ``draft_overrides``: DSpark config
    fields (e.g. ``dspark_n_routed_experts``) replaced before the draft is built. ``doc_start_fraction``: that
    fraction of the greedy pools (training and held-out) starts at a document's first token instead of mid-stream
    (:func:`_with_doc_starts`; capped at the documents with >= ``greedy_start`` tokens), the chain from the same
    ``greedy_start``: prompts cut from a document's start (spec_eval, ``bench engine --text-prompts``) are what
    the mid-stream rows never show the draft. ``chat_prompt_fraction`` (target_from only): that fraction of the
    pools are chat prompts (:func:`_with_chat_prompts`: the first turn of the training / held-out conversations,
    ``chat`` options), the chain from each prompt's end: the served target's answers. ``target_cache``: run the frozen target once over the draft's row
    pools and keep its taps and logits (:func:`_target_cache`; fp32, rows x seq_len x (taps + vocab) x 4 bytes at
    most) instead of once per draft step -- same losses (tests/test_train_target_cache.py), less time.
    ``allow_other_corpus`` (target_from only): this machine's corpus differs from the checkpoint's (another
    Python's documents): the draft trains on it, the checkpoint's heldout_rows.npy stays the perplexity rows and
    the export records both corpora.

    ``sft_steps`` (target_from only): first fine-tune the target on chat conversations (:func:`_sft`, rows of
    ``sft_seq_len`` tokens, ``sft_batch_size`` rows a step of which ``sft_lm_fraction`` are documentation rows,
    ``chat``: :func:`chat_data.conversations` options; ``sft_qat``: quantisation-aware, see :func:`_sft`); the
    fine-tuned target is exported, loaded back and then
    served to the draft stage (if ``draft_steps``) and re-measured like any target. ``index_distill``: weight of
    the indexer's distillation loss (``model/index_distill.py``) added in the target and SFT stages (0: none; the
    indexer then keeps its initial weights, as top-k passes no gradient). ``sft_teacher_picks``: the SFT steps force
    the entries of the name each tool-call / copy conversation must copy into the indexer's picks
    (:func:`_sft`'s ``teacher``)."""
    if index_distill < 0:
        raise ValueError(f"index_distill must be >= 0, got {index_distill!r}")
    t0 = time.time()
    if sft_steps and target_from is None:
        raise ValueError("sft_steps needs target_from (the SFT stage fine-tunes a trained checkpoint's target)")
    if not 0.0 <= sft_lm_fraction < 1.0:
        raise ValueError(f"sft_lm_fraction must be in [0, 1), got {sft_lm_fraction!r}")
    if not 0.0 <= doc_start_fraction <= 1.0:
        raise ValueError(f"doc_start_fraction must be in [0, 1], got {doc_start_fraction!r}")
    if doc_start_fraction and draft_data != "greedy":
        raise ValueError(f"doc_start_fraction needs draft_data='greedy' (document starts are chain prefixes), "
                         f"got draft_data={draft_data!r}")
    if not 0.0 <= chat_prompt_fraction <= 1.0 - doc_start_fraction:
        raise ValueError(f"chat_prompt_fraction must be in [0, 1 - doc_start_fraction], got {chat_prompt_fraction!r}")
    if chat_prompt_fraction and (draft_data != "greedy" or target_from is None):
        raise ValueError("chat_prompt_fraction needs draft_data='greedy' and target_from (chat chains are decoded by "
                         "the serving engine from each prompt's own end)")
    if draft_init not in ("fresh", "checkpoint"):
        raise ValueError(f"draft_init must be 'fresh' or 'checkpoint', got {draft_init!r}")
    bad = [k for k in (draft_overrides or {}) if not k.startswith("dspark_")]
    if bad:
        raise ValueError(f"draft_overrides may only change dspark_* fields, got {bad}")
    if draft_overrides and not draft_steps:
        raise ValueError("draft_overrides need draft_steps (a draft of other shapes must be trained)")
    if draft_init == "checkpoint" and (target_from is None or draft_overrides):
        raise ValueError("draft_init='checkpoint' needs target_from and no draft_overrides (same draft shapes)")
    os.makedirs(out, exist_ok=True)
    log: list[dict] = []
    logf = open(os.path.join(out, "log.jsonl"), "w")

    def record(r):
        log.append(r)
        logf.write(json.dumps(r) + "\n")
        logf.flush()

    # ---- data + tokenizer
    source = None
    if target_from is not None:
        source = _served_target(target_from, vocab_size, seq_len, docs)
        config = source["meta"]["config"]
    corpus = data.Corpus(os.path.join(out, "tokenizer"), vocab_size, vocab_size - 1, seq_len, docs=docs,
                         tokenizer_from=target_from)
    other_corpus = source is not None and corpus.info["sha256"] != source["meta"]["corpus"]["sha256"]
    if other_corpus:
        msg = (f"target_from: this machine's corpus (sha256 {corpus.info['sha256'][:12]}, Python "
               f"{corpus.info.get('python')}) is not the one {target_from} was trained on "
               f"({source['meta']['corpus']['sha256'][:12]}, Python {source['meta']['corpus'].get('python')})")
        if not allow_other_corpus:
            raise ValueError(msg + "; its held-out rows would not match (allow_other_corpus / --allow-other-corpus "
                             "trains the draft on this corpus and keeps the checkpoint's held-out rows)")
        print(msg + ": the draft trains on this machine's documents; perplexities use the checkpoint's own "
              "heldout_rows.npy", flush=True)
    from dsflash.engram_map import build_compressed_token_map
    tmap, n_comp = build_compressed_token_map(corpus.tokenizer)
    cfg = CONFIGS[config](vocab_size, n_comp) if source is None else source["model"].cfg
    if draft_overrides:
        cfg = cfg.replace(**draft_overrides)
    held = corpus.held_rows[: eval_batches * batch_size]
    if len(held) < batch_size:
        held = corpus.train_rows[-batch_size:]          # tiny corpora (tests): no real held-out split
    ppl_rows = held             # the rows every recorded perplexity uses (saved beside the checkpoint)
    if other_corpus:
        src_rows = os.path.join(target_from, "heldout_rows.npy")
        if not os.path.exists(src_rows):
            raise ValueError(f"allow_other_corpus: {target_from} has no heldout_rows.npy to keep")
        ppl_rows = np.load(src_rows).astype(np.int32)
    if not quiet:
        print(f"corpus {corpus.info}\nconfig {config} {cfg.hash()}: engram compressed vocab {n_comp}", flush=True)

    # ---- target
    from dsflash.model.params import float_params, init_params
    params = float_params(cfg, init_params(cfg, seed))
    params["engram.token_map"] = jnp.asarray(tmap, jnp.int32)
    tgt, drf, const = loop.split_params(params)
    served, served_precision = None, None
    if source is not None:
        # the served target: stored tensors for the taps, their dequantised floats for the shared embed/head
        m = source["model"]
        served = {k: v for k, v in m.params.items() if not k.startswith("mtp.")}
        source_draft = {k: v for k, v in m.params.items() if k.startswith("mtp.")}     # stored tensors
        served_precision = "reference"
        tgt, loaded_drf, const = loop.split_params(float_params(m.cfg, m.params))
        if draft_init == "checkpoint":
            drf = loaded_drf
        steps = 0
    opt = loop.make_optimizer(lr, max(steps, 1))
    opt_state = opt.init(tgt)
    it = iter(data.batches(corpus.train_rows, batch_size, seed))

    def heldout(p):
        return math.log(loop.perplexity(p, cfg, held, batch_size, precision))

    init_loss = None                    # target_from: no target stage (its perplexity is float_heldout_ppl)
    if source is None:
        init_loss = heldout({**tgt, **const})
        record({"stage": "target", "step": 0, "heldout_loss": init_loss})
    best_loss, best_step, best_w = init_loss, 0, None      # best_w: host copy of the best weights
    bar = _bar(steps, "target", quiet) if steps else None
    t_stage = time.time()
    done_steps = 0
    for step in range(1, steps + 1):
        tok = jnp.asarray(next(it))
        tgt, opt_state, loss, kl = loop.target_step(tgt, opt_state, const, cfg, tok, precision, opt, index_distill)
        r = {"stage": "target", "step": step, "loss": float(loss), "t": round(time.time() - t0, 1)}
        if index_distill:
            r["index_kl"] = float(kl)
        out_of_time = _over_budget(t_stage, max_target_seconds)
        if step % eval_every == 0 or step == steps or out_of_time:
            r["heldout_loss"] = heldout({**tgt, **const})
            if keep_best and r["heldout_loss"] < best_loss:
                best_loss, best_step, best_w = r["heldout_loss"], step, {k: np.asarray(v) for k, v in tgt.items()}
        record(r)
        done_steps = step
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", **({"held": f"{r['heldout_loss']:.3f}"}
                                                         if "heldout_loss" in r else {}), refresh=False)
        if out_of_time:
            print(f"target: time budget {max_target_seconds:.0f} s reached after {step} of {steps} steps "
                  "(learning rate not annealed to its end value)", flush=True)
            break
    if bar is not None:
        bar.close()
    if best_w is None:
        best_step = done_steps          # nothing kept: the last step is exported
    elif best_step != done_steps:
        print(f"target: keeping step {best_step} (held-out loss {best_loss:.4f}, the lowest; the last step's is "
              f"higher: overfitting)", flush=True)
        tgt = {k: jnp.asarray(v) for k, v in best_w.items()}
    if source is None:
        save_orbax(os.path.join(out, "orbax", "target"), tgt)
    else:
        best_step = source["meta"].get("target_step_kept", 0)

    # ---- supervised fine-tuning on chat conversations (target_from only)
    sft_meta, chat_held = None, None
    if sft_steps:
        if not draft_steps:
            drf = loaded_drf                # no draft stage: the checkpoint's draft ships with the new target
        tgt, sft_meta, chat_held = _sft(
            tgt, const, cfg, corpus, ppl_rows[: eval_batches * batch_size], record, steps=sft_steps, lr=sft_lr,
            seq_len=sft_seq_len,
            batch_size=sft_batch_size or batch_size, lm_fraction=sft_lm_fraction, chat=dict(chat or {}),
            precision=precision, seed=seed, eval_every=eval_every, doc_batch_size=batch_size, keep_best=keep_best,
            max_seconds=max_sft_seconds, quiet=quiet, qat=sft_qat, index_weight=index_distill,
            teacher=sft_teacher_picks)
        save_orbax(os.path.join(out, "orbax", "target"), tgt)
        if draft_steps:
            # the draft trains on the fine-tuned target as served: exported (FP8/MXFP4) and loaded back; its stored
            # tensors give the draft its taps and chains and are written unchanged into the final export
            from dsflash.api import load
            from dsflash.train.export import export_checkpoint
            sft_ck = os.path.join(out, "sft_checkpoint")
            export_checkpoint(sft_ck, cfg, {**tgt, **drf, **const}, corpus.folder, dict(source["meta"]))
            m_sft = load(sft_ck, progress=False)
            source = dict(source, model=m_sft)
            served = {k: v for k, v in m_sft.params.items() if not k.startswith("mtp.")}
            tgt, _, const = loop.split_params(float_params(m_sft.cfg, m_sft.params))
        else:
            served = {}                     # the final export quantises the fine-tuned target itself

    # ---- DSpark on the frozen target
    frozen = {**tgt, **const}
    dopt = loop.make_optimizer(draft_lr, draft_steps)
    dstate = dopt.init(drf)
    rng = np.random.default_rng(seed + 1)
    lo = 0
    n_doc_rows = n_doc_held = n_chat_rows = n_chat_held = 0
    draft_rows, draft_held = corpus.train_rows, held
    row_lo, held_lo = 0, 0              # anchors' lower bound: one for the pool, or one per row (chat prompts)
    if draft_data == "greedy" and draft_steps:
        # the target's own greedy continuations of data prefixes: what acceptance is measured against
        lo = (seq_len // 2 if greedy_start is None else greedy_start) - 1
        pick = np.random.default_rng(seed + 2).permutation(len(corpus.train_rows))[:greedy_rows]
        rows, gb = corpus.train_rows[pick], greedy_batch or batch_size
        rows, n_doc_rows, is_doc = _with_doc_starts(corpus, rows, "train", doc_start_fraction, lo + 1, seed + 4)
        held_src, n_doc_held, held_is_doc = _with_doc_starts(corpus, held, "held", doc_start_fraction, lo + 1,
                                                             seed + 5)
        convs = ([], [])
        if chat_prompt_fraction:
            from dsflash.train import chat_data
            convs = chat_data.split(chat_data.conversations(seed=seed, **(chat or {})))
        rows, row_start, n_chat_rows = _with_chat_prompts(corpus.tokenizer, rows, is_doc, convs[0],
                                                          chat_prompt_fraction, lo + 1, seed + 6)
        held_src, held_start, n_chat_held = _with_chat_prompts(corpus.tokenizer, held_src, held_is_doc, convs[1],
                                                               chat_prompt_fraction, lo + 1, seed + 7)
        row_lo, held_lo = _uniform_or_rows(row_start - 1), _uniform_or_rows(held_start - 1)
        if source is None:      # the float target, the whole row recomputed per token (one tick per batch)
            def pool(r, s, b, tick):
                return loop.greedy_pool(frozen, cfg, r, lo + 1, b, precision, tick)
            ticks = len(rows) // gb + len(held) // batch_size
        else:                   # the served target's chains, decoded by the engine itself (a tick per 1,024 rows)
            # one engine for both pools: each engine compiles its own prefill / decode programs
            llm = loop.served_engine(source["model"], gb, max(rows.shape[1], held_src.shape[1]))

            def pool(r, s, b, tick):
                return loop.greedy_pool_served(source["model"], r, _uniform_or_rows(s), gb, progress=tick, llm=llm)
            ticks = -(-len(rows) // 1024) + -(-len(held) // 1024)
        bar = _bar(ticks, "greedy chains", quiet)
        tick = (lambda _: bar.update(1)) if bar is not None else None
        draft_rows, draft_held = pool(rows, row_start, gb, tick), pool(held_src, held_start, batch_size, tick)
        if bar is not None:
            bar.close()
    elif draft_data not in ("greedy", "data"):        # (greedy with no draft steps: no pool to build)
        raise ValueError(f"draft_data must be 'greedy' or 'data', got {draft_data!r}")
    # index batches (grain shuffles indices either way: the same batches as shuffling the rows themselves)
    dit = iter(data.batches(np.arange(len(draft_rows)), batch_size, seed + 3)) if draft_steps else None
    cache = held_cache = None
    if target_cache and draft_steps and draft_data == "greedy":     # a fixed pool, not the whole corpus
        off = max(int(np.min(row_lo)), int(np.min(held_lo)), cfg.sliding_window)     # sample_anchors' lowest
        src, src_precision = (frozen, precision) if served is None else (served, served_precision)
        bar = _bar(-(-len(draft_rows) // batch_size) + -(-len(draft_held) // batch_size), "target taps", quiet)
        tick = (lambda _: bar.update(1)) if bar is not None else None
        cache = _target_cache(src, cfg, draft_rows, batch_size, src_precision, off, tick)
        held_cache = _target_cache(src, cfg, draft_held, batch_size, src_precision, off, tick)
        if bar is not None:
            bar.close()
        if not quiet:
            gb_ = sum(c[k].nbytes for c in (cache, held_cache) for k in ("taps", "logits")) / 1e9
            print(f"target taps + logits cached for {len(draft_rows)} + {len(draft_held)} rows: {gb_:.2f} GB",
                  flush=True)

    def cached_rows(c, idx):
        return None if c is None else dict(c, taps=c["taps"][idx], logits=c["logits"][idx])

    bar = _bar(draft_steps, "dspark", quiet)

    def draft_eval(d):
        hits, ces = [], []
        r2 = np.random.default_rng(1234)
        for i in range(0, len(draft_held) - batch_size + 1, batch_size):
            tok = jnp.asarray(draft_held[i:i + batch_size])
            lo_b = _rows_of(held_lo, np.arange(i, i + batch_size))
            a = jnp.asarray(loop.sample_anchors(r2, cfg, batch_size, seq_len, anchors, lo_b))
            _, aux = loop.draft_loss_jit(d, frozen, cfg, tok, a, precision, distill, served, served_precision,
                                         cached_rows(held_cache, slice(i, i + batch_size)))
            hits.append(np.asarray(aux["hit_per_pos"]))
            ces.append(float(aux["ce"]))
        return float(np.mean(ces)), np.mean(hits, axis=0)

    t_stage = time.time()
    done_draft = 0
    for step in range(1, draft_steps + 1):
        idx = np.asarray(next(dit))
        tok = jnp.asarray(draft_rows[idx])
        a = jnp.asarray(loop.sample_anchors(rng, cfg, batch_size, seq_len, anchors, _rows_of(row_lo, idx)))
        drf, dstate, loss, aux = loop.draft_step(drf, dstate, frozen, cfg, tok, a, precision, dopt, distill,
                                                 served, served_precision, cached_rows(cache, jnp.asarray(idx)))
        r = {"stage": "draft", "step": step, "loss": float(loss), "ce": float(aux["ce"]), "hit": float(aux["hit"]),
             "t": round(time.time() - t0, 1)}
        if step == 1:
            t_stage = time.time()       # the budget counts training, not the first step's compile
        out_of_time = _over_budget(t_stage, max_draft_seconds)
        if step % eval_every == 0 or step == draft_steps or out_of_time:
            ce, hits = draft_eval(drf)
            r["heldout_loss"], r["heldout_hit_per_pos"] = ce, [float(h) for h in hits]
        record(r)
        done_draft = step
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss):.3f}", hit=f"{float(aux['hit']):.2f}", refresh=False)
        if out_of_time:
            print(f"dspark: time budget {max_draft_seconds:.0f} s reached after {step} of {draft_steps} steps",
                  flush=True)
            break
    if bar is not None:
        bar.close()
    if draft_steps:
        save_orbax(os.path.join(out, "orbax", "draft"), drf)
    plot_losses(os.path.join(out, "loss.png"), log)

    # ---- export + reload through the official loader
    final = {**tgt, **drf, **const}
    float_ppl = loop.perplexity(final, cfg, ppl_rows, batch_size, precision)
    ck = os.path.join(out, "checkpoint")
    from dsflash.train.export import export_checkpoint
    meta = {"corpus": corpus.info, "config": config, "steps": steps, "steps_run": done_steps,
            "target_step_kept": best_step, "index_distill": index_distill,
            "draft_steps": draft_steps, "draft_steps_run": done_draft,
            "draft_data": draft_data,
            "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "draft_lr": draft_lr, "precision": precision,
            "seed": seed}
    # the greedy pools' make-up: always in target_from mode (a source's own values must not carry over), else only
    # when document starts were asked for (a default full run records what it always did)
    doc_meta = {"greedy_doc_starts": doc_start_fraction, "greedy_doc_start_rows": n_doc_rows,
                "greedy_doc_start_held_rows": n_doc_held, "greedy_chat_prompts": chat_prompt_fraction,
                "greedy_chat_prompt_rows": n_chat_rows, "greedy_chat_prompt_held_rows": n_chat_held,
                "greedy_start": lo + 1 if draft_data == "greedy" and draft_steps else None}
    if doc_start_fraction or chat_prompt_fraction:
        meta.update(doc_meta)
    keep = None
    if source is not None:
        target_name = source["meta"].get("target_from", os.path.basename(os.path.abspath(target_from)))
        if draft_steps:
            # the target's training record is the source's; this run adds the DSpark stage on its served weights
            meta = dict(source["meta"], **{k: meta[k] for k in ("draft_steps", "draft_steps_run", "draft_data",
                                                                 "draft_lr", "seed")},
                        draft_taps="served target (stored FP8/MXFP4 weights, reference precision)",
                        target_from=target_name, draft_init=draft_init, draft_overrides=dict(draft_overrides or {}),
                        greedy_rows=greedy_rows, **doc_meta, anchors=anchors, distill=distill,
                        draft_corpus=corpus.info)
            keep = served
        else:                               # no draft stage: the source's draft ships as stored, with its record
            meta = dict(source["meta"], target_from=target_name)
            keep = dict(served, **source_draft)
        if sft_meta is not None:
            meta.update(_sft_record(source["meta"], sft_meta))
            if draft_steps:
                meta["draft_taps"] = "served fine-tuned target (stored FP8/MXFP4 weights, reference precision)"
    export_checkpoint(ck, cfg, final, corpus.folder, meta, keep=keep)
    np.save(os.path.join(ck, "heldout_rows.npy"), ppl_rows.astype(np.int16))   # what the recorded perplexity used
    from dsflash.api import load
    m = load(ck, progress=False)
    loaded_ppl = loop.perplexity(m.params, cfg, ppl_rows, batch_size, "reference")
    _, hits = draft_eval({k: v for k, v in m.params.items() if k.startswith("mtp.")}) if draft_steps else (0, [])
    if sft_meta is not None:                # the exported checkpoint as served, on the held-out conversations
        sft_meta["loaded_heldout_chat_loss"] = loop.masked_loss(m.params, cfg, *chat_held, sft_meta["batch_size"],
                                                                "reference")
    # the measured numbers go into training.json too: tests/test_demo_model.py checks the shipped model against them
    meta.update(loaded_heldout_ppl=loaded_ppl, float_heldout_ppl=float_ppl,
                heldout_tokens_evaluated=int(ppl_rows.size - len(ppl_rows)))
    with open(os.path.join(ck, "training.json"), "w") as f:
        json.dump(meta, f, indent=2)
    size = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck))
    metrics = dict(meta, config_hash=cfg.hash(), engram_compressed_vocab_size=n_comp,
                   **({} if init_loss is None else {"init_heldout_ppl": math.exp(init_loss)}),
                   uniform_ppl=vocab_size,
                   loaded_draft_teacher_forced_hit_per_pos=[float(h) for h in hits],
                   checkpoint_bytes=size, seconds=round(time.time() - t0, 1))
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    logf.close()
    if not quiet:
        print(json.dumps(metrics, indent=2), flush=True)
    return metrics


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsflash.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="demo", choices=sorted(CONFIGS))
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200, help="target steps")
    ap.add_argument("--draft-steps", type=int, default=None, help="DSpark steps (default steps // 2)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--anchors", type=int, default=4, help="DSpark blocks per sequence per step")
    ap.add_argument("--distill", type=float, default=0.5)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--draft-data", default="greedy", choices=("greedy", "data"),
                    help="DSpark rows: the target's greedy continuations of data prefixes (default) or the data")
    ap.add_argument("--greedy-rows", type=int, default=2048, help="rows of greedy continuations for DSpark")
    ap.add_argument("--greedy-start", type=int, default=None, help="prefix length kept (default seq_len // 2)")
    ap.add_argument("--allow-other-corpus", action="store_true",
                    help="--target-from on a machine whose corpus differs from the checkpoint's (other Python)")
    ap.add_argument("--no-target-cache", action="store_true",
                    help="run the frozen target inside every draft step instead of once per pool row (less memory)")
    ap.add_argument("--greedy-doc-starts", type=float, default=0.0, metavar="FRACTION",
                    help="this fraction of the greedy rows (training and held-out pools) starts at a document's first "
                         "token instead of mid-stream (capped at the documents with >= --greedy-start tokens); use "
                         "with --greedy-start 40: spec_eval's prompts are a document's first ~40 tokens")
    ap.add_argument("--max-target-seconds", type=float, default=0.0, help="stop the target stage after this")
    ap.add_argument("--greedy-chat", type=float, default=0.0, metavar="FRACTION",
                    help="with --target-from: this fraction of the greedy rows are chat prompts (the first turn of the "
                         "chat conversations, those of <= --greedy-start tokens), the chain from the prompt's end")
    ap.add_argument("--max-draft-seconds", type=float, default=0.0, help="stop the DSpark stage after this many seconds of training (its compile not counted)")
    ap.add_argument("--no-keep-best", action="store_true",
                    help="export the last target step, not the one with the lowest held-out loss")
    ap.add_argument("--target-from", default=None,
                    help="train only the DSpark stage on this trained checkpoint's served target (kept as stored)")
    ap.add_argument("--draft-init", default="fresh", choices=("fresh", "checkpoint"),
                    help="with --target-from: start the draft fresh or from that checkpoint's draft")
    ap.add_argument("--draft-experts", type=int, default=None, help="override dspark_n_routed_experts")
    ap.add_argument("--draft-topk", type=int, default=None, help="override dspark_num_experts_per_tok")
    ap.add_argument("--markov-rank", type=int, default=None, help="override dspark_markov_rank")
    ap.add_argument("--greedy-batch", type=int, default=None,
                    help="batch of the greedy-chain generation (with --target-from: the engine's max_num_seqs)")
    ap.add_argument("--index-distill", type=float, default=0.0,
                    help="weight of the indexer's distillation loss in the target and SFT stages: KL from the main "
                         "attention's distribution over the compressed entries to the indexer's (0: off; the indexer "
                         "gets no gradient through top-k otherwise)")
    g = ap.add_argument_group("supervised fine-tuning on chat conversations (with --target-from)")
    g.add_argument("--sft-steps", type=int, default=0,
                   help="fine-tune the --target-from target on conversations built from CPython's docs (chat_data)")
    g.add_argument("--sft-lr", type=float, default=3e-4)
    g.add_argument("--sft-seq-len", type=int, default=1024,
                   help="tokens per chat row (whole conversations packed; longer ones dropped: the tools prompt "
                        "alone is ~560 demo tokens)")
    g.add_argument("--sft-batch-size", type=int, default=None, help="rows per step (default --batch-size)")
    g.add_argument("--sft-lm-fraction", type=float, default=0.25,
                   help="share of each batch's rows that are documentation rows; the loss is (1-F) x chat CE + "
                        "F x documentation CE (keeps documentation perplexity from collapsing)")
    g.add_argument("--max-sft-seconds", type=float, default=0.0,
                   help="stop the SFT stage after this many seconds of training (its compile not counted)")
    g.add_argument("--no-sft-qat", action="store_true",
                   help="fine-tune the float weights without seeing their export's FP8 / MXFP4 / bf16 rounding (the "
                        "default forward uses the exported values, gradients passed straight through)")
    g.add_argument("--chat-per-entry", type=int, default=3, help="conversations per documented entry")
    g.add_argument("--chat-thinking", type=float, default=0.25, help="share of conversations in thinking mode")
    g.add_argument("--chat-tools", type=float, default=0.2, help="share of tool-call conversations")
    g.add_argument("--chat-multi", type=float, default=0.1, help="share of two-turn conversations")
    g.add_argument("--chat-answer-chars", type=int, default=400, help="answers: the doc's first paragraphs, this long")
    g.add_argument("--chat-limit", type=int, default=None, help="use only the first N entries (smoke runs)")
    g.add_argument("--chat-copy", type=float, default=0.0, metavar="SHARE",
                   help="add SHARE x (training entries) synthetic copy conversations (a name, ~40-100 tokens of "
                        "documentation, a request to repeat it; chat_data.copy_conversations): copying past the "
                        "32-token window")
    g.add_argument("--sft-teacher-picks", action="store_true",
                   help="in the SFT steps, force the entries of the name each tool-call / copy conversation must copy "
                        "into the indexer's top-k after it (dsflash/train/teacher_picks.py; evaluation unforced)")
    a = ap.parse_args(argv)
    chat = dict(per_entry=a.chat_per_entry, thinking_share=a.chat_thinking, tool_share=a.chat_tools,
                multi_share=a.chat_multi, max_answer_chars=a.chat_answer_chars, limit=a.chat_limit,
                copy_share=a.chat_copy)
    overrides = {k: v for k, v in (("dspark_n_routed_experts", a.draft_experts),
                                   ("dspark_num_experts_per_tok", a.draft_topk),
                                   ("dspark_markov_rank", a.markov_rank)) if v is not None}
    train(a.out, config=a.config, vocab_size=a.vocab_size, steps=a.steps,
          draft_steps=a.steps // 2 if a.draft_steps is None else a.draft_steps, batch_size=a.batch_size,
          seq_len=a.seq_len, lr=a.lr, draft_lr=a.draft_lr, precision=a.precision, seed=a.seed,
          anchors=a.anchors, distill=a.distill, eval_every=a.eval_every, quiet=a.quiet,
          draft_data=a.draft_data, greedy_rows=a.greedy_rows, greedy_start=a.greedy_start,
          max_target_seconds=a.max_target_seconds, max_draft_seconds=a.max_draft_seconds,
          keep_best=not a.no_keep_best, target_from=a.target_from, draft_init=a.draft_init,
          draft_overrides=overrides, greedy_batch=a.greedy_batch, doc_start_fraction=a.greedy_doc_starts,
          target_cache=not a.no_target_cache, allow_other_corpus=a.allow_other_corpus, sft_steps=a.sft_steps,
          sft_lr=a.sft_lr, sft_seq_len=a.sft_seq_len, sft_batch_size=a.sft_batch_size,
          sft_lm_fraction=a.sft_lm_fraction, max_sft_seconds=a.max_sft_seconds,
          sft_qat=not a.no_sft_qat, chat=chat, chat_prompt_fraction=a.greedy_chat, index_distill=a.index_distill,
          sft_teacher_picks=a.sft_teacher_picks)
