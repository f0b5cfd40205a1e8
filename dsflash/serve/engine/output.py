"""The OutputProcessor: what came back from the device becomes text and ``RequestOutput``s.

It appends each call's tokens to their sequences, detokenises incrementally, applies the stop conditions
(stop ids / EOS, stop strings, ``max_tokens``), records TTFT / ITL / acceptance, publishes newly committed
blocks to the prefix cache (through the scheduler) and builds the cumulative outputs of the requests that moved.
"""
from __future__ import annotations

from dsflash.serve.engine.sequence import DECODE, Sequence
from dsflash.serve.types import CompletionOutput, RequestMetrics, RequestOutput


class OutputProcessor:
    def __init__(self, scheduler, metrics, *, tokenizer, eos_token_id, block: int):
        self.scheduler, self.metrics = scheduler, metrics
        self.tokenizer, self.eos_token_id = tokenizer, eos_token_id
        self.k = block                                   # drafts per speculative step (0: plain decoding)
        self.pending: dict[str, RequestOutput] = {}     # outputs to hand out next step (aborts, P/D installs)

    def new_detok(self, params):
        tok = self.tokenizer
        if tok is None or not hasattr(tok, "token_bytes"):
            return None
        from dsflash.tokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(tok, params.stop, skip_special_tokens=params.skip_special_tokens,
                                      include_stop=params.include_stop_str_in_output)

    # ------------------------------------------------------------------ tokens and stops
    def append(self, s: Sequence, toks, lps, now) -> bool:
        """Append generated tokens, applying stop conditions; returns True if the sequence finished."""
        p = s.params
        if s.metrics.first_token_time is None and toks:
            s.metrics.first_token_time = now
            self.metrics.ttft.append(now - s.metrics.arrival_time)
        elif toks and s.last_token_time is not None:
            d = (now - s.last_token_time) / len(toks)
            self.metrics.itl.extend([d] * len(toks))
        if toks:
            s.last_token_time = now
        for i, t in enumerate(toks):
            s.out_ids.append(t)
            if s.logprobs is not None and lps is not None:
                s.logprobs.append(self._lp_entry(s, t, *[x[i] for x in lps]))
            self.metrics.generation_tokens += 1
            if t in s.stop_ids:
                eos = t == self.eos_token_id and t not in p.stop_token_ids
                return self._done(s, "stop", None if eos else t)
            if s.guide is not None:
                s.guide.accept(t)
            if s.detok is not None:
                s.detok.add(t)
                if s.detok.stopped:
                    return self._done(s, "stop", s.detok.stop_reason)
            if s.guide is not None and s.guide.done:      # the grammar is complete: nothing may follow
                return self._done(s, "stop", None)
            if len(s.out_ids) >= p.max_tokens:
                return self._done(s, "length", None)
        return False

    @staticmethod
    def _lp_entry(s, tok, lp, top_ids, top_lp):
        top = {int(t): float(v) for t, v in zip(top_ids[:s.params.logprobs], top_lp[:s.params.logprobs])}
        return {"token_id": int(tok), "logprob": float(lp), "top": top}

    def _text(self, s):
        if s.detok is not None:
            return s.detok.text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(s.out_ids, skip_special_tokens=s.params.skip_special_tokens)

    def _done(self, s, reason, stop_reason):
        if s.detok is not None and not s.detok.stopped:
            s.detok.finish()
        s.text = self._text(s)
        self.scheduler.finish(s, reason, stop_reason)
        return True

    # ------------------------------------------------------------------ one step's results
    def process(self, plan, pf, dc, now, progressed: set):
        if pf is not None:
            self._process_prefill(plan.prefill_items, pf, now, progressed, plan.prefill[2])
        if dc is not None:
            self._process_decode(plan.decode, dc, now, progressed, plan.K1)

    def _process_prefill(self, items, res, now, progressed, rows):
        for r, (s, n, last) in zip(rows, items):
            self.metrics.computed_prompt_tokens += n
            if s.finished:
                continue
            self.scheduler.register(s, s.computed)
            if last:
                s.pending -= 1
                s.pending_lb -= 1
                lps = (res["lp"][r:r + 1], res["top_ids"][r:r + 1], res["top_lp"][r:r + 1])
                self.append(s, [int(res["tok"][r])], lps, now)
                progressed.add(s.request_id)

    def _process_decode(self, decode, res, now, progressed, K1):
        m = self.metrics
        m.num_decode_iters += int(res["iters"])
        for s, h in decode:
            s.pending -= h * K1
            s.pending_lb -= h
            if s.finished:
                continue
            i = s.slot if s.slot is not None else s.last_slot
            n = int(res["n_out"][i])
            if self.k and K1 > 1:         # (a plain call of an adaptive engine drafts nothing)
                nd = int(res["drafts"][i])
                acc = res["acc_pos"][i]
                m.spec_num_drafts += nd
                m.spec_num_draft_tokens += nd * self.k
                m.spec_num_accepted_tokens += int(acc.sum())
                for j in range(self.k):
                    m.spec_accepted_per_pos[j] += int(acc[j])
                s.metrics.num_drafts += nd
                s.metrics.num_draft_tokens += nd * self.k
                s.metrics.num_accepted_tokens += int(acc.sum())
                if nd:
                    m.acceptance_length.append(n / nd)
            if s.guide is not None:         # the drafts its next call verifies (proposed after this call)
                nxt = res.get("next_drafts")
                s.guide.drafts = [int(t) for t in nxt[i]] if nxt is not None else None
            if n == 0:
                continue
            toks = [int(t) for t in res["tok"][i, :n]]
            lps = (res["lp"][i, :n], res["top_ids"][i, :n], res["top_lp"][i, :n])
            self.append(s, toks, lps, now)
            progressed.add(s.request_id)
            if s.status == DECODE:
                if s.pending == 0:
                    assert int(res["pos"][i]) == len(s.all_ids) - 2, (int(res["pos"][i]), len(s.all_ids))
                self.scheduler.register(s, len(s.all_ids) - 1)

    # ------------------------------------------------------------------ outputs
    def make_output(self, rid) -> RequestOutput:
        seqs = self.scheduler.groups[rid]
        outs = []
        for s in seqs:
            text = s.text = self._text(s)
            outs.append(CompletionOutput(index=s.index, text=text, token_ids=list(s.out_ids),
                                         finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                         logprobs=list(s.logprobs) if s.logprobs is not None else None))
        s0 = seqs[0]
        met = s0.metrics
        if len(seqs) > 1:
            met = RequestMetrics(**vars(s0.metrics))
            met.num_generation_tokens = sum(len(s.out_ids) for s in seqs)
            for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                setattr(met, f, sum(getattr(s.metrics, f) for s in seqs))
        else:
            met.num_generation_tokens = len(s0.out_ids)
        return RequestOutput(request_id=rid, prompt=s0.prompt, prompt_token_ids=list(s0.prompt_ids), outputs=outs,
                             finished=all(s.finished for s in seqs), metrics=met)

    def emit_now(self, rid):
        """Hand out ``rid``'s output with the next step's (an abort, a request finished at admission) and
        forget the request if it is done."""
        self.pending[rid] = self.make_output(rid)
        self.scheduler.retire(rid)

    def collect(self, progressed, pending: bool = True) -> list[RequestOutput]:
        """This step's outputs: every request that moved, then (``pending``) the pending ones; finished requests
        retire."""
        outs = [self.make_output(rid) for rid in progressed if rid in self.scheduler.groups]
        for o in outs:
            self.scheduler.retire(o.request_id)
        if pending:
            outs.extend(self.pending.values())
            self.pending.clear()
        return outs
