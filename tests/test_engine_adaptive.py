"""Adaptive speculation (dsflash/serve/engine/adaptive.py): the draft-length decision on synthetic costs and
acceptance (plain where drafting would displace prefill: ``Scheduler.prefill_room``), and the real engine on the toy
backend: a request whose drafts never verify stops drafting, greedy output stays plain decoding's, and switching
between the compiled programs compiles nothing."""
import jax.numpy as jnp
import numpy as np
import pytest

from dsflash.serve.engine import LLMEngine
from dsflash.serve.engine.adaptive import (SpeculationPolicy, choose_draft_length, expected_extra_rows,
                                          expected_tokens)
from dsflash.serve.engine.scheduler import DECODE, PREFILL, Scheduler, Sequence
from dsflash.serve.engine.testing import ToyBackend, run_greedy
from dsflash.serve.types import SamplingParams

# every program compiled before the engine serves (background_compile=False): these tests count which program ran
COMMON = dict(max_num_seqs=4, max_model_len=64, page_size=8, max_num_batched_tokens=48, decode_steps=2,
              prefill_buckets=[(4, 12)], enable_prefix_caching=False, background_compile=False)


# ------------------------------------------------------------------ the decision on synthetic numbers
def test_no_drafts_when_they_never_accept():
    assert choose_draft_length({0: 1.0, 5: 1.01}, [0.0] * 8) == 0


def test_no_drafts_when_verify_is_expensive():
    # 1.5 accepted drafts per verify: 2.5 tokens per row, but an iteration costs 3 plain ones
    assert choose_draft_length({0: 1.0, 5: 3.0}, [1.5] * 8) == 0


def test_drafts_when_acceptance_high_and_verify_cheap():
    assert choose_draft_length({0: 1.0, 5: 1.3}, [2.0] * 8) == 5
    assert choose_draft_length({0: 1.0, 5: 1.3}, [2.0] + [0.0] * 7) == 0   # one good row does not pay for 8


def test_drafting_never_counts_as_cheaper_than_plain():
    """A drafting iteration includes the plain one's forward: a measured drafting cost below the plain cost is
    noise and must not make drafts that never verify look worth it."""
    assert choose_draft_length({0: 1.0, 3: 0.8}, [0.0] * 8) == 0
    assert choose_draft_length({0: 1.0, 3: 0.8}, [0.5] * 8) == 3      # (1.5 tokens at 1.0) still wins


def test_no_rows_or_unknown_plain_cost_means_plain():
    assert choose_draft_length({0: 1.0, 5: 0.5}, []) == 0
    assert choose_draft_length({5: 0.5}, [3.0]) == 0


def test_expected_tokens_caps_accepted_at_the_draft_length():
    assert expected_tokens(0, [4.0, 4.0]) == 2
    assert expected_tokens(3, [4.0, 1.0]) == (1 + 3) + (1 + 1)


class _Seq:
    """The fields of a Sequence the policy reads and writes."""
    def __init__(self, rid):
        self.request_id = rid
        self.spec_acc, self.spec_n, self.spec_verifies, self.spec_drafting, self.spec_idle_calls = 0.0, 0.0, 0, True, 0


def _measured(s, accepted_per_verify, n=10**6):
    """``s`` with ``n`` verifications at ``accepted_per_verify`` behind it (its estimate is then that, whatever the
    prior)."""
    s.spec_acc, s.spec_n, s.spec_verifies = accepted_per_verify * n, float(n), n
    return s


def test_policy_measures_both_then_stops_a_failing_request_and_reprobes_it():
    # a weak prior (prior_weight): 4 failed verifications are enough evidence here
    pol = SpeculationPolicy(5, "adaptive", probe_calls=1, min_verifies=4, reprobe_every=3, remeasure_every=10**6,
                            remeasure_plain_every=10**6, cold_calls=0, prior_weight=0.5)
    good, bad = _Seq("good"), _Seq("bad")
    assert pol.choose([good, bad]) == 5                 # each program is timed first
    pol.observe(5, 1.2, 4, [(good, 4, 12), (bad, 4, 0)])
    assert not bad.spec_drafting and good.spec_drafting and pol.requests_stopped == 1
    assert pol.choose([good, bad]) == 0
    pol.observe(0, 1.0, 4, [])
    # drafting pays for the good request alone: 1 + 3 tokens at 1.2x the cost, vs 1 + 1 plain
    assert pol.choose([good, bad]) == 5
    pol.observe(5, 1.2, 4, [(good, 4, 12), (bad, 4, 0)])
    assert pol.choose([bad]) == 0                       # the stopped request alone: plain
    pol.observe(0, 1.0, 4, [])
    pol.choose([bad])
    pol.choose([bad])                                   # third call without a verification: re-probed
    assert bad.spec_drafting and pol.requests_reprobed == 1


def test_a_programs_cold_first_call_is_not_averaged_in():
    """The first call of each decode program is a cold run (3-5x on CPU): it counts as a probe but its time is
    dropped, so one slow sample cannot keep a rarely run drafting program looking expensive."""
    pol = SpeculationPolicy(5, "adaptive", probe_calls=2, remeasure_every=10**6, remeasure_plain_every=10**6)
    a = _measured(_Seq("a"), 2.0)
    for d, t in ((5, 9.0), (5, 1.2), (0, 5.0), (0, 1.0)):   # each program: a cold call, then a warm one
        assert pol.choose([a]) == d
        pol.observe(d, t, 1, [(a, 1, 2)] if d else [])
    assert pol.costs[5].seconds == pytest.approx(1.2) and pol.costs[0].seconds == pytest.approx(1.0)
    assert pol.choose([a]) == 5          # 3 tokens at 1.2x beat 1 (the cold 9.0 would have said plain)


def test_drafting_cost_is_remeasured_only_while_drafting_could_pay():
    """A drafting cost not measured for ``remeasure_every`` calls is re-measured only if the acceptance estimates
    could make drafting win at a plain iteration's cost (its floor): drafts that never verify are not probed."""
    for est, want in ((0.001, 0), (0.5, 5)):
        pol = SpeculationPolicy(5, "adaptive", probe_calls=1, remeasure_every=3, remeasure_plain_every=10**6,
                                cold_calls=0)
        pol.costs[5].observe(3.0, 1)
        pol.costs[0].observe(1.0, 1)
        a = _measured(_Seq("a"), est)
        for _ in range(3):
            assert pol.choose([a]) == 0
            pol.observe(0, 1.0, 1, [])
        assert pol.choose([a]) == want, est


def test_probes_back_off_while_drafts_never_verify_and_drafting_resumes_once_they_do():
    """A stream of new requests whose drafts never verify: the engine-wide reprobe and the drafting re-measure come
    ever more rarely (without the back-off: one every reprobe_every calls, ~45 in 3,000); when the drafts start
    verifying, a probe finds it within reprobe_every * max_backoff calls and drafting stays on."""
    pol = SpeculationPolicy(3, "adaptive", cold_calls=0)

    def call(i, accepted):
        s = _Seq(str(i))
        d = pol.choose([s])
        pol.observe(d, 4 * (1.3 if d else 1.0), 4, [(s, 4, 4 * accepted)] if d else [])   # decode_steps 4
        return d

    drafted = sum(bool(call(i, 0)) for i in range(3000))
    assert drafted <= 2 * pol.probe_calls + 8 and pol.backoff == pol.max_backoff
    later = [bool(call(i, 3)) for i in range(pol.reprobe_every * pol.max_backoff + 100)]
    assert sum(later[-100:]) >= 80 and pol.backoff == 1


def test_a_due_probe_waits_while_prompts_wait_for_prefill():
    """A drafting call takes block + 1 tokens per decode row of the step's budget: an exploration probe that is due
    waits while prefill is pending, up to twice its interval."""
    for prefilling, want in ((False, 3), (True, 6)):
        pol = SpeculationPolicy(3, "adaptive", probe_calls=1, cold_calls=0, reprobe_every=3, remeasure_every=10**6)
        pol.costs[3].observe(1.3, 1)
        pol.costs[0].observe(1.0, 1)
        pol.engine_acc, pol.engine_n = 0.0, 1e6
        calls = 0
        while pol.choose([_Seq(str(calls))], prefilling=prefilling) == 0:
            pol.observe(0, 1.0, 1, [])
            calls += 1
        assert calls == want, prefilling


def _drafting_pays(block=5, **kw):
    """A policy whose measured costs favour drafting at good acceptance (1.2x a plain iteration)."""
    pol = SpeculationPolicy(block, "adaptive", probe_calls=1, cold_calls=0, remeasure_plain_every=10**6, **kw)
    pol.costs[block].observe(1.2, 1)
    pol.costs[0].observe(1.0, 1)
    return pol


def test_drafting_that_would_displace_prefill_runs_plain():
    """Where drafting would take tokens from the step's prefill (the budget binds), the call is plain whatever the
    costs say; where the budget has room for both, prompts waiting change nothing. "always" still drafts."""
    pol = _drafting_pays()
    a = _measured(_Seq("a"), 2.0)
    assert pol.choose([a]) == 5 and pol.choose([a], prefilling=True) == 5
    assert pol.choose([a], prefilling=True, displaces_prefill=80) == 0
    assert pol.draft_len == 0 and pol.calls_plain_for_prefill == 1
    pol.observe(0, 1.0, 1, [])                      # observed as a plain call
    assert pol.choose([a], prefilling=True) == 5
    assert pol.metrics()["spec_calls_plain_for_prefill"] == 1
    assert SpeculationPolicy(5, "always").choose([a], prefilling=True, displaces_prefill=80) == 5
    assert SpeculationPolicy(5, "off").choose([a], prefilling=True, displaces_prefill=80) == 0


def test_a_step_that_prefills_runs_plain_even_where_the_budget_has_room():
    """A mixed step (the plain call would prefill prompt tokens) is plain by default, though drafting would take none
    of them: it would lengthen the step every waiting prompt waits on (H200, session 24: adaptive 0.91x plain at 32
    prompts, its drafting mixed steps 13.3 ms against 11.8). ``draft_in_mixed_steps`` keeps the budget-only rule."""
    pol = _drafting_pays()
    a = _measured(_Seq("a"), 2.0)
    assert pol.choose([a], prefilling=True, prefill_tokens=0) == 5          # prompts wait, none prefilled this step
    assert pol.choose([a], prefilling=True, prefill_tokens=40) == 0
    assert pol.calls_plain_for_prefill == 1
    pol.observe(0, 1.0, 1, [])
    assert pol.choose([a]) == 5                                             # the prefill done: drafting again
    old = _drafting_pays(draft_in_mixed_steps=True)
    assert old.choose([a], prefilling=True, prefill_tokens=40) == 5
    assert old.choose([a], prefilling=True, prefill_tokens=40, displaces_prefill=8) == 0
    assert SpeculationPolicy(5, "always").choose([a], prefilling=True, prefill_tokens=40) == 5


def _mixed_policy(ratio, row_ratio=0.0):
    """A policy drafting in mixed steps whose drafting iteration costs ``ratio`` plain ones (sequential verify, the
    row cost ``row_ratio``)."""
    pol = SpeculationPolicy(5, "adaptive", probe_calls=1, cold_calls=0, remeasure_plain_every=10**6,
                            remeasure_every=10**6, reprobe_every=10**6, draft_in_mixed_steps=True,
                            sequential_verify=True, row_prior=row_ratio, margin=0.02)
    pol.costs[0].observe(1.0, 1)
    pol.costs[5].observe(ratio, 1, ref=1.0)
    pol.costs[5]._row_ratio = row_ratio
    return pol


def test_a_mixed_step_charges_drafting_to_the_sequences_it_holds_up():
    """Issue 23, session 29 (2-core CPU, demo, chat prompts, batch 8): a pass's first mixed step decodes 1 row while
    the other 7 prompts prefill. Drafting there cost ~2.6 plain iterations for one row expecting ~1.0 accepted drafts
    (2.0 tokens an iteration against 1: a per-row win at a modelled 1.9x), but the 7 held prompts wait out the extra
    time too: the mixed steps' decode calls took 401 ms a pass against plain's 236 and the pass ran 0.90x plain. With
    the held sequences priced at their plain rate, drafting there needs accepted drafts > (1 + 7) x 0.9: plain."""
    a = _measured(_Seq("a"), 1.0)
    pol = _mixed_policy(1.9)
    assert pol.choose([a]) == 5                      # decode-only, the batch's last row: drafting pays
    pol = _mixed_policy(1.9)
    assert pol.choose([a], prefilling=True, prefill_tokens=59, held=7) == 0
    assert pol.calls_plain_for_prefill == 0          # the cost model's decision, not the prefill-first rule
    # a step that prefills with no row decoding yet runs plain, whatever the last choice was (before: the last
    # pass's last call, drafting for the batch's last row, carried into the next pass's first step)
    pol = _mixed_policy(1.9)
    assert pol.choose([a]) == 5 and pol.choose([], prefilling=True) == 0 and pol.choose([]) == 5
    # held counts only in a step that prefills (waiting prompts that get no tokens this step are not held by it)
    assert _mixed_policy(1.9).choose([a], prefilling=True, prefill_tokens=0, held=7) == 5


def test_a_mixed_step_still_drafts_where_drafting_is_cheap():
    """The GPU case (H100, demo, chat, batch 8: drafting ~1.3-1.45 plain iterations, ~1.15 accepted drafts; mixed
    steps 16.1 ms for 34.5 tokens drafting against 14.5 ms for 26.5 plain): with most of the batch decoding and a few
    prompts held, drafting in the mixed step still pays and is chosen; with one row decoding and seven held it does
    not (8 x 0.4 plain iterations of the whole batch for 1.15 tokens)."""
    rows = [_measured(_Seq(str(i)), 1.15) for i in range(6)]
    assert _mixed_policy(1.4).choose(rows, prefilling=True, prefill_tokens=32, held=2) == 5
    assert _mixed_policy(1.3).choose(rows[:4], prefilling=True, prefill_tokens=79, held=4) == 5
    assert _mixed_policy(1.4).choose(rows[:1], prefilling=True, prefill_tokens=59, held=7) == 0


def test_prefill_first_switches_log_at_debug_and_cost_switches_at_info(caplog):
    """Under load the prefill-first rule can flip the draft length step by step: those switches (and the switch back
    right after one) log at debug, a switch the costs decide still at info."""
    import logging
    pol = _drafting_pays()
    a = _measured(_Seq("a"), 2.0)
    with caplog.at_level(logging.DEBUG, logger="dsflash.serve.engine"):
        assert pol.choose([a]) == 5
        for _ in range(3):
            assert pol.choose([a], prefilling=True, displaces_prefill=40) == 0
            assert pol.choose([a], prefilling=True) == 5
    switches = [r.levelno for r in caplog.records if "draft length" in r.getMessage()]
    assert switches == [logging.INFO] + [logging.DEBUG] * 6, [(r.levelname, r.getMessage()) for r in caplog.records]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="dsflash.serve.engine"):
        pol.costs[5].ratio = 10.0              # drafting now costs 10 plain iterations: the costs switch to plain
        assert pol.choose([a]) == 0
    assert [r.levelno for r in caplog.records if "draft length" in r.getMessage()] == [logging.INFO]


def test_a_due_probe_is_not_consumed_by_a_call_that_would_displace_prefill():
    """Drafts that never verify: the engine-wide reprobe comes due; calls whose drafting would displace prefill run
    plain and leave it due (no back-off either), and the first call without that conflict probes. A displaced call
    right after the probe does not judge it either: the next free call does (back-off 1 -> 2)."""
    pol = SpeculationPolicy(3, "adaptive", probe_calls=1, cold_calls=0, reprobe_every=3, remeasure_every=10**6)
    pol.costs[3].observe(1.3, 1)
    pol.costs[0].observe(1.0, 1)
    pol.engine_acc, pol.engine_n = 0.0, 1e6
    for i in range(3):
        assert pol.choose([_Seq(str(i))]) == 0
        pol.observe(0, 1.0, 1, [])
    for i in range(10):                              # due (3 calls without a draft) but displaced: plain
        assert pol.choose([_Seq(f"d{i}")], prefilling=True, displaces_prefill=12) == 0
        pol.observe(0, 1.0, 1, [])
    assert pol.backoff == 1 and not pol._probed and pol.calls_plain_for_prefill == 10
    s = _Seq("p")
    assert pol.choose([s], prefilling=True) == 3     # the probe, at the first step that leaves the prefill alone
    pol.observe(3, 1.3, 1, [(s, 1, 0)])
    assert pol.choose([s], prefilling=True, displaces_prefill=12) == 0 and pol.backoff == 1
    pol.observe(0, 1.0, 1, [])
    assert pol.choose([s]) == 0 and pol.backoff == 2     # the probe found nothing: backed off once


def test_drafting_cost_follows_the_plain_cost_as_a_ratio():
    """The drafting cost is its measured ratio to the plain cost around it: when the machine's load doubles the plain
    cost later, drafting is not left looking cheap at its old absolute cost."""
    pol = SpeculationPolicy(3, "adaptive", probe_calls=1, cold_calls=0, remeasure_every=10**6)
    a = _measured(_Seq("a"), 0.3)
    pol.observe(3, 1.3, 1, [])          # the start-up probes: drafting first, at 1.3x the plain cost after it
    pol.observe(0, 1.0, 1, [])
    assert pol.costs[3].ratio == pytest.approx(1.3)
    pol.observe(3, 1.3, 1, [])          # drafting at 1.3x the plain cost around it
    assert pol.costs[3].ratio == pytest.approx(1.3)
    for _ in range(6):                  # the load doubles: plain now takes 2.0
        pol.observe(0, 2.0, 1, [])
    assert pol.current_costs()[3] == pytest.approx(1.3 * pol.costs[0].seconds)
    assert pol.choose([a]) == 0         # 1.3 tokens at 1.3x plain: no (at the stale 1.3 s vs 2.0 s it was yes)
    assert choose_draft_length({d: c.seconds for d, c in pol.costs.items()}, [0.3]) == 3


def test_a_drafting_call_that_accepted_much_does_not_read_as_the_cost_of_drafting():
    """Sequential verify: a drafting iteration's cost grows with the verify rows its acceptance lets run (demo, CPU,
    batch 1: ~1.16 plain iterations at none, +0.41 per extra row). Its samples are taken back to no extra rows, so one
    call that accepted 9 drafts in 4 iterations (3.2x plain, which pushed the old EMA of ratios from 1.37 to 1.93)
    does not make drafting look too dear at the mean acceptance; the model charges the rows expected there."""
    def policy(sequential):
        pol = SpeculationPolicy(5, "adaptive", probe_calls=1, cold_calls=0, remeasure_every=10**6,
                                remeasure_plain_every=10**6, sequential_verify=sequential)
        pol.observe(0, 4.0, 4, [])                       # plain: 1.0 per iteration
        for extra in (0, 1, 3, 2, 9):                    # drafting calls of 4 iterations, extra verify rows
            pol.observe(5, 4 * 1.16 + 0.41 * extra, 4, [], 4 + extra)
        return pol
    pol = policy(True)
    a = _measured(_Seq("a"), 0.5)
    assert pol.costs[5].row_ratio == pytest.approx(0.41, abs=0.05)
    assert pol.costs[5].ratio == pytest.approx(1.16, abs=0.05)
    assert pol.current_costs([0.6])[5] == pytest.approx(1.16 + 0.41 * 0.6, abs=0.05)
    assert pol.current_costs([0.0])[5] == pytest.approx(1.16, abs=0.05)
    assert pol.choose([a]) == 5                          # 1.5 tokens at ~1.37x plain
    # the same samples without the row counts (the old model: an EMA of whole-call ratios) said plain here
    old = SpeculationPolicy(5, "adaptive", probe_calls=1, cold_calls=0, remeasure_every=10**6,
                            remeasure_plain_every=10**6)
    old.observe(0, 4.0, 4, [])
    for extra in (0, 1, 3, 2, 9):
        old.observe(5, 4 * 1.16 + 0.41 * extra, 4, [])
    assert old.current_costs([0.5])[5] > 1.5 and old.choose([_measured(_Seq("b"), 0.5)]) == 0


def test_a_call_whose_rows_finished_early_is_not_averaged_in():
    """A request's last call ends when its rows finish, before the iterations it was planned for; its per-iteration
    cost carries the call's fixed cost over fewer iterations (demo, CPU, batch 1: 1-iteration drafting calls 56-70
    ms, 4-iteration ones ~100) and is not a sample of what the next call costs."""
    pol = SpeculationPolicy(5, "adaptive", probe_calls=1, cold_calls=0, remeasure_every=10**6)
    pol.observe(0, 4.0, 4, [], planned_iters=4)
    pol.observe(5, 5.2, 4, [], planned_iters=4)
    pol.observe(5, 2.7, 1, [], planned_iters=4)        # ran 1 of 4: its rows finished
    pol.observe(0, 1.9, 2, [], planned_iters=4)
    assert pol.costs[5].ratio == pytest.approx(1.3) and pol.costs[0].seconds == pytest.approx(1.0)
    pol.observe(0, 3.3, 3, [], planned_iters=3)        # planned for 3 (the request's last tokens): a sample
    assert pol.costs[0].seconds == pytest.approx(0.7 * 1.0 + 0.3 * 1.1)


def test_the_batched_verify_cost_does_not_follow_acceptance():
    """Without the sequential verify every drafting iteration runs all block + 1 rows: no rows are charged."""
    pol = SpeculationPolicy(5, "adaptive", probe_calls=1, cold_calls=0, remeasure_every=10**6)
    pol.observe(0, 1.0, 1, [])
    pol.observe(5, 1.4, 1, [])
    assert pol.current_costs([0.0])[5] == pytest.approx(1.4) and pol.current_costs([3.0])[5] == pytest.approx(1.4)


def test_expected_extra_rows_is_the_longest_accepted_prefix():
    assert expected_extra_rows(5, []) == 0 and expected_extra_rows(5, [0.0, 0.0]) == 0
    assert expected_extra_rows(5, [0.6]) == pytest.approx(0.6)             # one row: its estimate
    assert expected_extra_rows(5, [0.0, 2.0]) == pytest.approx(2.0)
    assert expected_extra_rows(5, [5.0, 5.0, 9.0]) == pytest.approx(5.0)   # all accepted: every row runs
    many = expected_extra_rows(5, [0.6] * 8)                                # the max of 8 is more than the mean
    assert 0.6 < many < 5.0 and many > expected_extra_rows(5, [0.6] * 2)


def test_always_and_off_never_adapt():
    assert SpeculationPolicy(5, "always").choose([_Seq("a")]) == 5
    off = SpeculationPolicy(5, "off")
    assert off.lengths == (0,) and off.choose([_Seq("a")]) == 0
    with pytest.raises(ValueError, match="speculative_mode"):
        SpeculationPolicy(5, "sometimes")


# ------------------------------------------------------------------ Scheduler.prefill_room (the rule's input)
def _scheduler(B, decode_rows, waiting=(48,), *, dp=1, cap=None, buckets=((1, 128), (4, 32)), slots=64,
               busy_slots=0, waiting_rank=None):
    """A scheduler with ``decode_rows`` sequences decoding (per rank: a list) and waiting prompts of the given
    lengths; ``busy_slots`` of each rank's slots taken."""
    sch = Scheduler(num_slots=slots, num_pages=512, page_size=16, pages_per_seq=16, dp=dp, block=5, decode_steps=4,
                    max_num_batched_tokens=B, prefix_caching=False, prefix_replay="bounded", replay_window=16,
                    replay_exact=64, prefill_buckets=list(buckets), mirror=None, draft_sampling=False, metrics=None,
                    mixed_prefill_tokens=cap)
    sp = SamplingParams(max_tokens=64)
    per_rank = decode_rows if isinstance(decode_rows, (list, tuple)) else [decode_rows] + [0] * (dp - 1)
    for r, n in enumerate(per_rank):
        for i in range(n):
            s = Sequence(f"d{r}-{i}", 0, None, [2] * 48, sp, 0.0, 0, [])
            s.status, s.out_ids, s.rank = DECODE, [3], r
            sch.running.append(s)
    for pool in sch.rank_slots:
        for _ in range(busy_slots):
            pool.allocate()
    for i, n in enumerate(waiting):
        sch.add(f"w{i}", [Sequence(f"w{i}", 0, None, [2] * n, sp, 0.0, 0, [])], waiting_rank)
    return sch


def test_drafting_shrinks_the_prefill_only_where_the_budget_binds():
    # the H100 bench's batch 32 (block 5, B = 128): drafting leaves 16 tokens of the 48-token prompt, plain all 48
    sch = _scheduler(128, 32)
    assert sch.prefill_room(6) == 16 and sch.prefill_room(1) == 48
    # a large budget has room for the prompt either way
    big = _scheduler(4096, 32)
    assert big.prefill_room(6) == big.prefill_room(1) == 48
    # nothing pending, or no slot to admit the waiting prompt into: nothing to displace
    assert _scheduler(128, 32, waiting=()).prefill_room(6) == 0
    full = _scheduler(128, 32, slots=32, busy_slots=32)
    assert full.prefill_room(6) == full.prefill_room(1) == 0


def test_prefill_room_packs_the_pending_prompts_as_the_scheduler_does():
    """A running prompt's remaining 30 tokens, then waiting prompts, packed into the buckets: (4, 32) takes at most 32
    tokens of a prompt, so with 4 decode rows drafting (budget 104) leaves as much as plain (124); only a budget
    below what the buckets can take (K1 = 20: 48) shrinks the prefill."""
    sch = _scheduler(128, 4, waiting=(100, 100, 100))
    pre = sch.waiting.popleft()
    pre.status, pre.computed = PREFILL, 70
    sch.running.append(pre)
    assert sch.prefill_room(1) == sch.prefill_room(6) == 30 + 32 + 32
    assert sch.prefill_room(20) == 48


@pytest.mark.parametrize("cap, drafting, plain", [(16, 16, 16), (64, 16, 48)])
def test_the_mixed_prefill_cap(cap, drafting, plain):
    """``max_mixed_prefill_tokens``: a cap below both budgets binds either way (drafting displaces nothing); one
    between them does not save the prefill from drafting."""
    sch = _scheduler(128, 32, cap=cap, buckets=((1, 128), (4, 32), (1, cap)))
    assert (sch.prefill_room(6), sch.prefill_room(1)) == (drafting, plain)


def test_each_dp_rank_has_its_own_budget():
    """Rank 0's decode rows shrink rank 0's prefill budget only: a prompt waiting on rank 1 is not displaced."""
    kw = dict(dp=2, buckets=((2, 128), (8, 32)))
    other = _scheduler(128, [32, 0], waiting_rank=1, **kw)
    assert other.prefill_room(6) == other.prefill_room(1) == 48
    same = _scheduler(128, [32, 0], waiting_rank=0, **kw)
    assert same.prefill_room(6) == 16 and same.prefill_room(1) == 48


# ------------------------------------------------------------------ the engine
class NeverAcceptToy(ToyBackend):
    """The toy whose draft always proposes the last token id, which its target never picks (greedy drafts all
    fail at the first position)."""

    def forward(self, params, batch, state, *, logits="last", taps=False):
        out, state = super().forward(params, batch, state, logits=logits, taps=taps)
        out["logits"] = out["logits"].at[..., -1].set(-1e9)
        return out, state

    def propose(self, params, state, y, pos, slots, floor, temperature, keys):
        d, lg, c = super().propose(params, state, y, pos, slots, floor, temperature, keys)
        return jnp.full_like(d, self.vocab_size - 1), lg, c


def _run(eng, prompts, tag="r", max_tokens=40):
    return run_greedy(eng, prompts, tag, max_tokens)


PROMPTS = [[int(x) for x in np.random.default_rng(i).integers(2, 63, size=5 + 7 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def plain_outputs():
    return _run(LLMEngine(NeverAcceptToy(), speculative_mode="off", **COMMON), PROMPTS)


@pytest.fixture(scope="module")
def adaptive_engine():
    eng = LLMEngine(NeverAcceptToy(), **COMMON)                # adaptive: the default
    assert eng.config.speculative_mode == "adaptive" and eng.runner.draft_lengths == (0, eng.k)
    return eng


def test_failing_drafts_stop_and_output_equals_plain(adaptive_engine, plain_outputs):
    eng = adaptive_engine
    pol = eng.speculation
    for c in pol.costs.values():      # verify as cheap as a plain step (held): only acceptance can stop drafts
        c.seconds, c.samples, c.alpha = 1e-3, pol.probe_calls, 0.0
    out = _run(eng, PROMPTS[:1])
    assert out == {0: plain_outputs[0]}
    m = eng.metrics_snapshot()
    assert m["spec_num_accepted_tokens"] == 0
    assert m["spec_requests_stopped_drafting"] == 1
    # drafted until its estimate fell below stop_below, then plain to the end (40 tokens, 2 per call): the first
    # request of an engine is shrunk toward the weak initial prior (initial_weight pseudo-verifications at 1.0,
    # outweighed by the failures as they come), which takes ~18 failed verifications at the defaults
    assert pol.min_verifies <= m["spec_num_drafts"] <= 20
    assert m["spec_draft_length"] == 0 and m["spec_drafted_call_fraction"] < 0.5     # 9 of 20 calls
    assert m["compiles_after_warmup"] == 0


def test_switching_programs_keeps_greedy_output_and_compiles_nothing(adaptive_engine, plain_outputs):
    """A policy that flips the draft length every call: output is plain decoding's, nothing compiles."""
    eng = adaptive_engine
    eng.speculation = pol = SpeculationPolicy(eng.k, "adaptive")
    flips = iter(range(10**6))
    pol._decide = lambda accepted: eng.k * (next(flips) % 2)
    assert _run(eng, PROMPTS, tag="flip") == plain_outputs
    m = eng.metrics_snapshot()
    assert 0.3 < m["spec_drafted_call_fraction"] < 0.7
    assert m["compiles_after_warmup"] == 0


def test_the_engine_runs_every_mixed_step_plain(adaptive_engine):
    """With a policy that would always draft, the engine's steps that prefill a prompt run their decode rows plain
    (K1 = 1) and the decode-only steps draft: six prompts over four slots, so later prompts prefill while earlier
    ones decode."""
    eng = adaptive_engine
    eng.speculation = pol = SpeculationPolicy(eng.k, "adaptive")
    pol._decide = lambda accepted: eng.k
    seen, schedule = [], eng.scheduler.schedule

    def recording():
        plan = schedule()
        if plan and plan.decode:
            seen.append((bool(plan.prefill), plan.K1))
        return plan
    eng.scheduler.schedule = recording
    try:
        prompts = [[int(x) for x in np.random.default_rng(50 + i).integers(2, 63, size=9 + 5 * i)] for i in range(6)]
        _run(eng, prompts, tag="mix", max_tokens=12)
    finally:
        del eng.scheduler.schedule
    mixed = [k1 for pre, k1 in seen if pre]
    alone = [k1 for pre, k1 in seen if not pre]
    assert mixed and alone, seen
    assert set(mixed) == {1}, seen
    assert eng.k + 1 in alone, seen


def test_new_requests_start_from_the_engine_wide_acceptance():
    pol = SpeculationPolicy(5, "adaptive", probe_calls=1, reprobe_every=2, remeasure_every=10**6,
                            remeasure_plain_every=10**6, cold_calls=0, initial_weight=1)
    a = _Seq("a")
    pol.choose([a])
    pol.observe(5, 1.6, 4, [(a, 4, 0)])               # drafts fail; verify costs 1.6 plain iterations
    pol.choose([a])
    pol.observe(0, 1.0, 4, [])
    b = _Seq("b")                                       # a new request of the same workload: no probe of its own
    assert pol.estimate(b) < 0.25 and pol.choose([b]) == 0
    pol.observe(0, 1.0, 4, [])
    assert pol.choose([b]) == 5                         # reprobe_every calls without drafts: the workload is probed


def _serve(pol, requests, concurrency, calls_per_request, accepted, ratio, iters=4):
    """Serve ``requests`` new requests, ``concurrency`` at a time, each running ``calls_per_request`` decode calls
    of ``iters`` verifications whose accepted drafts come from ``accepted(request index, call index)``; a drafting
    call costs ``ratio`` plain ones. Returns the drafting calls each request was in and the drafting calls."""
    waiting, running, drafted, calls = list(range(requests)), [], [0] * requests, 0
    while waiting or running:
        while waiting and len(running) < concurrency:
            i = waiting.pop(0)
            s = _Seq(str(i))
            s.i, s.calls = i, 0
            running.append(s)
        d = pol.choose(running)
        calls += bool(d)
        per_seq = []
        for s in running:
            if d:
                drafted[s.i] += 1
                per_seq.append((s, iters, accepted(s.i, s.calls)))
            s.calls += 1
        pol.observe(d, (ratio if d else 1.0) * iters, iters, per_seq)
        running = [s for s in running if s.calls < calls_per_request]
    return drafted, calls


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_requests_of_a_workload_whose_drafts_never_verify_draft_rarely(concurrency):
    """The H200 bench-4l-96e serve run (random weights: no draft ever verifies; 48 requests of 128 tokens at
    concurrency 1 / 8 / 32, decode_steps 4; drafting 1.86x plain): in the code that ran it every new request drafted
    until it stopped (497 drafting calls). With the engine-wide prior a new request starts at the engine's ~0 and
    does not draft; what drafts is the start-up (each program measured, the weak initial prior) and the backed-off
    engine-wide reprobes (one call each, for every row in it; at most one per 64 decode calls, backed off)."""
    pol = SpeculationPolicy(5, "adaptive")
    drafted, calls = _serve(pol, 48, concurrency, 32, lambda i, c: 0, 1.86)
    assert calls <= pol.probe_calls + 2 + 48 * 32 // concurrency // pol.reprobe_every, drafted
    later = drafted[concurrency:]           # requests that started after the engine had learned
    assert sum(later) <= 0.4 * len(later), drafted


def test_an_unlucky_start_near_break_even_does_not_stop_a_request():
    """Demo model, CPU, batch 1: drafting costs 1.4x plain (break-even ~0.42 accepted drafts per verification with
    the margin), the engine's requests accept 0.5; a new request's first 8 verifications accept 1 draft (the
    first draft is accepted ~27 % of the time, so that is likely enough). It keeps drafting: its estimate is shrunk
    toward the engine-wide 0.5, not its own 0.125 (the per-request EMA stopped it after those 8)."""
    pol = SpeculationPolicy(5, "adaptive", cold_calls=0)
    _serve(pol, 8, 1, 16, lambda i, c: 2, 1.4)          # earlier requests: 2 accepted per 4 verifications
    assert 0.45 < pol.engine_mean < 0.55
    s = _Seq("unlucky")
    for accepted in (1, 0, None):
        while (d := pol.choose([s])) == 0:         # the plain program's periodic re-measure: a plain call
            pol.observe(0, 4.0, 4, [])
        assert d == 5
        if accepted is not None:
            pol.observe(5, 1.4 * 4, 4, [(s, 4, accepted)])
    assert s.spec_drafting and pol.estimate(s) > 0.43 and s.spec_verifies == 8
    assert pol.requests_stopped == 0


def test_a_request_that_really_fails_still_stops_against_a_good_prior():
    """The prior is evidence, not a floor: a request whose drafts keep failing stops although the engine's requests
    accept 0.5 (after ~one prior weight of verifications)."""
    pol = SpeculationPolicy(5, "adaptive", cold_calls=0)
    _serve(pol, 8, 1, 16, lambda i, c: 2, 1.4)
    assert pol.engine_mean > 0.45
    s = _Seq("bad")
    for _ in range(40):
        if not s.spec_drafting:
            break
        pol.observe(5, 1.4 * 4, 4, [(s, 4, 0)])
    assert not s.spec_drafting and s.spec_verifies <= 2 * pol.prior_weight + 4


# ------------------------------------------------------------------ the lazy draft context (runner.lazy_ctx)
def _flip_run(eng, prompts, tag, period=3):
    """Draft on one call in ``period`` (plain otherwise): drafting resumes after plain calls again and again."""
    eng.speculation = pol = SpeculationPolicy(eng.k, "adaptive")
    calls = iter(range(10**6))
    pol._decide = lambda accepted: eng.k if next(calls) % period == 0 else 0
    return _run(eng, prompts, tag=tag)


def test_lazy_draft_context_drafts_as_the_eager_one():
    """The plain program skips the draft's context update; the drafting one catches it up from the recorded taps.
    The toy's drafts read its draft ring, so equal acceptance means the caught-up context is the eager one's."""
    prompts = PROMPTS + [[int(x) for x in np.random.default_rng(9).integers(2, 63, size=20)]]
    res = {}
    for lazy in (True, False):
        eng = LLMEngine(ToyBackend(), lazy_draft_context=lazy, **COMMON)
        assert eng.runner.lazy_ctx == lazy and ("taps" in eng.runner.rows) == lazy
        out = _flip_run(eng, prompts, "z")
        m = eng.metrics_snapshot()
        assert m["compiles_after_warmup"] == 0
        res[lazy] = (out, m["spec_num_drafts"], m["spec_num_accepted_tokens"])
    assert res[True] == res[False]
    assert res[True][2] > 0
    plain = _run(LLMEngine(ToyBackend(), speculative_mode="off", **COMMON), prompts, tag="z")
    assert res[True][0] == plain


# ------------------------------------------------------------------ the sequential verify's early exit
class CountingToy(ToyBackend):
    """The toy with a counter of target forwards in its state."""

    def init_state(self, geo):
        return {**super().init_state(geo), "n_fwd": jnp.zeros((), jnp.int32)}

    def forward(self, params, batch, state, *, logits="last", taps=False):
        out, state = super().forward(params, batch, state, logits=logits, taps=taps)
        return out, {**state, "n_fwd": state["n_fwd"] + 1}


@pytest.mark.parametrize("accept_until,forwards", [((0, 0, 0, 0), 1), ((2, 0, 1, 0), 3), ((9, 9, 9, 9), 4),
                                                   ((0, 3, 0, 0), 4)])
def test_sequential_verify_stops_at_the_last_first_rejection(accept_until, forwards):
    """Row j + 1 is verified only while some row accepted drafts 0 .. j: with none accepted a drafting iteration
    runs one forward; the rows it runs equal the full sequential verify's and the rest are zeros."""
    import types

    import jax
    from dsflash.model.state import Batch, CacheGeometry
    from dsflash.serve.engine.runner import Runner
    be = CountingToy()
    geo = CacheGeometry(num_slots=4, num_pages=8, page_size=8, ring_slack=16)
    be.bind_geometry(geo)
    S_, K1 = 4, be.block + 1
    rng = np.random.default_rng(0)
    z = jnp.zeros((S_,), jnp.int32)
    batch = Batch(jnp.asarray(rng.integers(2, 60, size=(S_, K1)), jnp.int32), jnp.full((S_,), 5, jnp.int32),
                  jnp.full((S_,), K1, jnp.int32), jnp.arange(S_, dtype=jnp.int32),
                  jnp.asarray(np.arange(S_ * 2).reshape(S_, 2), jnp.int32), z, z, z)
    until = jnp.asarray(accept_until, jnp.int32)
    runner = types.SimpleNamespace(backend=be, sequential_verify=True)

    def run(until):
        def verify_row(j, logits):
            return j < until, {"seen": jnp.full((S_,), j + 1, jnp.int32)}
        return Runner._target_forward(runner, be.params, batch, be.init_state(geo), True, verify_row)

    out, state = jax.jit(run)(until)
    full, _ = jax.jit(run)(jnp.full((S_,), 99, jnp.int32))
    assert int(state["n_fwd"]) == forwards
    np.testing.assert_array_equal(np.asarray(out["logits"][:, :forwards]), np.asarray(full["logits"][:, :forwards]))
    assert not np.asarray(out["logits"][:, forwards:]).any()
    np.testing.assert_array_equal(np.asarray(out["seen"]), np.where(np.arange(K1) < forwards, np.arange(K1) + 1, 0)[None].repeat(S_, 0))


def test_a_decode_call_reports_the_verify_rows_it_ran():
    """The cost model's extra rows: the decode result's ``verify_rows`` is the one-row verify forwards it ran."""
    from dsflash.serve.engine.packed import to_host

    class SlotCountingToy(CountingToy):     # the counter as a per-slot leaf (the engine's snapshot layout)
        def init_state(self, geo):
            return {**super().init_state(geo), "n_fwd": jnp.zeros((geo.num_slots, 1), jnp.int32)}

    eng = LLMEngine(SlotCountingToy(), speculative_mode="always", sequential_verify=True, **COMMON)
    r, seen = eng.runner, []
    orig = r.decode

    def decode(inp, d=None):
        n0 = int(r.state["n_fwd"][0, 0])
        res = to_host(orig(inp, d))           # (the program's results come back packed: packed.py)
        seen.append((int(r.state["n_fwd"][0, 0]) - n0, int(res["verify_rows"]), int(res["iters"])))
        return res
    r.decode = decode
    _run(eng, PROMPTS, tag="v")
    assert seen and all(fwd == rows for fwd, rows, _ in seen), seen
    assert any(rows > it for _, rows, it in seen)      # the toy's drafts verify: some calls ran extra rows


# ------------------------------------------------------------------ what a plain call of an adaptive engine costs
class RecordingToy(ToyBackend):
    """The toy, logging (while ``log`` is a list) every target forward's rows per sequence and taps flag and every
    call of the draft model, as a program is traced."""
    log = None

    def forward(self, params, batch, state, *, logits="last", taps=False):
        if self.log is not None:
            self.log.append(("forward", int(batch.tokens.shape[1]), bool(taps)))
        return super().forward(params, batch, state, logits=logits, taps=taps)

    def propose(self, params, state, y, pos, slots, floor, temperature, keys):
        if self.log is not None:
            self.log.append(("propose",))
        return super().propose(params, state, y, pos, slots, floor, temperature, keys)

    def update_context(self, params, out, batch, state):
        if self.log is not None:
            self.log.append(("update_context",))
        return super().update_context(params, out, batch, state)


def _traced_decode(eng, draft_len):
    """What the engine's decode program of ``draft_len`` calls, as traced (a fresh trace of the runner's program)."""
    import functools

    import jax
    r, be = eng.runner, eng.backend
    be.log = []
    try:
        jax.jit(functools.partial(r._decode_impl, drafting=draft_len > 0)).lower(
            r.params, r.state, r.rows, r.place(r.empty_decode_inputs()))
        return be.log
    finally:
        be.log = None


def test_a_plain_call_runs_one_row_per_sequence_and_no_draft_model():
    """Issue 23 (H100: adaptive drafted in none of a pass's calls yet ran 0.81x plain): an adaptive engine's call
    that does not draft runs the plain engine's iteration -- one forward of one row per sequence, no proposal and
    no draft-context update (lazy draft context) -- plus the taps it records for a later catch-up. The drafting
    program proposes and updates the draft context. (A guard: this held before the issue's investigation; the
    measured costs are in docs/engine.md.)"""
    eng, plain = LLMEngine(RecordingToy(), **COMMON), LLMEngine(RecordingToy(), speculative_mode="off", **COMMON)
    assert eng.runner.draft_lengths == (0, eng.k) and eng.runner.lazy_ctx
    assert _traced_decode(plain, 0) == [("forward", 1, False)]
    assert _traced_decode(eng, 0) == [("forward", 1, True)]
    drafting = _traced_decode(eng, eng.k)
    assert ("propose",) in drafting and ("update_context",) in drafting


def test_plain_calls_do_not_redo_the_expected_verify_rows(monkeypatch):
    """Issue 23: with the sequential verify (CPU) every decision charged the verify rows expected at the rows'
    acceptance estimates, a 30-step bisection (``expected_extra_rows``) of ~0.45 ms host time a call at 8 rows --
    paid by every plain call too (choose 483 -> 21 us, demo, CPU). Only a drafting call's verifications move the
    estimates, so a run of plain calls computes it once; a drafting call's results compute it again."""
    import types

    import dsflash.serve.engine.adaptive as A
    calls = []
    real = A.expected_extra_rows
    monkeypatch.setattr(A, "expected_extra_rows", lambda d, acc: calls.append(tuple(acc)) or real(d, acc))
    pol = SpeculationPolicy(5, "adaptive", sequential_verify=True)
    seqs = [types.SimpleNamespace(request_id=str(i)) for i in range(8)]
    for _ in range(pol.probe_calls + 1):     # the start-up probes: drafting 4x plain, half a draft accepted
        pol.observe(5, 0.032, 4, [(s, 4, 2) for s in seqs], 6, 4)
        pol.observe(0, 0.008, 4, [], None, 4)
    calls.clear()
    for _ in range(20):
        assert pol.choose(seqs) == 0
        pol.observe(0, 0.008, 4, [], None, 4)
    assert len(calls) == 1 and all(x > 0 for x in calls[0])
    pol.observe(5, 0.032, 4, [(s, 4, 4) for s in seqs], 8, 4)     # a drafting call: the estimates move
    pol.choose(seqs)
    assert len(calls) == 2 and calls[1] != calls[0]
    assert pol._extra_rows(calls[1]) == real(5, calls[1])


def _bisection_extra_rows(draft_len, accepted):
    """``expected_extra_rows`` as it was before session 29 (a numpy bisection over every row): the reference."""
    a = np.clip(np.asarray([x for x in accepted if x > 0], np.float64), 0.0, draft_len)
    if not draft_len or not a.size:
        return 0.0
    if a.size == 1:
        return float(a[0])
    j = np.arange(1, draft_len + 1)
    lo, hi = np.zeros_like(a), np.ones_like(a)
    for _ in range(30):
        mid = (lo + hi) / 2
        big = (mid[:, None] ** j).sum(1) > a
        hi, lo = np.where(big, mid, hi), np.where(big, lo, mid)
    r = (lo + hi) / 2
    return float((1.0 - np.prod(1.0 - r[:, None] ** j, axis=0)).sum())


def test_the_expected_verify_rows_solve_each_estimate_once():
    """Issue 23, session 29: a batch whose rows change (a prompt joins, a request finishes) changed the estimates'
    tuple, and each change redid a numpy bisection over every row (~0.5-0.8 ms host time at 8 rows, demo, CPU, twice
    a pass of the bench) although the rows' estimates were mostly the same values (new requests start at the
    engine-wide mean). Each distinct estimate is solved once now; the answer is the bisection's."""
    import dsflash.serve.engine.adaptive as A
    rng = np.random.default_rng(0)
    for n in (2, 3, 8, 32):
        for _ in range(5):
            acc = list(rng.uniform(0.0, 5.5, size=n)) + [0.0]
            assert A.expected_extra_rows(5, acc) == pytest.approx(_bisection_extra_rows(5, acc), rel=1e-12, abs=1e-12)
    A._geometric_ratio.cache_clear()
    A.expected_extra_rows(5, [0.8] * 8)
    assert A._geometric_ratio.cache_info().misses == 1              # eight rows, one estimate: one solve
    A.expected_extra_rows(5, [0.8] * 7 + [0.55])                     # a row joins at another estimate
    A.expected_extra_rows(5, [0.8] * 6 + [0.55])                     # and one leaves
    assert A._geometric_ratio.cache_info().misses == 2


def test_a_plain_decision_does_not_refit_the_row_cost():
    """Every decision reads the drafting cost's per-row slope (``IterationCost.row_ratio``, a fit over the samples);
    only a sample changes it, so it is kept until the next one."""
    from dsflash.serve.engine.adaptive import IterationCost
    c = IterationCost(0.3, row_prior=0.5)
    c.observe(0.04, 4, ref=0.01, extra_rows=4)
    c.observe(0.05, 4, ref=0.01, extra_rows=8)
    first = c.row_ratio
    fits = []
    real = c._fitted_row_ratio
    c._fitted_row_ratio = lambda: fits.append(1) or real()
    for _ in range(10):
        assert c.row_ratio == first and c.at(1.0) == c.ratio + first
    assert not fits
    c.observe(0.06, 4, ref=0.01, extra_rows=12)
    assert c.row_ratio != first and len(fits) == 1


def test_the_kernels_line_names_the_plain_programs_rows(monkeypatch):
    """The start-up line's ``decode=`` is the decode program at ``max_num_seqs * (block + 1)`` rows; an adaptive
    engine's plain calls run ``max_num_seqs`` rows, where a kernel's gate may pick another implementation (H100,
    demo, batch 8: the line said indexer triton / MoE sw_il_bm32 where those calls run XLA's indexer and sw_il, as the
    plain engine's line says; read as what they run, it suggested they ran the verify-width program). The line
    names the plain program's rows and what it runs differently. A gate at 16 rows stands in for a GPU's."""
    import types

    import dsflash.kernels.dispatch as D
    from dsflash.config import preset
    monkeypatch.setattr(D, "use_triton",
                        lambda kernel, backend, size, **kw: kernel == "sparse_attention" and size >= 16)

    def line(K1, lengths):
        fake = types.SimpleNamespace(
            run_options={"backend": "xla", "precision": "reference", "bounded_replay": None},
            backend=types.SimpleNamespace(cfg=preset("tiny")),
            config=types.SimpleNamespace(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=128),
            runner=types.SimpleNamespace(K1=K1, k=K1 - 1, draft_lengths=lengths))
        fake._plain_program_kernels = types.MethodType(LLMEngine._plain_program_kernels, fake)
        return LLMEngine.kernels_line.fget(fake)
    adaptive = line(4, (0, 3))
    assert "sparse_attention decode=triton" in adaptive
    assert adaptive.endswith("draft length 3 (32 rows); draft length 0 (8 rows): sparse_attention decode=xla")
    assert "draft length 0" not in line(4, (3,))            # always drafting: one decode program
    assert "draft length 0" not in line(1, (0,))            # plain


# ------------------------------------------------------------------ tap-free plain calls (runner.TAP_FREE)
def _plain_policy(block=5, reprobe_every=6, lead=4):
    """A policy that measured both programs and finds drafting 50x plain: only the engine-wide reprobe drafts."""
    pol = SpeculationPolicy(block, "adaptive", reprobe_every=reprobe_every, remeasure_every=10**6)
    for c in pol.costs.values():
        c.seconds, c.samples, c.alpha = 1e-3, pol.probe_calls, 0.0
    pol.costs[block].ratio = 50.0
    return pol


def test_tap_free_only_in_a_long_plain_stretch_and_not_within_lead_calls_of_a_scheduled_probe():
    """The policy allows the tap-free program once it has been plain for ``lead`` calls and no drafting call it
    schedules (here the engine-wide reprobe, every 6 x back-off calls) is due within ``lead`` calls: the last
    ``lead`` plain calls before every probe record."""
    pol, s, lead, seq = _plain_policy(), _Seq("a"), 4, []
    for _ in range(60):
        d = pol.choose([s])
        seq.append("D" if d else ("f" if pol.tap_free([s], lead) else "r"))
        pol.observe(d, 1e-3 * 4, 4, [(s, 4, 0)] if d else [])
    text = "".join(seq)
    # probes at 6, then (back-off 2) 12 calls later, then 24 later: tap-free only where the probe is > lead away
    assert text == "rrrrrr" + "D" + "rrrr" + "f" * 4 + "rrrr" + "D" + "rrrr" + "f" * 16 + "rrrr" + "D" + "rrrr" + \
        "f" * 11, text


def test_a_drafting_decision_waits_for_the_draft_context_and_a_due_probe_stays_due():
    """After tap-free calls a drafting call would catch the draft context up from a ring missing positions: the
    decision is deferred (plain, recorded) until the engine says the context is complete, and a due probe stays due
    (no back-off, no reset of its interval)."""
    pol, s = _plain_policy(), _Seq("a")
    for _ in range(6):
        pol.observe(pol.choose([s]), 4e-3, 4)
    backoff = pol.backoff
    for _ in range(3):                      # the reprobe is due, the context is not ready: plain, still due
        assert pol.choose([s], draft_ready=False) == 0 and not pol.tap_free([s], 4)
        pol.observe(0, 4e-3, 4)
    assert pol.deferred_drafting_calls == 3 and pol.backoff == backoff
    assert pol.choose([s], draft_ready=True) == pol.block
    assert pol.metrics()["spec_deferred_drafting_calls"] == 3


def test_the_tap_free_program_records_no_taps():
    """The third decode program: the plain one's forward (one row per sequence) without taps."""
    import functools

    import jax
    from dsflash.serve.engine.runner import TAP_FREE
    eng = LLMEngine(RecordingToy(), **COMMON)
    r, be = eng.runner, eng.backend
    assert r.tap_free and set(r._decodes) == {0, eng.k, TAP_FREE} and ("decode", TAP_FREE) in r._compiled
    be.log = []
    try:
        jax.jit(functools.partial(r._decode_impl, drafting=False, record=False)).lower(
            r.params, r.state, r.rows, r.place(r.empty_decode_inputs()))
        assert be.log == [("forward", 1, False)]
    finally:
        be.log = None
    assert not LLMEngine(RecordingToy(), tap_free_plain=False, **COMMON).runner.tap_free
    assert not LLMEngine(RecordingToy(), speculative_mode="always", **COMMON).runner.tap_free


def _ring_run(tap_free):
    """The toy (its drafts read the draft context) with a policy plain by cost (drafting only at the engine-wide
    reprobe): per decode call its program, and at every drafting call each active row's (pos, ctx_pos, the ring
    entries the catch-up reads)."""
    import jax
    eng = LLMEngine(ToyBackend(), tap_free_plain=tap_free, **dict(COMMON, max_model_len=160))
    eng.speculation = pol = _plain_policy(eng.k)
    pol.sequential_verify = eng.runner.sequential_verify
    r, calls, seen = eng.runner, [], []
    decode, W = r.decode, r.tap_window

    def traced(inp, draft_len=None):
        calls.append(draft_len)
        if draft_len and draft_len > 0:
            rows = jax.device_get(r.rows)
            act = np.asarray(rows["active"]) & ~np.asarray(inp["deactivate"])
            snap = {}
            for i in np.flatnonzero(act):
                p, cp = int(rows["pos"][i]), int(rows["ctx_pos"][i])
                q = range(max(cp, p - W) + 1, p + 1)
                snap[int(i)] = (p, cp, np.stack([rows["taps"][i, x % W] for x in q]) if len(q) else None)
            seen.append(snap)
        return decode(inp, draft_len)

    r.decode = traced
    return eng, pol, calls, seen, _ring_requests(eng)


def _ring_requests(eng):
    """_ring_run's three greedy requests run to the end on ``eng``: their token ids by request id."""
    for i in range(3):
        p = [int(x) for x in np.random.default_rng(i).integers(2, 63, size=5 + 3 * i)]
        eng.add_request(f"t{i}", p, SamplingParams(max_tokens=90 - 10 * i, temperature=0.0, ignore_eos=True))
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


def test_after_a_tap_free_stretch_a_drafting_call_reads_the_ring_an_always_recording_engine_would():
    """Long plain stretches run the tap-free program, the last ceil(W / decode_steps) calls before each scheduled
    probe record again, and every drafting call's catch-up reads exactly the ring entries (and positions) it reads
    in an engine that recorded every plain call: same drafts, same acceptance, plain decoding's output."""
    from dsflash.serve.engine.runner import TAP_FREE
    eng, pol, calls, seen, out = _ring_run(True)
    ref_eng, _, ref_calls, ref_seen, ref_out = _ring_run(False)
    lead = eng._tap_lead
    assert lead == 4 and TAP_FREE in calls and TAP_FREE not in ref_calls
    assert pol.tap_free_calls == calls.count(TAP_FREE) >= 10 and pol.deferred_drafting_calls == 0
    drafting = [i for i, d in enumerate(calls) if d and d > 0]
    assert drafting == [i for i, d in enumerate(ref_calls) if d and d > 0] and len(drafting) >= 2
    assert [max(d, 0) if d is not None else d for d in calls] == ref_calls
    for i in drafting:                # tap-free calls end lead calls before a drafting call
        if TAP_FREE in calls[:i]:
            assert calls[i - lead:i] == [0] * lead, calls[i - lead - 2:i + 1]
    assert len(seen) == len(ref_seen)
    for a, b in zip(seen, ref_seen):
        assert a.keys() == b.keys()
        for slot in a:
            assert a[slot][:2] == b[slot][:2]
            if a[slot][2] is not None:
                np.testing.assert_array_equal(a[slot][2], b[slot][2])
    assert out == ref_out
    m, ref_m = eng.metrics_snapshot(), ref_eng.metrics_snapshot()
    assert (m["spec_num_drafts"], m["spec_num_accepted_tokens"]) == \
        (ref_m["spec_num_drafts"], ref_m["spec_num_accepted_tokens"]) and m["spec_num_accepted_tokens"] > 0
    assert m["compiles_after_warmup"] == 0
    assert out == _ring_requests(LLMEngine(ToyBackend(), speculative_mode="off", **dict(COMMON, max_model_len=160)))


def test_a_drafting_decision_after_tap_free_calls_is_deferred_until_the_ring_is_refilled():
    """A decision to draft the policy did not schedule (here: the costs turn) right after tap-free calls runs
    recording plain calls until every row recorded its last W positions, then drafts."""
    from dsflash.serve.engine.runner import TAP_FREE
    eng = LLMEngine(ToyBackend(), **dict(COMMON, max_model_len=160))
    eng.speculation = pol = _plain_policy(eng.k, reprobe_every=10**6)
    calls, decode = [], eng.runner.decode
    eng.runner.decode = lambda inp, draft_len=None: (calls.append(draft_len), decode(inp, draft_len))[1]
    for i in range(2):
        eng.add_request(f"t{i}", [3 + i, 7, 9, 11, 5], SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True))
    while calls.count(TAP_FREE) < 6:
        eng.step()
    pol.costs[eng.k].ratio = 1.0         # drafting now pays
    n = len(calls)
    for _ in range(eng._tap_lead + 1):
        eng.step()
    assert calls[n:] == [0] * eng._tap_lead + [eng.k] and pol.deferred_drafting_calls == eng._tap_lead
