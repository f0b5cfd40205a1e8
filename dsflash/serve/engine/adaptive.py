"""Adaptive speculation: per decode call, draft ``block`` tokens or none, whichever is expected to emit more tokens
per second (docs/engine.md "Adaptive speculation").

Two things are measured while serving:

* the **cost** of one decode iteration of each compiled program (draft length ``block``: propose + verify
  ``block + 1`` rows; draft length 0: one row), as an exponential moving average of the decode call's wall time
  divided by its iterations (drafting's also as a ratio to the plain EMA current when it ran, which is what the
  decision uses: load on a shared machine moves both). The decode program has one shape (every slot, every call), so one cost per draft
  length covers every batch size. Each length is run ``probe_calls`` times first (the first ``cold_calls`` of
  them not averaged in: a cold run), and a length not chosen for ``remeasure_plain_every`` (plain) /
  ``remeasure_every`` (drafting) calls is run once again so a stale cost cannot lock the choice (drafting only
  while the acceptance estimates say it could pay at a plain iteration's cost, its floor). With the
  sequential verify (runner) a drafting iteration stops verifying at the batch's last first rejection, so its
  cost grows with the acceptance: at none it is about one plain iteration plus the proposal. Its samples are
  therefore taken back to no extra verify rows (a fitted cost per row, ``IterationCost``) and the decision
  charges the rows expected at the rows' estimates (``expected_extra_rows``). A call whose rows finished before
  its planned iterations (a request's last) is not averaged in: its per-iteration cost carries the call's fixed
  cost over fewer iterations.
* the **acceptance** of every sequence: its accepted drafts and verifications, shrunk toward an engine-wide prior,
  ``(accepted + prior_weight * engine_mean) / (verifications + prior_weight)``. ``engine_mean`` is accepted drafts
  per verification over every request (each verification's weight decaying by ``1 - 1 / engine_horizon`` per
  later one; it starts as ``initial_weight`` pseudo-verifications at ``prior``). A new request starts at the
  engine's mean: new requests of a workload whose drafts fail do not pay a probe each, and a few unlucky
  verifications of a request near break-even do not stop it. One whose estimate falls below ``stop_below`` after
  ``min_verifies`` verifications stops drafting (counts 0), and is re-probed (its own evidence dropped: back at the
  engine's mean) after ``reprobe_every`` decode calls without a verification (a call that drafts for other
  requests verifies its drafts too, for free). After ``reprobe_every`` calls without a draft the engine runs one
  drafting call (the engine-wide reprobe), so a workload that changed is noticed.

Exploration (the engine-wide reprobe, the drafting re-measure) backs off: after each probe whose result still
says plain, both come twice as rarely (up to ``max_backoff`` x), and at the base rate again once a probe pays, so
a workload whose drafts never verify stops paying for probes (a changed one is noticed within
``reprobe_every * max_backoff`` calls, twice that under constant prefill). A due probe also waits while prompts
wait for prefill (up to twice its interval): a drafting call's rows take ``block + 1`` tokens each of the step's
token budget.

* **Prefill first**: a call in a step that prefills prompts (a mixed step: the engine asks the scheduler's
  ``prefill_room``) runs plain, whatever the costs say. Where the token budget binds, each draft token would
  displace a prompt token for less than one expected emitted token (H100, demo, batch 32: always-drafting 0.87x
  plain, lost in those mixed steps). Where it does not, drafting still lengthens the step, and so every waiting
  prompt's time to its first token and the batch's end, for tokens of requests that are not the last to finish
  (H200, demo, 32 documentation prompts, session 24: 17 mixed steps 13.3 ms each drafting against 11.8 plain,
  +26 ms of a 357-ms pass that lost 0.91x to plain; decode-only 130.8 ms against 126.5).
  ``draft_in_mixed_steps=True`` keeps the older rule (plain only where the budget binds); the engine passes it from
  ``EngineConfig.speculative_in_mixed_steps``, on by default since session 28 (H100, demo, 128 chat prompts: 1.65x
  plain against this rule's 1.29x at 8 sequences, 1.18x against 1.14x at 32). The cost model then also charges
  the drafting call's extra time to the sequences the step holds up besides its rows (``held``: prompts it
  prefills, waiting ones its free slots take), as rows emitting one token an iteration either way: priced as free
  they had a 2-core CPU draft a pass's first mixed step for its one decoding row while 7 prompts prefilled (chat,
  batch 8: 0.90x plain, session 29). It is no exploration decision: the back-off stays, a due probe waits for a step without prefill, and the call's cost is a plain sample
  as any other.

**Tap-free plain calls** (``tap_free``): a plain call of a long plain stretch may run a decode program that records no
taps for the lazy draft context; the policy allows it only while no drafting call it schedules is due within the
``lead`` calls that rewrite a row's last W taps, and ``choose(draft_ready=False)`` defers any other decision to draft
until the engine says every row's ring is complete again (docs/engine.md "Tap-free plain calls").

**Background compile**: while the drafting program still compiles (``EngineConfig.background_compile``), the engine
passes ``choose(draft_compiled=False)``: a decision to draft (the start-up measurement first of all) is deferred
the same way, so every call runs the plain recording program and the first call after the compile drafts.

``choose_draft_length`` then compares ``(rows + expected accepted drafts) / cost`` per length. Only the draft
lengths compiled (at start-up, or in the background and finished) are candidates, so adapting never compiles. It
changes only how many tokens are drafted: verification decides which are emitted, so greedy output equals plain
decoding's.
"""
from __future__ import annotations

import functools
import logging
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

log = logging.getLogger("dsflash.serve.engine")

SPECULATIVE_MODES = ("adaptive", "always", "off")


def expected_tokens(draft_len: int, accepted: Sequence[float]) -> float:
    """Tokens one iteration emits over the rows: one each, plus the expected accepted drafts (at most
    ``draft_len``) when drafting."""
    if not draft_len:
        return float(len(accepted))
    return float(sum(1.0 + min(max(a, 0.0), draft_len) for a in accepted))


def choose_draft_length(costs: Mapping[int, float], accepted: Sequence[float], margin: float = 0.0) -> int:
    """The draft length in ``costs`` (seconds per iteration; 0 = no drafts) with the most expected tokens per
    second for rows expecting ``accepted`` drafts each per verification. Drafting must beat plain decoding by
    the fraction ``margin`` (ties and unknowns go to 0: plain decoding is never slower than itself). A drafting
    cost below the plain one counts as the plain one: a drafting iteration runs the plain iteration's forward and
    more, so such a sample is noise (one noisy plain sample on a loaded CPU had 8 calls in a row draft for drafts
    that never verify)."""
    if not accepted or 0 not in costs:
        return 0
    best, best_rate = 0, expected_tokens(0, accepted) / costs[0] * (1.0 + margin)
    for d, c in sorted(costs.items()):
        if d and c > 0:
            rate = expected_tokens(d, accepted) / max(c, costs[0])
            if rate > best_rate:
                best, best_rate = d, rate
    return best


def expected_extra_rows(draft_len: int, accepted: Sequence[float]) -> float:
    """Expected one-row verify forwards past the first of a sequential-verify iteration (runner: row ``j + 1`` runs
    while some row accepted drafts ``0 .. j``): ``E[max over rows of the accepted prefix]``. Each row's accepted
    prefix ``L`` is taken as geometric, ``P(L >= j) = r ** j`` with ``E[min(L, draft_len)] =`` its estimate (the demo
    draft's first positions: 0.27, 0.12, 0.07, 0.05, 0.02); one row: its estimate. Host work: each distinct estimate's
    ``r`` is solved once (``_geometric_ratio``, cached: a batch's new requests share the engine-wide mean, and a
    batch that gains or loses a row keeps the others' estimates), the rest is ``draft_len`` products over the rows
    (demo, CPU, 8 rows: ~0.5 ms a change of the batch as a numpy bisection over every row, 2 a pass of the bench)."""
    a = [min(float(x), float(draft_len)) for x in accepted if x > 0]
    if not draft_len or not a:
        return 0.0
    if len(a) == 1:
        return a[0]
    rs = [_geometric_ratio(draft_len, x) for x in a]
    total = 0.0
    for j in range(1, draft_len + 1):
        none = 1.0
        for r in rs:
            none *= 1.0 - r ** j
        total += 1.0 - none
    return total


@functools.lru_cache(maxsize=4096)
def _geometric_ratio(draft_len: int, a: float) -> float:
    """``r`` with ``sum_{j=1..draft_len} r ** j = a`` (0 < a <= draft_len), by 30 bisection steps (increasing in r;
    r = 1 gives draft_len)."""
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(1, draft_len + 1)) > a:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


class IterationCost:
    """EMA of seconds per decode iteration of one program. The first ``cold`` calls are counted but not averaged
    in: a program's first call with running rows is a cold run (the engine's warm-up runs no iteration; on CPU
    the first call of either tiny-model decode program took 3-5x the next ones, docs/engine.md), and one such
    sample would hold a rarely run program's cost up for a long time.

    Against a reference (plain) cost the samples are also kept as ratios, modelled as ``ratio + row_ratio * x``
    with ``x`` the call's extra verify rows per iteration (sequential verify: a drafting iteration's cost grows
    with the rows its acceptance lets run). ``row_ratio`` is a least-squares slope over the samples (weights decaying
    by ``1 - 1 / row_horizon``) shrunk toward ``row_prior`` with ``row_prior_weight`` (in rows squared);
    ``ratio`` is an EMA of the samples taken back to no extra rows, so one call that accepted much (demo, batch
    1: 9 drafts in 4 iterations, 3.2x plain) no longer reads as the cost of drafting at the mean acceptance."""

    def __init__(self, alpha: float, cold: int = 0, row_prior: float = 0.5, row_prior_weight: float = 1.0,
                 row_horizon: float = 64.0):
        self.alpha, self.cold, self.seconds, self.samples, self.since = alpha, cold, None, 0, 0
        self.ratio = None      # EMA of the sample over the reference cost, taken back to no extra verify rows
        self.rows = 0.0        # EMA of extra verify rows per iteration of the samples
        self.row_prior, self.row_prior_weight = row_prior, row_prior_weight
        self._decay = 1.0 - 1.0 / max(1.0, row_horizon)
        self._fit = np.zeros(5)          # weight, sum x, sum y, sum x^2, sum x*y of (extra rows, ratio) samples
        self._row_ratio = None           # row_ratio of the current fit (None: not computed since it changed)

    @property
    def row_ratio(self) -> float:
        """Reference iterations one extra verify row costs (>= 0); kept until the next sample (every decision reads
        it, only ``observe`` changes it)."""
        if self._row_ratio is None:
            self._row_ratio = self._fitted_row_ratio()
        return self._row_ratio

    def _fitted_row_ratio(self) -> float:
        w, sx, sy, sxx, sxy = self._fit
        vxx = sxx - sx * sx / w if w > 0 else 0.0
        vxy = sxy - sx * sy / w if w > 0 else 0.0
        return float(max(0.0, (vxy + self.row_prior_weight * self.row_prior) / (vxx + self.row_prior_weight)))

    def at(self, extra_rows: float) -> Optional[float]:
        """The modelled ratio to the reference cost at ``extra_rows`` per iteration."""
        return None if self.ratio is None else self.ratio + self.row_ratio * extra_rows

    def observe(self, seconds: float, iters: int, ref: Optional[float] = None, extra_rows: float = 0.0,
                full: Optional[int] = None):
        """``full``: the iterations the call was planned for; one that ran fewer (its rows finished early: a
        request's last call) is not averaged in once there is a sample: its per-iteration cost carries the call's
        fixed cost (demo, CPU, batch 1: a 1-iteration drafting call took 56-70 ms, a 4-iteration one ~100: XLA's
        work hoisted out of the loop) over fewer iterations."""
        if iters <= 0:
            return
        self.samples += 1
        self.since = 0
        if self.samples <= self.cold or (full and iters < full and self.seconds is not None):
            return
        s, x = seconds / iters, extra_rows / iters
        self.seconds = s if self.seconds is None else (1 - self.alpha) * self.seconds + self.alpha * s
        self.rows = (1 - self.alpha) * self.rows + self.alpha * x if self.samples > self.cold + 1 else x
        if ref:
            r = s / ref
            self._fit = self._decay * self._fit + np.array([1.0, x, r, x * x, x * r])
            self._row_ratio = None
            r -= self.row_ratio * x
            self.ratio = r if self.ratio is None else (1 - self.alpha) * self.ratio + self.alpha * r


class SpeculationPolicy:
    """Decides each decode call's draft length (``choose``) and learns from its results (``observe``)."""

    def __init__(self, block: int, mode: str = "adaptive", *, prior: float = 1.0, prior_weight: float = 48.0,
                 initial_weight: float = 8.0, engine_horizon: float = 256.0, ema: float = 0.3,
                 stop_below: float = 0.25, min_verifies: int = 4, reprobe_every: int = 64, probe_calls: int = 2,
                 remeasure_every: int = 50, remeasure_plain_every: int = 8, margin: float = 0.02,
                 cold_calls: int = 1, max_backoff: int = 16, sequential_verify: bool = False,
                 row_prior: float = 0.5, draft_in_mixed_steps: bool = False):
        if mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative_mode: must be one of {', '.join(SPECULATIVE_MODES)}, got {mode!r}")
        self.block = block if mode != "off" else 0
        self.mode = mode if self.block else "off"
        self.prior, self.ema, self.stop_below, self.min_verifies = prior, ema, stop_below, min_verifies
        self.prior_weight = float(prior_weight)
        self.reprobe_every, self.probe_calls, self.margin = reprobe_every, probe_calls, margin
        self.draft_in_mixed_steps = bool(draft_in_mixed_steps)     # "Prefill first" above
        # re-measure a program not run for this many calls: plain often (cheap, and a stale plain cost is what
        # could keep a losing draft length), the drafting one rarely (each re-measure costs a verify)
        self.remeasure = {0: remeasure_plain_every, block: remeasure_every}
        self.costs = {0: IterationCost(ema, cold_calls),
                      self.block: IterationCost(ema, cold_calls, row_prior=row_prior)} if self.block else {}
        # the runner's sequential verify: a drafting iteration's cost grows with the verify rows its acceptance lets
        # run (the engine sets this once its runner is built); the batched verify's does not
        self.sequential_verify = bool(sequential_verify)
        self._rows_memo = None             # (estimates, expected_extra_rows of them): _extra_rows
        self.draft_len = self.block if self.mode == "always" else 0   # the last decision
        self.calls = self.drafted_calls = 0
        self.requests_stopped = self.requests_reprobed = 0
        # the engine-wide prior: accepted drafts and verifications over every request, each verification's weight
        # decaying by 1 - 1 / engine_horizon per later one; it starts as initial_weight pseudo-verifications at
        # ``prior`` (weak: the first verifications outweigh it)
        self.engine_decay = 1.0 - 1.0 / max(1.0, float(engine_horizon))
        self.engine_acc, self.engine_n = initial_weight * prior, float(initial_weight)
        self.calls_since_draft = 0
        # exploration back-off: the engine-wide reprobe and the drafting re-measure come backoff x less often after
        # each probe that found nothing (doubling up to max_backoff), and at the base rate again once one pays
        self.backoff, self.max_backoff = 1, max(1, max_backoff)
        self._reprobing = self._probed = False
        self._wait = 1                     # 2 while prompts wait for prefill (choose)
        self._held = 0                     # sequences the call's step holds up besides its rows (choose)
        self.calls_plain_for_prefill = 0   # calls run plain because drafting would have shrunk the step's prefill
        # tap-free plain calls (``tap_free``) and drafting calls deferred until the draft context could be caught up
        # (``choose(draft_ready=False)``): the engine's counts
        self.tap_free_calls = self.deferred_drafting_calls = 0
        self.calls_before_drafting_compiled = 0   # decisions to draft run plain: the program compiles in the background
        self._deferred = False             # this call's drafting was deferred (it must record: no tap-free call)
        self._plain_for_prefill_last = False    # the last switch to 0 was that rule's (its switch back logs at debug)

    @property
    def engine_mean(self) -> float:
        """Accepted drafts per verification over every request (the prior a request's estimate is shrunk toward)."""
        return self.engine_acc / self.engine_n if self.engine_n > 0 else self.prior

    @property
    def lengths(self) -> tuple:
        """The draft lengths the engine compiles decode programs for."""
        return (0, self.block) if self.mode == "adaptive" else (self.block,)

    # ------------------------------------------------------------------ per sequence
    def estimate(self, s) -> float:
        """Expected accepted drafts per verification of sequence ``s`` (0 once it stopped drafting): its own
        accepted drafts and verifications plus ``prior_weight`` pseudo-verifications at the engine-wide mean
        (``(accepted + w * engine_mean) / (verifications + w)``). A new request starts at the engine-wide mean; a few
        unlucky verifications move it only part of the way (demo model: the first draft is accepted ~27 % of the
        time, so 8 verifications at 0.10 are no evidence against a mean of ~0.5)."""
        if not getattr(s, "spec_drafting", True):
            return 0.0
        n = getattr(s, "spec_n", 0.0)
        w = self.prior_weight
        return (getattr(s, "spec_acc", 0.0) + w * self.engine_mean) / (n + w) if n + w > 0 else self.engine_mean

    def _reprobe(self, seqs: Iterable):
        for s in seqs:
            if getattr(s, "spec_drafting", True):
                continue
            s.spec_idle_calls = getattr(s, "spec_idle_calls", 0) + 1
            if s.spec_idle_calls >= self.reprobe_every:    # its own evidence forgotten: back at the engine's mean
                s.spec_drafting, s.spec_acc, s.spec_n, s.spec_verifies = True, 0.0, 0.0, 0
                self.requests_reprobed += 1

    # ------------------------------------------------------------------ per decode call
    def choose(self, seqs: Sequence, prefilling: bool = False, displaces_prefill: int = 0,
               prefill_tokens: int = 0, held: int = 0, draft_ready: bool = True, draft_compiled: bool = True) -> int:
        """Draft length of the next decode call over ``seqs`` (its sequences). ``prefilling``: prompts wait for
        prefill this step; an exploration probe then waits (up to twice its interval), since a drafting call's
        decode rows take ``block + 1`` tokens each of the step's token budget and so slow the prefill down too
        (batch 32 of the tiny model: a probe left 16 of 128 tokens to prefill). ``displaces_prefill``: the prompt
        tokens drafting would take from this step's prefill (0: none, the budget has room for both);
        ``prefill_tokens``: the prompt tokens the step prefills with a plain call. Plain (``_plain_for_prefill``)
        if the step prefills anything, or, with ``draft_in_mixed_steps``, if drafting would displace some of it.
        ``held``: the sequences a step that prefills holds up besides ``seqs`` (prompts prefilling in it or waiting
        for a free slot it can fill); a drafting call's extra time is charged at their plain rate too (``_decide``).
        ``draft_ready``: whether a drafting call could catch every row's draft context up now (False after tap-free
        calls until each row has recorded its last W positions again: ``tap_free``); if not, a decision to draft is
        **deferred**: this call runs plain (and records) and the decision's exploration state is kept (a due probe
        stays due), so it drafts once the context is complete. ``draft_compiled``: whether the drafting program is
        compiled (False while it compiles in the background: ``EngineConfig.background_compile``); if not, a decision
        to draft is deferred the same way (counted apart, ``spec_calls_before_drafting_compiled``), so the start-up
        measurements of the drafting program run once it is."""
        self._deferred = False
        if self.mode != "adaptive":
            return self.block
        if not seqs:                 # nothing decoding yet: keep the last choice (no flapping in the log), but a
            # step that prefills runs plain: its decode rows are prompts whose prefill ends in it, the rest wait on it
            # (a pass's first step ran the last pass's last choice, drafting, with 7 prompts prefilling: session 29)
            return 0 if prefilling else self.draft_len
        self._reprobe(seqs)
        if displaces_prefill or (prefill_tokens and not self.draft_in_mixed_steps):
            return self._plain_for_prefill(int(displaces_prefill), int(prefill_tokens))
        self._wait = 2 if prefilling else 1
        kept = (self.calls_since_draft, self._reprobing)
        if self.calls_since_draft >= self.reprobe_every * self.backoff * self._wait:   # nothing drafted: probe
            self.calls_since_draft = 0     # one drafting call (its verifications update the estimates), not an
            self._reprobing = True         # optimistic prior for every new request
        accepted = [self.estimate(s) for s in seqs]
        self._held = max(0, int(held)) if prefill_tokens else 0
        d = self._decide(accepted)
        if d and not (draft_ready and draft_compiled):   # the draft context cannot be caught up yet (tap-free
            self.calls_since_draft, self._reprobing = kept  # calls) or the program is not compiled yet: plain, and
            self._probed = False                            # the probe (if this was one) stays due
            self._deferred = True
            if draft_compiled:
                self.deferred_drafting_calls += 1
            else:
                self.calls_before_drafting_compiled += 1
            return 0
        if d != self.draft_len:
            c = {k: (None if v is None else round(1e3 * v, 2)) for k, v in self.current_costs(accepted).items()}
            log.log(logging.DEBUG if self._plain_for_prefill_last else logging.INFO,
                    "speculation: draft length %d -> %d (ms per iteration by draft length %s, %d rows, "
                    "expected accepted drafts per verification %.2f)", self.draft_len, d, c, len(seqs),
                    sum(accepted) / max(1, len(seqs)))
            self.draft_len = d
            self._plain_for_prefill_last = False
        return d

    def tap_free(self, seqs: Sequence, lead: int) -> bool:
        """Whether this plain call may run the tap-free plain program (no taps recorded for the lazy draft context):
        the policy has been plain for ``lead`` calls and no drafting call it schedules is due within the next
        ``lead`` calls (``lead = ceil(W / decode_steps)``: the calls that record a row's last W positions again,
        all a catch-up reads). Scheduled: the start-up measurements, the engine-wide reprobe, the drafting
        re-measure (while it could pay) and a stopped request's re-probe (its estimate goes back to the engine's
        mean). A decision that turns to drafting otherwise (costs, a new request's estimate) is deferred until the
        context is complete (``choose(draft_ready=False)``). Call after ``choose`` returned 0."""
        if self.mode != "adaptive" or not seqs or self._deferred or self._reprobing or lead < 1:
            return False
        c0, ck = self.costs[0], self.costs[self.block]
        if c0.seconds is None or ck.seconds is None or min(c0.samples, ck.samples) < self.probe_calls:
            return False
        if self.calls_since_draft < lead or self.calls_since_draft + lead >= self.reprobe_every * self.backoff:
            return False
        if ck.since + lead >= self.remeasure[self.block] * self.backoff and \
                self._could_pay([self.estimate(s) for s in seqs]):
            return False
        for s in seqs:
            if not getattr(s, "spec_drafting", True) and \
                    getattr(s, "spec_idle_calls", 0) + lead >= self.reprobe_every:
                return False
        return True

    def _plain_for_prefill(self, displaced: int, prefill: int = 0) -> int:
        """Draft length 0 for a call in a step that prefills ``prefill`` prompt tokens, of which drafting would take
        ``displaced``: a draft row takes ``block`` tokens more of the budget and is expected to emit fewer than
        ``block`` more (accepted drafts <= ``block``; ~1.15 per verification on the demo model at 5), so where the
        budget binds drafting trades prompt tokens (and waiting requests' time to first token) for fewer output
        tokens (H100, demo, batch 32: mixed steps 18.7 ms drafting vs 13.5 plain, their prefill budget 16 vs 96
        tokens); where it does not, it lengthens the step the prompts wait on (the module docstring). Outside
        ``_decide`` on purpose: the back-off and a pending probe are left as they are (a probe waits for a step
        without prefill), and the call is observed as any plain one."""
        self.calls_plain_for_prefill += 1
        if self.draft_len:      # debug, as the switch back: under load this can alternate step by step (the metric
            # spec_calls_plain_for_prefill counts it)
            log.debug("speculation: draft length %d -> 0 (a step that prefills %d prompt tokens%s)", self.draft_len,
                      prefill, f"; drafting would take {displaced}" if displaced else "")
            self.draft_len = 0
            self._plain_for_prefill_last = True
        return 0

    def _decide(self, accepted: list) -> int:
        for d in (self.block, 0):               # measure each program first (a cold call does not count)
            c = self.costs[d]
            if c.seconds is None or c.samples < self.probe_calls:
                return d
        # in a step that prefills, the sequences it holds up (``held``) wait out a drafting call's extra time too:
        # they count as rows that emit one token an iteration either way (``choose_draft_length`` then drafts only
        # where the accepted drafts beat (rows + held) x the extra cost in plain iterations), not as free
        best = choose_draft_length(self.current_costs(accepted), list(accepted) + [0.0] * self._held, self.margin)
        if self._probed:        # the call before was an exploration probe: back off while probes find nothing
            self.backoff = 1 if best else min(2 * self.backoff, self.max_backoff)
            self._probed = False
        reprobing, self._reprobing = self._reprobing, False
        if reprobing and not best:    # the engine-wide reprobe: one drafting call, then back off if it found nothing
            self._probed = True
            return self.block
        # re-measure the one not chosen for a while (drafting: only if it could pay, and backed off)
        if not best and self.costs[self.block].since >= self.remeasure[self.block] * self.backoff * self._wait \
                and self._could_pay(accepted):
            self._probed = True
            return self.block
        if self.costs[0].since >= self.remeasure[0]:
            return 0
        return best

    def current_costs(self, accepted: Sequence[float] = ()) -> dict:
        """Seconds per iteration by draft length as of now, for rows expecting ``accepted`` drafts each: plain's EMA
        (re-measured every few calls), drafting's as its measured ratio to the plain cost around it times that. On a
        shared machine the load moves both, and a rarely run drafting program's absolute EMA is from another load
        than the plain one's (tiny model, CPU, batch 1: EMAs 9.6 / 9.3 ms, so drafts were chosen at 0.06 expected
        accepted drafts, when the programs' ratio was 1.34). With the sequential verify the ratio is the one at the
        verify rows these rows are expected to run (``IterationCost``, ``expected_extra_rows``)."""
        c0, ck = self.costs[0], self.costs[self.block]
        if ck.ratio is None or c0.seconds is None:
            return {d: c.seconds for d, c in self.costs.items()}
        x = self._extra_rows(accepted) if self.sequential_verify else 0.0
        return {0: c0.seconds, self.block: c0.seconds * ck.at(x)}

    def _extra_rows(self, accepted: Sequence[float]) -> float:
        """``expected_extra_rows(block, accepted)``, kept for the last estimates: its bisection costs ~0.45 ms of
        host time (demo, CPU, 8 rows), and between drafting calls the estimates do not change (only a drafting
        call's verifications move them), so a run of plain calls paid it every step for the same answer."""
        key = tuple(accepted)
        if self._rows_memo is None or self._rows_memo[0] != key:
            self._rows_memo = (key, expected_extra_rows(self.block, key))
        return self._rows_memo[1]

    def _could_pay(self, accepted: list) -> bool:
        """Whether drafting could win at these acceptance estimates if it cost no more than a plain iteration (its
        floor: a drafting iteration runs the plain one's forward and more). If not, re-measuring its cost cannot
        change the choice (the tiny model's random drafts: the estimates decay to ~0), so it is not probed."""
        return expected_tokens(self.block, accepted) > expected_tokens(0, accepted) * (1.0 + self.margin)

    def observe(self, draft_len: int, seconds: Optional[float], iters: int, per_seq: Iterable = (),
                verify_rows: Optional[int] = None, planned_iters: Optional[int] = None):
        """A decode call's results: its wall time over ``iters`` iterations, per sequence ``(s, verifies, accepted
        drafts)``, (sequential verify) the one-row verify forwards it ran over all its iterations, and the iterations
        it was planned for (its rows' most)."""
        self.calls += 1
        self.drafted_calls += bool(draft_len)
        if self.mode != "adaptive":
            return
        for d, c in self.costs.items():
            c.since += 1
        if seconds is not None and draft_len in self.costs:
            extra = max(0, verify_rows - iters) if draft_len and verify_rows is not None else 0
            self.costs[draft_len].observe(seconds, iters, ref=self.costs[0].seconds if draft_len else None,
                                          extra_rows=extra, full=planned_iters)
            ck = self.costs[self.block]
            if not draft_len and ck.ratio is None and ck.seconds and self.costs[0].seconds:
                # the start-up probes: drafting ran first (taken back to no extra rows at the prior's row cost)
                ck.ratio = ck.seconds / self.costs[0].seconds - ck.row_ratio * ck.rows
        self.calls_since_draft = 0 if draft_len else self.calls_since_draft + 1
        if not draft_len:
            return
        per_seq = list(per_seq)
        for s, verifies, accepted in per_seq:
            if verifies <= 0:
                continue
            s.spec_acc = getattr(s, "spec_acc", 0.0) + accepted
            s.spec_n = getattr(s, "spec_n", 0.0) + verifies
            s.spec_verifies = getattr(s, "spec_verifies", 0) + verifies
            if not getattr(s, "spec_drafting", True):
                # a stopped request in a call others drafted for was verified for free: a probe
                s.spec_idle_calls = 0
                s.spec_drafting = True
                if self.estimate(s) < self.stop_below:
                    s.spec_drafting = False
            elif s.spec_verifies >= self.min_verifies and (est := self.estimate(s)) < self.stop_below:
                s.spec_drafting, s.spec_idle_calls = False, 0
                self.requests_stopped += 1
                log.info("speculation: request %s stops drafting (%.2f accepted drafts per verification over %d, "
                         "estimate %.2f with the engine-wide %.2f)", s.request_id, s.spec_acc / max(1e-9, s.spec_n),
                         s.spec_verifies, est, self.engine_mean)
        tot_v = sum(v for _, v, _ in per_seq if v > 0)
        if tot_v > 0:      # the engine-wide prior (every request's estimate is shrunk toward it)
            g = self.engine_decay ** tot_v
            self.engine_acc = g * self.engine_acc + sum(a for _, v, a in per_seq if v > 0)
            self.engine_n = g * self.engine_n + tot_v

    def metrics(self) -> dict:
        return {"spec_mode": self.mode, "spec_draft_length": self.draft_len,
                "spec_drafted_call_fraction": self.drafted_calls / self.calls if self.calls else 0.0,
                "spec_requests_stopped_drafting": self.requests_stopped,
                "spec_requests_reprobed": self.requests_reprobed,
                "spec_calls_plain_for_prefill": self.calls_plain_for_prefill,
                "spec_tap_free_calls": self.tap_free_calls,
                "spec_deferred_drafting_calls": self.deferred_drafting_calls,
                "spec_calls_before_drafting_compiled": self.calls_before_drafting_compiled,
                "spec_engine_accepted_per_verify": self.engine_mean,
                **{f"spec_iteration_ms_draft{d}": (1e3 * c.seconds if c.seconds is not None else 0.0)
                   for d, c in self.costs.items()},
                **({"spec_draft_cost_ratio": self.costs[self.block].ratio or 0.0,
                    "spec_draft_row_cost_ratio": self.costs[self.block].row_ratio} if self.costs else {})}
