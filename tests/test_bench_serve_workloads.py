"""Workload generators of ``bench serve``, driven by a fake lane context (no HTTP): fixed lengths,
AgentX-like prefix growth per turn, subagent fan-out and join, cache-busting markers, warm-up."""
from __future__ import annotations

import asyncio
import re

import pytest

from dsflash.bench.workloads import (
    WORDS, AgentXConfig, AgentXWorkload, FixedConfig, FixedWorkload, StopLane, cache_bust_marker,
    estimate_tokens)


class FakeLane:
    """Answers every request with ``max_tokens`` words at once; stops after ``limit`` requests."""

    def __init__(self, lane: int, limit: int, fail_every: int = 0):
        self.lane, self.limit, self.fail_every = lane, limit, fail_every
        self.sent = []          # (spec, phase) in send order
        self.thinks = []
        self.warm_calls = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def send(self, spec):
        if len(self.sent) >= self.limit:
            raise StopLane()
        self.sent.append((spec, "warm" if self.warm_calls == 0 else "profile"))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        self.in_flight -= 1
        if self.fail_every and len(self.sent) % self.fail_every == 0:
            return None
        return " ".join(f"g{i}" for i in range(spec.max_tokens))

    async def think(self, seconds):
        self.thinks.append(seconds)

    async def warmup_done(self):
        self.warm_calls += 1


def drive(workload, lane=0, limit=200, **kw) -> FakeLane:
    ctx = FakeLane(lane, limit, **kw)

    async def go():
        try:
            await workload.run_lane(ctx)
        except StopLane:
            pass
    asyncio.run(go())
    return ctx


def small_agentx(**kw) -> AgentXConfig:
    base = dict(system_tokens=200, first_turn_tokens=100, turn_tokens=40, output_tokens=30, min_output_tokens=5,
                max_output_tokens=200, min_turns=10, max_turns=14, think_time=2.0, max_think_time=5.0,
                subagent_prob=0.4, max_fanout=3, subagent_task_tokens=50, subagent_result_tokens=20,
                max_context_tokens=8000, warmup_requests=2)
    base.update(kw)
    return AgentXConfig(**base)


def is_prefix(a: list[dict], b: list[dict]) -> bool:
    return len(a) < len(b) and b[:len(a)] == a


# --------------------------------------------------------------------------------- fixed lengths
def test_fixed_lengths_prefix_and_uniqueness():
    cfg = FixedConfig(input_len=300, output_len=50, range_ratio=0.2, prefix_len=100, warmup_requests=1)
    wl = FixedWorkload(cfg, seed=3, nonce="abc", endpoint="completions")
    specs = [wl.request(lane, i) for lane in range(3) for i in range(20)]
    ins = [s.est_prompt_tokens for s in specs]
    outs = [s.max_tokens for s in specs]
    assert all(240 <= n <= 360 for n in ins) and len(set(ins)) > 5        # uniform in 300 * (1 ± 0.2)
    assert all(40 <= n <= 60 for n in outs) and len(set(outs)) > 5
    texts = [s.prompt for s in specs]
    assert all(set(t.split()) <= set(WORDS) for t in texts)               # token-ish words only
    assert all(estimate_tokens(t) == n for t, n in zip(texts, ins))
    prefix = texts[0].split()[:100]
    assert all(t.split()[:100] == prefix for t in texts)                 # deliberate shared prefix
    assert len({tuple(t.split()[100:116]) for t in texts}) == len(texts)  # nothing else shared
    # same seed: same lengths; another nonce: other text (no stale cache hits across runs)
    other = FixedWorkload(cfg, seed=3, nonce="xyz", endpoint="completions")
    assert [other.request(0, i).max_tokens for i in range(20)] == outs[:20]
    assert other.request(0, 0).prompt != wl.request(0, 0).prompt
    assert wl.request(1, 5).prompt == wl.request(1, 5).prompt            # deterministic


def test_fixed_exact_lengths_and_token_ids():
    wl = FixedWorkload(FixedConfig(input_len=64, output_len=16), seed=0, endpoint="chat")
    s = wl.request(0, 0)
    assert s.max_tokens == 16 and estimate_tokens(s.messages[0]["content"]) == 64
    ids = FixedWorkload(FixedConfig(input_len=64, output_len=8, prompt_format="token-ids", vocab_size=500),
                        endpoint="completions").request(0, 0)
    assert len(ids.prompt) == 64 and all(10 <= t < 500 for t in ids.prompt)
    with pytest.raises(ValueError):
        FixedWorkload(FixedConfig(prompt_format="token-ids"), endpoint="chat")


def test_fixed_lane_warms_up_then_opens_window():
    ctx = drive(FixedWorkload(FixedConfig(input_len=8, output_len=4, warmup_requests=2)), limit=7)
    phases = [(s.warmup, ph) for s, ph in ctx.sent]
    assert phases[:2] == [(True, "warm")] * 2 and all(p == (False, "profile") for p in phases[2:])
    assert ctx.warm_calls == 1


# --------------------------------------------------------------------------------- AgentX-like
def test_agentx_plan_shape_is_seeded_and_bounded():
    cfg = small_agentx()
    wl = AgentXWorkload(cfg, seed=1)
    plans = [wl.plan(lane, rep) for lane in range(4) for rep in range(5)]
    assert all(10 <= len(p.turns) <= 14 or _context(p, cfg) > 8000 - 400 for p in plans)
    outs = [t.output_tokens for p in plans for t in p.turns]
    assert all(5 <= o <= 200 for o in outs) and 20 <= sorted(outs)[len(outs) // 2] <= 45   # lognormal around 30
    thinks = [t.think_s for p in plans for t in p.turns[1:]]
    assert all(0 <= x <= 5.0 for x in thinks) and 1.0 < sum(thinks) / len(thinks) < 3.0
    assert plans[0].turns[0].think_s == 0.0
    groups = [len(t.subagents) for p in plans for t in p.turns if t.subagents]
    assert groups and all(1 <= g <= 3 for g in groups) and max(groups) > 1
    assert wl.plan(2, 3) == AgentXWorkload(cfg, seed=1).plan(2, 3)          # seeded
    assert wl.plan(2, 3) != AgentXWorkload(cfg, seed=2).plan(2, 3)
    # the context bound holds even with long turns
    tight = small_agentx(turn_tokens=500, max_context_tokens=3000, min_turns=30, max_turns=30)
    for p in (AgentXWorkload(tight, seed=0).plan(0, r) for r in range(3)):
        assert 1 <= len(p.turns) < 30 and _context(p, tight) <= 3000
    # scale multiplies token lengths
    big = AgentXWorkload(small_agentx(scale=4.0), seed=1)
    assert big.plan(0, 0).turns[0].user_tokens == 400


def _context(plan, cfg):
    sys_ = cfg.scaled(cfg.system_tokens) + 4
    return sys_ + sum(t.user_tokens + 8 + t.output_tokens + sum(s.result_tokens for s in t.subagents)
                      for t in plan.turns)


def test_agentx_prefix_grows_per_turn_and_history_is_the_answer():
    cfg = small_agentx(subagent_prob=0.0, warmup_requests=0)
    wl = AgentXWorkload(cfg, seed=0, nonce="n1")
    ctx = drive(wl, limit=60)
    roots = [s for s, _ in ctx.sent if s.kind == "root"]
    by_session = {}
    for s in roots:
        by_session.setdefault(s.session_id, []).append(s)
    assert len(by_session) >= 2                           # the lane went on to a new replay
    for sid, specs in by_session.items():
        for prev, cur in zip(specs, specs[1:]):
            assert cur.turn == prev.turn + 1
            # the new prompt is the previous prompt + the previous answer + new user tokens
            assert is_prefix(prev.messages, cur.messages)
            assert len(cur.messages) == len(prev.messages) + 2
            assert cur.messages[len(prev.messages)] == {
                "role": "assistant", "content": " ".join(f"g{i}" for i in range(prev.max_tokens))}
            assert cur.est_prompt_tokens > prev.est_prompt_tokens + prev.max_tokens
    # think-time gaps between turns, none before the first
    assert len(ctx.thinks) > 0 and all(t >= 0 for t in ctx.thinks)


def test_agentx_synthetic_history_ignores_server_text():
    wl = AgentXWorkload(small_agentx(subagent_prob=0.0, history="synthetic"), seed=0)
    ctx = drive(wl, limit=8)
    roots = [s for s, _ in ctx.sent if s.kind == "root"]
    answer = roots[-1].messages[-2]
    assert answer["role"] == "assistant" and not answer["content"].startswith("g0")
    assert set(answer["content"].split()) <= set(WORDS)


def test_agentx_fanout_joins_before_root_continues():
    cfg = small_agentx(subagent_prob=1.0, max_fanout=3, subagent_min_turns=2, subagent_max_turns=3,
                       warmup_requests=0)
    wl = AgentXWorkload(cfg, seed=4, nonce="f")
    ctx = drive(wl, limit=80)
    sent = [s for s, _ in ctx.sent]
    subs = [s for s in sent if s.kind == "subagent"]
    assert subs and ctx.max_in_flight >= 2                 # subagents run concurrently
    system_of = {s.session_id: s.messages[0]["content"] for s in sent if s.kind == "root"}
    for s in subs:
        # a subagent starts from its root's system prompt (shared prefix, same marker) ...
        assert s.parent in system_of and s.messages[0]["content"] == system_of[s.parent]
        assert s.messages[0]["role"] == "system" and s.messages[1]["role"] == "user"
    # ... its turns grow its own conversation ...
    agents = {}
    for s in subs:
        agents.setdefault(s.session_id, []).append(s)
    assert any(len(v) >= 2 for v in agents.values())
    for v in agents.values():
        for a, b in zip(v, v[1:]):
            assert is_prefix(a.messages, b.messages)
    # ... and the root's next turn comes after all of the group's requests, carrying their results
    idx = {id(s): i for i, s in enumerate(sent)}
    plan = wl.plan(0, 0)
    start = wl.warmup_start(plan)
    root0 = [s for s in sent if s.kind == "root" and s.session_id == "s0.0"]
    first, second = root0[0], root0[1]
    group = [s for s in subs if s.session_id.startswith(f"s0.0.t{first.turn}.")]
    assert len({s.session_id for s in group}) == len(plan.turns[start].subagents)
    assert all(idx[id(first)] < idx[id(s)] < idx[id(second)] for s in group)
    assert second.messages[-1]["content"].count("[subagent ") == len(plan.turns[start].subagents)


def test_agentx_cache_bust_marker_per_replay():
    wl = AgentXWorkload(small_agentx(min_turns=3, max_turns=3, subagent_prob=0.5, warmup_requests=0),
                        seed=0, nonce="R7")
    markers = {}
    for lane in range(3):
        ctx = drive(wl, lane=lane, limit=40)
        for s, _ in ctx.sent:
            sys_msg = s.messages[0]["content"]
            m = re.match(r"\[replay R7-(\d+)-(\d+)\] ", sys_msg)
            assert m, sys_msg[:40]                          # the marker comes first
            assert int(m.group(1)) == lane
            root_sid = s.parent or s.session_id
            markers.setdefault(root_sid, set()).add(m.group(0))
            assert sys_msg[m.end():] == wl.system_text     # the rest of the system prompt is shared
    assert all(len(v) == 1 for v in markers.values())       # one marker per session tree (root + subagents)
    flat = [next(iter(v)) for v in markers.values()]
    assert len(flat) == len(set(flat)) >= 6                 # and a different one for every replay
    assert cache_bust_marker("R7", 1, 2) == "[replay R7-1-2]"
    # another run (nonce) replays the same shapes under new markers
    wl2 = AgentXWorkload(small_agentx(min_turns=3, max_turns=3, subagent_prob=0.5), seed=0, nonce="Q1")
    assert wl2.plan(0, 0) == wl.plan(0, 0)


def test_agentx_warmup_from_mid_session_with_primer():
    cfg = small_agentx(subagent_prob=0.0, warmup_requests=3, min_turns=20, max_turns=20)
    wl = AgentXWorkload(cfg, seed=9)
    starts = []
    for lane in range(8):
        plan = wl.plan(lane, 0)
        start = wl.warmup_start(plan)
        n = len(plan.turns)
        assert 0.25 * n - 1 <= start <= 0.75 * n
        starts.append(start)
        ctx = drive(wl, lane=lane, limit=10)
        sent = ctx.sent
        # a 1-token primer with the full context at the start turn, then the same turn for real
        primer, first = sent[0][0], sent[1][0]
        assert primer.kind == "primer" and primer.max_tokens == 1 and primer.warmup
        assert primer.turn == start and first.turn == start and first.messages == primer.messages
        # the history before the start point is already there (synthetic), so the prompt is long
        assert len(first.messages) == 2 + 2 * start
        warm = [s for s, _ in sent if s.warmup]
        assert [s.kind for s in warm] == ["primer"] + ["root"] * 3
        assert all(ph == "warm" for s, ph in sent if s.warmup)
        assert all(ph == "profile" and not s.warmup for s, ph in sent[4:])
        assert ctx.warm_calls == 1
    assert len(set(starts)) > 2                              # seeded per lane


def test_agentx_failed_request_keeps_session_going():
    wl = AgentXWorkload(small_agentx(subagent_prob=0.0, warmup_requests=0), seed=0)
    ctx = drive(wl, limit=12, fail_every=3)
    roots = [s for s, _ in ctx.sent if s.kind == "root"]
    assert len(roots) >= 10
    for a, b in zip(roots, roots[1:]):
        if a.session_id == b.session_id:
            assert is_prefix(a.messages, b.messages)


def test_config_validation():
    with pytest.raises(ValueError):
        AgentXConfig(max_fanout=11).validate()
    with pytest.raises(ValueError):
        AgentXConfig(max_context_tokens=100).validate()
    with pytest.raises(ValueError):
        FixedConfig(range_ratio=1.0).validate()


def test_tokens_per_word_calibration_scales_word_counts():
    # a server tokenizer that makes 2 tokens of every word: half the words for the same token lengths
    wl = FixedWorkload(FixedConfig(input_len=200, output_len=8), seed=0, endpoint="completions", tokens_per_word=2.0)
    s = wl.request(0, 0)
    assert len(s.prompt.split()) == 100 and s.est_prompt_tokens == 200 and s.max_tokens == 8
    ax1 = AgentXWorkload(small_agentx(), seed=0)
    ax2 = AgentXWorkload(small_agentx(), seed=0, tokens_per_word=2.0)
    assert len(ax2.system_text.split()) == len(ax1.system_text.split()) // 2
    assert ax2.plan(0, 0) == ax1.plan(0, 0)            # plans stay in tokens
    first = [s for s, _ in drive(ax2, limit=2).sent][1]
    assert abs(first.est_prompt_tokens - [s for s, _ in drive(ax1, limit=2).sent][1].est_prompt_tokens) < 40


def test_scale_multiplies_inputs_not_outputs():
    a = AgentXWorkload(small_agentx(), seed=5).plan(1, 0)
    b = AgentXWorkload(small_agentx(scale=0.5), seed=5).plan(1, 0)
    assert b.turns[0].user_tokens == 50 and a.turns[0].user_tokens == 100
    n = min(len(a.turns), len(b.turns))
    assert [t.output_tokens for t in a.turns[:n]] == [t.output_tokens for t in b.turns[:n]]


def test_prompt_fitter_exact_counts_with_the_demo_tokenizer():
    from pathlib import Path

    import numpy as np

    from dsflash.bench.workloads import FixedConfig, FixedWorkload, PromptFitter
    tok_dir = Path(__file__).resolve().parents[1] / "dsflash" / "assets" / "demo"
    if not (tok_dir / "tokenizer.json").is_file():
        pytest.skip("no demo tokenizer in this checkout")
    from dsflash.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(tok_dir)
    f = PromptFitter(tok)
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 64, 333):
        text = f.fit(rng, n)
        assert len(tok.encode(text)) == n
        longer = f.fit(rng, n + 25, lead=text)        # a lead (shared prefix) is kept verbatim
        assert longer.startswith(text + " ") and len(tok.encode(longer)) == n + 25
    with pytest.raises(ValueError):
        f.fit(rng, 3, lead=f.fit(rng, 10))
    # the fixed workload: every prompt is input_len - overhead tokens of text, prefix shared
    wl = FixedWorkload(FixedConfig(input_len=50, output_len=4, range_ratio=0.4, prefix_len=9), fitter=f,
                       prompt_overhead=4)
    assert wl.exact_lengths
    for i in range(6):
        spec = wl.request(0, i)
        n_in = wl.lengths(0, i)[0]
        assert spec.est_prompt_tokens == n_in
        assert len(tok.encode(spec.messages[0]["content"])) == n_in - 4
        assert spec.messages[0]["content"].startswith(wl.prefix_text + " ")
